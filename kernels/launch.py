"""Framework-free launch descriptions shared by the torch and JAX adapters.

A stage's plan function turns array metadata (:class:`ArrayInfo`) and Python
options into a :class:`Program`: the fresh arrays to allocate and the kernel
launches to run over named arrays.  The adapters only bind names to their own
arrays and launch; every decision (validation, grid, tile sizes, in-place
updates) is made here, once.

Conventions every kernel follows, so one signature serves both adapters:

* parameters are ordered *inputs*, then *outputs*, then scalars, then
  constexprs (jax-triton appends one pointer per output after the inputs and
  passes every keyword as a compile-time constant);
* an output whose name is also an input is updated in place: torch passes the
  same tensor for both parameters, JAX aliases the output to the input
  (``input_output_aliases``);
* ``scalars`` (sizes, strides) are runtime arguments in torch and constants in
  JAX; ``constexprs`` are constants in both.

:func:`execute` is the one executor of a Program: both adapters (and the JAX
CPU path) call it with their own ``allocate`` and ``launch`` callables, so
allocation, skipped empty launches, output threading, fills of unwritten
buffers and instrumentation (:func:`observe_launches`) behave the same
everywhere.  The one exception is the torch accelerator's steady eager calls
(``qsa_torch._accel._eager``): they run a :class:`Schedule` of the same Program --
the same launches, fills and results, workspaces carved from one
allocation -- and fall back to :func:`execute` whenever an observer is
registered.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

from . import runtime

__all__ = ["ArrayInfo", "Buffer", "ITEMSIZE", "Launch", "LaunchEvent", "Program", "Schedule", "contiguous_strides",
           "execute", "fused_launch", "kernel_name", "observe_launches", "triton_launch"]

#: Bytes per element of every dtype a plan names.
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "int32": 4, "int64": 8,
            "uint8": 1}
#: Alignment of each buffer carved from a :class:`Schedule`'s scratch (what a CUDA allocation guarantees, at least).
SCRATCH_ALIGNMENT = 256


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements, of an array of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class ArrayInfo(NamedTuple):
    """What a plan may know of an array: shape, dtype name and strides.

    ``dtype`` is a NumPy-style name (``"bfloat16"``, ``"float8_e4m3fn"``,
    ``"int32"``...); ``strides`` are in elements.  A NamedTuple: cheap to
    build on every call and hashable, so plans can be memoised on it.
    """

    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...]

    @classmethod
    def contiguous(cls, shape, dtype: str) -> "ArrayInfo":
        shape = tuple(int(s) for s in shape)
        return cls(shape, dtype, contiguous_strides(shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Buffer:
    """A fresh array the program allocates (an output or a workspace).

    Launches that run write every element of the buffers they output (tests
    poison allocations to prove it), so a buffer is allocated uninitialised.
    ``fill`` is what it holds when it must have a value that no launch gives
    it: a result, or a launch input, that no launch before writes (every
    writer has an empty grid).  The executor applies it, identically in both
    adapters.

    ``refilled``: every run of the program leaves the buffer holding
    ``fill`` again (tickets and histograms that the last program to use
    them sets back to zero), so an executor that runs programs one after
    another on one stream may keep it from one call to the next instead of
    filling a fresh one (qsa_torch's eager path: docs/design.md).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    fill: int | float = 0
    refilled: bool = False

    @property
    def info(self) -> ArrayInfo:
        return ArrayInfo.contiguous(self.shape, self.dtype)


@dataclass(frozen=True)
class Launch:
    """One kernel launch over named arrays."""

    kernel: Any
    grid: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    scalars: Mapping[str, int | float] = field(default_factory=dict)
    constexprs: Mapping[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_kernel_arguments(self)

    def aliases(self) -> dict[int, int]:
        """Input index -> output index for outputs updated in place."""
        return {
            self.inputs.index(name): j
            for j, name in enumerate(self.outputs)
            if name in self.inputs
        }

    @property
    def empty(self) -> bool:
        return math.prod(self.grid) == 0


def fused_launch(kernel, parts: tuple[tuple[str, Launch], ...], num_warps: int) -> Launch:
    """One launch of ``kernel`` doing the work of independent launches ``parts``: ``(prefix, launch)``.

    Its grid is one dimension: each part's programs in turn, the part's grid
    (at most two dimensions) flattened row-major.  Its array arguments are
    every part's inputs, then every part's outputs, in part order; its
    scalars and constexprs each part's under the part's prefix, and per part
    ``<prefix>programs`` and ``<prefix>grid_1`` (its program count and its
    grid's second extent), for ``kernel`` to find which part's program it
    runs.  The parts must read nothing another writes: nothing orders their
    programs.  ``num_stages``: the parts' largest.
    """
    scalars, constexprs = {}, {}
    for prefix, launch in parts:
        if len(launch.grid) > 2:
            raise ValueError(f"fused_launch: the {prefix!r} part has a {len(launch.grid)}-dimensional grid")
        extent_0, extent_1 = (*launch.grid, 1)[:2]
        scalars[f"{prefix}programs"], scalars[f"{prefix}grid_1"] = extent_0 * extent_1, extent_1
        scalars.update({prefix + name: value for name, value in launch.scalars.items()})
        constexprs.update({prefix + name: value for name, value in launch.constexprs.items()})
    return Launch(kernel=kernel, grid=(sum(scalars[f"{prefix}programs"] for prefix, _ in parts),),
                  inputs=tuple(name for _, launch in parts for name in launch.inputs),
                  outputs=tuple(name for _, launch in parts for name in launch.outputs),
                  scalars=scalars, constexprs=constexprs, num_warps=num_warps,
                  num_stages=max(launch.num_stages for _, launch in parts))


def kernel_name(kernel) -> str:
    """A Triton kernel's function name (compiled ``JITFunction`` or interpreted)."""
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


@functools.lru_cache(maxsize=None)
def _kernel_parameters(kernel) -> tuple[tuple[str, bool, bool], ...]:
    """``(name, is_constexpr, has_default)`` of each parameter of a ``@triton.jit`` kernel."""
    fn = getattr(kernel, "fn", kernel)
    while hasattr(fn, "fn"):  # autotuners/heuristics wrap the JITFunction
        fn = fn.fn
    return tuple(
        (p.name, "constexpr" in str(p.annotation), p.default is not inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values())


def check_kernel_arguments(launch: Launch) -> None:
    """Every name a launch binds is a parameter of its kernel, and every parameter is bound.

    Pointers are positional (inputs then outputs); sizes and strides
    (``scalars``) and ``constexprs`` are keywords.  jax-triton passes every
    keyword as a compile-time constant, so a misspelled keyword would
    silently become an unused constant there: refuse it here, when the plan
    builds the launch.
    """
    parameters = _kernel_parameters(launch.kernel)
    name = kernel_name(launch.kernel)
    positional = len(launch.inputs) + len(launch.outputs)
    names = [p[0] for p in parameters]
    if positional > len(names):
        raise TypeError(f"Launch of {name}: {positional} array arguments (inputs {launch.inputs}, outputs "
                        f"{launch.outputs}) but the kernel has {len(names)} parameters {tuple(names)}")
    keywords = {p[0]: p for p in parameters[positional:]}
    for kind, bound in (("scalars", launch.scalars), ("constexprs", launch.constexprs)):
        for key in bound:
            if key in names[:positional]:
                raise TypeError(f"Launch of {name}: {kind} key {key!r} is also bound positionally: inputs and "
                                f"outputs cover the first {positional} parameters {tuple(names[:positional])}")
            if key not in keywords:
                raise TypeError(f"Launch of {name}: {kind} key {key!r} is not a parameter of the kernel "
                                f"(keyword parameters: {tuple(keywords)})")
            if keywords[key][1] != (kind == "constexprs"):
                wanted = "constexprs" if keywords[key][1] else "scalars"
                raise TypeError(f"Launch of {name}: {key!r} is given in {kind} but is "
                                f"{'a tl.constexpr' if keywords[key][1] else 'a runtime'} parameter "
                                f"(put it in {wanted})")
    duplicated = set(launch.scalars) & set(launch.constexprs)
    if duplicated:
        raise TypeError(f"Launch of {name}: {sorted(duplicated)} given both as scalars and constexprs")
    missing = [key for key, (_, _, has_default) in keywords.items()
               if not has_default and key not in launch.scalars and key not in launch.constexprs]
    if missing:
        raise TypeError(f"Launch of {name}: parameters {missing} are not bound (by scalars or constexprs)")


@dataclass(frozen=True)
class Program:
    """Everything a public call runs: fresh buffers, launches, results.

    Names used by launches are either arguments (bound by the adapter) or
    buffers declared here.  ``results`` are returned in order.
    """

    function: str
    buffers: tuple[Buffer, ...]
    launches: tuple[Launch, ...]
    results: tuple[str, ...]

    def __post_init__(self):
        fresh = {b.name for b in self.buffers}
        for launch in self.launches:
            for name in launch.outputs:
                # An argument is updated in place: torch writes the caller's
                # tensor, JAX must alias it, so the launch must also read it.
                if name not in fresh and name not in launch.inputs:
                    raise ValueError(f"{self.function}: launch of {kernel_name(launch.kernel)} writes argument "
                                     f"{name!r} without reading it (updated arguments must be inputs too)")

    def buffer(self, name: str) -> Buffer | None:
        for b in self.buffers:
            if b.name == name:
                return b
        return None

    @functools.cached_property
    def scale_arguments(self) -> tuple[str, ...]:
        """Arguments the launches read that are fp8 scales (:data:`SCALE_ARGUMENTS`)."""
        fresh = {b.name for b in self.buffers}
        return tuple(dict.fromkeys(name for launch in self.launches for name in launch.inputs
                                   if name in SCALE_ARGUMENTS and name not in fresh))

    @functools.cached_property
    def updated_arguments(self) -> tuple[str, ...]:
        """Arguments some launch writes in place (caches)."""
        fresh = {b.name for b in self.buffers}
        names: list[str] = []
        for launch in self.launches:
            for name in launch.outputs:
                if name not in fresh and name not in names:
                    names.append(name)
        return tuple(names)

    @functools.cached_property
    def fresh_results(self) -> tuple[str, ...]:
        """The results that are buffers (allocated by the call), in ``results`` order."""
        fresh = {b.name for b in self.buffers}
        return tuple(name for name in self.results if name in fresh)

    def returned(self, results: tuple):
        """Results as the public function returns them: a lone result bare, else the tuple."""
        return results[0] if len(results) == 1 else results

    @functools.cached_property
    def runnable_launches(self) -> tuple[Launch, ...]:
        """The launches with a nonempty grid (an empty grid launches nothing)."""
        return tuple(launch for launch in self.launches if not launch.empty)

    @functools.cached_property
    def filled_buffers(self) -> frozenset[str]:
        """Buffers allocated with their ``fill``: results and launch inputs that no runnable launch wrote first."""
        written: set[str] = set()
        needed: set[str] = set()
        fresh = {b.name: b for b in self.buffers}
        for launch in self.runnable_launches:
            needed.update(name for name in launch.inputs if name in fresh and name not in written)
            written.update(launch.outputs)
        needed.update(name for name in self.results if name in fresh and name not in written)
        return frozenset(needed)


@dataclass(frozen=True)
class Schedule:
    """A Program's runnable launches over numbered slots, for an executor that runs it many times.

    Slots ``0 .. len(arguments) - 1`` are the call's arguments in the order
    the executor lists them, then one slot per buffer of the program, in
    ``program.buffers`` order.  Buffers that are neither results nor filled
    (workspaces the launches write before reading) are carved from one
    ``scratch_bytes`` allocation at ``scratch`` offsets, each
    :data:`SCRATCH_ALIGNMENT`-aligned; workspaces that must start at zero
    (tickets, histograms: ``fill`` 0) likewise from one ``zeroed_bytes``
    allocation of zeros at ``zeroed`` offsets, so a program pays one fill
    whatever the number of its zeroed workspaces (all-zero bytes are a zero of
    every dtype); the others are ``allocated`` one by one (``fill`` ``None``:
    uninitialised).  An in-place executor (torch) needs no output threading:
    every launch's outputs are the arrays in its slots.  ``zeroed_refilled``:
    every zeroed workspace is :attr:`Buffer.refilled`, so the zeroed
    allocation is all zeros again after each run (and the scratch is always
    written before it is read): an executor may keep both between runs that
    follow one another.
    """

    arguments: tuple[str, ...]
    scratch: tuple[tuple[int, Buffer, int], ...]  # (slot, buffer, byte offset)
    scratch_bytes: int
    zeroed: tuple[tuple[int, Buffer, int], ...]  # (slot, buffer, byte offset) in the zeroed allocation
    zeroed_bytes: int
    allocated: tuple[tuple[int, Buffer, int | float | None], ...]  # (slot, buffer, fill or None)
    launches: tuple[tuple[Launch, tuple[int, ...]], ...]  # (launch, slots of its inputs then outputs)
    results: tuple[int, ...]
    updated: tuple[int, ...]  # slots of the arguments some launch writes in place
    zeroed_refilled: bool = False

    @classmethod
    def of(cls, program: "Program", arguments: tuple[str, ...]) -> "Schedule":
        slot = {name: i for i, name in enumerate(arguments)}
        missing = set(program.updated_arguments) - set(slot)
        if missing:
            raise ValueError(f"{program.function}: arguments {sorted(missing)} are not among {arguments}")
        scratch, zeroed, allocated, ends = [], [], [], {"scratch": 0, "zeroed": 0}
        filled, results = program.filled_buffers, set(program.results)

        def carve(region: str, carved: list, index: int, buffer: Buffer) -> None:
            carved.append((index, buffer, ends[region]))
            size = math.prod(buffer.shape) * ITEMSIZE[buffer.dtype]
            ends[region] += -(-size // SCRATCH_ALIGNMENT) * SCRATCH_ALIGNMENT

        for i, buffer in enumerate(program.buffers):
            index = slot[buffer.name] = len(arguments) + i
            if buffer.name in results:
                allocated.append((index, buffer, buffer.fill if buffer.name in filled else None))
            elif buffer.name not in filled:
                carve("scratch", scratch, index, buffer)
            elif buffer.fill == 0:
                carve("zeroed", zeroed, index, buffer)
            else:
                allocated.append((index, buffer, buffer.fill))
        launches = tuple((launch, tuple(slot[name] for name in (*launch.inputs, *launch.outputs)))
                         for launch in program.runnable_launches)
        return cls(arguments, tuple(scratch), ends["scratch"], tuple(zeroed), ends["zeroed"], tuple(allocated),
                   launches,
                   tuple(slot[name] for name in program.results),
                   tuple(slot[name] for name in program.updated_arguments),
                   all(buffer.refilled for _, buffer, _ in zeroed))


# --------------------------------------------------------------------------
# The executor and its instrumentation hook
# --------------------------------------------------------------------------

class LaunchEvent(NamedTuple):
    """What an observer sees of one kernel launch (see :func:`observe_launches`)."""

    adapter: str  # "torch", "jax" (compiled: seen when jax traces the call) or "jax-host" (CPU callback)
    function: str  # the public function the program serves
    kernel: str  # the kernel's function name
    grid: tuple[int, ...]
    launch: Launch


_observers: list[Callable[[LaunchEvent], None]] = []
_observers_lock = threading.Lock()


@contextlib.contextmanager
def observe_launches(callback: Callable[[LaunchEvent], None] | None = None) -> Iterator[list[LaunchEvent]]:
    """See every kernel launch any adapter makes while the context is open.

    With no ``callback``, the events are collected in the list the context
    yields.  Observers are process-wide (the JAX CPU path launches from its
    interpreter thread) and are called just before each launch.  Empty
    launches are skipped and never seen.
    """
    events: list[LaunchEvent] = []
    observer = events.append if callback is None else callback
    with _observers_lock:
        _observers.append(observer)
    try:
        yield events
    finally:
        with _observers_lock:
            _observers.remove(observer)


def triton_launch(launch: Launch, inputs: Sequence, outputs: Sequence) -> Sequence:
    """Launch ``launch`` with Triton's own ``kernel[grid](...)`` (in place: returns ``outputs``)."""
    launch.kernel[launch.grid](*inputs, *outputs, **launch.scalars, **launch.constexprs,
                               num_warps=launch.num_warps, num_stages=launch.num_stages)
    return outputs


#: The names every stage gives its per-tensor fp8 scales (the step: its state's fields).
SCALE_ARGUMENTS = frozenset({"k_scale", "v_scale", "scale", "compressed_key_scale"})


def check_scale_values(function: str, name: str, values: Sequence[float]) -> None:
    """Under ``QSA_CHECK_SCALES``: ``values`` (one scale's elements, read on the host) are finite and > 0."""
    if not all(math.isfinite(value) and value > 0 for value in values):
        raise ValueError(f"{function}: {name} must be finite and > 0 (QSA_CHECK_SCALES=1 checks the scales' "
                         f"values), got {[float(value) for value in values]}")


def check_scales(program: Program, arrays: Mapping[str, Any],
                 read: Callable[[str, Any], Sequence[float] | None]) -> None:
    """The debug check of :data:`~qsa_kernels.runtime.CHECK_SCALES`, before anything is allocated or launched.

    ``read(name, array)``: the array's elements on the host, or ``None`` where
    the adapter cannot read them now (a CUDA graph being captured; a traced
    JAX value, which the adapter checks when the computation runs).
    """
    for name in program.scale_arguments:
        array = arrays.get(name)
        values = None if array is None else read(name, array)
        if values is not None:
            check_scale_values(program.function, name, values)


def execute(program: Program, arrays: Mapping[str, Any], *, adapter: str,
            allocate: Callable[[Buffer, int | float | None], Any],
            launch: Callable[[Launch, list, list], Sequence],
            guard: Callable[[], Any] | None = None,
            prepare: Callable[[Launch, list, list], None] | None = None,
            read: Callable[[str, Any], Sequence[float] | None] | None = None) -> tuple:
    """Run ``program`` over ``arrays`` (its arguments by name; ``None`` for absent ones).

    ``allocate(buffer, fill)`` makes a buffer's array: uninitialised when
    ``fill`` is ``None``, else filled with it (``Program.filled_buffers``).
    ``launch(launch, inputs, outputs)`` runs one launch and returns its
    outputs' new values (torch: the same tensors, written in place; JAX: the
    arrays ``triton_call`` returns).  Outputs are threaded through later
    launches; empty launches are skipped; ``guard()``, if given, is entered
    around the launches (interpreter lock, CUDA device).  ``prepare(launch,
    inputs, outputs)``, if given, builds a launch's kernel without running it:
    it is called for every launch of a multi-launch program before the first
    one runs, so that a kernel that cannot be built (compile error, too much
    shared memory) fails the call before any launch writes a cache.
    ``read(name, array)``, if given, reads a scale on the host for
    ``QSA_CHECK_SCALES`` (:func:`check_scales`).  Returns the results, in
    ``program.results`` order.
    """
    if read is not None and runtime.CHECK_SCALES:
        check_scales(program, arrays, read)
    env = dict(arrays)
    filled = program.filled_buffers
    for buffer in program.buffers:
        env[buffer.name] = allocate(buffer, buffer.fill if buffer.name in filled else None)
    launches = program.runnable_launches
    if launches:
        with guard() if guard is not None else contextlib.nullcontext():
            if prepare is not None and len(launches) > 1:
                for step in launches:
                    prepare(step, [env[name] for name in step.inputs], [env[name] for name in step.outputs])
            for step in launches:
                if _observers:
                    event = LaunchEvent(adapter, program.function, kernel_name(step.kernel), step.grid, step)
                    for observer in tuple(_observers):
                        observer(event)
                outputs = launch(step, [env[name] for name in step.inputs], [env[name] for name in step.outputs])
                for name, value in zip(step.outputs, outputs):
                    env[name] = value
    return tuple(env[name] for name in program.results)
