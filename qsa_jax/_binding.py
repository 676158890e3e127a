"""The JAX binding: qsa_kernels programs over JAX arrays, through the one executor.

Public APIs only (JAX, jax-triton's ``triton_call``): tests/test_binding.py
scans this module's imports.  Compiled process: each launch is a
``jax_triton.triton_call`` (this module is the only one that calls
jax-triton; jax-triton lowers it itself).  Interpreted process (no CUDA
device; jax-triton cannot even be imported with a CPU-only jaxlib): the
whole program runs from one host callback through the shared executor
(``qsa_kernels.launch.execute``) on zero-copy CPU torch tensors, so the
same plans and kernels run under ``jax.jit`` in CI.

The accelerator (``qsa_jax._lowering``: installed unless
``QSA_ACCELERATE=0``) plugs in through :data:`hook`: it binds each launch
itself and re-lowers it to jaxlib's typed-FFI call with a slimmed payload
(the same kernel, arguments and bits; less host time per launch).

Every call is wrapped so that ``jax.grad`` and ``jax.vmap`` fail with a message
naming the public function, not an internal error.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from jax import Array
    from jax.typing import ArrayLike

from qsa_kernels import runtime
from qsa_kernels.launch import (ArrayInfo, Buffer, Launch, Program, check_scale_values, check_scales, execute,
                                kernel_name, triton_launch)
from qsa_kernels.stage import RUN_PROGRAM_DOC, Stage
from qsa_kernels.stage import plan_seam as stage_plan_seam
from qsa_kernels.validate import check_host_indices_fit_int32, device_error, type_error

from . import _sharding

_BITS_VIEW = {  # dtypes torch.from_numpy cannot take: move them as raw bits
    np.dtype(ml_dtypes.bfloat16): ("uint16", "bfloat16"),
    np.dtype(ml_dtypes.float8_e4m3fn): ("uint8", "float8_e4m3fn"),
}


def _device_of(value):
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        devices = value.devices()
    except Exception:  # pragma: no cover - non-committed values
        return None
    return next(iter(devices)) if len(devices) == 1 else tuple(devices)


def metadata(function: str, arrays: Mapping[str, object]):
    """Check types and devices, convert NumPy inputs, read metadata.

    Returns ``(arrays, infos)``: the JAX arrays (``None`` for absent optional
    arguments) and their :class:`ArrayInfo` (row-major strides).
    """
    converted: dict[str, jax.Array | None] = {}
    infos: dict[str, ArrayInfo | None] = {}
    first = None
    for name, value in arrays.items():
        if value is None:
            converted[name] = infos[name] = None
            continue
        if isinstance(value, np.ndarray):
            value, host = jnp.asarray(value), value
            if value.dtype != host.dtype:  # without x64, int64 narrows to int32: it must not wrap
                check_host_indices_fit_int32(function, name, host)
        elif not isinstance(value, jax.Array):
            raise type_error(function, name, "a JAX array", value)
        device = _device_of(value)
        if device is not None:
            if first is None:
                first = (name, device)
            elif device != first[1]:
                raise device_error(function, name, device, *first)
            platform = getattr(device, "platform", None)
            if not runtime.INTERPRETED and platform not in ("gpu", "cuda", None):
                raise ValueError(f"{function}: this process runs compiled Triton kernels, so arrays must be on a CUDA device, got {device}")
        converted[name] = value
        infos[name] = ArrayInfo.contiguous(value.shape, np.dtype(value.dtype).name)
    return converted, infos


def _to_torch(array: np.ndarray):
    import torch

    array = np.asarray(array)
    raw = _BITS_VIEW.get(array.dtype)
    if raw is not None:
        return torch.from_numpy(array.view(raw[0])).view(getattr(torch, raw[1]))
    return torch.from_numpy(array)


def _to_numpy(tensor) -> np.ndarray:
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return tensor.numpy()


class _InterpreterThread:
    """One thread, started at import, that runs every host-callback launch.

    XLA:CPU runs host callbacks with subnormals flushed to zero (FTZ/DAZ),
    which the interpreter's NumPy arithmetic would inherit: torch and JAX
    would then disagree on subnormal inputs.  A thread started here keeps the
    importing thread's default floating-point environment.
    """

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="qsa-interpreter", daemon=True).start()

    def _serve(self):
        while True:
            job, outcome, done = self._jobs.get()
            try:
                outcome.append((True, job()))
            except BaseException as error:  # handed back to the callback's thread
                outcome.append((False, error))
            done.set()

    def __call__(self, job: Callable):
        outcome, done = [], threading.Event()
        self._jobs.put((job, outcome, done))
        done.wait()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


_interpreter_thread = _InterpreterThread() if runtime.INTERPRETED else None


#: What to install for the CPU path (the README's Install table says the same).
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _host_torch(function: str):
    """torch, on whose CPU tensors the interpreter runs (never through qsa_torch), or an error naming the remedy.

    The ``jax`` extra does not require torch (from PyPI it is a multi-GB CUDA
    build): a JAX-only environment learns here, at its first call, which torch
    the CPU path needs.
    """
    try:
        import torch
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        raise ModuleNotFoundError(
            f"{function}: without a CUDA device qsa_jax runs the kernels through Triton's interpreter on CPU "
            f"torch tensors, and torch is not installed: install its CPU build ({CPU_TORCH})",
            name="torch") from None
    return torch


def _run_on_host(program: Program, names, arrays):
    torch = _host_torch(program.function)

    updated = set(program.updated_arguments)
    result_types = []
    for name in program.results:
        buffer = program.buffer(name)
        if buffer is not None:
            result_types.append(jax.ShapeDtypeStruct(buffer.shape, jnp.dtype(buffer.dtype)))
        else:
            source = arrays[names.index(name)]
            result_types.append(jax.ShapeDtypeStruct(source.shape, source.dtype))

    def allocate(buffer: Buffer, fill):
        dtype = getattr(torch, buffer.dtype)  # plans name dtypes as torch does
        if fill is None:
            return torch.empty(buffer.shape, dtype=dtype)
        return torch.full(buffer.shape, fill, dtype=dtype)

    def host(*host_arrays):
        tensors = {}
        for name, array in zip(names, host_arrays):
            array = np.array(array, copy=True) if name in updated else np.asarray(array)
            if not array.flags.writeable:
                array = array.copy()
            tensors[name] = _to_torch(array)
        outputs = _interpreter_thread(lambda: execute(
            program, tensors, adapter="jax-host", allocate=allocate, launch=triton_launch,
            guard=lambda: runtime.interpreter_lock))
        return tuple(_to_numpy(out) for out in outputs)

    return jax.pure_callback(host, tuple(result_types), *arrays)


# --------------------------------------------------------------------------
# The compiled path: one jax-triton launch per launch
# --------------------------------------------------------------------------

#: The XLA custom-call targets a jitted qsa_jax function may contain (jaxlib's Triton handlers: the
#: legacy call jax-triton 0.3 emits, the typed-FFI call of 0.4 and of the accelerator), for
#: ``jax.export.DisabledSafetyCheck.custom_call``.
CUSTOM_CALL_TARGETS = ("triton_kernel_call", "triton_kernel_call_ffi")


class Accelerator(Protocol):
    """What ``qsa_jax._lowering`` plugs in (:func:`install`)."""

    def launcher(self, jax_triton) -> Callable[[Launch, list, list], list] | None:
        """How launches traced now are bound and lowered; ``None``: jax-triton's own way."""

    def lowering(self) -> str:
        """The lowering in force for launches traced now (``"ffi"``, ``"legacy"``, ``"jax-triton"``)."""

    def lowering_available(self, name: str) -> bool: ...

    def use_lowering(self, name: str) -> contextlib.AbstractContextManager: ...

    def describe(self) -> dict[str, str]: ...


#: The installed accelerator, or ``None`` (``QSA_ACCELERATE=0``: jax-triton lowers every launch).
hook: Accelerator | None = None


def install(accelerator: Accelerator | None) -> None:
    """Plug ``accelerator`` in (``None``: take it out)."""
    global hook
    hook = accelerator


def import_jax_triton():
    """``jax_triton``, imported with ``TRITON_CACHE_DIR`` put back as it was (importing it sets it to ""
    (0.3) or removes it (0.4), after which torch-side Triton launches fail)."""
    previous = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous
    if jax_triton_api(jax_triton) == "0.4":
        import triton

        if tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2]) < (3, 7):
            raise ImportError(f"jax-triton {jax_triton.__version__} needs triton >= 3.7, and this is triton "
                              f"{triton.__version__}: install jax-triton 0.3.1 or a newer triton")
    return jax_triton


def jax_triton_api(jax_triton) -> str:
    """``"0.3"`` or ``"0.4"``: how the installed ``triton_call`` binds outputs (its public signature says)."""
    return "0.4" if "out_type" in inspect.signature(jax_triton.triton_call).parameters else "0.3"


def allocate(buffer: Buffer, fill):
    """The executor's ``allocate``: unfilled buffers are placeholders (the launch that writes one gets
    its shape and dtype as an out_shape and returns the array)."""
    if fill is None:
        return jax.ShapeDtypeStruct(buffer.shape, jnp.dtype(buffer.dtype))
    return jnp.full(buffer.shape, fill, jnp.dtype(buffer.dtype))


def out_types(outputs: list) -> list:
    return [jax.ShapeDtypeStruct(value.shape, value.dtype) for value in outputs]


def call_03(jax_triton, launch: Launch, inputs: list, outputs: list, name: str | None = None) -> list:
    """jax-triton 0.3's ``triton_call``: a pointer per input, then per output (aliased ones too: the
    kernels' layout, torch passing an in-place tensor twice), every keyword a constant.  ``name``:
    the launch's (the accelerator's rule reads it); default ``qsa:<kernel>``."""
    return jax_triton.triton_call(
        *inputs, kernel=launch.kernel, out_shape=out_types(outputs), grid=launch.grid,
        name=name or "qsa:" + kernel_name(launch.kernel), input_output_aliases=launch.aliases(),
        num_warps=launch.num_warps, num_stages=launch.num_stages, **launch.scalars, **launch.constexprs)


def _call_04(jax_triton, launch: Launch, inputs: list, outputs: list) -> list:
    """jax-triton 0.4's ``triton_call``, which gives an aliased output no pointer of its own: it binds
    launches without in-place arrays only (the accelerator binds the others)."""
    if launch.aliases():
        raise NotImplementedError(
            f"{kernel_name(launch.kernel)} updates arrays in place, which jax-triton {jax_triton.__version__}'s "
            f"triton_call cannot bind for this package's kernels (an aliased output gets no pointer of its own): "
            f"install jax-triton 0.3.1, or leave the accelerator on (QSA_ACCELERATE unset), which binds them "
            f"for the jax-triton releases it lists (qsa_jax._lowering.VERIFIED)")
    return jax_triton.triton_call(
        *inputs, kernel=launch.kernel, out_type=out_types(outputs), grid=launch.grid,
        name="qsa:" + kernel_name(launch.kernel), num_warps=launch.num_warps, num_stages=launch.num_stages,
        **launch.scalars, **launch.constexprs)


_jax_triton = None


def _run_compiled(program: Program, names, arrays):
    global _jax_triton
    if _jax_triton is None:
        _jax_triton = import_jax_triton()
    launch = hook.launcher(_jax_triton) if hook is not None else None
    if launch is None:
        bind = call_03 if jax_triton_api(_jax_triton) == "0.3" else _call_04
        launch = functools.partial(bind, _jax_triton)
    return execute(program, dict(zip(names, arrays)), adapter="jax", allocate=allocate, launch=launch)


# How launches reach XLA: the accelerator's choice, else jax-triton's own lowering.

def triton_lowering() -> str:
    """How Triton launches traced from now on reach XLA: ``"ffi"``, ``"legacy"`` or
    ``"jax-triton"`` (``"interpreter"`` in a process without a CUDA device, where every
    launch runs from a host callback instead)."""
    if hook is not None:
        return hook.lowering()  # (its QSA_JAX_LOWERING checked first, interpreted or not)
    return "interpreter" if runtime.INTERPRETED else "jax-triton"


def triton_lowering_available(name: str) -> bool:
    """Whether launches can lower the ``name`` way here without forcing: ``"auto"`` and
    ``"jax-triton"`` in any compiled process; ``"legacy"`` and ``"ffi"`` where the accelerator
    is on and the installed jax-triton and jaxlib are verified (``"ffi"``: and jaxlib registers
    its FFI handler)."""
    if hook is not None:
        return hook.lowering_available(name)
    _check_lowering(name)
    return not runtime.INTERPRETED and name in ("auto", "jax-triton")


@contextlib.contextmanager
def use_triton_lowering(name: str) -> Iterator[None]:
    """Lower the Triton launches traced inside the block the ``name`` way (``"auto"``, ``"ffi"``,
    ``"legacy"`` or ``"jax-triton"``; the default is the ``QSA_JAX_LOWERING`` environment
    variable, else ``"auto"``).  A context variable: it holds for the current thread (and
    context), nested blocks restore the outer choice on exit.  A jitted function is traced at
    its first call for given shapes: call (or ``.lower()``) it inside the block.  Raises at entry
    if ``name`` cannot be used here (``"ffi"`` and ``"legacy"`` need the accelerator).  No
    effect in a process without a CUDA device."""
    if hook is not None:
        with hook.use_lowering(name):
            yield
        return
    _check_lowering(name)
    if name not in ("auto", "jax-triton") and not runtime.INTERPRETED:
        raise RuntimeError(f"the {name!r} lowering is the accelerator's, which QSA_ACCELERATE=0 turned off: use "
                           f"'jax-triton' or 'auto'")
    yield


LOWERINGS = ("auto", "ffi", "legacy", "jax-triton")


def _check_lowering(name: str) -> None:
    if name not in LOWERINGS:
        raise ValueError(f"lowering must be one of {', '.join(map(repr, LOWERINGS))}, got {name!r}")


def _read_scale(function: str, name: str, array) -> list[float] | None:
    """A scale's elements for ``QSA_CHECK_SCALES``: read now when concrete; when traced (under
    ``jax.jit``), checked by a debug callback as the computation runs (``None`` here): its error
    comes with the computation's, and the call's launches may already have run."""
    try:
        return np.asarray(array, dtype=np.float64).reshape(-1).tolist()
    except jax.errors.TracerArrayConversionError:
        jax.debug.callback(lambda value: check_scale_values(
            function, name, np.asarray(value, dtype=np.float64).reshape(-1).tolist()), array)
        return None


def run(program: Program, arrays: Mapping[str, jax.Array | None]) -> tuple[jax.Array, ...]:
    """Run a program over JAX arrays; results in ``program.results`` order."""
    if runtime.CHECK_SCALES:
        check_scales(program, arrays, functools.partial(_read_scale, program.function))
    names = [name for name, value in arrays.items() if value is not None]
    values = [arrays[name] for name in names]
    function = program.function
    runner = _run_on_host if runtime.INTERPRETED else _run_compiled

    @jax.custom_batching.custom_vmap
    def call(*values):
        values = _sharding.guard(function, values)  # one device's arrays only (shard_map): see _sharding
        return tuple(runner(program, names, list(values)))

    @call.def_vmap
    def _no_vmap(axis_size, in_batched, *values):
        raise NotImplementedError(f"{function} does not support jax.vmap: call it on the whole batch (its arrays already carry a row dimension)")

    @jax.custom_jvp
    def guarded(*values):
        return call(*values)

    @guarded.defjvp
    def _no_jvp(primals, tangents):
        raise NotImplementedError(f"{function} is not differentiable (jax.grad / jax.jvp): it is an inference kernel")

    return guarded(*values)


def _program(stage: Stage, arguments: Mapping[str, object]):
    """The call's JAX arrays by name and its Program."""
    arrays, options = stage.split(arguments)
    named, back = stage.labelled(arrays)  # errors name the arguments as the caller wrote them
    converted, infos = metadata(stage.name, named)
    return back(converted), stage.plan(**back(infos), **options)


def call(stage: Stage, arguments: Mapping[str, object]):
    """Run the public function ``stage`` declares, given its arguments by name."""
    arrays, program = _program(stage, arguments)
    return program.returned(run(program, arrays))


def plan(stage: Stage, arguments: Mapping[str, object]) -> Program:
    """The Program a call with these arguments runs (validated, memoised; nothing launched)."""
    return _program(stage, arguments)[1]


def plan_seam(stage: Stage):
    """``function.plan``: the Program a call with the same arguments runs (nothing launched)."""
    return stage_plan_seam(stage, plan, framework='jax', module='qsa_jax')


def run_program(program: Program, arrays: Mapping[str, ArrayLike | None]) -> tuple[Array, ...]:
    return run(program, arrays)


run_program.__doc__ = RUN_PROGRAM_DOC
