"""Framework-free launch descriptions shared by the torch and JAX adapters.

A stage's plan function turns array metadata (:class:`ArrayInfo`) and Python
options into a :class:`Program`: the fresh arrays to allocate and the kernel
launches to run over named arrays.  The adapters only bind names to their own
arrays and launch; every decision (validation, grid, tile sizes, in-place
updates) is made here, once.

Conventions every kernel follows, so one signature serves both adapters:

* parameters are ordered *inputs*, then *outputs*, then scalars, then
  constexprs (jax-triton appends one pointer per output after the inputs and
  passes every keyword as a compile-time constant);
* an output whose name is also an input is updated in place: torch passes the
  same tensor for both parameters, JAX aliases the output to the input
  (``input_output_aliases``);
* ``scalars`` (sizes, strides) are runtime arguments in torch and constants in
  JAX; ``constexprs`` are constants in both.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

__all__ = ["ArrayInfo", "Buffer", "Launch", "Program", "cached_plan", "clear_plan_caches", "contiguous_strides", "split_arguments"]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements, of an array of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class ArrayInfo(NamedTuple):
    """What a plan may know of an array: shape, dtype name and strides.

    ``dtype`` is a NumPy-style name (``"bfloat16"``, ``"float8_e4m3fn"``,
    ``"int32"``...); ``strides`` are in elements.  A NamedTuple: cheap to
    build on every call and hashable, so plans can be memoised on it.
    """

    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...]

    @classmethod
    def contiguous(cls, shape, dtype: str) -> "ArrayInfo":
        shape = tuple(int(s) for s in shape)
        return cls(shape, dtype, contiguous_strides(shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Buffer:
    """A fresh array the program allocates (an output or a workspace)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def info(self) -> ArrayInfo:
        return ArrayInfo.contiguous(self.shape, self.dtype)


@dataclass(frozen=True)
class Launch:
    """One kernel launch over named arrays."""

    kernel: Any
    grid: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    scalars: Mapping[str, int | float] = field(default_factory=dict)
    constexprs: Mapping[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3

    def aliases(self) -> dict[int, int]:
        """Input index -> output index for outputs updated in place."""
        return {
            self.inputs.index(name): j
            for j, name in enumerate(self.outputs)
            if name in self.inputs
        }

    @property
    def empty(self) -> bool:
        return math.prod(self.grid) == 0


@dataclass(frozen=True)
class Program:
    """Everything a public call runs: fresh buffers, launches, results.

    Names used by launches are either arguments (bound by the adapter) or
    buffers declared here.  ``results`` are returned in order.
    """

    function: str
    buffers: tuple[Buffer, ...]
    launches: tuple[Launch, ...]
    results: tuple[str, ...]

    def buffer(self, name: str) -> Buffer | None:
        for b in self.buffers:
            if b.name == name:
                return b
        return None

    @property
    def updated_arguments(self) -> tuple[str, ...]:
        """Arguments some launch writes in place (caches)."""
        fresh = {b.name for b in self.buffers}
        names: list[str] = []
        for launch in self.launches:
            for name in launch.outputs:
                if name not in fresh and name not in names:
                    names.append(name)
        return tuple(names)

    def returned(self, results: tuple):
        """Results as the public function returns them: a lone result bare, else the tuple."""
        return results[0] if len(results) == 1 else results

    @property
    def runnable_launches(self) -> tuple[Launch, ...]:
        return tuple(launch for launch in self.launches if not launch.empty)


def split_arguments(plan, arguments: Mapping[str, Any]) -> tuple[dict, dict]:
    """A public call's arguments, by name, as ``(arrays, options)`` for ``plan``."""
    arrays = {name: arguments[name] for name in plan.array_arguments}
    options = {name: value for name, value in arguments.items() if name not in arrays}
    return arrays, options


from .memo import cached_plan, clear_plan_caches  # noqa: E402,F401  (moved to memo.py; imports keep working)
