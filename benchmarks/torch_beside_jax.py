"""The eager torch step's host time with and without JAX in the process (a measuring script).

    python benchmarks/torch_beside_jax.py [--batch 1] [--context 131072] [--json PATH]

One process, the composed decode step at production geometry (``bench_step.py``'s
shape), its eager torch call timed in phases, each a little more of JAX brought up
in the process: none, ``import jax``, its GPU client (``jax.devices()``), one
computation run, then ``gc.freeze()``.  Per phase: ``torch_wall_us``
(``common.torch_wall_us``: 100 calls, the final synchronize included, median of
5; four times), ``host_us`` (``profile_host.wall_us``: 100 calls, no
synchronize in the timed loop, least of 5; four times) and the step's CUDA
graph (``common.torch_graph_us``).  ``bench_step.py`` times every torch column
before JAX comes up because of what this shows.
"""

from __future__ import annotations

import argparse
import gc
import json

import common  # noqa: F401  (puts the checkout on sys.path)
import bench_step
import profile_host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("torch_beside_jax.py needs a CUDA device")
    shape = bench_step.Shape(bench_step.PRODUCTION, args.batch, args.context, torch.device("cuda"))
    step = shape.torch_step
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    phases: dict = {}

    def phase(name: str) -> None:
        phases[name] = dict(torch_wall_us=[round(common.torch_wall_us(step), 1) for _ in range(4)],
                            host_us=[round(profile_host.wall_us(step, 100), 1) for _ in range(4)],
                            graph_us=round(common.torch_graph_us(step, calls=10), 1))
        print(name, phases[name], flush=True)

    phase("no_jax")
    phase("no_jax_again")
    import jax

    phase("jax_imported")
    jax.devices()
    phase("jax_client")
    import jax.numpy as jnp

    (jnp.ones((1024,)) + 1).block_until_ready()
    phase("jax_ran")
    gc.collect()
    gc.freeze()
    phase("gc_frozen")
    if args.json:
        result = dict(batch=args.batch, context=args.context, torch=torch.__version__, jax=jax.__version__,
                      gpu=torch.cuda.get_device_name(), phases=phases)
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
