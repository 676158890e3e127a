"""Binds qsa_kernels programs to torch tensors and launches them."""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch

from qsa_kernels import runtime
from qsa_kernels.launch import ArrayInfo, Program, split_arguments
from qsa_kernels.validate import device_error, type_error

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def info(tensor: torch.Tensor) -> ArrayInfo:
    """Shape, dtype and strides of a tensor, as plans see them."""
    return ArrayInfo(tuple(tensor.shape), DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype).removeprefix("torch."), tensor.stride())


def metadata(function: str, arrays: Mapping[str, object]) -> dict[str, ArrayInfo | None]:
    """Check types and devices, and read every array's metadata.

    ``None`` entries are absent optional arguments.  All tensors must share
    one device; in a compiled process that device must be a CUDA device.
    """
    infos: dict[str, ArrayInfo | None] = {}
    first_name = first = None
    for name, value in arrays.items():
        if value is None:
            infos[name] = None
            continue
        if not isinstance(value, torch.Tensor):
            raise type_error(function, name, "a torch.Tensor", value)
        if first is None:
            first_name, first = name, value
        elif value.get_device() != first.get_device() or value.is_meta != first.is_meta:
            raise device_error(function, name, value.device, first_name, first.device)
        infos[name] = info(value)
    if first is not None:
        on_cuda = first.is_cuda
        if runtime.INTERPRETED and not (first.get_device() < 0 and not first.is_meta):
            raise ValueError(f"{function}: this process runs Triton's interpreter (no CUDA device was visible at import), so tensors must be on the CPU, got {first.device}")
        if not runtime.INTERPRETED and not on_cuda:
            raise ValueError(f"{function}: this process runs compiled Triton kernels, so tensors must be on a CUDA device, got {first.device}")
    return infos


def run(program: Program, arrays: Mapping[str, torch.Tensor | None], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Allocate the program's buffers and launch its kernels on ``device``'s current stream."""
    env = {name: value for name, value in arrays.items() if value is not None}
    for buffer in program.buffers:
        env[buffer.name] = torch.empty(buffer.shape, dtype=DTYPES[buffer.dtype], device=device)
    launches = program.runnable_launches
    if launches:
        if runtime.INTERPRETED:
            guard = runtime.interpreter_lock
        else:
            guard = torch.cuda.device(device)
        with guard:
            for launch in launches:
                launch.kernel[launch.grid](
                    *(env[name] for name in launch.inputs),
                    *(env[name] for name in launch.outputs),
                    **launch.scalars,
                    **launch.constexprs,
                    num_warps=launch.num_warps,
                    num_stages=launch.num_stages,
                )
    return tuple(env[name] for name in program.results)


def call(plan, arguments: Mapping[str, object]):
    """Run the public function ``plan`` serves, given its arguments by name."""
    arrays, options = split_arguments(plan, arguments)
    # A plan may name its arguments differently in errors (the step: "state.key_cache").
    labels = getattr(plan, "labels", None)
    if labels:
        infos = metadata(plan.function, {labels[name]: value for name, value in arrays.items()})
        infos = {name: infos[labels[name]] for name in arrays}
    else:
        infos = metadata(plan.function, arrays)
    program = plan(**infos, **options)
    device = next(value.device for value in arrays.values() if value is not None)
    return program.returned(run(program, arrays, device))
