"""Host time of the pager (``PagedRequests.step``) per step, before and after issue 13.

Geometry of the production model at 128K context: KV pages of 64, compress
ratio 4, compressed pages of 64, ``max_context`` = 131072; ``B`` requests of
about 32K tokens each (admitted), then:

* ``decode``: every request decodes one row (the same batch each step);
* ``mixed``: ``B - 1`` requests decode while one prefills chunks of 512 rows
  (the same batch each step);
* ``join``: a request joins a decode batch (a new batch: the new pager
  gathers its table rows, the only step whose cost grows with ``max_context``).

``before`` is the pager as it was (a copy is kept below: it rebuilt the
full-width block tables every step); ``after`` is ``qsa_kernels.paging``.
Both are fed the same calls and their metadata are checked equal.  Median of
repeated steps, microseconds of host (CPU) time; timings depend on the host.

    PYTHONPATH=.:.pypath python benchmarks/bench_pager.py [--out benchmarks/results/h200/pager.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from typing import Hashable, Mapping

import numpy as np

from qsa_kernels.paging import CacheGeometry, HostStepMetadata, METADATA_FIELDS, PagedRequests

MAX_CONTEXT = 128 * 1024
CONTEXT = 32 * 1024
CHUNK = 512


def geometry(requests: int) -> CacheGeometry:
    pages = requests * (CONTEXT + 8 * CHUNK + 64 * 64) // 64 + 64
    return CacheGeometry(page_size=64, num_pages=pages, compress_ratio=4, compressed_page_size=64,
                         num_compressed_pages=pages // 4 + 64, max_context=MAX_CONTEXT, max_requests=requests + 1)


# ---------------------------------------------------------------------------
# The pager before issue 13 (kernels/paging.py at 9b5ea8f), kept for comparison.
# ---------------------------------------------------------------------------

class OldPagedRequests:
    """:class:`PagedRequests` as it was at 9b5ea8f: the same interface (``step``, ``release``,
    ``admit``, ``seed``: its docstring), but each step rebuilt the full-width block tables."""

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

        block_table = _old_table([self._pages[r] for r in requests], g.table_width)
        compressed_table = _old_table([self._compressed[r] for r in requests], g.compressed_table_width)
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


def _old_table(pages_per_request: list[list[int]], width: int) -> np.ndarray:
    """Rows of physical pages, padded with -1 to ``width``."""
    table = np.full((len(pages_per_request), width), -1, np.int64)
    for row, pages in enumerate(pages_per_request):
        table[row, : len(pages)] = pages
    return table


# ---------------------------------------------------------------------------


def _same(a: HostStepMetadata, b: HostStepMetadata) -> None:
    for name in METADATA_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), f"metadata.{name} differs between the pagers"


def _timed(pager, calls: list[dict], repeats: int) -> tuple[float, list]:
    """Median µs per call of ``pager.step`` over the calls (repeated), and the last metadata of each."""
    times, last = [], []
    for _ in range(repeats):
        for new_tokens in calls:
            start = time.perf_counter()
            meta = pager.step(new_tokens)
            times.append(time.perf_counter() - start)
            last.append(meta)
    return statistics.median(times) * 1e6, last[-len(calls):]


def measure(requests: int, steps: int) -> dict:
    result = {"requests": requests, "max_context": MAX_CONTEXT, "context": CONTEXT}
    g = geometry(requests)
    pagers = {"before": OldPagedRequests(g, seed=0), "after": PagedRequests(g, seed=0)}
    names = list(range(requests))
    for pager in pagers.values():
        for r in names:
            pager.admit(r, CONTEXT + 3 * r)
    decode = {r: 1 for r in names}
    mixed = {**{r: 1 for r in names[:-1]}, names[-1]: CHUNK}
    for shape, calls, repeats in (("decode", [decode], steps), ("mixed", [mixed], max(4, steps // 16))):
        metas = {}
        for label, pager in pagers.items():
            pager.step(calls[0])  # a first step of the batch (the new pager's rebuild)
            result[f"{shape}_{label}_us"], metas[label] = _timed(pager, calls, repeats)
        _same(metas["before"][-1], metas["after"][-1])
    # A request joins a decode batch (a new batch); median over joins of fresh requests.
    metas, times = {}, {label: [] for label in pagers}
    for join in range(max(4, steps // 16)):
        batch = {**{r: 1 for r in names[1:]}, ("new", join): 1}
        for label, pager in pagers.items():
            pager.release(names[0] if join == 0 else ("new", join - 1))
            start = time.perf_counter()
            metas[label] = pager.step(batch)
            times[label].append(time.perf_counter() - start)
        _same(metas["before"], metas["after"])
    for label in pagers:
        result[f"join_{label}_us"] = statistics.median(times[label]) * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="*", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", "--json", dest="out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    rows = [measure(b, args.steps) for b in args.requests]
    report = {"host": platform.processor() or platform.machine(), "python": platform.python_version(),
              "numpy": np.__version__, "note": "host (CPU) microseconds per PagedRequests.step, median", "rows": rows}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
