"""Binds qsa_kernels programs to torch tensors: the eager executor and the torch custom ops.

Every public function is generated from its stage's declaration
(:func:`public`) and runs ``call(stage, arguments_by_name)``.  A call
runs one of two ways, with the same plan, the same executor
(:func:`qsa_kernels.launch.execute`) and the same results:

* **eager** (plain CPU/CUDA tensors, no torch.compile, no dispatch mode):
  validate, plan (memoised), launch.  No dispatcher round trip, so a call
  costs the plan lookup plus the launches.
* **as a torch custom op** in the ``qsa`` namespace, whenever torch itself
  must see the call: under ``torch.compile`` / ``torch.export``, fake and
  meta tensors, ``FakeTensorMode`` or any other dispatch mode.  The op's fake
  implementation runs the plan (so validation errors and result shapes come
  from the plan) and allocates the fresh results; it never launches.

Why an opaque op and not ``triton_op`` + ``wrap_triton``: an op whose
kernels are Python functions is opaque to Inductor, which then calls it as it
is (launching the same compiled Triton kernels, through the same executor, as
eager does): results are bitwise the eager ones, and CUDA graphs
(``reduce-overhead``) capture the launches on the current stream.
``triton_op`` would let Inductor re-emit each ``kernel[grid]`` call itself:
it traces the launch through ``wrap_triton``, which does not run under
Triton's interpreter (the CPU path), re-types Python float scalars as fp64
(``tl.dot`` then fails an assertion on ``scale_log2``), and would put a second
launch path beside the executor.

Op registration (:func:`_make_op`).  Each op is defined in one
``torch.library.Library("qsa", "FRAGMENT")``, its schema tagged
``pt2_compliant_tag``, with four kernels:

* ``CompositeExplicitAutograd`` (the CPU and CUDA backends): the
  implementation -- the call's prepared program (:mod:`._eager`), else the
  plan and the executor;
* the fake implementation (``torch.library.register_fake``: FakeTensorMode,
  meta tensors), which plans and allocates and never launches;
* ``Autograd``: refuses a call autograd would record (:func:`_refuse_grad`'s
  error, naming the function and the argument: called directly, as a loaded
  ``torch.export`` program calls it, too), bumps the version counters of the
  arrays the variant updates (by their positions, computed once), and runs
  the backend kernel -- directly when the backend is the next key (plain CPU
  or CUDA tensors, no mode: a compiled graph's steady calls), else by
  redispatching below ``ADInplaceOrView``;
* ``ADInplaceOrView`` (ops that update arrays): the version bump alone, for
  calls without the Autograd key (inference mode on normal tensors).

This is what ``torch.library.custom_op`` registers, less its cost per call:
a Python kernel per key (Autograd, then ADInplaceOrView, then the backend
wrapper's alias check) and, from torch 2.13, an ADInplaceOrView kernel that
re-binds the arguments to the schema (``torch._library.utils.fill_defaults``
reads ``schema.arguments``, a list rebuilt from C++ on every access, twice per
argument: quadratic in the schema, ~220 µs per call of the step's
29-argument op on a CPU host).  ``benchmarks/step_overhead.py`` measures it.

Ops are generated from the declarations, never written by hand, and all
registered when this module is imported (so a program saved by
``torch.export`` loads in any process that imported ``qsa_torch``): one op
per :class:`~qsa_kernels.stage.Variant` of each public function,
``qsa::<variant name>`` (``qsa::store_cache_rows``,
``qsa::rope_reshape_and_cache_return_zeros``; docs/api.md lists them).  The
schema's arguments are the function's parameters (arrays ``Tensor`` /
``Tensor?``, options ``Scalar?``: ints, floats, bools or None), the mutated
arguments are the variant's ``updated`` arrays and the returns its fresh
results (custom ops cannot return their inputs: the caller's own cache
tensors are returned for in-place results, as in eager).  Calls that
autograd would record are refused (:func:`_refuse_grad`: the kernels are not
differentiable).  Every path bumps the version counter of each array a call
updates in place (``tensor._version``, as torch's own in-place ops do, so
autograd detects a saved tensor written since).  Under ``torch.compile`` the binding
runs inside ``torch._dynamo.nonstrict_trace`` (Dynamo does not trace the
plans; AOTAutograd runs them on fake tensors), so a whole composition traces
with no graph break; ``torch._dynamo`` is only imported once something
compiles (it costs seconds of import time).
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Mapping

import torch

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    from torch import Tensor as Array, Tensor as ArrayLike

from qsa_kernels import api, pdl, runtime
from qsa_kernels.launch import ArrayInfo, Buffer, Launch, Program, execute
from qsa_kernels.stage import RUN_PROGRAM_DOC, Stage, Variant, make_public, stage_named
from qsa_kernels.validate import device_error, type_error

from . import _eager, _fast_launch
from ._internals import OWN_OP_KERNELS, any_requires_grad as _any_requires_grad, increment_version as _increment_version

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


_new_tuple = tuple.__new__  # builds an ArrayInfo without its Python-level __new__ (hot path)


def info(tensor: torch.Tensor) -> ArrayInfo:
    """Shape, dtype and strides of a tensor, as plans see them."""
    dtype = DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype).removeprefix("torch.")
    return _new_tuple(ArrayInfo, (tuple(tensor.shape), dtype, tensor.stride()))


def _static_info(tensor: torch.Tensor) -> ArrayInfo:
    # Fake tensors may carry symbolic sizes: kernels specialise on every size
    # (grids, tiles), so the plan sees (and guards on) concrete ints.
    return ArrayInfo(tuple(int(s) for s in tensor.shape),
                     DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype).removeprefix("torch."),
                     tuple(int(s) for s in tensor.stride()))


def metadata(function: str, arrays: Mapping[str, object], read=info) -> dict[str, ArrayInfo | None]:
    """Check types and devices, and read every array's metadata.

    ``None`` entries are absent optional arguments.  All tensors must share
    one device; in a compiled process that device must be a CUDA device, in
    an interpreted one the CPU.  Meta tensors are accepted anywhere: they
    only ever reach the ops' fake implementations.
    """
    return _read(function, arrays, read)[0]


def _read(function: str, arrays: Mapping[str, object], read=info):
    """``(infos, first tensor, plain)``: :func:`metadata`'s checks and whether the call can run eagerly.

    *plain*: every tensor is a plain (not fake, functional or other subclass)
    tensor on a real device, so torch needs to see nothing of the call.
    """
    infos: dict[str, ArrayInfo | None] = {}
    first_name = first = None
    plain = True
    for name, value in arrays.items():
        if value is None:
            infos[name] = None
            continue
        if type(value) is not torch.Tensor:
            if not isinstance(value, torch.Tensor):
                raise type_error(function, name, "a torch.Tensor", value)
            plain = False
        if first is None:
            first_name, first, index = name, value, value.get_device()
            meta = index < 0 and value.is_meta  # CPU and meta tensors both have index -1
        elif value.get_device() != index or (index < 0 and value.is_meta != meta):
            raise device_error(function, name, value.device, first_name, first.device)
        infos[name] = read(value)
    if first is not None:
        if meta:
            plain = False
        elif runtime.INTERPRETED and index >= 0:
            raise ValueError(f"{function}: this process runs Triton's interpreter (no CUDA device was visible at import), so tensors must be on the CPU, got {first.device}")
        elif not runtime.INTERPRETED and index < 0:
            raise ValueError(f"{function}: this process runs compiled Triton kernels, so tensors must be on a CUDA device, got {first.device}")
    return infos, first, plain


# --------------------------------------------------------------------------
# Eager execution
# --------------------------------------------------------------------------

def launch_kernel(launch: Launch, inputs: list, outputs: list) -> list:
    """The one place the torch adapter launches a kernel (in place on ``outputs``).

    Through :mod:`._fast_launch`: bound once per Triton specialization, then
    the compiled launcher is called directly (``kernel[grid]`` under the
    interpreter, on a first call, and whenever the binding cannot be reused).
    """
    _fast_launch.launch(launch.kernel, launch.grid, (*inputs, *outputs), launch.scalars, launch.constexprs,
                        launch.num_warps, launch.num_stages)
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


def _interpreter_guard():
    return runtime.interpreter_lock


class _CudaGuard:
    """Make ``device`` current around the launches, only when it is not already."""

    __slots__ = ("index", "previous")

    def __init__(self, device: torch.device):
        self.index = device.index

    def __enter__(self):
        self.previous = torch.cuda.current_device()
        if self.index is not None and self.index != self.previous:
            torch.cuda.set_device(self.index)

    def __exit__(self, *exc):
        if self.index is not None and self.index != self.previous:
            torch.cuda.set_device(self.previous)


def build_kernel(launch: Launch, inputs: list, outputs: list) -> None:
    """Compile ``launch``'s kernel for these arguments and load it on the device, without launching.

    ``JITFunction.warmup`` compiles (or finds in Triton's cache); reading the
    compiled kernel's ``run`` loads its module, which is where Triton raises
    ``OutOfResources`` for a kernel the device cannot hold.
    """
    # The options its launches will take (launch_pdl among them), so that they find this build.
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    if _fast_launch.launch.early(launch.kernel, torch.cuda.current_device()):
        options["launch_pdl"] = True
    compiled = launch.kernel.warmup(*inputs, *outputs, **launch.scalars, **launch.constexprs, grid=launch.grid,
                                    **options)
    compiled.run  # noqa: B018  (loads the module)


# Programs whose kernels were built on a device: (id, device index, early
# launches on) -> the program (kept, so that its id is never reused; the
# kernels are built with the launch options they run with).  Multi-launch
# programs are built before their first launch the first time they run on a
# device.
_BUILT: dict[tuple[int, int, bool], Program] = {}


def run(program: Program, arrays: Mapping[str, torch.Tensor | None], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Allocate the program's buffers and launch its kernels on ``device``'s current stream.

    Compiled: the first time a program runs on a device, every kernel is
    built before the first launch (``execute``'s ``prepare``), so a kernel
    that cannot be built fails the call before any cache is written.
    """
    if runtime.INTERPRETED:  # nothing to build: the interpreter runs the source
        return execute(program, arrays, adapter="torch", allocate=_Allocate(device), launch=launch_kernel,
                       guard=_interpreter_guard, read=_read_scale)
    key = (id(program), device.index, pdl.ENABLED)
    prepare = None if key in _BUILT else build_kernel
    results = execute(program, arrays, adapter="torch", allocate=_Allocate(device), launch=launch_kernel,
                      guard=lambda: _CudaGuard(device), prepare=prepare, read=_read_scale)
    _BUILT.setdefault(key, program)
    return results


def _read_scale(name: str, tensor: torch.Tensor) -> list[float] | None:
    """A scale's elements on the host for ``QSA_CHECK_SCALES`` (a synchronising copy); ``None`` while
    a CUDA graph is captured (a copy to the host cannot be captured)."""
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return tensor.detach().reshape(-1).float().tolist()


def _check_updates(function: str, program: Program, arrays: Mapping[str, torch.Tensor | None]) -> None:
    """Refuse in-place writes torch's own in-place ops would refuse (inference tensors; autograd: _refuse_grad)."""
    for name in program.updated_arguments:
        tensor = arrays[name]
        if tensor.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{function}: {name} is updated in place, but it is an inference tensor and "
                               f"this call is outside InferenceMode (inplace update to inference tensor outside "
                               f"InferenceMode is not allowed)")


def _not_differentiable(stage: Stage, name: str) -> NotImplementedError:
    label = stage.label(name)
    return NotImplementedError(
        f"{stage.name} is not differentiable (autograd): it is an inference kernel, and {label} requires grad "
        f"while grad mode is on: call it under torch.no_grad() or torch.inference_mode(), or pass "
        f"{label}.detach()")


def _refuse_grad(stage: Stage, arrays: Mapping[str, torch.Tensor | None], exempt_fake_run: bool = True) -> None:
    """Refuse a call that autograd would record: an input requires grad while grad mode is on.

    The kernels have no derivative; without this the result would have no
    ``grad_fn`` and ``backward()`` would silently miss the call's gradient.
    Where it runs (:func:`_call`, :func:`call`, the ops' Autograd kernel):
    eager calls, before anything launches; an op called directly (a loaded
    ``torch.export`` program, a user); ``torch.export``, as the call is traced; under
    ``torch.compile``, in AOTAutograd's trace (the compiled function raises
    ``BackendCompilerFailed`` with this error, fullgraph or not), never
    while Dynamo traces: Dynamo makes a raise there a graph break that skips
    the caller's frames for good, after which it would compile this
    module's own functions as frames of their own (``exempt_fake_run``:
    return quietly in Dynamo's fake-tensor run, :func:`_dynamo_fake_run`;
    ``torch.export``'s check, made before tracing, passes False).  Non-tensor
    values are skipped.
    """
    if torch.is_grad_enabled():
        for name, value in arrays.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                if exempt_fake_run and _dynamo_fake_run():
                    return
                raise _not_differentiable(stage, name)


def _dynamo_fake_run() -> bool:
    """Dynamo runs a ``nonstrict_trace``-d call on fake tensors to see its outputs (not AOTAutograd's trace).

    Torch 2.13 reports it as compiling; 2.10 and 2.11 do not, but a tracing
    context is set (and no functionalization: that is AOTAutograd's trace).
    """
    if _functionalizing():
        return False
    return _is_compiling() or _TracingContext.try_get() is not None


def _no_mode() -> bool:
    """No dispatch or torch-function mode is active (FakeTensorMode, a user's logging mode...)."""
    return not (_dispatch_modes() or _function_mode())


# Where a torch lacks these (torch._C, read with every torch: qsa_torch._internals), a mode is
# assumed: every call then goes through its op.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_function_mode = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: True)


# --------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------

_OPS: dict[str, tuple] = {}  # variant name -> (OpOverload, its parameters), every variant of every public function


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
        if default is not inspect.Parameter.empty:
            arguments.append(f"{kind} {name}={default!r}")
        else:
            arguments.append(f"{kind} {name}")
    returns = "()" if fresh == 0 else "Tensor" if fresh == 1 else "(" + ", ".join(["Tensor"] * fresh) + ")"
    return f"({', '.join(arguments)}) -> {returns}"


# Every qsa op is defined and implemented in this one library (kept for the process's life).
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
# op -> the Python function its backend kernel runs (the benchmarking seam: benchmarks/step_overhead.py).
_IMPLEMENTATIONS: dict = {}
_grad_enabled = torch.is_grad_enabled
if OWN_OP_KERNELS:  # torch internals, for the verified torch minors only (qsa_torch._internals)
    _below_inplace_or_view = torch._C._AutoDispatchBelowADInplaceOrView
    _after_inplace_or_view = torch._C._after_ADInplaceOrView_keyset
    _BACKENDS = frozenset((torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA))


def _make_op(stage: Stage, variant: Variant):
    """Define ``qsa::<variant name>`` and register its kernels (see the module docstring, "Op registration")."""
    parameters = _op_parameters(stage, variant)
    names = tuple(parameter.name for parameter in parameters)
    selected = dict(variant.selected)
    name = variant.name
    schema = _schema(stage, variant)
    if OWN_OP_KERNELS:
        _LIBRARY.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        op = getattr(getattr(torch.ops, NAMESPACE), name).default
    else:
        op = None  # defined below, by custom_op
    # Positions of the arrays updated in place: never defaulted, so the dispatcher always passes them
    # positionally (it drops only trailing arguments equal to their defaults).
    mutated = tuple(names.index(n) for n in variant.updated)
    if any(parameters[i].default is not inspect.Parameter.empty for i in mutated):
        raise RuntimeError(f"{NAMESPACE}::{name}: an array updated in place has a default (the op's kernels "
                           f"find updated arrays by position)")

    defaults = tuple(parameter.default for parameter in parameters)
    fresh_positions: dict = {}  # id(program) -> (program, where its fresh results are in program.results)

    def named(values: tuple, keywords: dict) -> dict:
        # The op's values by the stage's names (the dispatcher drops trailing defaulted ones).
        arguments = dict(zip(names, values))
        if len(values) < len(names):
            for n, default in zip(names[len(values):], defaults[len(values):]):
                arguments[n] = keywords.get(n, default)
        arguments.update(selected)
        return arguments

    def bind(values: tuple, keywords: dict) -> tuple[dict, dict]:
        return stage.split(named(values, keywords))

    def implementation(*values, **keywords):
        arguments = named(values, keywords)
        program, results = _eager.run(stage, arguments)  # a compiled graph's steady calls
        if program is _eager.MISS:
            key = results
            arrays, options = stage.split(arguments)
            program = stage.plan(**_infos(stage, arrays)[0], **options)
            _check_updates(stage.name, program, arrays)
            device = next(value.device for value in arrays.values() if value is not None)
            results = run(program, arrays, device)
            _eager.remember(key, stage, program, device)
        entry = fresh_positions.get(id(program))
        if entry is None or entry[0] is not program:
            if len(fresh_positions) >= _eager._LIMIT:
                fresh_positions.clear()
            entry = fresh_positions[id(program)] = (
                program, tuple(program.results.index(n) for n in program.fresh_results))
        return _returns(tuple([results[i] for i in entry[1]]))

    def fake(*values, **keywords):
        # Never launches: the plan validates and sizes the fresh results.
        arrays, options = bind(values, keywords)
        program = stage.plan(**_infos(stage, arrays, _static_info)[0], **options)
        device = next(value.device for value in arrays.values() if value is not None)
        buffers = {b.name: b for b in program.buffers}
        return _returns(tuple(torch.empty(buffers[n].shape, dtype=DTYPES[buffers[n].dtype], device=device)
                              for n in program.fresh_results))

    if OWN_OP_KERNELS:
        _register_own_kernels(stage, name, op, names, mutated, implementation, fake)
    else:
        op = _register_custom_op(stage, name, schema, names, variant.updated, implementation, fake)
    _IMPLEMENTATIONS[op] = implementation
    return op, parameters


def _register_own_kernels(stage: Stage, name: str, op, names: tuple, mutated: tuple, implementation, fake):
    """Register ``op``'s kernels in :data:`_LIBRARY` (the module docstring, "Op registration")."""

    def autograd(keyset, *values, **keywords):
        # The Autograd key: refuse a call autograd would record, bump the versions of the arrays written
        # in place (as ADInplaceOrView would), run the backend kernel.
        if _grad_enabled() and _any_requires_grad(*values):
            _refuse_grad(stage, dict(zip(names, values)))
        below = keyset & _after_inplace_or_view
        with _below_inplace_or_view():
            if below.highestPriorityTypeId() in _BACKENDS:  # the backend kernel is next: call it without a hop
                result = implementation(*values, **keywords)
            else:
                result = op.redispatch(below, *values, **keywords)
        if mutated:
            _increment_version([values[i] for i in mutated])
        return result

    def inplace_or_view(keyset, *values, **keywords):
        # Reached without the Autograd key (inference mode on normal tensors): the version bump alone.
        with _below_inplace_or_view():
            result = op.redispatch(keyset & _after_inplace_or_view, *values, **keywords)
        _increment_version([values[i] for i in mutated])
        return result

    _LIBRARY.impl(name, implementation, "CompositeExplicitAutograd")
    _LIBRARY.impl(name, autograd, "Autograd", with_keyset=True)
    if mutated:
        _LIBRARY.impl(name, inplace_or_view, "ADInplaceOrView", with_keyset=True)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)


def _register_custom_op(stage: Stage, name: str, schema: str, names: tuple, updated: tuple, implementation, fake):
    """Define and register ``qsa::<name>`` through ``torch.library.custom_op`` (a torch whose
    internals :mod:`._internals` has not verified): the same schema, implementation and fake, with
    torch's own Autograd and ADInplaceOrView kernels (which bump the versions of ``updated``).

    An op called directly with an input that requires grad, in grad mode (the public functions
    refuse such a call before any launch, on every path): an op without in-place arrays raises
    the public functions' error from its autograd formula's context set-up, which torch runs
    after the kernels; one with them (torch takes no formula for those) returns results whose
    ``backward()`` raises torch's "no autograd formula" error.
    """
    definition = torch.library.custom_op(f"{NAMESPACE}::{name}", implementation, mutates_args=updated,
                                         schema=schema, tags=(torch.Tag.pt2_compliant_tag,))
    definition.register_fake(fake)
    if not updated:
        def refuse(ctx, inputs, output):
            # Torch runs this (in no_grad) only when grad mode was on and an input requires grad.
            if not _dynamo_fake_run():
                raise _not_differentiable(stage, next(
                    n for n, v in zip(names, inputs) if isinstance(v, torch.Tensor) and v.requires_grad))

        def backward(ctx, *grads):  # never reached: refuse() raised in the forward
            raise _not_differentiable(stage, names[0])

        definition.register_autograd(backward, setup_context=refuse)
    return definition._opoverload


def _returns(fresh: tuple):
    return None if not fresh else fresh[0] if len(fresh) == 1 else fresh


def register_ops(stage: Stage) -> None:
    """Register one custom op per variant of ``stage`` (done at import for every public function)."""
    for variant in stage.variants:
        if variant.name in _OPS:
            raise RuntimeError(f"two qsa ops would be named {NAMESPACE}::{variant.name}")
        _OPS[variant.name] = _make_op(stage, variant)


def op_call(stage: Stage, arguments: Mapping[str, object]) -> tuple:
    """``(op, values)``: the custom op a call with these (valid) arguments runs, and its positional values.

    The op is ``torch.ops.qsa.<variant name>.default``; the values are the
    call's, in the op's order (defaults for the rest).
    """
    op, parameters = _OPS[stage.variant(arguments).name]
    return op, tuple(arguments.get(p.name, p.default) for p in parameters)


for _stage in api.FUNCTIONS:
    register_ops(_stage)
del _stage


# --------------------------------------------------------------------------
# The public functions
# --------------------------------------------------------------------------

def _infos(stage: Stage, arrays: Mapping[str, object], read=info):
    """:func:`_read` under the names the stage's errors use (the step's "state.key_cache")."""
    named, back = stage.labelled(arrays)
    infos, first, plain = _read(stage.name, named, read)
    return back(infos), first, plain


def _call(stage: Stage, arguments: Mapping[str, object], key=None):
    """The general path of a call (``key``: the eager call key to prepare once it ran, if any)."""
    arrays, options = stage.split(arguments)
    infos, first, plain = _infos(stage, arrays)
    program = stage.plan(**infos, **options)
    _refuse_grad(stage, arrays)  # (not in Dynamo's fake-tensor run)
    if not _is_compiling():
        _check_updates(stage.name, program, arrays)
        if plain and _no_mode():
            results = run(program, arrays, first.device)
            _eager.remember(key, stage, program, first.device)
            _increment_version([arrays[name] for name in program.updated_arguments])  # (as _eager.call)
            return program.returned(results)
    op, values = op_call(stage, arguments)
    fresh = op(*values)
    fresh = () if fresh is None else (fresh,) if isinstance(fresh, torch.Tensor) else tuple(fresh)
    made = dict(zip(program.fresh_results, fresh))
    return program.returned(tuple(made[name] if name in made else arrays[name] for name in program.results))


# True while Dynamo traces (and under torch.export); a flag read in eager.
_is_compiling = torch.compiler.is_compiling
_TracingContext = torch._guards.TracingContext  # (torch._guards is imported by torch itself)


def _functionalizing() -> bool:
    """A FunctionalTensorMode is active: AOTAutograd traces the call (Dynamo's own fake-tensor run has none)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None


def _concrete(value):
    # Options that reach the graph as symbols (a Python int or float that
    # Dynamo made dynamic) are specialised: plans take plain numbers.
    if isinstance(value, torch.SymBool):
        return bool(value)
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return value


def _traced_call(stage_name: str, names: tuple, given: dict):
    # AOTAutograd runs this on fake/functional tensors: the plan runs in
    # Python and the op lands in the graph.
    return _call(stage_named(stage_name), {n: _concrete(given.get(n)) for n in names})


def call(stage: Stage, arguments: Mapping[str, object]):
    """Run the public function ``stage`` declares, given its arguments by name."""
    if _is_compiling():
        # Dynamo traces neither the plans nor the Stage object: hand the
        # stage over by name.  nonstrict_trace takes no None inputs: absent
        # ones are put back inside.  It is applied here, not as a decorator,
        # so that importing qsa_torch does not import torch._dynamo (Dynamo
        # turns this call into the decorated function's; under non-strict
        # torch.export it runs as Python, with torch._dynamo imported by then).
        given = {name: value for name, value in arguments.items() if value is not None}
        if not torch.compiler.is_dynamo_compiling():  # torch.export: refuse here (Dynamo: in AOTAutograd)
            _refuse_grad(stage, given, exempt_fake_run=False)
        return torch._dynamo.nonstrict_trace(_traced_call)(stage.name, tuple(arguments), given)
    if _no_mode():  # a plain eager call with a key run before: its prepared program (qsa_torch._eager)
        results, key = _eager.call(stage, arguments)
        if results is not _eager.MISS:
            return results
        return _call(stage, arguments, key)
    return _call(stage, arguments)


def plan(stage: Stage, arguments: Mapping[str, object]) -> Program:
    """The Program a call with these arguments runs (validated, memoised; nothing launched)."""
    arrays, options = stage.split(arguments)
    return stage.plan(**_infos(stage, arrays)[0], **options)


#: ``public(stage)``: the stage's public function for torch (with its ``.plan``).
public = functools.partial(make_public, call=call, plan=plan, framework="torch", module="qsa_torch")


def run_program(program: Program, arrays: Mapping[str, ArrayLike | None]) -> tuple[Array, ...]:
    first = next(value for value in arrays.values() if value is not None)
    return run(program, arrays, first.device)


run_program.__doc__ = RUN_PROGRAM_DOC
