"""One declaration per public function: its arrays, options, tuning, docstring and plan.

A :class:`Stage` is everything the two adapters need to know of a public
function, in one explicit object:

* the **plan** (a pure function of array metadata and options returning a
  :class:`~.launch.Program`); its Python signature is the public signature:
  parameter order, keyword-only markers and defaults;
* which parameters are **arrays** (``None`` allowed where the plan's default
  is ``None``, or where the declaration names them ``nullable``: required
  positionally, ``None`` meaning "absent", as stage 1's ``cos_sin``);
* what a call **returns**, in order (``results``): arrays it updates in
  place (returned as given) and fresh arrays, some only when a boolean
  option is true (:func:`when`).  So each stage has a finite set of
  variants (:class:`Variant`), one per value of those options, known before
  any call: the torch adapter registers one custom op per variant at import;
* each **option**'s kind (:class:`.validate.Option`: what it must be, its
  canonical value);
* the **tuning** parameters, each filled with a stage of
  :func:`.tuning.current` unless passed;
* the **docstring** (shared by both adapters: :mod:`.docs`) and the
  annotation of what the function returns.

Both adapters build their public functions from it (``api.define``, by
:func:`make_function`: a real Python function with the public signature),
and :meth:`Stage.plan` is the public planning seam: the memoised Program a
call with those arrays' metadata and options runs.

Memoisation.  Before the memo lookup every option is made canonical and
typed (``k=3.0``, ``k=True`` and ``k=[3]`` are rejected on every call,
``k=np.int32(3)`` shares ``k=3``'s plan: with plain argument equality
``3 == 3.0 == True`` one call's plan would serve another's invalid
arguments), ``None`` for a required array raises, and the tuning in force is
part of the key, so acceptance never depends on earlier calls.  After a miss,
checks common to every plan run once: every array has a contiguous last
dimension, no array the program updates in place is an expanded view, and
the program returns and updates exactly what its variant declares.
"""

from __future__ import annotations

import __future__
import dataclasses
import functools
import inspect
import itertools
from typing import Any, Callable, Mapping, NamedTuple

from . import tuning as _tuning
from .docs import framework_doc
from .launch import Program
from .validate import Checker, Option, missing_array_error, naming

__all__ = ["RUN_PROGRAM_DOC", "Stage", "Variant", "clear_plan_caches", "make_function", "plan_seam", "signature_text",
           "stage", "stage_named", "when"]

_MISSING = object()
_ARRAY, _OPTIONAL_ARRAY, _OPTION, _TUNING = "array", "optional array", "option", "tuning"
_STAGES: dict[str, "Stage"] = {}
_current_tuning = _tuning._CURRENT.get


class When(NamedTuple):
    """Results returned only when the boolean option ``option`` is true (made by :func:`when`)."""

    option: str
    results: tuple[str, ...]


def when(option: str, *results: str) -> When:
    """In a :class:`Stage`'s ``results``: ``results`` follow only when ``option`` (a ``BOOL`` option) is true."""
    return When(option, results)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kind of call of a public function: what it returns and updates in place.

    A stage has one variant per combination of the boolean options its
    ``results`` name in :func:`when` entries (most have none: one variant).
    ``name`` is the function's name followed by ``_<option>`` for each such
    option that is true (``rope_reshape_and_cache_return_zeros``): the torch
    adapter's op name, so it never changes while the declaration does not.
    ``results`` are the declared names in the order a call returns them;
    ``updated`` are the arrays among them (updated in place and returned as
    given), ``fresh`` the others (allocated by the call).
    """

    name: str
    selected: tuple[tuple[str, bool], ...]  # (option, value) of each option that selects a variant
    results: tuple[str, ...]
    updated: tuple[str, ...]
    fresh: tuple[str, ...]



class Stage:
    """The declaration of one public function (see the module docstring).

    ``plan``: the plan function (named ``plan_<function>``); ``arrays``: its
    array parameters; ``results``: what a call returns, in order (names of
    required arrays, updated in place and returned as given, and of fresh
    results; :func:`when` entries for results that depend on a boolean
    option); ``options``: option name -> kind; ``tuning``: tuning parameter -> stage
    name of :class:`.tuning.Tuning`; ``labels``: how errors name an array
    (the step's ``key_cache`` is ``state.key_cache``); ``nullable``: arrays
    without a default that may still be ``None`` (absent; the plan decides
    what that means: ``cos_sin=None``, no RoPE); ``returns``: the
    return annotation (``Array`` is the adapter's array type).  Every
    parameter of ``plan`` is exactly one of arrays, options and tuning.
    """

    def __init__(self, plan: Callable[..., Program], *, arrays: tuple[str, ...], options: Mapping[str, Option],
                 results: tuple[str | When, ...], doc: str | None = None, returns: str = "Array",
                 tuning: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None,
                 nullable: tuple[str, ...] = (), rows: Mapping[str, str] | None = None):
        self.name = plan.__name__.removeprefix("plan_")
        self.doc = plan.__doc__ if doc is None else doc
        self.returns = returns
        self.labels = dict(labels or {})
        self.options = dict(options)
        tuning = dict(tuning or {})
        self._plan = plan
        self._parameters = tuple(inspect.signature(plan).parameters.values())
        names = [p.name for p in self._parameters]
        declared = [*arrays, *self.options, *tuning]
        undeclared = [name for name in names if name not in declared]
        if undeclared:
            raise TypeError(f"Stage {self.name}: parameters {undeclared} of {plan.__name__} are declared neither "
                            "as arrays, options nor tuning (every option has a declared kind)")
        unknown = sorted(set(declared) - set(names)) + sorted(set(nullable) - set(arrays))
        if unknown or len(declared) != len(set(declared)):
            raise TypeError(f"Stage {self.name}: {unknown or 'duplicates'} in the declaration are not "
                            f"{plan.__name__}'s arrays, options and tuning (once each)")
        for name, stage in tuning.items():
            if stage not in _tuning.STAGES:
                raise TypeError(f"Stage {self.name}: tuning parameter {name} names no tuning stage {stage!r}")
        # One (name, action, payload, default) per plan parameter, in signature order.
        self._spec = []
        for p in self._parameters:
            default = _MISSING if p.default is inspect.Parameter.empty else p.default
            if p.name in tuning:
                self._spec.append((p.name, _TUNING, tuning[p.name], None))
            elif p.name in self.options:
                self._spec.append((p.name, _OPTION, self.options[p.name], default))
            else:
                optional = default is None or p.name in nullable
                self._spec.append((p.name, _OPTIONAL_ARRAY if optional else _ARRAY, None, default))
        self._names = tuple(names)
        self._known = frozenset(names)
        self.arrays = tuple(p.name for p in self._parameters if p.name in arrays)
        self.optional_arrays = frozenset(name for name, action, _, _ in self._spec if action is _OPTIONAL_ARRAY)
        #: The public parameters (arrays and options, not tuning), in signature order.
        self.parameters = tuple(p for p in self._parameters if p.name not in tuning)
        self._declare_results(tuple(results))
        #: Fresh result -> the array argument whose leading (row) dimension it has: the one
        #: dimension of a fresh result that may be symbolic under ``torch.compile`` (the row and
        #: request counts are the dynamic sizes of a serving step; every other dimension follows
        #: the caches, heads and options).  Default: the first array argument; checked per plan.
        self.rows = {name: (rows or {}).get(name, self.arrays[0])
                     for variant in self.variants for name in variant.fresh}
        unknown_rows = sorted(set(rows or {}) - set(self.rows)) + sorted(
            source for source in self.rows.values() if source not in self.arrays or source in self.optional_arrays)
        if unknown_rows:
            raise TypeError(f"Stage {self.name}: rows names {unknown_rows}, which are not fresh results and "
                            "required arrays")
        self._memo()
        _STAGES[self.name] = self

    def __repr__(self) -> str:
        return f"<Stage {self.name}>"

    def __call__(self, *args, **kwargs) -> Program:
        """:meth:`plan`: a stage is called as the plan function it declares."""
        return self.plan(*args, **kwargs)

    # -- the planning seam ---------------------------------------------------

    def plan(self, *args, **kwargs) -> Program:
        """The Program a call runs, from its arrays' :class:`ArrayInfo` and its options (memoised).

        Arguments as the public function takes them (arrays as ArrayInfos,
        ``None`` for absent optional ones); tuning parameters, if given,
        replace the current tuning's stage.  Raises the public function's
        errors for invalid arguments (never cached).
        """
        current = _current_tuning()
        try:
            if current is _tuning.DEFAULT:
                return self._seen_by_default(*args, **kwargs)
            return self._seen_overridden(*args, _tuning_in_force=current, **kwargs)
        except TypeError as error:
            if "unhashable" not in str(error):
                raise
        return self._checked(current, args, dict(kwargs))

    def plan_named(self, function: str, labels: Mapping[str, str], /, *args, **kwargs) -> Program:
        """:meth:`plan`, its errors naming ``function`` and the arrays by ``labels`` (a composed call's)."""
        with naming(function, labels):
            return self.plan(*args, **kwargs)

    def label(self, name: str) -> str:
        """How errors name the array ``name``."""
        return self.labels.get(name, name)

    def labelled(self, arrays: Mapping[str, Any]) -> tuple[dict, Callable[[Mapping], dict]]:
        """``arrays`` keyed by the names errors use (:attr:`labels`), and the map back.

        So an adapter's type and device errors name the arrays as the caller
        wrote them (the step's ``state.key_cache``).
        """
        labels = self.labels
        if not labels:  # every stage but the step: nothing to rename (the torch hot path)
            return arrays, _same
        named = {labels.get(name, name): value for name, value in arrays.items()}
        return named, lambda by_label: {name: by_label[labels.get(name, name)] for name in arrays}

    def variant(self, options: Mapping[str, Any]) -> Variant:
        """The :class:`Variant` a call with these options (by name, as given) runs.

        Options not given take their defaults; call it on options a plan
        has accepted (an invalid selecting option raises the plan's error).
        """
        if not self._selectors:
            return self.variants[0]
        key = tuple(self.options[name].canonical(self.name, name, options.get(name, self._selector_defaults[name]))
                    for name in self._selectors)
        return self._variant_by_key[key]

    def split(self, arguments: Mapping[str, Any]) -> tuple[dict, dict]:
        """A call's arguments, by name, as ``(arrays, options)`` (absent arrays: ``None``)."""
        arrays = {name: arguments.get(name) for name in self.arrays}
        options = {name: value for name, value in arguments.items() if name not in arrays}
        return arrays, options

    def cache_clear(self) -> None:
        self._seen_by_default.cache_clear()
        self._seen_overridden.cache_clear()
        self._build.cache_clear()

    def cache_info(self):
        return self._build.cache_info()

    # -- the public signature ------------------------------------------------

    def signature(self) -> inspect.Signature:
        """The public function's signature; annotations as strings (``ArrayLike``, ``Array``: the adapter's types)."""
        parameters = []
        for p in self.parameters:
            if p.name in self.options:
                kind = self.options[p.name]
                annotation = kind.canonical_type.__name__ + (" | None" if kind.optional else "")
            else:
                annotation = "ArrayLike | None" if p.name in self.optional_arrays else "ArrayLike"
            parameters.append(p.replace(annotation=annotation))
        return inspect.Signature(parameters, return_annotation=self.returns)

    # -- results and variants ------------------------------------------------

    def _declare_results(self, results: tuple[str | When, ...]) -> None:
        """Check the ``results`` declaration; make :attr:`variants` and :attr:`updates` from it."""
        selectors: list[str] = []
        for entry in results:
            names = entry.results if isinstance(entry, When) else (entry,)
            if isinstance(entry, When):
                kind = self.options.get(entry.option)
                if kind is None or kind.canonical_type is not bool or kind.optional:
                    raise TypeError(f"Stage {self.name}: when({entry.option!r}, ...) must name a bool option "
                                    "(declared BOOL)")
                if entry.option not in selectors:
                    selectors.append(entry.option)
            for name in names:
                if not isinstance(name, str) or not name:
                    raise TypeError(f"Stage {self.name}: results must be names or when(...) entries, got {name!r}")
                if name in self.optional_arrays:
                    raise TypeError(f"Stage {self.name}: result {name!r} is an optional array (a call that "
                                    "omits it could not return it)")
                if name in self._known and name not in self.arrays:
                    raise TypeError(f"Stage {self.name}: result {name!r} is an option or tuning parameter")
        self._selectors = tuple(selectors)
        defaults = {p.name: p.default for p in self._parameters}
        self._selector_defaults = {name: (None if defaults[name] is inspect.Parameter.empty else defaults[name])
                                   for name in selectors}
        variants, by_key = [], {}
        for values in itertools.product((False, True), repeat=len(selectors)):
            chosen = dict(zip(selectors, values))
            names: list[str] = []
            for entry in results:
                if not isinstance(entry, When):
                    names.append(entry)
                elif chosen[entry.option]:
                    names.extend(entry.results)
            if len(names) != len(set(names)):
                raise TypeError(f"Stage {self.name}: results {names} name an array twice ({chosen})")
            variant = Variant(
                name=self.name + "".join(f"_{option}" for option, value in chosen.items() if value),
                selected=tuple(chosen.items()), results=tuple(names),
                updated=tuple(name for name in names if name in self.arrays),
                fresh=tuple(name for name in names if name not in self.arrays))
            variants.append(variant)
            by_key[values] = variant
        #: Every kind of call, the one with every selecting option false first.
        self.variants: tuple[Variant, ...] = tuple(variants)
        self._variant_by_key = by_key
        #: The arrays some call updates in place (and returns), in ``results`` order.
        self.updates = tuple(dict.fromkeys(name for variant in variants for name in variant.updated))

    def _check_results(self, program: Program, variant: Variant) -> None:
        """The program returns and updates in place what ``variant`` declares (else a bug in the plan)."""
        fresh = {buffer.name for buffer in program.buffers}
        matches = len(program.results) == len(variant.results) and all(
            got == wanted if wanted in variant.updated else got in fresh
            for got, wanted in zip(program.results, variant.results))
        if not matches or set(program.updated_arguments) != set(variant.updated):
            raise AssertionError(f"{self.name}: the program returns {program.results} and updates "
                                 f"{program.updated_arguments} in place, but the stage declares results "
                                 f"{variant.results} (updated in place: {variant.updated}) for "
                                 f"{dict(variant.selected) or 'every call'}")

    # -- memo ----------------------------------------------------------------

    def _memo(self) -> None:
        function = self.name

        # Keyed by the whole tuning in force too: a composed plan (the step)
        # reads its stages' tuning through their plans, not only its own.
        @functools.lru_cache(maxsize=4096)
        def build(current, *values):
            arguments = dict(zip(self._names, values))
            program = self._plan(**arguments)
            check = Checker(function)
            for name in self.arrays:
                if arguments[name] is not None:
                    check.last_dim_contiguous(name, arguments[name])
            variant = self._variant_by_key[tuple(arguments[n] for n in self._selectors)]
            self._check_results(program, variant)
            for name, got in zip(variant.results, program.results):
                if name in variant.fresh:
                    rows, source = program.buffer(got).shape[:1], self.rows[name]
                    if rows != arguments[source].shape[:1]:
                        raise AssertionError(f"{function}: fresh result {name} has {rows} rows, but the stage "
                                             f"declares that it has {source}'s ({arguments[source].shape[:1]})")
            for name in program.updated_arguments:
                check.not_expanded(name, arguments[name])
            return program

        # Calls seen before, keyed by the values as given *and their types*
        # (typed=True: 3, 3.0 and True never share an entry) and by the tuning
        # in force (calls under the default tuning, nearly all, have a cache of
        # their own).  A hit skips the canonicalisation of ``_checked``;
        # unhashable values (lists, tracers) always take the checked path,
        # which rejects them.
        @functools.lru_cache(maxsize=4096, typed=True)
        def seen_by_default(*args, **kwargs):
            return self._checked(_tuning.DEFAULT, args, kwargs)

        @functools.lru_cache(maxsize=4096, typed=True)
        def seen_overridden(*args, _tuning_in_force, **kwargs):
            return self._checked(_tuning_in_force, args, kwargs)

        self._build, self._seen_by_default, self._seen_overridden = build, seen_by_default, seen_overridden

    def _checked(self, current, args, kwargs) -> Program:
        plan_name = self._plan.__name__
        if args:
            if len(args) > len(self._names):
                raise TypeError(f"{plan_name}() takes {len(self._names)} arguments, got {len(args)}")
            for name in self._names[:len(args)]:
                if name in kwargs:
                    raise TypeError(f"{plan_name}() got multiple values for argument {name!r}")
            kwargs.update(zip(self._names, args))
        if not kwargs.keys() <= self._known:
            raise TypeError(f"{plan_name}() got unexpected arguments {sorted(kwargs.keys() - self._known)}")
        values = []
        check = Checker(self.name, self.labels)
        for name, action, payload, default in self._spec:
            value = kwargs.get(name, default)
            if value is _MISSING:
                raise TypeError(f"{plan_name}() missing required argument {name!r}")
            if action is _OPTION:
                value = payload.canonical(check.function, check.name(name), value)
            elif action is _ARRAY:
                if value is None:
                    raise missing_array_error(check.function, check.name(name))
            elif action is _TUNING and value is None:
                value = getattr(current, payload)
            values.append(value)
        return self._build(current, *values)


def stage(**declaration) -> Callable[[Callable[..., Program]], Stage]:
    """Declare the decorated plan function's :class:`Stage` (keywords: :class:`Stage`'s).

    ``@stage(arrays=..., options=..., doc=...)`` on ``def plan_<function>``
    binds that name to the Stage, which is called as the memoised plan.
    """
    return lambda plan: Stage(plan, **declaration)


def _same(arrays):
    return arrays


def stage_named(name: str) -> Stage:
    """The declared stage of public function ``name`` (the torch compile path hands stages over by name)."""
    return _STAGES[name]


def clear_plan_caches() -> None:
    """Forget every memoised plan (frees memory; never needed for correctness)."""
    for stage in _STAGES.values():
        stage.cache_clear()


RUN_PROGRAM_DOC = """Run a Program over arrays by name; its results, in ``program.results`` order.

For benchmarks and tests that sweep what a call plans: take a call's
Program from ``function.plan(...)``, change it (``dataclasses.replace`` of a
launch's warps, say) and run it here.  Launches as a call does (torch: on
the tensors' device and current stream).
"""


def signature_text(signature: inspect.Signature, default: Callable[[inspect.Parameter], str] | None = None,
                   *, method: bool = False) -> str:
    """``(q: ArrayLike, ..., *, k_scale: ArrayLike | None = ...) -> Array``: a ``def``'s parameters and
    return annotation, the one spelling of a public signature (the typed Protocol's methods,
    :mod:`.functions`, with ``self`` where ``method``; the adapters' functions, :func:`make_function`).
    A default reads ``default(parameter)``; without ``default``, ``...`` (a stub's)."""
    parts, keyword_only = ["self"] if method else [], False
    for p in signature.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        text = p.name if p.annotation is p.empty else f"{p.name}: {p.annotation}"
        if p.default is not p.empty:
            text += f" = {default(p) if default else '...'}"
        parts.append(text)
    return f"({', '.join(parts)}) -> {signature.return_annotation}"


def make_function(stage: Stage, call: Callable[[Stage, dict], Any], *, framework: str, module: str,
                  signature: inspect.Signature | None = None):
    """A function with ``stage``'s public signature (``signature``; default :meth:`Stage.signature`)
    that returns ``call(stage, arguments_by_name)``.

    Generated as real Python source (a ``def`` with the public parameters and
    annotations, :func:`signature_text`), so that calls bind arguments as any
    function does, at no cost, with Python's own errors; ``inspect.signature``,
    ``help()`` and IDEs see the parameters and annotations (strings, as under
    ``from __future__ import annotations``), and Dynamo traces it as plain code.
    """
    signature = signature or stage.signature()
    arguments = "{" + ", ".join(f"{name!r}: {name}" for name in signature.parameters) + "}"
    source = (f"def {stage.name}{signature_text(signature, lambda p: f'_default_{p.name}')}:\n"
              f"    return _call(_stage, {arguments})\n")
    namespace = {f"_default_{p.name}": p.default for p in signature.parameters.values() if p.default is not p.empty}
    namespace.update(_call=call, _stage=stage)
    code = compile(source, f"<qsa {framework} {stage.name}>", "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)
    exec(code, namespace)  # noqa: S102
    function = namespace[stage.name]
    function.__module__ = module
    function.__qualname__ = stage.name
    function.__doc__ = framework_doc(stage.doc, framework)
    return function


def plan_seam(stage: Stage, plan: Callable[[Stage, dict], Program], *, framework: str, module: str):
    """``function.plan`` for one adapter: a function with ``stage``'s public signature returning
    ``plan(stage, arguments)``, the Program a call with those arguments runs (nothing launched), so
    that tests and benchmarks see exactly what a call plans, arrays included."""
    seam = make_function(stage, plan, framework=framework, module=module)
    seam.__qualname__ = f"{stage.name}.plan"
    seam.__doc__ = (f"The Program ``{stage.name}`` runs for these arguments (validated and memoised as a "
                    "call's; nothing is launched).")
    seam.__annotations__["return"] = "Program"
    return seam