"""Eager fast path for Triton launches: bind once per specialization, then call the launcher.

``kernel[grid](*args, **kwargs)`` costs 27-100 µs of host time per call in
Triton 3.6 (``JITFunction.run``: the generated binder, ``compute_cache_key``,
``str(options)``, a ``LazyDict`` of launch metadata, the global-value check).
Our launches repeat with steady shapes, so :func:`launch` computes a cheap key
of everything Triton specializes a compiled kernel on, and on a hit calls that
compiled kernel's launcher directly, exactly as ``JITFunction.run`` would::

    compiled.run(grid_0, grid_1, grid_2, stream, compiled.function,
                 compiled.packed_metadata, launch_metadata, enter_hook, exit_hook,
                 *bound_arguments)

The first call of each key (a miss) goes through ``kernel[grid](...)``, which
compiles (or finds) and launches the kernel and returns it; the key's claim of
what Triton specializes on is then checked against Triton's own binder.  A
mismatch (or Triton internals not where this module reads them) warns once
(:class:`SpecializationDriftWarning`) and turns the fast path off for that
kernel instead of caching a binding that could later launch the wrong kernel;
the call itself ran the ordinary way.  The fast path is on only for the Triton
minors in :data:`VERIFIED` (``QSA_FAST_LAUNCH`` overrides).

What the key holds, per call (``triton/runtime/jit.py`` and
``python/src/specialize.cc`` of Triton 3.6 are the reference):

* the device (``JITFunction.device_caches[device]``: one compiled kernel, and
  one loaded CUfunction, per device);
* ``num_warps``, ``num_stages``, the debug flag and the instrumentation mode
  (``run`` puts them in ``options``, part of ``compute_cache_key``), and
  ``launch_pdl``, which this module passes itself: on for the kernels
  :mod:`qsa_kernels.pdl` marks, on sm_90 and later, while ``pdl.ENABLED``
  (a function of the kernel, the device and :func:`environment`);
* per kernel parameter, in signature order:
  - tensor: its dtype (the pointer type ``*bf16``, ``*fp8e4nv``...) and whether
    ``data_ptr() % 16 == 0`` (``handle_tensor``: attribute ``D``,
    ``tt.divisibility = 16``);
  - int: ``== 1`` (then Triton makes it a constexpr), else its width class
    (``i32`` / ``i64`` / ``u64`` by range) and ``% 16 == 0`` (``handle_long_type``);
  - float: ``fp32``; bool: ``u1``; None: a constexpr None;
  - constexpr parameter: its value and the value's type (``True``, ``1`` and
    ``1.0`` hash alike in Python but compile differently).

Shapes and strides are not in it: Triton passes them as the int arguments
they are.  The stream is not in it either: Triton does not specialize on it;
it is read on every call (the current stream of the current device) and
passed to the launcher.  Anything this module does not model (launch hooks,
pre-run hooks, callable grids, argument types other than the above, Triton's
interpreter) takes the ordinary ``kernel[grid](...)`` path.

Cost per call.  The keyword part of a launch (``scalars``, ``constexprs``:
sizes, strides, tile constants) comes from a memoised plan, so the same dict
objects recur: their tokens and values are bound once per launch site and
reused after one dict comparison with a private copy (a dict changed in place
is rebound).  The positional part (tensors) is read every call, in C-level
passes: ``data_ptr`` and ``dtype`` of each.  The key is then one small tuple;
on a hit the launch goes to ``CudaLauncher.launch`` directly when the kernel
needs no scratch memory (else through ``CudaLauncher.__call__``, which
allocates it).
"""

from __future__ import annotations

import operator
import warnings
from functools import reduce
from operator import or_
from typing import Any, Callable, Mapping

import torch
import triton
import triton.language as tl
from triton import knobs as _knobs
from triton.knobs import HookChain as _HookChain
from triton.runtime.jit import JITFunction

from qsa_kernels import pdl, runtime

from ._internals import switch

__all__ = ["ENABLED", "VERIFIED", "launch", "FastLauncher", "SpecializationDriftWarning", "argument_token",
           "claimed_specialization", "environment"]


class SpecializationDriftWarning(RuntimeWarning):
    """Our specialization key disagrees with Triton's own binder (a bug here, or a new Triton).

    Warned once per kernel, which then takes the ordinary path for the rest of the process.
    """


#: The Triton minors this module's model of ``JITFunction.run`` was verified against: minor ->
#: (how a bound launch calls the compiled launcher, what was verified, where).  Any other Triton
#: launches through ``kernel[grid](...)`` unless ``QSA_FAST_LAUNCH=1``.
VERIFIED = {
    "3.6": ("CudaLauncher.launch", "bitwise equal to kernel[grid] on every stage; the binder agrees with the key "
            "on 21,600 random argument sets", "H200 (GPU) and CPU"),
    "3.7": ("CudaLauncher.__call__", "binder and specialization rules as 3.6's; run() keys on the same options "
            "plus add_stages_inspection_hook (modelled: a hook takes the ordinary path)", "CPU only (source, binder)"),
    "3.8": ("CudaLauncher.__call__", "as 3.7; CompiledKernel.__del__ unloads its module (bindings hold the "
            "compiled kernel)", "CPU only (source, binder)"),
    "3.9": ("CudaLauncher.__call__", "as 3.8, plus fpsan_homomorphic_casts in run()'s options (in the key)",
            "CPU only (source, binder)"),
}
_ENVIRONMENT = "QSA_FAST_LAUNCH"  # "0": always kernel[grid]; "1": the fast path even on an unverified Triton


def _enabled() -> bool:
    return switch(_ENVIRONMENT, triton.__version__, VERIFIED)


#: Whether launches bind to the compiled launcher in this process (decided once, at import).
ENABLED = _enabled()


class _Unsupported(Exception):
    """An argument this module does not model: use the ordinary launch path."""


_MISSING = object()
# The argument order of CudaLauncher.launch is Triton 3.6's; other versions go
# through CudaLauncher.__call__ (still the compiled kernel's own launcher).
_TRITON_3_6 = triton.__version__.startswith("3.6.")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_UINT64_MAX = 2**64 - 1

# Tokens for non-tensor runtime arguments.  (handle_long_type: an int equal
# to 1 becomes ("constexpr", 1); otherwise its type is i32 if it fits, else i64,
# else u64, and "D" marks a multiple of 16.  handle_float_type: "fp32";
# handle_bool_type: "u1"; None: ("constexpr", None).)
_ONE = "1"
_TOKEN_INT = {"i32D": ("i32", True), "i32": ("i32", False), "i64D": ("i64", True), "i64": ("i64", False),
              "u64D": ("u64", True), "u64": ("u64", False)}  # token -> (type, multiple of 16)
_FP32, _U1, _NONE = "fp32", "u1", "None"


def argument_token(value: Any) -> Any:
    """What Triton specializes on in a runtime (non-constexpr) argument, as a hashable token.

    Raises ``_Unsupported`` for anything Triton would not take or this module
    does not model (so the caller falls back to ``kernel[grid]``).
    """
    kind = type(value)
    if kind is torch.Tensor:
        return (value.dtype, value.data_ptr() & 15 == 0)
    if kind is int:
        if value == 1:
            return _ONE
        divisible = value & 15 == 0
        if _INT32_MIN <= value <= _INT32_MAX:
            return "i32D" if divisible else "i32"
        if _INT64_MIN <= value <= _INT64_MAX:
            return "i64D" if divisible else "i64"
        if 0 <= value <= _UINT64_MAX:
            return "u64D" if divisible else "u64"
        raise _Unsupported  # Triton raises OverflowError: let it
    if kind is float:
        return _FP32
    if kind is bool:
        return _U1
    if value is None:
        return _NONE
    if isinstance(value, torch.Tensor):  # subclasses (nn.Parameter): Triton reads data_ptr too
        return (value.dtype, value.data_ptr() & 15 == 0)
    raise _Unsupported


def _constexpr_token(value: Any) -> tuple:
    # The type: 1, True and 1.0 are equal in Python but compile differently;
    # a float's hex: 0.0 == -0.0 as well.
    return (float, value.hex()) if type(value) is float else (type(value), value)


def _native_claim(token: Any, value: Any, is_const: bool, specialize: bool, align: bool) -> tuple:
    """``native_specialize_impl(backend, value, is_const, specialize, align)`` as the token predicts it."""
    from triton._utils import canonicalize_ptr_dtype

    if type(token) is tuple:  # a tensor: (dtype, 16-byte aligned)
        dtype, aligned = token
        key = None if not specialize else ("D" if align and aligned else "")
        return (canonicalize_ptr_dtype(dtype, is_const), key)
    if token == _ONE:
        if specialize:
            return ("constexpr", value)
        return ("i32", None)
    if token in _TOKEN_INT:
        width, divisible = _TOKEN_INT[token]
        key = None if not specialize else ("D" if align and divisible else "")
        return (width, key)
    if token == _FP32:
        return ("fp32", None)
    if token == _U1:
        return ("u1", None)
    if token == _NONE:
        return ("constexpr", None)
    raise AssertionError(f"unknown token {token!r}")


def claimed_specialization(params, tokens, values) -> list:
    """The list Triton's binder returns as ``specialization``, as our tokens predict it.

    ``params`` are the kernel's ``KernelParam`` s, ``tokens`` our key's per-parameter
    tokens and ``values`` the bound arguments (used only for values the token
    says Triton embeds: constexprs and ints equal to 1).  Mirrors
    ``create_function_from_signature`` (including annotated parameters).
    """
    claims = []
    for param, token, value in zip(params, tokens, values):
        if param.is_constexpr:
            claims.append(("constexpr", value))  # the token is the value itself (with its type)
            continue
        specialize = not param.do_not_specialize
        base = _native_claim(token, value, param.is_const, specialize, not param.do_not_specialize_on_alignment)
        annotation = param.annotation_type
        if annotation:
            if annotation == "u1" or annotation[:2] in ("fp", "bf"):
                claims.append((annotation, None))
            else:
                # the binder's `specialize` is a string there, always true: it
                # prepends the annotation to whatever specialize_impl returned
                claims.append((annotation,) + base[1:])
        else:
            claims.append(base)
    return claims


class _Named:
    """The keyword part of one launch site, bound once: the two dicts (held, so that their ids
    stay theirs), copies of them, and the values and tokens they bind to, in signature order.

    A dict changed in place since is rebound.  (A value replaced by an equal one
    of another type, ``1`` by ``True``, is not seen: the launch then passes the
    bound value, consistently with the binding's kernel.)"""

    __slots__ = ("scalars", "constexprs", "snapshot", "values", "tokens", "token_id")


class _KernelBinding:
    """What one kernel's launches need, computed once: its parameters, and its bindings."""

    __slots__ = ("kernel", "params", "parameters", "constexpr_names", "named", "token_ids", "bindings")

    def __init__(self, kernel):
        self.kernel = kernel  # held so that id(kernel) stays this kernel's
        self.params = tuple(kernel.params)
        self.parameters = tuple(kernel.signature.parameters.values())
        self.constexpr_names = frozenset(p.name for p in self.params if p.is_constexpr)
        self.named: dict = {}  # (id(scalars), id(constexprs), positional count) -> _Named
        self.token_ids: dict = {}  # keyword tokens -> a small int standing for them in keys
        # key -> (launch function, its leading arguments, packed_metadata)
        self.bindings: dict = {}

    def named_part(self, positional: int, scalars: Mapping, constexprs: Mapping) -> _Named:
        """Bind the keyword arguments: values and tokens of parameters ``positional`` on, defaults applied."""
        if positional > len(self.parameters):
            raise _Unsupported
        if constexprs and scalars:
            named = {**scalars, **constexprs}
            if len(named) != len(scalars) + len(constexprs):
                raise _Unsupported  # a name given twice: let Python raise
        else:
            named = constexprs or scalars
        later = self.parameters[positional:]
        if not named.keys() <= {p.name for p in later}:
            raise _Unsupported  # unknown keyword, or a positional one given again: let Triton raise
        values, tokens = [], []
        for p in later:
            value = named.get(p.name, p.default)
            if value is p.empty:
                raise _Unsupported  # missing argument: let Triton raise
            values.append(value)
            tokens.append(_constexpr_token(value) if p.name in self.constexpr_names else argument_token(value))
        part = _Named()
        part.scalars, part.constexprs = scalars, constexprs
        # Private copies: a dict changed in place later compares unequal (one C-level comparison per call).
        part.snapshot = (dict(scalars), dict(constexprs))
        part.values, part.tokens = tuple(values), tuple(tokens)
        hash(part.tokens)  # TypeError (unhashable constexpr) here, not at every call
        part.token_id = self.token_ids.setdefault(part.tokens, len(self.token_ids))
        return part

    def bind(self, args: tuple, scalars: Mapping, constexprs: Mapping) -> list:
        """All arguments in signature order, defaults applied (JITFunction.run's ``bound_args.values()``)."""
        return [*args, *self.named_part(len(args), scalars, constexprs).values]

    def tokens(self, values: list) -> list:
        """Per-parameter tokens of arguments in signature order (the key's content, uncompressed);
        ``values`` may be the leading (positional) ones only."""
        return [_constexpr_token(value) if p.is_constexpr else argument_token(value)
                for p, value in zip(self.params, values)]


class _Unbindable:
    """A kernel object this module does not bind (always launched the ordinary way)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel  # held so that id(kernel) stays this kernel's


_data_ptr = torch.Tensor.data_ptr  # raises TypeError on anything but a tensor
_dtype_of = operator.attrgetter("dtype")
_ALL_ALIGNED = "all 16-byte aligned"
_NAMED_LIMIT = 4096  # launch sites remembered per kernel (plans are memoised with the same bound)


def _positional_tokens(dtypes, alignment, args) -> list:
    """Per-argument tokens of the positional part of a key (for the check on a miss)."""
    if dtypes is None:
        return list(alignment)
    if alignment is _ALL_ALIGNED:
        return [(dtype, True) for dtype in dtypes]
    return list(zip(dtypes, alignment))


def environment():
    """What ``JITFunction.run`` reads from the process, besides the arguments, to pick a compiled kernel.

    ``None`` when something is set that this module does not model (launch
    hooks, a stage-inspection hook): such launches take the ordinary path.
    Every bound launch re-reads this and compares it with its binding's.
    """
    runtime_knobs, compilation = _knobs.runtime, _knobs.compilation
    enter, leave = runtime_knobs.launch_enter_hook, runtime_knobs.launch_exit_hook
    # Triton keeps empty HookChains there; anything else is a hook to honour.
    if (enter is not None and (type(enter) is not _HookChain or enter.calls)) or \
       (leave is not None and (type(leave) is not _HookChain or leave.calls)) or \
       getattr(runtime_knobs, "add_stages_inspection_hook", None) is not None:
        return None
    return (runtime_knobs.debug, compilation.instrumentation_mode,
            getattr(compilation, "fpsan_homomorphic_casts", None), pdl.ENABLED)


def _launch_function(compiled):
    """``(function, leading arguments)`` that launch ``compiled``, as ``CompiledKernel.run`` would.

    Triton 3.6's ``CudaLauncher.__call__(gx, gy, gz, stream, function, *args)``
    allocates the global and profile scratch buffers (when the kernel needs
    them) and calls ``self.launch(gx, gy, gz, stream, function,
    launch_cooperative_grid, launch_pdl, global_scratch, profile_scratch,
    *args)`` (backends/nvidia/driver.py).  When the kernel needs no scratch,
    we call ``launch`` directly and skip that Python frame.
    """
    launcher = compiled.run  # loads the module on first use (already done by the launch that bound it)
    if (_TRITON_3_6 and type(launcher).__name__ == "CudaLauncher" and getattr(launcher, "global_scratch_size", 1) == 0
            and getattr(launcher, "profile_scratch_size", 1) == 0 and hasattr(launcher, "launch")):
        return launcher.launch, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None)
    return launcher, ()


class FastLauncher:
    """Launches Triton kernels through cached bindings (see the module docstring).

    ``interpreted``, ``get_device``, ``get_stream`` and ``get_capability``
    default to this process's choice (``qsa_kernels.runtime.INTERPRETED``),
    Triton's own driver functions and torch's device capability; tests inject
    them to exercise the compiled path on CPU.
    """

    def __init__(self, interpreted: bool | None = None,
                 get_device: Callable[[], int] | None = None,
                 get_stream: Callable[[int], int] | None = None,
                 enabled: bool | None = None,
                 get_capability: Callable[[int], tuple[int, int]] | None = None):
        self.interpreted = runtime.INTERPRETED if interpreted is None else interpreted
        self.enabled = ENABLED if enabled is None else enabled
        self._get_device = get_device
        self._get_stream = get_stream
        self._get_capability = get_capability or torch.cuda.get_device_capability
        self._capabilities: dict = {}  # device -> its compute capability
        self._kernels: dict = {}  # id(kernel) -> _KernelBinding
        self.misses = 0  # first calls of a specialization (tests and benchmarks read it)

    def _driver_functions(self):
        # Resolved at the first compiled launch, not at import: no CUDA
        # initialisation at import time.  These are the functions
        # JITFunction.run uses (GPUDriver.__init__).
        from triton.runtime.driver import driver

        active = driver.active
        if self._get_device is None:
            self._get_device = active.get_current_device
        if self._get_stream is None:
            self._get_stream = active.get_current_stream
        return self._get_device, self._get_stream

    def __call__(self, kernel, grid: tuple, args: tuple, scalars: Mapping[str, Any],
                 constexprs: Mapping[str, Any], num_warps: int, num_stages: int):
        """Launch ``kernel[grid](*args, **scalars, **constexprs, num_warps=, num_stages=)``.

        On the current device and its current stream.  ``scalars`` and
        ``constexprs`` are best the same dict objects from call to call (a
        memoised plan's): their binding is then reused after a check that
        their keys and values are unchanged.  Returns the :class:`Binding`
        the launch went through (made on a first call), or ``None`` when it
        took the ordinary path.
        """
        if self.interpreted:
            kernel[grid](*args, **scalars, **constexprs, num_warps=num_warps, num_stages=num_stages)
            return None
        get_device, get_stream = self._get_device, self._get_stream
        if get_device is None or get_stream is None:
            get_device, get_stream = self._driver_functions()
        device = get_device()
        early = self.early(kernel, device)
        if not self.enabled:
            self._slow(kernel, grid, args, scalars, constexprs, num_warps, num_stages, early)
            return None
        state = self._kernels.get(id(kernel))
        if state is None:
            # Only plain JITFunctions (not autotuners, heuristics...): their run() is the one modelled here.
            state = _KernelBinding(kernel) if isinstance(kernel, JITFunction) else _Unbindable(kernel)
            self._kernels[id(kernel)] = state
        process = environment()
        if process is None or state.__class__ is _Unbindable or kernel.pre_run_hooks or callable(grid):
            self._slow(kernel, grid, args, scalars, constexprs, num_warps, num_stages, early)
            return None
        try:
            site = (id(scalars), id(constexprs), len(args))
            named = state.named.get(site)
            if named is None or named.scalars is not scalars or named.constexprs is not constexprs or \
               scalars != named.snapshot[0] or constexprs != named.snapshot[1]:
                named = state.named_part(len(args), scalars, constexprs)
                if len(state.named) >= _NAMED_LIMIT:
                    state.named.clear()
                state.named[site] = named
            try:
                pointers = tuple(map(_data_ptr, args))
                dtypes = tuple(map(_dtype_of, args))
                alignment = _ALL_ALIGNED if not reduce(or_, pointers, 0) & 15 else \
                    tuple([pointer & 15 == 0 for pointer in pointers])
            except (TypeError, AttributeError):  # not all tensors
                dtypes, alignment = None, tuple(state.tokens(args))
            key = (named.token_id, dtypes, alignment, device, num_warps, num_stages, kernel.debug, process)
            binding = state.bindings.get(key)
        except Exception:  # _Unsupported, an unhashable constexpr...: the ordinary path
            # does whatever Triton does with such arguments.  (Meta and fake tensors report
            # data_ptr() == 0 and would launch like kernel[grid] launches them: callers must
            # not launch on them.)
            self._slow(kernel, grid, args, scalars, constexprs, num_warps, num_stages, early)
            return None
        if binding is None:
            tokens = _positional_tokens(dtypes, alignment, args) + list(named.tokens)
            return self._miss(state, key, tokens, [*args, *named.values], device, kernel, grid, args, scalars,
                              constexprs, num_warps, num_stages, early)
        if not binding.globals_unchanged():  # JITFunction.run raises when one has changed: let it
            self._slow(kernel, grid, args, scalars, constexprs, num_warps, num_stages, early)
            return None
        size = len(grid)
        # launch_metadata and the hooks: None, as there are no hooks (checked above).
        binding.launch(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, get_stream(device),
                       *binding.leading, binding.packed_metadata, None, None, None, *args, *named.values)
        return binding

    def early(self, kernel, device: int) -> bool:
        """Whether ``kernel`` is launched on ``device`` with programmatic dependent launch
        (:func:`qsa_kernels.pdl.launches_early`; the device's capability read once)."""
        if not (pdl.ENABLED and pdl.EMIT and pdl.waits(kernel)):
            return False
        capability = self._capabilities.get(device)
        if capability is None:
            capability = self._capabilities[device] = tuple(self._get_capability(device))
        return pdl.launches_early(kernel, capability)

    @staticmethod
    def _slow(kernel, grid, args, scalars, constexprs, num_warps, num_stages, early):
        if early:
            return kernel[grid](*args, **scalars, **constexprs, num_warps=num_warps, num_stages=num_stages,
                                launch_pdl=True)
        return kernel[grid](*args, **scalars, **constexprs, num_warps=num_warps, num_stages=num_stages)

    def _miss(self, state, key, tokens, values, device, kernel, grid, args, scalars, constexprs,
              num_warps, num_stages, early):
        """First call of a specialization: launch the ordinary way, check our key, bind.

        A key that disagrees with Triton's binder (or a Triton whose internals
        moved: the binder's place, its results) is warned about once, and the
        kernel takes the ordinary path from then on: the call itself already
        ran the ordinary way.
        """
        compiled = self._slow(kernel, grid, args, scalars, constexprs, num_warps, num_stages, early)
        self.misses += 1
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return None  # a jit_cache_hook skipped compilation: nothing to bind
        try:
            binder = kernel.device_caches[device][4]
            bound, specialization, _ = binder(*args, **scalars, **constexprs)
            triton_values = list(bound.values())
            if len(triton_values) != len(values) or not all(map(_same_argument, triton_values, values)):
                raise SpecializationDriftWarning(f"{kernel}: arguments bound unlike Triton binds them")
            claims = claimed_specialization(state.params, tokens, values)
            if claims != list(specialization) or str(claims) != str(list(specialization)):
                diff = [(p.name, ours, theirs) for p, ours, theirs in zip(state.params, claims, specialization)
                        if ours != theirs or str(ours) != str(theirs)]
                raise SpecializationDriftWarning(
                    f"{kernel}: our specialization key disagrees with Triton's (parameter, ours, Triton's): {diff}")
            launch, leading = _launch_function(compiled)
        except Exception as error:
            self._kernels[id(kernel)] = _Unbindable(kernel)
            warnings.warn(f"qsa_torch: the fast launch path is off for {kernel} in this process (Triton "
                          f"{triton.__version__}): {type(error).__name__}: {error}", SpecializationDriftWarning,
                          stacklevel=3)
            return None
        binding = state.bindings[key] = Binding(launch, (compiled.function, *leading), compiled, kernel)
        return binding

    def keyword_values(self, kernel, positional: int, scalars: Mapping[str, Any], constexprs: Mapping[str, Any]):
        """The values a launch with ``positional`` positional arguments passes after them, in signature order
        (``scalars`` and ``constexprs`` bound, defaults applied), as a bound launch passes them."""
        state = self._kernels[id(kernel)]
        site = (id(scalars), id(constexprs), positional)
        named = state.named.get(site)
        if named is None or named.scalars is not scalars or named.constexprs is not constexprs:
            named = state.named_part(positional, scalars, constexprs)
        return named.values

    def clear(self) -> None:
        """Forget every binding (the compiled kernels stay in Triton's caches)."""
        self._kernels.clear()


class Binding:
    """A compiled kernel's launcher, bound: ``launch(gx, gy, gz, stream, *leading, packed_metadata,
    None, None, None, *arguments)`` launches it as ``JITFunction.run`` would.

    Holds the compiled kernel: from Triton 3.8 its ``__del__`` unloads the
    module the bound function lives in.
    """

    __slots__ = ("launch", "leading", "packed_metadata", "compiled", "kernel", "process", "_seen_globals")

    def __init__(self, launch, leading: tuple, compiled, kernel):
        self.launch, self.leading, self.compiled, self.kernel = launch, leading, compiled, kernel
        self.packed_metadata = compiled.packed_metadata
        self.process = environment()
        # (Triton's record, the immutable globals found equal: (globals dict, name, object, its value),
        # the others: (name, recorded value, globals dict)), or () before the first check
        self._seen_globals: tuple = ()

    def globals_unchanged(self) -> bool:
        """The globals the kernel read when it was compiled still hold those values (``run`` checks it too).

        Triton records a deep copy of each, so equality is a value comparison
        (a ``tl.constexpr``'s ``!=`` builds constexprs: ~1 µs a global).  A
        global found equal whose object is immutable (an immutable scalar or
        tuple, or a constexpr of one) is remembered by identity: while the
        name holds that object, with that value object, it holds that value."""
        used = self.kernel.used_global_vals
        if not used:
            return True
        seen = self._seen_globals
        if seen and seen[0] is used:
            for globals_dict, name, now, value in seen[1]:
                if globals_dict.get(name, _MISSING) is not now or getattr(now, "value", None) is not value:
                    break
            else:  # the immutable ones hold; compare the others by value
                return all(globals_dict.get(name, _MISSING) == recorded for name, recorded, globals_dict in seen[2])
        remembered, compared = [], []
        for (name, _), (recorded, globals_dict) in used.items():
            now = globals_dict.get(name, _MISSING)
            if now is not recorded and now != recorded:
                return False
            if _immutable(now):
                remembered.append((globals_dict, name, now, getattr(now, "value", None)))
            else:
                compared.append((name, recorded, globals_dict))
        self._seen_globals = (used, tuple(remembered), tuple(compared))
        return True


def _immutable(value) -> bool:
    """Whether ``value`` cannot change in place: an immutable scalar, a tuple of such, or a constexpr of one."""
    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, tuple):
        return all(map(_immutable, value))
    return value is None or type(value) in (bool, int, float, complex, str, bytes)


def _same_argument(a, b) -> bool:
    return a is b or (type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b)


#: The process's launcher: ``launch(kernel, grid, args, scalars, constexprs, num_warps, num_stages)``.
launch = FastLauncher()
