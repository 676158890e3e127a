"""The custom ops with dispatcher kernels of their own (torch minors in ``_internals.VERIFIED``).

What ``torch.library.custom_op`` registers, less its cost per call: a
Python kernel per key (Autograd, then ADInplaceOrView, then the backend
wrapper's alias check) and, from torch 2.13, an ADInplaceOrView kernel that
re-binds the arguments to the schema (``fill_defaults`` reads
``schema.arguments``, rebuilt from C++ on every access, twice per argument:
~220 µs per call of the step's 29-argument op on a CPU host;
``benchmarks/step_overhead.py``).  Each op is defined in one
``torch.library.Library("qsa", "FRAGMENT")`` with the binding's schema,
tagged ``pt2_compliant_tag``, with four kernels:

* ``CompositeExplicitAutograd`` (CPU, CUDA): the binding's implementation;
* the binding's fake implementation (``torch.library.register_fake``);
* ``Autograd``: refuses a call autograd would record (the binding's error),
  runs the backend kernel -- directly when it is next (plain tensors, no
  mode), else by redispatching below ``ADInplaceOrView`` -- and bumps the
  version counters of the arrays the variant updates (by position);
* ``ADInplaceOrView`` (ops that update arrays): the version bump alone, for
  calls without the Autograd key (inference mode on normal tensors).
"""

from __future__ import annotations

import inspect

import torch

from qsa_kernels.stage import Stage, Variant

from .. import _binding
from ._internals import any_requires_grad, increment_version

__all__ = ["define"]

_LIBRARY = None  # the one Library every own-kernel op is defined in (kept for the process's life)


def define(stage: Stage, variant: Variant, schema: str, names: tuple, implementation, fake):
    """Define ``qsa::<variant>`` with the binding's schema, implementation and fake, and own kernels."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library(_binding.NAMESPACE, "FRAGMENT")
    name = variant.name
    _LIBRARY.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    op = getattr(getattr(torch.ops, _binding.NAMESPACE), name).default
    # Arrays updated in place are never defaulted, so the dispatcher always passes them positionally.
    parameters = [p for p in stage.parameters if p.name in names]
    mutated = tuple(names.index(n) for n in variant.updated)
    if any(parameters[i].default is not inspect.Parameter.empty for i in mutated):
        raise RuntimeError(f"qsa::{name}: an array updated in place has a default (the op's kernels find "
                           f"updated arrays by position)")
    below_inplace_or_view = torch._C._AutoDispatchBelowADInplaceOrView
    after_inplace_or_view = torch._C._after_ADInplaceOrView_keyset
    backends = frozenset((torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA))
    grad_enabled = torch.is_grad_enabled

    def autograd(keyset, *values, **keywords):
        if grad_enabled() and any_requires_grad(*values):
            _binding.refuse_grad(stage, dict(zip(names, values)))
        below = keyset & after_inplace_or_view
        with below_inplace_or_view():
            if below.highestPriorityTypeId() in backends:  # the backend kernel is next: call it without a hop
                result = implementation(*values, **keywords)
            else:
                result = op.redispatch(below, *values, **keywords)
        if mutated:
            increment_version([values[i] for i in mutated])
        return result

    def inplace_or_view(keyset, *values, **keywords):
        with below_inplace_or_view():
            result = op.redispatch(keyset & after_inplace_or_view, *values, **keywords)
        increment_version([values[i] for i in mutated])
        return result

    _LIBRARY.impl(name, implementation, "CompositeExplicitAutograd")
    _LIBRARY.impl(name, autograd, "Autograd", with_keyset=True)
    if mutated:
        _LIBRARY.impl(name, inplace_or_view, "ADInplaceOrView", with_keyset=True)
    torch.library.register_fake(f"{_binding.NAMESPACE}::{name}", fake, lib=_LIBRARY)
    return op
