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
from typing import Hashable, Mapping

import numpy as np

__all__ = ["CacheGeometry", "HostStepMetadata", "PagedRequests", "METADATA_FIELDS", "STATE_FIELDS"]

#: The caches of one QSA attention layer, in the order of ``QSAState``'s fields.
STATE_FIELDS = ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache")


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Sizes of one layer's caches; everything a step's shapes depend on but ``T`` and ``B``.

    ``ring_size`` defaults to ``compress_ratio`` (it may be larger, never smaller).
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
                     "num_compressed_pages", "max_context", "max_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CacheGeometry: {name} must be a positive int, got {value!r}")
        if self.ring_size is None:
            object.__setattr__(self, "ring_size", self.compress_ratio)
        if self.ring_size < self.compress_ratio:
            raise ValueError(f"CacheGeometry: ring_size must be at least compress_ratio = "
                             f"{self.compress_ratio}, got {self.ring_size}")

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

    ``seed`` shuffles the free lists, so pages of one request are scattered
    over the pool as in a long-running server.
    """

    def __init__(self, geometry: CacheGeometry, *, seed: int | None = None):
        self.geometry = geometry
        order = (lambda n: np.random.default_rng(seed).permutation(n)) if seed is not None else np.arange
        self._free_pages = list(order(geometry.num_pages)[::-1])
        self._free_compressed = list(order(geometry.num_compressed_pages)[::-1])
        self._free_rings = list(order(geometry.max_requests)[::-1])
        self.lengths: dict[Hashable, int] = {}
        self._pages: dict[Hashable, list[int]] = {}
        self._compressed: dict[Hashable, list[int]] = {}
        self._ring: dict[Hashable, int] = {}

    def _take(self, free: list, count: int, what: str) -> list[int]:
        if count > len(free):
            raise ValueError(f"PagedRequests: out of {what}: {count} needed, {len(free)} free")
        return [int(free.pop()) for _ in range(count)]

    def _grow(self, request: Hashable, length: int) -> None:
        g = self.geometry
        if length > g.max_context:
            raise ValueError(f"PagedRequests: request {request!r} would reach {length} tokens, "
                             f"past max_context = {g.max_context}")
        if request not in self._ring:
            self._ring[request] = self._take(self._free_rings, 1, "compressor-state rings (max_requests)")[0]
            self._pages[request], self._compressed[request] = [], []
            self.lengths[request] = 0
        pages, compressed = self._pages[request], self._compressed[request]
        pages += self._take(self._free_pages, -(-length // g.page_size) - len(pages), "KV pages")
        groups = length // g.compress_ratio
        compressed += self._take(self._free_compressed, -(-groups // g.compressed_page_size) - len(compressed),
                                 "compressed-key pages")

    def admit(self, request: Hashable, length: int) -> None:
        """Register ``request`` with ``length`` tokens already written into the caches."""
        if request in self.lengths:
            raise ValueError(f"PagedRequests: request {request!r} is already in flight")
        self._grow(request, length)
        self.lengths[request] = length

    def release(self, request: Hashable) -> None:
        """Return a finished request's pages and ring block to the pools."""
        self._free_pages += self._pages.pop(request)[::-1]
        self._free_compressed += self._compressed.pop(request)[::-1]
        self._free_rings.append(self._ring.pop(request))
        del self.lengths[request]

    def step(self, new_tokens: Mapping[Hashable, int]) -> HostStepMetadata:
        """Allocate for and describe one step: ``new_tokens[request]`` rows of each request."""
        g = self.geometry
        requests = list(new_tokens)
        counts = np.array([new_tokens[r] for r in requests], np.int64)
        if len(requests) == 0 or (counts < 1).any():
            raise ValueError(f"PagedRequests: a step needs at least one request and one token per request, got {dict(new_tokens)}")
        starts = np.array([self.lengths.get(r, 0) for r in requests], np.int64)
        ends = starts + counts
        for request, end in zip(requests, ends):
            self._grow(request, int(end))

        block_table = _table([self._pages[r] for r in requests], g.table_width)
        compressed_table = _table([self._compressed[r] for r in requests], g.compressed_table_width)
        rings = np.array([[self._ring[r]] for r in requests], np.int64)

        query_start_loc = np.concatenate([[0], np.cumsum(counts)])
        token_to_req = np.repeat(np.arange(len(requests)), counts)
        positions = np.arange(query_start_loc[-1]) - query_start_loc[token_to_req] + starts[token_to_req]

        slot_mapping = block_table[token_to_req, positions // g.page_size] * g.page_size + positions % g.page_size
        # A row completes group `group` when its position is the group's last.
        ratio, cpage = g.compress_ratio, g.compressed_page_size
        completes = (positions + 1) % ratio == 0
        group = np.where(completes, (positions + 1) // ratio - 1, 0)
        compressed_slots = np.where(
            completes, compressed_table[token_to_req, group // cpage] * cpage + group % cpage, -1)
        # The ring keeps the last ring_size positions: distinct slots within a
        # step, and every member of the still-open group.
        in_ring = positions >= ends[token_to_req] - g.ring_size
        ring_slots = np.where(in_ring, rings[token_to_req, 0] * g.ring_size + positions % g.ring_size, -1)

        for request, end in zip(requests, ends):
            self.lengths[request] = int(end)
        i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
        return HostStepMetadata(
            slot_mapping=i32(slot_mapping),
            positions=i32(positions),
            raw_positions=i32(np.repeat(positions[:, None, None], 3, axis=2)),
            token_to_req=i32(token_to_req),
            query_start_loc=i32(query_start_loc),
            sequence_lengths=i32(ends),
            block_table=i32(block_table),
            compressed_block_table=i32(compressed_table),
            compressed_slots=i32(compressed_slots),
            compressor_state_block_table=i32(rings),
            compressor_state_slots=i32(ring_slots),
        )


def _table(pages_per_request: list[list[int]], width: int) -> np.ndarray:
    """Rows of physical pages, padded with -1 to ``width``."""
    table = np.full((len(pages_per_request), width), -1, np.int64)
    for row, pages in enumerate(pages_per_request):
        table[row, : len(pages)] = pages
    return table
