"""bf16 casts in the kernels are exact, interpreted as compiled (``qsa_kernels.interpreter_compat``).

Triton's interpreter converted bf16 subnormals to and from float32 wrongly
(7.44e-39 became 3.12e-39 or 7.35e-40) and truncated float32 to bf16 where the
GPU rounds to nearest even (issue 52, item 5).  These tests hold on either
path: a cast round trip of every bf16 value, float32 -> bf16 against torch's
rounding, and the stages that pass bf16 values through unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import qsa_jax
import qsa_torch
from qsa_kernels import interpreter_compat as compat

from .util import DEVICE, assert_bitwise_equal, host, to_jax

#: A bf16 subnormal: 7.44e-39 (0x0051), the value issue 52 saw change.
SUBNORMAL = 0x0051


def bf16_from_bits(bits) -> torch.Tensor:
    return torch.tensor(np.asarray(bits, np.uint16).view(np.int16)).view(torch.bfloat16)


def bits_of(tensor: torch.Tensor) -> np.ndarray:
    return host(tensor.contiguous().view(torch.int16)).view(np.uint16)


@triton.jit
def _round_trip_kernel(x_ptr, wide_ptr, back_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    wide = x.to(tl.float32)
    tl.store(wide_ptr + i, wide, mask=i < n)
    tl.store(back_ptr + i, wide.to(tl.bfloat16), mask=i < n)


@triton.jit
def _narrow_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n).to(tl.bfloat16), mask=i < n)


@triton.jit
def _int_kernel(x_ptr, out_ptr, back_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(x_ptr + i, mask=i < n).to(tl.bfloat16)
    tl.store(out_ptr + i, value, mask=i < n)
    tl.store(back_ptr + i, value.to(tl.int32), mask=i < n)


def _launch(kernel, *arrays, n):
    block = 1024
    with torch.no_grad():
        kernel[(triton.cdiv(n, block),)](*arrays, n, BLOCK=block)


def test_bf16_round_trip_of_every_value():
    """Every bf16 bit pattern but the signalling NaNs (quieted on the way, as NaN stays NaN): to
    float32 exactly (the top 16 bits) and back bit for bit; subnormals included."""
    codes = np.arange(1 << 16, dtype=np.uint32)
    exponent, mantissa = (codes >> 7) & 0xFF, codes & 0x7F
    keep = ~((exponent == 0xFF) & (mantissa != 0) & (mantissa < 0x40))  # signalling NaNs
    codes = codes[keep].astype(np.uint16)
    x = bf16_from_bits(codes).to(DEVICE)
    wide = torch.empty(len(codes), dtype=torch.float32, device=DEVICE)
    back = torch.empty_like(x)
    _launch(_round_trip_kernel, x, wide, back, n=len(codes))
    expected_wide = codes.astype(np.uint32) << 16
    assert np.array_equal(host(wide).view(np.uint32), expected_wide)
    assert np.array_equal(bits_of(back), codes)
    # The value issue 52 saw change (81 x 2**-133).
    assert host(wide)[np.searchsorted(codes, SUBNORMAL)] == np.float32(81 * 2.0 ** -133)


def _float32_cases() -> np.ndarray:
    """float32 bit patterns: subnormals, ties (even and odd kept halves), carries into the
    exponent and to inf, the largest finite values, zeros, infinities, and random bits."""
    edges = [0x00008000, 0x00018000, 0x00017FFF, 0x00008001, 0x00007FFF, 0x0001FFFF, 0x007FFFFF, 0x807FFFFF,
             0x00800000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F800001, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
             0xFF7F7FFF, 0xFF7F8000, 0x80008000, 0x80018000, 0x00000000, 0x80000000, 0x7F800000, 0xFF800000]
    g = np.random.default_rng(52)
    rand = g.integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32)
    small = g.integers(0, 1 << 24, 2000, dtype=np.uint64).astype(np.uint32)  # subnormals and the first normals
    bits = np.concatenate([np.array(edges, np.uint32), rand, small, small | np.uint32(0x80000000)])
    return bits[~np.isnan(bits.view(np.float32))]


def test_float32_to_bf16_rounds_to_nearest_even():
    """float32 -> bf16 in a kernel: torch's rounding (nearest, ties to even, subnormals kept,
    past the largest bf16 to inf), bit for bit."""
    bits = _float32_cases()
    x = torch.from_numpy(bits.view(np.float32).copy())
    out = torch.empty(len(bits), dtype=torch.bfloat16, device=DEVICE)
    _launch(_narrow_kernel, x.to(DEVICE), out, n=len(bits))
    assert np.array_equal(bits_of(out), bits_of(x.to(torch.bfloat16)))


def test_nan_stays_nan():
    """NaN float32 of any payload (one that lives in the low 16 bits only too) and sign: a bf16 NaN."""
    bits = np.array([0x7F800001, 0x7FC00000, 0x7FC00001, 0xFF812345, 0x7FFFFFFF, 0xFFC00000, 0x7F80FFFF],
                    np.uint32)
    out = torch.empty(len(bits), dtype=torch.bfloat16, device=DEVICE)
    _launch(_narrow_kernel, torch.from_numpy(bits.view(np.float32).copy()).to(DEVICE), out, n=len(bits))
    values = host(out.float())
    assert np.isnan(values).all()
    if not DEVICE.type == "cuda":  # the interpreter keeps the sign (the GPU may give its canonical NaN)
        assert np.array_equal(np.signbit(values), np.signbit(bits.view(np.float32)))


def test_helpers_match_torch_and_round_once_from_float64():
    """The conversions themselves (host code, either path): float32 -> bf16 as torch rounds it;
    float64 -> bf16 rounded once (torch's float64 -> bfloat16 goes through float32: twice)."""
    bits = _float32_cases()
    x = torch.from_numpy(bits.view(np.float32).copy())
    assert np.array_equal(compat.f32_to_bf16(bits.view(np.float32)), bits_of(x.to(torch.bfloat16)))
    assert np.array_equal(compat.f32_to_bf16(bits.view(np.float32), "rtz"), (bits >> 16).astype(np.uint16))
    assert np.array_equal(compat.bf16_to_f32(compat.f32_to_bf16(bits.view(np.float32))),
                          x.to(torch.bfloat16).float().numpy())
    # 1 + 2**-8 + 2**-30: float32 rounds it to 1 + 2**-8, a tie that bf16 rounds to even (1.0);
    # rounded once it is above the tie: 1 + 2**-7.  Likewise below the smallest subnormal's half.
    values = np.array([1 + 2.0 ** -8 + 2.0 ** -30, -(1 + 2.0 ** -8 + 2.0 ** -30), 1 + 2.0 ** -8,
                       2.0 ** -134 + 2.0 ** -160, 2.0 ** -134, 3.0 ** 80, 1e300, -1e300, np.inf, 0.0, -0.0])
    expected = [0x3F81, 0xBF81, 0x3F80, 0x0001, 0x0000, None, 0x7F80, 0xFF80, 0x7F80, 0x0000, 0x8000]
    got = compat.f64_to_bf16(values)
    for value, code, want in zip(values, got, expected):
        if want is not None:
            assert code == want, f"{value!r}: {code:#06x}, expected {want:#06x}"
    exact = compat.bf16_to_f32(got[5:6]).astype(np.float64)[0]
    assert abs(exact - 3.0 ** 80) <= 2.0 ** -9 * 3.0 ** 80  # within half a bf16 ulp
    assert np.isnan(compat.bf16_to_f32(compat.f64_to_bf16(np.array([np.nan])))).all()


def test_integers_to_and_from_bf16():
    """int32 -> bf16 (rounded once) -> int32, in a kernel."""
    values = np.array([0, 1, -1, 7, 255, 256, 257, 259, -259, 1 << 20, (1 << 20) + 4097, -(1 << 30) - 3], np.int32)
    out = torch.empty(len(values), dtype=torch.bfloat16, device=DEVICE)
    back = torch.empty(len(values), dtype=torch.int32, device=DEVICE)
    _launch(_int_kernel, torch.from_numpy(values).to(DEVICE), out, back, n=len(values))
    expected = torch.from_numpy(values.astype(np.float64)).to(torch.bfloat16)
    assert np.array_equal(bits_of(out), bits_of(expected))
    assert np.array_equal(host(back), host(expected.float()).astype(np.int32))


def _rope_at_position_zero(dtype, cache_dtype, k_scale=None, v_scale=None):
    """rope_reshape_and_cache's arguments: 2 tokens at position 0 (cos 1, sin 0), q, k and v
    of bf16 subnormals (and a few normal values), each token into its own cache slot."""
    T, QH, KH, D, P = 2, 2, 1, 16, 4
    g = np.random.default_rng(5)
    sub = g.integers(1, 0x80, (T, QH + 2 * KH, D)).astype(np.uint16)  # subnormal magnitudes
    sub |= np.where(g.random(sub.shape) < 0.5, 0x8000, 0).astype(np.uint16)
    sub[:, :, 0] = SUBNORMAL
    sub[:, :, 1] = 0x3F80  # 1.0
    qkv = bf16_from_bits(sub)
    q, k, v = qkv[:, :QH].clone(), qkv[:, QH:QH + KH].clone(), qkv[:, QH + KH:].clone()
    cos_sin = torch.cat([torch.ones(8, D // 2), torch.zeros(8, D // 2)], dim=1)
    key_cache = torch.zeros(2, P, KH, D, dtype=cache_dtype)
    value_cache = torch.zeros(2, P, KH, D, dtype=cache_dtype)
    args = dict(q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=torch.tensor([0, 5], dtype=torch.int32), positions=torch.zeros(T, dtype=torch.int32),
                cos_sin=cos_sin)
    args = {name: value.to(DEVICE) for name, value in args.items()}
    options = dict(is_neox=True)
    if k_scale is not None:
        options.update(k_scale=torch.tensor(k_scale, device=DEVICE), v_scale=torch.tensor(v_scale, device=DEVICE))
    return args, options


def test_rope_at_position_zero_keeps_bf16_subnormals():
    """RoPE at position 0 is the identity: q_out and k_out are q and k, and the cache holds k
    and v, bit for bit, subnormals included (torch and JAX)."""
    args, options = _rope_at_position_zero(torch.bfloat16, torch.bfloat16)
    q, k, v = args["q"].clone(), args["k"].clone(), args["v"].clone()
    jax_out = qsa_jax.rope_reshape_and_cache(**{n: to_jax(a) for n, a in args.items()}, **options)
    out = qsa_torch.rope_reshape_and_cache(**args, **options)
    assert_bitwise_equal(out[0], q, "q_out")
    assert_bitwise_equal(out[1], k, "k_out")
    for name, cache, source in (("key_cache", out[2], k), ("value_cache", out[3], v)):
        assert_bitwise_equal(cache[0, 0], source[0], f"{name} slot 0")
        assert_bitwise_equal(cache[1, 1], source[1], f"{name} slot 5")
    for i, (a, b) in enumerate(zip(jax_out, out)):
        assert_bitwise_equal(a, b, f"torch vs JAX output {i}")


def test_fp8_store_of_bf16_subnormals_with_a_tiny_scale():
    """An fp8 cache with scale 2**-130: a bf16 subnormal 10 x 2**-130 is stored as 10.0 (issue 52
    saw 4.0), and every value as its exact quotient rounded to e4m3 (torch's cast)."""
    args, options = _rope_at_position_zero(torch.bfloat16, torch.float8_e4m3fn, 2.0 ** -130, 2.0 ** -130)
    for name in ("k", "v"):  # only subnormals: 1.0 / 2**-130 would saturate (torch's cast gives NaN)
        args[name][:, :, 1] = bf16_from_bits([SUBNORMAL]).to(DEVICE)
    ten = bf16_from_bits([0x0050]).to(DEVICE)  # 80 x 2**-133 = 10 x 2**-130
    assert ten.double().item() == 10 * 2.0 ** -130
    args["k"][0, 0, 2] = ten
    args["v"][1, 0, 3] = ten
    out = qsa_torch.rope_reshape_and_cache(**args, **options)
    assert out[2][0, 0, 0, 2].float().item() == 10.0
    assert out[3][1, 1, 0, 3].float().item() == 10.0
    for cache, source in ((out[2], args["k"]), (out[3], args["v"])):
        for slot, (page, offset) in enumerate(((0, 0), (1, 1))):
            expected = (source[slot].double() * 2.0 ** 130).float().to(torch.float8_e4m3fn)
            assert_bitwise_equal(cache[page, offset], expected, f"slot {slot}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_are_unchanged_by_the_patch(dtype):
    """float16 and float32 casts keep the interpreter's own (numpy's, exact) conversions."""
    x = torch.tensor([1e-7, 6e-8, -3.0, 65504.0], dtype=dtype).to(DEVICE)
    out = torch.empty(4, dtype=torch.bfloat16, device=DEVICE)
    _launch(_narrow_kernel, x, out, n=4)
    assert np.array_equal(bits_of(out), bits_of(x.cpu().float().to(torch.bfloat16)))
