"""Argument checks shared by every plan: one message text for both adapters.

Every message reads ``"<function>: <argument> <what was expected>, got <what
was given>"`` so that a user sees which call and which argument is wrong.

Arrays are checked through :class:`Checker` (rank, dtype, length, layout);
options (Python scalars) through their declared :class:`Option` kind, which
also makes their value canonical (``np.int32(3)`` -> ``3``, ``2`` -> ``2.0``
for a float option) so that a memoised plan is keyed by what it means.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable, Iterable, Mapping

import numpy as np

from .launch import ArrayInfo

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
INDEX_DTYPES = ("int32", "int64")
FP8_DTYPE = "float8_e4m3fn"
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


# --------------------------------------------------------------------------
# Options: declared kinds, validated and canonicalised before the memo lookup
# --------------------------------------------------------------------------

_INVALID = object()


def _as_int(value):
    if isinstance(value, (bool, np.bool_)):  # bool is an int subclass, not an int here
        return _INVALID
    if isinstance(value, (int, np.integer)):
        return int(value)
    return _INVALID


def _as_float(value):
    if isinstance(value, (bool, np.bool_)):
        return _INVALID
    if isinstance(value, (int, float, np.integer, np.floating)):
        try:
            return float(value)
        except OverflowError:  # an int beyond float range
            return _INVALID
    return _INVALID


def _as_bool(value):
    return bool(value) if isinstance(value, (bool, np.bool_)) else _INVALID


def describe(value) -> str:
    """``value`` as a message shows it: short, and with a hint for arrays and tracers."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.generic):
        try:
            shape = tuple(value.shape)
        except Exception:  # pragma: no cover - exotic array-likes
            shape = "?"
        return (f"{type(value).__name__} of shape {shape} (options are static Python values, "
                "not arrays: under jax.jit, mark them static or close over them)")
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclasses.dataclass(frozen=True)
class Option:
    """The kind of a plan option: what it must be, and its canonical value.

    ``convert`` maps an accepted Python or NumPy scalar to its canonical
    type (or ``_INVALID``); ``accepts`` checks the canonical value's range.
    """

    expected: str
    convert: Callable
    accepts: Callable
    canonical_type: type
    optional: bool = False

    def or_none(self) -> "Option":
        """The same kind, also accepting ``None`` (the plan's default)."""
        return dataclasses.replace(self, expected=self.expected + " or None", optional=True)

    def canonical(self, function: str, name: str, value):
        """The canonical value, or ``ValueError`` naming the function and the option."""
        if value is None and self.optional:
            return None
        if type(value) is self.canonical_type and self.accepts(value):
            return value  # the common case, already canonical
        converted = self.convert(value)
        if converted is _INVALID or not self.accepts(converted):
            raise ValueError(f"{function}: {name} must be {self.expected}, got {describe(value)}")
        return converted


POSITIVE_INT = Option("a positive int", _as_int, lambda v: v >= 1, int)
NONNEGATIVE_INT = Option("a non-negative int", _as_int, lambda v: v >= 0, int)
BOOL = Option("a bool", _as_bool, lambda v: True, bool)
FINITE_NUMBER = Option("a finite Python number", _as_float, math.isfinite, float)
FINITE_POSITIVE_NUMBER = Option("a finite positive Python number", _as_float,
                                lambda v: math.isfinite(v) and v > 0, float)


# --------------------------------------------------------------------------
# Arrays
# --------------------------------------------------------------------------

#: ``(function, labels)`` while a composed call plans one of its stages
#: (:meth:`.stage.Stage.plan_named`): the stage's errors then name the
#: composed function and its arguments as the caller wrote them.
_NAMING: contextvars.ContextVar[tuple[str, Mapping[str, str]] | None] = contextvars.ContextVar(
    "qsa_naming", default=None)


@contextlib.contextmanager
def naming(function: str, labels: Mapping[str, str]):
    """Inside the block, every :class:`Checker` names ``function`` and the arguments' ``labels``."""
    token = _NAMING.set((function, labels))
    try:
        yield
    finally:
        _NAMING.reset(token)


class Checker:
    """Raises ``ValueError`` naming the function and the argument.

    Arguments are named through :meth:`name` (and :meth:`owner` for "q's"),
    so that a stage planned as part of a composed call names what the
    caller passed (:func:`naming`).
    """

    def __init__(self, function: str, labels: Mapping[str, str] | None = None):
        named = _NAMING.get()
        self.function, self.labels = (function, labels or {}) if named is None else named

    def name(self, argument: str) -> str:
        """How errors name ``argument``."""
        return self.labels.get(argument, argument)

    def owner(self, argument: str) -> str:
        """``argument``'s name as a possessive: ``q's``, ``raw_keys'``."""
        name = self.name(argument)
        return name + ("'" if name.endswith("s") else "'s")

    def renamed(self, **arguments: str) -> "Checker":
        """A checker for a helper whose parameters have other names: ``helper_parameter=own_argument``."""
        renamed = Checker.__new__(Checker)
        renamed.function = self.function
        renamed.labels = {**self.labels, **{parameter: self.name(own) for parameter, own in arguments.items()}}
        return renamed

    def fail(self, name: str, expected: str, got: object) -> None:
        raise ValueError(f"{self.function}: {self.name(name)} {expected}, got {got}")

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

    def array(self, name: str, info: ArrayInfo, rank: int, layout: str, dtypes: Iterable[str]) -> None:
        """Rank ``rank`` (described as ``layout``), then one of ``dtypes``."""
        self.rank(name, info, rank, layout)
        self.dtype(name, info, dtypes)

    def index_array(self, name: str, info: ArrayInfo, rank: int, layout: str) -> None:
        """An int32/int64 array of rank ``rank``: every index role takes both dtypes."""
        self.array(name, info, rank, layout, INDEX_DTYPES)

    def index_vector(self, name: str, info: ArrayInfo, length: int | None, what: str, like: str = "") -> None:
        """A ``[what]`` int32/int64 vector of ``length`` entries (any length if None)."""
        self.index_array(name, info, 1, f"[{what}]")
        if length is not None and info.shape[0] != length:
            self.fail(name, f"must have {what} = {length} entries" + (f" like {self.name(like)}" if like else ""),
                      f"shape {info.shape}")

    def same_dtype(self, name: str, info: ArrayInfo, other_name: str, other: ArrayInfo) -> None:
        """``info`` has ``other``'s dtype."""
        if info.dtype != other.dtype:
            self.fail(name, f"must have {self.owner(other_name)} dtype {other.dtype}", info.dtype)

    def not_expanded(self, name: str, info: ArrayInfo) -> None:
        """An array updated in place has no stride-0 dimension of size > 1 (an expanded
        view would have several elements share one address; torch's own in-place
        operations refuse it too)."""
        if info.size and any(stride == 0 and size > 1 for size, stride in zip(info.shape, info.strides)):
            self.fail(name, "must not be an expanded view (a stride-0 dimension of size > 1): "
                      "it is updated in place", f"strides {info.strides} for shape {info.shape}")

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

    def cache_scales(self, fp8: bool, cache_dtype: str, scales: dict[str, ArrayInfo | None]) -> None:
        """The one rule of every stage with K/V caches: each scale of ``scales`` (name ->
        array or None) is given, as a 0-d or 1-element float array, exactly when the caches
        are ``float8_e4m3fn`` (a scale quantises or dequantises fp8 values; a 16-bit cache
        holds its values as they are)."""
        for name, info in scales.items():
            if fp8 and info is None:
                self.fail(name, f"must be given (a 0-d or 1-element float tensor) for {FP8_DTYPE} caches", None)
            if not fp8 and info is not None:
                self.fail(name, f"must be None for {cache_dtype} caches (scales are for {FP8_DTYPE} caches)",
                          f"an array of shape {info.shape}")
            if info is not None:
                self.scalar_array(name, info)

    def writer_scales(self, fp8: bool, scales: dict[str, ArrayInfo | None]) -> None:
        """Stage 1's rule, the source's (aiter's ``apply_scale=True``): every scale of
        ``scales`` is required for ``float8_e4m3fn`` caches; for the others each is optional
        and applied where given (stored = value * (1 / scale), which no reader undoes).
        A given scale is a 0-d or 1-element float array."""
        for name, info in scales.items():
            if fp8 and info is None:
                self.fail(name, f"must be given (a 0-d or 1-element float tensor) for {FP8_DTYPE} caches", None)
            if info is not None:
                self.scalar_array(name, info)

    def option(self, name: str, value, kind: Option):
        """``value`` checked against ``kind``; returns its canonical value."""
        return kind.canonical(self.function, name, value)


def missing_array_error(function: str, name: str) -> TypeError:
    """A required array passed as ``None``."""
    return TypeError(f"{function}: {name} must be an array (it is required), got None")


def check_host_indices_fit_int32(function: str, name: str, array: np.ndarray) -> None:
    """A host integer array that is about to be narrowed to int32 holds only int32 values.

    qsa_jax without x64 converts NumPy int64 inputs to int32 (``jnp.asarray``):
    slot ``2**32 + 1`` would become slot 1, a live cache row.  Such values
    raise instead; in-range values narrow exactly.
    """
    if array.dtype.kind not in "iu" or array.size == 0:
        return
    low, high = int(array.min()), int(array.max())
    if low < INT32_MIN or high > INT32_MAX:
        raise ValueError(
            f"{function}: {name} must hold int32 values when JAX runs without x64 (it narrows "
            f"{array.dtype} to int32, which would wrap them; enable jax_enable_x64 to pass them), "
            f"got {array.dtype} values in [{low}, {high}]")


def type_error(function: str, name: str, expected: str, value: object) -> TypeError:
    return TypeError(f"{function}: {name} must be {expected}, got {type(value).__name__}")


def device_error(function: str, name: str, device: object, first: str, first_device: object) -> ValueError:
    return ValueError(
        f"{function}: all arrays must be on one device: {name} is on {device}, "
        f"{first} is on {first_device}"
    )
