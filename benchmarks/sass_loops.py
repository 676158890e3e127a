"""SASS instructions of a plan's kernels compiled for sm_90, loop by loop (no GPU needed).

Compiles the launches of ``tests/test_compile_sm90.py`` cases (specialised as
the torch adapter calls them) with Triton's bundled ptxas and disassembles
them with the bundled cuobjdump.  For each kernel it prints the registers,
the instruction count, and each loop (a backward branch: the instructions
between its target and the branch) with its instruction count and the
opcodes it holds most of.  Per thread: a warp runs each instruction once for
its 32 threads.

    TRITON_INTERPRET=0 python benchmarks/sass_loops.py attention/fp8-decode-256 scores/fp8-decode-256-128k

Offline figures for a change to a hot loop (docs/design.md, "Measured tuning
values" quotes them); timings still need the GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def disassemble(cubin: bytes) -> list[tuple[int, str, str]]:
    """``(address, opcode, operands)`` of every instruction of the cubin's one kernel."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", file.name], check=True,
                              capture_output=True, text=True).stdout
    return [(int(m.group(1), 16), m.group(3), m.group(4).strip()) for m in map(_LINE.search, text.splitlines()) if m]


def loops(instructions) -> list[tuple[int, int, list[str]]]:
    """``(start, end, opcodes)`` of each backward branch's body, innermost (shortest) first."""
    found = []
    for index, (address, opcode, operands) in enumerate(instructions):
        if opcode.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", operands)
            if target and int(target.group(1), 16) <= address:
                start = int(target.group(1), 16)
                body = [op for at, op, _ in instructions if start <= at <= address]
                found.append((start, address, body))
    return sorted(found, key=lambda loop: len(loop[2]))


def main() -> None:
    from qsa_kernels import runtime

    assert not runtime.INTERPRETED, "run with TRITON_INTERPRET=0: kernels must be compiled, not interpreted"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from qsa_kernels.launch import ArrayInfo
    from tests.test_compile_sm90 import CASES, _resources, specialise

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("labels", nargs="+", help=f"cases of tests/test_compile_sm90.py, e.g. {next(iter(CASES))}")
    parser.add_argument("--top", type=int, default=8, help="opcodes shown per loop")
    args = parser.parse_args()
    backend = make_backend(GPUTarget("cuda", 90, 32))
    for label in args.labels:
        plan, kwargs = CASES[label]
        program = plan(**kwargs)
        arrays = {name: info for name, info in kwargs.items() if isinstance(info, ArrayInfo)}
        arrays.update((b.name, b.info) for b in program.buffers)
        seen = set()
        for launch in program.runnable_launches:
            if launch.kernel.__name__ in seen:  # chunks repeat a launch
                continue
            seen.add(launch.kernel.__name__)
            kernel, options, signature, constexprs, attrs = (launch.kernel, *specialise(launch, arrays, backend))
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", 90, 32), options=options.__dict__)
            regs, spills = _resources(compiled.asm["cubin"])
            instructions = disassemble(compiled.asm["cubin"])
            print(f"{label} {kernel.__name__}: {regs} registers, {spills} spills, {len(instructions)} instructions "
                  f"({launch.num_warps} warps)")
            for start, end, body in loops(instructions):
                counts = collections.Counter(op.split(".")[0] for op in body)
                top = ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top))
                print(f"  loop {start:#06x}-{end:#06x}: {len(body)} instructions ({top})")


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    main()
