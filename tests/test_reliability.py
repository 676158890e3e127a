"""Nothing lost, nothing silent, second pass (issue 28): what each fix keeps true.

* ``TRITON_INTERPRET`` is read exactly as the installed Triton reads it;
* the scales' rules: one rule for every stage, Python-number scales checked;
* fp8 writes keep NaN a NaN (GPU: the interpreter's fp8 casts are wrong);
* a row past ``cos_sin`` leaves the compressed-key cache as it was.

(The pager's widths are in tests/test_paging.py; tuning values in
tests/test_validation.py's neighbourhood: below, with the knobs named.)
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
