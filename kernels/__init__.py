"""qsa_kernels: the Triton kernels of QSA and their framework-free launch plans.

Installed from the directory ``kernels/`` under the import name
``qsa_kernels`` (PyPI's unrelated ``kernels`` distribution owns that name).
Importing this package needs neither torch nor jax.  It decides once per
process whether kernels run compiled (a CUDA device is visible) or through
Triton's interpreter (no CUDA device): see :mod:`qsa_kernels.runtime`.
"""

__version__ = "0.1.0"  # the one version of the distribution qsa-kernels (pyproject reads it)

from . import runtime  # noqa: F401  (must run before triton is imported below)
from . import interpreter_compat  # noqa: F401  (Triton 3.9's interpreter: boolean splats)
from .launch import ArrayInfo, Buffer, Launch, Program
from .rope_cache import plan_rope_reshape_and_cache

__all__ = [
    "ArrayInfo",
    "Buffer",
    "Launch",
    "Program",
    "plan_rope_reshape_and_cache",
]
