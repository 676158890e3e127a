"""How qsa_jax's launches reach XLA (docs/api.md, "Calling from jax.jit"): the CPU-checkable parts.

The lowering choice (the version table, the environment variable, the context
variable) with versions given to it; the call-proto slimming against a proto
built by hand; the lowering itself where jax-triton and jaxlib's CUDA plugin
import (scripts/check_jax_lowering.py).  The GPU side (every lowering bitwise
equal, donation, the step inside a command buffer) is in tests/test_step.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import qsa_jax
from qsa_jax import _triton_call
from qsa_kernels import runtime


@pytest.mark.skipif(not runtime.INTERPRETED, reason="the interpreter's answer")
def test_interpreted_process_reports_the_interpreter_and_no_lowering():
    assert qsa_jax.triton_lowering() == "interpreter"
    assert not any(qsa_jax.triton_lowering_available(name) for name in _triton_call.LOWERINGS)
    with qsa_jax.use_triton_lowering("legacy"):  # accepted, no effect without a CUDA device
        assert qsa_jax.triton_lowering() == "interpreter"


def test_unknown_lowering_names_are_refused():
    with pytest.raises(ValueError, match="lowering must be one of 'auto', 'ffi', 'legacy', 'jax-triton', got 'fast'"):
        with qsa_jax.use_triton_lowering("fast"):
            pass
    with pytest.raises(ValueError, match="got 'FFI'"):
        qsa_jax.triton_lowering_available("FFI")


def test_environment_variable_is_checked_with_a_clear_message():
    code = "import qsa_jax\ntry:\n    qsa_jax.triton_lowering()\nexcept ValueError as e:\n    print(e)\n"
    env = dict(os.environ, QSA_JAX_LOWERING="fastest")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "QSA_JAX_LOWERING must be one of 'auto', 'ffi', 'legacy', 'jax-triton', got 'fastest'" in out.stdout, out


def test_environment_variable_sets_the_default_of_every_context():
    """Read at import: the context variable's default, so new threads start from it too."""
    code = ("import threading, qsa_jax\nfrom qsa_jax import _triton_call\nseen = []\n"
            "t = threading.Thread(target=lambda: seen.append(_triton_call._requested.get()))\nt.start(); t.join()\n"
            "print(_triton_call._requested.get(), seen[0])\n")
    env = dict(os.environ, QSA_JAX_LOWERING=" JAX-Triton ")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["jax-triton", "jax-triton"], out


# --------------------------------------------------------------------------
# The version table's decisions (qsa_jax._triton_call.VERIFIED), with versions given
# --------------------------------------------------------------------------

@pytest.mark.parametrize("requested, jax_triton, jaxlib, ffi, expected", [
    ("auto", "0.3.1", "0.11.2", True, "ffi"),  # the H200 image
    ("auto", "0.3.1", "0.11.2", False, "legacy"),  # no FFI handler registered: the package's legacy call
    ("auto", "0.3.1", "0.12.0.1", True, "ffi"),
    ("auto", "0.4.0", "0.12.0", True, "ffi"),
    ("auto", "0.4.1", "0.12.0.1", True, "ffi"),
    ("auto", "0.4.1+local", "0.12.0.1", True, "ffi"),  # a local label is the same release
    ("auto", "0.4.2", "0.12.0.1", True, "jax-triton"),  # a newer jax-triton: its own lowering
    ("auto", "0.3.0", "0.11.2", True, "jax-triton"),  # an older one
    ("auto", "0.4.1rc1", "0.12.0.1", True, "jax-triton"),  # a pre-release is not the release
    ("auto", "0.4.1", "0.12.1", True, "jax-triton"),  # a newer jaxlib
    ("auto", "0.4.1", "0.11.1", True, "jax-triton"),  # an older one
    ("auto", None, "0.11.2", True, "jax-triton"),  # jax-triton not installed
    ("jax-triton", "0.3.1", "0.11.2", True, "jax-triton"),  # the fallback, forced
    ("legacy", "0.4.1", "0.12.0.1", True, "legacy"),
    ("legacy", "0.4.2", "0.12.1", False, "legacy"),  # the private path, forced outside the table
    ("ffi", "0.4.2", "0.12.0.1", True, "ffi"),
])
def test_version_table_decides_the_lowering(requested, jax_triton, jaxlib, ffi, expected):
    assert _triton_call._choose(requested, jax_triton, jaxlib, ffi) == expected


def test_ffi_without_the_handler_is_refused_whatever_the_versions():
    for jax_triton in ("0.3.1", "0.4.9"):
        with pytest.raises(RuntimeError, match="the ffi lowering needs jaxlib's triton_kernel_call_ffi handler"):
            _triton_call._choose("ffi", jax_triton, "0.11.2", False)


def test_version_table_rows_are_well_formed_and_match_the_extra():
    """Each row a real range with where it was checked; the jax-gpu extra's floors are the table's oldest."""
    import tomllib

    from packaging.requirements import Requirement

    rows = _triton_call.VERIFIED
    assert {row.package for row in rows} == {"jax-triton", "jaxlib"}
    for row in rows:
        assert _triton_call._release(row.first) <= _triton_call._release(row.last), row
        assert row.where.startswith(("GPU", "CPU")) and row.uses, row
    extra = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["jax-gpu"]
    specs = {r.name: r.specifier for r in map(Requirement, extra)}
    oldest = {p: min((_triton_call._release(r.first), r.first) for r in rows if r.package == p)[1]
              for p in ("jax-triton", "jaxlib")}
    assert {s.version for s in specs["jax-triton"] if s.operator == ">="} == {oldest["jax-triton"]}
    assert {s.version for s in specs["jax"] if s.operator == ">="} == {oldest["jaxlib"]}  # jax pins its jaxlib floor
    for row in rows:  # the extra admits every verified release
        package = "jax" if row.package == "jaxlib" else row.package
        assert specs[package].contains(row.first) and specs[package].contains(row.last), (row, specs[package])


@pytest.fixture
def compiled(monkeypatch):
    """A compiled process as far as the lowering choice goes (versions set by the test; no device call)."""
    monkeypatch.setattr(runtime, "INTERPRETED", False)

    def given(jax_triton, jaxlib, ffi=True):
        monkeypatch.setattr(_triton_call, "_versions", lambda: (jax_triton, jaxlib))
        monkeypatch.setattr(_triton_call, "_ffi_registered", lambda: ffi)
        monkeypatch.setattr(_triton_call, "_warned", set())

    return given


def test_verified_versions_take_the_packages_lowering(compiled):
    compiled("0.4.1", "0.12.0.1")
    assert qsa_jax.triton_lowering() == "ffi"
    assert all(qsa_jax.triton_lowering_available(name) for name in _triton_call.LOWERINGS)
    assert _triton_call.lowering_reason().startswith("ffi: auto, and jaxlib 0.12.0.1 registers")
    compiled("0.3.1", "0.11.2", ffi=False)
    assert qsa_jax.triton_lowering() == "legacy" and not qsa_jax.triton_lowering_available("ffi")
    with pytest.raises(RuntimeError, match="needs jaxlib's triton_kernel_call_ffi handler"):
        with qsa_jax.use_triton_lowering("ffi"):  # refused at entry
            pass


def test_unverified_versions_fall_back_to_jax_tritons_lowering(compiled):
    compiled("0.4.2", "0.12.0.1")  # say a jax-triton released after the table
    assert qsa_jax.triton_lowering() == "jax-triton"
    assert qsa_jax.triton_lowering_available("jax-triton") and qsa_jax.triton_lowering_available("auto")
    assert not qsa_jax.triton_lowering_available("ffi") and not qsa_jax.triton_lowering_available("legacy")
    assert "jax-triton 0.4.2 with jaxlib 0.12.0.1 is not among the versions" in _triton_call.lowering_reason()
    with pytest.warns(RuntimeWarning, match="the 'legacy' lowering was asked for, but jax-triton 0.4.2"):
        with qsa_jax.use_triton_lowering("legacy"):  # forcing the private path: used, with a warning
            assert qsa_jax.triton_lowering() == "legacy"
    assert qsa_jax.triton_lowering() == "jax-triton"


def test_the_choice_is_per_thread_and_nested_blocks_restore_it(compiled):
    """A context variable: a block in one thread is invisible to another; nested blocks unwind in order."""
    import threading

    compiled("0.3.1", "0.11.2")
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def other():
        with qsa_jax.use_triton_lowering("jax-triton"):
            seen["other, in its block"] = qsa_jax.triton_lowering()
            inside.set()
            release.wait(30)
        seen["other, after"] = qsa_jax.triton_lowering()

    with qsa_jax.use_triton_lowering("legacy"):
        thread = threading.Thread(target=other)
        thread.start()
        assert inside.wait(30)
        assert qsa_jax.triton_lowering() == "legacy"  # the other thread's block does not leak here
        with qsa_jax.use_triton_lowering("ffi"):
            assert qsa_jax.triton_lowering() == "ffi"
        assert qsa_jax.triton_lowering() == "legacy"
        release.set()
        thread.join(30)
    assert qsa_jax.triton_lowering() == "ffi"  # auto
    assert seen == {"other, in its block": "jax-triton", "other, after": "ffi"}


def test_use_triton_lowering_restores_the_previous_choice_even_on_error():
    before = _triton_call._requested.get()
    with pytest.raises(RuntimeError, match="inside"):
        with qsa_jax.use_triton_lowering("legacy"):
            assert _triton_call._requested.get() == "legacy"
            raise RuntimeError("inside")
    assert _triton_call._requested.get() == before


def _cuda_plugin() -> str | None:
    """Why the CUDA lowering cannot be checked here, or None."""
    code = "import jax_triton, jaxlib.gpu_triton as g; assert hasattr(g, 'TritonKernel')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return None if out.returncode == 0 else "jax-triton and jaxlib's CUDA plugin are not both importable here"


def test_every_lowering_lowers_for_cuda_without_a_gpu():
    """scripts/check_jax_lowering.py: real jax-triton and CUDA plugin, StableHLO for CUDA, decoded."""
    why = _cuda_plugin()
    if why:
        pytest.skip(why)
    script = Path(__file__).parent.parent / "scripts" / "check_jax_lowering.py"
    out = subprocess.run([sys.executable, str(script), "--functions", "rope,topk"], capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert out.returncode == 0 and "all checks passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def _field(number: int, payload: bytes) -> bytes:
    return _triton_call._varint(number << 3 | 2) + _triton_call._varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    return _triton_call._varint(number << 3) + _triton_call._varint(value)


def test_slim_call_proto_drops_only_the_kernels_ttir():
    """Built by hand from jaxlib/gpu/triton.proto: TritonAnyKernelCall{kernel_call(1){kernel(1)
    {name 1, num_warps 2, shared 3, ptx 4, ttir 5, cc 6}, grid 2-4, parameters 5}, metadata 3, name 4}."""
    ptx = b".version 8.4\n" + b"x" * 300  # > 127 bytes: multi-byte lengths
    kernel = lambda ttir: (_field(1, b"rope_cache_kernel") + _varint_field(2, 8) + _varint_field(3, 70000)  # noqa: E731
                           + _field(4, ptx) + (_field(5, ttir) if ttir else b"") + _varint_field(6, 90))
    params = b"".join(_field(5, _field(1, _varint_field(2, 16))) for _ in range(3))
    call = lambda ttir: _field(1, kernel(ttir)) + _varint_field(2, 132) + _varint_field(3, 1) + params  # noqa: E731
    whole = lambda ttir: _field(1, call(ttir)) + _field(3, b"meta") + _field(4, b"qsa:rope_cache_kernel")  # noqa: E731
    slim = _triton_call._slim_call_proto(zlib.compress(whole(b"module { tt.func ... }" * 40)))
    assert zlib.decompress(slim) == whole(None)
    # the same proto without TTIR passes through unchanged (but for compression)
    assert zlib.decompress(_triton_call._slim_call_proto(zlib.compress(whole(None)))) == whole(None)
