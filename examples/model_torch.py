"""The demo model in PyTorch: the forward pass, and a CUDA graph per batch shape for decoding."""

from __future__ import annotations

import torch

import qsa_torch
from model import ACT_LIMIT, GRID, ModelConfig, rope_table
from qsa_kernels.paging import CacheGeometry


def quantize(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(x * GRID), -ACT_LIMIT * GRID, ACT_LIMIT * GRID) / GRID


class TorchModel:
    """``all_reduce``, if given, sums the output projection's partial products over the
    processes that split the heads (``tensor_parallel.py``: ``torch.distributed.all_reduce``)."""

    def __init__(self, config: ModelConfig, weights: dict, device: torch.device, all_reduce=None):
        self.config = config
        self.device = device
        self.all_reduce = all_reduce
        to = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        self.embed, self.lm_head = to(weights["embed"]), to(weights["lm_head"])
        self.layers = [{name: to(w) for name, w in layer.items()} for layer in weights["layers"]]
        self.cos_sin = to(rope_table(config.head_dim, config.max_position, config.rope_base))
        self.index_cos_sin = to(rope_table(config.index_head_dim, config.max_position, config.rope_base))

    def new_states(self, geometry: CacheGeometry) -> list[qsa_torch.QSAState]:
        c = self.config
        return [qsa_torch.QSAState.zeros(geometry, kv_heads=c.kv_heads, head_dim=c.head_dim,
                                         index_head_dim=c.index_head_dim, dtype=torch.bfloat16,
                                         device=self.device) for _ in range(c.layers)]

    def forward(self, tokens: torch.Tensor, states: list, meta: qsa_torch.StepMetadata):
        """-> (logits of each request's last row [B, vocab], greedy tokens [B], states, token indices per layer)."""
        c = self.config
        rows = tokens.shape[0]
        h = self.embed[tokens]
        new_states, selections = [], []
        for layer, state in zip(self.layers, states):
            heads = lambda w, n, d: (h @ w).view(rows, n, d).to(torch.bfloat16)  # noqa: E731
            out, state, selected = qsa_torch.qsa_attention_step(
                heads(layer["wq"], c.heads, c.head_dim), heads(layer["wk"], c.kv_heads, c.head_dim),
                heads(layer["wv"], c.kv_heads, c.head_dim), heads(layer["wiq"], c.index_heads, c.index_head_dim),
                heads(layer["wik"], 1, c.index_head_dim), state, meta, self.cos_sin, self.index_cos_sin,
                compress_ratio=c.compress_ratio, token_topk=c.token_topk, return_token_indices=True)
            attention = quantize(out.float().view(rows, -1))
            projected = attention @ layer["wo"]
            if self.all_reduce is not None:
                projected = self.all_reduce(projected)  # exact: partial sums of fixed-point products (model.py)
            h = torch.clamp(h + quantize(projected), -ACT_LIMIT, ACT_LIMIT)
            up = torch.relu(quantize(h @ layer["wup"]))
            h = torch.clamp(h + quantize(up @ layer["wdown"]), -ACT_LIMIT, ACT_LIMIT)
            new_states.append(state)
            selections.append(selected)
        logits = h[meta.query_start_loc[1:] - 1] @ self.lm_head
        return logits, torch.argmax(logits, dim=-1), new_states, selections


class GraphedSteps:
    """The whole model step as one CUDA graph per batch shape ``(T, B)``.

    The caches are updated in place, so a graph keeps pointing at them; each
    call copies this step's tokens and metadata into the graph's static input
    tensors and replays.  Kernels are compiled by a warm-up run whose cache
    slots are all -1 (it writes nothing), then the step is captured.
    """

    def __init__(self, model: TorchModel, states: list):
        self.model, self.states = model, states
        self.graphs: dict = {}

    def __call__(self, tokens: torch.Tensor, host_meta):
        key = (host_meta.num_rows, host_meta.num_requests)
        if key not in self.graphs:
            self.graphs[key] = self._capture(tokens, host_meta)
        graph, static_tokens, static_meta, outputs = self.graphs[key]
        static_tokens.copy_(tokens)
        for name, array in vars(host_meta).items():
            getattr(static_meta, name).copy_(torch.from_numpy(array))
        graph.replay()
        return outputs

    def _capture(self, tokens, host_meta):
        device = self.model.device
        static_tokens = tokens.clone()
        static_meta = qsa_torch.StepMetadata.from_host(host_meta, device)
        dry = qsa_torch.StepMetadata(**{
            name: torch.full_like(value, -1) if name.endswith("slots") or name == "slot_mapping" else value
            for name, value in vars(static_meta).items()})
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model.forward(static_tokens, self.states, dry)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.model.forward(static_tokens, self.states, static_meta)
        return graph, static_tokens, static_meta, outputs
