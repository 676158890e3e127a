"""qsa demo: write a batch of tokens into a paged KV cache from torch and from JAX.

Three requests of different lengths are prefilled into a shared, shuffled
page pool with ``rope_reshape_and_cache``, from ``qsa_torch`` (in place) and
from ``qsa_jax`` under ``jax.jit`` with the caches donated.  The demo checks
that both frameworks produce bit-identical outputs and caches, and that they
match a float64 reference, then prints a short summary.

Runs on the CPU through Triton's interpreter when no CUDA device is visible.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    import jax
    import jax.numpy as jnp
    import torch

    import qsa_jax
    import qsa_torch
    from qsa_kernels import runtime
    from tests import reference

    device = "cpu" if runtime.INTERPRETED else "cuda"
    mode = "Triton interpreter (CPU)" if runtime.INTERPRETED else f"compiled Triton on {torch.cuda.get_device_name()}"
    print(f"qsa demo: {mode}")

    query_heads, kv_heads, head_dim, page_size = 8, 2, 64, 16
    lengths = [37, 5, 22]  # tokens per request, not page multiples
    num_tokens = sum(lengths)
    pages_per_request = [(n + page_size - 1) // page_size for n in lengths]
    num_pages = sum(pages_per_request) + 3
    g = torch.Generator().manual_seed(2026)

    # Each request owns shuffled physical pages of one pool.
    pool = torch.randperm(num_pages, generator=g).tolist()
    slots, positions = [], []
    for request, n in enumerate(lengths):
        pages, pool = pool[: pages_per_request[request]], pool[pages_per_request[request]:]
        for position in range(n):
            slots.append(pages[position // page_size] * page_size + position % page_size)
            positions.append(position)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    positions = torch.tensor(positions, dtype=torch.int64)

    q = torch.randn(num_tokens, query_heads, head_dim, generator=g).to(torch.bfloat16)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.float32)
    key_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    value_cache = torch.randn_like(key_cache, dtype=torch.float32).to(torch.bfloat16)
    initial = [t.clone() for t in (key_cache, value_cache)]

    args = [t.to(device) for t in (q, k, v, key_cache, value_cache, slot_mapping, positions, cos_sin)]
    t0 = time.perf_counter()
    torch_out = qsa_torch.rope_reshape_and_cache(*args, is_neox=True)
    if device == "cuda":
        torch.cuda.synchronize()
    torch_seconds = time.perf_counter() - t0
    print(f"  torch: wrote {num_tokens} tokens of {len(lengths)} requests into {num_pages} pages in place ({torch_seconds * 1e3:.1f} ms)")

    def to_jax(t):
        t = t.cpu()
        if t.dtype == torch.bfloat16:
            return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
        return jnp.asarray(t.numpy().astype(np.int32) if t.dtype == torch.int64 else t.numpy())

    step = jax.jit(lambda *a: qsa_jax.rope_reshape_and_cache(*a, is_neox=True), donate_argnums=(3, 4))
    jax_args = [to_jax(t) for t in (q, k, v, initial[0], initial[1], slot_mapping, positions, cos_sin)]
    t0 = time.perf_counter()
    jax_out = jax.block_until_ready(step(*jax_args))
    jax_seconds = time.perf_counter() - t0
    print(f"  jax:   the same call under jax.jit with donated caches ({jax_seconds * 1e3:.1f} ms incl. tracing)")

    names = ["q_out", "k_out", "key_cache", "value_cache"]
    identical = all(
        np.array_equal(np.asarray(j).view(np.uint16), t.cpu().view(torch.int16).numpy().view(np.uint16))
        for j, t in zip(jax_out, torch_out)
    )
    print(f"  torch and JAX outputs bit-identical: {identical}")

    f64 = lambda t: t.cpu().double().numpy()  # noqa: E731
    ref = reference.rope_reshape_and_cache(
        f64(q), f64(k), f64(v), f64(initial[0]), f64(initial[1]), slot_mapping.numpy(), positions.numpy(),
        f64(cos_sin), is_neox=True, layout="flash")
    worst = 0.0
    for name, got, expected in zip(names, torch_out, ref[:4]):
        error = np.linalg.norm(f64(got) - expected) / np.linalg.norm(expected)
        worst = max(worst, error)
        print(f"  {name:12s} relative error vs float64 reference: {error:.2e}")
    ok = identical and worst < 1e-2
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
