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
