"""What each launch of the jitted decode step carries to jaxlib: lowered for CUDA on a CPU, at production shapes.

    TRITON_INTERPRET=0 python scripts/jax_payload.py [--batches 1 8] [--context 131072] [--dump DIR] [--json PATH]

Needs what ``scripts/check_jax_lowering.py`` needs (jax-triton, jaxlib's CUDA
plugin on PYTHONPATH; no GPU, no torch).  Traces the step of
``benchmarks/bench_step.py`` (production geometry) once per PTX form
(``qsa_jax._lowering.ptx_form``: ``"full"``, Triton's PTX as is, and
``"minified"``) with the FFI lowering, and prints per launch: the kernel, its
grid and parameter count, the PTX text's bytes, the call proto's bytes and the
compressed payload's (what jaxlib copies and hashes: see docs/design.md, "JAX
call overhead").  ``--dump DIR`` writes each launch's PTX in both forms
(``<batch>-<n>-<kernel>.<form>.ptx``) for ``tests/test_jax_lowering.py``'s
SASS comparison or by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import zlib

if os.environ.get("TRITON_INTERPRET") != "0":
    sys.exit("run with TRITON_INTERPRET=0: the launches must be compiled, not interpreted")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib.gpu_triton as gpu_triton  # noqa: E402
from jax.extend.mlir import ir  # noqa: E402

if not hasattr(gpu_triton, "TritonKernel"):
    sys.exit("jaxlib's CUDA plugin is not importable (jaxlib.gpu_triton has no TritonKernel): see "
             "scripts/check_jax_lowering.py")
gpu_triton.get_compute_capability = lambda device: 90  # no GPU to ask: the H200's sm_90

import qsa_jax  # noqa: E402
from qsa_jax import _lowering as tc  # noqa: E402
from qsa_kernels.paging import CacheGeometry, PagedRequests  # noqa: E402

S = jax.ShapeDtypeStruct
# benchmarks/bench_step.py's PRODUCTION geometry
QH, KH, D, IH, DI, PAGE, RATIO, CPAGE, TOKEN_TOPK = 24, 2, 256, 4, 128, 64, 4, 64, 2048


def step_arguments(batch: int, context: int):
    """``(function, abstract arguments)`` of bench_step's decode step at ``batch`` x ``context``."""
    geometry = CacheGeometry(
        page_size=PAGE, num_pages=batch * -(-context // PAGE), compress_ratio=RATIO, compressed_page_size=CPAGE,
        num_compressed_pages=batch * -(-(context // RATIO) // CPAGE), max_context=context, max_requests=batch)
    pager = PagedRequests(geometry)
    for request in range(batch):
        pager.admit(request, context - 1)
    host = pager.step({request: 1 for request in range(batch)})
    meta = qsa_jax.StepMetadata.from_host(host)
    state = {name: S(shape, jnp.bfloat16) for name, shape in geometry.state_shapes(KH, D, DI).items()}

    def step(q, k, v, iq, ik, state, meta, cs, ics):
        return qsa_jax.qsa_attention_step(q, k, v, iq, ik, qsa_jax.QSAState(**state), meta, cs, ics,
                                          compress_ratio=RATIO, token_topk=TOKEN_TOPK)

    rows = host.num_rows
    arguments = (S((rows, QH, D), jnp.bfloat16), S((rows, KH, D), jnp.bfloat16), S((rows, KH, D), jnp.bfloat16),
                 S((rows, IH, DI), jnp.bfloat16), S((rows, 1, DI), jnp.bfloat16), state,
                 jax.tree.map(lambda a: S(a.shape, a.dtype), meta),
                 S((context, D), jnp.float32), S((context, DI), jnp.float32))
    return step, arguments


def launch_facts(op) -> dict:
    """One custom call's payload, decoded: sizes, kernel, grid, parameters and the PTX."""
    compressed = tc._proto.payload(op, ir)
    proto = zlib.decompress(compressed)
    top = {field: payload for field, _, _, payload in tc._proto._fields(proto)}
    call = list(tc._proto._fields(top[1]))
    kernel = dict((field, payload) for field, _, _, payload in tc._proto._fields(next(p for f, _, _, p in call if f == 1)))
    grid = [next((tc._proto._read_varint(entry, 1)[0] for f, _, entry, _ in call if f == n), 0) for n in (2, 3, 4)]
    ptx = kernel.get(4, b"")
    return dict(kernel=kernel.get(1, b"").decode(), grid=grid, parameters=sum(f == 5 for f, _, _, _ in call),
                ptx_bytes=len(ptx), proto_bytes=len(proto), payload_bytes=len(compressed),
                ttir=5 in kernel, ptx=ptx.decode())


def lower_step(batch: int, context: int, form: str) -> list[dict]:
    function, arguments = step_arguments(batch, context)
    with qsa_jax.use_triton_lowering("ffi"), tc.ptx_form(form):
        lowered = jax.jit(lambda *a: function(*a), donate_argnums=(5,)).trace(*arguments).lower(
            lowering_platforms=("cuda",))
    return [launch_facts(op) for op in tc._proto.custom_calls(lowered)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--dump", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    import jax_triton
    import triton

    print(f"jax {jax.__version__}, jaxlib {tc._versions()[1]}, jax-triton {jax_triton.__version__}, "
          f"triton {triton.__version__}; ffi lowering, sm_90")
    rows = []
    for batch in args.batches:
        forms = {form: lower_step(batch, args.context, form) for form in tc.PTX_FORMS}
        full, small = forms["full"], forms["minified"]
        assert [f["kernel"] for f in full] == [s["kernel"] for s in small]
        print(f"\n{batch} request(s) x {args.context}: {len(full)} launches")
        print(f"{'kernel':40} {'grid':>14} {'params':>6} | {'PTX full':>9} {'minified':>9} | "
              f"{'payload full':>12} {'minified':>9}")
        for n, (f, s) in enumerate(zip(full, small)):
            print(f"{f['kernel'][:40]:40} {'x'.join(map(str, f['grid'])):>14} {f['parameters']:>6} | "
                  f"{f['ptx_bytes']:>9} {s['ptx_bytes']:>9} | {f['payload_bytes']:>12} {s['payload_bytes']:>9}")
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                for form, facts in (("full", f), ("minified", s)):
                    (args.dump / f"{batch}-{n}-{f['kernel']}.{form}.ptx").write_text(facts["ptx"])
            rows.append(dict(batch=batch, context=args.context, launch=n, kernel=f["kernel"], grid=f["grid"],
                             parameters=f["parameters"],
                             **{f"{key}_{form}": facts[key] for form, facts in (("full", f), ("minified", s))
                                for key in ("ptx_bytes", "proto_bytes", "payload_bytes")}))
        total = lambda launches, key: sum(x[key] for x in launches)  # noqa: E731
        print(f"{'per step':40} {'':>14} {'':>6} | {total(full, 'ptx_bytes'):>9} {total(small, 'ptx_bytes'):>9} | "
              f"{total(full, 'payload_bytes'):>12} {total(small, 'payload_bytes'):>9}")
    if args.json:
        args.json.write_text(json.dumps(dict(
            jax=jax.__version__, jaxlib=tc._versions()[1], jax_triton=jax_triton.__version__,
            triton=triton.__version__, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
