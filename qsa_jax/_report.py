"""qsa_jax's lines of the environment report (``python -m qsa_kernels.info``)."""

from __future__ import annotations

import importlib.metadata

from qsa_kernels import info, runtime

from . import _binding


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _lines() -> dict[str, str]:
    if runtime.INTERPRETED:
        text = "interpreter: no CUDA device, so every launch runs from a host callback on CPU torch tensors"
        if not _installed("torch"):
            text += ("; torch is not installed, which that path needs "
                     "(pip install torch --index-url https://download.pytorch.org/whl/cpu)")
        return {"JAX lowering": text}
    if _binding.hook is None:
        text = "jax-triton: the accelerator is off (QSA_ACCELERATE=0), so jax-triton lowers every launch itself"
    else:
        try:
            text = _binding.hook.describe()["JAX lowering"]
        except (RuntimeError, ValueError) as error:
            text = f"unusable: {error}"
    if not _installed("jax-triton"):
        text += "; jax-triton is not installed, so qsa_jax cannot launch on the GPU (pip install 'qsa-kernels[jax-gpu]')"
    return {"JAX lowering": text}


def register() -> None:
    info.register_reporter("qsa_jax", _lines)
