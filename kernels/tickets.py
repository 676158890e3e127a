"""Tickets: programs of one launch that take their roles, and wait, by atomic counters.

A row's programs draw a start ticket (:func:`start_ticket`) and act by it,
not by their program id; a program waits (:func:`wait_for`) only for
programs whose tickets are lower, which have started and therefore run: no
deadlock however the GPU schedules the launch, and Triton's interpreter,
which runs programs one after another, finds every wait already met.
:func:`publish` makes a program's stores visible to the programs that wait
for its count; :func:`finish_ticket` tells the last of a group to finish
that it is last, with every other one's stores visible.  Counters live in
a zero-filled buffer that the last program puts back to zero.  Used by the
ticketed top-k (``topk.ticketed``) and the fused selection
(``select.select_fused_kernel``); docs/design.md, "Numerics and
determinism", says why the results cannot depend on the schedule.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def start_ticket(counter):
    """This program's start ticket: how many programs drew one from ``counter`` before it."""
    return tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")


@triton.jit
def publish(counter):
    """Counts this program done (release): every thread's stores before the
    count (one thread adds) are visible to a program that acquires it."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")


@triton.jit
def wait_for(counter, target):
    """Spins until ``*counter >= target`` (acquire: what was published before
    each increment is visible after)."""
    arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while arrived < target:
        arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


@triton.jit
def finish_ticket(counter):
    """Counts this program done (acq_rel) and returns how many were done
    before it: the one that draws the last ticket sees every other one's
    stores made before their tickets (after a ``tl.debug_barrier()``, so
    every thread's)."""
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
