"""Which of torch's private internals this process uses: one table, one switch.

The ops' own dispatcher kernels (``qsa_torch._accel._ops``)
and the eager path's version bumps call into ``torch._C``:
``_AutoDispatchBelowADInplaceOrView``, ``_after_ADInplaceOrView_keyset``,
``_any_requires_grad``, ``_increment_version`` and ``OpOverload.redispatch``
by keyset.  They are used only with the torch minors in :data:`VERIFIED`;
any other torch registers each op through ``torch.library.custom_op`` (the
public path: the same schemas, results, version bumps and errors, with more
host time per op call) and bumps versions through
``torch.autograd.graph.increment_version``.  ``QSA_OP_KERNELS=0`` takes the
public path with any torch, ``QSA_OP_KERNELS=1`` the own kernels with any
torch that has those names; decided once, at import.

The checks that decide whether a call may skip the dispatcher (no dispatch
or torch-function mode, no functionalization) read ``torch._C`` too, with
every torch: where a name is missing, a mode is assumed (the call goes
through its op, which is always correct).

The eager path's check that a call's tensors match a recent call's
(``qsa_torch._accel._eager``) uses ``torch._C._dynamo.guards.TensorGuards``, the C
check ``torch.compile`` guards its graphs with (type, dispatch keys -- so
device type, layout and the neg/conj bits --, dtype, device index,
requires_grad, sizes, strides), with the torch minors in
:data:`GUARDS_VERIFIED`, and only once it has passed a self-test in the
process (:func:`tensor_guards`); ``QSA_TENSOR_GUARDS`` switches it as
``QSA_OP_KERNELS`` does.  Without it every call builds its key in Python
(the same keys, a few µs more per call).  It is part of ``torch._C``: using
it imports no ``torch._dynamo``.
"""

from __future__ import annotations

import os
import warnings

import torch

from qsa_kernels import runtime

__all__ = ["VERIFIED", "GUARDS_VERIFIED", "OWN_OP_KERNELS", "switch", "increment_version", "any_requires_grad",
           "tensor_guards"]

#: Torch minors the ops' own dispatcher kernels were verified with: minor -> (what, where).
VERIFIED = {
    "2.10": ("the op and eager suites (test_torch_ops, test_eager, test_torch_export, test_reliability)",
             "CPU only"),
    "2.11": ("as 2.10; the GPU op, eager, export and scale tests", "H200 (GPU) and CPU"),
    "2.13": ("as 2.10, and benchmarks/step_overhead.py", "CPU only"),
    "2.14": ("as 2.10", "CPU only"),
}
_ENVIRONMENT = "QSA_OP_KERNELS"  # "0": torch.library.custom_op; "1": the own kernels on any torch
# What the own kernels read from torch._C (all must exist, forced or not).
_NEEDED = ("_AutoDispatchBelowADInplaceOrView", "_after_ADInplaceOrView_keyset", "_any_requires_grad",
           "_increment_version")


def switch(variable: str, version: str, verified) -> bool:
    """A private fast path's switch: ``variable`` on or off as ``runtime.env_switch`` reads it, or
    ``auto`` / unset: on where ``version``'s major.minor is in ``verified``."""
    default = ".".join(version.split(".")[:2]) in verified
    if os.environ.get(variable, "").strip().lower() == "auto":
        return default
    try:
        return runtime.env_switch(variable, default=default)
    except ValueError:
        raise ValueError(f"{variable} must be 0, 1 or auto (or off/on, false/true, no/yes), got "
                         f"{os.environ[variable]!r}") from None


def _own_op_kernels() -> bool:
    if not switch(_ENVIRONMENT, torch.__version__, VERIFIED):
        return False
    missing = [name for name in _NEEDED if not hasattr(torch._C, name)]
    if missing and os.environ.get(_ENVIRONMENT, "").strip().lower() in ("", "auto"):
        return False
    if missing:
        raise RuntimeError(f"{_ENVIRONMENT}=1, but this torch ({torch.__version__}) has no torch._C."
                           f"{', torch._C.'.join(missing)}: unset it (or set it to 0) to register the ops "
                           f"through torch.library.custom_op")
    return True


#: Whether the ops are registered with qsa's own Autograd / ADInplaceOrView kernels (else custom_op).
OWN_OP_KERNELS = _own_op_kernels()


def _public_increment_version(tensors) -> None:
    for tensor in tensors:
        torch.autograd.graph.increment_version(tensor)


#: ``increment_version(tensors)``: bump each tensor's ``_version``, as torch's in-place ops do.
increment_version = torch._C._increment_version if OWN_OP_KERNELS else _public_increment_version


def _public_any_requires_grad(*values) -> bool:
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in values)


#: ``any_requires_grad(*values)``: whether any of the values is a tensor that requires grad (one C
#: call where verified).
any_requires_grad = torch._C._any_requires_grad if OWN_OP_KERNELS else _public_any_requires_grad


#: Torch minors whose ``TensorGuards`` was verified as the eager key's check: minor -> (what, where).
GUARDS_VERIFIED = {
    "2.11": ("test_eager and test_torch_ops on the GPU (76 passed; 77 with the recent key's getters); "
             "benchmarks/bench_step.py at 1-256 requests x 128K, every torch path", "H200 (GPU) only"),
    "2.13": ("test_eager, test_internals, test_torch_ops, test_reliability; benchmarks/eager_python.py",
             "CPU only"),
}
_GUARDS_ENVIRONMENT = "QSA_TENSOR_GUARDS"  # "0": keys built in Python; "1": TensorGuards on any torch
_guards: list = []  # [the TensorGuards class or None], once decided


def tensor_guards():
    """``TensorGuards`` (``guards = TensorGuards(*tensors, dynamic_dims_sizes=None,
    dynamic_dims_strides=None)``; ``guards.check(*tensors)``), or ``None`` where it is not to be used:
    switched off, an unverified torch (unless forced), or a failed self-test (then with a warning)."""
    if not _guards:
        _guards.append(_checked_guards())
    return _guards[0]


def _checked_guards():
    if not switch(_GUARDS_ENVIRONMENT, torch.__version__, GUARDS_VERIFIED):
        return None
    try:
        guards = torch._C._dynamo.guards.TensorGuards
        base = torch.empty(2, 3)
        check = guards(base, base, dynamic_dims_sizes=None, dynamic_dims_strides=None).check

        class Subclass(torch.Tensor):
            pass

        # Each of these differs from `base` in one property the eager key holds (or the plain-call
        # rules refuse): the check must refuse every one, and accept a tensor like `base`.
        others = (torch.empty(2, 4), torch.empty(3, 2).t(), torch.empty(2, 3, dtype=torch.float64),
                  torch.empty(2, 3, requires_grad=True), torch.empty(2, 3, device="meta"),
                  torch.empty(2, 3).as_subclass(Subclass), torch.empty(6)[:3].view(1, 3).expand(2, 3), None)
        passed = check(base, torch.empty(2, 3)) and not any(check(base, other) for other in others)
    except Exception as error:  # a changed signature: the Python key
        passed, error_text = False, f"{type(error).__name__}: {error}"
    else:
        error_text = "it accepted a tensor it must refuse" if not passed else ""
    if passed:
        return guards
    warnings.warn(f"qsa_torch: torch {torch.__version__}'s TensorGuards failed qsa's self-test ({error_text}); "
                  f"eager calls build their keys in Python (set {_GUARDS_ENVIRONMENT}=0 to silence this)",
                  RuntimeWarning, stacklevel=3)
    return None
