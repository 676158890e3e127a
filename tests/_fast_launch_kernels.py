"""Kernel signatures for tests/test_fast_launch.py (JITFunctions need a source file).

The bodies are never compiled: the CPU tests bind these signatures with
Triton's own binder and a stand-in for the compiled kernel.
"""

import triton.language as tl
from triton.runtime.jit import JITFunction


def _every_kind(a_ptr, b_ptr, n, m, x, flag, maybe, W: tl.constexpr, DT: tl.constexpr = tl.float32, tail=16):
    pass


def _annotated(a_ptr: "*fp32", n: tl.int64, k_ptr: "*kfp16", s: tl.float32, q: "i32", r, c_ptr):
    pass


# Built directly (not through triton.jit), so that they are JITFunctions even
# in a process that runs the interpreter.
EVERY_KIND = JITFunction(_every_kind)
ANNOTATED = JITFunction(_annotated, do_not_specialize=["q", "r"], do_not_specialize_on_alignment=["c_ptr"])
