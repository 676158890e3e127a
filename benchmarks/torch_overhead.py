"""Host cost of the torch adapter per eager call, kernel launches excluded (a timing script, not a test).

    PYTHONPATH=.:.pypath python benchmarks/torch_overhead.py [--calls 20000]

Every public function runs on sanitize.py's small cases with Triton's
``run`` replaced by a no-op.  Two columns, median CPU µs per call:

* ``binding_us``: the public call, the plan lookup, the checks, allocations,
  the executor and Triton's ``kernel[grid](...)`` argument passing (``run``
  itself stubbed out);
* ``adapter_us``: the same with the adapter's one launch call site
  (``qsa_torch._launch.launch_kernel``) stubbed out: what the adapter alone
  costs, which no faster launcher can remove.

Runs on the CPU (interpreter) and on the GPU (compiled; there the allocations
are CUDA ones).
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
    print(f"{'function':26s} {'launches':>8s} {'binding_us':>10s} {'adapter_us':>10s}")
    for case in CASES:
        index = next(i for i, (name, _, _) in enumerate(sanitize.CASES) if name == case)
        function, arrays, static, _ = sanitize.CASES[index][2](np.random.default_rng(index), True)
        static.pop("_logits_workspace_bytes", None)
        tensors = {n: (None if a is None else runner.put(a)) for n, a in arrays.items()}
        fn = getattr(qsa_torch, function)
        fn(**tensors, **static)
        launches = len(fn.plan(**tensors, **static).runnable_launches)
        columns = []
        for stub in (False, True):
            if stub and not hasattr(_launch, "launch_kernel"):
                columns.append(float("nan"))
                continue
            real = getattr(_launch, "launch_kernel", None)
            if stub:
                _launch.launch_kernel = lambda launch, inputs, outputs: outputs
            times = []
            for _ in range(args.repeats):
                start = time.process_time()  # CPU time: robust to a shared machine
                for _ in range(args.calls):
                    fn(**tensors, **static)
                times.append((time.process_time() - start) / args.calls * 1e6)
            if stub:
                _launch.launch_kernel = real
            columns.append(statistics.median(times))
        print(f"{function:26s} {launches:8d} {columns[0]:10.2f} {columns[1]:10.2f}")


if __name__ == "__main__":
    main()
