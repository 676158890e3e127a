"""Binds qsa_kernels programs to JAX arrays.

Compiled process: each launch is a ``jax_triton.triton_call`` (see
:mod:`qsa_jax._triton_call`, the only module that touches jax-triton).
Interpreted process (no CUDA device; jax-triton cannot even be imported with a
CPU-only jaxlib): the whole program runs from one host callback through the
shared executor (``qsa_kernels.launch.execute``) on zero-copy CPU torch
tensors, so the same plans and kernels run under ``jax.jit`` in CI.

Every call is wrapped so that ``jax.grad`` and ``jax.vmap`` fail with a message
naming the public function, not an internal error.
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import TYPE_CHECKING, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from jax import Array
    from jax.typing import ArrayLike

from qsa_kernels import runtime
from qsa_kernels.launch import ArrayInfo, Buffer, Program, check_scale_values, check_scales, execute, triton_launch
from qsa_kernels.stage import RUN_PROGRAM_DOC, Stage, make_public
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


def _run_compiled(program: Program, names, arrays):
    from . import _triton_call

    return _triton_call.run(program, dict(zip(names, arrays)))


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


#: ``public(stage)``: the stage's public function for jax (with its ``.plan``).
public = functools.partial(make_public, call=call, plan=plan, framework="jax", module="qsa_jax")


def run_program(program: Program, arrays: Mapping[str, ArrayLike | None]) -> tuple[Array, ...]:
    return run(program, arrays)


run_program.__doc__ = RUN_PROGRAM_DOC
