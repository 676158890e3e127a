"""qsa demo: a small decoder with QSA attention, in PyTorch and in JAX, token for token.

Three prompts of different lengths are prefilled in chunks (prefill chunks and
decode rows share steps) and then decoded greedily, by the same model written
in torch (``model_torch.py``) and in JAX (``model_jax.py``), each layer's
attention being one ``qsa_attention_step``.  Paging is done once per step on
the host (``qsa_kernels.paging``) and shared.  The whole decode step is one
``jax.jit`` function with donated caches in JAX and, on a GPU, one CUDA graph
per batch shape in torch.  The demo prints whether torch and JAX produced
identical logits and tokens, the largest deviation from a float64 reference
of the same model (``model_reference.py``: same selected tokens, plain
attention), and the time per step.

Without a CUDA device everything runs through Triton's interpreter (a few
minutes at most).  ``--gpu-production`` runs the production geometry on a GPU
instead: 8 requests whose 32K-token contexts are random K/V written into the
caches through the QSA step, then 64 greedy decode steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

from model import CPU_CONFIG, Request, make_weights  # noqa: E402
from qsa_kernels import runtime  # noqa: E402  (decides compiled vs interpreted first)
from qsa_kernels.paging import CacheGeometry, PagedRequests  # noqa: E402


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


def to_host(tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def small_run() -> bool:
    import jax
    import jax.numpy as jnp
    import torch

    import qsa_jax
    import qsa_torch
    from model_jax import JaxModel
    from model_reference import ReferenceModel
    from model_torch import GraphedSteps, TorchModel

    on_gpu = not runtime.INTERPRETED
    device = torch.device("cuda" if on_gpu else "cpu")
    config, chunk = CPU_CONFIG, 8
    rng = np.random.default_rng(2026)
    prompt_lengths, new_tokens = [21, 14, 9], [8, 5, 10]
    prompts = [rng.integers(0, config.vocab, n).tolist() for n in prompt_lengths]
    geometry = CacheGeometry(page_size=8, num_pages=16, compress_ratio=config.compress_ratio,
                             compressed_page_size=4, num_compressed_pages=8, max_context=32, max_requests=4)
    print(f"model: {config.layers} layers, hidden {config.hidden}, attention {config.heads} Q / {config.kv_heads} KV "
          f"heads x d{config.head_dim} bf16, indexer {config.index_heads} heads x d{config.index_head_dim}, "
          f"ratio {config.compress_ratio}, top {config.token_topk} tokens + tail; KV pages of {geometry.page_size}")
    print(f"requests: prompts of {prompt_lengths} tokens prefilled in chunks of {chunk}, then "
          f"{new_tokens} greedy tokens")

    weights = make_weights(config)
    torch_model, jax_model = TorchModel(config, weights, device), JaxModel(config, weights)
    reference = ReferenceModel(config, weights)
    torch_states, jax_states = torch_model.new_states(geometry), jax_model.new_states(geometry)
    graphed = GraphedSteps(torch_model, torch_states) if on_gpu else None
    pager = PagedRequests(geometry, seed=1)
    torch_requests = [Request(p, n) for p, n in zip(prompts, new_tokens)]
    jax_requests = [Request(p, n) for p, n in zip(prompts, new_tokens)]

    identical, worst, largest = True, 0.0, 0.0
    decode_times = {"torch": [], "jax": []}
    batch_shapes = set()
    step = 0
    while not all(r.done for r in torch_requests):
        active = [i for i, r in enumerate(torch_requests) if not r.done]
        torch_rows = {i: torch_requests[i].next_rows(chunk) for i in active}
        jax_rows = {i: jax_requests[i].next_rows(chunk) for i in active}
        host_meta = pager.step({i: len(torch_rows[i]) for i in active})
        batch_shapes.add((host_meta.num_rows, host_meta.num_requests))
        prefill_rows = sum(len(torch_rows[i]) for i in active if torch_requests[i].fed < len(torch_requests[i].prompt))
        decode = prefill_rows == 0
        torch_tokens = torch.tensor(sum(torch_rows.values(), []), device=device)
        jax_tokens = jnp.asarray(sum(jax_rows.values(), []), jnp.int32)

        start = time.perf_counter()
        if graphed is not None and decode:
            logits, next_tokens, _, selections = graphed(torch_tokens, host_meta)
        else:
            meta = qsa_torch.StepMetadata.from_host(host_meta, device)
            logits, next_tokens, torch_states, selections = torch_model.forward(torch_tokens, torch_states, meta)
        logits, next_tokens, selections = to_host(logits), to_host(next_tokens), [to_host(s) for s in selections]
        torch_seconds = time.perf_counter() - start

        start = time.perf_counter()
        out = jax_model(jax_tokens, jax_states, qsa_jax.StepMetadata.from_host(host_meta))
        jax_logits, jax_next, jax_states, jax_selections = jax.block_until_ready(out)
        jax_seconds = time.perf_counter() - start

        same = (bits_equal(logits, jax_logits) and np.array_equal(next_tokens, jax_next)
                and all(np.array_equal(a, b) for a, b in zip(selections, jax_selections)))
        identical &= same
        ref_logits = reference.step(np.asarray(sum(torch_rows.values(), [])), active, host_meta, selections)
        worst = max(worst, float(np.abs(logits - ref_logits).max()))
        largest = max(largest, float(np.abs(ref_logits).max()))
        if decode:
            decode_times["torch"].append(torch_seconds)
            decode_times["jax"].append(jax_seconds)
        step += 1
        print(f"  step {step:2d}: {len(active)} request{'s' if len(active) > 1 else ' '}, {prefill_rows:2d} prefill + "
              f"{host_meta.num_rows - prefill_rows} decode rows: torch {torch_seconds:5.2f} s, "
              f"JAX {jax_seconds:5.2f} s, identical: {same}", flush=True)

        for i in active:
            torch_requests[i].advance(len(torch_rows[i]), int(next_tokens[active.index(i)]))
            jax_requests[i].advance(len(jax_rows[i]), int(jax_next[active.index(i)]))
            if torch_requests[i].done:
                pager.release(i)
                reference.release(i)

    identical &= all(t.generated == j.generated for t, j in zip(torch_requests, jax_requests))
    for i, r in enumerate(torch_requests):
        print(f"  request {i}: prompt {len(r.prompt)} tokens -> generated {r.generated}")
    graph_note = f", {len(graphed.graphs)} CUDA graphs" if graphed is not None else ""
    print(f"torch and JAX produced identical logits and tokens (bitwise, every step): {identical}")
    print(f"  JAX traced the step {jax_model.traces} times over {step} steps of {len(batch_shapes)} batch shapes "
          f"(T rows, B requests){graph_note}")
    relative = worst / largest
    print(f"largest deviation from a float64 reference of the same model (same selected tokens, plain attention): "
          f"{worst:.2e} (logits up to {largest:.2f}; {relative:.1e} relative)")
    mode = "Triton interpreter on CPU" if runtime.INTERPRETED else "compiled; torch CUDA graphs"
    print(f"time per decode step ({config.layers} layers, median, {mode}): "
          f"torch {statistics.median(decode_times['torch']) * 1e3:.0f} ms, "
          f"JAX jit {statistics.median(decode_times['jax']) * 1e3:.0f} ms")
    return identical and jax_model.traces == len(batch_shapes) and relative < 2e-2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-production", action="store_true",
                        help="production geometry on a GPU: 8 requests at 32K context, 64 decode steps")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    mode = "Triton interpreter (CPU)" if runtime.INTERPRETED else "compiled Triton (GPU)"
    print(f"qsa demo: {mode}", flush=True)
    if args.gpu_production:
        if runtime.INTERPRETED:
            print("--gpu-production needs a CUDA device")
            return 2
        from demo_production import production_run
        ok = production_run(args.requests, args.context, args.steps)
    else:
        ok = small_run()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
