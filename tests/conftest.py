"""Shared test setup: poisoned allocations and the gpu marker.

Every ``torch.empty`` / ``torch.empty_like`` made while a test runs is filled
with NaN (floats) or 0x7F bytes (integers), so an output element a kernel
forgets to write shows up instead of passing as a lucky zero.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from qsa_kernels import runtime


def _poison(tensor: torch.Tensor) -> torch.Tensor:
    # FakeTensors (torch.compile tracing, Inductor's pattern set-up) hold no data.
    if tensor.numel() and not isinstance(tensor, FakeTensor):
        # no_grad: Inductor allocates leaves with requires_grad=True (pad_mm's patterns);
        # filling one is our poison, not an autograd-visible in-place write.
        with torch.no_grad():
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
            else:
                # (0-d tensors cannot be viewed as bytes: Inductor allocates some)
                tensor.view(torch.uint8).fill_(0x7F) if tensor.is_contiguous() and tensor.dim() else tensor.fill_(0x7F)
    return tensor


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(empty_like(*a, **k)))
    yield


def pytest_collection_modifyitems(config, items):
    if runtime.INTERPRETED:
        skip = pytest.mark.skip(reason="GPU-only case (large shape or fp8): this process runs Triton's interpreter")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
