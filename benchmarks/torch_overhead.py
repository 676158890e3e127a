"""Host cost of the torch adapter per eager call, kernel launches excluded (a timing script, not a test).

    PYTHONPATH=.:.pypath python benchmarks/torch_overhead.py [--calls 20000]

Every public function runs on sanitize.py's small cases with Triton's
``run`` replaced by a no-op, so what is timed is the public call, the
plan lookup, the checks, allocations and the executor: what the adapter adds
on top of the launches.  Prints median µs per call over a few repeats.
Runs on the CPU (interpreter) and on the GPU (compiled): on the GPU the
allocations are CUDA ones and ``launch_kernel`` is what is stubbed out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import sanitize  # noqa: E402

CASES = ("rope_paged_fp16_gptj", "compress_decode_fp32_d96", "store_int64_w3_rows3d_slots32", "scores_decode_bf16",
         "topk_decode_ties", "expand", "select_decode", "attention_decode_split_k")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    import triton

    import qsa_torch
    from qsa_torch import _launch

    # No kernel runs: stub out the launch itself (the interpreter's or the compiled kernel's).
    from qsa_kernels import runtime
    if runtime.INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction
        InterpretedFunction.run = lambda self, *a, **k: None
    else:
        triton.runtime.jit.JITFunction.run = lambda self, *a, **k: None
    runner = sanitize.TorchRunner.__new__(sanitize.TorchRunner)
    runner.torch, runner.device = torch, torch.device("cpu" if runtime.INTERPRETED else "cuda")
    print(f"{'function':26s} {'launches':>8s} {'us/call':>9s}")
    for case in CASES:
        index = next(i for i, (name, _, _) in enumerate(sanitize.CASES) if name == case)
        function, arrays, static, _ = sanitize.CASES[index][2](np.random.default_rng(index), True)
        static.pop("_logits_workspace_bytes", None)
        tensors = {n: (None if a is None else runner.put(a)) for n, a in arrays.items()}
        fn = getattr(qsa_torch, function)
        fn(**tensors, **static)
        plan = getattr(sys.modules[fn.__module__], "plan_" + function)
        arrays_only, options = _launch.split_arguments(plan, dict(tensors, **static))
        launches = len(plan(**_launch.metadata(function, arrays_only), **options).runnable_launches)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.calls):
                fn(**tensors, **static)
            times.append((time.perf_counter() - start) / args.calls * 1e6)
        print(f"{function:26s} {launches:8d} {statistics.median(times):9.2f}")


if __name__ == "__main__":
    main()
