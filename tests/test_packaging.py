"""The distribution: what the wheel holds, its metadata, and the import graph of the packages.

The wheel is built from a copy of the project's files (so the checkout gets no
build/ or egg-info), with ``pip wheel --no-deps``.  Without build isolation
when this environment's setuptools can build it (>= 77 reads the SPDX license;
torch requires it, so test environments have it), else in an isolated build
environment, which needs the package index.
"""

from __future__ import annotations

import ast
import email.parser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"qsa_kernels": ROOT / "kernels", "qsa_torch": ROOT / "qsa_torch", "qsa_jax": ROOT / "qsa_jax"}


def _source_version() -> str:
    """``__version__`` of kernels/__init__.py, read without importing it."""
    tree = ast.parse((ROOT / "kernels" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            return ast.literal_eval(node.value)
    raise AssertionError("kernels/__init__.py defines no __version__")


def _setuptools_can_build() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE", "NOTICE"):
        shutil.copy(ROOT / name, source / name)
    for name in ("kernels", "qsa_torch", "qsa_jax", "tests"):  # tests/ too: it must stay out of the wheel
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)]
    if _setuptools_can_build():
        command.insert(4, "--no-build-isolation")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        if "--no-build-isolation" not in command and ("No matching distribution" in result.stderr
                                                      or "connection" in result.stderr.lower()):
            pytest.skip("cannot build offline: this environment's setuptools is older than 77 and the "
                        "isolated build environment could not be downloaded")
        raise AssertionError(f"pip wheel failed:\n{result.stdout}\n{result.stderr}")
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def test_wheel_holds_the_three_packages_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names}
    dist_info = f"qsa_kernels-{_source_version()}.dist-info"
    assert top == {"qsa_kernels", "qsa_torch", "qsa_jax", dist_info}, top  # no `kernels`, no `tests`
    for package, directory in PACKAGES.items():
        modules = {f"{package}/{p.relative_to(directory).as_posix()}" for p in _sources(directory)}
        assert modules <= set(names), sorted(modules - set(names))  # subpackages too (pyproject's packages)
        assert f"{package}/py.typed" in names
    assert {f"{dist_info}/licenses/LICENSE", f"{dist_info}/licenses/NOTICE"} <= set(names)
    assert not any("/tests/" in name or name.startswith("tests/") for name in names)


def test_wheel_metadata(wheel):
    import qsa_jax
    import qsa_kernels
    import qsa_torch

    meta = _metadata(wheel)
    assert meta["Name"] == "qsa-kernels"
    assert meta["Version"] == _source_version() == qsa_kernels.__version__ == qsa_torch.__version__ \
        == qsa_jax.__version__
    assert meta["License-Expression"] == "Apache-2.0 AND MIT"
    assert set(meta.get_all("License-File")) == {"LICENSE", "NOTICE"}
    assert meta["Requires-Python"] == ">=3.11"
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert meta["Summary"] and meta["Keywords"] and meta["Author"] and meta["Maintainer"]
    assert set(meta.get_all("Provides-Extra")) == {"torch", "jax", "jax-gpu", "gpu", "test"}

    from packaging.requirements import Requirement  # pytest's own dependency

    def spelled(requirement: Requirement) -> str:
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        return f"{requirement.name}{extras}{','.join(sorted(str(s) for s in requirement.specifier))}"

    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]

    def needs(extra: str | None) -> set[str]:
        """What installing the distribution (with ``extra``) requires, beyond the base requirements."""
        return {spelled(r) for r in requires if (r.marker is None) == (extra is None)
                and (extra is None or r.marker.evaluate({"extra": extra}))}

    assert needs(None) == {"triton<3.10,>=3.6.0", "numpy"}  # neither torch nor jax: qsa_kernels needs neither
    assert needs("torch") == {"torch>=2.9"}
    assert needs("jax") == {"jax>=0.8.2", "ml_dtypes", "torch>=2.9"}  # the CPU path runs on torch tensors
    assert needs("jax-gpu") == {"jax>=0.8.2", "ml_dtypes", "jax-triton==0.3.1"}  # no torch on the GPU path
    assert needs("gpu") == {"qsa-kernels[jax-gpu,torch]"}
    assert needs("test") == {"qsa-kernels[jax,torch]", "pytest>=8", "hypothesis>=6"}


# --------------------------------------------------------------------------
# The import graph: the adapters are siblings, the kernels need neither framework
# --------------------------------------------------------------------------

def _sources(directory: Path) -> list[Path]:
    """The package's Python files, its subpackages' too."""
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(package: str, directory: Path, path: Path) -> str:
    parts = [package, *path.relative_to(directory).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_statements(package: str, directory: Path):
    """``(file, module, names)`` of every import in the package's files, anywhere in them
    (function bodies and ``if TYPE_CHECKING:`` blocks too), relative ones resolved
    (``import m``: names empty; ``from m import n``: names ``(n,)``)."""
    for path in _sources(directory):
        here = _module_name(package, directory, path).split(".")
        if path.name != "__init__.py":
            here = here[:-1]  # the package a relative import starts from
        file = path.relative_to(directory).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield file, alias.name, ()
            elif isinstance(node, ast.ImportFrom):
                base = here[:len(here) - (node.level - 1)] if node.level else []
                yield file, ".".join(filter(None, [*base, node.module])), tuple(a.name for a in node.names)


def _imports(package: str, directory: Path) -> dict[str, set[str]]:
    """Every module each file (by its path in the package) imports: ``m``, and ``m.n`` for ``from m import n``."""
    found = {path.relative_to(directory).as_posix(): set() for path in _sources(directory)}
    for file, module, names in _import_statements(package, directory):
        found[file].add(module)
        found[file].update(f"{module}.{name}" for name in names)
    return found


def _module_graph(package: str, directory: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports: ``from m import n`` imports ``m.n``
    where that is a module (``from . import runtime``), else ``m``."""
    modules = {p.relative_to(directory).as_posix(): _module_name(package, directory, p) for p in _sources(directory)}
    graph = {module: set() for module in modules.values()}
    for file, module, names in _import_statements(package, directory):
        submodules = {f"{module}.{name}" for name in names} & graph.keys()
        targets = submodules | ({module} & graph.keys() if len(submodules) < len(names) or not names else set())
        graph[modules[file]].update(targets - {modules[file]})
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (each once, from its first module in sorted order)."""
    found, done = set(), set()

    def visit(module, path):
        if module in path:
            circle = path[path.index(module):]
            first = circle.index(min(circle))
            found.add(tuple(circle[first:] + circle[:first]))
            return
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return [list(circle) for circle in sorted(found)]


def _crossings(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{package}/{file} imports {name}" for file, names in _imports(package, PACKAGES[package]).items()
            for name in sorted(names) if name.split(".")[0] in forbidden]


def test_import_graph_sees_imports_inside_functions(tmp_path):
    """The scan itself: imports inside function bodies count, relative imports are resolved."""
    (tmp_path / "_launch.py").write_text(
        "from . import _step\nfrom .._x import y\n\ndef run():\n    from qsa_torch import _launch\n"
        "    import torch.nn as nn\n")
    imports = _imports("qsa_jax", tmp_path)["_launch.py"]
    assert {"qsa_jax._step", "qsa_torch", "qsa_torch._launch", "torch.nn"} <= imports
    assert _imports("qsa_jax", PACKAGES["qsa_jax"])["__init__.py"] >= {"qsa_kernels.runtime"}


def test_import_graph_finds_circles(tmp_path):
    """The circle check itself: function-level and TYPE_CHECKING imports close circles; a
    subpackage's relative imports resolve; ``from . import m`` is an edge to ``m``."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("def f():\n    from .sub import b\n")
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from ..c import C\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    (tmp_path / "d.py").write_text("from . import c\n")
    graph = _module_graph("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.d"] == {"pkg.c"}
    assert _cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c"]]


def test_kernels_have_no_import_circle():
    assert _cycles(_module_graph("qsa_kernels", PACKAGES["qsa_kernels"])) == []


def test_no_kernels_module_is_over_650_lines():
    """Modules a reader can hold: split by algorithm past this (docs/design.md, "Layout")."""
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in _sources(PACKAGES["qsa_kernels"])}
    assert {name: n for name, n in lengths.items() if n > 650} == {}


def test_kernels_import_neither_framework_nor_an_adapter():
    assert _crossings("qsa_kernels", ("torch", "jax", "jaxlib", "jax_triton", "qsa_torch", "qsa_jax")) == []


def test_torch_adapter_does_not_import_the_jax_adapter():
    assert _crossings("qsa_torch", ("qsa_jax", "jax", "jaxlib", "jax_triton")) == []


def test_jax_adapter_does_not_import_the_torch_adapter():
    assert _crossings("qsa_jax", ("qsa_torch",)) == []
