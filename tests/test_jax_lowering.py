"""How qsa_jax's launches reach XLA (docs/api.md, "Calling from jax.jit"): the CPU-checkable parts.

The GPU side (both lowerings bitwise equal, donation, the step inside a command
buffer) is in tests/test_step.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest

import qsa_jax
from qsa_jax import _triton_call
from qsa_kernels import runtime


@pytest.mark.skipif(not runtime.INTERPRETED, reason="the interpreter's answer")
def test_interpreted_process_reports_the_interpreter_and_no_lowering():
    assert qsa_jax.triton_lowering() == "interpreter"
    assert not any(qsa_jax.triton_lowering_available(name) for name in ("auto", "ffi", "legacy"))
    with qsa_jax.use_triton_lowering("legacy"):  # accepted, no effect without a CUDA device
        assert qsa_jax.triton_lowering() == "interpreter"


def test_unknown_lowering_names_are_refused():
    with pytest.raises(ValueError, match="lowering must be one of 'auto', 'ffi', 'legacy', got 'fast'"):
        with qsa_jax.use_triton_lowering("fast"):
            pass
    with pytest.raises(ValueError, match="got 'FFI'"):
        qsa_jax.triton_lowering_available("FFI")


def test_environment_variable_is_checked_with_a_clear_message():
    code = "import qsa_jax\ntry:\n    qsa_jax.triton_lowering()\nexcept ValueError as e:\n    print(e)\n"
    env = dict(os.environ, QSA_JAX_LOWERING="fastest")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "QSA_JAX_LOWERING must be one of 'auto', 'ffi', 'legacy', got 'fastest'" in out.stdout, out


def test_use_triton_lowering_restores_the_previous_choice_even_on_error():
    before = _triton_call._requested
    with pytest.raises(RuntimeError, match="inside"):
        with qsa_jax.use_triton_lowering("legacy"):
            assert _triton_call._requested == "legacy"
            raise RuntimeError("inside")
    assert _triton_call._requested == before


def _field(number: int, payload: bytes) -> bytes:
    return _triton_call._varint(number << 3 | 2) + _triton_call._varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    return _triton_call._varint(number << 3) + _triton_call._varint(value)


def test_slim_call_proto_drops_only_the_kernels_ttir():
    """Built by hand from jaxlib/gpu/triton.proto: TritonAnyKernelCall{kernel_call(1){kernel(1)
    {name 1, num_warps 2, shared 3, ptx 4, ttir 5, cc 6}, grid 2-4, parameters 5}, metadata 3, name 4}."""
    ptx = b".version 8.4\n" + b"x" * 300  # > 127 bytes: multi-byte lengths
    kernel = lambda ttir: (_field(1, b"rope_cache_kernel") + _varint_field(2, 8) + _varint_field(3, 70000)  # noqa: E731
                           + _field(4, ptx) + (_field(5, ttir) if ttir else b"") + _varint_field(6, 90))
    params = b"".join(_field(5, _field(1, _varint_field(2, 16))) for _ in range(3))
    call = lambda ttir: _field(1, kernel(ttir)) + _varint_field(2, 132) + _varint_field(3, 1) + params  # noqa: E731
    whole = lambda ttir: _field(1, call(ttir)) + _field(3, b"meta") + _field(4, b"qsa:rope_cache_kernel")  # noqa: E731
    slim = _triton_call._slim_call_proto(zlib.compress(whole(b"module { tt.func ... }" * 40)))
    assert zlib.decompress(slim) == whole(None)
    # the same proto without TTIR passes through unchanged (but for compression)
    assert zlib.decompress(_triton_call._slim_call_proto(zlib.compress(whole(None)))) == whole(None)
