"""Writes each adapter's typed public functions from the stages' declarations (qsa_kernels.api).

    python scripts/generate_functions.py          # rewrites qsa_torch/_functions.py, qsa_jax/_functions.py
    python scripts/generate_functions.py --check  # exits 1 if either is not what the declarations give

One ``def`` per public function with the declared signature and annotations
(an ``@overload`` per variant where a bool option selects what it returns,
``Literal`` on that option), so that a type checker sees every parameter and
return type; the body hands the arguments by name to the adapter's binding.
The composed step takes the state and metadata containers in place of their
fields.  tests/test_generated.py runs ``--check``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ADAPTERS = {
    "torch": ("qsa_torch", "from torch import Tensor as Array, Tensor as ArrayLike"),
    "jax": ("qsa_jax", "from jax import Array\n    from jax.typing import ArrayLike"),
}


def _import_api():
    try:
        from qsa_kernels import api, step
    except ImportError:  # a checkout without the package installed: kernels/ is qsa_kernels
        import importlib.util

        spec = importlib.util.spec_from_file_location("qsa_kernels", os.path.join(ROOT, "kernels", "__init__.py"),
                                                      submodule_search_locations=[os.path.join(ROOT, "kernels")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["qsa_kernels"] = module
        spec.loader.exec_module(module)
        from qsa_kernels import api, step
    return api, step


def _annotation(stage, parameter) -> str:
    if parameter.name in stage.options:
        kind = stage.options[parameter.name]
        return kind.canonical_type.__name__ + (" | None" if kind.optional else "")
    return "ArrayLike | None" if parameter.name in stage.optional_arrays else "ArrayLike"


def _public_parameters(stage, step):
    """``(name, annotation, kind, default)`` of the public function's parameters, in order."""
    out = []
    containers = {step.STATE_FIELDS[0]: ("state", "QSAState"), step.METADATA_FIELDS[0]: ("metadata", "StepMetadata")}
    folded = set(step.STATE_FIELDS + step.SCALE_FIELDS + step.METADATA_FIELDS) if stage.name == step.FUNCTION else set()
    for p in stage.parameters:
        if p.name in containers and folded:
            name, annotation = containers[p.name]
            out.append((name, annotation, p.kind, inspect.Parameter.empty))
        elif p.name not in folded:
            out.append((p.name, _annotation(stage, p), p.kind, p.default))
    return out


def _result_type(stage, step, variant) -> str:
    if stage.name == step.FUNCTION:  # the four caches come back as one QSAState
        names = [n for n in variant.results if n not in step.STATE_FIELDS]
        types = ["Array", "QSAState"] + ["Array"] * (len(names) - 1)
    else:
        types = ["Array"] * len(variant.results)
    return types[0] if len(types) == 1 else f"tuple[{', '.join(types)}]"


def _signature(parameters, overrides=None, stub=False) -> str:
    """The parameter list; ``overrides``: name -> (annotation, default text or None for no default)."""
    parts, keyword_only = [], False
    for name, annotation, kind, default in parameters:
        if kind is inspect.Parameter.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        text = f"{name}: {annotation}"
        if overrides and name in overrides:
            annotation, default_text = overrides[name]
            text = f"{name}: {annotation}"
            if default_text is None and not keyword_only:
                default_text = "..."  # a positional parameter after defaulted ones keeps one
            if default_text is not None:
                text += f" = {default_text}"
        elif default is not inspect.Parameter.empty:
            text += " = ..." if stub else f" = {default!r}"
        parts.append(text)
    return ", ".join(parts)


def _function(stage, step, framework: str) -> str:
    parameters = _public_parameters(stage, step)
    selectors = [name for name, value in stage.variants[0].selected]
    variants = {tuple(value for _, value in variant.selected): variant for variant in stage.variants}
    union = " | ".join(dict.fromkeys(_result_type(stage, step, v) for v in stage.variants))
    lines = []
    if selectors:
        defaults = {name: default for name, _, _, default in parameters if name in selectors}
        for values, variant in variants.items():
            overrides = {name: (f"Literal[{value}]", "..." if defaults[name] == value else None)
                         for name, value in zip(selectors, values)}
            lines += ["@overload",
                      f"def {stage.name}({_signature(parameters, overrides, stub=True)}) -> "
                      f"{_result_type(stage, step, variant)}: ..."]
        if len(selectors) > 1:  # one option a bool, the others at their defaults
            for name in selectors:
                overrides = {n: ("bool", "...") if n == name else (f"Literal[{defaults[n]}]", "...") for n in selectors}
                returns = " | ".join(dict.fromkeys(
                    _result_type(stage, step, v) for values, v in variants.items()
                    if all(value == defaults[n] for n, value in zip(selectors, values) if n != name)))
                lines += ["@overload", f"def {stage.name}({_signature(parameters, overrides, stub=True)}) -> {returns}: ..."]
        lines += ["@overload",
                  f"def {stage.name}({_signature(parameters, {n: ('bool', '...') for n in selectors}, stub=True)}) "
                  f"-> {union}: ..."]
    arguments = ", ".join(f"{name!r}: {name}" for name, *_ in parameters)
    call = "_step_call" if stage.name == step.FUNCTION else "_call"
    lines += [f"def {stage.name}({_signature(parameters)}) -> {union}:",
              f"    return {call}(_api.plan_{stage.name}, {{{arguments}}})  # type: ignore[no-any-return]",
              ""]
    return "\n".join(lines)


def source(framework: str) -> str:
    api, step = _import_api()
    module, imports = ADAPTERS[framework]
    names = [stage.name for stage in api.FUNCTIONS]
    body = "\n\n".join(_function(stage, step, framework) for stage in api.FUNCTIONS)
    docs = "\n".join(f"{name}.__doc__ = _doc(_api.plan_{name}.doc, {framework!r})" for name in names)
    docs += f"\nfor _function in ({', '.join(names)}):\n    _function.__module__ = {module!r}  # as help() and docs name it"
    seams = "\n".join(f"{name}.plan = _plan_seam(_api.plan_{name})  # type: ignore[attr-defined]"
                      for name in names if name != step.FUNCTION)
    return f'''# Generated by scripts/generate_functions.py from qsa_kernels.api's declarations: do not edit.
# (python scripts/generate_functions.py rewrites it; tests/test_generated.py checks that it is current.)
"""{module}'s public functions, one per declared stage, typed (docs/api.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

from qsa_kernels import api as _api
from qsa_kernels.docs import framework_doc as _doc

from ._binding import call as _call, plan_seam as _plan_seam
from ._step import QSAState, StepMetadata, step_call as _step_call

if TYPE_CHECKING:  # the annotations' array types (the same names in both adapters)
    {imports}

__all__ = {names!r}


{body}

{docs}
{seams}
'''


def _path(framework: str) -> str:
    return os.path.join(ROOT, ADAPTERS[framework][0], "_functions.py")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is not current")
    arguments = parser.parse_args(argv)
    stale = []
    for framework in ADAPTERS:
        text, path = source(framework), _path(framework)
        current = open(path).read() if os.path.exists(path) else None
        if current != text:
            stale.append(os.path.relpath(path, ROOT))
            if not arguments.check:
                with open(path, "w") as out:
                    out.write(text)
    if arguments.check and stale:
        print(f"not current: {', '.join(stale)} (run python scripts/generate_functions.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
