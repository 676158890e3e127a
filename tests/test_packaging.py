"""The distribution: what the wheel and the sdist hold, its metadata, what its installs resolve to, and
the import graph of the packages.

The wheel is built from a copy of the project's files (so the checkout gets no
build/ or egg-info), with ``pip wheel --no-deps``.  Without build isolation
when this environment's setuptools can build it (>= 77 reads the SPDX license;
torch requires it, so test environments have it), else in an isolated build
environment, which needs the package index.  The resolution tests (the end
of this file) need PyPI and skip, saying so, where it cannot be reached.
"""

from __future__ import annotations

import ast
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
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
    assert needs("torch") == {"torch>=2.10"}  # 2.9.x pins triton 3.5.1 (test_below_the_torch_floor...)
    assert needs("jax") == {"jax>=0.8.2", "ml_dtypes"}  # no torch: from PyPI a CUDA build (the README says which)
    # no torch on the GPU path; the ranges are qsa_jax._lowering.VERIFIED's (tests/test_jax_lowering.py)
    assert needs("jax-gpu") == {"jax<0.13,>=0.11.2", "ml_dtypes", "jax-triton<=0.4.1,>=0.3.1"}
    assert needs("gpu") == {"qsa-kernels[jax-gpu,torch]"}
    assert needs("test") == {"qsa-kernels[jax,torch]", "pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "mypy>=1.10",
                             "transformers<5,>=4.51"}  # examples/transformers_model.py


def test_wheel_installs_the_info_command(wheel):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt"))
        entry_points = archive.read(name).decode()
    assert "[console_scripts]" in entry_points and "qsa-info = qsa_kernels.info:main" in entry_points
    # the adapters the report imports, so that they register their lines (the kernels name none)
    assert "[qsa_kernels.reporters]" in entry_points and "qsa_torch = qsa_torch" in entry_points \
        and "qsa_jax = qsa_jax" in entry_points


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


# --------------------------------------------------------------------------
# The sdist: the repository's tracked files, so its tests find what they read
# --------------------------------------------------------------------------

def test_sdist_holds_every_tracked_file(tmp_path):
    """The tests read docs/, examples/, benchmarks/, scripts/ and .ci/: MANIFEST.in grafts them all."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    if not _setuptools_can_build():
        pytest.skip("this environment's setuptools is older than 77 (it cannot read the SPDX license)")
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True,
                            check=True).stdout
    tracked = {name for name in listed.split("\0") if name and (ROOT / name).is_file()}
    source = tmp_path / "source"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    out = tmp_path / "sdist"
    result = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"],
        cwd=source, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    import tarfile

    with tarfile.open(out / result.stdout.split()[-1]) as archive:  # qsa_kernels-<version>/<path>
        names = {m.name.split("/", 1)[1] for m in archive.getmembers() if m.isfile()}
    generated = {"PKG-INFO", "setup.cfg"} | {n for n in names if n.startswith("qsa_kernels.egg-info/")}
    missing = tracked - {".gitignore"} - names
    assert not missing, f"tracked but not in the sdist (MANIFEST.in): {sorted(missing)}"
    extra = names - tracked - generated
    assert not extra, f"in the sdist but not tracked: {sorted(extra)}"


# --------------------------------------------------------------------------
# A JAX-only environment: the CPU path names the torch it needs
# --------------------------------------------------------------------------

def test_jax_cpu_path_without_torch_names_the_cpu_wheel():
    from qsa_kernels import runtime

    if not runtime.INTERPRETED:
        pytest.skip("a compiled process: qsa_jax launches through jax-triton, without torch")
    from qsa_jax._binding import CPU_TORCH

    assert CPU_TORCH in (ROOT / "README.md").read_text()  # the README's install table says the same
    code = """
import sys
sys.modules["torch"] = None  # as where torch is not installed
import jax, jax.numpy as jnp, qsa_jax
try:
    jax.jit(lambda x, n: qsa_jax.topk_blocks(x, n, 2))(jnp.ones((2, 8), jnp.float32), jnp.array([8, 3], jnp.int32))
except ModuleNotFoundError as error:
    print(error.name, "|", error)
else:
    raise AssertionError("no error without torch")
"""
    from .test_readme import _package_path

    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=_package_path()),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    name, message = result.stdout.strip().split(" | ", 1)
    assert name == "torch" and message.startswith("topk_blocks: ") and CPU_TORCH in message, result.stdout


# --------------------------------------------------------------------------
# Resolution against the public registry: the installs scripts/setup.sh
# performs, and each extra at its floors
#
# Dry runs (``pip install --dry-run --report``) read only the candidates'
# metadata: PyPI's metadata files (PEP 658), or where an index (a mirror)
# lists none, the METADATA inside each wheel through HTTP range requests
# (``--use-feature=fast-deps``): no wheel is downloaded.  This
# machine's own pip configuration (find-links with local wheels, extra
# indexes, constraints) is dropped: PIP_CONFIG_FILE=os.devnull skips every
# configuration file, and only the PIP_* variables about reaching a network
# are kept.  All the resolutions start together and each test waits for its
# own: together they take about as long as the slowest.
# --------------------------------------------------------------------------

PYPI = "https://pypi.org/simple"
NETWORK_SETTINGS = ("PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT",
                    "PIP_RETRIES", "PIP_TIMEOUT")
NETWORK_ERRORS = re.compile(r"Could not fetch URL|NewConnectionError|ConnectionError|SSLError|Read timed out|"
                            r"Max retries exceeded|Temporary failure in name resolution")
#: The newest torch below the floor: every 2.9.x pins triton 3.5.1.
BELOW_TORCH_FLOOR = "2.9.1"


def _setup_script() -> dict[str, str]:
    """What scripts/setup.sh and .ci/run install by default (read from them, so the tests follow them)."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    found = {
        "torch": re.search(r'^TORCH=\$\{QSA_TORCH:-([^}]+)\}$', setup, re.M),
        "triton": re.search(r'^TRITON=\$\{QSA_TRITON:-([^}]+)\}$', setup, re.M),
        "newest triton": re.search(r'QSA_TRITON="([^"]+)" bash scripts/test\.sh', ci),
    }
    assert all(found.values()), found
    # The second install, as the dry runs below repeat it (with this project's wheel for ".[test]").
    assert '-m pip install -q -c scripts/constraints-cpu.txt -e ".[test]" "$triton" packaging' in setup
    return {name: match.group(1) for name, match in found.items()}


def _floors() -> dict[str, str]:
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    floors = {}
    for extra, name, key in (("torch", "torch", "torch"), ("jax", "jax", "jax"), ("jax-gpu", "jax", "jax-gpu"),
                             ("jax-gpu", "jax-triton", "jax-triton")):
        (spec,) = [s for r in map(Requirement, extras[extra]) if r.name == name for s in r.specifier
                   if s.operator == ">="]
        floors[key] = spec.version
    return floors


def _triton_range():
    import tomllib

    from packaging.requirements import Requirement

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r.specifier for r in map(Requirement, dependencies) if r.name == "triton")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _Resolution:
    """One dry run, started at once; :meth:`result` waits for it."""

    def __init__(self, name: str, arguments: list[str], report: Path, python: str | None):
        # python: another environment's interpreter, or "3.12" for a fresh environment of that Python
        # (wheels only: jax >= 0.11, the jax-gpu extra's floor, needs Python >= 3.12)
        version = ["--python-version", python, "--only-binary=:all:"] if python and "/" not in python else []
        command = [sys.executable, "-m", "pip"] + (["--python", python] if python and not version else []) + [
            "install", "--dry-run", "--no-cache-dir", "--index-url", PYPI, "--report", str(report),
            "--use-feature=fast-deps",  # no metadata file on the index: range requests, not whole wheels
            *(["--ignore-installed"] if python is None or version else []), *version, *arguments]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in NETWORK_SETTINGS}
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
        self.name, self.command, self.report = name, command, report
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._done = None

    def result(self):
        """``(returncode, output, {name: version}, {name: requires_dist})``; skips on network errors."""
        if self._done is None:
            try:
                stderr, _ = self.process.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                self.process.kill()
                raise AssertionError(f"{self.name}: no resolution within 600 s: {' '.join(self.command)}")
            versions, requires = {}, {}
            if self.process.returncode == 0:
                for item in json.loads(self.report.read_text())["install"]:
                    name = _canonical(item["metadata"]["name"])
                    versions[name] = item["metadata"]["version"]
                    requires[name] = item["metadata"].get("requires_dist", [])
            self._done = (self.process.returncode, stderr, versions, requires)
        returncode, stderr = self._done[:2]
        if returncode != 0 and NETWORK_ERRORS.search(stderr):
            pytest.skip(f"PyPI stopped answering during the dry run: {stderr.strip().splitlines()[-1]}")
        if returncode != 0 and "fast-deps" in stderr and "invalid choice" in stderr:
            pytest.skip("this pip has no --use-feature=fast-deps: on an index without metadata files a dry run "
                        "would download whole wheels (several GB for a CUDA torch)")
        return self._done


def _pypi_reachable() -> str | None:
    """Why the resolutions cannot run here, or None."""
    import urllib.request

    try:
        urllib.request.urlopen(f"{PYPI}/pip/", timeout=10).close()
    except Exception as error:
        return f"PyPI ({PYPI}) is unreachable ({type(error).__name__}: {error}): the resolution tests need it"
    from packaging.version import Version

    pip_version = metadata.version("pip")
    if Version(pip_version) < Version("23.0"):
        return f"pip {pip_version} is too old for these dry runs (--dry-run --report and --python: pip >= 23.0)"
    return None


def _cpu_torch_environment(path: Path) -> str | None:
    """A fresh venv holding only this environment's torch's metadata, as after setup.sh's first install
    from PyTorch's CPU index; ``None`` when this environment's torch is not the CPU build."""
    try:
        torch = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    if "+cpu" not in torch.version or any(r.startswith("triton") for r in torch.requires or []):
        return None
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    purelib = subprocess.run([str(path / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    for file in torch.files or []:  # the .dist-info directory only: metadata, no code
        if file.parts[0].endswith(".dist-info"):
            target = Path(purelib) / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(file.locate(), target)
    return str(path / "bin" / "python")


@pytest.fixture(scope="module")
def resolutions(wheel, tmp_path_factory):
    why = _pypi_reachable()
    if why:
        pytest.skip(why)
    defaults, floors = _setup_script(), _floors()
    constraints = ["-c", str(ROOT / "scripts" / "constraints-cpu.txt")]
    project = str(wheel)  # the project's metadata, as `-e ".[test]"` reads it
    work = tmp_path_factory.mktemp("resolutions")
    cpu_python = _cpu_torch_environment(work / "cpu-torch")
    cases = {  # name: (arguments, python: None = a fresh environment)
        "setup, PyPI only": ([defaults["torch"], f"{project}[test]", "packaging", *constraints], None),
        "torch extra at its floor": ([f"{project}[torch]", f"torch=={floors['torch']}"], None),
        "below the torch floor": ([project, f"torch=={BELOW_TORCH_FLOOR}"], None),
        "jax extra at its floor": ([f"{project}[jax]", f"jax=={floors['jax']}"], None),
        "jax-gpu extra at its floors": ([f"{project}[jax-gpu]", f"jax=={floors['jax-gpu']}",
                                         f"jax-triton=={floors['jax-triton']}", "triton==3.6.0"], "3.12"),
        "jax-gpu extra, newest": ([f"{project}[jax-gpu]"], "3.12"),
        "gpu extra at its floors": ([f"{project}[gpu]", f"torch=={floors['torch']}", f"jax=={floors['jax-gpu']}"],
                                    "3.12"),
        "test extra at its floors": ([f"{project}[test]", f"torch=={floors['torch']}", f"jax=={floors['jax']}"],
                                     None),
    }
    if cpu_python:
        for case, triton in (("setup, CPU torch", defaults["triton"]), ("CI, CPU torch, newest triton",
                                                                         defaults["newest triton"])):
            cases[case] = ([f"{project}[test]", triton, "packaging", *constraints], cpu_python)
    started = {name: _Resolution(name, arguments, work / f"{index}.json", python)
               for index, (name, (arguments, python)) in enumerate(cases.items())}
    yield started, defaults, floors
    for resolution in started.values():  # only what this fixture started, and only if still running
        if resolution.process.poll() is None:
            resolution.process.kill()
            resolution.process.wait()


def _resolved(resolutions, name: str):
    started = resolutions[0]
    if name not in started:
        pytest.skip("this environment's torch is not PyTorch's CPU build: the CPU-index setup cannot be repeated")
    returncode, stderr, versions, requires = started[name].result()
    assert returncode == 0, f"{name}: {' '.join(started[name].command)}\n{stderr}"
    return versions, requires


def _triton_pin(requires: list[str]):
    """The triton requirement of torch's Requires-Dist that applies here (a CUDA build's pin), or None."""
    from packaging.requirements import Requirement

    pins = [r for r in map(Requirement, requires) if r.name == "triton"
            and (r.marker is None or r.marker.evaluate({"extra": ""}))]
    return pins[0].specifier if pins else None


def test_setup_on_a_machine_reaching_only_pypi_resolves(resolutions):
    """PyPI's torch (a CUDA build on Linux x86-64) pins its own triton: setup.sh takes that one, in range."""
    defaults = resolutions[1]
    versions, requires = _resolved(resolutions, "setup, PyPI only")
    from packaging.requirements import Requirement

    assert Requirement(defaults["torch"]).specifier.contains(versions["torch"])
    pin = _triton_pin(requires["torch"])
    if pin is not None:  # what setup.sh installs instead of QSA_TRITON
        assert pin.contains(versions["triton"])
    assert _triton_range().contains(versions["triton"]), versions["triton"]
    from packaging.version import Version

    assert Version(versions["numpy"]) < Version("2.4")  # scripts/constraints-cpu.txt


@pytest.mark.parametrize("case, default", [("setup, CPU torch", "triton"),
                                           ("CI, CPU torch, newest triton", "newest triton")])
def test_setup_after_the_cpu_torch_resolves(resolutions, case, default):
    """After the CPU wheel (no triton pin): the test extra, the requested triton and the NumPy constraint."""
    versions, _ = _resolved(resolutions, case)
    from packaging.requirements import Requirement
    from packaging.version import Version

    assert "torch" not in versions  # the installed CPU torch satisfies the extras: kept
    assert Requirement(resolutions[1][default]).specifier.contains(versions["triton"])
    assert Version(versions["numpy"]) < Version("2.4")  # scripts/constraints-cpu.txt
    assert {"qsa-kernels", "jax", "pytest", "hypothesis", "mypy"} <= set(versions)


def test_each_extra_resolves_at_its_floors(resolutions):
    from packaging.version import Version

    floors = resolutions[2]
    versions, requires = _resolved(resolutions, "torch extra at its floor")
    assert Version(versions["torch"]) == Version(floors["torch"])
    assert _triton_range().contains(versions["triton"])
    for case, floor in (("jax extra at its floor", "jax"), ("jax-gpu extra at its floors", "jax-gpu")):
        versions, _ = _resolved(resolutions, case)
        assert Version(versions["jax"]) == Version(floors[floor]), case
        cuda = sorted(n for n in versions if n == "torch" or n.startswith(("nvidia-", "cuda-")))
        assert not cuda, f"{case} pulls {cuda}"  # no surprise CUDA torch
    assert versions["jax-triton"] == floors["jax-triton"]
    for case, floor in (("gpu extra at its floors", "jax-gpu"), ("test extra at its floors", "jax")):
        versions, _ = _resolved(resolutions, case)
        assert Version(versions["torch"]) == Version(floors["torch"]), case
        assert Version(versions["jax"]) == Version(floors[floor]), case
    # torch 2.10 pins triton 3.6.0, which jax-triton 0.4 (triton >= 3.7) refuses: pip takes 0.3.1
    assert versions.get("jax-triton") is None or versions["jax-triton"] == floors["jax-triton"]


def test_jax_gpu_extra_resolves_to_the_newest_admitted_releases(resolutions):
    """Nothing else in the way: the newest jax-triton the extra admits (its upper bound, the newest
    verified) and a jax in range, with a triton of the supported range."""
    import tomllib

    from packaging.requirements import Requirement

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["jax-gpu"]
    specs = {r.name: r.specifier for r in map(Requirement, extra)}
    versions, _ = _resolved(resolutions, "jax-gpu extra, newest")
    (newest,) = [s.version for s in specs["jax-triton"] if s.operator == "<="]
    assert versions["jax-triton"] == newest
    assert specs["jax"].contains(versions["jax"]) and _triton_range().contains(versions["triton"]), versions


def test_below_the_torch_floor_is_impossible(resolutions):
    """Why the floor is what it is: the newest torch below it pins a triton outside the supported range."""
    from packaging.version import Version

    assert Version(BELOW_TORCH_FLOOR) < Version(resolutions[2]["torch"])
    returncode, stderr, _, _ = resolutions[0]["below the torch floor"].result()
    assert returncode != 0 and "ResolutionImpossible" in stderr, stderr
    causes = stderr[stderr.index("The conflict is caused by"):]
    assert re.search(rf"torch {re.escape(BELOW_TORCH_FLOOR)} depends on triton==3\.5", causes), causes
