"""Composed-step benchmark: one QSA attention layer's decode step against a dense attention layer.

Production geometry (attention 24 Q / 2 KV heads x d256 bf16, KV pages of 64;
indexer 4 heads x d128, ratio 4, compressed pages of 64; top 512 blocks =
2048 tokens + tail).  ``B`` requests at ``L`` tokens of context each decode one
row: ``qsa_attention_step`` runs all four stages (RoPE + KV write, compression
+ ring + compressed store, selection, sparse attention).

One copy of the caches: torch allocates them (random contents; each request's
pages contiguous, so the dense baseline can view them as ``[B, L, KH, D]``)
and JAX uses the same memory through DLPack, updating it in place by
donation.  Should a runtime refuse to donate a DLPack buffer (the step would
then copy the whole cache), JAX gets its own copy where two fit, else that
shape's JAX columns are skipped with a note.

Paths, per shape:
* ``jax_wall_us``: N back-to-back calls of the jitted step (donated state),
  wall clock per call; ``jax_floor_us``: the same for a trivial jitted
  function of the same arguments (what JAX's dispatch costs on the host, the
  floor under ``jax_wall_us``); ``jax_loop_us``: one jitted ``lax.fori_loop`` of N steps
  with ``unroll=True`` (device time), each step's output fed back as the next
  query so no step can be dropped;
* ``torch_graph_us``: CUDA-graph replay of N steps; ``torch_eager_us``:
  ``triton.testing.do_bench`` median of one eager step;
* ``torch_compile_us``: ``torch.compile(fullgraph=True)`` of the step (Inductor,
  default mode), do_bench median; ``torch_compile_graph_us``: the same with
  ``mode="reduce-overhead"`` (Inductor's CUDA graphs; the caches are marked
  static addresses, as a module's buffers would be), N back-to-back calls
  between two events, per call (GPU only: None on the CPU);
* ``dense_graph_us``: the dense attention layer, CUDA-graph replay: stage 1
  (RoPE + KV write) and ``scaled_dot_product_attention`` (flash) over each
  request's whole context (GQA as MQA per KV head).

Goals reported: JAX jitted step device time within 5% of the torch graph step;
``torch.compile(mode="reduce-overhead")`` within 5% of the hand-captured graph;
at 128K the QSA layer at least 15x faster than the dense layer for every batch.

``--cache-dtype fp8``: the K/V and compressed-key caches are fp8 e4m3 with
per-tensor scales in ``QSAState`` (results in step_fp8.json by default).  The
dense baseline is not rerun (it reads bf16 caches): ``dense_bf16_graph_us``
comes from a bf16 run's JSON (``--dense-json``, default results/<card>/step.json)
where it has the shape, with the goal: at 128K, the fp8 QSA layer at least
25x faster than the dense bf16 layer at 64 and 256 requests.
``launches``: kernel launches per step (observed on one eager step).
``--unfused-selection``: the selection as score, top-k and expand launches
(``SelectTuning(fused=False)``).
``--merge-paths``: also the step's launches and CUDA-graph µs with the
attention's split-K merged in its launch and by a merge launch
(``AttentionTuning.fused_merge`` forced each way; the default, ``False``,
takes the merge launch; ``None`` would merge in the launch at up to
``fused_merge_max_programs`` programs: 1-8 requests).
``--pdl-paths``: also the step's CUDA-graph µs and eager wall with
programmatic dependent launch on and off (``qsa_kernels.pdl.ENABLED``
forced each way; on by default on sm_90).
``--rope-paths``: also the step's launches, CUDA-graph µs and eager wall
with stage 1 in stage 2's launch and in its own (``StepTuning.fuse_rope``
each way, alternating: separate, fused, separate again, fused again).
``--multi-token-rows N``: also the step with ``N`` new rows per request
(speculative decoding / MTP: each row its own causal tail, a short prefill
chunk per request; docs/api.md) at 8 and 64 requests (both smoke batches with
``--smoke``): ``multi_token_*`` columns, its launches, CUDA-graph µs (per
step of ``B x N`` rows) and eager µs, and ``multi_token_over_one_row``, its
graph time over the one-row step's.  The rows' positions end at ``L - 1``.
``--engine-pattern``: also ``engine_graph_us``, the step compiled once with a
dynamic token count (``torch.compile(dynamic=True)``, as vLLM compiles its
model) and then captured in a CUDA graph and replayed, as engines do per
batch size (per step; beside ``torch_graph_us``, the hand-captured graph).
``--unfused``: the step's stage 2 and index-query RoPE as separate launches
(``StepTuning(fuse_stages=False)``; results in step_unfused.json by default),
to compare with the fused default.
Shapes run in order of importance (128K first) and stop at a time budget, with
a note.  Every shape's torch columns come first, with no JAX in the process
(as a torch user's process has none), then every shape's JAX columns.  ``benchmarks/plot_step.py`` draws the JSON.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card

import common  # noqa: E402
from qsa_kernels.tuning import TOPK_PATHS  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Geometry:
    QH: int = 24
    KH: int = 2
    D: int = 256
    IH: int = 4
    DI: int = 128
    PAGE: int = 64
    RATIO: int = 4
    CPAGE: int = 64
    TOKEN_TOPK: int = 2048


PRODUCTION = Geometry()
BATCHES = [1, 8, 64, 256]
CONTEXTS = [131072, 32768, 8192]  # 128K first: the 15x goal is stated there
LOOP_CALLS = 10  # steps per CUDA graph and per unrolled fori_loop
TIME_BUDGET_S = 100.0  # stop starting new shapes past this (the whole run must stay < 150 s)
MEMORY_MARGIN = 4 << 30  # bytes left free for workspaces, graphs and JAX

SMOKE = Geometry(QH=4, KH=2, D=32, IH=2, DI=32, PAGE=8, RATIO=4, CPAGE=8, TOKEN_TOPK=16)
SMOKE_BATCHES, SMOKE_CONTEXTS = [1, 2], [64]
MULTI_TOKEN_BATCHES = (8, 64)  # --multi-token-rows: the batches it is measured at


def cache_bytes(g: Geometry, batch: int, context: int, element_bytes: int = 2) -> int:
    kv = 2 * batch * context * g.KH * g.D * element_bytes
    compressed = batch * (context // g.RATIO + g.CPAGE) * g.DI * element_bytes
    return kv + compressed


def random_fp8(torch, shape, device):
    """N(0, 1) values rounded to fp8 e4m3, made in chunks (no NaN codes, unlike random bits)."""
    cache = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    for first in range(0, shape[0], 4096):
        cache[first:first + 4096] = torch.randn(cache[first:first + 4096].shape, device=device).to(cache.dtype)
    return cache


class Shape:
    """Caches, metadata and inputs of one (batch, context) decode step, on torch's device."""

    def __init__(self, g: Geometry, batch: int, context: int, device, fp8: bool = False, rows_per_request: int = 1):
        import numpy as np
        import torch

        import qsa_torch
        from qsa_kernels.paging import CacheGeometry, PagedRequests

        self.g, self.batch, self.context = g, batch, context
        geometry = CacheGeometry(
            page_size=g.PAGE, num_pages=batch * -(-context // g.PAGE), compress_ratio=g.RATIO,
            compressed_page_size=g.CPAGE, num_compressed_pages=batch * -(-(context // g.RATIO) // g.CPAGE),
            max_context=context, max_requests=batch)
        pager = PagedRequests(geometry)  # no shuffle: request r owns pages r*W .. r*W + W - 1
        self.rows_per_request = rows_per_request
        for request in range(batch):
            pager.admit(request, context - rows_per_request)
        # Each request's rows at positions context - rows_per_request .. context - 1.
        self.host_meta = pager.step({request: rows_per_request for request in range(batch)})
        rows = batch * rows_per_request
        self.meta = qsa_torch.StepMetadata.from_host(self.host_meta, device)
        shapes = geometry.state_shapes(g.KH, g.D, g.DI)
        self.fp8 = fp8
        if fp8:  # fp8 K/V and compressed keys with their scales; the ring stays bf16
            scale = lambda: torch.full((), 1.0, dtype=torch.float32, device=device)  # noqa: E731
            self.state = qsa_torch.QSAState(
                key_cache=random_fp8(torch, shapes["key_cache"], device),
                value_cache=random_fp8(torch, shapes["value_cache"], device),
                compressor_state_cache=torch.empty(shapes["compressor_state_cache"], dtype=torch.bfloat16,
                                                   device=device).normal_(),
                compressed_key_cache=random_fp8(torch, shapes["compressed_key_cache"], device),
                k_scale=scale(), v_scale=scale(), compressed_key_scale=scale())
        else:
            self.state = qsa_torch.QSAState(**{
                name: torch.empty(shape, dtype=torch.bfloat16, device=device).normal_()
                for name, shape in shapes.items()})
        gen = torch.Generator(device).manual_seed(0)
        rnd = lambda *s: torch.randn(*s, generator=gen, device=device).to(torch.bfloat16)  # noqa: E731
        self.inputs = dict(q=rnd(rows, g.QH, g.D), k=rnd(rows, g.KH, g.D), v=rnd(rows, g.KH, g.D),
                           index_q=rnd(rows, g.IH, g.DI), index_k=rnd(rows, 1, g.DI))
        def table(d):
            angles = torch.arange(context, device=device)[:, None] * torch.rand(d // 2, device=device)
            return torch.cat([angles.cos(), angles.sin()], 1)

        self.cos_sin, self.index_cos_sin = table(g.D), table(g.DI)
        self.options = dict(compress_ratio=g.RATIO, token_topk=g.TOKEN_TOPK)
        assert np.array_equal(self.host_meta.positions,
                              np.tile(np.arange(context - rows_per_request, context), batch))

    def torch_step(self):
        import qsa_torch

        return qsa_torch.qsa_attention_step(**self.inputs, state=self.state, metadata=self.meta, cos_sin=self.cos_sin,
                                            index_cos_sin=self.index_cos_sin, **self.options)[0]

    def compiled_step(self, mode: str | None, every_input_static: bool = False, dynamic: bool | None = None):
        """``torch.compile`` of the step (fullgraph: no graph break allowed), over this shape's tensors.

        The caches are marked static addresses, as a module's buffers would
        be; ``every_input_static`` marks every tensor argument so (the fixed
        addresses a hand-captured graph has): Inductor's CUDA graphs copy
        every other input into the graph's own buffer on each replay.
        """
        import torch

        import qsa_torch

        for name in ("key_cache", "value_cache", "compressor_state_cache", "compressed_key_cache"):
            torch._dynamo.mark_static_address(getattr(self.state, name))
        if every_input_static:
            for tensor in self.tensors():
                torch._dynamo.mark_static_address(tensor)
        step = torch.compile(qsa_torch.qsa_attention_step, fullgraph=True, mode=mode, dynamic=dynamic)
        return lambda: step(**self.inputs, state=self.state, metadata=self.meta, cos_sin=self.cos_sin,
                            index_cos_sin=self.index_cos_sin, **self.options)[0]

    def tensors(self):
        """Every tensor argument of the step."""
        import torch

        fields = [*self.inputs.values(), self.cos_sin, self.index_cos_sin]
        for holder in (self.state, self.meta):
            fields += [getattr(holder, f.name) for f in dataclasses.fields(holder)]
        return [t for t in fields if isinstance(t, torch.Tensor)]

    def dense_step(self):
        """Stage 1, then flash SDPA over every request's whole context (the caches viewed as [B, L, KH, D])."""
        import torch.nn.functional as F

        import qsa_torch

        g, batch = self.g, self.batch
        q, _, key_cache, value_cache = qsa_torch.rope_reshape_and_cache(
            self.inputs["q"], self.inputs["k"], self.inputs["v"], self.state.key_cache, self.state.value_cache,
            self.meta.slot_mapping, self.meta.positions, self.cos_sin, is_neox=True)
        whole = lambda cache: cache.view(batch, -1, g.KH, g.D)[:, : self.context].transpose(1, 2)  # noqa: E731
        return F.scaled_dot_product_attention(q.view(batch, g.KH, g.QH // g.KH, g.D), whole(key_cache),
                                              whole(value_cache))


def launches(shape: Shape) -> int:
    """Kernel launches of one step (one eager torch step, observed; JAX runs the same Program)."""
    from qsa_kernels.launch import observe_launches

    with observe_launches() as events:
        shape.torch_step()
    return len(events)


def jax_columns(shape: Shape, share: str, smoke: bool, lowering: str = "auto") -> tuple[dict, str]:
    """JAX wall clock and fori_loop device time of the step; ``share`` is "dlpack" or "copy";
    ``lowering``: how the Triton launches reach XLA (``qsa_jax.use_triton_lowering``)."""
    import qsa_jax

    with qsa_jax.use_triton_lowering(lowering):
        return _jax_columns(shape, share, smoke)


def jax_arrays(shape: Shape, share: str = "dlpack") -> tuple[dict, object, object, tuple]:
    """``(inputs, state, metadata, (cos_sin, index_cos_sin))`` of ``shape`` as JAX arrays: torch's
    memory through DLPack, the state too with ``share="dlpack"`` (else JAX's own copy)."""
    import jax
    import jax.numpy as jnp

    import qsa_jax
    from qsa_kernels.paging import STATE_FIELDS
    from qsa_kernels.step import SCALE_FIELDS

    def dlpack(tensor):
        try:
            return jax.dlpack.from_dlpack(tensor)
        except Exception:  # no fp8 through DLPack here: share the bytes, then reinterpret
            import torch

            if tensor.dtype != torch.float8_e4m3fn:
                raise
            return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(tensor.view(torch.uint8)), jnp.float8_e4m3fn)

    inputs = {name: dlpack(a) for name, a in shape.inputs.items()}
    tables = (dlpack(shape.cos_sin), dlpack(shape.index_cos_sin))
    meta = qsa_jax.StepMetadata.from_host(shape.host_meta)
    own = (lambda t: jnp.array(dlpack(t), copy=True)) if share == "copy" else dlpack
    state = qsa_jax.QSAState(**{name: own(getattr(shape.state, name)) for name in STATE_FIELDS},
                             **{name: own(getattr(shape.state, name)) for name in SCALE_FIELDS
                                if getattr(shape.state, name) is not None})
    return inputs, state, meta, tables


def jax_step_and_loop(shape: Shape, calls: int = LOOP_CALLS):
    """``(step, loop)``: the QSA step over ``(inputs, state, meta, cos_sin, index_cos_sin)``, and a
    ``lax.fori_loop`` of ``calls`` of them (unrolled; each output fed back as the next query, so no
    step can be dropped), both returning ``(out, state)``; to be jitted with the state donated."""
    import jax

    import qsa_jax

    def step(inputs, state, meta, cos_sin, index_cos_sin):
        return qsa_jax.qsa_attention_step(**inputs, state=state, metadata=meta, cos_sin=cos_sin,
                                          index_cos_sin=index_cos_sin, **shape.options)

    def loop(inputs, state, meta, cos_sin, index_cos_sin):
        def body(_, carry):
            q, state = carry
            return step(dict(inputs, q=q), state, meta, cos_sin, index_cos_sin)

        return jax.lax.fori_loop(0, calls, body, (inputs["q"], state), unroll=True)

    return step, loop


def _jax_columns(shape: Shape, share: str, smoke: bool) -> tuple[dict, str]:
    import jax

    inputs, state, meta, tables = jax_arrays(shape, share)
    step, loop = jax_step_and_loop(shape)
    jitted = jax.jit(step, donate_argnums=1)
    looped = jax.jit(loop, donate_argnums=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        _, state = jax.block_until_ready(jitted(inputs, state, meta, *tables))
        note = ""
        if share == "dlpack" and state.key_cache.unsafe_buffer_pointer() != shape.state.key_cache.data_ptr():
            note = "donation did not keep the DLPack buffer"
        wall, state = _calls_us(jitted, inputs, state, meta, tables, smoke)
        columns = dict(jax_wall_us=wall)
        columns["jax_floor_us"], state = _floor_us(inputs, state, meta, tables, smoke)
        _, state = jax.block_until_ready(looped(inputs, state, meta, *tables))
        times = []
        for _ in range(3 if smoke else 5):
            start = time.perf_counter()
            _, state = jax.block_until_ready(looped(inputs, state, meta, *tables))
            times.append((time.perf_counter() - start) * 1e6 / LOOP_CALLS)
        columns["jax_loop_us"] = statistics.median(times)
        trace = common.gpu_trace(lambda: jax.block_until_ready(looped(inputs, state, meta, *tables)), LOOP_CALLS)
        if trace:  # the GPU's own time per step (the loop's wall time also holds XLA's host work)
            columns.update(jax_device_us=trace["device_us"], jax_gpu_ops=trace["gpu_ops"])
    return columns, note


def _floor_us(inputs, state, meta, tables, smoke: bool) -> tuple[float, object]:
    """What JAX itself costs per call on this host: a trivial jitted function of the step's arguments
    (the state donated and returned, a fresh output of the step's shape), timed as ``jax_wall_us`` is.
    Returns ``(µs per call, the state)``: the donated state must be taken back."""
    import jax
    import jax.numpy as jnp

    def trivial(inputs, state, meta, cos_sin, index_cos_sin):
        return jnp.zeros_like(inputs["q"]), state

    floor = jax.jit(trivial, donate_argnums=1)
    _, state = jax.block_until_ready(floor(inputs, state, meta, *tables))
    return _calls_us(floor, inputs, state, meta, tables, smoke)


def _calls_us(jitted, inputs, state, meta, tables, smoke: bool) -> tuple[float, object]:
    """Wall µs per call of LOOP_CALLS back-to-back calls of ``jitted`` (median of repeats) and the state
    it hands back (donated on every call)."""
    import jax

    times = []
    for _ in range(3 if smoke else 5):
        start = time.perf_counter()
        for _ in range(LOOP_CALLS):
            _, state = jitted(inputs, state, meta, *tables)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) * 1e6 / LOOP_CALLS)
    return statistics.median(times), state


class Runner:
    """Measures shapes in turn; JAX shares torch's caches through DLPack until donating them fails."""

    def __init__(self, smoke: bool, fp8: bool = False, lowerings: tuple[str, ...] = ()):
        import torch

        self.torch, self.smoke, self.fp8 = torch, smoke, fp8
        self.lowerings = lowerings  # extra JAX columns per Triton lowering (jax_*_us_<lowering>)
        self.skip_compile = False
        self.skip_jax = False
        self.merge_paths = False
        self.pdl_paths = False
        self.rope_paths = False
        self.engine_pattern = False
        self.multi_token_rows = 0  # --multi-token-rows: 0, no multi-token columns
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.share = "dlpack"
        self.notes: list[str] = []

    def free_bytes(self) -> float:
        return self.torch.cuda.mem_get_info()[0] if self.device.type == "cuda" else float("inf")

    def measure(self, g: Geometry, batch: int, context: int) -> dict | None:
        """The torch columns of one shape (no JAX in the process yet: see :meth:`measure_jax`)."""
        label = f"B={batch} L={_tokens(context)}"
        need = cache_bytes(g, batch, context, 1 if self.fp8 else 2)
        if need + MEMORY_MARGIN > self.free_bytes():
            self.notes.append(f"{label}: skipped, its caches ({need / 2**30:.1f} GiB) do not fit")
            return None
        shape = Shape(g, batch, context, self.device, fp8=self.fp8)
        row = dict(batch=batch, context=context, cache_gib=round(need / 2**30, 2), launches=launches(shape))
        row["torch_eager_us"] = common.torch_median_us(shape.torch_step, self.smoke)
        row["torch_eager_wall_us"] = common.torch_wall_us(shape.torch_step, smoke=self.smoke)
        row["torch_graph_us"] = common.torch_graph_us(shape.torch_step, calls=LOOP_CALLS, smoke=self.smoke)
        row["torch_graph_wall_us"] = self.graph_wall_us(shape)
        if self.merge_paths:
            row.update(self.merge_path_columns(shape))
        if self.pdl_paths:
            row.update(self.pdl_path_columns(shape))
        if self.rope_paths:
            row.update(self.rope_path_columns(shape))
        if self.engine_pattern:
            row.update(self.engine_columns(shape, label))
        if not self.fp8:  # compiled columns and the dense layer (it reads bf16 caches) come from a bf16 run
            if not self.skip_compile:
                row.update(self.compiled(shape, label))
            row["dense_graph_us"] = common.torch_graph_us(shape.dense_step, calls=LOOP_CALLS, smoke=self.smoke)
        del shape
        self._free()
        if self.multi_token_rows and (self.smoke or batch in MULTI_TOKEN_BATCHES):  # one shape's caches at a time
            row.update(self.multi_token_columns(g, batch, context, row["torch_graph_us"]))
        return row

    def measure_jax(self, g: Geometry, row: dict) -> None:
        """Add the JAX columns and the ratios to a shape's row (the same shape and contents again).

        Run after every shape's torch columns, so that those are timed with no
        JAX in the process (``torch_beside_jax.py`` times the eager step beside
        each stage of bringing JAX up)."""
        if not self.skip_jax:
            shape = Shape(g, row["batch"], row["context"], self.device, fp8=self.fp8)
            row.update(self.jax_lowerings(shape, f"B={row['batch']} L={_tokens(row['context'])}"))
            del shape
            self._free()
        row["jax_over_torch_device"] = _ratio(row.get("jax_device_us") or row.get("jax_loop_us"),
                                              row.get("torch_graph_us"))
        row["jax_wall_over_torch_graph"] = _ratio(row.get("jax_wall_us"), row.get("torch_graph_us"))
        row["compile_graph_over_graph"] = _ratio(row.get("torch_compile_graph_us"), row.get("torch_graph_us"))
        row["dense_over_qsa"] = _ratio(row.get("dense_graph_us"), row.get("torch_graph_us"))

    def _free(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def multi_token_columns(self, g: Geometry, batch: int, context: int, one_row_graph_us: float | None) -> dict:
        """``--multi-token-rows N``: the step with N new rows per request (B x N rows), its own caches
        (the one-row shape's are freed before)."""
        rows = self.multi_token_rows
        shape = Shape(g, batch, context, self.device, fp8=self.fp8, rows_per_request=rows)
        columns = dict(multi_token_rows=rows, multi_token_launches=launches(shape))
        columns["multi_token_eager_us"] = common.torch_median_us(shape.torch_step, self.smoke)
        columns["multi_token_graph_us"] = common.torch_graph_us(shape.torch_step, calls=LOOP_CALLS, smoke=self.smoke)
        columns["multi_token_over_one_row"] = _ratio(columns["multi_token_graph_us"], one_row_graph_us)
        del shape
        self._free()
        return columns

    def merge_path_columns(self, shape: Shape) -> dict:
        """``--merge-paths``: launches and CUDA-graph µs of the step with the attention's split-K
        merged in its launch and by a merge launch (AttentionTuning.fused_merge forced each way)."""
        from qsa_kernels import tuning

        columns = {}
        for fused, name in ((True, "fused_merge"), (False, "merge_launch")):
            with tuning.override(attention=common.fused_merge_attention(fused)):
                columns[f"{name}_launches"] = launches(shape)
                columns[f"{name}_graph_us"] = common.torch_graph_us(shape.torch_step, calls=LOOP_CALLS,
                                                                    smoke=self.smoke)
        return columns

    def pdl_path_columns(self, shape: Shape) -> dict:
        """``--pdl-paths``: CUDA-graph µs and eager wall of the step with programmatic dependent
        launch on and off (qsa_kernels.pdl.ENABLED forced each way, new graphs each way)."""
        from qsa_kernels import pdl

        columns, enabled = {}, pdl.ENABLED
        try:
            for on, name in ((False, "no_pdl"), (True, "pdl"), (False, "no_pdl_again")):
                pdl.ENABLED = on
                columns[f"{name}_graph_us"] = common.torch_graph_us(shape.torch_step, calls=LOOP_CALLS,
                                                                    smoke=self.smoke)
                columns[f"{name}_eager_wall_us"] = common.torch_wall_us(shape.torch_step, smoke=self.smoke)
        finally:
            pdl.ENABLED = enabled
        return columns

    def rope_path_columns(self, shape: Shape) -> dict:
        """``--rope-paths``: launches, CUDA-graph µs and eager wall of the step with stage 1 in its own
        launch and in stage 2's (StepTuning.fuse_rope forced each way, alternating, new graphs each time)."""
        from qsa_kernels import tuning

        columns = {}
        for fused, name in ((False, "rope_launch"), (True, "rope_fused"), (False, "rope_launch_again"),
                            (True, "rope_fused_again")):
            with tuning.override(step=dataclasses.replace(tuning.current().step, fuse_rope=fused)):
                columns[f"{name}_launches"] = launches(shape)
                columns[f"{name}_graph_us"] = common.torch_graph_us(shape.torch_step, calls=LOOP_CALLS,
                                                                    smoke=self.smoke)
                columns[f"{name}_eager_wall_us"] = common.torch_wall_us(shape.torch_step, smoke=self.smoke)
        return columns

    def engine_columns(self, shape: Shape, label: str) -> dict:
        """The engine pattern (vLLM's): the step compiled once with a dynamic token count
        (``dynamic=True``, default mode), then that compiled step captured in a CUDA graph and
        replayed: ``engine_graph_us`` per step, beside the hand-captured graph's ``torch_graph_us``."""
        if self.device.type != "cuda":
            return {}
        try:
            self.torch._dynamo.reset()
            step = shape.compiled_step(None, dynamic=True)
            step()  # compile
            return {"engine_graph_us": common.torch_graph_us(step, calls=LOOP_CALLS, smoke=self.smoke)}
        except Exception as error:  # keep the other columns of the shape
            self.notes.append(f"{label}: the engine pattern failed: {type(error).__name__}: {str(error)[:200]}")
            return {}

    def graph_wall_us(self, shape: Shape) -> float | None:
        """A hand-captured CUDA graph of one step, replayed back to back: wall per replay."""
        if self.device.type != "cuda":
            return None
        return common.torch_wall_us(common.one_call_graph(shape.torch_step).replay, smoke=self.smoke)

    def compiled(self, shape: Shape, label: str) -> dict:
        """torch.compile columns (GPU only: Inductor needs a device; CPU smoke runs skip them)."""
        if self.device.type != "cuda":
            return {}
        columns = {}
        for column, mode, static in (("torch_compile", None, False), ("torch_compile_graph", "reduce-overhead", False),
                                     ("torch_compile_graph_static", "reduce-overhead", True)):
            try:
                self.torch._dynamo.reset()
                step = shape.compiled_step(mode, every_input_static=static)
                if mode is None:
                    columns[column + "_us"] = common.torch_median_us(step, self.smoke)
                else:
                    columns[column + "_us"] = common.torch_loop_us(step, calls=LOOP_CALLS, smoke=self.smoke)
                columns[column + "_wall_us"] = common.torch_wall_us(step, smoke=self.smoke)
            except Exception as error:  # keep the other columns of the shape
                self.notes.append(f"{label}: torch.compile mode={mode} failed: {type(error).__name__}: "
                                  f"{str(error)[:200]}")
        # torch's own floors: a compiled function of the same tensors doing nothing of ours (one
        # elementwise kernel), in each mode (reduce-overhead: every tensor static).
        tensors = shape.tensors()
        for column, mode in (("torch_compile_default_floor_wall_us", None),
                             ("torch_compile_floor_wall_us", "reduce-overhead")):
            try:
                self.torch._dynamo.reset()
                if mode is not None:
                    for tensor in tensors:
                        self.torch._dynamo.mark_static_address(tensor)
                floor = self.torch.compile(lambda *ts: ts[0] + 1, fullgraph=True, mode=mode)
                columns[column] = common.torch_wall_us(lambda: floor(*tensors), smoke=self.smoke)
            except Exception as error:
                self.notes.append(f"{label}: the torch.compile floor (mode={mode}) failed: {type(error).__name__}: "
                                  f"{str(error)[:200]}")
        return columns

    def jax_lowerings(self, shape: Shape, label: str) -> dict:
        """The JAX columns with the default lowering, plus ``*_<lowering>`` columns for each
        of ``self.lowerings`` (the default's columns are those of the lowering it resolves to)."""
        import qsa_jax

        if not self.lowerings:
            return self.jax(shape, label)
        row = {}
        for lowering in self.lowerings:
            columns = self.jax(shape, label, lowering)
            row.update({f"{name}_{lowering.replace('-', '_')}": value for name, value in columns.items()})
            if lowering == qsa_jax.triton_lowering():
                row.update(columns)
        return row

    def jax(self, shape: Shape, label: str, lowering: str = "auto") -> dict:
        if self.share == "dlpack":
            try:
                columns, problem = jax_columns(shape, "dlpack", self.smoke, lowering)
                if not problem:
                    return columns
                self.notes.append(f"{label}: {problem}; JAX gets its own copy of the caches from here on")
            except Exception as error:
                self.notes.append(f"{label}: JAX over the DLPack caches failed ({type(error).__name__}: "
                                  f"{str(error)[:160]}); JAX gets its own copy from here on")
            self.share = "copy"
        if cache_bytes(shape.g, shape.batch, shape.context, 1 if self.fp8 else 2) + MEMORY_MARGIN > self.free_bytes():
            self.notes.append(f"{label}: JAX skipped: a second copy of the caches does not fit")
            return {}
        try:
            return jax_columns(shape, "copy", self.smoke, lowering)[0]
        except Exception as error:  # keep the torch columns of the shape
            self.notes.append(f"{label}: JAX failed: {type(error).__name__}: {str(error)[:200]}")
            return {}


def main():
    p = common.parser(__doc__, "step.json")
    p.add_argument("--budget", type=float, default=TIME_BUDGET_S, help="seconds after which no new shape starts")
    p.add_argument("--cache-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="K/V and compressed-key caches: bf16, or fp8 e4m3 with per-tensor scales")
    p.add_argument("--dense-json", default=os.path.join(common.results_dir(), "step.json"),
                   help="with --cache-dtype fp8: the bf16 run whose dense_graph_us the fp8 step is compared with")
    p.add_argument("--jax-lowerings", nargs="*", default=None, choices=("legacy", "ffi", "jax-triton"),
                   help="also measure JAX with each of these Triton lowerings (default: legacy and ffi where "
                        "available; jax-triton: jax-triton's own lowering, the fallback)")
    p.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile columns (slow to build)")
    p.add_argument("--skip-jax", action="store_true", help="leave out the JAX columns")
    p.add_argument("--unfused", action="store_true",
                   help="the step's stage 2 and index-query RoPE as separate launches (StepTuning.fuse_stages off)")
    p.add_argument("--unfused-selection", action="store_true",
                   help="the selection as its three launches (SelectTuning.fused off; results in "
                        "step_unfused-selection.json)")
    p.add_argument("--topk-path", choices=TOPK_PATHS, default="auto",
                   help="force the selection's top-k path (TopkTuning.path; results in step_topk-<path>.json)")
    p.add_argument("--topk-tuning", type=lambda text: {name: int(value) for name, value in
                                                       (field.split("=") for field in text.split(","))},
                   default={}, help="TopkTuning integer fields for every column, e.g. radix_bits=4,bound_passes=4 "
                                    "(results in step_topk-tuning.json)")
    p.add_argument("--pdl-paths", action="store_true",
                   help="also the step's graph us and eager wall with programmatic dependent launch off and on")
    p.add_argument("--engine-pattern", action="store_true",
                   help="also the step compiled with dynamic=True, then captured in a CUDA graph (engine_graph_us)")
    p.add_argument("--rope-paths", action="store_true",
                   help="also the step's launches, graph us and eager wall with stage 1 in its own launch and in "
                        "stage 2's (StepTuning.fuse_rope each way, alternating)")
    p.add_argument("--multi-token-rows", type=int, default=0, metavar="N",
                   help="also time the step with N new rows per request (speculative decoding, e.g. 4) at "
                        f"{' and '.join(map(str, MULTI_TOKEN_BATCHES))} requests: multi_token_* columns")
    p.add_argument("--merge-paths", action="store_true",
                   help="also time the step with the attention's split-K merged in its launch and by a merge "
                        "launch (AttentionTuning.fused_merge forced each way): fused_merge_* and merge_launch_* "
                        "columns")
    p.add_argument("--fused-merge", choices=("default", "on", "off"), default="default",
                   help="run every column with the attention's split-K merged in its launch (on) or by a merge "
                        "launch (off): AttentionTuning.fused_merge forced (results in step_fused-merge-<on|off>.json)")
    args = p.parse_args()
    fp8 = args.cache_dtype == "fp8"
    default = p.get_default("json")
    if fp8 and args.json == default:
        args.json = args.json.replace("step.json", "step_fp8.json")
    defaults = (default, default.replace("step.json", "step_fp8.json"))
    if args.unfused and args.json in defaults:
        args.json = args.json.replace(".json", "_unfused.json")
    if args.unfused_selection and args.json in defaults:
        args.json = args.json.replace(".json", "_unfused-selection.json")
    if args.topk_path != "auto" and args.json in defaults:
        args.json = args.json.replace(".json", f"_topk-{args.topk_path}.json")
    if args.topk_tuning and args.json in defaults:
        args.json = args.json.replace(".json", "_topk-tuning.json")
    if args.fused_merge != "default" and args.json in defaults:
        args.json = args.json.replace(".json", f"_fused-merge-{args.fused_merge}.json")
    from qsa_kernels import tuning

    # Plans (JAX's at trace time too) are made inside: every column runs the chosen launches.
    stages = dict(step=tuning.StepTuning(fuse_stages=False)) if args.unfused else {}
    if args.topk_path != "auto" or args.topk_tuning:
        stages["topk"] = tuning.TopkTuning(path=args.topk_path, **args.topk_tuning)
    if args.unfused_selection:
        stages["select"] = tuning.SelectTuning(fused=False)
    if args.fused_merge != "default":
        stages["attention"] = common.fused_merge_attention(args.fused_merge == "on")
    with tuning.override(**stages):
        run(args, fp8)


def run(args, fp8: bool) -> None:
    started = time.perf_counter()
    g = SMOKE if args.smoke else PRODUCTION
    batches, contexts = (SMOKE_BATCHES, SMOKE_CONTEXTS) if args.smoke else (BATCHES, CONTEXTS)
    runner = Runner(args.smoke, fp8, ())  # its JAX lowerings are set before the JAX columns
    runner.skip_compile = args.skip_compile
    runner.skip_jax = args.skip_jax
    runner.merge_paths = args.merge_paths
    runner.pdl_paths = args.pdl_paths
    runner.rope_paths = args.rope_paths
    runner.engine_pattern = args.engine_pattern
    if args.multi_token_rows < 0 or args.multi_token_rows == 1:
        raise SystemExit("bench_step --multi-token-rows: N >= 2 (rows per request), or 0 for none")
    runner.multi_token_rows = args.multi_token_rows
    rows = []
    chosen = None
    if args.shapes and not args.smoke:  # decode:B:L entries only (a step decodes one row a request)
        if any(mode != "decode" for mode, _, _ in args.shapes):
            raise SystemExit("bench_step --shapes: decode:B:L entries only")
        chosen = {(batch, context) for _, batch, context in args.shapes}
        batches = [b for b in batches if any(b == c[0] for c in chosen)] + sorted(
            {b for b, _ in chosen} - set(batches))
        contexts = [c for c in contexts if any(c == x[1] for x in chosen)] + sorted(
            {c for _, c in chosen} - set(contexts), reverse=True)
    for context in contexts:
        for batch in batches:
            if chosen is not None and (batch, context) not in chosen:
                continue
            if time.perf_counter() - started > args.budget:
                runner.notes.append(f"B={batch} L={_tokens(context)}: skipped, past the {args.budget:.0f} s budget")
                continue
            row = runner.measure(g, batch, context)
            if row is not None:
                rows.append(row)
                common.print_table([row], list(row))
    # JAX after every shape's torch columns (Runner.measure_jax says why), with the same shapes.
    import qsa_jax

    if args.jax_lowerings is None:
        args.jax_lowerings = [name for name in ("legacy", "ffi") if qsa_jax.triton_lowering_available(name)]
    runner.lowerings = tuple(args.jax_lowerings)
    for row in rows:
        runner.measure_jax(g, row)

    columns = ["batch", "context", "cache_gib", "launches", "torch_eager_us", "torch_compile_us", "torch_compile_graph_us",
               "torch_compile_graph_static_us", "torch_graph_wall_us", "torch_eager_wall_us", "torch_compile_wall_us",
               "torch_compile_graph_wall_us", "torch_compile_graph_static_wall_us", "torch_compile_default_floor_wall_us",
               "torch_compile_floor_wall_us", "torch_graph_us", "jax_wall_us", "jax_floor_us", "jax_loop_us", "jax_device_us",
               *(f"jax_{kind}_us_{name.replace('-', '_')}" for name in args.jax_lowerings
                 for kind in ("wall", "loop", "device")),
               "dense_graph_us", "jax_over_torch_device", "jax_wall_over_torch_graph",
               "compile_graph_over_graph", "dense_over_qsa"]
    if args.pdl_paths:
        columns[columns.index("torch_graph_us") + 1:1] = [
            f"{name}_{kind}" for name in ("no_pdl", "pdl", "no_pdl_again") for kind in ("graph_us", "eager_wall_us")]
    if args.rope_paths:
        columns[columns.index("torch_graph_us") + 1:1] = [
            f"{name}_{kind}" for name in ("rope_launch", "rope_fused", "rope_launch_again", "rope_fused_again")
            for kind in ("launches", "graph_us", "eager_wall_us")]
    if args.engine_pattern:
        columns[columns.index("torch_graph_us") + 1:1] = ["engine_graph_us"]
    if args.multi_token_rows:
        columns[columns.index("torch_graph_us") + 1:1] = [
            "multi_token_rows", "multi_token_launches", "multi_token_eager_us", "multi_token_graph_us",
            "multi_token_over_one_row"]
    if args.merge_paths:
        columns[columns.index("torch_graph_us") + 1:1] = [
            "fused_merge_launches", "fused_merge_graph_us", "merge_launch_launches", "merge_launch_graph_us"]
    if fp8:
        columns = [c for c in columns if "compile" not in c]
        columns[columns.index("dense_graph_us")] = "dense_bf16_graph_us"
        columns[columns.index("dense_over_qsa")] = "dense_bf16_over_qsa_fp8"
    print()
    common.print_table(rows, columns)
    goals = _goals(rows, batches, contexts[0])
    if fp8:
        goals.append(_fp8_goal(rows, args.dense_json, contexts[0]))
    for line in goals + runner.notes:
        print(line)
    sharing = ("one copy of the caches, allocated by torch and shared with JAX through DLPack (random contents)"
               if runner.share == "dlpack" else "JAX used its own copy of the caches (see the notes)")
    common.write_json(args.json, "qsa_attention_step", rows, [
        "one QSA attention layer's decode step (all four stages), one row per request, production geometry; "
        "every row completes a compressed group (the step's most expensive case)",
        "launches: kernel launches per step, " + ("--unfused: StepTuning.fuse_stages off" if args.unfused else
                                                  "stage 2 and the index-query RoPE fused where StepTuning allows")
        + ("; the selection as three launches (--unfused-selection)" if args.unfused_selection else
           "; the selection fused where SelectTuning allows")
        + (f"; top-k path forced: {args.topk_path}" if args.topk_path != "auto" else "")
        + (f"; TopkTuning fields: {args.topk_tuning}" if args.topk_tuning else "")
        + ("; the attention's split-K merged in its launch where AttentionTuning allows" if args.fused_merge == "default"
           else f"; the attention's split-K merge in its launch forced {args.fused_merge} (--fused-merge)")
        + ("; fused_merge_* / merge_launch_*: the step with AttentionTuning.fused_merge forced on / off "
           "(--merge-paths)" if args.merge_paths else "")
        + (f"; multi_token_*: the step with {args.multi_token_rows} new rows per request (speculative decoding, "
           f"positions L - {args.multi_token_rows} .. L - 1; --multi-token-rows) at "
           f"{' and '.join(map(str, MULTI_TOKEN_BATCHES))} requests, its own caches; multi_token_graph_us: "
           "CUDA graph per step of B x N rows; multi_token_over_one_row: over torch_graph_us"
           if args.multi_token_rows else ""),
        f"torch_graph_us: CUDA graph of {LOOP_CALLS} steps, per step; torch_eager_us: do_bench median",
        "torch_compile_us: torch.compile(fullgraph=True) of the step, Inductor default mode, do_bench median",
        f"torch_compile_graph_us: the same with mode='reduce-overhead' (caches marked static), {LOOP_CALLS} "
        "back-to-back calls between two events, per call; torch_compile_graph_static_us: the same with every "
        "tensor argument marked static (the fixed addresses a hand-captured graph has: Inductor's CUDA graphs "
        "copy every other input into the graph's own buffers on each replay)",
        "*_wall_us: host-timed, 100 back-to-back calls, the final synchronize included, per call (median of 5): "
        "torch_graph_wall_us replays a hand-captured graph of one step; torch_compile_floor_wall_us: a "
        "reduce-overhead function of the same static tensors that adds 1 to one input, torch's own cost; "
        "torch_compile_default_floor_wall_us: the same function compiled in the default mode",
        f"jax_wall_us: {LOOP_CALLS} back-to-back jitted calls with the state donated, wall clock per call",
        "jax_floor_us: the same for a trivial jitted function of the same arguments (state donated and returned, "
        "a fresh zero output of the step's shape), in the same process: what JAX's dispatch costs on this host",
        f"jax_loop_us: one jitted lax.fori_loop of {LOOP_CALLS} steps, unroll=True, per step (wall clock of a "
        "blocking call: XLA's host work before the GPU starts is in it)",
        "jax_device_us: the same loop's GPU time per step, first kernel start to last kernel end (CUPTI trace "
        "through torch.profiler); jax_gpu_ops: kernels and copies per step",
        f"JAX columns use the default Triton lowering ({qsa_jax.triton_lowering()}); jax_*_us_<lowering>: the "
        f"same with that lowering (qsa_jax.use_triton_lowering); XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        "dense_graph_us: stage 1 + flash SDPA over the whole context (GQA as MQA per KV head), CUDA graph",
        *(["fp8 e4m3 K/V and compressed-key caches with per-tensor scales (1.0) in QSAState; the ring is bf16; "
            f"dense_bf16_graph_us: the bf16 run's dense_graph_us ({args.dense_json})"] if fp8 else []),
        sharing, *goals, *runner.notes,
    ])
    _plot(args.json)
    print(f"wall: {time.perf_counter() - started:.0f} s")


def _fp8_goal(rows, dense_json: str, longest: int) -> str:
    """Fill dense_bf16_* from a bf16 run's JSON; the goal line of issue 15."""
    import json

    try:
        with open(dense_json) as file:
            dense = {(r["batch"], r["context"]): r.get("dense_graph_us") for r in json.load(file)["rows"]}
    except (OSError, ValueError, KeyError) as error:
        return f"goal (fp8 vs dense bf16): no bf16 run to compare with ({type(error).__name__}: {dense_json})"
    for row in rows:
        row["dense_bf16_graph_us"] = dense.get((row["batch"], row["context"]))
        row["dense_bf16_over_qsa_fp8"] = _ratio(row["dense_bf16_graph_us"], row.get("torch_graph_us"))
    at = {r["batch"]: r["dense_bf16_over_qsa_fp8"] for r in rows if r["context"] == longest and r["batch"] in (64, 256)}
    met = len(at) == 2 and all(v and v >= 25 for v in at.values())
    return (f"goal: at {_tokens(longest)} the fp8 QSA layer >= 25x faster than the dense bf16 layer at 64 and 256 "
            f"requests: {', '.join(f'B={b}: {v:.1f}x' for b, v in at.items() if v) or 'not measured'} -> "
            f"{'met' if met else 'NOT met'}")


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def _ratio(a, b):
    return a / b if a and b else None


def _goals(rows, batches, longest) -> list[str]:
    ratios = [r["jax_over_torch_device"] for r in rows if r.get("jax_over_torch_device")]
    lines = []
    compiled = [r["compile_graph_over_graph"] for r in rows if r.get("compile_graph_over_graph")]
    if compiled:
        lines.append(f"goal: torch.compile(mode='reduce-overhead') step within 5% of the hand-captured graph: "
                     f"worst ratio {max(compiled):.3f} -> {'met' if max(compiled) <= 1.05 else 'NOT met'}")
    for column, goal, met in (
            ("torch_compile_graph_static_wall_us", "reduce-overhead (every input static), host-timed, within 10% "
             "of the hand graph", lambda by_batch: max(by_batch.values()) <= 1.10),
            ("torch_eager_wall_us", "eager step, host-timed, at most 2x the hand graph at 1 request",
             lambda by_batch: by_batch.get(1, 0) <= 2.0)):
        over = [(r["batch"], r[column] / r["torch_graph_wall_us"]) for r in rows
                if r.get(column) and r.get("torch_graph_wall_us") and r["context"] == longest]
        if over:
            lines.append(f"goal: {goal} ({_tokens(longest)}): " + ", ".join(f"B={b}: {x:.2f}x" for b, x in over)
                         + f" -> {'met' if met(dict(over)) else 'NOT met'}")
    over_eager = [(r["batch"], r["torch_compile_wall_us"] / r["torch_eager_wall_us"],
                   r.get("torch_compile_default_floor_wall_us")) for r in rows
                  if r.get("torch_compile_wall_us") and r.get("torch_eager_wall_us") and r["context"] == longest]
    if over_eager:
        lines.append(f"goal: compile default, host-timed, no slower than eager ({_tokens(longest)}): "
                     + ", ".join(f"B={b}: {x:.2f}x" + (f" (torch's default-mode floor {f:.1f} us)" if f else "")
                                 for b, x, f in over_eager)
                     + f" -> {'met' if max(x for _, x, _ in over_eager) <= 1.0 else 'NOT met'}")
    if ratios:
        lines.append(f"goal: JAX step device time within 5% of the torch graph step: worst ratio "
                     f"{max(ratios):.3f} -> {'met' if max(ratios) <= 1.05 else 'NOT met'}")
    walls = [r["jax_wall_over_torch_graph"] for r in rows if r.get("jax_wall_over_torch_graph")]
    if walls:
        lines.append(f"goal: JAX wall time per call within 20% of the torch graph step: worst ratio "
                     f"{max(walls):.3f} -> {'met' if max(walls) <= 1.2 else 'NOT met'}")
    above = [(r["jax_wall_us"] - r["jax_floor_us"]) / r["torch_graph_us"] for r in rows
             if r.get("jax_wall_us") and r.get("jax_floor_us") and r.get("torch_graph_us")]
    if above:
        lines.append(f"goal: a single jitted call at most the trivial-call floor plus 1.2x the torch graph step: "
                     f"worst (wall - floor) / graph {max(above):.3f} -> {'met' if max(above) <= 1.2 else 'NOT met'}")
    at_longest = {r["batch"]: r.get("dense_over_qsa") for r in rows if r["context"] == longest}
    if at_longest:
        missing = [b for b in batches if not at_longest.get(b)]
        worst = min(v for v in at_longest.values() if v) if any(at_longest.values()) else None
        met = worst is not None and worst >= 15 and not missing
        lines.append(f"goal: at {_tokens(longest)} the QSA layer >= 15x faster than dense for every batch: "
                     f"speedups {', '.join(f'B={b}: {v:.1f}x' for b, v in at_longest.items() if v)}"
                     f"{'; not measured: B=' + ','.join(map(str, missing)) if missing else ''} -> "
                     f"{'met' if met else 'NOT met'}")
    return lines


def _plot(json_path: str) -> None:
    try:
        import matplotlib  # noqa: F401  (optional)
        import plot_step
    except ImportError as error:
        print(f"no plot ({error}); run benchmarks/plot_step.py where matplotlib is installed")
        return
    plot_step.plot(json_path, os.path.splitext(json_path)[0] + ".png")


if __name__ == "__main__":
    main()
