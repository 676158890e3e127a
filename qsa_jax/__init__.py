"""QSA kernels for JAX: the functional API of docs/api.md over JAX arrays.

Pure functions that work under ``jax.jit``; caches come back as arrays aliasing
the inputs (donate them for an in-place update).  On a CUDA device kernels
run through ``jax_triton.triton_call``; without one, through Triton's
interpreter from a host callback.

Two layers (docs/design.md, "The adapters"): the binding
(``qsa_jax._binding``: public JAX and jax-triton APIs only) and the
accelerator (``qsa_jax._lowering``: each launch re-lowered to jaxlib's
typed-FFI call with a slimmed payload, the same results bit for bit), which
this import plugs in unless ``QSA_ACCELERATE=0``.
"""

from qsa_kernels import runtime as _runtime  # noqa: F401  (chooses compiled/interpreted first)
from qsa_kernels import __version__  # noqa: F401  (one version for the three packages)

from . import _binding, _report

if _runtime.env_switch("QSA_ACCELERATE", default=True):  # the accelerator's one plug (docs/design.md)
    from . import _lowering

    _lowering.install()
_report.register()

from ._binding import (  # noqa: E402,F401  (run_program: the benchmarking seam, docs/api.md)
    CUSTOM_CALL_TARGETS,
    run_program,
    triton_lowering,
    triton_lowering_available,
    use_triton_lowering,
)
from ._functions import *  # noqa: E402,F403  (every public function, built from its declaration)
from ._functions import __all__ as _functions
from ._step import QSAState, StepMetadata  # noqa: E402

__all__ = [*_functions, "QSAState", "StepMetadata",
           # JAX only: how launches reach XLA (docs/api.md, "Calling from jax.jit")
           "CUSTOM_CALL_TARGETS", "triton_lowering", "triton_lowering_available", "use_triton_lowering"]
