"""Eager calls at the host cost of their launches: a call's Program, prepared once per call key.

The general eager path (``qsa_torch._binding``) reads every array's metadata
into an :class:`~qsa_kernels.launch.ArrayInfo`, looks the plan up, allocates
each buffer and launches each kernel through the fast launcher, which keys
every launch again on its arguments.  With steady shapes all of that repeats
a decision already made, so a call first builds one flat **call key** of
what its Program depends on, read straight from the tensors:

* the stage and the tuning in force (``None`` for the default tuning);
* per array argument, in the stage's order: shape, strides, dtype and device
  index (``None`` when absent) -- what its ``ArrayInfo`` holds, plus where the
  arrays live;
* per option, in the stage's order: its type and value (``3``, ``3.0`` and
  ``True`` never share a key, as in the Stage memo).

Per stage, the last few keys a call matched are kept with a C check of
their tensors (``torch._C._dynamo.guards.TensorGuards``, where
``qsa_torch._internals.tensor_guards`` admits it): a call whose tuning,
absent arrays and options (types and values) equal such a key's, and whose
tensors pass its check -- type, dispatch keys, dtype, device index, sizes,
strides, and no requires_grad (a key is kept with a check only when none of
its tensors required grad) --, has that key without building it.  The check
holds everything the key holds of a tensor, and more (the neg/conj bits, the
thread's dispatch-key state): it only ever sends a call to the longer path.

A key the general path has run (validated, planned and built) maps to a
:class:`Prepared` program: its :class:`~qsa_kernels.launch.Schedule`
(launches over numbered slots, workspaces carved from one allocation) and,
per alignment class of the call's pointers, every launch bound to its
compiled kernel (:class:`qsa_torch._accel._fast_launch.Binding`).  A call with that
key then reads each tensor's pointer, allocates, and calls the launchers
with integer pointers (Triton's launcher takes an int as the pointer itself,
so no ``data_ptr()`` call or pointer query per argument).

What is still checked on every call: that every tensor is a plain tensor
(not fake, meta, or a subclass) on the current device, no dispatch or
torch-function mode is active, no argument requires grad while grad mode is
on, no updated argument is an inference tensor outside inference mode, no
launch observer is registered, and that nothing Triton keys a launch on in
the process changed (:func:`qsa_torch._accel._fast_launch.environment`, the
kernels' globals).  Anything else -- a new key, a failed check -- takes the
general path, which raises the errors.
"""

from __future__ import annotations

import operator
import threading
from functools import reduce
from itertools import compress

import torch

from qsa_kernels import launch as _launch_module
from qsa_kernels import runtime, tuning as _tuning
from qsa_kernels.launch import Program, Schedule
from qsa_kernels.stage import Stage

from .._binding import DTYPES
from . import _fast_launch
from ._internals import any_requires_grad as _any_requires_grad, increment_version as _increment_version, \
    tensor_guards as _tensor_guards

_ABSENT = object()  # an option the arguments do not hold
__all__ = ["MISS", "Prepared", "clear", "remember", "run_prepared"]

#: What :func:`call` returns when the call must take the general path.
MISS = object()
_LIMIT = 4096  # prepared call keys kept (the Stage memo keeps as many plans)
_ALIGNED = "aligned"  # the alignment class of calls whose every pointer is 16-byte aligned
_current_tuning = _tuning._CURRENT.get
_DEFAULT_TUNING = _tuning.DEFAULT
_data_ptr = torch.Tensor.data_ptr
_inference_mode, _is_inference = torch.is_inference_mode_enabled, torch.Tensor.is_inference

_PREPARED: dict[tuple, "Prepared"] = {}
# Per stage, the keys its calls matched most recently, newest first: (check of the tensors, tuning or
# None, getter of the present arrays, getter of the absent ones or None, option types, options, key,
# Prepared) each.  Replaced whole (threads read a snapshot).
_RECENT: dict[Stage, tuple] = {}
_RECENT_KEPT = 4
# Per stage: (a getter of its array arguments in declaration order, their names, as many Nones, its
# option names, as many _ABSENTs).
_SPECS: dict[Stage, tuple] = {}
_ONLY_TENSORS = {torch.Tensor}
_is, _is_not, _grad_enabled = operator.is_, operator.is_not, torch.is_grad_enabled
_get_device, _stride, _is_meta = torch.Tensor.get_device, torch.Tensor.stride, operator.attrgetter("is_meta")
_shape, _dtype = operator.attrgetter("shape"), operator.attrgetter("dtype")
_strided = torch.strided


def _odd(value) -> bool:
    """A tensor the binding must see (nested, sparse: its errors name them), or not a tensor at all."""
    return value is not None and (value.__class__ is not torch.Tensor or value.is_nested or
                                  value.layout is not _strided)


def _spec(stage: Stage) -> tuple:
    arrays = stage.arrays
    options = tuple(p.name for p in stage.parameters if p.name in stage.options)
    spec = _SPECS[stage] = (_getter(arrays), arrays, (None,) * len(arrays), options, (_ABSENT,) * len(options))
    return spec


def _key(stage: Stage, arguments) -> tuple | None:
    """``(key, Prepared or None, tensors, present)``: the call key (module docstring), its prepared
    program where a recent key matched, and the array arguments in the stage's order (all; the present
    ones); ``None``: not a plain eager call.  Built with C-level passes (``map``) over the arrays: this
    is the per-call cost."""
    take, array_names, nones, option_names, absents = _SPECS.get(stage) or _spec(stage)
    try:
        tensors = take(arguments)  # the public functions give every array argument (None where absent)
    except KeyError:
        tensors = tuple(map(arguments.get, array_names))
    if True in map(_odd, tensors):  # (before any guard: torch's C check throws on a nested tensor)
        return None
    if option_names:
        options = tuple(map(arguments.get, option_names, absents))
        option_types = tuple(map(type, options))
    else:
        options = option_types = ()
    current = _current_tuning()
    tuned = None if current is _DEFAULT_TUNING else current
    for check, recent_tuning, take_present, take_absent, recent_types, recent_options, key, prepared in \
            _RECENT.get(stage, ()):
        # The types first: options of other types may not compare as plain values.  The check refuses
        # None, so a present array given as None fails it; the absent ones are checked to be None.
        if recent_tuning is tuned and recent_types == option_types and recent_options == options and \
                (take_absent is None or True not in map(_is_not, take_absent(tensors), nones)):
            present = take_present(tensors)
            if check(*present):
                return key, prepared, tensors, present
    absent = tuple(map(_is, tensors, nones))
    present = tuple(compress(tensors, map(_is_not, tensors, nones))) if True in absent else tensors
    if set(map(type, present)) != _ONLY_TENSORS:
        return None
    devices = tuple(map(_get_device, present))
    if _grad_enabled() and _any_requires_grad(*present):
        return None
    if -1 in devices and True in map(_is_meta, present):  # CPU and meta tensors both report -1
        return None
    key = (stage, tuned, absent, tuple(map(_shape, present)), tuple(map(_stride, present)),
           tuple(map(_dtype, present)), devices, option_types, options)
    return key, None, tensors, present


def _keep_recent(stage: Stage, key: tuple, prepared: "Prepared", present: tuple) -> None:
    """Keep ``key`` (just found in the memo for ``present``) as the stage's newest recent key."""
    guards = _tensor_guards()
    if guards is None or _any_requires_grad(*present):
        return
    check = guards(*present, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
    absent = key[2]
    take_present = _getter(tuple(i for i, missing in enumerate(absent) if not missing))
    take_absent = _getter(tuple(i for i, missing in enumerate(absent) if missing)) if True in absent else None
    _RECENT[stage] = ((check, key[1], take_present, take_absent, key[7], key[8], key, prepared),
                      *_RECENT.get(stage, ())[:_RECENT_KEPT - 1])


def run_prepared(stage: Stage, arguments, keep: bool) -> tuple:
    """Run a plain eager call through its prepared program: ``(prepared, results, tensors)`` -- results in
    ``program.results`` order, the call's array arguments --, or ``(MISS, key, None)``.

    With ``MISS`` the call has done nothing and must take the binding's
    path; ``key`` is then ``None`` for a call that is not a plain eager one,
    else what :func:`remember` takes once that path has run the call.  No
    version counter is bumped here.  ``keep``: the call may use the
    workspaces kept for its stream (a plain eager call; an op's
    implementation never does: under ``torch.compile(mode="reduce-overhead")``
    it runs inside the CUDA-graph tree's memory pool, which must hold no
    allocation but the graph's outputs)."""
    found = _key(stage, arguments)
    if found is None:
        return MISS, None, None
    key, prepared, tensors, present = found
    if prepared is None:
        try:
            prepared = _PREPARED.get(key)
        except TypeError:  # an unhashable option: the binding rejects it
            return MISS, None, None
        if prepared is not None:
            _keep_recent(stage, key, prepared, present)
    if prepared is None or _launch_module._observers or runtime.CHECK_SCALES:  # (the binding reads scales)
        return MISS, key, None
    results = prepared.run(tensors, present, keep)
    if results is MISS:
        return MISS, None, None
    return prepared, results, tensors


def remember(key, stage: Stage, program: Program, device: torch.device) -> None:
    """Prepare ``program`` for later calls with ``key`` (the general path has just run it on ``device``)."""
    if key is None:
        return
    if len(_PREPARED) >= _LIMIT:
        _PREPARED.clear()
    _PREPARED[key] = Prepared(program, stage.arrays, device, absent=key[2])


def clear() -> None:
    """Forget every prepared program, recent key and kept workspace (never needed for correctness)."""
    _PREPARED.clear()
    _RECENT.clear()
    _KEPT.clear()


class Prepared:
    """One call key's Program on one device: its schedule, and its launches bound per alignment class.

    Bound launches take their pointers from one flat list per call: the
    present array arguments' (in the stage's order), then the separately
    allocated buffers', then the scratch workspaces', then the zeroed ones'.
    """

    __slots__ = ("program", "schedule", "device", "index", "allocations", "scratch_views", "scratch_offsets",
                 "zeroed_views", "zeroed_offsets", "results", "positions", "kernels", "bound", "updated",
                 "take_updated", "take_results", "own_pointers", "workspaces", "last_views")

    def __init__(self, program: Program, arguments: tuple[str, ...], device: torch.device, absent: tuple[bool, ...]):
        self.program = program
        self.schedule = schedule = Schedule.of(program, arguments)
        self.device = device
        self.index = device.index if device.type == "cuda" else -1
        # (shape, torch dtype, fill or None) of each buffer allocated on its own.
        self.allocations = tuple((buffer.shape, DTYPES[buffer.dtype], fill)
                                 for _, buffer, fill in schedule.allocated)
        # (slot, byte offset, byte count, torch dtype, shape) of each workspace carved from the scratch.
        # (slot, byte offset, byte count, torch dtype, shape) of each workspace carved from the
        # zeroed allocation.
        self.scratch_views, self.zeroed_views = (tuple(
            (slot, offset, _launch_module.ITEMSIZE[buffer.dtype] * _count(buffer.shape),
             DTYPES[buffer.dtype], buffer.shape)
            for slot, buffer, offset in carved) for carved in (schedule.scratch, schedule.zeroed))
        self.scratch_offsets = tuple(offset for _, _, offset in schedule.scratch)
        self.zeroed_offsets = tuple(offset for _, _, offset in schedule.zeroed)
        # slot -> position in the per-call pointer list (absent arguments have none).
        present = [slot for slot, missing in enumerate(absent) if not missing]
        position = {slot: i for i, slot in enumerate(present)}
        for slot, _, _ in schedule.allocated:
            position[slot] = len(position)
        for slot, _, _ in (*schedule.scratch, *schedule.zeroed):
            position[slot] = len(position)
        self.positions = position
        # Each result: (0, argument slot) or (1, index among the allocations).
        allocated = [slot for slot, _, _ in schedule.allocated]
        self.results = tuple((0, slot) if slot < len(arguments) else (1, allocated.index(slot))
                             for slot in schedule.results)
        self.kernels = tuple({id(launch.kernel): launch.kernel for launch, _ in schedule.launches}.values())
        self.updated = schedule.updated
        self.take_updated = _getter(schedule.updated)
        # The results from (*arguments, *allocations).
        self.take_results = _getter(tuple(i if kind == 0 else len(arguments) + i for kind, i in self.results))
        self.own_pointers = len(present) + len(schedule.allocated)  # pointers before the workspaces' views
        self.workspaces = bool(self.scratch_offsets or self.zeroed_offsets)
        self.last_views = [(None, None), (None, None)]  # per workspace region: (base, its views' pointers)
        # alignment class -> (process environment, bindings, records: (launch function, leading arguments,
        # pointer getter, keyword values, gx, gy, gz) per launch)
        self.bound: dict = {}

    # -- one call ------------------------------------------------------------

    def run(self, tensors: tuple, present: tuple, keep: bool):
        """Allocate, launch, return the results in ``program.results`` order (``MISS``: take the general path).

        ``keep``: take the workspaces from those kept for this device, stream and thread."""
        if self.updated and not _inference_mode() and True in map(_is_inference, self.take_updated(tensors)):
            return MISS  # the general path raises torch's error
        compiled = not runtime.INTERPRETED
        stream = 0
        if compiled:
            launcher = _fast_launch.launch
            get_device = launcher._get_device
            if get_device is None:
                get_device, _ = launcher._driver_functions()
            if get_device() != self.index:
                return MISS  # launches go on the current device: the general path makes the tensors' current
            stream = launcher._get_stream(self.index)
        device = self.device
        # (The empty cases skipped: a one-launch call's Python is most of its host time.)
        allocated = [torch.empty(shape, dtype=dtype, device=device) if fill is None else
                     torch.full(shape, fill, dtype=dtype, device=device)
                     for shape, dtype, fill in self.allocations] if self.allocations else []
        scratch = zeroed = None
        if self.workspaces:
            schedule = self.schedule
            kept = _kept_workspaces(self.index, stream, compiled) if keep else [None, None]
            if self.scratch_offsets:
                scratch = _workspace(kept, 0, schedule.scratch_bytes, device)
            if self.zeroed_offsets:
                zeroed = _workspace(kept, 1, schedule.zeroed_bytes, device) if schedule.zeroed_refilled else \
                    torch.zeros(schedule.zeroed_bytes, dtype=torch.uint8, device=device)
        results = self.take_results((*tensors, *allocated) if allocated else tensors)
        if not compiled:
            env = self._env(tensors, allocated, scratch, zeroed)
            with runtime.interpreter_lock:
                for launch, slots in self.schedule.launches:
                    launch.kernel[launch.grid](*[env[i] for i in slots], **launch.scalars, **launch.constexprs,
                                               num_warps=launch.num_warps, num_stages=launch.num_stages)
            return results
        pointers = [*map(_data_ptr, present), *map(_data_ptr, allocated)] if allocated else [*map(_data_ptr, present)]
        if self.workspaces:
            # A workspace's views start at multiples of SCRATCH_ALIGNMENT: aligned where its base is.
            bases = 0
            for region, workspace, offsets in ((0, scratch, self.scratch_offsets),
                                               (1, zeroed, self.zeroed_offsets)):
                if workspace is not None:
                    base = _data_ptr(workspace)
                    bases |= base
                    pointers += self._views(region, base, offsets)
            misaligned = reduce(operator.or_, pointers[:self.own_pointers], bases) & 15
        else:
            misaligned = reduce(operator.or_, pointers, 0) & 15
        alignment = tuple([pointer & 15 == 0 for pointer in pointers]) if misaligned else _ALIGNED
        bound = self.bound.get(alignment)
        if bound is not None and _fast_launch.environment() == bound[0] and self._kernels_unchanged(bound[1]):
            for function, head, take, values, gx, gy, gz in bound[2]:
                function(gx, gy, gz, stream, *head, *take(pointers), *values)
        else:
            self._bind(self._env(tensors, allocated, scratch, zeroed), alignment, _fast_launch.environment())
        return results

    def _views(self, region: int, base: int, offsets: tuple) -> list:
        """The pointers of a workspace's views at ``base`` (the last base's list again: kept workspaces)."""
        last = self.last_views[region]
        if last[0] != base:
            last = self.last_views[region] = (base, [base + offset for offset in offsets])
        return last[1]

    def _env(self, tensors: tuple, allocated: list, scratch, zeroed) -> list:
        """Every slot's tensor: the arguments, the allocations, views of the workspaces in the scratch
        and in the zeroed allocation."""
        env = [*tensors, *[None] * (len(allocated) + len(self.scratch_views) + len(self.zeroed_views))]
        for (slot, _, _), tensor in zip(self.schedule.allocated, allocated):
            env[slot] = tensor
        for region, views in ((scratch, self.scratch_views), (zeroed, self.zeroed_views)):
            for slot, offset, size, dtype, shape in views:
                env[slot] = region[offset:offset + size].view(dtype).view(shape)
        return env

    @staticmethod
    def _kernels_unchanged(bindings) -> bool:
        for binding in bindings:
            if binding.kernel.pre_run_hooks or not binding.globals_unchanged():
                return False
        return True

    def _bind(self, env: list, alignment, process) -> None:
        """Launch through the fast launcher (tensors), and keep the bindings it used for this alignment class."""
        launcher = _fast_launch.launch
        records, bindings = [], []
        for launch, slots in self.schedule.launches:
            args = tuple(env[i] for i in slots)
            binding = launcher(launch.kernel, launch.grid, args, launch.scalars, launch.constexprs,
                               launch.num_warps, launch.num_stages)
            if binding is None or any(i not in self.positions for i in slots):
                records = None  # not every launch can be bound: keep launching this way
            if records is None:
                continue
            take = _getter(tuple(self.positions[i] for i in slots))
            values = launcher.keyword_values(launch.kernel, len(args), launch.scalars, launch.constexprs)
            gx, gy, gz = (*launch.grid, 1, 1)[:3]
            records.append((binding.launch, (*binding.leading, binding.packed_metadata, None, None, None), take,
                            values, gx, gy, gz))
            bindings.append(binding)
        if records is not None and process is not None:
            self.bound[alignment] = (process, tuple(bindings), tuple(records))


# -- workspaces kept between calls ------------------------------------------
#
# The scratch is written before it is read, and a refilled zeroed allocation
# is all zeros again when the call's launches are done (Schedule.zeroed_refilled),
# so calls that follow one another can share both: the kernels of one stream
# run in order (with PDL too: each kernel waits for the one before it before
# touching memory).  Kept per device, stream and thread (two threads launching
# on one stream interleave their launches), never while a CUDA graph is being
# captured (the graph would bake them in, and replay them on other streams),
# and only up to _KEPT_BYTES: a larger workspace is allocated per call.

_KEPT: dict[tuple, list] = {}  # (device index, stream, thread) -> [scratch or None, zeroed or None]
_KEPT_BYTES = 32 << 20
_KEPT_STREAMS = 64  # entries before all are dropped (a process that makes a stream per request)
_thread = threading.get_ident
_capturing = torch.cuda.is_current_stream_capturing


def _kept_workspaces(index: int, stream: int, compiled: bool) -> list:
    """The kept [scratch, zeroed] pair for this call's device, stream and thread (a fresh pair while
    the stream is being captured)."""
    if compiled and _capturing():
        return [None, None]
    key = (index, stream, _thread())
    kept = _KEPT.get(key)
    if kept is None:
        if len(_KEPT) >= _KEPT_STREAMS:
            _KEPT.clear()
        kept = _KEPT[key] = [None, None]
    return kept


def _workspace(kept: list, region: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """At least ``nbytes`` of the kept ``region`` (0: scratch, uninitialised; 1: zeroed), grown as needed."""
    tensor = kept[region]
    if tensor is not None and tensor.numel() >= nbytes:
        return tensor
    tensor = (torch.zeros if region else torch.empty)(nbytes, dtype=torch.uint8, device=device)
    if nbytes <= _KEPT_BYTES:
        kept[region] = tensor
    return tensor


def _getter(keys: tuple):
    """``values -> tuple(values[k] for k in keys)``, always a tuple (operator.itemgetter: one C call)."""
    if len(keys) == 1:
        return lambda values, k=keys[0]: (values[k],)
    return operator.itemgetter(*keys) if keys else (lambda values: ())


def _count(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
