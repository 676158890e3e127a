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

**bf16 casts.**  The interpreter holds bf16 as raw uint16 bits and converts
them to and from float32 by moving bit fields (``_convert_float``): a
subnormal comes out wrong both ways (7.44e-39 became 3.12e-39 or 7.35e-40),
float32 -> bf16 truncates where the compiler rounds to nearest even, and a
cast between bf16 and an integer or float64 reinterprets the bits as a number.
Here bf16 -> float32 is exact (bf16 is the top 16 bits of float32), float32 ->
bf16 rounds the bit pattern to nearest even (as ``cvt.rn.bf16.f32``; NaN
stays NaN, quiet, sign kept), float64 -> bf16 rounds once (through float32
rounded to odd) and the integer casts go through float32 / float64.  So a
bf16 value, subnormal or not, survives a round trip bit for bit.
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


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of raw bf16 bits (uint16): exact, subnormals, infinities and NaN included."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray, rounding: str = "rtne") -> np.ndarray:
    """Raw bf16 bits (uint16) of float32 values: rounded to nearest even on the bit pattern
    (``"rtz"``: toward zero), subnormals included; NaN stays a quiet NaN of the same sign."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    if rounding == "rtne":
        # + 0x7FFF, + 1 when the kept half is odd: carries into the exponent (and to inf) as the hardware does.
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    else:
        rounded = bits
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = np.where(nan, (bits >> 16) | np.uint32(0x0040), rounded >> 16)
    return out.astype(np.uint16)


def f64_to_bf16(values: np.ndarray, rounding: str = "rtne") -> np.ndarray:
    """Raw bf16 bits of float64 values, rounded once: to float32 rounded to odd (toward zero,
    the last bit set when inexact: 16 more bits than bf16 keeps, so rounding that to bf16
    is rounding the float64 value), then :func:`f32_to_bf16`."""
    values = np.asarray(values, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        single = values.astype(np.float32)
        widened = single.astype(np.float64)
        away = np.isfinite(values) & (np.abs(widened) > np.abs(values))  # rounded away from zero
        single = np.where(away, np.nextafter(single, np.float32(0)), single)
        bits = single.view(np.uint32).copy()
        inexact = np.isfinite(values) & (single.astype(np.float64) != values)
    bits[inexact] |= np.uint32(1)
    return f32_to_bf16(bits.view(np.float32), rounding)


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
            return bf16_to_f32(data)
        return np.asarray(data).astype(np.float64)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        source, target = src.dtype.scalar, dst_type.scalar
        if target == tl.bfloat16 and source in (tl.float32, tl.float64):  # a rounding mode asked for
            rounding = "rtz" if rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ else "rtne"
            convert = f32_to_bf16 if source == tl.float32 else f64_to_bf16
            return interpreter.TensorHandle(convert(src.data, rounding), target)
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

    cast = builder.cast_impl  # every other cast (fp_ext, fp_trunc, si/ui_to_fp, fp_to_si/ui)

    def cast_impl(self, src, dst_type):
        source, target = src.dtype.scalar, dst_type.scalar
        if source == tl.bfloat16 and target != tl.bfloat16:
            values = bf16_to_f32(src.data)
            if target != tl.float32:  # float64 exactly; an integer as from float32
                values = values.astype(interpreter._get_np_dtype(target))
            return interpreter.TensorHandle(values, target)
        if target == tl.bfloat16 and source != tl.bfloat16:
            if source == tl.float32:
                return interpreter.TensorHandle(f32_to_bf16(src.data), target)
            # float16 and integers: exact in float64 (but int64 past 2**53), then rounded once.
            return interpreter.TensorHandle(f64_to_bf16(np.asarray(src.data).astype(np.float64)), target)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_impl


if runtime.INTERPRETED:
    _apply()
