"""Everything jax-triton-specific lives here (targets jax-triton 0.3.1's API).

jax-triton compiles and binds every kernel (``jax_triton.triton_call``); this
module decides which XLA custom call the launch lowers to:

* ``"ffi"``: jaxlib's typed-FFI handler ``triton_kernel_call_ffi`` (API
  version 4, the call proto as an ``opaque`` attribute).  XLA instantiates it
  once per executable and, because the handler is command-buffer compatible,
  records consecutive launches into one CUDA graph (a ``kCommandBuffer``
  thunk) instead of dispatching each from the host.
* ``"legacy"``: jax-triton 0.3.1's own lowering, the untyped
  ``triton_kernel_call`` (API version 2), which XLA dispatches one by one
  and hashes (PTX included) on every call.

``"auto"`` (the default) takes ``"ffi"`` wherever the installed jaxlib
registers the FFI handler (jaxlib >= 0.11: a static check of the handler
table, no device call), else ``"legacy"``.  ``QSA_JAX_LOWERING=legacy`` (or
``ffi``) in the environment forces one; :func:`use_triton_lowering` switches it
for the functions traced inside a block.  Both lower the same compiled kernel with the
same arguments, so their results are bitwise equal.  Either way the call's
payload is slimmed (see :func:`_slim_call_proto`): jaxlib copies and hashes
it per launch, so its size is host time.

A later move to jax-triton 0.4 (which lowers to the FFI handler itself)
should touch only this file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import zlib

import jax
import jax.numpy as jnp

from qsa_kernels import runtime
from qsa_kernels.launch import Buffer, Launch, Program, execute, kernel_name

FFI_TARGET = "triton_kernel_call_ffi"
#: The XLA custom-call targets a jitted qsa_jax function may contain (for
#: ``jax.export.DisabledSafetyCheck.custom_call``).
CUSTOM_CALL_TARGETS = ("triton_kernel_call", FFI_TARGET)
LOWERINGS = ("auto", "ffi", "legacy")
_ENVIRONMENT = "QSA_JAX_LOWERING"


def _import_jax_triton():
    # Importing jax_triton sets TRITON_CACHE_DIR to "", after which every
    # torch-side Triton launch in the process fails: put the old value back.
    previous = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous
    return jax_triton


_jax_triton = None
_requested = os.environ.get(_ENVIRONMENT, "auto").strip().lower() or "auto"


@functools.cache
def _ffi_available() -> bool:
    """Whether the installed jaxlib registers ``triton_kernel_call_ffi`` for CUDA
    (read from jaxlib's handler table: no device call)."""
    try:
        import jaxlib.gpu_triton as gpu_triton
    except ImportError:  # pragma: no cover - jaxlib without GPU Triton support
        return False
    plugin = getattr(gpu_triton, "_cuda_triton", None)
    registrations = getattr(plugin, "registrations", None)
    return bool(registrations) and FFI_TARGET in registrations()


def _check_name(name: str, what: str) -> None:
    if name not in LOWERINGS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, LOWERINGS))}, got {name!r}")


def triton_lowering_available(name: str) -> bool:
    """Whether launches can lower the ``name`` way here (``"auto"`` and
    ``"legacy"`` always can in a compiled process; ``"ffi"`` needs jaxlib >= 0.11)."""
    _check_name(name, "lowering")
    return not runtime.INTERPRETED and (name != "ffi" or _ffi_available())


def _resolve(name: str) -> str:
    if name == "auto":
        return "ffi" if _ffi_available() else "legacy"
    if name == "ffi" and not _ffi_available():
        raise RuntimeError(f"the ffi lowering needs jaxlib's {FFI_TARGET} handler (jaxlib >= 0.11), "
                           f"which this jaxlib does not register: use 'legacy' or 'auto'")
    return name


def triton_lowering() -> str:
    """How Triton launches traced from now on reach XLA: ``"ffi"`` or ``"legacy"``
    (``"interpreter"`` in a process without a CUDA device, where every launch
    runs from a host callback instead)."""
    _check_name(_requested, _ENVIRONMENT)
    return "interpreter" if runtime.INTERPRETED else _resolve(_requested)


@contextlib.contextmanager
def use_triton_lowering(name: str):
    """Lower the Triton launches traced inside the block the ``name`` way
    (``"auto"``, ``"ffi"`` or ``"legacy"``; the default is the
    ``QSA_JAX_LOWERING`` environment variable, else ``"auto"``).

    A jitted function is traced at its first call for given shapes: call (or
    ``.lower()``) it inside the block; JAX reuses that trace, lowering
    included, for later calls of the same function wherever they are made.
    Raises at entry if ``name`` cannot be used here.  No effect in a process
    without a CUDA device.
    """
    global _requested
    _check_name(name, "lowering")
    if not runtime.INTERPRETED:
        _resolve(name)
    previous, _requested = _requested, name
    try:
        yield
    finally:
        _requested = previous


# The custom call target each launch is bound with; the lowering rule below
# reads it back, so one process can hold functions lowered either way.
_TARGET = {"ffi": FFI_TARGET, "legacy": "triton_kernel_call"}


# Every launch of this package is bound with this name prefix: the lowering
# rule below changes only those, so other jax-triton users in the process see
# jax-triton's own lowering.
_NAME_PREFIX = "qsa:"


def _install_lowering(jax_triton) -> None:
    """Register, for CUDA, a lowering of jax-triton's primitive for our launches.

    jax-triton 0.3.1 compiles the kernel and builds the serialized call proto
    inside its lowering, emitted as the legacy call's ``backend_config``; the
    FFI handler takes the same proto as its ``opaque`` attribute.  So the legacy
    call is emitted, its proto read back (and slimmed), and the op replaced by
    the chosen call with the same operands, results and aliases.
    """
    import triton
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    lib = jax_triton.triton_lib
    legacy_rule = functools.partial(lib.triton_kernel_call_lowering, lib.get_cuda_backend)

    def rule(ctx, *operands, name, custom_call_target_name, input_output_aliases, **params):
        def lower():
            return legacy_rule(ctx, *operands, name=name, custom_call_target_name="triton_kernel_call",
                               input_output_aliases=input_output_aliases, **params)

        if not name.startswith(_NAME_PREFIX):  # not ours: jax-triton's lowering, untouched
            return legacy_rule(ctx, *operands, name=name, custom_call_target_name=custom_call_target_name,
                               input_output_aliases=input_output_aliases, **params)
        with triton.knobs.compilation.scope():  # line info: debug text only, the code is the same
            triton.knobs.compilation.disable_line_info = True
            results = lower()
        legacy_op = results[0].owner
        proto = _slim_call_proto(ir.StringAttr(legacy_op.attributes["backend_config"]).value_bytes)
        legacy_op.erase()
        aliases = dict(input_output_aliases)
        if custom_call_target_name == FFI_TARGET:
            return jax.ffi.ffi_lowering(FFI_TARGET, api_version=4, operand_output_aliases=aliases)(
                ctx, *operands, opaque=proto)
        return jax.ffi.ffi_lowering(custom_call_target_name, api_version=2, backend_config=proto,
                                    operand_output_aliases=aliases)(ctx, *operands)

    mlir.register_lowering(lib.triton_kernel_call_p, rule, platform="cuda")


# --------------------------------------------------------------------------
# The call proto, slimmed.  jaxlib keys its kernel cache on the whole
# compressed proto and, per call (legacy) or per execution of an executable
# (FFI: the initialize stage), copies it into a std::string to look it up
# (jaxlib/gpu/triton_kernels.cc, GetOrCreateKernelCall), and XLA copies it
# into each FFI call frame: host time proportional to its size, ~280 KB per
# decode step as jax-triton builds it.  The kernel's TTIR text in it is never
# read at run time, and Triton's line info is only debug text in the PTX; both
# go.  (Protobuf wire format, TritonAnyKernelCall -> kernel_call (1) ->
# kernel (1) -> ttir (5): see jaxlib/gpu/triton.proto.)
# --------------------------------------------------------------------------

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes):
    """``(field number, wire type, encoded entry, payload or None)`` for each entry of a message."""
    i = 0
    while i < len(data):
        start = i
        key, i = _read_varint(data, i)
        kind = key & 7
        payload = None
        if kind == 0:
            _, i = _read_varint(data, i)
        elif kind == 1:
            i += 8
        elif kind == 5:
            i += 4
        elif kind == 2:
            length, i = _read_varint(data, i)
            payload, i = data[i:i + length], i + length
        else:
            raise ValueError(f"unexpected protobuf wire type {kind}")
        yield key >> 3, kind, data[start:i], payload


def _edit(message: bytes, number: int, change) -> bytes:
    """``message`` with the payload of each length-delimited field ``number`` replaced by
    ``change(payload)`` (``None``: the field dropped)."""
    out = bytearray()
    for field, kind, entry, payload in _fields(message):
        if field != number or kind != 2:
            out += entry
            continue
        new = change(payload)
        if new is not None:
            out += _varint(number << 3 | 2) + _varint(len(new)) + new
    return bytes(out)


def _slim_call_proto(compressed: bytes) -> bytes:
    """A single-kernel call proto without the kernel's TTIR, recompressed at zlib's best level."""
    proto = zlib.decompress(compressed)
    proto = _edit(proto, 1, lambda call: _edit(call, 1, lambda kernel: _edit(kernel, 5, lambda ttir: None)))
    return zlib.compress(proto, 9)


def _allocate(buffer: Buffer, fill):
    # Unfilled buffers are placeholders: the launch that writes one gets its
    # shape and dtype as an out_shape and returns the array.
    if fill is None:
        return jax.ShapeDtypeStruct(buffer.shape, jnp.dtype(buffer.dtype))
    return jnp.full(buffer.shape, fill, jnp.dtype(buffer.dtype))


def _launch(launch: Launch, inputs: list, outputs: list, target: str) -> list:
    return _jax_triton.triton_call(
        *inputs,
        kernel=launch.kernel,
        out_shape=[jax.ShapeDtypeStruct(value.shape, value.dtype) for value in outputs],
        grid=launch.grid,
        name=_NAME_PREFIX + kernel_name(launch.kernel),
        input_output_aliases=launch.aliases(),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        custom_call_target_name=target,
        **launch.scalars,
        **launch.constexprs,
    )


def run(program: Program, env: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """Run ``program`` through the shared executor, one ``triton_call`` per launch."""
    global _jax_triton
    if _jax_triton is None:
        jax_triton = _import_jax_triton()
        _install_lowering(jax_triton)
        _jax_triton = jax_triton
    target = _TARGET[triton_lowering()]
    return execute(program, env, adapter="jax", allocate=_allocate,
                   launch=lambda launch, inputs, outputs: _launch(launch, inputs, outputs, target))
