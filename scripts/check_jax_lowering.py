"""Lower qsa_jax launches for CUDA on a machine without a GPU, with every lowering, and check them.

    TRITON_INTERPRET=0 python scripts/check_jax_lowering.py [--functions rope,topk,step]

Needs jax-triton and jaxlib's CUDA plugin (``jax-cuda13-plugin``: its
``_triton`` module imports without a GPU; ``pip download --no-deps`` it and put
the unpacked wheel on PYTHONPATH); no CUDA device, no torch.  The compute
capability is taken as the H200's (sm_90).  Each function is traced afresh per
lowering (``"ffi"``, ``"legacy"``, ``"jax-triton"``) and lowered to StableHLO;
its custom calls are decoded (target, aliases, the call proto) and checked:

* the target is the lowering's (``"jax-triton"``: jax-triton's own, 0.3.x the
  legacy call, 0.4.x the FFI call), in-place outputs keep their aliases;
* the package's lowerings carry no TTIR, jax-triton's carries it;
* every lowering launches the same kernel with the same grid, warps, shared
  memory and parameters (the call proto minus the PTX text and the name);
* with jax-triton 0.4, the direct bind (qsa_jax._lowering._bind_04) gives
  jax-triton's primitive the parameters its own ``triton_call`` gives a launch
  without aliases.

Exits non-zero on a failed check.  What it cannot show: that the kernels run
(no GPU), nor the PTX of a lowering traced after another compiled the same
kernel (jax-triton caches compiled kernels per process, line info or not).
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib

if os.environ.get("TRITON_INTERPRET") != "0":
    sys.exit("run with TRITON_INTERPRET=0: the launches must be compiled, not interpreted")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib.gpu_triton as gpu_triton  # noqa: E402
from jax.extend.mlir import ir  # noqa: E402

if not hasattr(gpu_triton, "TritonKernel"):
    sys.exit("jaxlib's CUDA plugin is not importable (jaxlib.gpu_triton has no TritonKernel): see the docstring")
gpu_triton.get_compute_capability = lambda device: 90  # no GPU to ask: the H200's sm_90

import qsa_jax  # noqa: E402
from qsa_jax import _lowering as tc  # noqa: E402
from qsa_kernels.paging import CacheGeometry, PagedRequests  # noqa: E402

S = jax.ShapeDtypeStruct
LOWERINGS = ("ffi", "legacy", "jax-triton")


def functions() -> dict:
    """name: (function, abstract arguments, donated argument numbers)."""
    T, QH, KH, D, P = 4, 8, 2, 64, 16
    rope = (lambda q, k, v, kc, vc, slots, pos, cs: qsa_jax.rope_reshape_and_cache(
        q, k, v, kc, vc, slots, pos, cs, is_neox=True),
        (S((T, QH, D), jnp.bfloat16), S((T, KH, D), jnp.bfloat16), S((T, KH, D), jnp.bfloat16),
         S((8, P, KH, D), jnp.bfloat16), S((8, P, KH, D), jnp.bfloat16), S((T,), jnp.int32),
         S((T,), jnp.int32), S((128, D), jnp.float32)), (3, 4))
    topk = (lambda logits, visible: qsa_jax.topk_blocks(logits, visible, 4),
            (S((2, 16), jnp.float32), S((2,), jnp.int32)), ())
    geometry = CacheGeometry(page_size=16, num_pages=32, compress_ratio=4, compressed_page_size=16,
                             num_compressed_pages=8, max_context=256, max_requests=4)
    pager = PagedRequests(geometry)
    pager.step({"a": 24, "b": 5})
    host = pager.step({"a": 1, "b": 1})
    state = qsa_jax.QSAState.zeros(geometry, kv_heads=1, head_dim=64, index_head_dim=32, dtype=jnp.bfloat16)
    meta = qsa_jax.StepMetadata.from_host(host)
    rows = host.num_rows

    def abstract(tree):
        return jax.tree.map(lambda a: S(a.shape, a.dtype), tree)

    step = (lambda q, k, v, iq, ik, state, meta, cs, ics: qsa_jax.qsa_attention_step(
        q, k, v, iq, ik, state, meta, cs, ics, compress_ratio=4, token_topk=8),
        (S((rows, 4, 64), jnp.bfloat16), S((rows, 1, 64), jnp.bfloat16), S((rows, 1, 64), jnp.bfloat16),
         S((rows, 2, 32), jnp.bfloat16), S((rows, 1, 32), jnp.bfloat16), abstract(state), abstract(meta),
         S((256, 64), jnp.float32), S((256, 32), jnp.float32)), (5,))
    return dict(rope=rope, topk=topk, step=step)


def decode(op) -> dict:
    """What one custom call launches: the proto's fields, the kernel's apart."""
    proto = zlib.decompress(tc._proto.payload(op, ir))
    top = {field: payload for field, _, _, payload in tc._proto._fields(proto)}
    call = list(tc._proto._fields(top[1]))
    kernel = next(payload for field, _, _, payload in call if field == 1)
    kernel_fields = list(tc._proto._fields(kernel))
    launch = b"".join(entry for field, _, entry, _ in call if field != 1)  # grid and parameters
    launch += b"".join(entry for field, kind, entry, _ in kernel_fields if field not in (4, 5))  # all but PTX, TTIR
    aliases = op.attributes["output_operand_aliases"] if "output_operand_aliases" in op.attributes else None
    return dict(target=ir.StringAttr(op.attributes["call_target_name"]).value,
                aliases=str(aliases) if aliases is not None else "[]",
                name=top.get(4, b"").decode(), ttir=any(field == 5 for field, _, _, _ in kernel_fields),
                launch=launch, payload=len(tc._proto.payload(op, ir)))


def check_bind(failures: list) -> None:
    """jax-triton 0.4: the direct bind against triton_call's own, for a launch without aliases."""
    seen, real = [], tc._bind_04

    def spy(jax_triton, launch, inputs, outputs, name):
        seen.append((launch, [S(a.shape, a.dtype) for a in inputs], [S(o.shape, o.dtype) for o in outputs], name))
        return real(jax_triton, launch, inputs, outputs, name)

    tc._bind_04 = spy
    try:
        jax.make_jaxpr(lambda l, v: qsa_jax.topk_blocks(l, v, 4))(S((2, 16), jnp.float32), S((2,), jnp.int32))
    finally:
        tc._bind_04 = real
    (launch, inputs, outputs, name), = seen
    jt = tc._binding._jax_triton
    ours = jax.make_jaxpr(lambda *a: real(jt, launch, list(a), outputs, name))(*inputs).eqns[0].params
    theirs = jax.make_jaxpr(lambda *a: jt.triton_call(
        *a, kernel=launch.kernel, out_type=outputs, grid=launch.grid, name=name, num_warps=launch.num_warps,
        num_stages=launch.num_stages, **launch.scalars, **launch.constexprs))(*inputs).eqns[0].params
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    print(f"direct bind vs triton_call's ({len(ours)} parameters): {'same' if not differ else differ}")
    if differ:
        failures.append(f"the direct bind differs from triton_call's in {differ}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", default="rope,topk,step")
    args = parser.parse_args()
    import jax_triton
    import triton

    jt_version, jaxlib_version = tc._versions()
    print(f"jax {jax.__version__}, jaxlib {jaxlib_version}, jax-triton {jax_triton.__version__} (metadata "
          f"{jt_version}), triton {triton.__version__}; {tc.FFI_TARGET} registered: {tc._ffi_registered()}")
    print(f"auto: {tc.lowering_reason()}")
    failures: list[str] = []
    own = tc.FFI_TARGET if tc._binding.jax_triton_api(jax_triton) == "0.4" else tc.LEGACY_TARGET
    expected = {"ffi": tc.FFI_TARGET, "legacy": tc.LEGACY_TARGET, "jax-triton": own}
    for name, (function, arguments, donated) in functions().items():
        if name not in args.functions.split(","):
            continue
        launches = {}
        for lowering in LOWERINGS:
            with qsa_jax.use_triton_lowering(lowering):  # a fresh function: JAX reuses a function's trace
                lowered = jax.jit(lambda *a, f=function: f(*a), donate_argnums=donated).trace(*arguments).lower(
                    lowering_platforms=("cuda",))
            calls = [decode(op) for op in tc._proto.custom_calls(lowered)]
            launches[lowering] = [(c["launch"], c["aliases"]) for c in calls]
            for c in calls:
                if c["target"] != expected[lowering] or c["ttir"] != (lowering == "jax-triton"):
                    failures.append(f"{name} {lowering}: {c['name']} lowered to {c['target']}, TTIR {c['ttir']}")
            print(f"{name:5} {lowering:10} {len(calls)} launches to {sorted({c['target'] for c in calls})}, "
                  f"{sum(c['payload'] for c in calls)} payload bytes, aliased: "
                  f"{sum(c['aliases'] != '[]' for c in calls)}")
        if len({tuple(v) for v in launches.values()}) != 1 or not launches["ffi"]:
            failures.append(f"{name}: the lowerings launch different kernels, grids or parameters")
    if tc._binding.jax_triton_api(jax_triton) == "0.4":
        check_bind(failures)
    for failure in failures:
        print("FAILED:", failure)
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
