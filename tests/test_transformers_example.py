"""examples/transformers_model.py runs and its QSA model matches the unmodified `transformers` model.

The example (docs/integrating.md) replaces a small random Llama's attention
with ``qsa_attention_step`` through transformers' attention interface,
prefills and decodes three requests, and compares the logits of every row
with the unmodified Hugging Face model's in bf16, within the tolerance it
states, with ``token_topk`` covering every context (dense-equivalent).  It
exits non-zero on a mismatch.  It runs here as a user runs it: a fresh
interpreter, by path, from an empty directory (about 40 s of CPU time under
Triton's interpreter).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "transformers_model.py"
TIMEOUT_S = 600  # about a minute alone; a loaded 2-core machine takes several times that


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (the test extra has it: pip install -e '.[test]')")
def test_transformers_example_matches_the_unmodified_model(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    output = f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    assert result.returncode == 0, f"exit {result.returncode}:\n{output}"
    lines = result.stdout.splitlines()
    assert "selection kept every token of every row (dense-equivalent): True" in lines, output
    comparison = [line for line in lines if line.startswith("logits vs the unmodified HF model")]
    assert len(comparison) == 1 and comparison[0].endswith(": match"), output
    assert sum(line.lstrip().startswith("request ") for line in lines) == 3, output  # greedy tokens printed
    assert lines[-1] == "OK", output
