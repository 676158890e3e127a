"""``qsa_kernels.runtime.env_switch``: one parser for the on/off ``QSA_*`` switches (issue 52, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qsa_kernels import runtime
from qsa_kernels.runtime import env_switch

VARIABLE = "QSA_TEST_SWITCH"


@pytest.mark.parametrize("raw", ["1", "on", "true", "yes", "TRUE", " Yes ", "On\n", "\t1"])
def test_on_spellings(monkeypatch, raw):
    monkeypatch.setenv(VARIABLE, raw)
    assert env_switch(VARIABLE, False) is True
    assert env_switch(VARIABLE, True) is True


@pytest.mark.parametrize("raw", ["0", "off", "false", "no", "FALSE", " No ", "OFF\n", "\t0"])
def test_off_spellings(monkeypatch, raw):
    monkeypatch.setenv(VARIABLE, raw)
    assert env_switch(VARIABLE, False) is False
    assert env_switch(VARIABLE, True) is False


@pytest.mark.parametrize("raw", [None, "", "   "])
@pytest.mark.parametrize("default", [False, True])
def test_unset_or_empty_is_the_default(monkeypatch, raw, default):
    if raw is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, raw)
    assert env_switch(VARIABLE, default) is default


@pytest.mark.parametrize("raw", ["2", "y", "n", "enable", "auto", "tru", "1 1", "-1", "0.0"])
def test_other_values_are_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(VARIABLE, raw)
    with pytest.raises(ValueError, match=rf"^{VARIABLE} must be one of 1, on, true, yes \(on\) or 0, off, false, "
                                         rf"no \(off\), or empty for the default \(off\), got {raw!r}"):
        env_switch(VARIABLE, False)


def _check_scales(raw: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, QSA_CHECK_SCALES=raw)
    return subprocess.run([sys.executable, "-c", "from qsa_kernels import runtime; print(runtime.CHECK_SCALES)"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_check_scales_reads_every_spelling():
    """``QSA_CHECK_SCALES=true`` is on (it was silently off), ``off`` off, and an unknown value
    stops the import with the variable's name instead of reading as off."""
    assert runtime.CHECK_SCALES is env_switch("QSA_CHECK_SCALES", False)
    on, off, bad = _check_scales("true"), _check_scales(" OFF "), _check_scales("sometimes")
    assert (on.returncode, on.stdout.strip()) == (0, "True"), on.stderr
    assert (off.returncode, off.stdout.strip()) == (0, "False"), off.stderr
    assert bad.returncode != 0 and "QSA_CHECK_SCALES must be one of" in bad.stderr
    assert "got 'sometimes'" in bad.stderr
