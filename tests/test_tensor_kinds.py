"""Tensor kinds the kernels cannot read get the package's own error, naming the function and the argument.

Every public function (both adapters) against nested, sparse, vmap-batched,
functorch-wrapped (``torch.func.jvp``) and forward-mode AD dual tensors:
a ``TypeError`` / ``NotImplementedError`` of ours, never torch's internal
errors and never a crash -- also after steady calls, when the accelerator
holds a recent call's key (a nested tensor reached torch's C guard check
once, which aborted the process: checked in a subprocess).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import qsa_jax
import qsa_torch

from .test_torch_ops import CASES, build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _first_array(arguments: dict) -> str:
    return next(name for name, value in arguments.items() if isinstance(value, torch.Tensor) and value.dim() >= 2)


KINDS = {  # kind -> (how a tensor becomes it, the error, what the message says)
    "nested": (lambda t: torch.nested.nested_tensor(list(t.unbind(0))), TypeError, "got a nested tensor"),
    "jagged": (lambda t: torch.nested.nested_tensor(list(t.unbind(0)), layout=torch.jagged), TypeError,
               "got a nested tensor"),
    "sparse_coo": (lambda t: t.float().to_sparse().to(t.dtype) if t.dtype != torch.bfloat16 else t.to_sparse(),
                   TypeError, "got a torch.sparse_coo tensor"),
    "sparse_csr": (lambda t: t.reshape(t.shape[0], -1).to_sparse_csr(), TypeError, "got a torch.sparse_csr tensor"),
}


def _call(function, arguments):
    return function(**arguments)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("case_id", list(CASES))
def test_tensor_kinds_are_refused_by_name(case_id, kind):
    function, arguments = build(case_id)
    for _ in range(2):  # steady calls first: the accelerator keeps their key and its C check
        function(**arguments)
    name = _first_array(arguments)
    make, error, message = KINDS[kind]
    try:
        odd = make(arguments[name])
    except (RuntimeError, NotImplementedError) as why:  # torch cannot make this kind of that dtype
        pytest.skip(f"torch makes no {kind} tensor of {arguments[name].dtype}: {why}")
    with pytest.raises(error, match=f"{function.__name__}: {name} must be a strided dense tensor, {message}"):
        function(**dict(arguments, **{name: odd}))


@pytest.mark.parametrize("case_id", list(CASES))
def test_vmap_jvp_and_forward_ad_are_refused_by_name(case_id):
    function, arguments = build(case_id)
    name = _first_array(arguments)
    tensor = arguments[name]
    with pytest.raises(NotImplementedError, match=f"{function.__name__} does not support torch.vmap .*"
                                                  f"call it on the whole batch"):
        torch.vmap(lambda t: function(**dict(arguments, **{name: t})))(torch.stack([tensor, tensor]))
    if not tensor.is_floating_point():
        return  # forward AD: floating point only
    with pytest.raises(NotImplementedError, match=f"{function.__name__} is not differentiable \\(forward-mode AD\\)"):
        with forward_ad.dual_level():
            function(**dict(arguments, **{name: forward_ad.make_dual(tensor, torch.ones_like(tensor))}))
    with pytest.raises(NotImplementedError, match=f"{function.__name__} is not differentiable \\(forward-mode AD\\)"):
        torch.func.jvp(lambda t: function(**dict(arguments, **{name: t})), (tensor,), (torch.ones_like(tensor),))


def test_the_step_refuses_odd_kinds_naming_the_state_field():
    from .test_step import clone_state, valid_arguments

    arguments, _ = valid_arguments()
    state = arguments.pop("state")
    for _ in range(2):
        qsa_torch.qsa_attention_step(state=clone_state(state), **arguments)
    nested = torch.nested.nested_tensor(list(state.key_cache.unbind(0)))
    import dataclasses

    with pytest.raises(TypeError, match="qsa_attention_step: state.key_cache must be a strided dense tensor, got a "
                                        "nested tensor"):
        qsa_torch.qsa_attention_step(state=dataclasses.replace(clone_state(state), key_cache=nested), **arguments)


@pytest.mark.parametrize("case_id", ["topk", "attention"])
def test_jax_refuses_torch_tensors_by_name(case_id):
    function, arguments = build(case_id)
    name = _first_array(arguments)
    jax_function = getattr(qsa_jax, function.__name__)
    with pytest.raises(TypeError, match=f"{function.__name__}: {name} must be a JAX array"):
        jax_function(**arguments)


def test_a_nested_tensor_after_steady_calls_does_not_crash_the_process():
    """Issue 52, item 1: after two ordinary calls a nested tensor reached torch's C guard check, which
    threw a C++ exception nothing caught (the process aborted, exit 134)."""
    code = ("import torch, qsa_torch\n"
            "d = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "x = torch.randn(3, 40, device=d); v = torch.full((3,), 40, dtype=torch.int32, device=d)\n"
            "for _ in range(3): qsa_torch.topk_blocks(x, v, 4)\n"
            "try:\n"
            "    qsa_torch.topk_blocks(torch.nested.nested_tensor([torch.randn(40), torch.randn(40)], device=d), v, 4)\n"
            "except TypeError as e:\n"
            "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: topk_blocks: logits must be a strided dense tensor, got a nested tensor" in out.stdout, out


def test_export_with_a_dynamic_row_dimension_round_trips():
    """Issue 52, item 7: torch.export with a dynamic row count works (it raised TypeError: unhashable
    type: non-nested SymInt)."""
    class Top(torch.nn.Module):
        def forward(self, logits, visible):
            return qsa_torch.topk_blocks(logits, visible, 4)

    _, arguments = build("topk")
    logits, visible = arguments["logits"], arguments["visible_blocks"]
    rows = torch.export.Dim("rows", min=2)
    program = torch.export.export(Top(), (logits, visible), dynamic_shapes=({0: rows}, {0: rows}))
    for count in (2, logits.shape[0] + 3):
        more_logits = torch.randn(count, logits.shape[1], device=logits.device).to(logits.dtype)
        more_visible = torch.randint(1, logits.shape[1] + 1, (count,), device=logits.device).to(visible.dtype)
        assert torch.equal(program.module()(more_logits, more_visible),
                           qsa_torch.topk_blocks(more_logits, more_visible, 4))
