"""Programmatic dependent launch: a kernel's launch overlaps the end of the kernel before it.

Where the launcher supports it (the torch adapter on sm_90 and later),
every kernel of this package is launched with CUDA's programmatic stream
serialization (Triton's ``launch_pdl``): the GPU may schedule a kernel's
programs before the previous kernel in the stream has finished, so the
launch gap between dependent kernels (a decode step is 4 launches at 1-8
requests) overlaps that kernel's tail.  Each kernel therefore begins with
:func:`wait_for_previous_kernel`: ``griddepcontrol.wait`` blocks until the
previous kernel has completed and its writes are visible, before the kernel
touches any memory (so no read sees a stale value and no write overtakes a
read).  The next kernel may be scheduled once every program of this one has
exited (CUDA's implicit trigger: its launch then overlaps this kernel's
completion), or with ``QSA_PDL_TRIGGER=start`` once every program has
passed its wait (``griddepcontrol.launch_dependents``: its programs may
take free SMs while this kernel runs).  Timed on the H200 (decode step,
128K, CUDA graphs, µs per step against ordinary launches in the same
process, 2026-12-02): "exit" 36.9 / 37.6 at 1 request, 77.1 / 77.3-77.8 at
8, 305.1 / 305.6-306.0 at 64, 973.4 / 975.8-977.7 at 256; "start" 37.9 /
39.7-40.0, 80.5 / 78.9-79.0, 300.8 / 307.0-307.1, 970.7 / 973.9-978.7:
larger gains, but slower at 8 requests, so "exit" is the default.  No
arithmetic changes: the results are bitwise those of ordinary launches.  A
kernel launched without the attribute (JAX's launches, ``QSA_PDL=0``) runs
the instructions as no-ops.  They are emitted (:data:`EMIT`) only in a
compiled process on a host whose every NVIDIA device is sm_90 or later, as
NVML reports them, so that no kernel compiled for an older device, and no
interpreted kernel, holds them; the early launch is taken only where they are.

:func:`dependent` marks a kernel that begins with the wait, and refuses one
that does not: only marked kernels are launched early
(:func:`launches_early`).
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import runtime

__all__ = ["EMIT", "ENABLED", "TRIGGER", "dependent", "launches_early", "supported", "wait_for_previous_kernel"]


def _choice(variable: str, default: str, choices: tuple[str, ...]) -> str:
    """A ``QSA_*`` variable that names one of ``choices`` (on/off ones: ``runtime.env_switch``)."""
    value = os.environ.get(variable, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{variable} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


#: ``QSA_PDL=0`` launches every kernel the ordinary way (``1``, the default:
#: early where :data:`EMIT`).  Read once, at import; benchmarks and tests set
#: the attribute (the torch launcher keys its bindings on it).
ENABLED: bool = runtime.env_switch("QSA_PDL", default=True)


def supported(capability: tuple[int, int]) -> bool:
    """Whether a device of this compute capability takes programmatic dependent launch (sm_90 on)."""
    return tuple(capability) >= (9, 0)


def _emits() -> bool:
    if runtime.INTERPRETED:
        return False
    if os.environ.get("QSA_PDL_EMIT", "").strip().lower() not in ("", "auto"):
        # offline compiles for sm_90 on a machine without it (tests/test_compile_sm90.py)
        return runtime.env_switch("QSA_PDL_EMIT", default=False)
    capabilities = runtime.nvml_capabilities()
    return bool(capabilities) and all(map(supported, capabilities))


#: Whether the kernels hold the wait (compiled, every device sm_90 on); fixed
#: at import, whatever ENABLED is, so that turning early launches on and off
#: never changes a kernel (Triton keys its cache on it, a constexpr global).
#: ``QSA_PDL_EMIT=1`` forces it, for the CPU's sm_90 compile check, which
#: compiles what the H200 runs.
EMIT: bool = _emits()
_EMIT = tl.constexpr(EMIT)

_MARK = "qsa_waits_for_previous_kernel"

#: When a kernel lets the next one be scheduled: ``"exit"`` (as each program
#: ends, CUDA's implicit trigger; the default) or ``"start"`` (right after its
#: wait: the next kernel's programs may take free SMs while this one runs).
#: Read once, at import (``QSA_PDL_TRIGGER``): it is compiled into every kernel.
TRIGGER: str = _choice("QSA_PDL_TRIGGER", "exit", ("exit", "start"))
_TRIGGER_AT_START = tl.constexpr(TRIGGER == "start")


@triton.jit
def wait_for_previous_kernel():
    """A dependent kernel's first step: wait for the previous kernel in the stream (and with
    TRIGGER "start", let the next one in)."""
    if _EMIT:
        gdc_wait()
        if _TRIGGER_AT_START:
            gdc_launch_dependents()


def _first_statement_waits(kernel) -> bool:
    function = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0]
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call):
        return False
    called = body[0].value.func
    name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", None)
    return name == wait_for_previous_kernel.fn.__name__ and not body[0].value.args


def dependent(kernel):
    """Marks a ``@triton.jit`` kernel whose first statement is ``wait_for_previous_kernel()``
    (after its docstring), so that it may be launched early; raises for any other."""
    if not _first_statement_waits(kernel):
        raise TypeError(f"{kernel.fn.__name__}: a dependent kernel's first statement must be "
                        f"wait_for_previous_kernel()")
    setattr(kernel, _MARK, True)
    return kernel


def waits(kernel) -> bool:
    """Whether ``kernel`` was marked by :func:`dependent`."""
    return getattr(kernel, _MARK, False)


def launches_early(kernel, capability: tuple[int, int]) -> bool:
    """Whether ``kernel`` is launched with programmatic stream serialization on a device of ``capability``."""
    return ENABLED and EMIT and waits(kernel) and supported(capability)
