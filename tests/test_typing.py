"""The public annotations accept the documents' examples: mypy over them and a typed user's code.

Every ```python block of README.md and docs/*.md (those tests/test_readme.py
runs, and docs/scaling-out.md's, which tests/test_sharding.py runs) is written
to a file of its own, and mypy checks them together with tests/typed_user.py
(annotated code whose ``assert_type`` and ``# type: ignore`` lines pin what
the annotations must give and reject).  mypy sees the packages this process
imports (a checkout or an installation) through MYPYPATH, as an installed
package looks to a user: their own modules are analysed but not reported
(``--follow-imports=silent``).  Function bodies are checked even without
annotations (``--check-untyped-defs``: the examples' functions have none).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_readme import FENCE, ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks() -> dict[str, str]:
    """``{file name: code}``, one per python block, named after its document and first line."""
    blocks = {}
    for document in DOCUMENTS:
        text = document.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            stem = re.sub(r"\W", "_", document.stem)  # a module name: scaling-out -> scaling_out
            blocks[f"{stem}_{line}.py"] = match.group(1)
    return blocks


def _package_dirs() -> dict[str, str]:
    import qsa_jax
    import qsa_kernels
    import qsa_torch

    return {m.__name__: os.path.dirname(m.__file__) for m in (qsa_kernels, qsa_torch, qsa_jax)}


def test_documents_and_typed_user_pass_mypy(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra (pip install -e '.[test]')")
    blocks = _blocks()
    assert sum(name.startswith("README_") for name in blocks) >= 2, sorted(blocks)
    assert sum(name.startswith("api_") for name in blocks) >= 3, sorted(blocks)
    packages, checked = tmp_path / "packages", tmp_path / "checked"
    packages.mkdir()
    checked.mkdir()
    for name, directory in _package_dirs().items():  # qsa_kernels lives in kernels/: names as imported
        (packages / name).symlink_to(directory, target_is_directory=True)
    for name, code in blocks.items():
        (checked / name).write_text(code)
    shutil.copy(ROOT / "tests" / "typed_user.py", checked / "typed_user.py")
    files = sorted(str(p) for p in checked.glob("*.py"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYPY")}
    env["MYPYPATH"] = str(packages)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", os.devnull, "--cache-dir", str(tmp_path / "cache"),
         "--follow-imports=silent", "--check-untyped-defs", "--warn-unused-ignores", "--no-color-output",
         *files],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"mypy:\n{result.stdout}\n{result.stderr}"
    assert f"no issues found in {len(files)} source files" in result.stdout, result.stdout
