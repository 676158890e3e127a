"""Programmatic dependent launch: a kernel's launch overlaps the end of the kernel before it.

Where the launcher supports it (the torch adapter on sm_90 and later),
every kernel of this package is launched with CUDA's programmatic stream
serialization (Triton's ``launch_pdl``): the GPU may schedule a kernel's
programs before the previous kernel in the stream has finished, so the
launch gap between dependent kernels (a decode step is 5 launches at 1-8
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
the instructions as no-ops; for GPUs before sm_90, and under the
interpreter, they are not emitted.

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
from triton.language.target_info import cuda_capability_geq

__all__ = ["ENABLED", "dependent", "launches_early", "supported", "wait_for_previous_kernel"]

#: ``QSA_PDL=0`` launches every kernel the ordinary way.  Read once, at import;
#: benchmarks and tests set the attribute (the torch launcher keys its
#: bindings on it).
ENABLED: bool = os.environ.get("QSA_PDL", "1").strip() != "0"

_MARK = "qsa_waits_for_previous_kernel"

#: When a kernel lets the next one be scheduled: ``"exit"`` (as each program
#: ends, CUDA's implicit trigger; the default) or ``"start"`` (right after its
#: wait: the next kernel's programs may take free SMs while this one runs).
#: Read once, at import (``QSA_PDL_TRIGGER``): it is compiled into every kernel.
TRIGGER: str = os.environ.get("QSA_PDL_TRIGGER", "exit").strip().lower()
if TRIGGER not in ("start", "exit"):
    raise ValueError(f"QSA_PDL_TRIGGER must be 'start' or 'exit', got {TRIGGER!r}")
_TRIGGER_AT_START = tl.constexpr(TRIGGER == "start")


@triton.jit
def wait_for_previous_kernel():
    """A dependent kernel's first step: wait for the previous kernel in the stream (and with
    TRIGGER "start", let the next one in)."""
    if cuda_capability_geq(9, 0):
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


def supported(capability: tuple[int, int]) -> bool:
    """Whether a device of this compute capability takes programmatic dependent launch (sm_90 on)."""
    return tuple(capability) >= (9, 0)


def launches_early(kernel, capability: tuple[int, int]) -> bool:
    """Whether ``kernel`` is launched with programmatic stream serialization on a device of ``capability``."""
    return ENABLED and waits(kernel) and supported(capability)
