"""``demo.py --gpu-production``: the demo model at the production QSA geometry on a GPU.

A model prefill over 32K tokens per request would dominate the run, so the
long contexts are random: random q/k/v and index keys of every context token
go through ``qsa_torch.qsa_attention_step`` in prefill chunks, which writes
them into the KV cache, the rings and the compressed-key cache exactly as a
prefill would.  JAX gets a copy of those caches (DLPack, then a device copy,
since torch keeps decoding in its own).  Then both frameworks decode greedily
from the same first tokens -- torch replaying one CUDA graph, JAX calling one
jitted step with donated caches -- and must agree on every logit and token.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from model import PRODUCTION_CONFIG, make_weights
from qsa_kernels.paging import STATE_FIELDS, CacheGeometry, PagedRequests

FILL_CHUNK = 4096  # context tokens per request per prefill step


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def production_run(num_requests: int, context: int, steps: int) -> bool:
    import jax
    import jax.numpy as jnp
    import torch

    import qsa_jax
    import qsa_torch
    from model_jax import JaxModel
    from model_torch import GraphedSteps, TorchModel

    c = PRODUCTION_CONFIG
    device = torch.device("cuda")
    max_context = context + steps
    geometry = CacheGeometry(
        page_size=64, num_pages=num_requests * -(-max_context // 64), compress_ratio=c.compress_ratio,
        compressed_page_size=64, num_compressed_pages=num_requests * -(-(max_context // c.compress_ratio) // 64),
        max_context=max_context, max_requests=num_requests)
    print(f"model: {c.layers} layers, hidden {c.hidden}, attention {c.heads} Q / {c.kv_heads} KV heads x "
          f"d{c.head_dim} bf16, KV pages of {geometry.page_size}; indexer {c.index_heads} heads x "
          f"d{c.index_head_dim}, ratio {c.compress_ratio}, compressed pages of {geometry.compressed_page_size}, "
          f"top {c.token_topk // c.compress_ratio} blocks = {c.token_topk} tokens + tail")
    print(f"{num_requests} requests at {context} tokens of context, then {steps} greedy decode steps")
    weights = make_weights(c)
    torch_model = TorchModel(c, weights, device)
    states = torch_model.new_states(geometry)
    pager = PagedRequests(geometry, seed=0)

    print(f"contexts: random K/V and index keys written into the caches by qsa_attention_step in prefill "
          f"chunks of {FILL_CHUNK} tokens per request (random q/k/v, not a model prefill)", flush=True)
    generator = torch.Generator(device).manual_seed(0)

    def random(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(torch.bfloat16)

    start = time.perf_counter()
    for done in range(0, context, FILL_CHUNK):
        count = min(FILL_CHUNK, context - done)
        host_meta = pager.step({r: count for r in range(num_requests)})
        meta = qsa_torch.StepMetadata.from_host(host_meta, device)
        rows = host_meta.num_rows
        for layer, state in enumerate(states):
            _, states[layer] = qsa_torch.qsa_attention_step(
                random(rows, c.heads, c.head_dim), random(rows, c.kv_heads, c.head_dim),
                random(rows, c.kv_heads, c.head_dim), random(rows, c.index_heads, c.index_head_dim),
                random(rows, 1, c.index_head_dim), state, meta, torch_model.cos_sin, torch_model.index_cos_sin,
                compress_ratio=c.compress_ratio, token_topk=c.token_topk)
        torch.cuda.synchronize()
        print(f"  {done + count:6d} / {context} context tokens per request "
              f"({time.perf_counter() - start:.1f} s)", flush=True)

    jax_states = [qsa_jax.QSAState(**{name: jnp.array(jax.dlpack.from_dlpack(getattr(state, name)), copy=True)
                                      for name in STATE_FIELDS}) for state in states]
    jax.block_until_ready(jax_states)
    jax_model = JaxModel(c, weights)
    graphed = GraphedSteps(torch_model, states)
    first = np.random.default_rng(0).integers(0, c.vocab, num_requests)
    torch_tokens = torch.tensor(first, device=device)
    jax_tokens = jnp.asarray(first, jnp.int32)

    identical = True
    times = {"torch": [], "jax": []}
    generated = {"torch": [], "jax": []}
    print("decoding (the first step also captures the CUDA graph and compiles the JAX step)", flush=True)
    for step in range(steps):
        host_meta = pager.step({r: 1 for r in range(num_requests)})
        start = time.perf_counter()
        logits, next_tokens, _, _ = graphed(torch_tokens, host_meta)
        torch.cuda.synchronize()
        times["torch"].append(time.perf_counter() - start)
        start = time.perf_counter()
        jax_logits, jax_next, jax_states, _ = jax.block_until_ready(
            jax_model(jax_tokens, jax_states, qsa_jax.StepMetadata.from_host(host_meta)))
        times["jax"].append(time.perf_counter() - start)
        identical &= bits_equal(logits.cpu().numpy(), np.asarray(jax_logits))
        generated["torch"].append(next_tokens.cpu().numpy())
        generated["jax"].append(np.asarray(jax_next))
        torch_tokens, jax_tokens = next_tokens, jax_next
        if (step + 1) % 16 == 0 or step == 0:
            print(f"  step {step + 1:3d}: torch {times['torch'][-1] * 1e3:8.1f} ms, JAX {times['jax'][-1] * 1e3:8.1f} ms, "
                  f"identical so far: {identical}", flush=True)

    torch_generated, jax_generated = np.stack(generated["torch"], 1), np.stack(generated["jax"], 1)
    same_tokens = np.array_equal(torch_generated, jax_generated)
    print(f"torch and JAX produced identical logits (bitwise, every step): {identical}; identical tokens: {same_tokens}")
    print(f"  request 0 generated {torch_generated[0, :16].tolist()} ...")
    print(f"  JAX traced the step {jax_model.traces} time(s); torch captured {len(graphed.graphs)} CUDA graph(s)")
    print("largest deviation from a float64 reference: not computed at this size (the CPU demo checks it)")
    print(f"time per decode step ({c.layers} layers, {num_requests} requests, median of steps 2..{steps}): "
          f"torch CUDA graph {statistics.median(times['torch'][1:]) * 1e3:.2f} ms, "
          f"JAX jit {statistics.median(times['jax'][1:]) * 1e3:.2f} ms (wall clock per step, host included)")
    return identical and same_tokens
