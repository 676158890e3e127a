"""Fixes for Triton's interpreter, applied only when this process interprets.

**Boolean splats (Triton 3.9).**  The interpreter gives a comparison of two
scalars the *operand's* element type (say int32) while its data are booleans.
Splatting such a scalar to a block (``mask=row_ok & (cols < n)``, or a scalar
mask on a block load) then builds an int32 array, and Triton 3.9's
``load``/``store`` reject a non-boolean mask ("mask has unsupported dtype";
3.6 accepted it, 3.7 and 3.8 were not tried).  Compiled kernels are not
affected: the compiler types the comparison as int1.  Here a splat of boolean
data stays boolean (int1), which is what the kernel means.

**fp8 e4m3 casts.**  The interpreter converts to and from ``float8e4nv`` by
moving bit fields: rounding to e4m3 is wrong (-0.498 came out -0.25), NaN
becomes a finite code (0x7c, 384) and the two NaN codes widen to +-480.  Here
both directions are exact and as sm_90 computes them: to e4m3 as
``cvt.rn.satfinite.e4m3x2`` (round to nearest even, finite values and +-inf
past 448 saturated to +-448, NaN to the NaN code 0x7f), from e4m3 by the
table of its 256 values (0x7f and 0xff are NaN).  So CPU tests of the fp8
writers and readers check what the GPU computes.
"""

from __future__ import annotations

import numpy as np

from . import runtime


def e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 e4m3fn codes (NaN for 0x7f and 0xff)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -9, (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
    values = sign * magnitude
    values[(exponent == 0xF) & (mantissa == 0x7)] = np.nan
    return values.astype(np.float32)


_VALUES = e4m3_values()
_MAGNITUDES = _VALUES[:0x7F].astype(np.float64)  # codes 0..126, ascending


def to_e4m3(values: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes of float values: nearest, ties to even, saturated at +-448, NaN 0x7f."""
    values = np.asarray(values, np.float64)
    magnitude = np.minimum(np.abs(values), 448.0)  # +-inf too (satfinite)
    magnitude = np.where(np.isnan(values), 0.0, magnitude)
    upper = np.minimum(np.searchsorted(_MAGNITUDES, magnitude), 0x7E)
    lower = np.maximum(upper - 1, 0)
    below, above = magnitude - _MAGNITUDES[lower], _MAGNITUDES[upper] - magnitude
    # The nearer neighbour; at a midpoint the even code (an even mantissa).
    code = np.where((above < below) | ((above == below) & (upper % 2 == 0)), upper, lower)
    code = np.where(magnitude >= _MAGNITUDES[upper], upper, code)
    code = code.astype(np.uint8) | np.where(np.signbit(values), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(values), np.uint8(0x7F), code).astype(np.uint8)


def _apply() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_qsa_bool_splat", False):
        return
    splat = builder.create_splat

    def create_splat(self, ret_ty, arg):
        if arg.data.dtype == np.bool_:
            value = arg.data[0] if isinstance(arg.dtype, tl.block_type) else arg.data
            return interpreter.TensorHandle(np.full(ret_ty.shape, value, dtype=np.bool_), tl.int1)
        return splat(self, ret_ty, arg)

    builder.create_splat = create_splat
    builder._qsa_bool_splat = True

    fp_to_fp = builder.create_fp_to_fp
    # How the interpreter holds each float type: bf16 as raw uint16 bits, fp8 as uint8 codes.
    wide = {tl.float16: np.float16, tl.float32: np.float32, tl.float64: np.float64}

    def as_float(data, dtype):
        if dtype == tl.bfloat16:
            return (np.asarray(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        return np.asarray(data).astype(np.float64)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        source, target = src.dtype.scalar, dst_type.scalar
        if target == tl.float8e4nv and (source == tl.bfloat16 or source in wide):
            return interpreter.TensorHandle(to_e4m3(as_float(src.data, source)), target)
        if source == tl.float8e4nv and (target == tl.bfloat16 or target in wide):
            values = _VALUES[np.asarray(src.data, np.uint8)]
            if target == tl.bfloat16:  # exact in bf16 (NaN: 0x7fc0)
                data = (values.view(np.uint32) >> 16).astype(np.uint16)
            else:
                data = values.astype(wide[target])
            return interpreter.TensorHandle(data, target)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp


if runtime.INTERPRETED:
    _apply()
