"""Helpers shared by the tests: devices, conversions, comparisons."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from qsa_kernels import runtime

DEVICE = torch.device("cpu" if runtime.INTERPRETED else "cuda")

#: Whether the adapters' accelerators are plugged in (``QSA_ACCELERATE``, unset: on).  CI runs the
#: suite both ways; the accelerators' own tests skip without them.
ACCELERATED = runtime.env_switch("QSA_ACCELERATE", default=True)
needs_accelerator = pytest.mark.skipif(not ACCELERATED, reason="QSA_ACCELERATE=0: the accelerators are off")

_RAW = {
    torch.bfloat16: (torch.uint16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
}


def host(tensor: torch.Tensor) -> np.ndarray:
    """A torch tensor as a NumPy array of the same dtype (bf16/fp8 via ml_dtypes)."""
    tensor = tensor.detach().cpu().contiguous()
    raw = _RAW.get(tensor.dtype)
    if raw is not None:
        return tensor.view(raw[0]).numpy().view(raw[1])
    return tensor.numpy()


def f64(value) -> np.ndarray:
    """Any tensor / array as float64 NumPy (for references)."""
    if isinstance(value, torch.Tensor):
        value = host(value)
    return np.asarray(value).astype(np.float64)


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """The same values as a JAX array (int64 becomes int32 without x64)."""
    array = host(tensor)
    if array.dtype == np.int64 and not jax.config.jax_enable_x64:
        array = array.astype(np.int32)
    return jnp.asarray(array)


def assert_bitwise_equal(a, b, what: str = "") -> None:
    """Exact equality of two arrays from either framework (same dtype, same bits)."""
    a_np = host(a) if isinstance(a, torch.Tensor) else np.asarray(a)
    b_np = host(b) if isinstance(b, torch.Tensor) else np.asarray(b)
    assert a_np.shape == b_np.shape, f"{what}: shapes {a_np.shape} vs {b_np.shape}"
    assert a_np.dtype == b_np.dtype, f"{what}: dtypes {a_np.dtype} vs {b_np.dtype}"
    a_bits = a_np.view(f"u{a_np.dtype.itemsize}") if a_np.dtype.itemsize > 0 else a_np
    b_bits = b_np.view(f"u{b_np.dtype.itemsize}") if b_np.dtype.itemsize > 0 else b_np
    mismatch = np.count_nonzero(a_bits != b_bits)
    assert mismatch == 0, f"{what}: {mismatch} of {a_np.size} elements differ bitwise"


def assert_close(out, ref, tol: float, what: str = "") -> None:
    """‖out − ref‖ / ‖ref‖ <= tol, with NaN exactly where the reference has NaN."""
    out = f64(out)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, f"{what}: shapes {out.shape} vs {ref.shape}"
    out_nan, ref_nan = np.isnan(out), np.isnan(ref)
    assert np.array_equal(out_nan, ref_nan), (
        f"{what}: NaN at {np.count_nonzero(out_nan & ~ref_nan)} unexpected and "
        f"{np.count_nonzero(ref_nan & ~out_nan)} missing places")
    o, r = out[~ref_nan], ref[~ref_nan]
    norm = np.linalg.norm(r)
    error = np.linalg.norm(o - r) / (norm if norm > 0 else 1.0)
    assert error <= tol, f"{what}: relative error {error:.3e} > {tol:.1e}"


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-2)
