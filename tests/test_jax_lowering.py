"""How qsa_jax's launches reach XLA (docs/api.md, "Calling from jax.jit"): the CPU-checkable parts.

The lowering choice (the version table, the environment variable, the context
variable) with versions given to it; the call-proto slimming against a proto
built by hand; the lowering itself where jax-triton and jaxlib's CUDA plugin
import (scripts/check_jax_lowering.py).  The GPU side (every lowering bitwise
equal, donation, the step inside a command buffer) is in tests/test_step.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import qsa_jax
from qsa_jax import _lowering
from qsa_jax._lowering import _proto
from qsa_kernels import runtime

from .util import needs_accelerator

pytestmark = needs_accelerator  # how the accelerator (qsa_jax._lowering) lowers; the binding's: test_binding.py


@pytest.mark.skipif(not runtime.INTERPRETED, reason="the interpreter's answer")
def test_interpreted_process_reports_the_interpreter_and_no_lowering():
    assert qsa_jax.triton_lowering() == "interpreter"
    assert not any(qsa_jax.triton_lowering_available(name) for name in _lowering.LOWERINGS)
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
    code = ("import threading, qsa_jax\nfrom qsa_jax import _lowering\nseen = []\n"
            "t = threading.Thread(target=lambda: seen.append(_lowering._requested.get()))\nt.start(); t.join()\n"
            "print(_lowering._requested.get(), seen[0])\n")
    env = dict(os.environ, QSA_JAX_LOWERING=" JAX-Triton ")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["jax-triton", "jax-triton"], out


# --------------------------------------------------------------------------
# The version table's decisions (qsa_jax._lowering.VERIFIED), with versions given
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
    assert _lowering._choose(requested, jax_triton, jaxlib, ffi) == expected


def test_ffi_without_the_handler_is_refused_whatever_the_versions():
    for jax_triton in ("0.3.1", "0.4.9"):
        with pytest.raises(RuntimeError, match="the ffi lowering needs jaxlib's triton_kernel_call_ffi handler"):
            _lowering._choose("ffi", jax_triton, "0.11.2", False)


def test_version_table_rows_are_well_formed_and_match_the_extra():
    """Each row a real range with where it was checked; the jax-gpu extra's floors are the table's oldest."""
    import tomllib

    from packaging.requirements import Requirement

    rows = _lowering.VERIFIED
    assert {row.package for row in rows} == {"jax-triton", "jaxlib"}
    for row in rows:
        assert _lowering._release(row.first) <= _lowering._release(row.last), row
        assert row.where.startswith(("GPU", "CPU")) and row.uses, row
    extra = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["jax-gpu"]
    specs = {r.name: r.specifier for r in map(Requirement, extra)}
    oldest = {p: min((_lowering._release(r.first), r.first) for r in rows if r.package == p)[1]
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
        monkeypatch.setattr(_lowering, "_versions", lambda: (jax_triton, jaxlib))
        monkeypatch.setattr(_lowering, "_ffi_registered", lambda: ffi)
        monkeypatch.setattr(_lowering, "_warned", set())

    return given


def test_verified_versions_take_the_packages_lowering(compiled):
    compiled("0.4.1", "0.12.0.1")
    assert qsa_jax.triton_lowering() == "ffi"
    assert all(qsa_jax.triton_lowering_available(name) for name in _lowering.LOWERINGS)
    assert _lowering.lowering_reason().startswith("ffi: auto, and jaxlib 0.12.0.1 registers")
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
    assert "jax-triton 0.4.2 with jaxlib 0.12.0.1 is not among the versions" in _lowering.lowering_reason()
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
    before = _lowering._requested.get()
    with pytest.raises(RuntimeError, match="inside"):
        with qsa_jax.use_triton_lowering("legacy"):
            assert _lowering._requested.get() == "legacy"
            raise RuntimeError("inside")
    assert _lowering._requested.get() == before


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
    return _proto._varint(number << 3 | 2) + _proto._varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    return _proto._varint(number << 3) + _proto._varint(value)


def _call_proto(ptx: bytes, ttir: bytes | None) -> bytes:
    """Built by hand from jaxlib/gpu/triton.proto: TritonAnyKernelCall{kernel_call(1){kernel(1)
    {name 1, num_warps 2, shared 3, ptx 4, ttir 5, cc 6}, grid 2-4, parameters 5}, metadata 3, name 4}."""
    kernel = (_field(1, b"rope_cache_kernel") + _varint_field(2, 8) + _varint_field(3, 70000) + _field(4, ptx)
              + (_field(5, ttir) if ttir else b"") + _varint_field(6, 90))
    params = b"".join(_field(5, _field(1, _varint_field(2, 16))) for _ in range(3))
    call = _field(1, kernel) + _varint_field(2, 132) + _varint_field(3, 1) + params
    return _field(1, call) + _field(3, b"meta") + _field(4, b"qsa:rope_cache_kernel")


PTX = """//
// Generated by LLVM NVPTX Back-End
//

.version 8.7
.target sm_90a
.address_size 64

	// .globl	rope_cache_kernel     // -- Begin function rope_cache_kernel
.extern .shared .align 16 .b8 global_smem[];
                                        // @rope_cache_kernel
.visible .entry rope_cache_kernel(
	.param .u64 .ptr .global .align 1 rope_cache_kernel_param_0,
	.param .u32 rope_cache_kernel_param_1
)
.reqntid 64
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<9>;
	.reg .b64 	%rd<4>;

// %bb.0:                               // %.lr.ph
	ld.param.b64 	%rd1, [rope_cache_kernel_param_0];
	mov.u32 	%r1, %ctaid.x;
	setp.lt.s32 	%p1, %r1, 7;
	// begin inline asm
	mov.u32 %r2, 0x0;
	@%p1 ld.global.b32 { %r2 }, [ %rd1 + 0 ];
	// end inline asm
	selp.b32 	%r3, 1, -1, %p1;
	add.s32 	%r4, %r3, -16;
	.pragma "nounroll";  // "a string // that is not a comment"
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
	fma.rn.f32 	%r5, %r4, 0f3F800000, 0fBF000000;
	@!%p1 bra 	$L__BB0_1;
	ret;
                                        // -- End function
}
"""

_PTX_TOKEN = re.compile(r'"[^"]*"|[A-Za-z0-9_.$%@!<>]+|\S')


def _ptx_tokens(ptx: str) -> list[str]:
    """What ptxas reads of ``ptx``, as a reference decoder independent of minify_ptx: comments
    (``//`` to the line's end, outside strings; ``/* */``) dropped, then the tokens."""
    tokens, i = [], 0
    text = re.sub(r'("[^"\n]*")|//[^\n]*|/\*.*?\*/', lambda m: m.group(1) or " ", ptx, flags=re.S)
    return _PTX_TOKEN.findall(text)


def test_minify_ptx_keeps_every_token_and_drops_the_rest():
    small = _proto.minify_ptx(PTX)
    assert _ptx_tokens(small) == _ptx_tokens(PTX)
    lines = small.splitlines()
    others = [line for line in lines if '"' not in line]
    assert not any("//" in line or "\t" in line or "  " in line for line in others)
    assert lines[:3] == [".version 8.7", ".target sm_90a", ".address_size 64"]
    assert "@%p1 ld.global.b32{%r2},[%rd1+0];" in lines and "selp.b32 %r3,1,-1,%p1;" in lines
    assert "@!%p1 bra $L__BB0_1;" in lines and "$L__BB0_1:" in lines and ".reg .b32 %r<9>;" in lines
    assert '.pragma "nounroll";  // "a string // that is not a comment"' in lines  # a string: only stripped
    assert _proto.minify_ptx(small) == small
    assert len(small) < 0.6 * len(PTX)


def test_minify_ptx_leaves_block_comments_alone():
    """A ``/*`` anywhere: every line only loses its indentation (a ``//`` inside a block comment
    must not cut the line short)."""
    ptx = "\t/* a comment // with\n\tslashes */ add.s32 \t%r1, %r2, %r3;\n\n\tret;\n"
    small = _proto.minify_ptx(ptx)
    assert small == "/* a comment // with\nslashes */ add.s32 \t%r1, %r2, %r3;\nret;\n"
    assert _ptx_tokens(small) == _ptx_tokens(ptx)


def test_slim_call_proto_drops_the_ttir_and_minifies_only_the_ptx():
    ptx = PTX.encode()
    slim = _proto.slim_call_proto(zlib.compress(_call_proto(ptx, b"module { tt.func ... }" * 40)))
    assert zlib.decompress(slim) == _call_proto(_proto.minify_ptx(PTX).encode(), None)
    full = _proto.slim_call_proto(zlib.compress(_call_proto(ptx, b"module { tt.func ... }" * 40)), minify=False)
    assert zlib.decompress(full) == _call_proto(ptx, None)
    # the same proto without TTIR passes through unchanged (but for compression)
    assert zlib.decompress(_proto.slim_call_proto(zlib.compress(_call_proto(ptx, None)), minify=False)) \
        == _call_proto(ptx, None)


def test_ptx_form_is_a_context_variable_read_from_the_environment():
    assert _lowering._ptx_in_force() == "minified"
    with _lowering.ptx_form("full"):
        assert _lowering._ptx_in_force() == "full"
        with _lowering.ptx_form("minified"):
            assert _lowering._ptx_in_force() == "minified"
        assert _lowering._ptx_in_force() == "full"
    assert _lowering._ptx_in_force() == "minified"
    with pytest.raises(ValueError, match="PTX form must be one of 'minified', 'full', got 'tiny'"):
        with _lowering.ptx_form("tiny"):
            pass
    code = "from qsa_jax import _lowering\nprint(_lowering._ptx_in_force())\n"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, QSA_JAX_PTX=" Full "),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["full"], out


def _nvidia_tool(name: str) -> str | None:
    """Triton's bundled ``name``; for ptxas the one Triton itself runs for sm_90 (3.9: ptxas-blackwell,
    the CUDA 13 one its PTX version needs)."""
    try:
        from triton import knobs

        if name == "ptxas":
            from triton.backends.nvidia.compiler import get_ptxas

            return get_ptxas(90).path
        return getattr(knobs.nvidia, name).path
    except (ImportError, RuntimeError, AttributeError):  # no bundled NVIDIA tools in this triton
        return None


def test_minified_ptx_assembles_to_the_same_sass_for_every_kernel_of_the_step(tmp_path):
    """scripts/jax_payload.py: the decode step at production shapes (1 and 8 requests x 128K)
    lowered for CUDA with the real jax-triton and CUDA plugin, each launch's PTX in both forms;
    Triton's bundled ptxas assembles both for sm_90a and cuobjdump's SASS of the two is the same."""
    why = _cuda_plugin()
    if why:
        pytest.skip(why)
    ptxas, cuobjdump = _nvidia_tool("ptxas"), _nvidia_tool("cuobjdump")
    if not (ptxas and cuobjdump):
        pytest.skip("no bundled ptxas and cuobjdump in this triton installation")
    script = Path(__file__).parent.parent / "scripts" / "jax_payload.py"
    out = subprocess.run([sys.executable, str(script), "--dump", str(tmp_path)], capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    fulls = sorted(tmp_path.glob("*.full.ptx"))
    assert len(fulls) >= 8, out.stdout  # 4 launches at each batch (fused compression and selection)
    for full in fulls:
        small = full.with_name(full.name.replace(".full.ptx", ".minified.ptx"))
        assert _ptx_tokens(small.read_text()) == _ptx_tokens(full.read_text()), full.name
        assert small.stat().st_size < full.stat().st_size, full.name
        sass = []
        for ptx in (full, small):
            cubin = ptx.with_suffix(".cubin")
            subprocess.run([ptxas, "-arch=sm_90a", "-o", str(cubin), str(ptx)], check=True, timeout=600)
            text = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True,
                                  timeout=300).stdout
            sass.append([line for line in text.splitlines() if "code for sm_" not in line and ".cubin" not in line])
        assert len(sass[0]) > 20 and sass[0] == sass[1], full.name
