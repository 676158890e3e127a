"""Paging for the composed QSA step: pages, rings, lengths, and each step's index arrays.

Framework-free (NumPy): the metadata of a step is built once on the host and
both adapters turn the same arrays into their own (``StepMetadata.from_host``),
so nothing about paging is written twice.

Three caches are paged per request:

* the KV cache ``[num_pages, P, KH, D]``: token ``p`` of a request lives at
  ``block_table[req, p // P] * P + p % P``;
* the compressed-key cache ``[num_compressed_pages, Pc, 1, DI]``: group ``g``
  (positions ``g*ratio .. g*ratio + ratio - 1``) lives at
  ``compressed_block_table[req, g // Pc] * Pc + g % Pc``, written by the row
  that completes it;
* the compressor-state ring ``[max_requests, ring, 1, DI]``: one block per
  request, position ``p`` at slot ``p % ring``; it keeps the raw index keys of
  the last ``ring`` positions, so a group that straddles two steps finds its
  older members there.

Block tables have a fixed width (from ``max_context``), so a step's shapes
depend only on its row count ``T`` and request count ``B``: one trace under
``jax.jit`` and one CUDA graph per ``(T, B)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Mapping

import numpy as np

__all__ = ["CacheGeometry", "HostStepMetadata", "PagedRequests", "METADATA_FIELDS", "STATE_FIELDS"]

#: The step's metadata is int32: slot counts, positions and lengths stay at most this.
INT32_MAX = 2**31 - 1


def _is_int(value) -> bool:
    """A Python or NumPy integer, not a bool (``True`` is an int in Python)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


#: The caches of one QSA attention layer, in the order of ``QSAState``'s fields.
STATE_FIELDS = ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache")


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Sizes of one layer's caches; everything a step's shapes depend on but ``T`` and ``B``.

    ``ring_size`` defaults to ``compress_ratio`` (it may be larger, never smaller).
    Pools of more than ``2**31 - 1`` slots (KV, compressed-key or ring) and a
    ``max_context`` past ``2**31 - 1`` are refused: the step's metadata is
    int32, and a wrapped slot would be a live slot of another page.
    """

    page_size: int
    num_pages: int
    compress_ratio: int
    compressed_page_size: int
    num_compressed_pages: int
    max_context: int
    max_requests: int
    ring_size: int | None = None

    def __post_init__(self):
        for name in ("page_size", "num_pages", "compress_ratio", "compressed_page_size",
                     "num_compressed_pages", "max_context", "max_requests", "ring_size"):
            value = getattr(self, name)
            if name == "ring_size" and value is None:
                continue
            if not _is_int(value) or value < 1:
                raise ValueError(f"CacheGeometry: {name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.ring_size is None:
            object.__setattr__(self, "ring_size", self.compress_ratio)
        if self.ring_size < self.compress_ratio:
            raise ValueError(f"CacheGeometry: ring_size must be at least compress_ratio = "
                             f"{self.compress_ratio}, got {self.ring_size}")
        # The step's metadata is int32: every slot (and so every row count and page),
        # position and length must fit, or a wrapped slot would be a live slot of
        # another page.
        for name, count in (("num_pages * page_size", self.num_pages * self.page_size),
                            ("num_compressed_pages * compressed_page_size",
                             self.num_compressed_pages * self.compressed_page_size),
                            ("max_requests * ring_size", self.max_requests * self.ring_size),
                            ("max_context", self.max_context)):
            if count > INT32_MAX:
                raise ValueError(f"CacheGeometry: {name} must be at most 2**31 - 1 (the step's metadata is int32), "
                                 f"got {count}")

    @property
    def table_width(self) -> int:
        """KV pages per request: the width of ``block_table``."""
        return -(-self.max_context // self.page_size)

    @property
    def compressed_table_width(self) -> int:
        """Compressed pages per request: the width of ``compressed_block_table``."""
        return max(1, -(-(self.max_context // self.compress_ratio) // self.compressed_page_size))

    def state_shapes(self, kv_heads: int, head_dim: int, index_head_dim: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the four caches of ``QSAState``, by field name."""
        return dict(
            key_cache=(self.num_pages, self.page_size, kv_heads, head_dim),
            value_cache=(self.num_pages, self.page_size, kv_heads, head_dim),
            compressor_state_cache=(self.max_requests, self.ring_size, 1, index_head_dim),
            compressed_key_cache=(self.num_compressed_pages, self.compressed_page_size, 1, index_head_dim),
        )


@dataclasses.dataclass(frozen=True)
class HostStepMetadata:
    """One step's index arrays (NumPy int32); ``T`` rows of ``B`` requests.

    Rows are grouped by request, in batch order; a request's rows hold
    consecutive positions.  The adapters' ``StepMetadata`` has these fields.
    """

    slot_mapping: np.ndarray  # [T] KV-cache slot of each row
    positions: np.ndarray  # [T] position of each row in its request
    raw_positions: np.ndarray  # [T, 1, 3] the 3 (M-RoPE) positions of each row; equal for text
    token_to_req: np.ndarray  # [T] batch index of each row's request
    query_start_loc: np.ndarray  # [B + 1] first row of each request, then T
    sequence_lengths: np.ndarray  # [B] each request's length after this step
    block_table: np.ndarray  # [B, table_width] KV pages, -1 past the end
    compressed_block_table: np.ndarray  # [B, compressed_table_width] compressed-key pages, -1 past the end
    compressed_slots: np.ndarray  # [T] compressed-key slot of the group a row completes, else -1
    compressor_state_block_table: np.ndarray  # [B, 1] each request's ring block
    compressor_state_slots: np.ndarray  # [T] ring slot a row's raw index key goes to, else -1

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    @property
    def num_requests(self) -> int:
        return len(self.sequence_lengths)


#: Field names of the step metadata, shared by the adapters' ``StepMetadata``.
METADATA_FIELDS = tuple(f.name for f in dataclasses.fields(HostStepMetadata))


class PagedRequests:
    """The requests in flight: their lengths, pages and rings; builds each step's metadata.

    ``step({request: new_tokens, ...})`` allocates what the new tokens need and
    returns the step's :class:`HostStepMetadata` (batch order = the mapping's
    order); ``release(request)`` returns a finished request's pages and ring.
    ``admit(request, length)`` registers a request whose first ``length``
    tokens are already in the caches (written some other way).

    Every call is all or nothing: one that raises (a bad count, past
    ``max_context``, out of pages or rings) has registered, allocated and
    changed nothing.

    ``seed`` shuffles the free lists, so pages of one request are scattered
    over the pool as in a long-running server.

    Cost: a step costs time in proportion to its rows and newly allocated
    pages, not to ``max_context``: each request's table row is kept (one row
    per ring block) and only new pages are written.  So a step of the same
    batch as the previous one (the same requests in the same order: a decode
    loop) returns *the same* ``block_table`` and ``compressed_block_table``
    arrays, with the new pages filled in.  Only entries past every earlier
    step's lengths change (``-1`` becomes a page), so an earlier step's
    metadata still describes that step exactly; but copy the tables (or
    convert them: ``StepMetadata.from_host`` copies) if you need them frozen.
    A batch of other requests or order gets new arrays.
    """

    def __init__(self, geometry: CacheGeometry, *, seed: int | None = None):
        self.geometry = geometry
        order = (lambda n: np.random.default_rng(seed).permutation(n)) if seed is not None else np.arange
        self._free_pages = [int(p) for p in order(geometry.num_pages)[::-1]]
        self._free_compressed = [int(p) for p in order(geometry.num_compressed_pages)[::-1]]
        self._free_rings = [int(p) for p in order(geometry.max_requests)[::-1]]
        self._ring: dict[Hashable, int] = {}
        self._lengths = np.zeros(geometry.max_requests, np.int64)  # per ring block
        # Per ring block (one per request in flight): its table rows and how
        # many pages of each kind it holds.
        self._rows = np.full((geometry.max_requests, geometry.table_width), -1, np.int32)
        self._compressed_rows = np.full((geometry.max_requests, geometry.compressed_table_width), -1, np.int32)
        self._num_pages = np.zeros(geometry.max_requests, np.int64)
        self._num_compressed = np.zeros(geometry.max_requests, np.int64)
        self._batch: _Batch | None = None  # the last step's batch, whose tables the next may reuse

    # -- validation (nothing changes before these pass) ----------------------

    def _fail(self, message: str):
        raise ValueError(f"PagedRequests: {message}")

    def _needs(self, lengths: np.ndarray, pages: np.ndarray, compressed: np.ndarray, new_rings: int):
        """Pages each request needs to reach ``lengths``; raises if the pools cannot give them all."""
        g = self.geometry
        new_pages = np.maximum(-(-lengths // g.page_size) - pages, 0)
        new_compressed = np.maximum(-(-(lengths // g.compress_ratio) // g.compressed_page_size) - compressed, 0)
        for what, needed, free in (("compressor-state rings (max_requests)", new_rings, self._free_rings),
                                   ("KV pages", int(new_pages.sum()), self._free_pages),
                                   ("compressed-key pages", int(new_compressed.sum()), self._free_compressed)):
            if needed > len(free):
                self._fail(f"out of {what}: {needed} needed, {len(free)} free")
        return new_pages, new_compressed

    def _check_request(self, call: str, request) -> None:
        """A request id is a dict key: an unhashable one is the pager's own error, not Python's."""
        try:
            hash(request)
        except TypeError:
            self._fail(f"{call}: a request must be hashable (it is a dict key), got {type(request).__name__} {request!r}")

    def _check_new_length(self, request, start: int, count: int) -> None:
        """``start + count`` in Python integers (NumPy's int64 would wrap past 2**63, or refuse
        the count) against ``max_context``, before anything changes."""
        if start + count > self.geometry.max_context:
            self._fail(f"request {request!r} would reach {start + count} tokens, "
                       f"past max_context = {self.geometry.max_context}")

    def _check_context(self, requests, lengths: np.ndarray) -> None:
        if lengths.max() > self.geometry.max_context:
            over = np.flatnonzero(lengths > self.geometry.max_context)
            i = int(over[0])
            self._fail(f"request {requests[i]!r} would reach {int(lengths[i])} tokens, "
                       f"past max_context = {self.geometry.max_context}")

    # -- allocation (after validation: cannot fail) --------------------------

    def _allocate(self, rings: np.ndarray, new_pages: np.ndarray, new_compressed: np.ndarray,
                  batch: "_Batch | None" = None) -> None:
        """Give each ring block its new pages (in batch order), in its rows and ``batch``'s tables."""
        for rows, counts, new, free, tables in (
                (self._rows, self._num_pages, new_pages, self._free_pages, batch and batch.block_table),
                (self._compressed_rows, self._num_compressed, new_compressed, self._free_compressed,
                 batch and batch.compressed_block_table)):
            if not new.any():
                continue
            for i in np.flatnonzero(new):
                ring, first, n = int(rings[i]), int(counts[rings[i]]), int(new[i])
                pages = [free.pop() for _ in range(n)]
                rows[ring, first:first + n] = pages
                if tables is not None:
                    tables[i, first:first + n] = pages
                counts[ring] = first + n

    # -- public calls --------------------------------------------------------

    @property
    def lengths(self) -> dict[Hashable, int]:
        """Each request in flight and its length (tokens in the caches); a fresh dict."""
        return {request: int(self._lengths[ring]) for request, ring in self._ring.items()}

    def admit(self, request: Hashable, length: int) -> None:
        """Register ``request`` with ``length`` tokens already written into the caches."""
        if not _is_int(length) or length < 0:
            self._fail(f"admit: length must be a non-negative int, got {length!r}")
        self._check_request("admit", request)
        if request in self._ring:
            self._fail(f"request {request!r} is already in flight")
        self._check_new_length(request, 0, int(length))
        lengths = np.array([int(length)], np.int64)
        zero = np.zeros(1, np.int64)
        new_pages, new_compressed = self._needs(lengths, zero, zero, 1)
        ring = self._free_rings.pop()
        self._ring[request] = ring
        self._allocate(np.array([ring]), new_pages, new_compressed)
        self._lengths[ring] = int(length)

    def release(self, request: Hashable) -> None:
        """Return a finished request's pages and ring block to the pools."""
        self._check_request("release", request)
        if request not in self._ring:
            self._fail(f"release: request {request!r} is not in flight (never admitted or stepped, or already released)")
        ring = self._ring.pop(request)
        for rows, counts, free in ((self._rows, self._num_pages, self._free_pages),
                                   (self._compressed_rows, self._num_compressed, self._free_compressed)):
            n = int(counts[ring])
            free += rows[ring, :n][::-1].tolist()
            rows[ring, :n] = -1
            counts[ring] = 0
        self._free_rings.append(ring)
        self._lengths[ring] = 0
        self._batch = None  # its tables hold this request's pages

    # Any keys: Mapping is invariant in its key type, so Mapping[Hashable, ...] would reject a dict[str, int].
    def step(self, new_tokens: Mapping[Any, int | np.integer]) -> HostStepMetadata:
        """Allocate for and describe one step: ``new_tokens[request]`` rows of each request."""
        g = self.geometry
        if not isinstance(new_tokens, Mapping):
            self._fail(f"step: new_tokens must be a mapping of request -> new token count, got {type(new_tokens).__name__}")
        requests = list(new_tokens)
        values = list(new_tokens.values())
        if not requests:
            self._fail("a step needs at least one request and one token per request, got {}")
        if not set(map(type, values)) <= {int}:  # the common case checks in C; the rest one by one
            for request, value in zip(requests, values):
                if not _is_int(value):
                    self._fail(f"step: the new token count of request {request!r} must be a positive int, got {value!r}")
        # Counts are checked as Python integers before NumPy sees them: a count past
        # int64 would raise OverflowError, one near it would wrap past the checks.
        if min(values) < 1:
            self._fail(f"a step needs at least one request and one token per request, got {dict(new_tokens)}")
        if max(values) > g.max_context:  # past max_context whatever the request's length
            i = next(i for i, value in enumerate(values) if value > g.max_context)
            ring = self._ring.get(requests[i], -1) if _hashable(requests[i]) else -1
            self._check_new_length(requests[i], int(self._lengths[ring]) if ring >= 0 else 0, int(values[i]))
        counts = np.array(values, np.int64)

        batch = self._batch if self._batch is not None and self._batch.requests == requests else None
        if batch is not None:  # a decode loop: every request in flight, its rings and tables known
            starts, rings, new_rings = batch.ends, batch.rings, 0
        else:
            try:
                known = [self._ring.get(r, -1) for r in requests]
            except TypeError:  # a Mapping other than a dict may have unhashable keys
                for request in requests:
                    self._check_request("step", request)
                raise
            rings = np.array(known, np.int64)
            new_rings = known.count(-1)
            starts = np.where(rings < 0, 0, self._lengths[rings])
        ends = starts + counts
        self._check_context(requests, ends)
        pages, compressed = self._num_pages[rings], self._num_compressed[rings]
        if new_rings:
            fresh = rings < 0
            pages, compressed = np.where(fresh, 0, pages), np.where(fresh, 0, compressed)
        new_pages, new_compressed = self._needs(ends, pages, compressed, new_rings)

        # Everything is checked: from here on nothing can fail.
        if new_rings:
            rings = rings.copy()
            for i in np.flatnonzero(fresh):
                rings[i] = self._ring[requests[i]] = self._free_rings.pop()
        if batch is None:
            self._allocate(rings, new_pages, new_compressed)
            batch = _Batch(requests, rings, self._rows[rings], self._compressed_rows[rings], ends)
        else:
            self._allocate(rings, new_pages, new_compressed, batch)
            batch.ends = ends
        self._batch = batch
        self._lengths[rings] = ends
        return _describe(g, counts, starts, ends, rings, batch.block_table, batch.compressed_block_table)


class _Batch:
    """The last step's batch: its requests in order, ring blocks, tables and lengths after it."""

    __slots__ = ("requests", "rings", "block_table", "compressed_block_table", "ends")

    def __init__(self, requests: list, rings: np.ndarray, block_table: np.ndarray,
                 compressed_block_table: np.ndarray, ends: np.ndarray):
        self.requests, self.rings, self.ends = requests, rings, ends
        self.block_table = block_table  # int32 [B, table_width]
        self.compressed_block_table = compressed_block_table  # int32 [B, compressed_table_width]


def _describe(g: CacheGeometry, counts, starts, ends, rings, block_table, compressed_table) -> HostStepMetadata:
    """A step's index arrays from its counts and tables, in time proportional to its rows."""
    num_requests = len(counts)
    query_start_loc = np.zeros(num_requests + 1, np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    rows = int(query_start_loc[-1])
    if rows == num_requests:  # decode: one row per request
        token_to_req = np.arange(num_requests)
        positions = starts
    else:
        token_to_req = np.repeat(np.arange(num_requests), counts)
        positions = np.arange(rows) - query_start_loc[token_to_req] + starts[token_to_req]

    page, ratio, cpage, ring = g.page_size, g.compress_ratio, g.compressed_page_size, g.ring_size
    slot_mapping = block_table[token_to_req, positions // page].astype(np.int64) * page + positions % page
    # A row completes group `group` when its position is the group's last.
    completes = (positions + 1) % ratio == 0
    group = np.where(completes, (positions + 1) // ratio - 1, 0)
    compressed_slots = np.where(
        completes, compressed_table[token_to_req, group // cpage].astype(np.int64) * cpage + group % cpage, -1)
    # The ring keeps the last ring_size positions: distinct slots within a
    # step, and every member of the still-open group.
    in_ring = positions >= ends[token_to_req] - ring
    ring_slots = np.where(in_ring, rings[token_to_req] * ring + positions % ring, -1)

    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    positions32 = i32(positions)
    return HostStepMetadata(
        slot_mapping=i32(slot_mapping),
        positions=positions32,
        raw_positions=np.repeat(positions32[:, None, None], 3, axis=2),
        token_to_req=i32(token_to_req),
        query_start_loc=i32(query_start_loc),
        sequence_lengths=i32(ends),
        block_table=block_table,
        compressed_block_table=compressed_table,
        compressed_slots=i32(compressed_slots),
        compressor_state_block_table=i32(rings[:, None]),
        compressor_state_slots=i32(ring_slots),
    )
