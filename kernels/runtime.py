"""Per-process choice between compiled Triton kernels and Triton's interpreter.

A process is either *compiled* (a CUDA device is visible: kernels are compiled
for it) or *interpreted* (no CUDA device: ``TRITON_INTERPRET=1`` runs the same
kernels on CPU arrays).  The choice is made once, before any kernel is
decorated, so that a CPU user needs no setup.  An explicit ``TRITON_INTERPRET``
in the environment always wins, read as Triton itself reads it (its
``knobs.runtime.interpret``: ``" 1 "`` is false and ``"y"`` true in Triton
3.6), so that the package and Triton never disagree about which path runs.

This module imports neither torch nor jax (triton only to read that knob,
when the variable is set), and it never
initialises CUDA: ``cuInit`` in a parent process leaves a forked child unable
to use CUDA, so importing the package must not call it (torch's own
``import torch`` does not either).  Devices are counted through NVML (what
``nvidia-smi`` uses; no CUDA context), then ``/proc/driver/nvidia/gpus``.
"""

from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["CHECK_SCALES", "INTERPRETED", "interpreter_lock", "cuda_device_visible", "env_switch"]

#: The spellings of an on/off ``QSA_*`` switch (case-insensitive, blanks stripped).
SWITCH_ON = ("1", "on", "true", "yes")
SWITCH_OFF = ("0", "off", "false", "no")


def env_switch(name: str, default: bool) -> bool:
    """The on/off environment switch ``name``: 1/on/true/yes or 0/off/false/no
    (case-insensitive, blanks stripped); unset or empty: ``default``.  Any other
    value is refused with a ``ValueError`` naming the variable, never read as off."""
    raw = os.environ.get(name)
    value = "" if raw is None else raw.strip().lower()
    if not value:
        return bool(default)
    if value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    raise ValueError(f"{name} must be one of {', '.join(SWITCH_ON)} (on) or {', '.join(SWITCH_OFF)} (off), "
                     f"or empty for the default ({'on' if default else 'off'}), got {raw!r}")


def _hidden_by_environment() -> bool:
    """``CUDA_VISIBLE_DEVICES`` set to nothing (or to a leading -1) hides every device from CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return False
    first = visible.split(",")[0].strip()
    return first == "" or first.startswith("-")


def _nvml_device_count() -> int | None:
    """Devices NVML reports, or ``None`` without a usable NVML library."""
    capabilities = nvml_capabilities()
    return None if capabilities is None else len(capabilities)


def nvml_capabilities() -> list[tuple[int, int]] | None:
    """The compute capability of every device NVML reports (whatever
    ``CUDA_VISIBLE_DEVICES`` says), or ``None`` without a usable NVML library.
    No CUDA context."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
        try:
            count = ctypes.c_uint(0)
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return None
            capabilities = []
            for index in range(count.value):
                handle, major, minor = ctypes.c_void_p(), ctypes.c_int(0), ctypes.c_int(0)
                if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 or \
                        nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
                    return None
                capabilities.append((major.value, minor.value))
            return capabilities
        finally:
            nvml.nvmlShutdown()
    except AttributeError:
        return None


def _proc_device_count() -> int | None:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return None


def cuda_device_visible() -> bool:
    """True when at least one CUDA device is visible to this process, found without initialising CUDA."""
    if _hidden_by_environment():
        return False
    for count in (_nvml_device_count(), _proc_device_count()):
        if count is not None:
            return count > 0
    return False


def _decide() -> bool:
    if os.environ.get("TRITON_INTERPRET") is not None:
        # Triton's own reading of its variable (it parses env bools in C++, and
        # the accepted spellings are its business): whatever it decides, the
        # package must decide the same, or a "compiled" process would launch
        # interpreted kernels (or the reverse) and fail far from the cause.
        from triton import knobs

        return bool(knobs.runtime.interpret)
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

#: ``QSA_CHECK_SCALES=1`` (or on, true, yes: :func:`env_switch`): every call reads its
#: fp8 scales (``k_scale``, ``v_scale``, ``scale``, the state's scales) on the host and
#: raises a ``ValueError`` naming the function and the argument unless each is finite
#: and > 0.  A debug switch: reading a device value synchronises, so by default no call
#: reads it (docs/api.md, "Scales").  Read once, at import; tests set the attribute.
CHECK_SCALES: bool = env_switch("QSA_CHECK_SCALES", False)
