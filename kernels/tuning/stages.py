"""The tuning of stages 1 and 2 (RoPE and the caches, compression) and of the composed step."""

from __future__ import annotations

from ._values import MAX_WARPS, _positive_int, _power_of_two, _tuning_value


@_tuning_value
class RopeCacheTuning:
    """Stage 1 (``rope_reshape_and_cache``).

    Query heads per program: a ``[BLOCK_H, D]`` tile of about
    ``tile_elements``.  Small tiles on 2 warps keep the most rows in flight
    (``benchmarks/tune_rope_cache.py``; figures: docs/performance.md, "Per
    stage").
    """

    tile_elements: int = 1024
    num_warps: int = 2

    def __post_init__(self):
        _positive_int("RopeCacheTuning", "tile_elements", self.tile_elements)
        _positive_int("RopeCacheTuning", "num_warps", self.num_warps)
        # A tile of tile_elements // D query heads (a tl.arange size); warps as Triton takes them.
        _power_of_two("RopeCacheTuning", "tile_elements", self.tile_elements)
        _power_of_two("RopeCacheTuning", "num_warps", self.num_warps, most=MAX_WARPS)


@_tuning_value
class CompressTuning:
    """Stage 2 (``compress_groups`` and ``store_cache_rows``).

    Elements per program: with 4 warps each thread moves 8 elements (one
    16-byte load of bf16 per group member), and a decode batch of 256 rows
    still spreads over 32-64 programs.
    """

    tile_elements: int = 1024

    def __post_init__(self):
        _positive_int("CompressTuning", "tile_elements", self.tile_elements)
        _power_of_two("CompressTuning", "tile_elements", self.tile_elements)  # rows a tile: tile_elements // W


@_tuning_value
class StepTuning:
    """The composed step (``qsa_attention_step``): which stages share a launch.

    ``fuse_stages``: with at most ``fused_max_rows`` rows, the step runs its
    compression stage (pooling, the ring store, the pooled keys' RoPE and
    their store) and the index queries' RoPE as one launch
    (``fused.plan_compress_rotate_store``) instead of five; bit for bit the
    same results.  One program of that launch holds every row (so that the
    ring is read before it is overwritten), hence the bound (not yet timed:
    a decode batch of up to 16 rows is one [16, DI] tile).  Off: the
    separate launches (the test oracle: tests compare the two).

    ``fuse_rope``: stage 1 (RoPE on q and k, k and v into the KV cache) runs
    its programs in that same launch (``fused.rope_compress_store``): one
    launch fewer (four per decode step at 1-8 requests), the same bits; off,
    the oracle again.
    """

    fuse_stages: bool = True
    fused_max_rows: int = 16
    fuse_rope: bool = True

    def __post_init__(self):
        for name in ("fuse_stages", "fuse_rope"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StepTuning: {name} must be a bool, got {getattr(self, name)!r}")
        _positive_int("StepTuning", "fused_max_rows", self.fused_max_rows)
