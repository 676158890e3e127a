"""fp8 e4m3 caches: the exact widening their readers share.

Readers (attention, the scorer) widen each gathered fp8 tile to q's dtype,
which holds every e4m3 value exactly, and keep their 16-bit tensor-core dots.
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
    """fp8 e4m3 ``x`` as ``dtype`` (bf16 or fp16), exactly for every finite value.

    ``IN_REGISTERS`` (compiled only: inline asm): widen here, in the layout
    ``x`` was loaded in, never in a dot-operand layout (see :func:`_opaque`).
    ``BIT_TRICK`` (with it, bf16 only): integer ops instead of Triton's cast,
    which goes through fp16 with one F2F per element on the slow conversion
    pipe.  Byte ``s eeee mmm`` becomes the bf16 bits ``s 0000eeee mmm0000``,
    the e4m3 value times 2**-120, and one bf16x2 fma per two elements
    multiplies by 2**120: exact (a power of two; bf16 fma keeps subnormal
    inputs).  The two NaN codes come out as +-480; stage 1 and
    store_cache_rows saturate, so they never write them.  Without
    ``IN_REGISTERS`` (the interpreter): Triton's cast.  (docs/design.md,
    "Retired variants": the other widenings measured.)
    """
    if IN_REGISTERS:
        if BIT_TRICK:
            # prmt selector nibbles 8-b: the sign of byte 0-3 replicated; << 4 puts
            # e and m at bits 10..4 and a sign bit at 15, the mask clears the rest.
            widened = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 a<2>, scale, zero;
                prmt.b32 a0, $2, 0, 0x9180;
                prmt.b32 a1, $2, 0, 0xb3a2;
                shl.b32 a0, a0, 4;
                shl.b32 a1, a1, 4;
                and.b32 a0, a0, 0x87f087f0;
                and.b32 a1, a1, 0x87f087f0;
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
