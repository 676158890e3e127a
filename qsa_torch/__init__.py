"""QSA kernels for PyTorch: the functional API of docs/api.md over torch tensors.

Caches are updated in place and returned; every call launches on its
tensors' device and current stream, with no host synchronisation.

Every function is a torch custom op (namespace ``qsa``, one per variant of
its declaration: docs/api.md lists them) with a fake implementation that
works with symbolic sizes: ``torch.compile(..., fullgraph=True)`` with
dynamic row and request counts (one graph for every count), CUDA graphs,
``torch.export``, ``FakeTensorMode`` and meta tensors.  The kernels are not
differentiable: a call autograd would record raises.

Two layers (docs/design.md, "The adapters"): the binding
(``qsa_torch._binding``: public torch, Triton and torch.library APIs only)
and the accelerator (``qsa_torch._accel``: host-speed machinery, the same
results bit for bit), which this import plugs in unless ``QSA_ACCELERATE=0``.
"""

from qsa_kernels import runtime as _runtime  # noqa: F401  (chooses compiled/interpreted first)
from qsa_kernels import __version__  # noqa: F401  (one version for the three packages)

from . import _binding, _report

if _runtime.env_switch("QSA_ACCELERATE", default=True):  # the accelerator's one plug (docs/design.md)
    from . import _accel

    _accel.install()
_binding.register_ops()
_report.register()

from ._binding import run_program  # noqa: E402,F401  (the benchmarking seam: docs/api.md)
from ._functions import *  # noqa: E402,F403  (every public function, built from its declaration)
from ._functions import __all__ as _functions
from ._step import QSAState, StepMetadata  # noqa: E402

__all__ = [*_functions, "QSAState", "StepMetadata"]
