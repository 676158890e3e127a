"""Torch internals behind a table (qsa_torch._accel._internals): the switch, and the public registration path.

The ops' own dispatcher kernels read torch._C and are used only with the
torch minors ``_internals.VERIFIED`` lists; any other torch (or
``QSA_OP_KERNELS=0``) registers every op through ``torch.library.custom_op``.
That path must keep every promise the op suites check: they run here again, in
a process that takes it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qsa_torch._accel import _fast_launch, _internals


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SWITCHES = {  # switch -> (its variable, the module whose version it reads, the decision)
    "op kernels": ("QSA_OP_KERNELS", _internals.torch, _internals._own_op_kernels),
    "fast launch": ("QSA_FAST_LAUNCH", _fast_launch.triton, _fast_launch._enabled),
}


@pytest.mark.parametrize("which, value, version, on", [
    ("op kernels", "", "2.11.0+cu130", True), ("op kernels", "auto", "2.13.0+cpu", True),
    ("op kernels", "", "2.99.0", False), ("op kernels", "0", "2.13.0", False),
    ("op kernels", "1", "2.99.0", True), ("op kernels", " yes ", "2.99.1", True),
    ("fast launch", "", "3.6.0", True), ("fast launch", "auto", "3.9.0", True), ("fast launch", "", "3.10.0", False),
    ("fast launch", "", "4.0.1", False), ("fast launch", "0", "3.6.0", False), ("fast launch", "off", "3.6.0", False),
    ("fast launch", "1", "3.10.0", True), ("fast launch", " ON ", "3.11.2", True)])
def test_private_paths_by_their_table_and_switch(monkeypatch, which, value, version, on):
    """On by the verified-versions table, off elsewhere; the environment variable forces either way."""
    variable, module, decide = SWITCHES[which]
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(module, "__version__", version)
    assert decide() is on


def test_a_torch_without_the_internals_takes_custom_op_unless_forced(monkeypatch):
    monkeypatch.setattr(_internals.torch, "__version__", "2.13.0")
    monkeypatch.delattr(torch._C, "_after_ADInplaceOrView_keyset")
    monkeypatch.setenv("QSA_OP_KERNELS", "auto")
    assert _internals._own_op_kernels() is False
    monkeypatch.setenv("QSA_OP_KERNELS", "1")
    with pytest.raises(RuntimeError, match="_after_ADInplaceOrView_keyset"):
        _internals._own_op_kernels()


def test_the_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv("QSA_OP_KERNELS", "custom")
    with pytest.raises(ValueError, match="QSA_OP_KERNELS must be 0, 1 or auto"):
        _internals._own_op_kernels()


def test_the_version_bumps_of_both_paths(monkeypatch):
    tensors = [torch.zeros(2), torch.zeros(3)]
    before = [t._version for t in tensors]
    _internals._public_increment_version(tensors)
    torch._C._increment_version(tensors)
    assert [t._version for t in tensors] == [v + 2 for v in before]


@pytest.mark.parametrize("values, expected", [
    ((), False), ((1, None, "x", torch.zeros(2)), False), ((torch.zeros(2), torch.zeros(2, requires_grad=True)), True),
    ((3.0, torch.zeros(2, requires_grad=True).detach()), False)])
def test_any_requires_grad_of_both_paths(values, expected):
    """The eager key's grad check: the public reading and torch._C's agree, non-tensors ignored."""
    assert _internals._public_any_requires_grad(*values) is expected
    assert torch._C._any_requires_grad(*values) is expected


def test_the_binding_registers_the_ops_through_custom_op():
    """QSA_ACCELERATE=0 (the binding alone; CI runs the whole suite so) or QSA_OP_KERNELS=0: every op
    is defined by torch.library.custom_op."""
    for variable in ("QSA_ACCELERATE", "QSA_OP_KERNELS"):
        env = dict(os.environ, **{variable: "0"})
        probe = subprocess.run([sys.executable, "-c", "import qsa_torch, torch; "
                                "import torch._library.custom_ops as c; "
                                "print(isinstance(c.OPDEFS.get('qsa::store_cache_rows'), c.CustomOpDef))"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert probe.stdout.split() == ["True"], variable + ": " + probe.stdout + probe.stderr
