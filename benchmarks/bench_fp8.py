"""fp8 against bf16 caches, one process, one card (issue 51): the composed step and its attention.

For each batch (1, 8, 64, 256 requests x 128K context, production geometry;
the largest that fits the card), the step is built twice, with bf16 caches
and with fp8 e4m3 caches (per-tensor scales; ``bench_step.Shape``), one after
the other so only one copy is on the card.  Per cache dtype:

* ``*_step_us``: CUDA-graph replay of the step (all four stages), per step;
* ``*_attention_us``: CUDA-graph replay of ``sparse_paged_attention`` alone on
  the step's own caches and selection (``return_token_indices=True``);
* ``*_stages_us``: the step's device time by stage (``rope_cache_compress``:
  stages 1-2, ``selection``: stage 3, ``attention``: stage 4), summed from the
  kernels' durations in a torch.profiler (CUPTI) trace of eager steps.

``copy_gbps``: the card's device-to-device copy rate (an SM copy kernel) measured in the same
process (bytes read + written); ``attention_bytes_bf16``: the bf16
attention's bytes (each valid selected K and V row once per KV head, q, out,
the indices and the block table), ``attention_pct_copy_bf16`` /
``attention_pct_copy_fp8``: those bytes (fp8: K/V at one byte) over the
attention's time, as a % of ``copy_gbps``.  Ratios: ``step_speedup`` =
bf16 / fp8 step, ``attention_ratio`` = fp8 / bf16 attention.

Writes ``benchmarks/results/<card>/fp8_vs_bf16.json``.
"""

from __future__ import annotations

import gc

import common
from bench_step import BATCHES, PRODUCTION, SMOKE, Shape

CONTEXT = 131072
STAGE_OF_KERNEL = (  # the first name fragment a kernel's name holds -> its stage
    ("attention", "attention"), ("merge_splits", "attention"),
    ("select", "selection"), ("score", "selection"), ("topk", "selection"), ("expand", "selection"),
)


def stage_of(kernel_name: str) -> str:
    for fragment, stage in STAGE_OF_KERNEL:
        if fragment in kernel_name:
            return stage
    return "rope_cache_compress"


def stages_us(torch, step, steps: int = 10) -> dict[str, float]:
    """Device µs per step by stage, from the kernels' durations in a CUPTI trace of eager steps."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in trace.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        duration = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
        stage = stage_of(event.name)
        totals[stage] = totals.get(stage, 0.0) + duration / steps
    return totals


def attention_arrays(shape: Shape) -> dict:
    """The step's attention call on its own caches and selection."""
    import qsa_torch

    out = qsa_torch.qsa_attention_step(**shape.inputs, state=shape.state, metadata=shape.meta, cos_sin=shape.cos_sin,
                                       index_cos_sin=shape.index_cos_sin, return_token_indices=True,
                                       **shape.options)
    token_indices = out[2]
    arrays = dict(q=shape.inputs["q"], k_cache=shape.state.key_cache, v_cache=shape.state.value_cache,
                  token_indices=token_indices, block_table=shape.meta.block_table,
                  token_to_req=shape.meta.token_to_req)
    if shape.fp8:
        arrays.update(k_scale=shape.state.k_scale, v_scale=shape.state.v_scale)
    return arrays


def attention_bytes(g, arrays: dict, kv_element_bytes: int) -> int:
    """Valid selected K and V rows once per KV head, q, out, the indices and the block table."""
    valid = int((arrays["token_indices"] >= 0).sum())
    q = arrays["q"]
    kv = 2 * valid * g.KH * g.D * kv_element_bytes
    return (kv + 2 * q.numel() * q.element_size() + arrays["token_indices"].numel() * arrays["token_indices"]
            .element_size() + arrays["block_table"].numel() * arrays["block_table"].element_size())


def measure(torch, g, batch: int, fp8: bool, smoke: bool) -> dict:
    import qsa_torch

    shape = Shape(g, batch, CONTEXT if not smoke else 64, "cuda" if torch.cuda.is_available() else "cpu", fp8=fp8)
    name = "fp8" if fp8 else "bf16"
    row = {}
    step = shape.torch_step
    row[f"{name}_step_us"] = common.torch_graph_us(step, calls=10, smoke=smoke) or common.torch_median_us(step, smoke)
    arrays = attention_arrays(shape)
    attend = lambda: qsa_torch.sparse_paged_attention(**arrays)  # noqa: E731
    row[f"{name}_attention_us"] = common.torch_graph_us(attend, smoke=smoke) or common.torch_median_us(attend, smoke)
    row[f"attention_bytes_{name}"] = attention_bytes(g, arrays, 1 if fp8 else 2)
    if torch.cuda.is_available():
        row[f"{name}_stages_us"] = stages_us(torch, step)
    return row


def release(torch) -> None:
    """The last shape's caches off the card before the next is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main():
    parser = common.parser(__doc__, "fp8_vs_bf16.json")
    parser.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")], default=BATCHES)
    args = parser.parse_args()
    import torch

    g = SMOKE if args.smoke else PRODUCTION
    batches = [1, 2] if args.smoke else args.batches
    copy = common.copy_gbps(smoke=args.smoke)
    rows, notes = [], []
    for batch in batches:
        row = dict(batch=batch, context=64 if args.smoke else CONTEXT, card=common.card(), copy_gbps=copy)
        try:
            for fp8 in (False, True):
                row.update(measure(torch, g, batch, fp8, args.smoke))
                release(torch)
        except torch.cuda.OutOfMemoryError:
            notes.append(f"{batch} requests x {CONTEXT}: out of memory on this card, skipped (and larger batches)")
            release(torch)
            break
        row["step_speedup"] = row["bf16_step_us"] / row["fp8_step_us"]
        row["attention_ratio"] = row["fp8_attention_us"] / row["bf16_attention_us"]
        if copy:
            for name in ("bf16", "fp8"):
                rate = common.gbps(row[f"attention_bytes_{name}"], row[f"{name}_attention_us"])
                row[f"attention_pct_copy_{name}"] = 100.0 * rate / copy
        rows.append(row)
        common.print_table([row], [k for k in row if not k.endswith("stages_us")])
        for name in ("bf16", "fp8"):
            print(f"  {name} stages µs:", {k: round(v, 1) for k, v in row.get(f"{name}_stages_us", {}).items()})
    common.write_json(args.json, "fp8 vs bf16 caches: step and attention", rows, [
        "production geometry (24 Q / 2 KV heads x d256, indexer 4 x d128, pages of 64, top-512 blocks), one "
        f"decode row per request at {CONTEXT} tokens of context; bf16 and fp8 e4m3 caches (scales 1.0) built one "
        "after the other",
        "*_step_us: CUDA graph of 10 steps, per step; *_attention_us: CUDA graph of 20 sparse_paged_attention "
        "calls on the step's caches and selection, per call; *_stages_us: device µs per eager step by stage "
        "(CUPTI kernel durations)",
        "copy_gbps: an SM copy kernel (torch.mul(x, 1, out=y), float32) over 2 GiB read + written, CUDA graph, "
        "same process; "
        "attention_pct_copy_*: attention bytes / time as % of copy_gbps",
        *notes,
    ])


if __name__ == "__main__":
    main()
