"""fp8 e4m3 caches: the one quantiser their writers share and the exact widening of their readers.

Writers (stage 1, ``store_cache_rows``, the composed step's fused stage 2)
store ``value / scale`` through :func:`quantise`: finite values and +-inf
saturate to +-448, NaN stays NaN (an e4m3 NaN code).  Readers (attention, the
scorer) widen each gathered fp8 tile to q's dtype through :func:`widen_e4m3`,
which holds every e4m3 value exactly and turns both NaN codes (0x7f, 0xff)
into NaN, and keep their 16-bit tensor-core dots.  So a NaN in k, v or a
stored row reaches the output as it does through a 16-bit cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import runtime


def in_registers(fp8: bool) -> bool:
    """Whether a reader's ``IN_REGISTERS`` constexpr is on: fp8 cache, compiled (inline asm; the
    interpreter takes Triton's cast)."""
    return fp8 and not runtime.INTERPRETED


def bit_trick(fp8: bool, q_dtype: str) -> bool:
    """Whether a reader's ``BIT_TRICK`` constexpr is on: in registers (:func:`in_registers`) and bf16 q."""
    return in_registers(fp8) and q_dtype == "bfloat16"


#: The largest finite e4m3 value: writers saturate finite values and +-inf to +-FP8_MAX.
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def quantise(values, scale_ptr, dtype: tl.constexpr):
    """``values`` into an fp8 e4m3 cache of one per-tensor scale: ``value / scale`` in
    float32, correctly rounded (div_rn: ``/`` is div.full.f32 on the GPU, 2 ulp, which could
    pick the other fp8 neighbour next to a rounding midpoint), saturated to +-448 (finite
    values and +-inf), NaN kept NaN, rounded to nearest even e4m3 (``dtype``).

    The one quantiser of every fp8 writer.  The clamp propagates NaN (max.NaN / min.NaN on
    the GPU, NumPy's under the interpreter, no extra instruction) and the sm_90 cast
    (``cvt.rn.satfinite.e4m3x2.f32``) turns NaN into a NaN code; under the interpreter
    :mod:`.interpreter_compat` makes Triton's e4m3 casts those of the GPU.
    """
    values = tl.math.div_rn(values.to(tl.float32), tl.load(scale_ptr).to(tl.float32))
    values = tl.maximum(values, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    values = tl.minimum(values, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return values.to(dtype)


@triton.jit
def _opaque(x):
    """``x`` (uint8) unchanged, through an identity asm Triton must not move or duplicate.

    Triton's layout passes hoist a conversion to a dot-operand layout above
    pure elementwise ops, up to the load (so a widened operand is staged in
    shared memory at its narrow width).  For 8-bit values that feed the B
    operand with the reduction dim not contiguous (V in P.V), that leaves
    them to be read from shared memory one byte at a time in the dot-operand
    layout (sm_90 SASS: 128 LDS.U8 per thread and tile at decode); a
    non-pure op stops the hoisting, so the widening runs in the load's layout
    and the dot reads 16-bit values with ldmatrix, as for 16-bit caches.
    """
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.uint8, is_pure=False, pack=4)


@triton.jit
def widen_e4m3(x, dtype: tl.constexpr, BIT_TRICK: tl.constexpr, IN_REGISTERS: tl.constexpr):
    """fp8 e4m3 ``x`` as ``dtype`` (bf16 or fp16): exactly for every finite value, NaN for
    both NaN codes (0x7f, 0xff).

    ``IN_REGISTERS`` (compiled only: inline asm): widen here, in the layout
    ``x`` was loaded in, never in a dot-operand layout (see :func:`_opaque`).
    ``BIT_TRICK`` (with it, bf16 only): integer ops instead of Triton's cast,
    which goes through fp16 with one F2F per element on the slow conversion
    pipe.  Byte ``s eeee mmm`` becomes the bf16 bits ``s 0000eeee mmm0000``,
    the e4m3 value times 2**-120, and one bf16x2 fma per two elements
    multiplies by 2**120: exact (a power of two; bf16 fma keeps subnormal
    inputs).  That alone would read the NaN codes as +-480, so the NaN codes
    are flagged on the packed bytes, ``(x & 0x7f7f7f7f) + 0x01010101`` setting
    bit 7 of exactly the bytes whose low 7 bits are all ones (no carry crosses
    a byte), sign-replicated by prmt to 0xffff in their bf16 halves and or-ed
    in before the multiply (a NaN, which it keeps): 4 more instructions per 4
    bytes on sm_90 (LOP3, IADD3, 2 PRMT; the or joins the mask's LOP3), 12
    instead of 8 (``benchmarks/sass_loops.py``).  The fp16 path's cast
    (``cvt.rn.f16x2.e4m3x2``) keeps NaN.  Without ``IN_REGISTERS`` (the
    interpreter): Triton's cast, made exact by :mod:`.interpreter_compat`.
    (docs/design.md, "Retired variants": the other widenings measured.)
    """
    if IN_REGISTERS:
        if BIT_TRICK:
            # prmt selector nibbles 8-b: the sign of byte 0-3 replicated; << 4 puts
            # e and m at bits 10..4 and a sign bit at 15, the mask clears the rest.
            # n: bit 7 of each NaN byte; m0, m1: 0xffff in the halves of NaN bytes,
            # a bf16 NaN once or-ed in.
            widened = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 a<2>, n, m<2>, scale, zero;
                prmt.b32 a0, $2, 0, 0x9180;
                prmt.b32 a1, $2, 0, 0xb3a2;
                and.b32 n, $2, 0x7f7f7f7f;
                add.u32 n, n, 0x01010101;
                prmt.b32 m0, n, 0, 0x9988;
                prmt.b32 m1, n, 0, 0xbbaa;
                shl.b32 a0, a0, 4;
                shl.b32 a1, a1, 4;
                and.b32 a0, a0, 0x87f087f0;
                and.b32 a1, a1, 0x87f087f0;
                or.b32 a0, a0, m0;
                or.b32 a1, a1, m1;
                mov.b32 scale, 0x7b807b80;
                mov.b32 zero, 0x80008000;
                fma.rn.bf16x2 $0, a0, scale, zero;
                fma.rn.bf16x2 $1, a1, scale, zero;
                }""",
                constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                is_pure=False, pack=4)
        else:
            widened = _opaque(x.to(tl.uint8, bitcast=True)).to(tl.float8e4nv, bitcast=True).to(dtype)
    else:
        widened = x.to(dtype)
    return widened
