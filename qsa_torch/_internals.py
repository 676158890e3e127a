"""Which of torch's private internals this process uses: one table, one switch.

The ops' own dispatcher kernels (``qsa_torch._launch``, "Op registration")
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
"""

from __future__ import annotations

import os

import torch

__all__ = ["VERIFIED", "OWN_OP_KERNELS", "switch", "increment_version", "any_requires_grad"]

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
    """A private fast path's switch: ``variable`` (0/off/false/no, 1/on/true/yes, or auto or unset:
    on where ``version``'s major.minor is in ``verified``)."""
    choice = os.environ.get(variable, "").strip().lower()
    if choice in ("0", "off", "false", "no"):
        return False
    if choice in ("1", "on", "true", "yes"):
        return True
    if choice not in ("", "auto"):
        raise ValueError(f"{variable} must be 0, 1 or auto, got {os.environ[variable]!r}")
    return ".".join(version.split(".")[:2]) in verified


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
