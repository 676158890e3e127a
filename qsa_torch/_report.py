"""qsa_torch's lines of the environment report (``python -m qsa_kernels.info``)."""

from __future__ import annotations

from qsa_kernels import info

from . import _binding


def _lines() -> dict[str, str]:
    if _binding.hook is None:
        return {"torch accelerator": "off (QSA_ACCELERATE=0): every call through the binding's custom ops "
                                     "and kernel[grid]"}
    return _binding.hook.describe()


def register() -> None:
    info.register_reporter("qsa_torch", _lines)
