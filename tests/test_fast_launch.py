"""The eager fast launch path (qsa_torch._accel._fast_launch).

On the CPU, the compiled path runs against Triton 3.6's own binder
(``create_function_from_signature`` with ``BaseBackend``, whose
``native_specialize_impl`` needs no GPU) and a stand-in for the compiled
kernel whose launcher checks, on every fast launch, that it was compiled for
exactly what Triton would specialize the launched arguments on.  The GPU
tests compare the fast path with ``kernel[grid]`` bitwise on every stage.
"""

from __future__ import annotations

import contextlib
import random
import re
import warnings
from collections import defaultdict

import numpy as np
import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import create_function_from_signature

from qsa_kernels import runtime, tuning
from qsa_kernels.launch import ArrayInfo
from qsa_torch._accel import _fast_launch
from qsa_torch._accel._fast_launch import Binding, FastLauncher, SpecializationDriftWarning, claimed_specialization

from . import _fast_launch_kernels as kernels



def binder_of(kernel):
    """Triton's own argument binder for ``kernel`` (what JITFunction.run calls)."""
    return create_function_from_signature(kernel.signature, kernel.params, BaseBackend)


class FakeCompiled:
    """Stands for a CompiledKernel: its launcher checks it fits the arguments it launches."""

    def __init__(self, harness, specialization, options):
        self.harness, self.specialization, self.options = harness, specialization, options
        self.function = object()
        self.packed_metadata = (options["num_warps"], 1, 0)

    def run(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, leave, *values):
        _, specialization, _ = self.harness.binder(*values)
        # The invariant: a fast launch runs a kernel compiled for exactly these arguments.
        assert str(specialization) == str(self.specialization), (specialization, self.specialization)
        assert function is self.function and packed_metadata is self.packed_metadata
        assert self.harness.device_now == self.options["device"]
        self.harness.fast.append(dict(grid=(gx, gy, gz), stream=stream, values=values, hooks=(launch_metadata, enter, leave),
                                      compiled=self))


class Harness:
    """A JITFunction whose compilation and launch are stood in for; a FastLauncher in compiled mode."""

    def __init__(self, kernel, monkeypatch):
        self.kernel = kernel
        self.binder = binder_of(kernel)
        self.device_now = 0
        self.compiled = {}
        self.slow = []  # ordinary kernel[grid] launches
        self.fast = []  # launches straight through a binding
        caches = defaultdict(lambda: ({}, {}, None, BaseBackend, self.binder))
        monkeypatch.setattr(kernel, "device_caches", caches)
        monkeypatch.setattr(kernel, "run", self._run)
        monkeypatch.setattr(kernel, "pre_run_hooks", [])
        monkeypatch.setattr(kernel, "used_global_vals", {})
        self.launcher = FastLauncher(interpreted=False, get_device=lambda: self.device_now,
                                     get_stream=lambda device: 7000 + device)

    def _run(self, *args, grid, warmup, **kwargs):
        """JITFunction.run, minus compiling and launching: the compiled kernel for these arguments."""
        kwargs["debug"] = kwargs.get("debug", self.kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = self.binder(*args, **kwargs)
        key = (self.device_now, str(specialization), str(options))
        if key not in self.compiled:
            self.compiled[key] = FakeCompiled(self, specialization, dict(options, device=self.device_now))
        self.slow.append(dict(grid=grid, values=tuple(bound.values())))
        return self.compiled[key]

    def __call__(self, grid, args, scalars, constexprs, num_warps=4, num_stages=3):
        self.launcher(self.kernel, grid, args, scalars, constexprs, num_warps, num_stages)

    def counts(self):
        return len(self.slow), len(self.fast)


def tensor(dtype=torch.float32, offset=0, n=64):
    """A CPU tensor viewed ``offset`` elements into a fresh (64-byte aligned) allocation."""
    base = torch.arange(n + offset, dtype=torch.float32).to(dtype)
    return base[offset:]


def every_kind_call(**changes):
    """Arguments of EVERY_KIND: (args, scalars, constexprs), with ``changes`` applied by name."""
    values = dict(a_ptr=tensor(torch.bfloat16), b_ptr=tensor(torch.int32), n=17, m=32, x=0.5, flag=True,
                  maybe=None, W=64)
    values.update(changes)
    args = (values.pop("a_ptr"), values.pop("b_ptr"))
    constexprs = {name: values.pop(name) for name in ("W", "DT") if name in values}
    return args, values, constexprs


def test_first_call_binds_then_launches_directly(monkeypatch):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    args, scalars, constexprs = every_kind_call()
    h((3,), args, scalars, constexprs)
    assert h.counts() == (1, 0)
    h((3,), args, scalars, constexprs)
    h((3, 2), args, scalars, constexprs)
    assert h.counts() == (1, 2)
    bound, _, _ = h.binder(*args, **scalars, **constexprs)
    first, second = h.fast
    assert first["grid"] == (3, 1, 1) and second["grid"] == (3, 2, 1)
    assert first["stream"] == 7000
    assert first["hooks"] == (None, None, None)
    # Every parameter in signature order, defaults applied (DT, tail), as JITFunction.run passes them.
    assert len(first["values"]) == len(bound)
    assert all(a is b for a, b in zip(first["values"], bound.values()))
    assert first["values"][-2:] == (tl.float32, 16)


# (description, changes to the first call, changes to the second call, whether the binding must change)
KEY_CASES = [
    ("pointer 16-byte aligned -> offset by 1 element", {}, dict(a_ptr=tensor(torch.bfloat16, offset=1)), True),
    ("pointer offset by 8 bf16 elements = 16 bytes (still aligned)", {}, dict(a_ptr=tensor(torch.bfloat16, offset=8)), False),
    ("pointer offset 2 -> offset 4 bf16 elements (both unaligned)", dict(a_ptr=tensor(torch.bfloat16, offset=2)),
     dict(a_ptr=tensor(torch.bfloat16, offset=4)), False),
    ("another allocation, same alignment", {}, dict(b_ptr=tensor(torch.int32, n=200)), False),
    ("pointer dtype bf16 -> float8_e4m3fn", {}, dict(a_ptr=tensor(torch.float8_e4m3fn)), True),
    ("pointer dtype bf16 -> float16", {}, dict(a_ptr=tensor(torch.float16)), True),
    ("int 17 -> 1 (constexpr in Triton)", {}, dict(n=1), True),
    ("int 17 -> 32 (divisible by 16)", {}, dict(n=32), True),
    ("int 17 -> 19 (same class)", {}, dict(n=19), False),
    ("int 32 -> 48 (both divisible by 16)", dict(n=32), dict(n=48), False),
    ("int 1 -> 1 (still 1)", dict(n=1), dict(n=1), False),
    ("int 17 -> 0 (divisible by 16)", {}, dict(n=0), True),
    ("int 17 -> -17 (same class)", {}, dict(n=-17), False),
    ("int i32 -> i64 (2**31 + 1)", {}, dict(n=2**31 + 1), True),
    ("int i64 -> u64 (2**63 + 1)", dict(n=2**31 + 1), dict(n=2**63 + 1), True),
    ("int i64 divisible -> not", dict(m=2**40), dict(m=2**40 + 3), True),
    ("int 17 -> float 17.0", {}, dict(n=17.0), True),
    ("float -> another float", {}, dict(x=-3.25), False),
    ("bool True -> False", {}, dict(flag=False), False),
    ("bool True -> int 1", {}, dict(flag=1), True),
    ("None -> tensor", {}, dict(maybe=tensor()), True),
    ("constexpr 64 -> 128", {}, dict(W=128), True),
    ("constexpr 1 -> True (equal and same hash in Python)", dict(W=1), dict(W=True), True),
    ("constexpr 0.0 -> -0.0 (equal and same hash in Python)", dict(W=0.0), dict(W=-0.0), True),
    ("constexpr 0.5 -> 0.5", dict(W=0.5), dict(W=0.5), False),
    ("constexpr dtype fp32 (default) -> bf16", {}, dict(DT=tl.bfloat16), True),
    ("constexpr dtype given as its default", {}, dict(DT=tl.float32), False),
]


@pytest.mark.parametrize("what, before, after, changes", KEY_CASES, ids=[c[0] for c in KEY_CASES])
def test_binding_changes_exactly_with_the_specialization(monkeypatch, what, before, after, changes):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    first, second = every_kind_call(**before), every_kind_call(**after)
    h((2,), *first)
    h((2,), *second)
    assert h.counts() == ((2, 0) if changes else (1, 1)), what
    # Back to the first arguments, then the second again: both bindings are reused.
    h((2,), *first)
    h((2,), *second)
    assert h.counts() == ((2, 2) if changes else (1, 3)), what
    # Whatever the binding, its kernel's specialization is what Triton computes now.
    _, then, _ = h.binder(*first[0], **first[1], **first[2])
    _, now, _ = h.binder(*second[0], **second[1], **second[2])
    assert (str(then) != str(now)) == changes, (what, then, now)


@pytest.mark.parametrize("what, options", [("num_warps", dict(num_warps=8)), ("num_stages", dict(num_stages=1))])
def test_binding_changes_with_launch_options(monkeypatch, what, options):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    call = every_kind_call()
    h((2,), *call)
    h((2,), *call, **options)
    h((2,), *call)
    h((2,), *call, **options)
    assert h.counts() == (2, 2)
    assert h.fast[1]["compiled"].options[what] == options[what]
    assert h.fast[0]["compiled"] is not h.fast[1]["compiled"]


def test_binding_changes_with_device(monkeypatch):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    call = every_kind_call()
    h((2,), *call)
    h.device_now = 1
    h((2,), *call)
    h((2,), *call)
    assert h.counts() == (2, 1)
    assert h.fast[0]["stream"] == 7001  # the current stream of the current device
    h.device_now = 0
    h((2,), *call)
    assert h.counts() == (2, 2) and h.fast[1]["stream"] == 7000


INTERESTING_INTS = [0, 1, -1, 2, 15, 16, -16, 17, 48, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1,
                    -(2**31) - 16, 2**40, 2**40 + 1, 2**63 - 1, 2**63 - 16, -(2**63), 2**63, 2**63 + 16, 2**64 - 1,
                    2**64 - 16]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int32, torch.int64, torch.uint8]


def random_value(rng, kind):
    if kind == "tensor":
        return tensor(rng.choice(DTYPES), offset=rng.choice([0, 0, 1, 2, 3, 4, 8, 16]))
    if kind == "int":
        return rng.choice(INTERESTING_INTS) if rng.random() < 0.7 else rng.randrange(-(2**40), 2**40)
    return rng.choice([
        lambda: tensor(rng.choice(DTYPES), offset=rng.choice([0, 1, 8])),
        lambda: rng.choice(INTERESTING_INTS),
        lambda: rng.uniform(-4, 4),
        lambda: rng.random() < 0.5,
        lambda: None,
    ])()


def random_call(rng, kernel):
    """Random arguments for any parameter kinds, all positional, defaults sometimes left out."""
    values = []
    for param in kernel.params:
        if param.is_constexpr:
            values.append(rng.choice([1, True, 2, 64, 1.0, None, tl.float32, tl.bfloat16, (1, 2)]))
        elif param.name.endswith("_ptr"):
            values.append(random_value(rng, "tensor"))
        elif param.name in ("n", "m", "q", "r"):
            values.append(random_value(rng, "int"))
        elif param.name in ("x", "s"):
            values.append(rng.uniform(-4, 4))
        else:
            values.append(random_value(rng, "any"))
    if kernel.params[-1].has_default and rng.random() < 0.5:
        values.pop()
    return values


@pytest.mark.parametrize("kernel", [kernels.EVERY_KIND, kernels.ANNOTATED], ids=["every_kind", "annotated"])
def test_key_claims_triton_specialization_on_random_arguments(kernel):
    """The tokens of the key predict Triton 3.6's specialization (native_specialize_impl) exactly."""
    rng = random.Random(12)
    binder = binder_of(kernel)
    for _ in range(400):
        args = random_call(rng, kernel)
        bound, specialization, _ = binder(*args)
        state = _fast_launch._KernelBinding(kernel)
        values = state.bind(tuple(args), {}, {})
        assert all(a is b for a, b in zip(values, bound.values())) and len(values) == len(bound)
        tokens = state.tokens(values)
        assert claimed_specialization(state.params, tokens, values) == specialization, args


def split_call(kernel, values, positional):
    """``values`` (in signature order) as (args, scalars, constexprs) with ``positional`` leading ones positional."""
    names = [p.name for p in kernel.params]
    scalars = {n: v for p, n, v in zip(kernel.params[positional:], names[positional:], values[positional:])
               if not p.is_constexpr}
    constexprs = {n: v for p, n, v in zip(kernel.params[positional:], names[positional:], values[positional:])
                  if p.is_constexpr}
    return tuple(values[:positional]), scalars, constexprs


@pytest.mark.parametrize("kernel", [kernels.EVERY_KIND, kernels.ANNOTATED], ids=["every_kind", "annotated"])
@pytest.mark.parametrize("positional", ["all", "pointers"])
def test_random_launch_sequence_never_reuses_a_wrong_binding(monkeypatch, kernel, positional):
    """Random calls through the launcher: every fast launch's kernel fits its arguments (FakeCompiled.run checks).

    The pool's dicts recur, as a memoised plan's do, so launch sites are reused too.
    """
    rng = random.Random(3)
    h = Harness(kernel, monkeypatch)
    leading = 2 if kernel is kernels.EVERY_KIND else 1
    pool = []
    for _ in range(25):
        values = random_call(rng, kernel)
        pool.append(split_call(kernel, values, len(values) if positional == "all" else leading))
    for _ in range(300):
        h((1,), *rng.choice(pool), num_warps=rng.choice([4, 8]))
    slow, fast = h.counts()
    assert slow + fast == 300 and fast > 150  # bindings were reused
    assert slow <= 2 * len(pool)  # at most one binding per (arguments, num_warps)


def test_key_claims_and_launch_for_every_argument_kind_by_keyword(monkeypatch):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    args, scalars, constexprs = every_kind_call(DT=tl.float8e4nv, n=2**33)
    h((1,), (), {"a_ptr": args[0], "b_ptr": args[1], **scalars}, constexprs)
    h((1,), (), {"a_ptr": args[0], "b_ptr": args[1], **scalars}, constexprs)
    assert h.counts() == (1, 1)


def test_drift_between_key_and_triton_is_caught(monkeypatch):
    """A key that forgot alignment is caught on its first miss: one warning, and that kernel takes the
    ordinary path from then on (never a wrong binding), the call itself having run the ordinary way."""
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    monkeypatch.setattr(_fast_launch, "_data_ptr", lambda t: t.data_ptr() & ~15)  # a key blind to alignment
    call = every_kind_call(a_ptr=tensor(torch.bfloat16, offset=1))
    with pytest.warns(SpecializationDriftWarning, match="a_ptr"):
        h((1,), *call)
    assert h.counts() == (1, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        h((1,), *call)
        h((1,), *every_kind_call())
    assert h.counts() == (3, 0)


def test_drift_in_a_keyword_token_is_caught(monkeypatch):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    true_token = _fast_launch.argument_token
    monkeypatch.setattr(_fast_launch, "argument_token", lambda v: "i32" if v == 1 else true_token(v))  # blind to == 1
    with pytest.warns(SpecializationDriftWarning, match="'n'"):
        h((1,), *every_kind_call(n=1))
    h((1,), *every_kind_call(n=1))
    assert h.counts() == (2, 0)


def test_moved_triton_internals_turn_the_fast_path_off(monkeypatch):
    """A Triton whose binder is no longer where this module reads it: a warning, not a failed call."""
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    monkeypatch.setattr(kernels.EVERY_KIND, "device_caches", defaultdict(lambda: ({}, {})))
    with pytest.warns(SpecializationDriftWarning, match="IndexError"):
        h((1,), *every_kind_call())
    h((1,), *every_kind_call())
    assert h.counts() == (2, 0)


def test_disabled_launcher_always_takes_the_ordinary_path(monkeypatch):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    h.launcher.enabled = False
    for _ in range(3):
        h((1,), *every_kind_call())
    assert h.counts() == (3, 0)


def test_fast_path_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("QSA_FAST_LAUNCH", "maybe")
    with pytest.raises(ValueError, match="QSA_FAST_LAUNCH"):
        _fast_launch._enabled()


def test_every_knob_triton_run_reads_is_in_the_environment(monkeypatch):
    """The options JITFunction.run adds from the process (this Triton's source) are all in environment()."""
    import inspect

    source = inspect.getsource(type(kernels.EVERY_KIND).run)
    read = set(re.findall(r"knobs\.(?:runtime|compilation)\.(\w+)", source))
    modelled = {"debug", "instrumentation_mode", "fpsan_homomorphic_casts", "launch_enter_hook", "launch_exit_hook",
                "add_stages_inspection_hook"}
    assert read <= modelled, read - modelled
    before = _fast_launch.environment()
    monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    assert _fast_launch.environment() != before


def test_launch_hooks_take_the_ordinary_path(monkeypatch):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    call = every_kind_call()
    h((1,), *call)
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        h((1,), *call)
        h((1,), *call)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert h.counts() == (3, 0)
    h((1,), *call)
    assert h.counts() == (3, 1)


def test_pre_run_hooks_and_callable_grids_take_the_ordinary_path(monkeypatch):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    call = every_kind_call()
    h((1,), *call)
    h(lambda meta: (1,), *call)
    monkeypatch.setattr(kernels.EVERY_KIND, "pre_run_hooks", [lambda *a, **k: None])
    h((1,), *call)
    assert h.counts() == (3, 0)


@pytest.mark.parametrize("what, call", [
    ("numpy integer scalar", every_kind_call(n=np.int64(17))),
    ("int beyond u64 (Triton raises OverflowError)", every_kind_call(n=2**64)),
    ("unhashable constexpr", every_kind_call(W=[1, 2])),
    ("string argument", every_kind_call(maybe="x")),
])
def test_arguments_not_modelled_take_the_ordinary_path(monkeypatch, what, call):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    for _ in range(2):
        try:
            h((1,), *call)
        except Exception:
            pass  # Triton's own binder may reject it: then it raises, as kernel[grid] would
    assert h.counts()[1] == 0, what


def test_unknown_duplicate_or_missing_keywords_take_the_ordinary_path(monkeypatch):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    args, scalars, constexprs = every_kind_call()
    h((1,), args, scalars, constexprs)
    h((1,), args, {**scalars, "unknown": 3}, constexprs)  # the stand-in binder takes it as an option
    with pytest.raises((TypeError, KeyError)):
        h((1,), args, scalars, {**constexprs, "n": 17})  # n given twice: Python's own error
    missing = dict(scalars)
    del missing["m"]
    with pytest.raises(TypeError):
        h((1,), args, missing, constexprs)
    assert h.counts()[1] == 0


def test_kernels_other_than_jit_functions_take_the_ordinary_path():
    calls = []

    class Tuner:  # like triton.runtime.Autotuner: indexable by a grid, no JITFunction state
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    launcher = FastLauncher(interpreted=False, get_device=lambda: 0, get_stream=lambda device: 0)
    for _ in range(2):
        launcher(Tuner(), (1,), (tensor(),), {"n": 3}, {"W": 4}, 4, 3)
    assert len(calls) == 2 and calls[0][2] == dict(n=3, W=4, num_warps=4, num_stages=3)


def test_changed_global_takes_the_ordinary_path(monkeypatch):
    """JITFunction.run raises when a global the kernel read has changed since compiling; so must we."""
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    call = every_kind_call()
    scope = {"BLOCK": tl.constexpr(16)}
    monkeypatch.setattr(kernels.EVERY_KIND, "used_global_vals", {("BLOCK", id(scope)): (scope["BLOCK"], scope)})
    h((1,), *call)
    h((1,), *call)
    assert h.counts() == (1, 1)
    scope["BLOCK"] = tl.constexpr(16)  # an equal value
    h((1,), *call)
    scope["BLOCK"] = tl.constexpr(32)
    h((1,), *call)
    assert h.counts() == (2, 2)


class _GlobalsKernel:
    """A kernel as Binding.globals_unchanged reads it: Triton's record of each global (a deep copy)."""

    def __init__(self, scope: dict):
        import copy

        self.used_global_vals = {(name, id(scope)): (copy.deepcopy(value), scope) for name, value in scope.items()}


def _globals_binding(scope: dict):
    binding = Binding.__new__(Binding)
    binding.kernel, binding._seen_globals = _GlobalsKernel(scope), ()
    return binding


def test_unchanged_globals_are_checked_by_identity_after_the_first_comparison(monkeypatch):
    """Immutable globals found equal once are then held by identity: no value comparison per call."""
    scope = {"BLOCK": tl.constexpr(16), "SHIFT": 3, "PAIR": (1, 2.0)}
    binding = _globals_binding(scope)
    assert binding.globals_unchanged()
    compared = []
    monkeypatch.setattr(tl.constexpr, "__ne__", lambda self, other: compared.append(1) or NotImplemented)
    for _ in range(3):
        assert binding.globals_unchanged()
    assert not compared


@pytest.mark.parametrize("change", ["rebound", "constexpr_value", "scalar", "mutable_in_place", "removed"])
def test_every_change_of_a_global_is_seen_after_identity_checks(change):
    """Whatever changes -- a new object of another value, a constexpr's value reassigned, a mutable
    global changed in place, the name gone -- the next check says so (as ``JITFunction.run`` would)."""
    scope = {"BLOCK": tl.constexpr(16), "SHIFT": 3, "SIZES": [1, 2]}
    binding = _globals_binding(scope)
    assert binding.globals_unchanged() and binding.globals_unchanged()
    scope["BLOCK"] = tl.constexpr(16)  # an equal value in a new object: unchanged
    assert binding.globals_unchanged()
    if change == "rebound":
        scope["BLOCK"] = tl.constexpr(32)
    elif change == "constexpr_value":
        scope["BLOCK"].value = 32
    elif change == "scalar":
        scope["SHIFT"] = 4
    elif change == "mutable_in_place":
        scope["SIZES"].append(3)
    else:
        del scope["SHIFT"]
    assert not binding.globals_unchanged()


def test_same_dicts_mutated_in_place_are_rebound(monkeypatch):
    """A launch site's dicts are bound once; changing them in place (keys or values) is seen."""
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    args, scalars, constexprs = every_kind_call()
    h((1,), args, scalars, constexprs)
    h((1,), args, scalars, constexprs)
    assert h.counts() == (1, 1)
    scalars["n"] = 1  # now a constexpr for Triton
    h((1,), args, scalars, constexprs)
    h((1,), args, scalars, constexprs)
    assert h.counts() == (2, 2) and h.fast[-1]["values"][2] == 1
    scalars["n"] = 19  # same class as 17: the first binding, with the new value
    h((1,), args, scalars, constexprs)
    assert h.counts() == (2, 3) and h.fast[-1]["values"][2] == 19
    constexprs["W"] = 32
    h((1,), args, scalars, constexprs)
    assert h.counts() == (3, 3)
    del scalars["x"]
    scalars["x"] = 0.5  # same values, another key order
    h((1,), args, scalars, constexprs)
    assert h.counts() == (3, 4) and h.fast[-1]["values"][4] == 0.5


class CudaLauncher:
    """Stands for triton.backends.nvidia.driver.CudaLauncher (same name and attributes)."""

    def __init__(self, scratch):
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.calls, self.launches = [], []

    def __call__(self, *args):
        self.calls.append(args)

    def launch(self, *args):
        self.launches.append(args)


@pytest.mark.parametrize("scratch", [0, 256])
def test_launcher_called_directly_when_no_scratch_is_needed(monkeypatch, scratch):
    h = Harness(kernels.EVERY_KIND, monkeypatch)
    launcher = CudaLauncher(scratch)
    compiled = FakeCompiled(h, None, dict(num_warps=4))
    compiled.run = launcher
    monkeypatch.setattr(kernels.EVERY_KIND, "run", lambda *a, grid, warmup, **k: compiled)
    args, scalars, constexprs = every_kind_call()
    h((2, 3), args, scalars, constexprs)
    h((2, 3), args, scalars, constexprs)
    values = tuple(h.binder(*args, **scalars, **constexprs)[0].values())
    from qsa_torch._accel import _fast_launch
    if scratch or not _fast_launch._TRITON_3_6:  # __call__ allocates the scratch; the direct call is 3.6's order
        (call,) = launcher.calls
        assert not launcher.launches
        assert call[:9] == (2, 3, 1, 7000, compiled.function, compiled.packed_metadata, None, None, None)
        assert call[9:] == values
    else:  # CudaLauncher.launch(gx, gy, gz, stream, function, cooperative, pdl, scratch, scratch, ...)
        (call,) = launcher.launches
        assert not launcher.calls
        assert call[:13] == (2, 3, 1, 7000, compiled.function, False, True, None, None, compiled.packed_metadata,
                             None, None, None)
        assert call[13:] == values


# ----------------------------------------------------------------- interpreter

def _info(t: torch.Tensor) -> ArrayInfo:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64"}
    return ArrayInfo(tuple(t.shape), names[t.dtype], t.stride())


@pytest.mark.skipif(not runtime.INTERPRETED, reason="interpreter case")
def test_interpreted_launch_is_kernel_grid():
    """Under the interpreter the module launches through kernel[grid]: same result, and right."""
    from qsa_kernels.compress import plan_store_cache_rows

    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(5, 4, 1, 24, generator=gen)
    slots = torch.tensor([3, 17, 0, 9, -1, 12, 19], dtype=torch.int32)
    rows = torch.randn(7, 24, generator=gen)
    (launch,) = plan_store_cache_rows(_info(cache), _info(slots), _info(rows)).launches
    # The fourth and fifth inputs are the scale's and the positions' stand-in pointers (an unquantised
    # store of every row).
    assert launch.inputs == ("cache", "slot_mapping", "rows", "slot_mapping", "slot_mapping")
    assert launch.outputs == ("cache",)
    env = dict(cache=cache.clone(), slot_mapping=slots, rows=rows)
    ours = FastLauncher()
    assert ours.interpreted
    with runtime.interpreter_lock:
        for _ in range(2):
            ours(launch.kernel, launch.grid, tuple(env[n] for n in launch.inputs + launch.outputs), launch.scalars,
                 launch.constexprs, launch.num_warps, launch.num_stages)
        theirs = dict(env, cache=cache.clone())
        launch.kernel[launch.grid](*(theirs[n] for n in launch.inputs + launch.outputs), **launch.scalars,
                                   **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    assert ours.misses == 0 and not ours._kernels  # nothing bound under the interpreter
    assert torch.equal(env["cache"], theirs["cache"])
    expected = cache.clone().view(-1, 24)
    for slot, row in zip(slots.tolist(), rows):
        if slot >= 0:
            expected[slot] = row
    assert torch.equal(env["cache"], expected.view(cache.shape))


# ----------------------------------------------------------------------- GPU

def _stage_programs(device):
    """(name, program, arrays) for every public function's launches at tiny shapes, plus attention with 2 splits."""
    from benchmarks.bench_host import program_of, public_calls

    calls = public_calls(device)
    del calls["qsa_attention_step"]  # its stages are covered one by one
    cases = list(calls.items())
    attention = calls["sparse_paged_attention"]
    # Wide enough for several key tiles (a token listed twice is attended twice), so two splits exist.
    cases = [(name, arguments, None) for name, arguments in cases]
    cases.append(("sparse_paged_attention", dict(attention, token_indices=torch.cat([attention["token_indices"]] * 16, 1)),
                  2))
    out = []
    for name, arguments, splits in cases:
        with contextlib.ExitStack() as stack:
            if splits is not None:  # the split count is tuning, not an argument
                stack.enter_context(tuning.override(attention=tuning.AttentionTuning(num_splits=splits)))
            program, env = program_of(name, arguments)
        gen = torch.Generator(device).manual_seed(len(out))
        for buffer in program.buffers:  # random contents, so that a launch that skips a write shows
            t = env[buffer.name]
            if buffer.name in program.filled_buffers:  # read before written (tickets): the executor's fill
                t.fill_(buffer.fill)
            elif t.dtype.is_floating_point:
                t.copy_(torch.randn(t.shape, generator=gen, device=device))
            else:
                t.copy_(torch.randint(-1, 3, t.shape, generator=gen, device=device))
        out.append((name + (f" ({splits} splits)" if splits is not None else ""), program, env))
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with ``t``'s strides (the plan's scalars are strides)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _run_program(program, env, launcher):
    env = {k: _copy(v) for k, v in env.items()}
    for launch in program.runnable_launches:
        args = tuple(env[n] for n in launch.inputs + launch.outputs)
        if launcher is None:
            launch.kernel[launch.grid](*args, **launch.scalars, **launch.constexprs, num_warps=launch.num_warps,
                                       num_stages=launch.num_stages)
        else:
            launcher(launch.kernel, launch.grid, args, launch.scalars, launch.constexprs, launch.num_warps,
                     launch.num_stages)
    if env and next(iter(env.values())).is_cuda:
        torch.cuda.synchronize()
    return env


@pytest.mark.gpu
def test_fast_path_is_bitwise_kernel_grid_on_every_stage():
    device = torch.device("cuda")
    launcher = FastLauncher()
    names = []
    for name, program, env in _stage_programs(device):
        names.append(name)
        expected = _run_program(program, env, None)
        _run_program(program, env, launcher)  # binds (first call of each specialization)
        misses = launcher.misses
        got = _run_program(program, env, launcher)
        assert launcher.misses == misses, f"{name}: steady call rebound"
        for key in expected:
            assert torch.equal(expected[key].view(torch.uint8), got[key].view(torch.uint8)), (name, key)
    assert {"rope_reshape_and_cache", "compress_groups", "store_cache_rows", "mqa_paged_scores", "topk_blocks",
            "expand_block_indices", "select_paged_tokens", "sparse_paged_attention",
            "sparse_paged_attention (2 splits)"} <= set(names)


@pytest.mark.gpu
def test_stale_binding_on_gpu_unaligned_then_aligned():
    """Same kernel, an unaligned view then an aligned tensor (and back): every result right."""
    from qsa_kernels.compress import plan_store_cache_rows

    device = torch.device("cuda")
    launcher = FastLauncher()
    gen = torch.Generator(device).manual_seed(0)
    slots = torch.tensor([3, 17, 0, 9, -1, 12, 19], dtype=torch.int32, device=device)
    width = 24
    for offset in (1, 0, 1, 0, 3, 8):
        storage = torch.randn(5 * 4 * width + offset, generator=gen, device=device)
        cache = storage[offset:].view(5, 4, 1, width)
        rows_storage = torch.randn(7 * width + offset, generator=gen, device=device)
        rows = rows_storage[offset:].view(7, width)
        expected = cache.clone().view(-1, width)
        for slot, row in zip(slots.tolist(), rows):
            if slot >= 0:
                expected[slot] = row
        (launch,) = plan_store_cache_rows(_info(cache), _info(slots), _info(rows)).launches
        for _ in range(2):  # the second call goes through the binding
            target = cache.clone() if offset == 0 else storage.clone()[offset:].view(cache.shape)
            arrays = {"cache": target, "slot_mapping": slots, "rows": rows}  # the plan names the pointers
            launcher(launch.kernel, launch.grid, tuple(arrays[n] for n in launch.inputs + launch.outputs),
                     launch.scalars, launch.constexprs, launch.num_warps, launch.num_stages)
            torch.cuda.synchronize()
            assert torch.equal(target.view(-1, width), expected), offset
    assert launcher.misses >= 2


# --------------------------------------------------------------------------
# Programmatic dependent launch (qsa_kernels.pdl): launch_pdl on exactly the
# marked kernels, on sm_90 on, while pdl.ENABLED
# --------------------------------------------------------------------------

@pytest.mark.parametrize("marked, capability, enabled, early", [
    (True, (9, 0), True, True), (True, (10, 0), True, True), (True, (8, 9), True, False),
    (False, (9, 0), True, False), (True, (9, 0), False, False)])
def test_launch_pdl_exactly_for_marked_kernels_on_sm90(monkeypatch, marked, capability, enabled, early):
    from qsa_kernels import pdl

    h = Harness(kernels.EVERY_KIND, monkeypatch)
    h.launcher = FastLauncher(interpreted=False, get_device=lambda: h.device_now, get_stream=lambda device: 7000,
                              get_capability=lambda device: capability)
    monkeypatch.setattr(pdl, "ENABLED", enabled)
    monkeypatch.setattr(pdl, "EMIT", True)  # as in a compiled process on an sm_90 host
    if marked:
        monkeypatch.setattr(kernels.EVERY_KIND, "qsa_waits_for_previous_kernel", True, raising=False)
    call = every_kind_call()
    h((2,), *call)
    h((2,), *call)
    assert h.counts() == (1, 1)
    assert h.launcher.early(kernels.EVERY_KIND, 0) is early
    # The compiled kernel the binding launches is the one compiled with launch_pdl (or without).
    assert h.fast[0]["compiled"].options.get("launch_pdl", False) is early


def test_pdl_switch_rebinds(monkeypatch):
    """pdl.ENABLED is part of the launcher's environment: flipping it never reuses the other's binding."""
    from qsa_kernels import pdl

    h = Harness(kernels.EVERY_KIND, monkeypatch)
    h.launcher = FastLauncher(interpreted=False, get_device=lambda: 0, get_stream=lambda device: 7000,
                              get_capability=lambda device: (9, 0))
    monkeypatch.setattr(kernels.EVERY_KIND, "qsa_waits_for_previous_kernel", True, raising=False)
    monkeypatch.setattr(pdl, "EMIT", True)
    call = every_kind_call()
    for enabled in (True, False, True, False):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        h((2,), *call)
    assert h.counts() == (2, 2)
    assert [f["compiled"].options.get("launch_pdl", False) for f in h.fast] == [True, False]
