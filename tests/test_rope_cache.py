"""Stage 1 (rope_reshape_and_cache): both adapters against the float64 reference,
torch-vs-JAX bitwise parity under jax.jit, untouched cache cells, validation."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
import triton

import qsa_jax
import qsa_torch
from qsa_kernels import runtime

from . import reference as R
from .util import DEVICE, assert_bitwise_equal, assert_close, f64, host, to_jax, tolerance


@dataclasses.dataclass
class Case:
    """One stage-1 configuration; options are spread pairwise over the cases."""

    T: int = 5
    T_kv: int | None = None
    QH: int = 4
    KH: int = 2
    D: int = 32
    P: int = 8
    blocks: int = 6
    layout: str = "flash"  # flash | paged | shuffled
    X: int = 8
    dtype: torch.dtype = torch.bfloat16
    cache_fp8: bool = False
    cos_sin_fp32: bool = False
    full_freqs: bool = False  # F == D instead of D/2
    is_neox: bool = True
    offsets: bool = False
    scales: bool = False
    swa: bool = False
    zeros: bool = False
    index_dtype: torch.dtype = torch.int64
    bad_positions: bool = False
    packed_qkv: bool = False  # q, k, v strided views of one packed tensor
    cache_view: bool = False  # caches are non-contiguous views of larger tensors
    no_rope: bool = False  # cos_sin=None: q and k arrive rotated (issue 56)
    scale_values: tuple = (0.5, [2.0])  # k_scale, v_scale when ``scales`` (a 0-d and a 1-element array)
    seed: int = 0


def make_inputs(c: Case):
    g = torch.Generator().manual_seed(c.seed)
    t_kv = c.T_kv if c.T_kv is not None else c.T
    rnd = lambda *shape, dtype=c.dtype: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    if c.packed_qkv:
        assert t_kv == c.T
        qkv = rnd(c.T, (c.QH + 2 * c.KH) * c.D).view(c.T, c.QH + 2 * c.KH, c.D)
        q, k, v = qkv[:, : c.QH], qkv[:, c.QH: c.QH + c.KH], qkv[:, c.QH + c.KH:]
    else:
        q, k, v = rnd(c.T, c.QH, c.D), rnd(t_kv, c.KH, c.D), rnd(t_kv, c.KH, c.D)
    cache_dtype = torch.float8_e4m3fn if c.cache_fp8 else c.dtype
    if c.layout == "flash":
        k_shape = v_shape = (c.blocks, c.P, c.KH, c.D)
    else:
        k_shape = (c.blocks, c.KH, c.D // c.X, c.P, c.X)
        v_shape = (c.blocks, c.KH, c.D, c.P) if c.layout == "paged" else (c.blocks, c.KH, c.P // c.X, c.D, c.X)
    if c.cache_view:
        # Every other page of a larger pool: strided, never to be copied.
        key_pool = rnd(2 * c.blocks, *k_shape[1:], dtype=torch.float32).to(cache_dtype)
        value_pool = rnd(2 * c.blocks, *v_shape[1:], dtype=torch.float32).to(cache_dtype)
        key_cache, value_cache = key_pool[::2], value_pool[::2]
    else:
        key_cache = rnd(*k_shape, dtype=torch.float32).to(cache_dtype)
        value_cache = rnd(*v_shape, dtype=torch.float32).to(cache_dtype)
    num_slots = c.blocks * c.P
    # Distinct shuffled slots, with -1 and out-of-range ones mixed in.
    slots = torch.randperm(num_slots, generator=g)[:t_kv].clone()
    if t_kv >= 3:
        slots[1] = -1
        slots[-1] = num_slots + 3
    max_position = 64
    freqs = c.D if c.full_freqs else c.D // 2
    angles = torch.rand(max_position, freqs, generator=g, dtype=torch.float64) * 6.3
    cs_dtype = torch.float32 if c.cos_sin_fp32 else c.dtype
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(cs_dtype)
    positions = torch.randint(0, max_position - 8, (c.T,), generator=g)
    offsets = torch.randint(0, 8, (c.T,), generator=g) if c.offsets else None
    if c.bad_positions and c.T >= 3:
        positions[0] = max_position + 5
        positions[2] = -3
    swa = None
    if c.swa:
        # The final slot is swa[slot]; slot values past the table are skipped.
        table = num_slots + 4
        swa = torch.randperm(table, generator=g)[:table]
        swa[swa >= num_slots] = -1
        swa_len = num_slots - 2
        swa = swa[:swa_len].clone()
        slots = torch.randperm(swa_len, generator=g)[:t_kv].clone()
        if t_kv >= 3:
            slots[1] = -1
            slots[-1] = swa_len + 1
        # Keep final slots distinct: two rows writing one slot is unspecified.
        seen = set()
        for i, s in enumerate(slots.tolist()):
            final = int(swa[s]) if 0 <= s < swa_len else -1
            if final >= 0 and final in seen:
                slots[i] = -1
            seen.add(final)
        swa = swa.to(c.index_dtype)
    scale = lambda value: torch.tensor(value, dtype=torch.float32)  # noqa: E731
    args = dict(
        q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache,
        slot_mapping=slots.to(c.index_dtype), positions=positions.to(c.index_dtype), cos_sin=cos_sin,
    )
    options = dict(
        is_neox=c.is_neox,
        k_scale=scale(c.scale_values[0]) if c.scales else None,
        v_scale=scale(c.scale_values[1]) if c.scales else None,
        offsets=offsets.to(c.index_dtype) if offsets is not None else None,
        swa_slot_mapping=swa,
        return_zeros=c.zeros,
    )
    move = lambda x: x.to(DEVICE) if isinstance(x, torch.Tensor) else x  # noqa: E731
    if c.cache_view:
        args["key_cache"], args["value_cache"] = key_pool.to(DEVICE)[::2], value_pool.to(DEVICE)[::2]
        args = {n: (a if n in ("key_cache", "value_cache") else move(a)) for n, a in args.items()}
    else:
        args = {n: move(a) for n, a in args.items()}
    if c.packed_qkv:
        qkv = qkv.to(DEVICE)
        args["q"], args["k"], args["v"] = qkv[:, : c.QH], qkv[:, c.QH: c.QH + c.KH], qkv[:, c.QH + c.KH:]
    if c.no_rope:
        args["cos_sin"] = None
    return args, {n: move(o) for n, o in options.items()}


def reference_for(c: Case, args, options):
    # cos_sin=None: the reference rotates by an identity table (cos 1, sin 0) past every position.
    cos_sin = R.identity_cos_sin(1024, c.D) if args["cos_sin"] is None else f64(args["cos_sin"])
    return R.rope_reshape_and_cache(
        f64(args["q"]), f64(args["k"]), f64(args["v"]), f64(args["key_cache"]), f64(args["value_cache"]),
        host(args["slot_mapping"]), host(args["positions"]), cos_sin,
        is_neox=c.is_neox, layout=c.layout, x=c.X,
        k_scale=None if options["k_scale"] is None else float(options["k_scale"].cpu()),
        v_scale=None if options["v_scale"] is None else float(options["v_scale"].cpu().reshape(())),
        offsets=None if options["offsets"] is None else host(options["offsets"]),
        swa_slot_mapping=None if options["swa_slot_mapping"] is None else host(options["swa_slot_mapping"]),
        fp8=c.cache_fp8,
    )


def run_jax(args, options):
    names = list(args)
    array_options = {n: o for n, o in options.items() if isinstance(o, torch.Tensor)}
    static = {n: o for n, o in options.items() if not isinstance(o, torch.Tensor)}

    @jax.jit
    def call(arrays, option_arrays):
        return qsa_jax.rope_reshape_and_cache(**arrays, **option_arrays, **static)

    return call({n: None if args[n] is None else to_jax(args[n]) for n in names},
                {n: to_jax(o) for n, o in array_options.items()})


def check_case(c: Case):
    args, options = make_inputs(c)
    originals = {n: args[n].clone() for n in ("key_cache", "value_cache")}
    jax_out = run_jax(args, options)  # before torch updates the caches in place
    ref_q, ref_k, ref_kc, ref_vc, (wrote_k, wrote_v) = reference_for(c, args, options)
    out = qsa_torch.rope_reshape_and_cache(**args, **options)
    check_outputs(c, args, options, out, jax_out, originals, (ref_q, ref_k, ref_kc, ref_vc, (wrote_k, wrote_v)))
    return args, options, out


def check_outputs(c: Case, args, options, out, jax_out, originals, reference):
    ref_q, ref_k, ref_kc, ref_vc, (wrote_k, wrote_v) = reference

    assert len(out) == (5 if c.zeros else 4)
    assert out[2] is args["key_cache"] and out[3] is args["value_cache"], "caches must be returned in place"
    tol = tolerance(c.dtype)
    assert_close(out[0], ref_q, tol, "q_out")
    assert_close(out[1], ref_k, tol, "k_out")
    cache_tol = 0.07 if c.cache_fp8 else tol
    for name, ref, wrote in (("key_cache", ref_kc, wrote_k), ("value_cache", ref_vc, wrote_v)):
        got = out[2 if name == "key_cache" else 3]
        assert_close(f64(got)[wrote], ref[wrote], cache_tol, f"{name} written cells")
        # Cells no valid slot addresses are bit-identical after the call.
        assert_bitwise_equal(host(got)[~wrote], host(originals[name])[~wrote], f"{name} untouched cells")
        assert wrote.any(), "the case writes no cell: it tests nothing"
    if c.zeros:
        z = f64(out[4])
        assert z.shape == tuple(args["q"].shape) and not np.any(z), "zeros must be all zeros"
    for i, (a, b) in enumerate(zip(jax_out, out)):
        assert_bitwise_equal(a, b, f"torch vs JAX output {i}")


CASES = {
    "neox_halffreq_flash_bf16_offsets": Case(offsets=True, P=16, blocks=3),
    "gptj_fullfreq_paged_fp16_swa_zeros": Case(is_neox=False, full_freqs=True, layout="paged", dtype=torch.float16, swa=True, zeros=True, index_dtype=torch.int32),
    "neox_fullfreq_shuffled_fp32_kvonly": Case(full_freqs=True, layout="shuffled", dtype=torch.float32, T=4, T_kv=7),
    "gptj_halffreq_flash_bf16_fp32cos_badpos": Case(is_neox=False, cos_sin_fp32=True, bad_positions=True, QH=8, KH=1),
    "packed_qkv_cache_view_paged": Case(packed_qkv=True, cache_view=True, layout="paged", QH=12, KH=1, X=4),
    "gqa12_d256_shuffled_kvonly_gptj": Case(QH=24, KH=2, D=256, T=2, T_kv=4, layout="shuffled", X=16, P=16, is_neox=False, offsets=True),
    "d64_gqa4_fp16_flash_int32_swa": Case(D=64, QH=8, KH=2, dtype=torch.float16, index_dtype=torch.int32, swa=True, cache_view=True),
    "d128_mha_bf16_paged_zeros_badpos": Case(D=128, QH=2, KH=2, T=6, layout="paged", X=8, zeros=True, bad_positions=True, full_freqs=True),
    "single_token": Case(T=1, QH=4, KH=4),
    # Scales on 16/32-bit caches, as the source applies them (issue 56): stored = x * (1 / scale).
    "scaled_fp32_paged_kvonly": Case(dtype=torch.float32, scales=True, scale_values=(0.3, [3.0]), layout="paged",
                                     T=4, T_kv=6),
    "scaled_fp16_flash_gptj_badpos": Case(dtype=torch.float16, scales=True, scale_values=(1.7, 0.45), is_neox=False,
                                          bad_positions=True),
    "scaled_bf16_shuffled": Case(scales=True, scale_values=(0.3, [3.0]), layout="shuffled", X=4, P=8),
    # cos_sin=None: q and k pass through unrotated (issue 56); a negative position is still outside.
    "no_rope_flash_bf16_badpos_offsets": Case(no_rope=True, bad_positions=True, offsets=True),
    "no_rope_paged_fp32_kvonly_scaled": Case(no_rope=True, dtype=torch.float32, layout="paged", T=3, T_kv=5,
                                             scales=True, scale_values=(0.3, [3.0])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_against_reference_and_jax(name):
    check_case(CASES[name])


# fp8 writes run on the CPU too: qsa_kernels.interpreter_compat makes the interpreter's e4m3
# casts those of sm_90.
@pytest.mark.parametrize("layout", ["flash", "paged", "shuffled"])
def test_fp8_caches_with_scales(layout):
    check_case(Case(cache_fp8=True, scales=True, layout=layout, X=16, P=16, D=64, T=6, T_kv=9))


def test_fp8_saturates_instead_of_overflowing():
    """Finite values past 448 and +-inf saturate to +-448 (never inf); a NaN stays NaN (issue 28,
    item 4: it was saturated to -448 too)."""
    c = Case(cache_fp8=True, scales=True, T=4, D=64)  # fp8 caches take both scales (issue 28)
    args, options = make_inputs(c)
    args["k"].mul_(1000.0)
    args["v"].mul_(1000.0)
    args["v"][0, 0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])  # row 0 is cached
    qsa_torch.rope_reshape_and_cache(**args, **options)
    for cache in (args["key_cache"], args["value_cache"]):
        values = cache.float()
        assert not torch.isinf(values).any(), "fp8 overflow must saturate, not give inf"
        assert values[~values.isnan()].abs().max() == 448.0
    values = args["value_cache"].float().flatten()
    assert values.isnan().sum() == 1, "the NaN of v is a NaN code"
    assert (values == 448.0).any() and (values == -448.0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_scales_on_16_and_32_bit_caches_round_as_the_source(dtype):
    """A scale given with a non-fp8 cache is applied as the source applies it (issue 56): the
    cached v (and a KV-only row's k, both unrotated) is ``x * (1 / scale)`` in float32, then the
    cache dtype, bit for bit.  (bf16 is checked within tolerance only: the interpreter truncates
    float32 to bf16 where the GPU rounds to nearest.)"""
    c = Case(dtype=dtype, scales=True, scale_values=(0.3, [3.0]), T=3, T_kv=6, P=4, blocks=4)
    args, options, out = check_case(c)
    k_scale, v_scale = (float(options[n].reshape(())) for n in ("k_scale", "v_scale"))
    slots = host(args["slot_mapping"])
    checked = 0
    for row, slot in enumerate(slots):
        if not 0 <= slot < c.blocks * c.P:
            continue
        page, offset = divmod(int(slot), c.P)
        expected_v = torch.from_numpy(R.source_scaled(host(args["v"][row].float()), v_scale)).to(dtype)
        assert_bitwise_equal(out[3][page, offset], expected_v, f"value_cache row {row}")
        if row >= c.T:  # KV-only: k is cached unrotated
            expected_k = torch.from_numpy(R.source_scaled(host(args["k"][row].float()), k_scale)).to(dtype)
            assert_bitwise_equal(out[2][page, offset], expected_k, f"key_cache row {row}")
        checked += 1
    assert checked >= 3
    assert not torch.equal(out[3][divmod(int(slots[0]), c.P)], args["v"][0]), "v_scale was not applied"


def test_one_scale_on_a_16_bit_cache_scales_only_its_cache():
    """Each scale is optional on a 16-bit cache: v_scale alone scales the values, not the keys."""
    c = Case(dtype=torch.float16, T=4, P=4, blocks=4)
    args, options = make_inputs(c)
    options = dict(options, v_scale=torch.tensor(0.25, device=DEVICE))
    plain = qsa_torch.rope_reshape_and_cache(**{**args, "key_cache": args["key_cache"].clone(),
                                                "value_cache": args["value_cache"].clone()}, is_neox=True)
    jax_out = run_jax(args, options)
    scaled = qsa_torch.rope_reshape_and_cache(**args, **options)
    assert_bitwise_equal(scaled[2], plain[2], "key_cache (no k_scale)")
    for row, slot in enumerate(host(args["slot_mapping"])):
        if 0 <= slot < c.blocks * c.P:
            page, offset = divmod(int(slot), c.P)
            assert_bitwise_equal(scaled[3][page, offset], (args["v"][row].double() * 4).half(), f"v row {row} x 4")
    for i, (a, b) in enumerate(zip(jax_out, scaled)):
        assert_bitwise_equal(a, b, f"torch vs JAX output {i}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("layout, dtype, neox", [("flash", torch.bfloat16, True), ("paged", torch.float16, False)])
def test_cos_sin_none_is_an_identity_table_and_reads_none(layout, dtype, neox):
    """``cos_sin=None`` (issue 56): bit for bit an identity table (cos 1, sin 0) that covers every
    non-negative position, in both frameworks; a negative position still gives NaN rows and no
    write; the launch reads no table."""
    c = Case(no_rope=True, layout=layout, dtype=dtype, is_neox=neox, bad_positions=True, T=5, T_kv=7, X=4)
    args, options = make_inputs(c)
    table = torch.from_numpy(R.identity_cos_sin(1024, c.D)).to(dtype).to(DEVICE)
    assert int(host(args["positions"]).max()) >= 64  # past the cases' tables (max_position + 5)
    with_table = qsa_torch.rope_reshape_and_cache(**{**args, "cos_sin": table, "key_cache": args["key_cache"].clone(),
                                                     "value_cache": args["value_cache"].clone()}, **options)
    jax_out = run_jax(args, options)
    out = qsa_torch.rope_reshape_and_cache(**args, **options)
    for i, (a, b, j) in enumerate(zip(out, with_table, jax_out)):
        assert_bitwise_equal(a, b, f"cos_sin=None vs an identity table, output {i}")
        assert_bitwise_equal(j, a, f"torch vs JAX output {i}")
    assert np.isnan(f64(out[0])[2]).all() and np.isfinite(f64(out[0])[[0, 1, 3, 4]]).all()  # position -3
    program = qsa_torch.rope_reshape_and_cache.plan(**args, **options)
    (launch,) = program.launches
    assert launch.constexprs["ROPE"] is False and "cos_sin" not in launch.inputs


@pytest.mark.gpu
@pytest.mark.parametrize("d", [256, 192, 96, 80])
def test_production_shape_against_reference(d):
    check_case(Case(T=64, QH=24, KH=2, D=d, P=64, blocks=4, offsets=True))


def test_empty_batch():
    c = Case(T=0, T_kv=0)
    args, options = make_inputs(c)
    before = args["key_cache"].clone()
    q_out, k_out, key_cache, _ = qsa_torch.rope_reshape_and_cache(**args, **options)
    assert q_out.shape == (0, c.QH, c.D) and k_out.shape == (0, c.KH, c.D)
    assert_bitwise_equal(key_cache, before, "cache after an empty call")
    jax_out = run_jax(*make_inputs(c))
    assert jax_out[0].shape == (0, c.QH, c.D)


def test_only_the_owning_rows_write():
    """Every KV row writes exactly its own slot: scrambling one row's k changes one cache cell row."""
    c = Case(T=6, P=4, blocks=4, QH=4, KH=2, D=16)
    args, options = make_inputs(c)
    first = qsa_torch.rope_reshape_and_cache(**args, **options)[2].clone()
    args2, _ = make_inputs(c)
    args2["k"][3] += 1.0
    second = qsa_torch.rope_reshape_and_cache(**args2, **options)[2]
    slot = int(args["slot_mapping"][3])
    page, offset = divmod(slot, c.P)
    changed = (host(first).view(np.uint16) != host(second).view(np.uint16)).any(axis=-1)
    expected = np.zeros_like(changed)
    expected[page, offset, :] = True
    assert np.array_equal(changed, expected)


# --------------------------------------------------------------------------
# Any even head dim (issue 50): D/2 padded to BLOCK_HALF lanes, a power of two
# --------------------------------------------------------------------------

#: Models' dims (80, 96, 192) and small ones for the interpreter; NeoX and GPT-J, F = D/2 and
#: F = D, every layout whose X divides D, fp8, no table, KV-only rows, 16/32-bit dtypes.
EVEN_HEAD_DIM_CASES = {
    "d80_neox_halffreq_flash_offsets": Case(D=80, T=3, QH=4, KH=2, offsets=True),
    "d80_gptj_fullfreq_paged_x16_fp16_kvonly": Case(D=80, T=3, T_kv=5, layout="paged", X=16, is_neox=False,
                                                    full_freqs=True, dtype=torch.float16),
    "d96_neox_fullfreq_shuffled_x16_zeros": Case(D=96, T=3, QH=4, KH=1, layout="shuffled", X=16, P=16, blocks=3,
                                                 full_freqs=True, zeros=True),
    "d96_gptj_halffreq_flash_fp32cos_badpos": Case(D=96, T=5, QH=2, KH=2, is_neox=False, cos_sin_fp32=True,
                                                   bad_positions=True),
    "d192_gptj_halffreq_paged_x8_fp32": Case(D=192, T=2, T_kv=3, QH=2, KH=1, layout="paged", X=8, is_neox=False,
                                             dtype=torch.float32),
    "d192_neox_fullfreq_flash_swa": Case(D=192, T=3, QH=2, KH=1, full_freqs=True, swa=True, cache_view=True),
    "d48_fp8_paged_x16_scales": Case(D=48, T=4, T_kv=6, layout="paged", X=16, P=16, blocks=3, cache_fp8=True,
                                     scales=True),
    "d24_gptj_fullfreq_shuffled_x8_packed": Case(D=24, layout="shuffled", X=8, is_neox=False, full_freqs=True,
                                                 packed_qkv=True),
    "d6_neox_paged_x2_int32": Case(D=6, QH=6, KH=3, layout="paged", X=2, index_dtype=torch.int32),
    "d10_no_rope_gptj_flash_badpos": Case(D=10, no_rope=True, is_neox=False, bad_positions=True, offsets=True),
    "d2_one_pair_scaled": Case(D=2, QH=2, KH=1, dtype=torch.float32, scales=True, scale_values=(0.3, [3.0])),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", list(EVEN_HEAD_DIM_CASES))
def test_any_even_head_dim_against_reference_and_jax(name):
    c = EVEN_HEAD_DIM_CASES[name]
    args, options, _ = check_case(c)
    (launch,) = qsa_torch.rope_reshape_and_cache.plan(**args, **options).launches
    assert launch.constexprs["BLOCK_HALF"] == triton.next_power_of_2(c.D // 2)


class Margins:
    """Arrays as views inside larger buffers whose margins (``WIDTH`` elements on each
    side) hold 0x7F bytes; :meth:`check` asserts that nothing wrote into a margin."""

    WIDTH = 64  # elements: keeps 16-byte alignment for every dtype

    def __init__(self):
        self.empty = torch.empty  # the allocator in force underneath (conftest's poisoned one)
        self.buffers: list = []

    def allocate(self, shape, dtype, device) -> torch.Tensor:
        size = int(np.prod(shape, dtype=np.int64))
        buffer = self.empty(size + 2 * self.WIDTH, dtype=dtype, device=device)
        buffer.view(torch.uint8).fill_(0x7F)
        self.buffers.append((buffer, buffer.clone()))
        return buffer[self.WIDTH: self.WIDTH + size].view(shape)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        view = self.allocate(tuple(tensor.shape), tensor.dtype, tensor.device)
        return view.copy_(tensor)

    def torch_empty(self, *shape, dtype=None, device=None, **options):
        """``torch.empty`` whose results have margins (the adapters' outputs)."""
        if options or dtype is None:
            return self.empty(*shape, dtype=dtype, device=device, **options)
        return self.allocate(tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape,
                             dtype, device)

    def check(self) -> None:
        assert self.buffers, "no array was given margins"
        w = self.WIDTH
        for buffer, before in self.buffers:
            assert_bitwise_equal(buffer[:w], before[:w], "the margin before an array")
            assert_bitwise_equal(buffer[-w:], before[-w:], "the margin after an array")


@pytest.mark.parametrize("layout, neox", [("flash", True), ("paged", False), ("shuffled", True)])
def test_padded_lanes_write_nothing_outside_the_arrays(layout, neox, monkeypatch):
    """D = 40: 20 rotation pairs in 32 lanes, 40 values in 64.  The caches, and q_out, k_out and
    zeros as both adapters allocate them, sit inside larger buffers with poisoned margins: the
    margins come back bit-identical, and so does every cache cell no slot addresses; the last
    slot (the caches' last cell) is written, so a padded lane past it would land in a margin."""
    c = Case(D=40, T=4, T_kv=5, QH=6, KH=2, P=8, blocks=2, layout=layout, X=8, is_neox=neox, zeros=True)
    margins = Margins()
    monkeypatch.setattr(torch, "empty", margins.torch_empty)
    args, options = make_inputs(c)
    last = c.blocks * c.P - 1  # the caches' last cells; row 4 is KV-only
    args["slot_mapping"] = torch.tensor([last, -1, 0, 5, 9], dtype=c.index_dtype, device=DEVICE)
    args["key_cache"], args["value_cache"] = margins.copy(args["key_cache"]), margins.copy(args["value_cache"])
    originals = {n: args[n].clone() for n in ("key_cache", "value_cache")}
    jax_out = run_jax(args, options)
    out = qsa_torch.rope_reshape_and_cache(**args, **options)
    check_outputs(c, args, options, out, jax_out, originals, reference_for(c, args, options))
    # The CPU's JAX runs the kernels on torch tensors (allocated through torch.empty, so with margins);
    # a GPU's JAX allocates its outputs in XLA (compared bitwise with torch's instead).
    adapters = 2 if runtime.INTERPRETED else 1
    assert len(margins.buffers) >= 2 + 3 * adapters, "q_out, k_out and zeros of each adapter have margins"
    margins.check()


# --------------------------------------------------------------------------
# Validation: every bad-argument case is a row of tests/test_bad_arguments.py.
# --------------------------------------------------------------------------

def test_wrong_array_types():
    args, options = make_inputs(Case())
    with pytest.raises(TypeError, match="rope_reshape_and_cache: positions must be a torch.Tensor"):
        qsa_torch.rope_reshape_and_cache(**{**args, "positions": host(args["positions"])}, **options)
    jax_args = {n: to_jax(a) for n, a in args.items()}
    with pytest.raises(TypeError, match="rope_reshape_and_cache: q must be a JAX array"):
        qsa_jax.rope_reshape_and_cache(**{**jax_args, "q": args["q"]}, is_neox=True)


@pytest.mark.skipif(not runtime.INTERPRETED, reason="needs two torch devices: CPU and meta work under the interpreter")
def test_mixed_devices_rejected():
    args, options = make_inputs(Case())
    args["positions"] = args["positions"].to("meta")
    with pytest.raises(ValueError, match="all arrays must be on one device: positions"):
        qsa_torch.rope_reshape_and_cache(**args, **options)


@pytest.mark.gpu
def test_cpu_tensor_in_compiled_process_rejected():
    args, options = make_inputs(Case())
    args = {n: a.cpu() for n, a in args.items()}
    options = {n: (o.cpu() if isinstance(o, torch.Tensor) else o) for n, o in options.items()}
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        qsa_torch.rope_reshape_and_cache(**args, **options)


@pytest.mark.gpu
def test_jax_donation_updates_cache_in_place():
    args, options = make_inputs(Case(T=8, P=16, blocks=4))
    jax_args = {n: to_jax(a) for n, a in args.items()}
    names = list(jax_args)
    donated = (names.index("key_cache"), names.index("value_cache"))

    def step(*arrays):
        return qsa_jax.rope_reshape_and_cache(*arrays, is_neox=True)

    call = jax.jit(step, donate_argnums=donated)
    key_cache = jax_args["key_cache"]
    pointer = key_cache.unsafe_buffer_pointer()
    out = call(*jax_args.values())
    assert out[2].unsafe_buffer_pointer() == pointer, "donated key_cache was copied"
    assert key_cache.is_deleted(), "the donated input must be consumed"


@pytest.mark.gpu
def test_torch_uses_current_stream():
    """The kernel must run on the caller's current stream, ordered after its prior work."""
    args, options = make_inputs(Case(T=8))
    new_q = torch.randn_like(args["q"])
    expected = qsa_torch.rope_reshape_and_cache(**{**make_inputs(Case(T=8))[0], "q": new_q}, **options)[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # a launch on another stream would read q before the copy below
        args["q"].copy_(new_q)
        out = qsa_torch.rope_reshape_and_cache(**args, **options)
    torch.cuda.current_stream().wait_stream(stream)
    assert_bitwise_equal(out[0], expected, "q_out computed on the side stream")


@pytest.mark.gpu
def test_jax_cpu_array_in_compiled_process_rejected():
    args, options = make_inputs(Case())
    cpu = jax.devices("cpu")[0]
    jax_args = {n: jax.device_put(to_jax(a), cpu) for n, a in args.items()}
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        qsa_jax.rope_reshape_and_cache(**jax_args, is_neox=True)
