"""Docstrings of the public functions, shared by both adapters.

Text between ``[torch: ...]`` and ``[jax: ...]`` markers is kept only in
that adapter's docstring; everything else is identical.
"""

from __future__ import annotations

import re

_MARK = re.compile(r"\[(torch|jax): (.*?)\]", re.S)


def _select(doc: str, framework: str) -> str:
    return _MARK.sub(lambda m: m.group(2) if m.group(1) == framework else "", doc)


def framework_doc(doc: str, framework: str) -> str:
    """``doc`` as ``framework``'s (``"torch"`` or ``"jax"``) docstring."""
    return _select(doc, framework)


def torch_doc(doc: str) -> str:
    return _select(doc, "torch")


def jax_doc(doc: str) -> str:
    return _select(doc, "jax")
