"""qsa_torch's functions as torch custom ops: torch.compile, opcheck, fake and meta tensors, export, fork.

Inputs are sanitize.py's small adversarial cases (indices to skip, shared
pages, invalid requests), one per public function.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qsa_torch
from qsa_kernels import runtime
from qsa_kernels import step as _step
from qsa_kernels.launch import observe_launches
from qsa_kernels.stage import stage_named
from qsa_torch import _binding
from qsa_torch._accel import _internals

from .util import DEVICE, assert_bitwise_equal

OWN_KERNELS = _binding.hook is not None and _internals.OWN_OP_KERNELS  # the accelerator's (qsa_torch._accel._ops)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import sanitize  # noqa: E402

CASES = {  # test id -> (sanitize case, option changes)
    "rope": ("rope_paged_fp16_gptj", {}),
    "rope_no_zeros": ("rope_flash_bf16_swa_offsets", dict(return_zeros=False)),  # one result fewer: another op
    "compress": ("compress_decode_fp32_d96", {}),
    "store": ("store_int64_w3_rows3d_slots32", {}),
    "scores": ("scores_fp32_q_bf16_cache", {}),
    "topk": ("topk_decode_ties", {}),
    "expand": ("expand", {}),
    "select": ("select_decode", {}),
    "attention": ("attention_decode_split_k", {}),  # split-K, then the merge launch
}


def build(case_id: str):
    """``(public function, arguments by name)`` for one case, as fresh CPU/GPU tensors."""
    case, changes = CASES[case_id]
    index = next(i for i, (name, _, _) in enumerate(sanitize.CASES) if name == case)
    function, arrays, static, _ = sanitize.CASES[index][2](np.random.default_rng(index), True)
    static.pop("_logits_workspace_bytes", None)
    runner = sanitize.TorchRunner.__new__(sanitize.TorchRunner)
    runner.torch, runner.device = torch, DEVICE
    tensors = {n: (None if a is None else runner.put(a)) for n, a in arrays.items()}
    return getattr(qsa_torch, function), dict(tensors, **dict(static, **changes))


def cloned(arguments: dict) -> dict:
    return {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in arguments.items()}


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def op_and_values(function, arguments):
    program = function.plan(**arguments)
    op, values = _binding.op_call(stage_named(function.__name__), arguments)
    return op, values, program


def assert_same_results(got, expected, got_arguments, expected_arguments, what):
    got, expected = as_tuple(got), as_tuple(expected)
    assert len(got) == len(expected), what
    for i, (a, b) in enumerate(zip(got, expected)):
        assert_bitwise_equal(a, b, f"{what}: result {i}")
    for name, value in expected_arguments.items():  # caches updated in place, identically
        if isinstance(value, torch.Tensor):
            assert_bitwise_equal(got_arguments[name], value, f"{what}: argument {name}")


@pytest.mark.parametrize("case_id", list(CASES))
def test_compiled_fullgraph_equals_eager_and_opcheck(case_id):
    function, arguments = build(case_id)
    eager_arguments = cloned(arguments)
    expected = function(**eager_arguments)
    op, values, program = op_and_values(function, arguments)
    torch.library.opcheck(op, tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in values))

    torch._dynamo.reset()
    compiled_arguments = cloned(arguments)
    got = torch.compile(function, fullgraph=True, backend="aot_eager")(**compiled_arguments)
    assert_same_results(got, expected, compiled_arguments, eager_arguments, f"{case_id} compiled")
    for name, result in zip(program.results, as_tuple(got)):
        if name in program.updated_arguments:  # in-place results are the caller's own tensors
            assert result is compiled_arguments[name], name


@pytest.mark.parametrize("case_id", list(CASES))
def test_fake_and_meta_tensors_never_launch(case_id):
    function, arguments = build(case_id)
    expected = as_tuple(function(**cloned(arguments)))
    with observe_launches() as launches:
        with FakeTensorMode() as mode:
            fake = {n: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for n, v in arguments.items()}
            fake_out = as_tuple(function(**fake))
        meta = {n: v.to("meta") if isinstance(v, torch.Tensor) else v for n, v in arguments.items()}
        meta_out = as_tuple(function(**meta))
    assert launches == [], "a kernel launched on fake or meta tensors"
    for outs, kind in ((fake_out, "fake"), (meta_out, "meta")):
        assert [(tuple(t.shape), t.dtype) for t in outs] == [(tuple(t.shape), t.dtype) for t in expected], kind
    assert all(t.is_meta for t in meta_out)


def test_fake_tensors_raise_the_plans_error():
    function, arguments = build("store")
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(v) for n, v in arguments.items()}
        fake["rows"] = fake["rows"][:, :, :2]
        with pytest.raises(ValueError, match="store_cache_rows: rows must have one row per slot_mapping entry"):
            qsa_torch.store_cache_rows(**fake)


def test_compiled_with_options_as_inputs():
    """Options passed into the compiled function (Dynamo may make them symbolic after a change) stay exact."""
    _, arguments = build("scores")
    arguments = {n: v for n, v in arguments.items() if n != "score_divisor"}

    def scores(arguments, divisor, columns):
        return qsa_torch.mqa_paged_scores(**dict(arguments, num_columns=columns), score_divisor=divisor)

    torch._dynamo.reset()
    compiled = torch.compile(scores, fullgraph=True, backend="aot_eager")
    for divisor, columns in ((2.5, 12), (3.25, 12), (4.0, 9)):
        assert_same_results(compiled(arguments, divisor, columns), scores(arguments, divisor, columns), {}, {},
                            f"divisor {divisor}, {columns} columns")


def test_compiled_composition_equals_eager():
    """Store rows into a compressed-key cache, then score against it: the second op reads the first's write."""
    _, scores_arguments = build("scores")
    cache = scores_arguments["k_cache"]
    pages, page = cache.shape[:2]
    generator = torch.Generator().manual_seed(3)
    slots = torch.randperm(pages * page, generator=generator)[:5].to(torch.int64).to(DEVICE)
    rows = torch.randn(5, 1, cache.shape[-1], generator=generator).to(cache.dtype).to(DEVICE)

    def composition(arguments, slots, rows):
        qsa_torch.store_cache_rows(arguments["k_cache"], slots, rows)
        logits, visible = qsa_torch.mqa_paged_scores(**arguments)
        return logits * 2, visible

    eager_arguments, compiled_arguments = cloned(scores_arguments), cloned(scores_arguments)
    expected = composition(eager_arguments, slots, rows)
    torch._dynamo.reset()
    got = torch.compile(composition, fullgraph=True, backend="aot_eager")(compiled_arguments, slots, rows)
    assert_same_results(got, expected, compiled_arguments, eager_arguments, "composition")
    assert not torch.equal(compiled_arguments["k_cache"], scores_arguments["k_cache"]), "nothing was stored"


def test_compiled_step_equals_eager():
    from .test_step import STATE_FIELDS, clone_state, valid_arguments

    arguments, _ = valid_arguments()
    state = arguments.pop("state")
    eager_state, compiled_state = clone_state(state), clone_state(state)
    expected = qsa_torch.qsa_attention_step(state=eager_state, **arguments, return_token_indices=True)
    torch._dynamo.reset()
    step = torch.compile(qsa_torch.qsa_attention_step, fullgraph=True, backend="aot_eager")
    out, new_state, indices = step(state=compiled_state, **arguments, return_token_indices=True)
    assert_bitwise_equal(out, expected[0], "out")
    assert_bitwise_equal(indices, expected[2], "token_indices")
    for name in STATE_FIELDS:
        assert getattr(new_state, name) is getattr(compiled_state, name), name
        assert_bitwise_equal(getattr(compiled_state, name), getattr(eager_state, name), name)


def test_opcheck_every_op_the_step_uses():
    """Whatever ops the composed step dispatches (stage ops today, one step op once it is one plan) pass opcheck."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from .test_step import valid_arguments

    copy = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    calls = {}

    class Record(TorchDispatchMode):  # a mode makes every call go through its op
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "qsa" and func not in calls:
                calls[func] = (tuple(copy(a) for a in args), {n: copy(v) for n, v in kwargs.items()})
            return func(*args, **kwargs)

    arguments, _ = valid_arguments()
    with Record():
        qsa_torch.qsa_attention_step(**arguments, return_token_indices=True)
    assert calls, "the step dispatched no qsa op"
    for op, (args, kwargs) in calls.items():
        torch.library.opcheck(op, args, kwargs)


class Layer(torch.nn.Module):
    def forward(self, cache, slots, rows, q, page_table, token_to_req, query_positions, sequence_lengths):
        qsa_torch.store_cache_rows(cache, slots, rows)
        return qsa_torch.mqa_paged_scores(q, cache, page_table, token_to_req, query_positions, sequence_lengths,
                                          compress_ratio=4)


def test_export_of_a_module_calling_stage_ops():
    _, a = build("scores")
    cache = a["k_cache"]
    slots = torch.tensor([3, -1, 0], dtype=torch.int64, device=DEVICE)
    rows = torch.randn(3, 1, cache.shape[-1]).to(cache.dtype).to(DEVICE)
    names = ("q", "page_table", "token_to_req", "query_positions", "sequence_lengths")
    inputs = lambda: (cache.clone(), slots, rows, *(a[n] for n in names))  # noqa: E731
    exported = torch.export.export(Layer(), inputs())
    assert any(str(node.target).startswith("qsa.") for node in exported.graph.nodes), exported.graph
    eager_inputs, exported_inputs = inputs(), inputs()
    expected = Layer()(*eager_inputs)
    got = exported.module()(*exported_inputs)
    for x, y in zip(got, expected):
        assert_bitwise_equal(x, y, "exported")
    assert_bitwise_equal(exported_inputs[0], eager_inputs[0], "cache")


class StepLayer(torch.nn.Module):
    """One step over flat arrays (containers built inside, so export needs no pytree registration): its
    output, and the token indices too with ``return_token_indices`` (another op)."""

    def __init__(self, options, return_token_indices: bool = False):
        super().__init__()
        self.options = options
        self.return_token_indices = return_token_indices

    def forward(self, q, k, v, index_q, index_k, cos_sin, index_cos_sin, *flat):
        from .test_step import STATE_FIELDS

        state = qsa_torch.QSAState(*flat[:len(STATE_FIELDS)])
        metadata = qsa_torch.StepMetadata(*flat[len(STATE_FIELDS):])
        results = qsa_torch.qsa_attention_step(q, k, v, index_q, index_k, state, metadata, cos_sin, index_cos_sin,
                                               **self.options, return_token_indices=self.return_token_indices)
        return (results[0], results[2]) if self.return_token_indices else results[0]


def test_export_of_a_module_calling_the_step():
    from qsa_kernels.paging import METADATA_FIELDS

    from .test_step import STATE_FIELDS, clone_state, valid_arguments

    arguments, _ = valid_arguments()
    state, metadata = arguments.pop("state"), arguments.pop("metadata")
    options = {n: arguments.pop(n) for n in ("compress_ratio", "token_topk", "is_neox")}
    arrays = [arguments[n] for n in ("q", "k", "v", "index_q", "index_k", "cos_sin", "index_cos_sin")]
    inputs = lambda s: (*arrays, *(getattr(s, n) for n in STATE_FIELDS),  # noqa: E731
                        *(getattr(metadata, n) for n in METADATA_FIELDS))
    layer = StepLayer(options)
    exported = torch.export.export(layer, inputs(clone_state(state)))
    eager_state, exported_state = clone_state(state), clone_state(state)
    assert_bitwise_equal(exported.module()(*inputs(exported_state)), layer(*inputs(eager_state)), "out")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(exported_state, name), getattr(eager_state, name), name)


def test_in_place_writes_follow_torchs_rules():
    _, arguments = build("store")
    cache = arguments["cache"].float().requires_grad_()
    rows = arguments["rows"].float()
    with pytest.raises(RuntimeError, match="store_cache_rows is not differentiable .*cache requires grad"):
        qsa_torch.store_cache_rows(cache, arguments["slot_mapping"], rows)  # (NotImplementedError is a RuntimeError)
    with torch.no_grad():  # as for torch's own in-place ops
        qsa_torch.store_cache_rows(cache, arguments["slot_mapping"], rows)
    with torch.inference_mode():
        inference_cache = arguments["cache"].clone()
        qsa_torch.store_cache_rows(inference_cache, arguments["slot_mapping"], arguments["rows"])
    with pytest.raises(RuntimeError, match="store_cache_rows: cache is updated in place, but it is an inference tensor"):
        qsa_torch.store_cache_rows(inference_cache, arguments["slot_mapping"], arguments["rows"])


# --------------------------------------------------------------------------
# Autograd: the kernels are not differentiable, so grad-recording calls are refused
# --------------------------------------------------------------------------

def not_differentiable(function: str, argument: str) -> str:
    """The error's text, as a pattern (compiled: inside Dynamo's BackendCompilerFailed message)."""
    return re.escape(f"{function} is not differentiable (autograd): it is an inference kernel, and {argument} "
                     "requires grad while grad mode is on")


def run_as(how: str, function):
    if how == "eager":
        return function
    torch._dynamo.reset()
    return torch.compile(function, fullgraph=how == "fullgraph", backend="aot_eager")


@pytest.mark.parametrize("how", ["eager", "fullgraph", "compiled"])
def test_an_input_that_requires_grad_is_refused_naming_the_function(how):
    function, arguments = build("attention")
    q = arguments["q"].clone().requires_grad_()
    # Compiled: the op's autograd kernel raises it while Dynamo runs the op on fake tensors, and Dynamo
    # wraps it (Unsupported under fullgraph; without, the call it falls back to raises it itself).
    error = NotImplementedError if how == "eager" else COMPILED_REFUSAL
    with observe_launches() as launches:
        with pytest.raises(error, match=not_differentiable("sparse_paged_attention", "q")):
            run_as(how, function)(**dict(arguments, q=q))
    if how == "compiled" and not OWN_KERNELS:
        # Dynamo falls back to running the op where it broke the graph; torch.library.custom_op's
        # autograd refuses in its formula's set-up, after the op's kernels ran (docs/api.md): an op
        # that writes nothing in place, so nothing but the launch happened.
        return
    assert launches == [], "a refused call launched"


#: How a compiled call's refusal of autograd reaches the caller (its message is the eager one).
COMPILED_REFUSAL = (NotImplementedError, torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed)


class Projected(torch.nn.Module):
    """A module whose parameter makes the op's input require grad (the case a model meets)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones((), device=DEVICE))

    def forward(self, logits, visible_blocks):
        return qsa_torch.topk_blocks(logits * self.scale, visible_blocks, 4)


@pytest.mark.parametrize("how", ["eager", "fullgraph", "compiled"])
def test_a_parameter_upstream_is_refused_and_no_grad_inference_mode_are_unaffected(how):
    _, arguments = build("topk")
    logits, visible = arguments["logits"], arguments["visible_blocks"]
    expected = qsa_torch.topk_blocks(logits, visible, 4)
    layer = run_as(how, Projected())
    error = NotImplementedError if how == "eager" else COMPILED_REFUSAL
    for _ in range(2):  # a refused call changes nothing for the next ones (Dynamo skipped no frame)
        with pytest.raises(error, match=not_differentiable("topk_blocks", "logits")):
            layer(logits, visible)
    with torch.no_grad():
        got = layer(logits, visible)
    assert not got.requires_grad
    assert_bitwise_equal(got, expected, f"{how} under no_grad")
    if how == "eager":  # (Dynamo does not compile under inference_mode with a parameter that requires grad)
        with torch.inference_mode():
            assert_bitwise_equal(layer(logits, visible), expected, "under inference_mode")


def test_export_refuses_grad_and_exports_under_no_grad():
    _, arguments = build("topk")
    inputs = (arguments["logits"], arguments["visible_blocks"])
    with pytest.raises(NotImplementedError, match=not_differentiable("topk_blocks", "logits")):
        torch.export.export(Projected(), inputs)
    with torch.no_grad():
        exported = torch.export.export(Projected(), inputs)
        assert_bitwise_equal(exported.module()(*inputs), qsa_torch.topk_blocks(*inputs, 4), "exported")


def test_the_step_names_the_state_field_that_requires_grad():
    from .test_step import clone_state, valid_arguments

    arguments, _ = valid_arguments()
    state = clone_state(arguments.pop("state"))
    state = dataclasses.replace(state, key_cache=state.key_cache.float().to(state.key_cache.dtype).requires_grad_())
    with pytest.raises(NotImplementedError, match=not_differentiable("qsa_attention_step", "state.key_cache")):
        qsa_torch.qsa_attention_step(state=state, **arguments)
    with pytest.raises(NotImplementedError, match=not_differentiable("qsa_attention_step", "q")):
        qsa_torch.qsa_attention_step(state=clone_state(state), **dict(arguments, q=arguments["q"].clone().requires_grad_()))
    with torch.no_grad():
        expected = qsa_torch.qsa_attention_step(state=clone_state(state), **arguments)[0]
        got = qsa_torch.qsa_attention_step(state=clone_state(state), **dict(arguments, q=arguments["q"].clone().requires_grad_()))[0]
    assert_bitwise_equal(got, expected, "step under no_grad")


def test_the_op_called_directly_refuses_grad_naming_the_function_and_argument():
    """As a loaded torch.export program or a compiled graph calls it: the op's Autograd kernel refuses the call."""
    function, arguments = build("attention")
    op, values, _ = op_and_values(function, arguments)
    values = tuple(v.clone().requires_grad_() if v is arguments["q"] else v for v in values)
    with observe_launches() as launches:
        with pytest.raises(NotImplementedError, match=not_differentiable("sparse_paged_attention", "q")):
            op(*values)
    if OWN_KERNELS:  # (torch.library.custom_op runs the formula's set-up after the kernels)
        assert launches == [], "a refused call launched"
    expected = as_tuple(function(**arguments))
    with torch.no_grad():
        got = as_tuple(op(*values))
    assert not any(t.requires_grad for t in got)
    for a, b in zip(got, expected):
        assert_bitwise_equal(a, b, "the op under no_grad")
    with torch.inference_mode():
        for a, b in zip(as_tuple(op(*values)), expected):
            assert_bitwise_equal(a, b, "the op under inference_mode")


OWN_KERNELS_ONLY = pytest.mark.skipif(not OWN_KERNELS, reason="the ops' own dispatcher kernels "
                                      "(this process registered them through torch.library.custom_op)")


@OWN_KERNELS_ONLY
def test_the_step_op_called_directly_names_the_state_field():
    from .test_step import valid_arguments

    arguments, _ = valid_arguments()
    flat = _step.state_arguments(arguments, qsa_torch.QSAState, qsa_torch.StepMetadata)
    op, values = _binding.op_call(stage_named("qsa_attention_step"), flat)
    cache = flat["key_cache"].float().to(flat["key_cache"].dtype).requires_grad_()
    values = tuple(cache if v is flat["key_cache"] else v for v in values)
    with pytest.raises(NotImplementedError, match=not_differentiable("qsa_attention_step", "state.key_cache")):
        op(*values)


@pytest.mark.skipif(OWN_KERNELS, reason="the torch.library.custom_op registration's behaviour")
def test_the_step_op_called_directly_through_custom_op_cannot_backward():
    """Registered through torch.library.custom_op (an unverified torch, QSA_OP_KERNELS=0): torch takes no
    autograd formula for an op that writes in place, so a direct call records the call and backward() raises
    torch's own error -- never a silent missing gradient.  (The public functions refuse before any launch.)"""
    from .test_step import clone_state, valid_arguments

    arguments, _ = valid_arguments()
    flat = _step.state_arguments(arguments, qsa_torch.QSAState, qsa_torch.StepMetadata)
    op, values = _binding.op_call(stage_named("qsa_attention_step"), flat)
    q = flat["q"].float().to(flat["q"].dtype).requires_grad_()
    values = tuple(q if v is flat["q"] else v for v in values)
    out = op(*values)
    out = out[0] if isinstance(out, tuple) else out
    assert out.grad_fn is not None
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.float().sum().backward()
    with pytest.raises(NotImplementedError, match=not_differentiable("qsa_attention_step", "q")):
        qsa_torch.qsa_attention_step(state=clone_state(arguments["state"]),
                                     **dict({k: v for k, v in arguments.items() if k != "state"}, q=q))


# --------------------------------------------------------------------------
# Version counters: an array updated in place changes version, as with torch's own in-place ops
# --------------------------------------------------------------------------

IN_PLACE_CASES = [case_id for case_id in CASES if build(case_id)[0].plan(**build(case_id)[1]).updated_arguments]


def versions(arguments: dict, names) -> dict:
    return {name: arguments[name]._version for name in names}


def assert_bumped(before: dict, arguments: dict, what: str) -> None:
    for name, version in before.items():
        assert arguments[name]._version > version, f"{what}: {name}'s version was not bumped"


@pytest.mark.parametrize("case_id", IN_PLACE_CASES)
def test_in_place_calls_bump_the_updated_arrays_versions(case_id):
    function, arguments = build(case_id)
    updated = function.plan(**arguments).updated_arguments
    read_only = [n for n, v in arguments.items() if isinstance(v, torch.Tensor) and n not in updated]
    for call in range(2):  # the general path, then the prepared one (qsa_torch._accel._eager)
        before, untouched = versions(arguments, updated), versions(arguments, read_only)
        function(**arguments)
        assert_bumped(before, arguments, f"eager call {call}")
        assert versions(arguments, read_only) == untouched, "an array only read changed version"
    op, values, _ = op_and_values(function, arguments)
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):  # inference mode: ADInplaceOrView only
        before = versions(arguments, updated)
        with mode():
            op(*values)
        assert_bumped(before, arguments, f"the op under {mode.__name__}")
    torch._dynamo.reset()
    compiled = torch.compile(function, fullgraph=True, backend="aot_eager")
    for call in range(2):
        before = versions(arguments, updated)
        compiled(**arguments)
        assert_bumped(before, arguments, f"compiled call {call}")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_step_bumps_the_caches_versions_and_compiles_bitwise(backend):
    """Eager and compiled (fullgraph; Inductor's default mode too): the same bits, every cache's version bumped."""
    from .test_step import STATE_FIELDS, clone_state, valid_arguments

    arguments, _ = valid_arguments()
    state = arguments.pop("state")
    eager_state, compiled_state = clone_state(state), clone_state(state)
    torch._dynamo.reset()
    step = torch.compile(qsa_torch.qsa_attention_step, fullgraph=True, backend=backend)
    for call in range(2):
        before = {n: (getattr(eager_state, n)._version, getattr(compiled_state, n)._version) for n in STATE_FIELDS}
        expected = qsa_torch.qsa_attention_step(state=eager_state, **arguments, return_token_indices=True)
        got = step(state=compiled_state, **arguments, return_token_indices=True)
        assert_bitwise_equal(got[0], expected[0], f"out, call {call}")
        assert_bitwise_equal(got[2], expected[2], f"token_indices, call {call}")
        for name in STATE_FIELDS:
            assert getattr(got[1], name) is getattr(compiled_state, name), name
            assert_bitwise_equal(getattr(compiled_state, name), getattr(eager_state, name), name)
            eager_before, compiled_before = before[name]
            assert getattr(eager_state, name)._version > eager_before, f"eager {name}, call {call}"
            assert getattr(compiled_state, name)._version > compiled_before, f"compiled {name}, call {call}"


def python_frames_outside(implementation, fn) -> list[str]:
    """``file:function`` of every Python function ``fn()`` calls, less those under ``implementation`` (and
    less comprehensions, lambdas and torch/_ops.py's OpOverload.__call__)."""
    frames, depth = [], [0]

    def profile(frame, event, _):
        if event == "call":
            if depth[0]:
                depth[0] += 1
            elif frame.f_code is implementation.__code__:
                depth[0] = 1
            elif not frame.f_code.co_name.startswith("<") and not (
                    frame.f_code.co_name == "__call__" and frame.f_code.co_filename.endswith("_ops.py")):
                frames.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
        elif event == "return" and depth[0]:
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return frames


@OWN_KERNELS_ONLY
def test_an_op_call_runs_one_python_kernel_before_the_implementation():
    """The step's op through the dispatcher: our Autograd kernel, then the implementation (no torch._library
    wrapper: custom_op's cost 3 Python kernels and, on torch 2.13, a bind quadratic in the 29 arguments)."""
    from .test_step import valid_arguments

    arguments, _ = valid_arguments()
    flat = _step.state_arguments(arguments, qsa_torch.QSAState, qsa_torch.StepMetadata)
    op, values = _binding.op_call(stage_named("qsa_attention_step"), flat)
    implementation = _binding._IMPLEMENTATIONS[op]
    op(*values)  # plans, builds and prepares
    for mode in (torch.enable_grad, torch.no_grad):
        with mode():
            frames = python_frames_outside(implementation, lambda: op(*values))
        assert frames == ["_ops.py:autograd"], frames
    torch._dynamo.reset()
    step = torch.compile(qsa_torch.qsa_attention_step, fullgraph=True)
    state = arguments.pop("state")
    step(state=state, **arguments)
    frames = python_frames_outside(implementation, lambda: step(state=state, **arguments))
    assert "_ops.py:autograd" in frames, frames
    assert not [f for f in frames if f.startswith(("custom_ops.py", "autograd.py:", "utils.py:fill_defaults"))], frames


def test_a_version_bump_is_what_autograd_checks():
    """A cache saved for backward, then written by a qsa call under no_grad: backward raises, as for copy_."""
    _, arguments = build("store")
    cache = arguments["cache"].float()
    weight = torch.ones((), requires_grad=True)
    product = cache * weight  # saves cache for weight's gradient
    with torch.no_grad():
        qsa_torch.store_cache_rows(cache, arguments["slot_mapping"], arguments["rows"].float())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.sum().backward()


FORK_CHILD = r"""
import ctypes, os, sys
calls = []
real_cdll = ctypes.CDLL
class Recording:
    def __init__(self, library):
        self._library = library
    def __getattr__(self, name):
        calls.append(name)
        return getattr(self._library, name)
def cdll(name, *args, **kwargs):
    library = real_cdll(name, *args, **kwargs)
    return Recording(library) if "libcuda" in str(name) else library
ctypes.CDLL = cdll
import torch, qsa_torch
from qsa_kernels import runtime
assert "cuInit" not in calls, calls
pid = os.fork()
if pid == 0:  # the child initialises CUDA itself (compiled process) or runs the interpreter
    device = "cpu" if runtime.INTERPRETED else "cuda"
    cache = torch.zeros(2, 4, 1, 8, device=device)
    qsa_torch.store_cache_rows(cache, torch.tensor([5, -1], dtype=torch.int32, device=device),
                               torch.ones(2, 8, device=device))
    cache = cache.cpu()
    os._exit(0 if cache[1, 1].eq(1).all() and cache.sum() == 8 else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_fork_after_import_and_no_cuinit():
    """A child forked after ``import qsa_torch`` runs a kernel (on the GPU: CUDA was not initialised before the fork)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the package decides itself
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", FORK_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "child 0", result.stderr[-3000:]


def test_runtime_probe_never_calls_cuinit():
    source = open(runtime.__file__).read()
    assert "cuInit" not in source.replace("``cuInit``", "")


# --------------------------------------------------------------------------
# GPU only: Inductor, CUDA graphs
# --------------------------------------------------------------------------

def step_inputs():
    from .test_step import clone_state, valid_arguments

    arguments, _ = valid_arguments()
    return arguments, clone_state


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inductor_step_equals_eager(mode):
    from .test_step import STATE_FIELDS

    from torch._dynamo.utils import counters

    arguments, clone_state = step_inputs()
    state = arguments.pop("state")
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(qsa_torch.qsa_attention_step, fullgraph=True, mode=mode)
    eager_state, compiled_state = clone_state(state), clone_state(state)
    for name in STATE_FIELDS:  # caches are static inputs, as a module's buffers would be
        torch._dynamo.mark_static_address(getattr(compiled_state, name))
    for _ in range(3):  # reduce-overhead records the graph on a later call
        expected = qsa_torch.qsa_attention_step(state=eager_state, **arguments, return_token_indices=True)
        got = step(state=compiled_state, **arguments, return_token_indices=True)
        torch.cuda.synchronize()
        assert_bitwise_equal(got[0], expected[0], "out")
        assert_bitwise_equal(got[2], expected[2], "token_indices")
        for name in STATE_FIELDS:
            assert_bitwise_equal(getattr(compiled_state, name), getattr(eager_state, name), name)
    if mode == "reduce-overhead":  # the step really ran as a CUDA graph
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.gpu
def test_cuda_graph_of_the_compiled_step():
    from .test_step import STATE_FIELDS

    arguments, clone_state = step_inputs()
    state = arguments.pop("state")
    torch._dynamo.reset()
    step = torch.compile(qsa_torch.qsa_attention_step, fullgraph=True)
    graph_state, eager_state = clone_state(state), clone_state(state)
    step(state=clone_state(state), **arguments)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(state=clone_state(state), **arguments)  # warm up on a side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = step(state=graph_state, **arguments)
    for name in STATE_FIELDS:  # the capture itself wrote nothing
        getattr(graph_state, name).copy_(getattr(state, name))
    graph.replay()
    expected, _ = qsa_torch.qsa_attention_step(state=eager_state, **arguments)
    torch.cuda.synchronize()
    assert_bitwise_equal(out, expected, "out")
    for name in STATE_FIELDS:
        assert_bitwise_equal(getattr(graph_state, name), getattr(eager_state, name), name)
