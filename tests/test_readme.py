"""The code examples of README.md and docs/*.md run as written, on this machine's device.

Every ```python block is a complete program: it is run on its own, in a fresh
interpreter (a subprocess with a timeout, in an empty directory, so that it
sees the installed packages or the checkout exactly as a user would), and
must exit cleanly.  Each example carries asserts of its own (shapes, values
against NumPy, torch == JAX); a block without one fails here, so an example
cannot silently stop checking anything.

The examples of docs/scaling-out.md need 2 host devices or 2 processes
(``mp.spawn`` cannot start a worker defined in ``python -c`` code):
``tests/test_sharding.py`` runs them, in the environment they need, and
checks what they shard; they are not run twice.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Documents whose examples another test runs (document name -> that test).
RUN_ELSEWHERE = {"scaling-out.md": "tests/test_sharding.py"}
DOCUMENTS = [ROOT / "README.md", *sorted(d for d in (ROOT / "docs").glob("*.md") if d.name not in RUN_ELSEWHERE)]
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
TIMEOUT_S = 600  # the CPU interpreter on a loaded 2-core machine; each block takes 5-30 s alone


def _blocks():
    for document in DOCUMENTS:
        text = document.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2  # the block's first line of code
            yield pytest.param(document, line, match.group(1), id=f"{document.relative_to(ROOT)}:{line}")


BLOCKS = list(_blocks())


def _package_path() -> str:
    """Where this process found the packages, for the subprocess (a checkout is not installed)."""
    import qsa_jax
    import qsa_kernels
    import qsa_torch

    dirs = [os.path.dirname(os.path.dirname(m.__file__)) for m in (qsa_kernels, qsa_torch, qsa_jax)]
    return os.pathsep.join(dict.fromkeys(dirs + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def test_the_documents_have_examples():
    counts = {d.name: sum(1 for b in BLOCKS if b.values[0] == d) for d in DOCUMENTS}
    assert counts["README.md"] >= 2, counts   # one per framework
    assert counts["api.md"] >= 3, counts      # stage 1 in both frameworks, top-k parity, export


def test_examples_left_out_here_are_run_elsewhere():
    for name, test in RUN_ELSEWHERE.items():
        text = (ROOT / "docs" / name).read_text()
        assert FENCE.search(text), f"docs/{name} has no python example: drop it from RUN_ELSEWHERE"
        assert f'"docs", "{name}"' in (ROOT / test).read_text(), f"{test} no longer reads docs/{name}'s examples"


def test_quick_start_is_two_commands_that_exist():
    text = (ROOT / "README.md").read_text()
    quick = text[text.index("## Quick start"):]
    block = quick[quick.index("```bash\n") + 8:quick.index("```", quick.index("```bash\n") + 8)]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    for command in commands:
        assert (ROOT / command.split()[1]).is_file()


@pytest.mark.parametrize("document, line, code", BLOCKS)
def test_example_runs(document, line, code, tmp_path):
    tree = ast.parse(code, filename=f"{document.name}:{line}")
    assert any(isinstance(node, ast.Assert) for node in ast.walk(tree)), \
        f"{document.name}:{line}: an example must check what it shows (no assert)"
    env = dict(os.environ, PYTHONPATH=_package_path(), PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, (f"{document.name}:{line} failed (exit {result.returncode}):\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
