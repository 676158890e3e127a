"""``python -m qsa_kernels.info``: the environment report prints every field, and never needs a framework.

Run as a user runs it, in a fresh interpreter (a subprocess that finds the
packages where this process found them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest

from qsa_kernels import runtime

from .test_readme import _package_path

#: What the report must say (issue 25): versions, the device, the CPU-or-GPU
#: choice, each with its reason; then the adapters' own lines (each registers them when
#: imported: the JAX lowering, the torch accelerator and its fast launcher).
LABELS = ["qsa-kernels", "python", "platform", "numpy", "triton", "torch", "jax", "jaxlib", "jax CUDA plugin",
          "jax-triton", "ml_dtypes", "NVIDIA driver", "devices", "environment", "kernels run", "CUDA queried",
          "CUDA initialised"]
ADAPTER_LABELS = ["JAX lowering", "torch accelerator", "torch fast launcher"]


def _run(*arguments: str, code: str | None = None) -> dict[str, str]:
    """The report's fields, from ``python -m qsa_kernels.info`` (or ``code``, which prints it)."""
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "qsa_kernels.info", *arguments]
    env = dict(os.environ, PYTHONPATH=_package_path())
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    labels = [line.split(":", 1)[0] for line in lines]
    assert labels[:len(LABELS)] == LABELS, lines  # every field, once, in order
    # then the adapters' lines (or why an adapter does not import here)
    assert set(labels[len(LABELS):]) <= set(ADAPTER_LABELS) | {"qsa_torch", "qsa_jax"}, lines
    return {label: line.split(":", 1)[1].strip() for label, line in zip(labels, lines)}


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def test_the_report_lists_the_documented_fields():
    from qsa_kernels import info

    assert list(info.FIELDS) == LABELS


def test_info_prints_every_field_with_this_environment():
    import numpy
    import triton

    import qsa_kernels

    fields = _run()
    assert all(fields.values()), fields
    assert fields["qsa-kernels"].startswith(qsa_kernels.__version__ + " (")
    assert fields["python"].startswith(".".join(map(str, sys.version_info[:3])))
    assert fields["numpy"] == numpy.__version__ and fields["triton"] == triton.__version__
    for name in ("jax", "jaxlib", "jax-triton", "ml_dtypes"):
        assert fields[name] == (_installed(name) or "not installed"), name
    if _installed("torch"):
        import torch

        assert fields["torch"].startswith(torch.__version__ + " (CUDA ")
        assert fields["CUDA initialised"] == "no"  # the report itself initialises nothing
    assert fields["kernels run"].startswith("interpreted" if runtime.INTERPRETED else "compiled")
    assert ("no CUDA device is visible" in fields["kernels run"]) == (runtime.INTERPRETED
                                                                      and not runtime.cuda_device_visible())
    if _installed("jax") and "JAX lowering" in fields:  # (the adapters' lines: an installed distribution's)
        import qsa_jax

        assert fields["JAX lowering"].startswith(qsa_jax.triton_lowering() + ":")
    if "torch accelerator" in fields:
        assert fields["torch accelerator"].startswith("on" if runtime.env_switch("QSA_ACCELERATE", True) else "off")
    if "torch fast launcher" in fields:
        assert fields["torch fast launcher"].startswith("off" if runtime.INTERPRETED else "on")
    assert fields["CUDA queried"].startswith("no (--cuda")
    if not runtime.cuda_device_visible():
        assert fields["devices"].startswith("none")


def test_info_without_torch_or_jax_imports_neither():
    """As in an environment with neither: their metadata hidden, their imports refused."""
    code = """
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "jax", "jaxlib", "jax_triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
from qsa_kernels import info
installed = info._version
info._version = lambda name: None if name.split("-")[0] in ("torch", "jax", "jaxlib") else installed(name)
info.main([])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib", "qsa_torch", "qsa_jax"))
assert not loaded, loaded
"""
    fields = _run(code=code)
    for name in ("torch", "jax", "jaxlib", "jax CUDA plugin", "jax-triton"):
        assert fields[name] == "not installed", (name, fields[name])
    for adapter in ("qsa_torch", "qsa_jax"):  # listed by the distribution, but their frameworks are absent
        assert fields.get(adapter, "does not import here").startswith("does not import here"), fields
    assert fields["kernels run"].startswith("interpreted" if runtime.INTERPRETED else "compiled")


@pytest.mark.gpu
def test_info_names_the_gpu_without_initialising_cuda_then_with_cuda():
    fields = _run()
    assert "compute capability" in fields["devices"] and "CUDA" in fields["NVIDIA driver"], fields
    assert fields["kernels run"].startswith("compiled") and fields["CUDA initialised"] == "no"
    fields = _run("--cuda")
    assert "torch sees" in fields["CUDA queried"] and "(sm_" in fields["CUDA queried"], fields
    assert fields["CUDA initialised"] == "yes"
