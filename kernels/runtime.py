"""Per-process choice between compiled Triton kernels and Triton's interpreter.

A process is either *compiled* (a CUDA device is visible: kernels are compiled
for it) or *interpreted* (no CUDA device: ``TRITON_INTERPRET=1`` runs the same
kernels on CPU arrays).  The choice is made once, before ``triton`` is first
imported, so that a CPU user needs no setup.  An explicit ``TRITON_INTERPRET``
in the environment always wins.

This module imports neither torch nor jax (nor triton): probing for a device
goes through the CUDA driver library directly.
"""

from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["INTERPRETED", "interpreter_lock", "cuda_device_visible"]


def cuda_device_visible() -> bool:
    """True when the CUDA driver reports at least one device to this process."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    if libcuda.cuInit(0) != 0:
        return False
    if libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0


def _decide() -> bool:
    value = os.environ.get("TRITON_INTERPRET")
    if value is not None:
        return value.strip().lower() in ("1", "true", "yes", "on")
    if cuda_device_visible():
        return False
    # triton reads the variable when a kernel is decorated, so setting it
    # here (before kernels/ decorates any) is enough even if triton itself
    # was imported earlier.
    os.environ["TRITON_INTERPRET"] = "1"
    return True


#: True when this process runs every kernel through Triton's interpreter.
INTERPRETED: bool = _decide()

#: Triton's interpreter is not thread-safe, and XLA:CPU may run host
#: callbacks concurrently: every interpreted launch holds this lock.
interpreter_lock = threading.RLock()
