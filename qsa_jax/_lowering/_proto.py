"""The call proto jax-triton's rule emits, read back and slimmed; the launches of a lowered computation."""

from __future__ import annotations

import re
import zlib

from .._binding import CUSTOM_CALL_TARGETS

LEGACY_TARGET, FFI_TARGET = CUSTOM_CALL_TARGETS

__all__ = ["custom_calls", "minify_ptx", "payload", "slim_call_proto"]


def custom_calls(lowered) -> list:
    """Every ``stablehlo.custom_call`` operation of ``lowered`` (a ``jax.stages.Lowered``), in order:
    the launches whose payloads the diagnostics read (scripts/check_jax_lowering.py,
    scripts/jax_payload.py, benchmarks/bench_jax_calls.py)."""
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call":
                        found.append(inner.operation)
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def payload(op, ir) -> bytes:
    """The compressed call proto jax-triton's rule put on ``op`` (0.3: the legacy call's
    ``backend_config``; 0.4: the FFI call's ``opaque`` attribute)."""
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    if target == LEGACY_TARGET:
        return ir.StringAttr(op.attributes["backend_config"]).value_bytes
    if target == FFI_TARGET:
        return ir.StringAttr(ir.DictAttr(op.attributes["mhlo.backend_config"])["opaque"]).value_bytes
    raise RuntimeError(f"jax-triton lowered a launch to {target!r}, which this module does not know")


# --------------------------------------------------------------------------
# The call proto, slimmed.  jaxlib keys its kernel cache on the whole
# compressed proto: per call (legacy) and per execution of an executable
# (jaxlib 0.11.2's FFI initialize stage) it copies the proto into a
# std::string, hashes it and compares it with the cached key
# (GetOrCreateKernelCall): three passes over its bytes (jaxlib 0.12's execute
# stage reuses the launch it cached in its instantiate state and reads no
# payload; docs/design.md, "JAX call overhead").  The kernel's TTIR text in it
# is never read at run time, Triton's line info and the PTX's comments and
# blanks are never read by ptxas; all go.  (Protobuf wire format,
# TritonAnyKernelCall -> kernel_call (1) -> kernel (1) -> ptx (4), ttir (5):
# see jaxlib/gpu/triton.proto.)
# --------------------------------------------------------------------------

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes):
    """``(field number, wire type, encoded entry, payload or None)`` for each entry of a message."""
    i = 0
    while i < len(data):
        start = i
        key, i = _read_varint(data, i)
        kind = key & 7
        payload = None
        if kind == 0:
            _, i = _read_varint(data, i)
        elif kind == 1:
            i += 8
        elif kind == 5:
            i += 4
        elif kind == 2:
            length, i = _read_varint(data, i)
            payload, i = data[i:i + length], i + length
        else:
            raise ValueError(f"unexpected protobuf wire type {kind}")
        yield key >> 3, kind, data[start:i], payload


def _edit(message: bytes, number: int, change) -> bytes:
    """``message`` with the payload of each length-delimited field ``number`` replaced by
    ``change(payload)`` (``None``: the field dropped)."""
    out = bytearray()
    for field, kind, entry, payload in _fields(message):
        if field != number or kind != 2:
            out += entry
            continue
        new = change(payload)
        if new is not None:
            out += _varint(number << 3 | 2) + _varint(len(new)) + new
    return bytes(out)


def slim_call_proto(compressed: bytes, minify: bool = True) -> bytes:
    """A single-kernel call proto without the kernel's TTIR and (``minify``) with its PTX
    minified (:func:`minify_ptx`), recompressed at zlib's best level."""
    def kernel(message: bytes) -> bytes:
        message = _edit(message, 5, lambda ttir: None)
        return _edit(message, 4, lambda ptx: minify_ptx(ptx.decode()).encode()) if minify else message

    proto = _edit(zlib.decompress(compressed), 1, lambda call: _edit(call, 1, kernel))
    return zlib.compress(proto, 9)


_PTX_SPACE = re.compile(r" ?([,;\[\]{}()+]) ?")


def minify_ptx(ptx: str) -> str:
    """``ptx`` without what ptxas never reads: ``//`` comments (LLVM's ``// begin inline asm``,
    ``// %bb.N:``, the commented-out ``// .globl``), indentation, blank lines, runs of blanks
    (one space is kept between tokens) and the blanks beside punctuation (``,`` ``;`` ``[`` ``]``
    ``{`` ``}`` ``(`` ``)`` ``+``).  A line holding a string, and every line of a PTX holding a
    ``/*`` comment, only loses its indentation.  The same machine code either way:
    tests/test_jax_lowering.py assembles both forms of every kernel of the decode step with
    Triton's ptxas and compares the SASS."""
    out, block_comments = [], "/*" in ptx
    for line in ptx.split("\n"):
        if block_comments or '"' in line:
            line = line.strip()
        else:
            line = _PTX_SPACE.sub(r"\1", " ".join(line.split("//", 1)[0].split()))
        if line:
            out.append(line)
    return "\n".join(out) + "\n"


