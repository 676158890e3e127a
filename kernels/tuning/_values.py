"""What every stage's tuning class is built from: frozen values, the checks of
their fields, and the defaults that a newer Triton series replaces."""

from __future__ import annotations

import dataclasses

import numpy as np
import triton

from ..validate import POSITIVE_INT

#: The Triton release series the tables were timed on (the GPU image's).
TIMED_TRITON = "3.6"
#: The release series (``major.minor``) of the Triton this process imports.
TRITON_SERIES = ".".join(triton.__version__.split(".")[:2])

#: Defaults of newer Triton series than :data:`TIMED_TRITON`: where a timed
#: value makes ptxas spill registers on sm_90 under that series (the compile
#: check, tests/test_compile_sm90.py, which needs no GPU), the nearest
#: spill-free value, chosen by that check alone and never timed on a GPU
#: (docs/design.md, "Defaults under newer Triton series").
#: ``series -> {"Class.field": value}``; for a launch table, the value is
#: ``{row index: row}`` (each row keeps its bound).  A series not listed
#: (3.6, 3.7) takes the timed values.
NEWER_TRITON: dict[str, dict[str, object]] = {
    "3.8": {
        # prefill (>= 4096 programs): 2 warps spill; 4 warps do not.
        "AttentionTuning.launch_table": {5: (None, 32 * 1024, 4, 2, 264)},
        # The sliced top-k's 4096-column place pass spills; 2048 columns do not.
        "TopkTuning.tile": 2048,
        # The row top-k at 16 warps, k = 2048: 8192-column tiles spill; 4096 do not.
        "TopkTuning.row_max_tile": 4096,
    },
    "3.9": {
        # decode 65-4095 programs: 3 stages spill, 2 do not; prefill: 2 warps spill, 4 do not.
        "AttentionTuning.launch_table": {3: (132, 16 * 1024, 2, 2, 512), 4: (4095, 16 * 1024, 2, 2, 264),
                                         5: (None, 32 * 1024, 4, 2, 264)},
        # The row top-k at 16 warps: 8192-column tiles spill; 4096 do not.
        "TopkTuning.row_max_tile": 4096,
        # The ticketed compaction by 16-column chunks: ptxas holds it to 64 registers and
        # spills; 2048-column chunks do not.
        "TopkTuning.ticketed_chunk": 2048,
    },
}

#: ``"Class.field" -> its timed value`` for every default that a series may replace.
_TIMED: dict[str, object] = {}


def _series_value(series: str, key: str):
    """The default ``key`` ("Class.field") has under Triton ``series``."""
    timed = _TIMED[key]
    change = NEWER_TRITON.get(series, {}).get(key)
    if change is None:
        return timed
    if isinstance(change, dict):  # a launch table's rows, by index
        rows = list(timed)
        for index, row in change.items():
            if not 0 <= index < len(rows) or row[0] != rows[index][0]:
                raise ValueError(f"NEWER_TRITON[{series!r}][{key!r}] row {index}: {row!r} does not replace "
                                 f"a row of the timed table with the same bound")
            rows[index] = row
        return tuple(rows)
    return change


def _versioned(key: str, timed):
    """A field default: ``timed`` (the Triton 3.6 value), or this Triton series' replacement."""
    _TIMED[key] = timed
    return _series_value(TRITON_SERIES, key)


def _tuning_value(cls):
    """A frozen dataclass whose hash is computed once: tuning values are hashed on
    every plan lookup (they are part of the memo key)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    field_hash = cls.__hash__

    def __hash__(self):
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = field_hash(self)
            object.__setattr__(self, "_hash", value)
            return value

    cls.__hash__ = __hash__
    return cls


def _positive_int(owner: str, name: str, value, optional: bool = False) -> None:
    """The plans' own positive-int rule (and message), for a tuning field."""
    kind = POSITIVE_INT.or_none() if optional else POSITIVE_INT
    kind.canonical(owner, name, value)


#: The most warps a program may have (1024 threads on NVIDIA GPUs).
MAX_WARPS = 32


def _power_of_two(owner: str, name: str, value, optional: bool = False, most: int | None = None) -> None:
    """A positive int that is a power of two (a ``tl.arange`` size, a warp count: what the
    kernels need), at most ``most``: refused here rather than at launch, naming the knob."""
    _positive_int(owner, name, value, optional)
    if value is None:
        return
    if value & (value - 1):
        raise ValueError(f"{owner}: {name} must be a power of two, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"{owner}: {name} must be at most {most}, got {value!r}")


def _table_rows(owner: str, name: str, table) -> tuple:
    """A launch table as a tuple of row tuples (rows that are not sequences: the table's error)."""
    try:
        return tuple(tuple(row) for row in table)
    except TypeError:
        raise ValueError(f"{owner}: {name} must be a sequence of rows (most programs or None, tile bytes, "
                         f"warps, stages, target programs), got {table!r}") from None


#: A launch table row's fields: (name, what it must be, whether it is, given an int that is not a bool).
_ROW_FIELDS = (
    ("most programs", "a positive int or None", lambda v: v is None or v >= 1),
    ("tile bytes", "a power of two", lambda v: v is not None and v >= 1 and not v & (v - 1)),
    ("warps", f"a power of two up to {MAX_WARPS}", lambda v: v is not None and 1 <= v <= MAX_WARPS and not v & (v - 1)),
    ("stages", "a positive int", lambda v: v is not None and v >= 1),
    ("target programs", "a positive int", lambda v: v is not None and v >= 1),
)


def _launch_rows(owner: str, name: str, table: tuple) -> None:
    """Every value of a launch table's (5-field) rows is what the plan needs: typed ints."""
    for i, row in enumerate(table):
        for (field, expected, accepts), value in zip(_ROW_FIELDS, row):
            typed = value is None or (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)))
            if not typed or not accepts(value):
                raise ValueError(f"{owner}: {name} row {i} {field} must be {expected}, got {value!r} in {row!r}")
