"""Argument checks shared by every plan: one message text for both adapters.

Every message reads ``"<function>: <argument> <what was expected>, got <what
was given>"`` so that a user sees which call and which argument is wrong.
"""

from __future__ import annotations

from typing import Iterable

from .launch import ArrayInfo

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
INDEX_DTYPES = ("int32", "int64")
FP8_DTYPE = "float8_e4m3fn"


class Checker:
    """Raises ``ValueError`` naming the function and the argument."""

    def __init__(self, function: str):
        self.function = function

    def fail(self, name: str, expected: str, got: object) -> None:
        raise ValueError(f"{self.function}: {name} {expected}, got {got}")

    def rank(self, name: str, info: ArrayInfo, rank: int, layout: str) -> None:
        if info.ndim != rank:
            self.fail(name, f"must be {layout} (rank {rank})", f"shape {info.shape}")

    def ranks(self, name: str, info: ArrayInfo, ranks: Iterable[int], layout: str) -> None:
        ranks = tuple(ranks)
        if info.ndim not in ranks:
            self.fail(name, f"must be {layout}", f"shape {info.shape}")

    def dtype(self, name: str, info: ArrayInfo, allowed: Iterable[str]) -> None:
        allowed = tuple(allowed)
        if info.dtype not in allowed:
            self.fail(name, "must have dtype " + " or ".join(allowed), info.dtype)

    def dim(self, name: str, info: ArrayInfo, axis: int, expected: int, what: str) -> None:
        if info.shape[axis] != expected:
            self.fail(
                name,
                f"must have {what} = {expected} in dimension {axis}",
                f"shape {info.shape}",
            )

    def shape(self, name: str, info: ArrayInfo, expected: tuple[int, ...], layout: str) -> None:
        if tuple(info.shape) != tuple(expected):
            self.fail(name, f"must be {layout} = {tuple(expected)}", f"shape {info.shape}")

    def index_vector(self, name: str, info: ArrayInfo, length: int, what: str) -> None:
        """A ``[what]`` int32/int64 vector of ``length`` entries."""
        self.rank(name, info, 1, f"[{what}]")
        self.dtype(name, info, INDEX_DTYPES)
        if info.shape[0] != length:
            self.fail(name, f"must have {what} = {length} entries", f"shape {info.shape}")

    def last_dim_contiguous(self, name: str, info: ArrayInfo) -> None:
        # An empty array has no layout to get wrong (NumPy gives it zero strides).
        if info.ndim and info.shape[-1] > 1 and info.size and info.strides[-1] != 1:
            self.fail(name, "must have a contiguous last dimension (stride 1)", f"strides {info.strides}")

    def power_of_two(self, name: str, value: int, what: str) -> None:
        if value < 1 or value & (value - 1):
            self.fail(name, f"must have {what} a power of two", value)

    def scalar_array(self, name: str, info: ArrayInfo) -> None:
        if info.size != 1 or info.ndim > 1:
            self.fail(name, "must be a 0-d or 1-element tensor", f"shape {info.shape}")
        self.dtype(name, info, FLOAT_DTYPES)

    def positive(self, name: str, value, what: str = "positive") -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            self.fail(name, f"must be {what}", repr(value))

    def positive_int(self, name: str, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.fail(name, "must be a positive int", repr(value))

    def nonnegative_int(self, name: str, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.fail(name, "must be a non-negative int", repr(value))


def type_error(function: str, name: str, expected: str, value: object) -> TypeError:
    return TypeError(f"{function}: {name} must be {expected}, got {type(value).__name__}")


def device_error(function: str, name: str, device: object, first: str, first_device: object) -> ValueError:
    return ValueError(
        f"{function}: all arrays must be on one device: {name} is on {device}, "
        f"{first} is on {first_device}"
    )
