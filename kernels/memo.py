"""Memoised plans whose acceptance never depends on earlier calls.

:func:`cached_plan` wraps a plan function.  Before the memo lookup it

* makes every option canonical and typed, from the kinds the plan declares
  (:class:`.validate.Option`): ``k=3.0``, ``k=True`` and ``k=[3]`` are
  rejected on every call, and ``k=np.int32(3)`` shares ``k=3``'s plan;
  (with plain argument equality ``3 == 3.0 == True`` would let one call's
  plan serve another's invalid arguments);
* rejects ``None`` for a required array (the plan's signature says which
  arrays are optional);
* fills in the stage's tuning from :func:`.tuning.current`, so that a plan
  is memoised with the knobs it was made with.

After a plan is made (a miss), checks common to every plan run once: every
array has a contiguous last dimension, no array the program updates in place
is an expanded (stride-0) view.  (Each launch is checked against its kernel's
parameters when it is built: :class:`.launch.Launch`.)
"""

from __future__ import annotations

import functools
import inspect
from typing import Mapping

from . import tuning as _tuning
from .validate import Checker, Option, missing_array_error

__all__ = ["cached_plan", "clear_plan_caches"]

_PLAN_CACHES: list = []
_current_tuning = _tuning._CURRENT.get
_MISSING = object()
# What the wrapper does with each parameter.
_ARRAY, _OPTIONAL_ARRAY, _OPTION, _TUNING = "array", "optional array", "option", "tuning"


def _annotation(parameter: inspect.Parameter) -> str:
    return str(parameter.annotation).replace(" ", "")


def cached_plan(plan=None, /, *, options: Mapping[str, Option] | None = None):
    """Memoise a plan function: its arguments are array metadata, options and tuning.

    Parameters annotated ``ArrayInfo`` are arrays (``ArrayInfo | None``:
    optional); parameters annotated with a tuning class of
    :mod:`.tuning` receive the current value of that stage unless passed;
    every other parameter is an option and needs its kind in ``options``.

    Plans are pure functions of these arguments, so a decode loop with
    steady shapes pays for validation and planning once (most of the torch
    adapter's host overhead).  Invalid arguments raise every time:
    exceptions are not cached.
    """
    if plan is None:
        return functools.partial(cached_plan, options=options)
    options = dict(options or {})
    function = plan.__name__.removeprefix("plan_")
    parameters = list(inspect.signature(plan).parameters.values())
    names = tuple(p.name for p in parameters)
    # One (name, action, payload, default) per parameter, in signature order.
    spec = []
    arrays, optional_arrays = [], set()
    for p in parameters:
        annotation = _annotation(p)
        default = _MISSING if p.default is inspect.Parameter.empty else p.default
        if annotation.startswith("ArrayInfo"):
            arrays.append(p.name)
            optional = "None" in annotation
            if optional:
                optional_arrays.add(p.name)
            spec.append((p.name, _OPTIONAL_ARRAY if optional else _ARRAY, None, default))
        elif annotation.removesuffix("|None") in _tuning.STAGE_OF:
            spec.append((p.name, _TUNING, _tuning.STAGE_OF[annotation.removesuffix("|None")], None))
        elif p.name in options:
            spec.append((p.name, _OPTION, options[p.name], default))
        else:
            raise TypeError(f"cached_plan: {plan.__name__}'s option {p.name} has no declared kind")
    unknown = set(options) - set(names)
    if unknown:
        raise TypeError(f"cached_plan: {plan.__name__} has no parameters {sorted(unknown)}")
    arrays = tuple(arrays)
    known = frozenset(names)

    @functools.lru_cache(maxsize=4096)
    def build(*values):
        arguments = dict(zip(names, values))
        program = plan(**arguments)
        check = Checker(function)
        for name in arrays:
            if arguments[name] is not None:
                check.last_dim_contiguous(name, arguments[name])
        for name in program.updated_arguments:
            if name in arguments and arguments[name] is not None:
                check.not_expanded(name, arguments[name])
        return program

    # Calls seen before, keyed by the values as given *and their types*
    # (typed=True: 3, 3.0 and True never share an entry) and by the tuning in
    # force (calls under the default tuning, nearly all, have a cache of their
    # own).  A hit skips the canonicalisation of ``checked``; unhashable values
    # (lists, tracers) always take the checked path, which rejects them.
    @functools.lru_cache(maxsize=4096, typed=True)
    def seen_by_default(*args, **kwargs):
        return checked(_tuning.DEFAULT, args, kwargs)

    @functools.lru_cache(maxsize=4096, typed=True)
    def seen_overridden(*args, _tuning_in_force, **kwargs):
        return checked(_tuning_in_force, args, kwargs)

    def memoised(*args, **kwargs):
        current = _current_tuning()
        try:
            if current is _tuning.DEFAULT:
                return seen_by_default(*args, **kwargs)
            return seen_overridden(*args, _tuning_in_force=current, **kwargs)
        except TypeError as error:
            if "unhashable" not in str(error):
                raise
        return checked(current, args, dict(kwargs))

    def checked(current, args, kwargs):
        if args:
            if len(args) > len(names):
                raise TypeError(f"{plan.__name__}() takes {len(names)} arguments, got {len(args)}")
            for name in names[:len(args)]:
                if name in kwargs:
                    raise TypeError(f"{plan.__name__}() got multiple values for argument {name!r}")
            kwargs.update(zip(names, args))
        if not kwargs.keys() <= known:
            raise TypeError(f"{plan.__name__}() got unexpected arguments {sorted(kwargs.keys() - known)}")
        values = []
        for name, action, payload, default in spec:
            value = kwargs.get(name, default)
            if value is _MISSING:
                raise TypeError(f"{plan.__name__}() missing required argument {name!r}")
            if action is _OPTION:
                value = payload.canonical(function, name, value)
            elif action is _ARRAY:
                if value is None:  # named as the caller knows it (the step: "metadata.slot_mapping")
                    raise missing_array_error(function, getattr(memoised, "labels", {}).get(name, name))
            elif action is _TUNING and value is None:
                value = getattr(current, payload)
            values.append(value)
        return build(*values)

    functools.update_wrapper(memoised, plan)
    # What adapters need to bind a public function to its plan: its name
    # (for error messages) and which of its arguments are arrays.
    memoised.function = function
    memoised.array_arguments = arrays
    memoised.optional_arrays = frozenset(optional_arrays)
    memoised.options = options
    def cache_clear():
        seen_by_default.cache_clear()
        seen_overridden.cache_clear()
        build.cache_clear()

    memoised.cache_clear = cache_clear
    memoised.cache_info = build.cache_info
    _PLAN_CACHES.append(memoised)
    return memoised


def clear_plan_caches() -> None:
    """Forget every memoised plan (frees memory; never needed for correctness)."""
    for cached in _PLAN_CACHES:
        cached.cache_clear()
