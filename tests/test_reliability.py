"""Nothing lost, nothing silent, second pass (issue 28): what each fix keeps true.

* ``TRITON_INTERPRET`` is read exactly as the installed Triton reads it;
* the scales' rules: one rule for every stage, Python-number scales checked;
* tuning values are refused at construction, naming the knob.

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
