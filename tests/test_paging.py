"""The pager (qsa_kernels.paging.PagedRequests) against an independent, obviously-correct model.

* random sequences of steps, admits and releases, failed calls among them:
  every step's metadata equals the model's construction token by token, and
  a failed call changes nothing (the model applies a call to a copy of its
  state and keeps the copy only if nothing raised);
* the clear errors of issue 13 (bad counts and lengths, bad geometry,
  unknown or twice-released requests);
* the table contract: a step of the same batch reuses the last step's tables,
  filling in new pages only, so earlier metadata still describes its own step;
  ``StepMetadata.from_host`` copies.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

import numpy as np
import pytest
import torch

import qsa_jax
import qsa_torch
from qsa_kernels.paging import METADATA_FIELDS, CacheGeometry, PagedRequests


class ModelPager:
    """The pager's contract, one token at a time: free lists popped from the end,
    pages allocated in batch order (rings, then KV pages, then compressed pages,
    each list on its own), returned in reverse on release."""

    def __init__(self, g: CacheGeometry, seed: int):
        self.g = g
        order = lambda n: np.random.default_rng(seed).permutation(n)  # noqa: E731 (one generator per pool)
        self.free = {"ring": [int(x) for x in order(g.max_requests)[::-1]],
                     "kv": [int(x) for x in order(g.num_pages)[::-1]],
                     "compressed": [int(x) for x in order(g.num_compressed_pages)[::-1]]}
        self.requests: dict = {}  # request -> dict(length, ring, kv pages, compressed pages)

    def _grow(self, request, length: int) -> None:
        g = self.g
        if length > g.max_context:
            raise ValueError("past max_context")
        state = self.requests.get(request)
        if state is None:
            if not self.free["ring"]:
                raise ValueError("out of rings")
            state = self.requests[request] = dict(length=0, ring=self.free["ring"].pop(), kv=[], compressed=[])
        while len(state["kv"]) * g.page_size < length:
            if not self.free["kv"]:
                raise ValueError("out of KV pages")
            state["kv"].append(self.free["kv"].pop())
        while len(state["compressed"]) * g.compressed_page_size < length // g.compress_ratio:
            if not self.free["compressed"]:
                raise ValueError("out of compressed pages")
            state["compressed"].append(self.free["compressed"].pop())

    def _transaction(self, change):
        trial = copy.deepcopy(self)
        result = change(trial)  # raises: self unchanged
        self.__dict__.update(trial.__dict__)
        return result

    def admit(self, request, length):
        def change(m):
            if not (type(length) is int and length >= 0) or request in m.requests:
                raise ValueError("bad admit")
            m._grow(request, length)
            m.requests[request]["length"] = length
        self._transaction(change)

    def release(self, request):
        def change(m):
            state = m.requests.pop(request)  # KeyError: an unknown request
            m.free["kv"] += state["kv"][::-1]
            m.free["compressed"] += state["compressed"][::-1]
            m.free["ring"].append(state["ring"])
        try:
            self._transaction(change)
        except KeyError:
            raise ValueError("not in flight") from None

    def step(self, new_tokens: dict) -> dict:
        def change(m):
            if not new_tokens or any(type(n) is not int or n < 1 for n in new_tokens.values()):
                raise ValueError("bad counts")
            # Grow rings first for every new request (in batch order), as the pools are independent.
            for request, n in new_tokens.items():
                m._grow(request, (m.requests[request]["length"] if request in m.requests else 0) + n)
            return m._describe(new_tokens)
        return self._transaction(change)

    def _describe(self, new_tokens: dict) -> dict:
        g = self.g
        out = {name: [] for name in METADATA_FIELDS}
        out["query_start_loc"] = [0]
        for b, (request, n) in enumerate(new_tokens.items()):
            state = self.requests[request]
            start, end = state["length"], state["length"] + n
            for position in range(start, end):
                out["slot_mapping"].append(state["kv"][position // g.page_size] * g.page_size + position % g.page_size)
                out["positions"].append(position)
                out["raw_positions"].append([[position] * 3])
                out["token_to_req"].append(b)
                if (position + 1) % g.compress_ratio == 0:
                    group = position // g.compress_ratio
                    page = state["compressed"][group // g.compressed_page_size]
                    out["compressed_slots"].append(page * g.compressed_page_size + group % g.compressed_page_size)
                else:
                    out["compressed_slots"].append(-1)
                keep = position >= end - g.ring_size  # the last ring_size positions
                out["compressor_state_slots"].append(
                    state["ring"] * g.ring_size + position % g.ring_size if keep else -1)
            state["length"] = end
            out["query_start_loc"].append(out["query_start_loc"][-1] + n)
            out["sequence_lengths"].append(end)
            out["block_table"].append(state["kv"] + [-1] * (g.table_width - len(state["kv"])))
            out["compressed_block_table"].append(
                state["compressed"] + [-1] * (g.compressed_table_width - len(state["compressed"])))
            out["compressor_state_block_table"].append([state["ring"]])
        return {name: np.array(values, np.int32) for name, values in out.items()}

    @property
    def lengths(self) -> dict:
        return {r: s["length"] for r, s in self.requests.items()}


def _assert_same_state(pager: PagedRequests, model: ModelPager, what: str) -> None:
    assert pager.lengths == model.lengths, what
    assert pager._free_pages == model.free["kv"], what
    assert pager._free_compressed == model.free["compressed"], what
    assert pager._free_rings == model.free["ring"], what


def _assert_same_metadata(meta, expected: dict, what: str) -> None:
    for name in METADATA_FIELDS:
        value = getattr(meta, name)
        assert value.dtype == np.int32, f"{what}: {name} dtype {value.dtype}"
        assert value.shape == expected[name].shape and np.array_equal(value, expected[name]), (
            f"{what}: metadata.{name}\n{value}\n{expected[name]}")


GEOMETRIES = [
    CacheGeometry(page_size=4, num_pages=24, compress_ratio=4, compressed_page_size=2, num_compressed_pages=10,
                  max_context=40, max_requests=4, ring_size=6),
    CacheGeometry(page_size=3, num_pages=30, compress_ratio=2, compressed_page_size=3, num_compressed_pages=14,
                  max_context=25, max_requests=3),
    CacheGeometry(page_size=8, num_pages=12, compress_ratio=8, compressed_page_size=1, num_compressed_pages=9,
                  max_context=64, max_requests=5, ring_size=8),
]


@pytest.mark.parametrize("seed", range(12))
def test_pager_equals_the_model_through_failed_calls(seed):
    g = GEOMETRIES[seed % len(GEOMETRIES)]
    rng = np.random.default_rng(seed)
    pager, model = PagedRequests(g, seed=seed), ModelPager(g, seed)
    names = [f"r{i}" for i in range(8)]
    failures = successes = 0
    for call in range(120):
        in_flight = list(model.requests)
        kind = rng.choice(["step", "step", "step", "decode", "decode", "admit", "release", "release", "bad"])
        if kind in ("step", "decode"):
            pool = in_flight + [str(rng.choice(names))] if in_flight and rng.random() < 0.7 else names
            chosen = list(rng.choice(pool, size=min(len(set(pool)), int(rng.integers(1, 5))), replace=False))
            if kind == "decode" and in_flight:
                chosen = in_flight  # the same batch again: the tables are reused
            counts = {str(r): 1 if kind == "decode" or rng.random() < 0.6 else int(rng.integers(1, 12)) for r in chosen}
            args = ("step", counts)
        elif kind == "admit":
            args = ("admit", str(rng.choice(names)), int(rng.integers(0, g.max_context + 4)))
        elif kind == "release":
            args = ("release", str(rng.choice(in_flight if in_flight and rng.random() < 0.8 else names)))  # unknown ones too
        else:
            r = str(rng.choice(in_flight or names))
            args = ("step", {r: [0, -1, 2.7, "3", True, None, np.float64(2.0)][int(rng.integers(0, 7))]})
        what = f"call {call}: {args}"
        try:
            expected = getattr(model, args[0])(*args[1:])
        except ValueError:
            before = dict(pager.lengths)
            with pytest.raises(ValueError, match="^PagedRequests: "):
                getattr(pager, args[0])(*args[1:])
            assert pager.lengths == before
            failures += 1
        else:
            result = getattr(pager, args[0])(*args[1:])
            if args[0] == "step":
                _assert_same_metadata(result, expected, what)
            successes += 1
        _assert_same_state(pager, model, what)
    assert failures > 10 and successes > 40, (failures, successes)


def test_failed_step_registers_nothing():
    """Bug (issue 13): a failed step left the requests new in that call registered, holding a
    ring and pages; then ``admit`` said "already in flight" and valid steps ran out of rings."""
    g = CacheGeometry(page_size=4, num_pages=6, compress_ratio=2, compressed_page_size=2, num_compressed_pages=6,
                      max_context=16, max_requests=2)
    pager = PagedRequests(g)
    free = (list(pager._free_pages), list(pager._free_compressed), list(pager._free_rings))
    for bad, message in (({"a": 3, "b": 17}, "past max_context = 16"), ({"a": 3, "b": 2.5}, "must be a positive int"),
                         ({"a": 13, "b": 13}, "out of KV pages"), ({"a": 1, "b": 1, "c": 1}, "out of compressor-state rings")):
        with pytest.raises(ValueError, match=message):
            pager.step(bad)
        assert pager.lengths == {} and (pager._free_pages, pager._free_compressed, pager._free_rings) == free
    pager.admit("b", 2)
    meta = pager.step({"a": 3, "b": 1})
    assert meta.sequence_lengths.tolist() == [3, 3]


@pytest.mark.parametrize("call, message", [
    (lambda p: p.admit("x", -5), "admit: length must be a non-negative int, got -5"),
    (lambda p: p.admit("x", 2.0), "admit: length must be a non-negative int, got 2.0"),
    (lambda p: p.admit("x", True), "admit: length must be a non-negative int, got True"),
    (lambda p: p.step({"x": 2.7}), "step: the new token count of request 'x' must be a positive int, got 2.7"),
    (lambda p: p.step({"x": "3"}), "step: the new token count of request 'x' must be a positive int, got '3'"),
    (lambda p: p.step({"x": True}), "step: the new token count of request 'x' must be a positive int, got True"),
    (lambda p: p.step({"x": 0}), "a step needs at least one request and one token per request"),
    (lambda p: p.step({}), "a step needs at least one request"),
    (lambda p: p.step([("x", 1)]), "step: new_tokens must be a mapping"),
    (lambda p: p.release("nobody"), "release: request 'nobody' is not in flight"),
])
def test_pager_rejects_bad_calls_clearly(call, message):
    pager = PagedRequests(GEOMETRIES[0])
    with pytest.raises(ValueError) as info:
        call(pager)
    assert str(info.value).startswith("PagedRequests: ") and message in str(info.value), str(info.value)
    assert pager.lengths == {}


def test_release_twice_is_a_clear_error():
    pager = PagedRequests(GEOMETRIES[0])
    pager.step({"x": 5})
    pager.release("x")
    with pytest.raises(ValueError, match="release: request 'x' is not in flight"):
        pager.release("x")


def test_numpy_integer_counts_are_counts():
    pager = PagedRequests(GEOMETRIES[0])
    pager.admit("x", np.int64(5))
    assert pager.step({"x": np.int32(2)}).sequence_lengths.tolist() == [7]


@pytest.mark.parametrize("field, value", [("page_size", True), ("ring_size", 2.5), ("num_pages", 4.0),
                                          ("max_requests", 0), ("ring_size", True), ("compress_ratio", "4")])
def test_geometry_rejects_non_ints(field, value):
    sizes = dict(page_size=4, num_pages=8, compress_ratio=2, compressed_page_size=2, num_compressed_pages=4,
                 max_context=16, max_requests=2)
    with pytest.raises(ValueError, match=f"CacheGeometry: {field} must be a positive int, got {value!r}"):
        CacheGeometry(**{**sizes, field: value})


def test_same_batch_tables_fill_in_place_and_old_metadata_stays_right():
    """The documented contract: a decode loop's tables are updated in place (new pages only)."""
    g = CacheGeometry(page_size=2, num_pages=40, compress_ratio=2, compressed_page_size=2, num_compressed_pages=40,
                      max_context=30, max_requests=3)
    pager = PagedRequests(g, seed=1)
    first = pager.step({"a": 3, "b": 1})
    frozen = {name: getattr(first, name).copy() for name in METADATA_FIELDS}
    later = [pager.step({"a": 1, "b": 1}) for _ in range(5)]
    assert all(m.block_table is first.block_table for m in later), "a decode loop reuses the tables"
    for name in METADATA_FIELDS:
        now, then = getattr(first, name), frozen[name]
        if name in ("block_table", "compressed_block_table"):
            changed = now != then
            assert (then[changed] == -1).all(), f"{name}: only unallocated entries change"
            for b, length in enumerate(first.sequence_lengths):  # what the first step uses is as it was
                used = -(-int(length) // g.page_size) if name == "block_table" else int(length) // 2 // 2
                assert np.array_equal(now[b, :used], then[b, :used])
        else:
            assert np.array_equal(now, then), f"{name} of an earlier step changed"
    snapshot = first.block_table.copy()
    other = pager.step({"b": 1, "a": 1})  # another order: another batch, new arrays; the old ones untouched
    assert other.block_table is not first.block_table
    assert np.array_equal(first.block_table, snapshot)
    assert np.array_equal(other.block_table[:, :3], snapshot[::-1, :3])


def test_from_host_copies():
    pager = PagedRequests(GEOMETRIES[0])
    host = pager.step({"x": 3})
    torch_meta = qsa_torch.StepMetadata.from_host(host)
    jax_meta = qsa_jax.StepMetadata.from_host(host)
    expected = host.block_table.copy()
    host.block_table[0, :] = 99
    assert np.array_equal(torch_meta.block_table.numpy(), expected)
    assert np.array_equal(np.asarray(jax_meta.block_table), expected)
    assert isinstance(torch_meta.block_table, torch.Tensor) and torch_meta.block_table.dtype == torch.int32


# --------------------------------------------------------------------------
# Widths (issue 28, item 6): int32 metadata, counts as Python integers
# --------------------------------------------------------------------------

def _frozen(value):
    """A comparable deep copy of the pager's state: arrays by dtype, shape and bytes."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return ("dict", tuple((key, _frozen(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(map(_frozen, value)))
    if hasattr(value, "__slots__"):  # the pager's _Batch
        return (type(value).__name__, tuple((name, _frozen(getattr(value, name))) for name in value.__slots__))
    return value


def snapshot(pager: PagedRequests):
    return _frozen(dict(vars(pager)))


@pytest.mark.parametrize("field, sizes, got", [
    ("num_pages * page_size", dict(page_size=64, num_pages=2**25), 2**31),
    ("num_compressed_pages * compressed_page_size", dict(compressed_page_size=2**16, num_compressed_pages=2**15), 2**31),
    ("max_requests * ring_size", dict(max_requests=2**29, ring_size=4), 2**31),
    ("max_context", dict(max_context=2**31), 2**31),
])
def test_geometry_refuses_pools_past_int32(field, sizes, got):
    """Bug: a pool of 2**31 slots or more was accepted and slot_mapping cast to int32
    silently (the wrapped slot is a live slot of another page)."""
    base = dict(page_size=4, num_pages=8, compress_ratio=2, compressed_page_size=2, num_compressed_pages=4,
                max_context=16, max_requests=2)
    with pytest.raises(ValueError) as info:
        CacheGeometry(**{**base, **sizes})
    assert str(info.value) == (f"CacheGeometry: {field} must be at most 2**31 - 1 (the step's metadata is int32), "
                               f"got {got}")
    # One slot fewer is a valid geometry.
    if field == "num_pages * page_size":
        CacheGeometry(**{**base, "page_size": 1, "num_pages": 2**31 - 1, "max_context": 16})


@pytest.mark.parametrize("call, message", [
    # Bug: 2**63 - 1 wrapped in int64, passed the checks and changed the pager before NumPy failed.
    # ("a" holds 5 tokens: 5 + 2**63 - 1 wraps to a negative length.)
    (lambda p: p.step({"a": 2**63 - 1}), "request 'a' would reach 9223372036854775812 tokens, past max_context = 40"),
    (lambda p: p.step({"b": 1, "a": 2**63 - 4}), "request 'a' would reach 9223372036854775809 tokens"),
    # Bug: counts of 2**63 and up raised a bare OverflowError.
    (lambda p: p.step({"x": 2**63}), "request 'x' would reach 9223372036854775808 tokens, past max_context = 40"),
    (lambda p: p.step({"a": 2, "x": 2**70}), "would reach 1180591620717411303424 tokens"),
    (lambda p: p.step({"x": -2**70}), "a step needs at least one request and one token per request"),
    (lambda p: p.step({"a": np.uint64(2**63)}), "request 'a' would reach 9223372036854775813 tokens"),
    (lambda p: p.admit("x", 2**63), "request 'x' would reach 9223372036854775808 tokens, past max_context = 40"),
    (lambda p: p.admit("x", 2**63 - 1), "past max_context = 40"),
    # Bug: unhashable ids raised Python's own TypeError, naming no call.
    (lambda p: p.admit(["x"], 2), "admit: a request must be hashable (it is a dict key), got list ['x']"),
    (lambda p: p.release({"x": 1}), "release: a request must be hashable (it is a dict key), got dict {'x': 1}"),
    (lambda p: p.step(_ListKeyed([(["x"], 1)])), "step: a request must be hashable (it is a dict key), got list ['x']"),
])
def test_overflowing_counts_and_unhashable_ids_change_nothing(call, message):
    """The pager's own ValueError, raised before anything changes: the state is identical
    (a deep snapshot) and later calls work as if the failed one had not happened."""
    pager, twin = PagedRequests(GEOMETRIES[0], seed=3), PagedRequests(GEOMETRIES[0], seed=3)
    for p in (pager, twin):
        p.step({"a": 5})
    before = snapshot(pager)
    with pytest.raises(ValueError) as info:
        call(pager)
    assert str(info.value).startswith("PagedRequests: ") and message in str(info.value), str(info.value)
    assert snapshot(pager) == before
    expected = twin.step({"a": 1, "b": 3})
    _assert_same_metadata(pager.step({"a": 1, "b": 3}), {n: getattr(expected, n) for n in METADATA_FIELDS}, "next step")


class _ListKeyed(Mapping):
    """A Mapping whose keys need not be hashable (a dict's must be)."""

    def __init__(self, items):
        self._items = list(items)

    def __getitem__(self, key):
        return next(value for k, value in self._items if k == key)

    def __iter__(self):
        return iter(k for k, _ in self._items)

    def __len__(self):
        return len(self._items)
