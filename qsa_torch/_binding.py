"""The torch binding: each public function is a ``torch.library`` custom op run by the one executor.

Public APIs only (``torch.library``, ``torch.compiler``, Triton's
``kernel[grid](...)``): tests/test_binding.py scans this module's imports.
A call of a public function (``qsa_torch._functions``, built from the
stages' declarations by ``qsa_kernels.api.define``) is :func:`call`:

1. the accelerator (:data:`hook`, ``qsa_torch._accel``: installed unless
   ``QSA_ACCELERATE=0``) may run a plain eager call itself, at the host
   cost of its launches;
2. otherwise the arguments are checked (types, tensor kinds, devices,
   grad: errors name the function and the argument) and, outside
   ``torch.compile``, planned, so a bad call fails before the dispatcher;
3. the call's op, ``torch.ops.qsa.<variant>`` (one per
   :class:`~qsa_kernels.stage.Variant`), runs.  Its implementation plans
   (memoised) and runs the Program through
   :func:`qsa_kernels.launch.execute`, one ``kernel[grid](...)`` per
   launch, on the tensors' device and current stream.  Its fake
   implementation (``FakeTensorMode``, meta tensors, ``torch.compile``,
   ``torch.export``) plans with the sizes' hints -- validation without a
   guard -- and allocates each fresh result with the symbolic row count of
   the argument it follows (``Stage.rows``): every other size of a result
   follows the caches, heads and options.  So one compiled graph serves
   every row and request count; shape-dependent choices (tiles, the fused
   paths' row bounds) are made inside the op, when it runs.

The ops never launch from a fake implementation, mutate exactly the arrays
their variant updates in place (``mutates_args``: torch bumps their version
counters) and refuse autograd: the kernels are not differentiable.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import numpy as np
import torch
from torch.fx.experimental import symbolic_shapes

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from torch import Tensor as Array, Tensor as ArrayLike

from qsa_kernels import api, runtime
from qsa_kernels.launch import ArrayInfo, Buffer, Launch, Program, execute
from qsa_kernels.stage import RUN_PROGRAM_DOC, Stage, Variant
from qsa_kernels.stage import plan_seam as stage_plan_seam
from qsa_kernels.validate import device_error, type_error

__all__ = ["DTYPES", "NAMESPACE", "Accelerator", "call", "hook", "info", "install", "op_call", "plan",
           "plan_seam", "run", "run_program"]

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
NAMESPACE = "qsa"


# --------------------------------------------------------------------------
# The accelerator's one hook
# --------------------------------------------------------------------------

class Accelerator(Protocol):
    """What ``qsa_torch._accel`` plugs in (:func:`install`); every method may decline."""

    def run(self, stage: Stage, arguments: Mapping[str, Any], eager: bool) -> tuple[Program | None, Any]:
        """``(program, results)`` of a call it ran itself, or ``(None, token)`` for :meth:`remember`.

        ``eager``: a public function's call (else an op's implementation)."""

    def remember(self, token: Any, stage: Stage, program: Program, device: torch.device) -> None:
        """The binding ran ``program`` for the call :meth:`run` declined with ``token``."""

    def launch(self, launch: Launch, inputs: list, outputs: list) -> None:
        """Launch one kernel (in place on ``outputs``)."""

    def build(self, launch: Launch, inputs: list, outputs: list) -> None:
        """Compile ``launch``'s kernel as its launches will run it, without launching."""

    def define_op(self, stage: Stage, variant: Variant, schema: str, names: tuple, implementation, fake):
        """Define and register ``qsa::<variant>``; ``None``: the binding's ``custom_op`` does it."""

    def describe(self) -> dict[str, str]:
        """Its lines of the environment report."""


#: The installed accelerator, or ``None`` (``QSA_ACCELERATE=0``: the binding alone).
hook: Accelerator | None = None


def install(accelerator: Accelerator | None) -> None:
    """Plug ``accelerator`` in (``None``: take it out).  Before the ops are registered, for ``define_op``."""
    global hook
    hook = accelerator


# --------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------

def info(tensor: torch.Tensor) -> ArrayInfo:
    """Shape, dtype and strides of a tensor, as plans see them."""
    dtype = DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype).removeprefix("torch.")
    return ArrayInfo(tuple(tensor.shape), dtype, tensor.stride())


_hint = getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "hint_int")


def _hinted_info(tensor: torch.Tensor) -> ArrayInfo:
    """:func:`info` of a fake tensor whose sizes may be symbolic: their hints (the traced call's
    sizes), read without a guard: the plan validates that call, the op revalidates every call."""
    dtype = DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype).removeprefix("torch.")
    return ArrayInfo(tuple(map(_hint, tensor.shape)), dtype, tuple(map(_hint, tensor.stride())))


def _kind_error(function: str, name: str, tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` is not a strided dense tensor the kernels can read, or ``None``."""
    if tensor.is_nested:
        return "a nested tensor"
    if tensor.layout is not torch.strided:
        return f"a {tensor.layout} tensor"
    return None


def check_arrays(function: str, arrays: Mapping[str, object]) -> dict[str, ArrayInfo | None]:
    """Check types, tensor kinds and devices, and read every array's metadata (eager calls).

    ``None`` entries are absent optional arguments.  All tensors share one
    device: a CUDA device in a compiled process, the CPU in an interpreted
    one; meta tensors only ever reach the ops' fake implementations.
    """
    infos: dict[str, ArrayInfo | None] = {}
    first_name = first = None
    for name, value in arrays.items():
        if value is None:
            infos[name] = None
            continue
        if not isinstance(value, torch.Tensor):
            raise type_error(function, name, "a torch.Tensor", value)
        kind = _kind_error(function, name, value)
        if kind is not None:
            raise TypeError(f"{function}: {name} must be a strided dense tensor, got {kind}")
        if first is None:
            first_name, first = name, value
        elif value.device != first.device:
            raise device_error(function, name, value.device, first_name, first.device)
        infos[name] = _hinted_info(value) if value.is_meta else info(value)
    if first is not None and not first.is_meta:
        if runtime.INTERPRETED and first.device.type != "cpu":
            raise ValueError(f"{function}: this process runs Triton's interpreter (no CUDA device was visible at "
                             f"import), so tensors must be on the CPU, got {first.device}")
        if not runtime.INTERPRETED and first.device.type != "cuda":
            raise ValueError(f"{function}: this process runs compiled Triton kernels, so tensors must be on a "
                             f"CUDA device, got {first.device}")
    return infos


def _labelled(stage: Stage, arrays: Mapping[str, object], check=check_arrays) -> dict[str, ArrayInfo | None]:
    """``check`` under the names the stage's errors use (the step's ``state.key_cache``)."""
    named, back = stage.labelled(arrays)
    return back(check(stage.name, named))


def not_differentiable(stage: Stage, name: str, mode: str = "autograd") -> NotImplementedError:
    label = stage.label(name)
    if mode == "forward-mode AD":
        why = f"{label} is a forward-mode AD dual tensor: pass its primal (torch.autograd.forward_ad.unpack_dual)"
    else:
        why = (f"{label} requires grad while grad mode is on: call it under torch.no_grad() or "
               f"torch.inference_mode(), or pass {label}.detach()")
    return NotImplementedError(f"{stage.name} is not differentiable ({mode}): it is an inference kernel, and {why}")


def refuse_grad(stage: Stage, arrays: Mapping[str, object]) -> None:
    """Refuse a call that autograd would record (an input requires grad in grad mode) or that carries a
    forward-mode AD tangent: the kernels have no derivative, and a silently missing one reads as zero."""
    grad = torch.is_grad_enabled()
    for name, value in arrays.items():
        if isinstance(value, torch.Tensor):
            if grad and value.requires_grad:
                raise not_differentiable(stage, name)
            if torch.autograd.forward_ad.unpack_dual(value).tangent is not None:
                raise not_differentiable(stage, name, "forward-mode AD")


def _check_updates(function: str, program: Program, arrays: Mapping[str, torch.Tensor | None]) -> None:
    """Refuse in-place writes torch's own in-place ops refuse (inference tensors outside inference mode)."""
    for name in program.updated_arguments:
        tensor = arrays[name]
        if tensor.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{function}: {name} is updated in place, but it is an inference tensor and "
                               f"this call is outside InferenceMode (inplace update to inference tensor outside "
                               f"InferenceMode is not allowed)")


# --------------------------------------------------------------------------
# Running a Program
# --------------------------------------------------------------------------

def _launch(launch: Launch, inputs: list, outputs: list) -> list:
    """One launch, in place on ``outputs``: the accelerator's launcher, else ``kernel[grid](...)``."""
    if hook is not None:
        hook.launch(launch, inputs, outputs)
    else:
        launch.kernel[launch.grid](*inputs, *outputs, **launch.scalars, **launch.constexprs,
                                   num_warps=launch.num_warps, num_stages=launch.num_stages)
    return outputs


class _Allocate:
    """The executor's ``allocate`` for one device."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, buffer: Buffer, fill):
        if fill is None:
            return torch.empty(buffer.shape, dtype=DTYPES[buffer.dtype], device=self.device)
        return torch.full(buffer.shape, fill, dtype=DTYPES[buffer.dtype], device=self.device)


class _OnDevice:
    """The launches' guard: the interpreter's lock, or ``device`` made current where it is not."""

    __slots__ = ("device", "context")

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        self.context = runtime.interpreter_lock if runtime.INTERPRETED else torch.cuda.device(self.device)
        return self.context.__enter__()

    def __exit__(self, *exc):
        return self.context.__exit__(*exc)


def _build(launch: Launch, inputs: list, outputs: list) -> None:
    """Compile ``launch``'s kernel for these arguments without launching (``JITFunction.warmup``), so a
    kernel that cannot be built fails a multi-launch call before any launch writes a cache."""
    launch.kernel.warmup(*inputs, *outputs, **launch.scalars, **launch.constexprs, grid=launch.grid,
                         num_warps=launch.num_warps, num_stages=launch.num_stages)


def _read_scale(name: str, tensor: torch.Tensor) -> list[float] | None:
    """A scale's elements on the host for ``QSA_CHECK_SCALES`` (a synchronising copy); ``None`` while
    a CUDA graph is captured (a copy to the host cannot be captured)."""
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return tensor.detach().reshape(-1).float().tolist()


_BUILT: set[tuple[int, int]] = set()  # (id of a kept program, device index): its kernels were built there
_KEPT: dict[int, Program] = {}        # keeps those programs alive, so their ids are never reused


def run(program: Program, arrays: Mapping[str, torch.Tensor | None], device: torch.device) -> tuple:
    """Allocate the program's buffers and launch its kernels on ``device``'s current stream; its results."""
    prepare = None
    if not runtime.INTERPRETED and (id(program), device.index) not in _BUILT:
        prepare = hook.build if hook is not None else _build
    results = execute(program, arrays, adapter="torch", allocate=_Allocate(device), launch=_launch,
                      guard=lambda: _OnDevice(device), prepare=prepare, read=_read_scale)
    if prepare is not None:
        _KEPT[id(program)] = program
        _BUILT.add((id(program), device.index))
    return results


def run_program(program: Program, arrays: Mapping[str, ArrayLike | None]) -> tuple[Array, ...]:
    first = next(value for value in arrays.values() if value is not None)
    return run(program, arrays, first.device)


run_program.__doc__ = RUN_PROGRAM_DOC


def _device(arrays: Mapping[str, object]) -> torch.device:
    return next(value.device for value in arrays.values() if isinstance(value, torch.Tensor))


def _run_call(stage: Stage, arguments: Mapping[str, object], eager: bool) -> tuple[Program, tuple]:
    """Plan and run a call whose arguments passed :func:`check_arrays`: the accelerator's way, else the
    executor's.  ``(program, results in program.results order)``."""
    token = None
    if hook is not None:
        program, token = hook.run(stage, arguments, eager)
        if program is not None:
            return program, token
    arrays, options = stage.split(arguments)
    program = stage.plan(**_labelled(stage, arrays), **options)
    _check_updates(stage.name, program, arrays)
    device = _device(arrays)
    results = run(program, arrays, device)
    if hook is not None:
        hook.remember(token, stage, program, device)
    return program, results


# --------------------------------------------------------------------------
# The custom ops
# --------------------------------------------------------------------------

_OPS: dict[str, tuple] = {}  # variant name -> (OpOverload, its parameters)
_IMPLEMENTATIONS: dict = {}  # op -> its implementation (the benchmarking seam: benchmarks/step_overhead.py)


def _op_parameters(stage: Stage, variant: Variant) -> tuple[inspect.Parameter, ...]:
    """The op's parameters: the function's, less the options that select the variant (the op implies them)."""
    selected = dict(variant.selected)
    return tuple(parameter for parameter in stage.parameters if parameter.name not in selected)


def _schema(stage: Stage, variant: Variant) -> str:
    updated, fresh = variant.updated, len(variant.fresh)
    arguments = []
    for parameter in _op_parameters(stage, variant):
        name, default = parameter.name, parameter.default
        if name in stage.arrays:
            alias = f"(a{updated.index(name)}!)" if name in updated else ""
            kind = f"Tensor{alias}" + ("?" if name in stage.optional_arrays else "")
        else:
            kind = "Scalar?"
        arguments.append(f"{kind} {name}" + ("" if default is inspect.Parameter.empty else f"={default!r}"))
    returns = "()" if fresh == 0 else "Tensor" if fresh == 1 else "(" + ", ".join(["Tensor"] * fresh) + ")"
    return f"({', '.join(arguments)}) -> {returns}"


def _returns(fresh: tuple):
    return None if not fresh else fresh[0] if len(fresh) == 1 else fresh


def _make_op(stage: Stage, variant: Variant):
    """Define ``qsa::<variant name>`` with its implementation and fake implementation."""
    parameters = _op_parameters(stage, variant)
    names = tuple(parameter.name for parameter in parameters)
    defaults = tuple(parameter.default for parameter in parameters)
    selected = dict(variant.selected)
    schema = _schema(stage, variant)
    fresh_at = tuple(i for i, name in enumerate(variant.results) if name in variant.fresh)  # in program.results

    def named(values: tuple, keywords: dict) -> dict:
        # The op's values by the stage's names (the dispatcher may drop trailing defaulted ones).
        arguments = dict(zip(names, map(_concrete, values)))
        for n, default in zip(names[len(values):], defaults[len(values):]):
            arguments[n] = _concrete(keywords.get(n, default))
        arguments.update(selected)
        return arguments

    def implementation(*values, **keywords):
        program, results = _run_call(stage, named(values, keywords), eager=False)
        return _returns(tuple([results[i] for i in fresh_at]))

    def fake(*values, **keywords):
        # Never launches: the plan validates the traced call; the results follow the arguments' rows.
        arrays, options = stage.split(named(values, keywords))
        program = stage.plan(**_labelled(stage, arrays, _hinted_infos), **options)
        device = _device(arrays)
        fresh = []
        for i in fresh_at:
            buffer = program.buffer(program.results[i])
            shape = (arrays[stage.rows[variant.results[i]]].shape[0], *buffer.shape[1:])
            fresh.append(torch.empty(shape, dtype=DTYPES[buffer.dtype], device=device))
        return _returns(tuple(fresh))

    op = hook.define_op(stage, variant, schema, names, implementation, fake) if hook is not None else None
    if op is None:
        op = _custom_op(stage, variant, schema, names, implementation, fake)

    def no_vmap(info, in_dims, *values, **keywords):
        batched = next((n for n, d in zip(names, in_dims) if d is not None), names[0])
        raise NotImplementedError(f"{stage.name} does not support torch.vmap ({stage.label(batched)} is batched): "
                                  f"call it on the whole batch (its arrays already carry a row dimension)")

    torch.library.register_vmap(op, no_vmap)
    _IMPLEMENTATIONS[op] = implementation
    return op, parameters


def _hinted_infos(function: str, arrays: Mapping[str, object]) -> dict[str, ArrayInfo | None]:
    return {name: None if value is None else _hinted_info(value) for name, value in arrays.items()}


def _custom_op(stage: Stage, variant: Variant, schema: str, names: tuple, implementation, fake):
    """``qsa::<variant>`` through ``torch.library.custom_op``, its fake registered, autograd refused."""
    definition = torch.library.custom_op(f"{NAMESPACE}::{variant.name}", implementation,
                                         mutates_args=variant.updated, schema=schema,
                                         tags=(torch.Tag.pt2_compliant_tag,))
    definition.register_fake(fake)
    if not variant.updated:  # (torch takes no autograd formula for an op that mutates its arguments)
        def refuse(ctx, inputs, output):
            # Torch runs this when grad mode was on and an input requires grad.
            raise not_differentiable(stage, next(
                n for n, v in zip(names, inputs) if isinstance(v, torch.Tensor) and v.requires_grad))

        def backward(ctx, *grads):  # never reached: refuse() raised in the forward
            raise not_differentiable(stage, names[0])

        definition.register_autograd(backward, setup_context=refuse)
    return definition._opoverload


def register_ops() -> None:
    """Register one custom op per variant of every public function (``qsa_torch``'s import does)."""
    for stage in api.FUNCTIONS:
        for variant in stage.variants:
            if variant.name not in _OPS:
                _OPS[variant.name] = _make_op(stage, variant)


def op_call(stage: Stage, arguments: Mapping[str, object]) -> tuple:
    """``(op, values)``: the custom op a call with these (valid) arguments runs, and its positional values."""
    op, parameters = _OPS[stage.variant(arguments).name]
    return op, tuple(arguments.get(p.name, p.default) for p in parameters)


# --------------------------------------------------------------------------
# The public functions' calls
# --------------------------------------------------------------------------

def _concrete(value):
    # An option Dynamo made symbolic (a Python int or float argument of a compiled function) is
    # specialised where the op reads it: options are static (a guard on their value, not on a size).
    if isinstance(value, torch.SymBool):
        return bool(value)
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return value


def call(stage: Stage, arguments: Mapping[str, object]):
    """Run the public function ``stage`` declares, given its arguments by name."""
    if torch.compiler.is_compiling():  # traced: the op lands in the graph; its fake validates
        results = _op_results(stage, arguments, canonical=False)
    else:
        if hook is not None:
            program, ran = hook.run(stage, arguments, eager=True)
            if program is not None:
                return program.returned(ran)
        arrays, options = stage.split(arguments)
        stage.plan(**_labelled(stage, arrays), **options)  # every argument error before the dispatcher
        refuse_grad(stage, arrays)
        results = _op_results(stage, arguments)
    return results[0] if len(results) == 1 else results


def _op_results(stage: Stage, arguments: Mapping[str, object], canonical: bool = True) -> tuple:
    """The call's op run; its results in the variant's order (arrays updated in place as given).

    The op's schema takes Python numbers: options are passed canonical (``np.int64(3)`` as ``3``;
    traced, a NumPy scalar as its Python value, the op's fake checks the rest)."""
    if canonical:
        arguments = {name: stage.options[name].canonical(stage.name, name, value) if name in stage.options
                     else value for name, value in arguments.items()}
    else:
        arguments = {name: value.item() if isinstance(value, np.generic) else value
                     for name, value in arguments.items()}
    variant = stage.variant(arguments)
    op, values = op_call(stage, arguments)
    fresh = op(*values)
    made = dict(zip(variant.fresh, (fresh,) if isinstance(fresh, torch.Tensor) else fresh or ()))
    return tuple(made[name] if name in made else arguments[name] for name in variant.results)


def plan(stage: Stage, arguments: Mapping[str, object]) -> Program:
    """The Program a call with these arguments runs (validated, memoised; nothing launched)."""
    arrays, options = stage.split(arguments)
    return stage.plan(**_labelled(stage, arrays), **options)


def plan_seam(stage: Stage):
    """``function.plan``: the Program a call with the same arguments runs (nothing launched)."""
    return stage_plan_seam(stage, plan, framework='torch', module='qsa_torch')
