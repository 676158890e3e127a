"""The package's structure: framework-free kernels, one API in both adapters."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import qsa_jax
import qsa_torch


#: qsa_jax's own names: how its launches reach XLA (no torch counterpart).
JAX_ONLY = ["CUSTOM_CALL_TARGETS", "triton_lowering", "triton_lowering_available", "use_triton_lowering"]


def test_both_adapters_export_the_same_functions_and_signatures():
    assert qsa_jax.__all__ == qsa_torch.__all__ + JAX_ONLY
    for name in qsa_torch.__all__:
        torch_fn, jax_fn = getattr(qsa_torch, name), getattr(qsa_jax, name)
        assert inspect.signature(torch_fn) == inspect.signature(jax_fn), name
        assert torch_fn.__doc__ and jax_fn.__doc__, f"{name} has no docstring"


def test_kernels_import_without_torch_or_jax():
    """qsa_kernels (plans included) must not need either framework."""
    code = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "jax", "jaxlib", "jax_triton"):
            raise ImportError("blocked: " + name)
        return None
sys.meta_path.insert(0, Block())
import pkgutil, importlib, qsa_kernels
for module in pkgutil.iter_modules(qsa_kernels.__path__):
    importlib.import_module("qsa_kernels." + module.name)
from qsa_kernels import ArrayInfo, plan_rope_reshape_and_cache
a = lambda shape, dtype="bfloat16": ArrayInfo.contiguous(shape, dtype)
program = plan_rope_reshape_and_cache(a((3, 4, 16)), a((3, 2, 16)), a((3, 2, 16)), a((2, 4, 2, 16)),
    a((2, 4, 2, 16)), a((3,), "int32"), a((3,), "int32"), a((8, 16)), is_neox=True)
assert program.launches and not any(m.split(".")[0] in ("torch", "jax") for m in sys.modules)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
