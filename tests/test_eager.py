"""The accelerator's eager path (qsa_torch._accel._eager): a call key run before goes through its prepared program.

Each case runs a call three times through the prepared path and once
through the general path (prepared programs cleared), on copies of the same
inputs: results and updated caches must be bitwise equal, and the steady
calls must not reach the general path.  Then every way a call can differ
from the one prepared -- shapes, strides, dtypes, options and their types,
tuning, devices, fake/meta tensors, grad, inference tensors, observers -- must
either get its own key or take the general path (which raises the errors).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import qsa_torch
from qsa_kernels import tuning
from qsa_kernels.launch import observe_launches
from qsa_torch import _binding
from qsa_torch._accel import _eager, _internals

from .test_torch_ops import CASES, as_tuple, assert_same_results, build, cloned
from .util import DEVICE, assert_bitwise_equal, needs_accelerator

pytestmark = needs_accelerator


@pytest.fixture
def general_calls(monkeypatch):
    """Counts the calls that reach the general eager path."""
    calls = []
    general = _binding._run_call

    def counting(stage, arguments, eager):
        calls.append(stage.name)
        return general(stage, arguments, eager)

    monkeypatch.setattr(_binding, "_run_call", counting)
    _eager.clear()
    yield calls
    _eager.clear()


@pytest.mark.parametrize("case_id", list(CASES))
def test_prepared_calls_equal_the_general_path(case_id, general_calls):
    function, arguments = build(case_id)
    _eager.clear()
    expected_arguments = cloned(arguments)
    expected = function(**expected_arguments)  # general path (nothing prepared)
    assert general_calls == [function.__name__]
    for _ in range(3):
        got_arguments = cloned(arguments)
        got = function(**got_arguments)
        assert_same_results(got, expected, got_arguments, expected_arguments, f"{case_id} prepared")
    assert general_calls == [function.__name__], "a steady call reached the general path"


def test_prepared_step_equals_the_general_path(general_calls):
    from .test_step import STATE_FIELDS, clone_state, valid_arguments

    arguments, _ = valid_arguments()
    state = arguments.pop("state")
    expected_state = clone_state(state)
    expected = qsa_torch.qsa_attention_step(state=expected_state, **arguments, return_token_indices=True)
    for _ in range(2):
        got_state = clone_state(state)
        got = qsa_torch.qsa_attention_step(state=got_state, **arguments, return_token_indices=True)
        assert_bitwise_equal(got[0], expected[0], "out")
        assert_bitwise_equal(got[2], expected[2], "token_indices")
        for name in STATE_FIELDS:
            assert getattr(got[1], name) is getattr(got_state, name), name
            assert_bitwise_equal(getattr(got_state, name), getattr(expected_state, name), name)
    assert general_calls == ["qsa_attention_step"]


def test_a_changed_call_gets_its_own_key(general_calls):
    function, arguments = build("attention")
    function(**cloned(arguments))
    function(**cloned(arguments))
    assert len(general_calls) == 1
    rows = arguments["q"].shape[0]
    changed = {n: v[: rows - 1] if isinstance(v, torch.Tensor) and n in ("q", "token_indices", "token_to_req")
               else v for n, v in cloned(arguments).items()}  # fewer rows: another plan
    function(**changed)
    assert len(general_calls) == 2
    strided = cloned(arguments)
    wide = torch.empty((rows, *arguments["q"].shape[1:-1], 2 * arguments["q"].shape[-1]), dtype=arguments["q"].dtype,
                       device=DEVICE)
    strided["q"] = wide[..., : arguments["q"].shape[-1]]  # same shape, other strides
    strided["q"].copy_(arguments["q"])
    function(**strided)
    assert len(general_calls) == 3
    with tuning.override(attention=tuning.AttentionTuning(tile_bytes=4096)):
        before = len(general_calls)
        function(**cloned(arguments))
        function(**cloned(arguments))
        assert len(general_calls) == before + 1  # its own key, then prepared


def test_option_types_never_share_a_key(general_calls):
    function, arguments = build("topk")
    k = arguments["k"]
    function(**cloned(arguments))
    function(**cloned(arguments))
    for wrong in (float(k), [k]):
        with pytest.raises((TypeError, ValueError), match="topk_blocks"):
            function(**dict(cloned(arguments), k=wrong))
    if k == 1:
        with pytest.raises((TypeError, ValueError), match="topk_blocks"):
            function(**dict(cloned(arguments), k=True))


def test_meta_and_fake_tensors_after_a_prepared_call_never_launch(general_calls):
    function, arguments = build("store")
    function(**cloned(arguments))
    function(**cloned(arguments))
    meta = {n: v.to("meta") if isinstance(v, torch.Tensor) else v for n, v in arguments.items()}
    with observe_launches() as events:
        out = function(**meta)
    assert not events
    assert all(t.is_meta for t in as_tuple(out))


def test_grad_and_inference_rules_hold_after_a_prepared_call(general_calls):
    _, arguments = build("store")
    cache, slots, rows = (arguments[n] for n in ("cache", "slot_mapping", "rows"))
    cache, rows = cache.float(), rows.float()
    for _ in range(2):
        qsa_torch.store_cache_rows(cache.clone(), slots, rows)
    leaf = cache.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="store_cache_rows is not differentiable"):
        qsa_torch.store_cache_rows(leaf, slots, rows)
    with pytest.raises(NotImplementedError, match="store_cache_rows is not differentiable"):
        qsa_torch.store_cache_rows(cache.clone(), slots, rows.clone().requires_grad_())
    with torch.inference_mode():
        inference_cache = cache.clone()
    with pytest.raises(RuntimeError, match="store_cache_rows: cache is updated in place, but it is an inference"):
        qsa_torch.store_cache_rows(inference_cache, slots, rows)


def test_observers_see_every_launch_of_a_prepared_call(general_calls):
    function, arguments = build("attention")
    # Split-K with the merge launch: two launches (AttentionTuning.fused_merge would make it one).
    with tuning.override(attention=tuning.AttentionTuning(fused_merge=False)):
        function(**cloned(arguments))
        function(**cloned(arguments))
        with observe_launches() as events:
            function(**cloned(arguments))
        assert len(events) == len(function.plan(**arguments).runnable_launches) >= 2


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter's device rule")
def test_a_prepared_key_never_accepts_a_wrong_device(general_calls):
    function, arguments = build("store")
    function(**cloned(arguments))
    function(**cloned(arguments))
    moved = {n: v.to("meta") if n == "rows" else v for n, v in cloned(arguments).items()}
    with pytest.raises(ValueError, match="store_cache_rows"):
        function(**moved)


def _carved_spans(carved, total: int, alignment: int) -> list:
    from qsa_kernels.launch import ITEMSIZE

    spans = []
    for _, buffer, offset in carved:
        assert offset % alignment == 0
        size = ITEMSIZE[buffer.dtype]
        for s in buffer.shape:
            size *= s
        spans.append((offset, offset + size))
        assert offset + size <= total
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    return spans


def test_workspaces_are_carved_aligned_and_apart():
    """The schedule's scratch layout: every workspace aligned, none overlapping, results on their own."""
    from qsa_kernels.launch import SCRATCH_ALIGNMENT, Schedule

    function, arguments = build("select")
    program = function.plan(**arguments)
    schedule = Schedule.of(program, tuple(n for n in arguments if isinstance(arguments[n], torch.Tensor)))
    _carved_spans(schedule.scratch, schedule.scratch_bytes, SCRATCH_ALIGNMENT)
    for _, buffer, _ in schedule.scratch:
        assert buffer.name not in program.results and buffer.name not in program.filled_buffers
    assert {b.name for _, b, _ in (*schedule.scratch, *schedule.zeroed, *schedule.allocated)} == \
        {b.name for b in program.buffers}


def test_zeroed_workspaces_share_one_allocation():
    """Workspaces that must start at zero (tickets, histograms) are carved from one zeroed
    allocation, aligned and apart (one fill per call, not one per workspace); a workspace of
    another fill and a filled result keep allocations of their own."""
    import triton

    from qsa_kernels.launch import SCRATCH_ALIGNMENT, Buffer, Launch, Program, Schedule

    @triton.jit
    def reads_five_writes_one(a, tickets, histogram, ones, zero_result, work):
        pass

    @triton.jit
    def reads_two(a, work):
        pass

    buffers = (Buffer("tickets", (3, 2, 2), "int32", fill=0), Buffer("histogram", (5, 7), "float32", fill=0),
               Buffer("ones", (4,), "float32", fill=1.0), Buffer("work", (9,), "float32"),
               Buffer("zero_result", (6,), "int32", fill=0))
    program = Program("synthetic", buffers, (
        Launch(reads_five_writes_one, (1,), ("a", "tickets", "histogram", "ones", "zero_result"), ("work",)),
        Launch(reads_two, (1,), ("a", "work"), ())), ("zero_result",))
    schedule = Schedule.of(program, ("a",))
    assert sorted(b.name for _, b, _ in schedule.zeroed) == ["histogram", "tickets"]
    assert [b.name for _, b, _ in schedule.scratch] == ["work"]
    assert sorted((b.name, fill) for _, b, fill in schedule.allocated) == [("ones", 1.0), ("zero_result", 0)]
    _carved_spans(schedule.zeroed, schedule.zeroed_bytes, SCRATCH_ALIGNMENT)


@pytest.mark.gpu
def test_prepared_binding_follows_pointer_alignment(general_calls):
    """One call key, pointers aligned then not (and back): each alignment class binds its own kernels."""
    generator = torch.Generator(DEVICE).manual_seed(0)
    width, pages, page = 24, 5, 4
    slots = torch.tensor([3, 17, 0, 9, -1, 12, 19], dtype=torch.int32, device=DEVICE)
    for offset in (0, 1, 0, 1, 3, 0, 8, 0):
        storage = torch.randn(pages * page * width + 8, generator=generator, device=DEVICE)
        cache = storage[offset:offset + pages * page * width].view(pages, page, 1, width)
        rows_storage = torch.randn(7 * width + 8, generator=generator, device=DEVICE)
        rows = rows_storage[offset:offset + 7 * width].view(7, width)
        expected = cache.clone().view(-1, width)
        for slot, row in zip(slots.tolist(), rows):
            if slot >= 0:
                expected[slot] = row
        for _ in range(3):
            target = storage.clone()[offset:offset + pages * page * width].view(cache.shape)
            qsa_torch.store_cache_rows(target, slots, rows)
            torch.cuda.synchronize()
            assert torch.equal(target.view(-1, width), expected), offset
    assert general_calls == ["store_cache_rows"]  # one key: the shapes, strides and dtypes never changed


def _kept(region: int) -> list:
    """The kept workspaces of one region (0 scratch, 1 zeroed) of every device, stream and thread."""
    return [pair[region] for pair in _eager._KEPT.values() if pair[region] is not None]


@pytest.mark.parametrize("what", ["topk_ticketed", "attention_fused_merge"])
def test_kept_workspaces_are_reused_and_left_zeroed(what, general_calls):
    """Calls that follow one another share one scratch and one zeroed allocation; the zeroed one is
    all zeros after every call (Buffer.refilled: the last program puts its tickets back), and every
    call gives the reference's result -- tickets left over would give the next call wrong roles."""
    from . import reference
    from .test_select import topk_logits
    from .util import f64, host

    if what == "topk_ticketed":
        topk = dataclasses.replace(tuning.current().topk, path="ticketed", ticketed_slice=16)
        logits = topk_logits(7, 6, 300, special=True).to(DEVICE)
        visible = torch.tensor([300, 4, 0, -5, 303, 150], dtype=torch.int32, device=DEVICE)
        expected = reference.topk_blocks(f64(logits), host(visible), 20)
        override, call = tuning.override(topk=topk), lambda: qsa_torch.topk_blocks(logits, visible, 20)
        check = lambda out: np.testing.assert_array_equal(host(out), expected)  # noqa: E731
    else:
        from .test_attention import MERGE_TILE_BYTES, merge_inputs

        args, expected = merge_inputs()
        override = tuning.override(attention=tuning.AttentionTuning(num_splits=5, tile_bytes=MERGE_TILE_BYTES,
                                                                    fused_merge=True))
        call = lambda: qsa_torch.sparse_paged_attention(**args)  # noqa: E731
        first = []
        check = lambda out: first.append(out) if not first else assert_bitwise_equal(out, first[0], "repeat")  # noqa: E731
    with override:
        results = [call() for _ in range(4)]
        assert len(general_calls) == 1
        program_zeroed = _kept(1)
        assert len(program_zeroed) == 1 and len(_kept(0)) == 1, "one kept pair for this device, stream, thread"
        pointers = (program_zeroed[0].data_ptr(), _kept(0)[0].data_ptr())
        for out in results:
            check(out)
        assert not host(program_zeroed[0]).any(), "the kept zeroed workspace is not all zeros after the calls"
        call()
        assert (_kept(1)[0].data_ptr(), _kept(0)[0].data_ptr()) == pointers, "not reused"


def test_kept_workspaces_are_per_thread(general_calls):
    """Two threads launching on one stream interleave their launches: each gets its own workspaces."""
    import threading

    from .test_select import topk_logits

    topk = dataclasses.replace(tuning.current().topk, path="ticketed", ticketed_slice=16)
    logits = topk_logits(3, 2, 200).to(DEVICE)
    visible = torch.tensor([200, 100], dtype=torch.int32, device=DEVICE)
    outs = []
    with tuning.override(topk=topk):
        outs.append(qsa_torch.topk_blocks(logits, visible, 9))
        outs.append(qsa_torch.topk_blocks(logits, visible, 9))

        def other():
            with tuning.override(topk=topk):  # (a context variable: a new thread starts from the default)
                outs.append(qsa_torch.topk_blocks(logits, visible, 9))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert len({key[2] for key in _eager._KEPT}) == 2 and len(_kept(1)) == 2
    assert len({t.data_ptr() for t in _kept(1)}) == 2
    for out in outs[1:]:
        assert_bitwise_equal(out, outs[0], "threads")


def test_an_op_call_keeps_no_workspace(general_calls):
    """The op's own implementation (what a compiled graph calls) allocates its workspaces per call:
    under reduce-overhead it runs inside the CUDA-graph tree's pool, where a kept allocation would
    be a live tensor the tree does not own (torch refuses the graph)."""
    from . import reference
    from .test_select import topk_logits
    from .util import f64, host

    topk = dataclasses.replace(tuning.current().topk, path="ticketed", ticketed_slice=16)
    logits = topk_logits(5, 4, 300).to(DEVICE)
    visible = torch.tensor([300, 200, 17, 0], dtype=torch.int32, device=DEVICE)
    expected = reference.topk_blocks(f64(logits), host(visible), 11)
    op = torch.ops.qsa.topk_blocks.default
    with tuning.override(topk=topk):
        outs = [op(logits, visible, 11) for _ in range(3)]
    assert _eager._PREPARED, "the op's calls did not take the prepared path"
    assert not _eager._KEPT, "an op call kept a workspace"
    for out in outs:
        np.testing.assert_array_equal(host(out), expected)
    with tuning.override(topk=topk):
        qsa_torch.topk_blocks(logits, visible, 11)
    assert _kept(1), "the public call kept none (the test above shows nothing)"


@pytest.mark.gpu
def test_a_captured_call_keeps_no_workspace(general_calls):
    """A call captured into a CUDA graph allocates its workspaces in the graph's pool: a kept one
    would be baked into the graph and shared with eager calls while the graph replays elsewhere."""
    from .test_select import topk_logits

    topk = dataclasses.replace(tuning.current().topk, path="ticketed", ticketed_slice=16)
    logits = topk_logits(5, 4, 300).to(DEVICE)
    visible = torch.tensor([300, 200, 17, 0], dtype=torch.int32, device=DEVICE)
    with tuning.override(topk=topk):
        expected = qsa_torch.topk_blocks(logits, visible, 11)
        qsa_torch.topk_blocks(logits, visible, 11)
        kept = {key: [t.data_ptr() for t in pair if t is not None] for key, pair in _eager._KEPT.items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = qsa_torch.topk_blocks(logits, visible, 11)
        assert {key: [t.data_ptr() for t in pair if t is not None] for key, pair in _eager._KEPT.items()} == kept
        for _ in range(3):
            captured.fill_(-7)
            graph.replay()
            torch.cuda.synchronize()
            assert_bitwise_equal(captured, expected, "replay")
    assert general_calls == ["topk_blocks"]


# -- recent keys (a C check of the tensors instead of the key's Python) -----


class _CountingMemo(dict):
    gets = 0

    def get(self, *arguments):
        type(self).gets += 1
        return super().get(*arguments)


@pytest.mark.skipif(_internals.tensor_guards() is None, reason="no TensorGuards with this torch")
def test_a_steady_call_matches_its_recent_key_without_the_memo(general_calls, monkeypatch):
    function, arguments = build("attention")
    expected = function(**cloned(arguments))
    memo = _CountingMemo(_eager._PREPARED)
    monkeypatch.setattr(_eager, "_PREPARED", memo)
    function(**cloned(arguments))  # the memo's key, kept as recent
    assert memo.gets == 1
    for _ in range(3):
        assert_bitwise_equal(function(**cloned(arguments)), expected, "out")
    assert memo.gets == 1, "a steady call built its key and looked it up"
    assert general_calls == [function.__name__]


def test_metadata_changed_in_place_after_a_prepared_call_is_keyed_again(general_calls):
    function, arguments = build("store")
    cache, slots, rows = (arguments[n].clone() for n in ("cache", "slot_mapping", "rows"))
    for _ in range(3):  # the same tensor objects every call
        qsa_torch.store_cache_rows(cache, slots, rows)
    assert general_calls == ["store_cache_rows"]
    # Same shape, other strides, in place (the same Python object): another key.
    wide = torch.zeros((*cache.shape[:-1], 2 * cache.shape[-1]), dtype=cache.dtype, device=DEVICE)
    cache.set_(wide.untyped_storage(), 0, cache.shape, wide.stride())
    cache.copy_(arguments["cache"])
    expected = arguments["cache"].clone()
    reference = qsa_torch.store_cache_rows(expected, slots, rows)
    qsa_torch.store_cache_rows(cache, slots, rows)
    assert_bitwise_equal(cache, reference, "cache with other strides")
    assert len(general_calls) == 2  # the reference's key (contiguous) was prepared; the strided one was not
    cache.resize_(*cache.shape[:-1], cache.shape[-1] - 1)  # a shape the plan refuses
    with pytest.raises(ValueError, match="store_cache_rows"):
        qsa_torch.store_cache_rows(cache, slots, rows)


def test_requires_grad_after_a_no_grad_call_still_raises(general_calls):
    _, arguments = build("store")
    cache, slots, rows = arguments["cache"].float(), arguments["slot_mapping"], arguments["rows"].float()
    rows.requires_grad_()
    with torch.no_grad():  # allowed under no_grad, and prepared
        for _ in range(3):
            qsa_torch.store_cache_rows(cache.clone(), slots, rows)
    with pytest.raises(NotImplementedError, match="store_cache_rows is not differentiable"):
        qsa_torch.store_cache_rows(cache.clone(), slots, rows)
    plain = rows.detach()
    for _ in range(2):
        qsa_torch.store_cache_rows(cache.clone(), slots, plain)
    plain.requires_grad_()  # the same object, now requiring grad
    with pytest.raises(NotImplementedError, match="store_cache_rows is not differentiable"):
        qsa_torch.store_cache_rows(cache.clone(), slots, plain)


def test_without_tensor_guards_calls_are_prepared_the_same(general_calls, monkeypatch):

    function, arguments = build("attention")
    expected = function(**cloned(arguments))
    monkeypatch.setattr(_internals, "_guards", [None])
    for _ in range(3):
        assert_bitwise_equal(function(**cloned(arguments)), expected, "out")
    assert not _eager._RECENT
    assert general_calls == [function.__name__]


def test_tensor_guards_that_accept_too_much_fail_the_self_test(monkeypatch):

    class Permissive:
        def __init__(self, *tensors, dynamic_dims_sizes, dynamic_dims_strides):
            pass

        def check(self, *tensors):
            return True

    monkeypatch.setenv("QSA_TENSOR_GUARDS", "1")
    monkeypatch.setattr(torch._C._dynamo.guards, "TensorGuards", Permissive)
    with pytest.warns(RuntimeWarning, match="TensorGuards failed qsa's self-test"):
        assert _internals._checked_guards() is None
    monkeypatch.setenv("QSA_TENSOR_GUARDS", "0")
    assert _internals._checked_guards() is None
    monkeypatch.undo()
    monkeypatch.setenv("QSA_TENSOR_GUARDS", "1")
    assert _internals._checked_guards() is torch._C._dynamo.guards.TensorGuards


def test_an_absent_array_given_or_a_present_one_omitted_is_keyed_again(general_calls):
    """A recent key holds which arrays were absent: a call that gives one of them, or omits a present
    one, takes the binding's path (here: its errors), never the recent key."""
    _, arguments = build("store")
    cache, slots, rows = (arguments[n] for n in ("cache", "slot_mapping", "rows"))
    for _ in range(3):
        qsa_torch.store_cache_rows(cache.clone(), slots, rows)
    assert general_calls == ["store_cache_rows"]
    scale = torch.ones((), dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="store_cache_rows"):  # a scale with a cache that takes none
        qsa_torch.store_cache_rows(cache.clone(), slots, rows, scale=scale)
    with pytest.raises((TypeError, ValueError), match="store_cache_rows"):
        qsa_torch.store_cache_rows(cache.clone(), slots, None)
    assert general_calls == ["store_cache_rows"]  # (the binding's checks raised, before any run)
    expected = cache.clone()
    _eager.clear()
    qsa_torch.store_cache_rows(expected, slots, rows)  # the general path
    got = cache.clone()
    qsa_torch.store_cache_rows(got, slots, rows)  # the recent key again
    assert_bitwise_equal(got, expected, "cache")
