"""The environment report to paste into a bug report: ``python -m qsa_kernels.info`` (or ``qsa-info``).

One ``field: value`` line per :data:`FIELDS` entry: the versions of Python
and of every package the kernels run with, the NVIDIA driver and devices,
whether this process runs the kernels compiled or through Triton's
interpreter and why; then the lines of each adapter that registered a
reporter (:func:`register_reporter`, when it is imported): how ``qsa_jax``
lowers its launches, whether ``qsa_torch``'s accelerator is on, and why.

It never initialises CUDA (a forked child of a process that did cannot use
CUDA, and a report must not change what it reports): versions come from the
installed distributions' metadata, devices and the driver from NVML, the
library ``nvidia-smi`` uses, through :mod:`qsa_kernels.runtime`'s own
device count.  ``--cuda`` also asks torch, Triton and JAX for their devices,
which initialises CUDA.  A framework that is not installed is reported as
such and never imported.  This module names no adapter: :func:`main`
imports the adapters the installed distribution declares in the
:data:`REPORTERS_GROUP` entry-point group (pyproject.toml), which register
themselves.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
from typing import Callable, Mapping
import os
import platform
import sys
from importlib import metadata

from . import __version__, runtime

__all__ = ["FIELDS", "REPORTERS_GROUP", "register_reporter", "report", "main"]

#: The report's own lines, in order (every one is always printed; the adapters' follow them).
FIELDS = (
    "qsa-kernels", "python", "platform", "numpy", "triton", "torch", "jax", "jaxlib", "jax CUDA plugin",
    "jax-triton", "ml_dtypes", "NVIDIA driver", "devices", "environment", "kernels run", "CUDA queried",
    "CUDA initialised",
)
NOT_INSTALLED = "not installed"
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
#: Environment variables that change what the package does (printed when set).
ENVIRONMENT = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "QSA_ACCELERATE", "QSA_FAST_LAUNCH", "QSA_OP_KERNELS",
               "QSA_TENSOR_GUARDS", "QSA_CHECK_SCALES", "QSA_JAX_LOWERING", "QSA_JAX_PTX", "TRITON_CACHE_DIR",
               "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _import(name: str):
    """``(module, None)``, or ``(None, why)`` when it does not import."""
    try:
        return importlib.import_module(name), None
    except Exception as error:  # a report must not fail on a broken installation: it says so
        return None, f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------
# NVML: the driver and the devices, without a CUDA context
# --------------------------------------------------------------------------

class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml() -> tuple[str, list[str]]:
    """``(driver, devices)`` as NVML reports them, or why it cannot."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return "none found (no NVML library: libnvidia-ml.so.1)", []
    if nvml.nvmlInit_v2() != 0:
        return "NVML did not initialise (nvmlInit_v2 failed)", []
    try:
        text = ctypes.create_string_buffer(96)
        driver = text.value.decode() if nvml.nvmlSystemGetDriverVersion(text, 96) == 0 else "unknown"
        cuda = ctypes.c_int(0)
        if nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda)) == 0:
            driver += f" (CUDA {cuda.value // 1000}.{cuda.value % 1000 // 10})"
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return driver, ["NVML could not count the devices"]
        devices = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
                devices.append(f"{index}: NVML gave no handle")
                continue
            name = ctypes.create_string_buffer(96)
            nvml.nvmlDeviceGetName(handle, name, 96)
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            capability = (f"compute capability {major.value}.{minor.value}"
                          if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major),
                                                                       ctypes.byref(minor)) == 0
                          else "compute capability unknown")
            memory = _Memory()
            size = (f", {memory.total / 2**30:.0f} GiB" if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0
                    else "")
            devices.append(f"{index}: {name.value.decode()}, {capability}{size}")
        return driver, devices
    except AttributeError as error:  # an NVML too old for one of these calls
        return f"NVML lacks {error}", []
    finally:
        nvml.nvmlShutdown()


# --------------------------------------------------------------------------
# Why the process runs the way it does
# --------------------------------------------------------------------------

def _visibility() -> str:
    """How runtime.py sees the devices (its own checks, in its order)."""
    if runtime._hidden_by_environment():
        return "CUDA_VISIBLE_DEVICES hides every device"
    nvml, proc = runtime._nvml_device_count(), runtime._proc_device_count()
    if nvml is not None:
        return f"NVML counts {nvml} device{'s' * (nvml != 1)}"
    if proc is not None:
        return f"/proc/driver/nvidia/gpus lists {proc} device{'s' * (proc != 1)}"
    return "no NVML library and no /proc/driver/nvidia/gpus"


def _kernels_run() -> str:
    visible, why = runtime.cuda_device_visible(), _visibility()
    given = os.environ.get("TRITON_INTERPRET")
    if runtime.INTERPRETED:
        if visible:
            return f"interpreted (Triton's interpreter on the CPU): TRITON_INTERPRET={given} overrides the device ({why})"
        return (f"interpreted (Triton's interpreter on the CPU): no CUDA device is visible ({why}), so "
                f"qsa_kernels set TRITON_INTERPRET=1 at import (unless it was set already)")
    if visible:
        return f"compiled (Triton kernels compiled for the CUDA device): {why}"
    return (f"compiled, as TRITON_INTERPRET={given} asks, but no CUDA device is visible ({why}): "
            f"launches will fail")


# --------------------------------------------------------------------------
# The adapters' own lines: each registers a reporter when it is imported
# --------------------------------------------------------------------------

#: Adapter -> its reporter (a function returning ``{field: value}``), registered by the adapter's import.
_REPORTERS: dict[str, Callable[[], dict[str, str]]] = {}
#: The entry-point group through which :func:`main` imports the installed adapters (pyproject.toml).
REPORTERS_GROUP = "qsa_kernels.reporters"


def register_reporter(adapter: str, reporter: Callable[[], dict[str, str]]) -> None:
    """Add ``adapter``'s lines to the report (``qsa_torch`` and ``qsa_jax`` call it when imported)."""
    _REPORTERS[adapter] = reporter


def _load_adapters() -> dict[str, str]:
    """Import the adapters the installed distribution declares (entry points), so that they register;
    ``{adapter: why not}`` for those that do not import here."""
    failed = {}
    for entry in metadata.entry_points(group=REPORTERS_GROUP):
        try:
            entry.load()
        except Exception as error:  # a report must not fail on a broken installation: it says so
            failed[entry.name] = f"{type(error).__name__}: {error}"
    return failed


def _adapter_lines(failed: Mapping[str, str]) -> dict[str, str]:
    lines = {}
    for adapter, reporter in sorted(_REPORTERS.items()):
        try:
            lines.update(reporter())
        except Exception as error:  # pragma: no cover - a reporter's own bug: say so
            lines[adapter] = f"its report failed ({type(error).__name__}: {error})"
    for adapter, why in sorted(failed.items()):
        lines[adapter] = f"does not import here ({why})"
    return lines


def _cuda_query(torch, jax_installed: bool) -> str:
    parts = []
    if torch is not None:
        if torch.cuda.is_available():
            names = [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                     for i in range(torch.cuda.device_count())]
            parts.append(f"torch sees {', '.join(names)}")
        else:
            parts.append("torch sees no CUDA device")
        if not runtime.INTERPRETED:
            try:  # Triton's driver object is not a stable API: a report, never a failure
                from triton.runtime import driver

                target = driver.active.get_current_target()
                parts.append(f"Triton targets {target.backend} {target.arch}")
            except Exception as error:  # pragma: no cover - another Triton's internals
                parts.append(f"Triton's target unknown ({type(error).__name__})")
    if jax_installed:
        jax = importlib.import_module("jax")
        parts.append(f"JAX backend {jax.default_backend()}: {', '.join(str(d) for d in jax.devices())}")
    return "; ".join(parts) or "nothing to ask (neither torch nor JAX is installed)"


def report(cuda: bool = False, failed: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """The report's ``(field, value)`` pairs: :data:`FIELDS` in order, then the imported adapters' lines
    (``failed``: adapters that did not import, and why)."""
    import numpy
    import triton

    torch, torch_why = None, f"torch {NOT_INSTALLED}"
    if _version("torch") is not None:
        torch, error = _import("torch")
        torch_why = f"torch does not import ({error})"
    jax_installed = _version("jax") is not None and _import("jax")[0] is not None
    plugins = [f"{name} {_version(name)}" for name in ("jax-cuda12-plugin", "jax-cuda13-plugin") if _version(name)]
    driver, devices = _nvml()
    torch_text = NOT_INSTALLED if _version("torch") is None else f"{_version('torch')}, but {torch_why}"
    if torch is not None:
        torch_text = f"{torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})"
    values = {
        "qsa-kernels": f"{__version__} ({os.path.dirname(os.path.realpath(__file__))})",
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "triton": triton.__version__,
        "torch": torch_text,
        "jax": _version("jax") or NOT_INSTALLED,
        "jaxlib": _version("jaxlib") or NOT_INSTALLED,
        "jax CUDA plugin": ", ".join(plugins) or NOT_INSTALLED,
        "jax-triton": _version("jax-triton") or NOT_INSTALLED,
        "ml_dtypes": _version("ml_dtypes") or NOT_INSTALLED,
        "NVIDIA driver": driver,
        "devices": "; ".join(devices) or "none (NVML, no CUDA initialisation)",
        "environment": ", ".join(f"{name}={os.environ[name]}" for name in ENVIRONMENT if name in os.environ)
                       or "none of " + ", ".join(ENVIRONMENT) + " is set",
        "kernels run": _kernels_run(),
        "CUDA queried": _cuda_query(torch, jax_installed) if cuda else "no (--cuda asks torch, Triton and JAX, "
                                                                      "which initialises CUDA)",
    }
    values["CUDA initialised"] = ("not known (torch is not installed)" if torch is None else
                                  "yes" if torch.cuda.is_initialized() else "no")
    return [(field, values[field]) for field in FIELDS] + list(_adapter_lines(failed or {}).items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qsa_kernels.info", description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true",
                        help="also ask torch, Triton and JAX for their devices (initialises CUDA)")
    arguments = parser.parse_args(argv)
    lines = report(cuda=arguments.cuda, failed=_load_adapters())
    width = max(len(field) for field, _ in lines) + 1
    for field, value in lines:
        print(f"{field + ':':<{width}} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
