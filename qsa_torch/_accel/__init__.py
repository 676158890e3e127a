"""The torch accelerator: host-speed machinery behind the binding's one hook (``qsa_torch._binding.hook``).

Everything here saves host time and nothing else: with ``QSA_ACCELERATE=0``
the binding alone runs every call, with the same results bit for bit
(tests run the suites both ways).  Delete this package and the binding
still works.  It reaches into torch's and Triton's internals, each use
gated by a table of the versions it was checked with (``_internals.VERIFIED``,
``_internals.GUARDS_VERIFIED``, ``_fast_launch.VERIFIED``) and a switch:

* :mod:`._fast_launch`: each Triton specialization bound once, then its
  compiled launcher called directly (``QSA_FAST_LAUNCH``);
* :mod:`._eager`: a plain eager call's Program prepared once per call key
  (its schedule, its launches bound), checked with torch's C tensor guards
  (``QSA_TENSOR_GUARDS``);
* :mod:`._ops`: the custom ops registered with dispatcher kernels of their
  own rather than ``torch.library.custom_op``'s Python ones
  (``QSA_OP_KERNELS``).

``qsa_torch``'s import installs it (:func:`install`) unless
``QSA_ACCELERATE`` is 0 / off / false / no (then nothing here is imported).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from qsa_kernels import runtime
from qsa_kernels.launch import Launch, Program
from qsa_kernels.stage import Stage, Variant

from .. import _binding
from . import _eager, _fast_launch, _internals, _ops

__all__ = ["TorchAccelerator", "install"]

# Dispatch and torch-function modes, functorch transforms (vmap, jvp, grad): where one is active the
# call goes through its op (torch must see it).  torch._C's names; a torch without them: a mode.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_function_mode = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: True)
_functorch = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: True)
_forward_ad = torch.autograd.forward_ad


def _plain() -> bool:
    """No dispatch or torch-function mode, functorch transform or forward-AD level is active."""
    return not (_dispatch_modes() or _function_mode()) and _functorch() is None and \
        getattr(_forward_ad, "_current_level", 0) < 0


class TorchAccelerator:
    """The hook's methods (:class:`qsa_torch._binding.Accelerator`)."""

    def run(self, stage: Stage, arguments: Mapping[str, Any], eager: bool) -> tuple[Program | None, Any]:
        if not _plain():
            return None, None
        prepared, results, tensors = _eager.run_prepared(stage, arguments, keep=eager)
        if prepared is _eager.MISS:
            return None, results  # the call key, to remember once the binding ran it (or None)
        if eager and prepared.updated:  # as torch's in-place ops do (an op's own kernels bump for the op)
            _internals.increment_version(prepared.take_updated(tensors))
        return prepared.program, results

    def remember(self, token: Any, stage: Stage, program: Program, device: torch.device) -> None:
        _eager.remember(token, stage, program, device)

    def launch(self, launch: Launch, inputs: list, outputs: list) -> None:
        _fast_launch.launch(launch.kernel, launch.grid, (*inputs, *outputs), launch.scalars, launch.constexprs,
                            launch.num_warps, launch.num_stages)

    def build(self, launch: Launch, inputs: list, outputs: list) -> None:
        # With the options its launches take (launch_pdl among them), so that they find this build.
        options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
        if _fast_launch.launch.early(launch.kernel, torch.cuda.current_device()):
            options["launch_pdl"] = True
        launch.kernel.warmup(*inputs, *outputs, **launch.scalars, **launch.constexprs, grid=launch.grid, **options)

    def describe(self) -> dict[str, str]:
        """Its lines of the environment report (``python -m qsa_kernels.info``)."""
        if runtime.INTERPRETED:
            launcher = "off: an interpreted process launches every kernel through kernel[grid]"
        elif not _fast_launch.ENABLED:
            launcher = (f"off: Triton {_fast_launch.triton.__version__} is not in its verified table "
                        f"(QSA_FAST_LAUNCH=1 forces it)")
        else:
            launcher = "on: each Triton specialization bound once, then its compiled launcher called directly"
        ops = ("own dispatcher kernels (torch minor verified; QSA_OP_KERNELS=0 for custom_op's)"
               if _internals.OWN_OP_KERNELS else "torch.library.custom_op's kernels")
        guards = "on" if _internals.tensor_guards() is not None else "off (keys built in Python)"
        return {"torch accelerator": f"on (QSA_ACCELERATE=0 turns it off): prepared eager calls, tensor guards "
                                     f"{guards}; ops: {ops}",
                "torch fast launcher": launcher}

    def define_op(self, stage: Stage, variant: Variant, schema: str, names: tuple, implementation, fake):
        return _ops.define(stage, variant, schema, names, implementation, fake) if _internals.OWN_OP_KERNELS \
            else None


def install() -> None:
    """Plug the accelerator into the binding (before its ops are registered)."""
    _binding.install(TorchAccelerator())
