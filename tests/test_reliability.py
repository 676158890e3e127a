"""Nothing lost, nothing silent, second pass (issue 28): what each fix keeps true.

* ``TRITON_INTERPRET`` is read exactly as the installed Triton reads it;
* the scales' rules: one rule for every stage, Python-number scales checked;
* tuning values are refused at construction, naming the knob;
* ``QSA_CHECK_SCALES=1`` checks device scales' values.

(The pager's widths are in tests/test_paging.py; the step's memo, metadata
checks and build-before-launch in tests/test_step_planning.py.)
"""

from __future__ import annotations

import pytest

from qsa_kernels import runtime


# --------------------------------------------------------------------------
# TRITON_INTERPRET (item 9)
# --------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["1", "0", "", " 1 ", "1 ", "y", "Y", "yes", "on", "ON", "true", "True", "t",
                                   "2", "false", "off", "no", "n", " true"])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value):
    """Bug: the package stripped and lower-cased the value with its own list of spellings:
    ``" 1 "`` meant interpreted to the package and compiled to Triton, ``"y"`` the reverse,
    and the mismatch surfaced as misleading errors far from the cause."""
    from triton import knobs

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert runtime._decide() is bool(knobs.runtime.interpret), value


# --------------------------------------------------------------------------
# Scales (item 8; item 9's k_scale="abc")
# --------------------------------------------------------------------------

@pytest.mark.parametrize("adapter", ["torch", "jax"])
@pytest.mark.parametrize("name, value, expected", [
    ("k_scale", "abc", "QSAState.zeros: k_scale must be a finite positive Python number, got 'abc'"),
    ("k_scale", 0, "QSAState.zeros: k_scale must be a finite positive Python number, got 0"),
    ("v_scale", -0.5, "QSAState.zeros: v_scale must be a finite positive Python number, got -0.5"),
    ("v_scale", float("nan"), "QSAState.zeros: v_scale must be a finite positive Python number, got nan"),
    ("compressed_key_scale", float("inf"), "QSAState.zeros: compressed_key_scale must be a finite positive Python number, got inf"),
    ("k_scale", True, "QSAState.zeros: k_scale must be a finite positive Python number, got True"),
    ("k_scale", None, "QSAState.zeros: k_scale must be a finite positive Python number, got None"),
    ("k_scale", 1e-50, "QSAState.zeros: k_scale must be a finite positive number in float32 (the state holds it as a float32 array), got 1e-50"),
    ("v_scale", 1e39, "QSAState.zeros: v_scale must be a finite positive number in float32"),
    # A bad scale is refused even for a 16-bit cache, which would not use it.
    ("compressed_key_scale", -1, "QSAState.zeros: compressed_key_scale must be a finite positive Python number, got -1"),
])
def test_state_zeros_checks_python_scales(adapter, name, value, expected):
    """Bug: 0, negative, NaN and inf scales were accepted (v_scale=0 gives all-zero output, a
    negative k_scale negates the logits), and k_scale="abc" raised torch's or JAX's own error,
    naming no function."""
    import jax.numpy as jnp
    import torch

    import qsa_jax
    import qsa_torch
    from qsa_kernels.paging import CacheGeometry

    module, fp8, bf16 = ((qsa_torch, torch.float8_e4m3fn, torch.bfloat16) if adapter == "torch"
                         else (qsa_jax, jnp.float8_e4m3fn, jnp.bfloat16))
    geometry = CacheGeometry(page_size=4, num_pages=4, compress_ratio=2, compressed_page_size=2,
                             num_compressed_pages=4, max_context=8, max_requests=2)
    with pytest.raises(ValueError) as info:
        module.QSAState.zeros(geometry, kv_heads=1, head_dim=16, index_head_dim=16, dtype=bf16, cache_dtype=fp8,
                              **{name: value})
    assert str(info.value).startswith(expected), str(info.value)


def test_state_zeros_keeps_valid_scales():
    import numpy as np
    import torch

    import qsa_torch
    from qsa_kernels.paging import CacheGeometry

    geometry = CacheGeometry(page_size=4, num_pages=4, compress_ratio=2, compressed_page_size=2,
                             num_compressed_pages=4, max_context=8, max_requests=2)
    state = qsa_torch.QSAState.zeros(geometry, kv_heads=1, head_dim=16, index_head_dim=16, dtype=torch.bfloat16,
                                     cache_dtype=torch.float8_e4m3fn, k_scale=np.float64(0.3), v_scale=2,
                                     compressed_key_scale=1e-30)
    assert state.k_scale.dtype == torch.float32 and float(state.k_scale) == float(np.float32(0.3))
    assert float(state.v_scale) == 2.0 and state.compressed_key_scale is None  # a bf16 compressed-key cache


# --------------------------------------------------------------------------
# Tuning values refused at construction, naming the knob (item 3)
# --------------------------------------------------------------------------
# Device scales under QSA_CHECK_SCALES (item 8's debug switch)
# --------------------------------------------------------------------------

def _fp8_store(adapter: str, scale_value: float):
    """An fp8 cache, rows and a device scale of ``scale_value`` for store_cache_rows."""
    import numpy as np
    import torch

    rng = np.random.default_rng(11)
    rows = rng.standard_normal((3, 16)).astype(np.float32)
    cache = (rng.standard_normal((2, 4, 1, 16)) * 4).astype(np.float32)
    slots = np.array([5, -1, 0], dtype=np.int32)
    if adapter == "torch":
        import qsa_torch

        from .util import DEVICE

        return (qsa_torch.store_cache_rows, torch.from_numpy(cache).to(DEVICE, torch.float8_e4m3fn),
                torch.from_numpy(slots).to(DEVICE), torch.from_numpy(rows).to(DEVICE, torch.bfloat16),
                torch.tensor([scale_value], dtype=torch.float32, device=DEVICE))
    import jax.numpy as jnp

    import qsa_jax

    return (qsa_jax.store_cache_rows, jnp.asarray(cache, jnp.float8_e4m3fn), jnp.asarray(slots),
            jnp.asarray(rows, jnp.bfloat16), jnp.asarray([scale_value], jnp.float32))


def _bits(array):
    import numpy as np

    if hasattr(array, "detach"):
        import torch

        return array.detach().cpu().view(torch.uint8).numpy().copy()
    return np.asarray(array).view(np.uint8).copy()


@pytest.mark.parametrize("adapter", ["torch", "jax", "jax-jit"])
@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_check_scales_refuses_bad_device_scales_before_any_write(monkeypatch, adapter, value):
    """QSA_CHECK_SCALES=1 reads each fp8 scale on the host and refuses one that is not finite
    and > 0, naming the function and the argument; eager calls raise before any write (the
    cache's bits unchanged).  Under jax.jit the value is traced: the check runs with the
    computation and its error comes with it."""
    monkeypatch.setattr(runtime, "CHECK_SCALES", True)
    function, cache, slots, rows, scale = _fp8_store(adapter.split("-")[0], value)
    before = _bits(cache)
    expected = "store_cache_rows: scale must be finite and > 0"
    if adapter == "jax-jit":
        import jax

        with pytest.raises(Exception, match=expected):
            jax.block_until_ready(jax.jit(lambda c, s, r, k: function(c, s, r, scale=k))(cache, slots, rows, scale))
        return
    with pytest.raises(ValueError, match=expected):
        function(cache, slots, rows, scale=scale)
    assert (_bits(cache) == before).all(), "the cache changed under a call that raised"


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("adapter", ["torch", "jax"])
def test_check_scales_passes_good_scales_and_is_off_by_default(monkeypatch, adapter):
    """With the switch on, a valid scale gives the same bits as with it off; off (the default),
    a zero scale is the caller's contract: no error (docs/api.md, "Scales")."""
    monkeypatch.setattr(runtime, "CHECK_SCALES", False)
    function, cache, slots, rows, scale = _fp8_store(adapter, 0.25)
    unchecked = _bits(function(cache, slots, rows, scale=scale))
    monkeypatch.setattr(runtime, "CHECK_SCALES", True)
    function, cache, slots, rows, scale = _fp8_store(adapter, 0.25)
    assert (_bits(function(cache, slots, rows, scale=scale)) == unchecked).all()
    monkeypatch.setattr(runtime, "CHECK_SCALES", False)
    function, cache, slots, rows, zero = _fp8_store(adapter, 0.0)
    function(cache, slots, rows, scale=zero)


def test_check_scales_covers_the_steps_state_scales(monkeypatch):
    """The composed step reads its state's scales too (k_scale here, a device zero set after
    QSAState.zeros checked the Python number), and refuses before stage 1 writes."""
    import dataclasses

    import torch

    from .test_bad_arguments import step_arguments
    from .test_step_planning import STATE_FIELDS

    monkeypatch.setattr(runtime, "CHECK_SCALES", True)
    arguments = step_arguments()
    state = arguments["state"]
    scale = torch.ones((), dtype=torch.float32, device=state.key_cache.device)
    state = arguments["state"] = dataclasses.replace(
        state, key_cache=state.key_cache.to(torch.float8_e4m3fn), value_cache=state.value_cache.to(torch.float8_e4m3fn),
        k_scale=scale * 0.0, v_scale=scale.clone())
    before = {n: _bits(getattr(state, n)) for n in STATE_FIELDS}
    import qsa_torch

    with pytest.raises(ValueError, match="qsa_attention_step: k_scale must be finite and > 0"):
        qsa_torch.qsa_attention_step(**arguments)
    for n in STATE_FIELDS:
        assert (_bits(getattr(state, n)) == before[n]).all(), n


# --------------------------------------------------------------------------

def _tuning_cases():
    from qsa_kernels import tuning as t

    table = ((4, 32 * 1024, 8, 3, 264), (None, 16 * 1024, 2, 2, 264))
    return [
        # Bug: these constructed fine and failed at launch ("arange's range must be a power of 2").
        (lambda: t.AttentionTuning(tile_bytes=3000), "AttentionTuning: tile_bytes must be a power of two, got 3000"),
        (lambda: t.TopkTuning(max_groups=3), "TopkTuning: max_groups must be a power of two, got 3"),
        (lambda: t.TopkTuning(path="sliced", tile=100), "TopkTuning: tile must be a power of two, got 100"),
        (lambda: t.CompressTuning(tile_elements=1000), "CompressTuning: tile_elements must be a power of two, got 1000"),
        (lambda: t.RopeCacheTuning(tile_elements=1500), "RopeCacheTuning: tile_elements must be a power of two, got 1500"),
        # Warps as Triton compiles them (a power of two) and CUDA runs them (<= 1024 threads).
        (lambda: t.RopeCacheTuning(num_warps=3), "RopeCacheTuning: num_warps must be a power of two, got 3"),
        (lambda: t.SelectTuning(fused_warps=64), "SelectTuning: fused_warps must be at most 32, got 64"),
        (lambda: t.SelectTuning(fp8_row_warps=6), "SelectTuning: fp8_row_warps must be a power of two, got 6"),
        # Bug: launch_table rows were never checked ("x": a raw TypeError at plan time; 0 or
        # negative warps and stages accepted).
        (lambda: t.AttentionTuning(launch_table=((None, "x", 4, 2, 264),)),
         "AttentionTuning: launch_table row 0 tile bytes must be a power of two, got 'x' in (None, 'x', 4, 2, 264)"),
        (lambda: t.AttentionTuning(launch_table=(table[0], (None, 16384, 0, 2, 264))),
         "AttentionTuning: launch_table row 1 warps must be a power of two up to 32, got 0"),
        (lambda: t.AttentionTuning(fp8_launch_table=((4, 1024, 4, -1, 264), table[1])),
         "AttentionTuning: fp8_launch_table row 0 stages must be a positive int, got -1"),
        (lambda: t.AttentionTuning(launch_table=((None, 16384, 4, 2, 0),)),
         "AttentionTuning: launch_table row 0 target programs must be a positive int, got 0"),
        (lambda: t.AttentionTuning(launch_table=(("4", 16384, 4, 2, 264), table[1])),
         "AttentionTuning: launch_table row 0 most programs must be a positive int or None, got '4'"),
        (lambda: t.AttentionTuning(launch_table=((True, 16384, 4, 2, 264), table[1])),
         "AttentionTuning: launch_table row 0 most programs must be a positive int or None, got True"),
        (lambda: t.AttentionTuning(launch_table=((None, 16384, 4, 2.0, 264),)),
         "AttentionTuning: launch_table row 0 stages must be a positive int, got 2.0"),
        (lambda: t.AttentionTuning(launch_table=(1, 2)), "AttentionTuning: launch_table must be a sequence of rows"),
    ]


@pytest.mark.parametrize("index", range(len(_tuning_cases())))
def test_tuning_values_are_refused_at_construction(index):
    make, message = _tuning_cases()[index]
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


def test_valid_tuning_values_still_plan_and_run():
    """Powers of two other than the defaults: accepted, and they reach the launch."""
    import numpy as np
    import torch

    import qsa_torch
    from qsa_kernels import tuning as t

    from .util import DEVICE

    table = ((None, 8 * 1024, 4, 1, 64),)
    logits = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 300)).astype(np.float32)).to(DEVICE)
    visible = torch.tensor([300, 40], device=DEVICE)
    expected = qsa_torch.topk_blocks(logits, visible, 5)
    with t.override(topk=t.TopkTuning(path="sliced", tile=64, max_groups=8)):
        assert torch.equal(qsa_torch.topk_blocks(logits, visible, 5), expected)
    assert t.AttentionTuning(tile_bytes=4096, launch_table=table, fp8_launch_table=table).launch_table == table
