"""The adapters' structure: a binding on public APIs, an accelerator behind one hook, no circle.

* The binding's modules import no private name of torch, Triton, JAX or
  jax-triton (an AST scan: no module path or imported name with a leading
  underscore from those packages) and never import their accelerator.
* The accelerator is reached only through the hook: the one module that
  imports it is the adapter's ``__init__`` (which plugs it in).
* ``qsa_kernels`` imports no adapter, by name or by string.
* The generated types of the public functions, kernels/functions.py, are current (scripts/generate_functions.py).
* ``QSA_ACCELERATE=0``: no accelerator module is imported, and the binding alone answers.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("torch", "triton", "jax", "jaxlib", "jax_triton")
ACCELERATORS = {"qsa_torch": "_accel", "qsa_jax": "_lowering"}
#: Public names whose spelling has an underscore in it (torch's documented APIs for custom ops).
PUBLIC_EXCEPTIONS = {"torch._check", "torch._dynamo.mark_dynamic"}


def _binding_modules(package: str) -> list[Path]:
    accelerator = ACCELERATORS[package]
    return sorted(path for path in (ROOT / package).rglob("*.py") if accelerator not in path.parts)


def _private_uses(path: Path) -> list[str]:
    """Private names of the frameworks that ``path`` imports or reads as attributes of them."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    aliases = {}  # local name -> module path, for attribute chains (torch._C...)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in FRAMEWORKS:
                    aliases[alias.asname or root] = alias.name if alias.asname else root
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            root = node.module.split(".")[0]
            if root in FRAMEWORKS:
                parts = node.module.split(".")
                for alias in node.names:
                    if any(p.startswith("_") for p in parts) or alias.name.startswith("_"):
                        found.append(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):  # torch._C.x, jax._src...: attribute chains from a framework module
        if isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                dotted = ".".join([aliases[value.id], *reversed(chain)])
                if any(part.startswith("_") and not part.startswith("__") for part in dotted.split(".")[1:]):
                    if not any(dotted.startswith(ok) for ok in PUBLIC_EXCEPTIONS):
                        found.append(dotted)
    return sorted(set(found))


@pytest.mark.parametrize("package", sorted(ACCELERATORS))
def test_the_binding_uses_no_private_name_of_the_frameworks(package):
    offenders = {str(path.relative_to(ROOT)): uses for path in _binding_modules(package)
                 if (uses := _private_uses(path))}
    assert not offenders, offenders


def test_the_scan_finds_private_names():
    """The scan itself: it must flag what the accelerators use."""
    assert "torch._C._AutoDispatchBelowADInplaceOrView" in _private_uses(ROOT / "qsa_torch/_accel/_ops.py")
    assert any(use.startswith("triton.runtime.jit") or "knobs" in use or "_" in use
               for use in _private_uses(ROOT / "qsa_torch/_accel/_fast_launch.py"))


def _imports(path: Path) -> set[str]:
    """Every module path ``path`` imports from, and each name it imports under it (``a.b``, ``a.b.c``)."""
    names = set()
    for base, imported in _import_statements(path):
        names.add(base)
        names.update(f"{base}.{name}" for name in imported)
    return names


def _import_statements(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` per import of ``path``, relative imports resolved (``import a.b``: ``(a.b, ())``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.append((base, tuple(alias.name for alias in node.names)))
    return found


@pytest.mark.parametrize("package", sorted(ACCELERATORS))
def test_the_accelerator_is_reached_only_through_the_hook(package):
    """Only the adapter's __init__ imports its accelerator (to plug it in); the binding never does."""
    accelerator = f"{package}.{ACCELERATORS[package]}"
    importers = [str(path.relative_to(ROOT)) for path in _binding_modules(package)
                 if any(name == accelerator or name.startswith(accelerator + ".") for name in _imports(path))]
    assert importers == [f"{package}/__init__.py"], importers


def test_the_kernels_import_no_adapter():
    """By an import statement or by a string handed to importlib (the report finds the adapters through
    entry points, which name them in pyproject.toml, not in the kernels)."""
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        assert not any(name.split(".")[0] in ACCELERATORS for name in _imports(path)), path
        strings = [node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)
                   and isinstance(node.value, str) and node.value.split(".")[0] in ACCELERATORS]
        assert not strings, (path, strings)


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports (``from . import x``: the module x)."""
    found = set()
    for base, imported in _import_statements(path):
        found.update([base] if not imported else
                     (f"{base}.{name}" if f"{base}.{name}" in modules else base for name in imported))
    return found & modules


def test_no_import_circle_in_the_adapters():
    """Each adapter's modules import one way (farm-studio look draws the same graph)."""
    for package in ACCELERATORS:
        paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
                 for p in (ROOT / package).rglob("*.py")}
        graph = {module: _module_imports(path, set(paths)) - {module} for module, path in paths.items()}
        for module in graph:  # a submodule importing its own package reads a name the package already has
            graph[module] = {d for d in graph[module] if not module.startswith(d + ".")}
        seen, stack = set(), []

        def visit(module):
            if module in stack:
                raise AssertionError(f"import circle: {' -> '.join(stack[stack.index(module):] + [module])}")
            if module in seen:
                return
            stack.append(module)
            for dependency in sorted(graph[module]):
                visit(dependency)
            stack.pop()
            seen.add(module)

        for module in sorted(graph):
            visit(module)


def test_the_generated_functions_are_current():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate_functions.py"), "--check"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_without_the_accelerator_nothing_of_it_is_imported():
    code = ("import sys, qsa_torch, qsa_jax, torch\n"
            "from qsa_torch import _binding as t\nfrom qsa_jax import _binding as j\n"
            "d = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "x = torch.randn(3, 40, device=d)\nv = torch.full((3,), 40, dtype=torch.int32, device=d)\n"
            "print(t.hook is None, j.hook is None, qsa_jax.triton_lowering(),\n"
            "      any(m.startswith(('qsa_torch._accel', 'qsa_jax._lowering')) for m in sys.modules),\n"
            "      qsa_torch.topk_blocks(x, v, 3).tolist() == torch.topk(x, 3).indices.sort().values.tolist())\n")
    env = dict(os.environ, QSA_ACCELERATE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    interpreted = out.stdout.split()[2:3] == ["interpreter"]
    assert out.stdout.split() == ["True", "True", "interpreter" if interpreted else "jax-triton", "False", "True"], \
        out.stdout + out.stderr
