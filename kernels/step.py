"""The composed QSA attention step: the four stages, in the one order that keeps every cache right.

Framework-neutral: it imports neither torch nor jax.  The step is one plan,
:func:`plan_qsa_attention_step`, over the flat arrays of a call (the state's
and the metadata's fields among them): it plans every stage with ArrayInfos
derived for the intermediates and composes their launches into one
:class:`~qsa_kernels.launch.Program`, so every stage is validated before the
first launch and a call that raises leaves every cache as it was.  The
adapters only check their containers' types, flatten them
(:func:`state_arguments`), run the plan like any stage's and rebuild the
state (:func:`step_results`).  The step never looks at array values, so it is
jit- and CUDA-graph-safe.

Order within a step (every write lands before the read that needs it):

1. RoPE on q and k; k and v into the paged KV cache (this step's tokens are
   attended by this step's rows: the causal tail);
2. pool the index-key groups this step completes, from the ring (older
   members) and this step's raw index keys; *then* store the raw index keys
   into the ring (a ring of ``compress_ratio`` slots would otherwise lose
   members the pooling still needs); RoPE the pooled keys at their group's
   first position and store them into the compressed-key cache (this step's
   rows select among the groups they complete);
3. RoPE the index queries at their positions; score, top-k, expand;
4. sparse attention over the selected tokens.

With at most ``StepTuning.fused_max_rows`` rows, stages 1, 2 and the index
queries' RoPE are one launch (``fused.plan_compress_rotate_store``, bit for
bit the separate launches: :func:`_fuses_compression`) and the selection one
more (``SelectTuning.fused``): four launches per decode step at 1-8 requests.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import types
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from .attention import plan_sparse_paged_attention
from .compress import plan_compress_groups, plan_store_rows_in_table
from .fused import plan_compress_rotate_store, rope_compress_store
from .launch import ArrayInfo, Buffer, Launch, Program
from .paging import METADATA_FIELDS, STATE_FIELDS
from .rope_cache import bound_positions, plan_rope_reshape_and_cache, plan_rope_rows
from .select import plan_select_paged_tokens
from .stage import Stage, stage, when
from .tuning import StepTuning
from .validate import BOOL, FINITE_NUMBER, FINITE_POSITIVE_NUMBER, FP8_DTYPE, POSITIVE_INT, Checker, describe

#: The dtypes of the step's q, k and v (the attention's).
ATTENTION_DTYPES = ("bfloat16", "float16")

if TYPE_CHECKING:  # annotations only
    from .paging import CacheGeometry, HostStepMetadata

__all__ = ["plan_qsa_attention_step", "public_results", "state_arguments", "STEP_DOC", "STATE_DOC",
           "METADATA_DOC", "METADATA_FIELDS", "STATE_FIELDS", "SCALE_FIELDS", "STEP_ARRAYS", "LABELS"]

#: QSAState's optional scales, after its four caches (``None`` for 16-bit caches).
SCALE_FIELDS = ("k_scale", "v_scale", "compressed_key_scale")

FUNCTION = "qsa_attention_step"

STEP_DOC = """\
One QSA attention layer's step: RoPE + KV write, compression, selection, attention.

A batch of ``T`` rows of ``B`` requests, any mix of prefill chunks and decode
rows (a request's rows hold consecutive positions, as ``metadata`` says).  In
order: RoPE on q and k at ``metadata.positions`` and k, v into the KV cache;
the index-key groups this step completes are mean-pooled (older members from
each request's compressor-state ring) *before* this step's raw index keys
are stored into the ring; the pooled keys get RoPE at their group's first
position (``first_positions[:, 0]`` of ``compress_groups``; the three M-RoPE
components are equal for text) and go into the compressed-key cache; the
index queries get RoPE at their positions and select ``token_topk`` tokens
(whole groups) plus the causal tail of the open group; each row attends its
selected tokens.  No host synchronisation[torch: : CUDA-graph safe][jax: ;
shapes (``T``, ``B`` and the caches') fix the trace].

Args:
    q: ``[T, QH, D]`` bf16 or fp16 attention queries, before RoPE.
    k, v: ``[T, KH, D]`` of q's dtype: keys (before RoPE) and values.
    index_q: ``[T, IH, DI]`` indexer queries, before RoPE (bf16, fp16 or fp32).
    index_k: ``[T, 1, DI]`` of index_q's dtype: raw indexer keys (no RoPE).
    state: a ``QSAState`` with the layer's four caches.[torch:  Updated in
        place.][jax:  Donate it (``donate_argnums``) under ``jax.jit`` for an
        in-place update with no copy.]
    metadata: a ``StepMetadata`` for this step (``StepMetadata.from_host`` of
        ``qsa_kernels.paging.PagedRequests.step``).
    cos_sin: ``[max_position, 2*F]`` RoPE table of the attention heads (see
        ``rope_reshape_and_cache``), or ``None`` (still positional): q and k
        arrive rotated, no RoPE is applied to them, and positions are bounded
        by ``index_cos_sin``'s rows (bit for bit an identity table of that
        many rows).
    index_cos_sin: ``[max_position_i, 2*FI]`` RoPE table of the indexer heads,
        ``max_position_i >= max_position`` (cos_sin's rows).  A position past
        cos_sin gives a NaN ``out`` row and writes nothing: no K/V, no ring
        slot, no compressed key (the group it completes is not stored; its
        slot keeps what it held until a step covering the position runs).
    compress_ratio: tokens per compressed group; the ring holds at least that
        many slots.
    token_topk: tokens selected per row (a multiple of compress_ratio), plus
        the causal tail of up to ``compress_ratio - 1`` tokens.
    is_neox: NeoX (split halves) or GPT-J (interleaved) RoPE, for both tables.
    softmax_scale: attention scale, default ``D ** -0.5``.
    return_token_indices: also return the selected tokens.
    sinks: keyword-only ``[QH]`` float32 or None: one extra logit per query
        head in the attention's softmax denominator (``sparse_paged_attention``'s).
    return_lse: keyword-only; also return each row's log-sum-exp
        ``lse [T, QH]`` float32 (``sparse_paged_attention``'s), to merge the
        step's attention with another pass (a window, a shared prefix).

Returns:
    ``(out [T, QH, D], state)`` and, with ``return_token_indices``,
    ``token_indices [T, token_topk + compress_ratio - 1]`` int32 last (logical
    positions of each row's request, ``-1`` padding), then with ``return_lse``
    ``lse [T, QH]`` float32 last.[torch:  ``state`` holds
    the same tensors, updated in place.][jax:  ``state`` holds the updated
    caches (aliasing the inputs).]
"""

STATE_DOC = """\
The caches of one QSA attention layer (shapes from
``qsa_kernels.paging.CacheGeometry.state_shapes``).[jax:  A pytree (registered
dataclass): pass it through ``jax.jit`` and donate it.]

Fields:
    key_cache, value_cache: ``[num_pages, P, KH, D]`` paged KV cache (flash layout).
    compressor_state_cache: ``[max_requests, ring, 1, DI]`` each request's ring
        of its last ``ring`` raw index keys.
    compressed_key_cache: ``[num_compressed_pages, Pc, 1, DI]`` mean-pooled,
        rotated index keys, one per completed group.

    k_scale, v_scale: ``None`` for 16-bit K/V caches; for ``float8_e4m3fn``
        ones (both fp8 or neither), their per-tensor scales, 0-d or 1-element
        float arrays: stage 1 stores value / scale, attention multiplies back.
    compressed_key_scale: likewise for the compressed-key cache (fp8 or of
        the index keys' dtype); the compressor-state ring is never fp8.

``QSAState.zeros(geometry, kv_heads=, head_dim=, index_head_dim=, dtype=,
index_dtype=None, device=None, cache_dtype=None, compressed_key_dtype=None,
k_scale=1.0, v_scale=1.0, compressed_key_scale=1.0)`` allocates zero caches:
K/V in ``cache_dtype`` (default ``dtype``), the compressed keys in
``compressed_key_dtype`` (default ``index_dtype``), and float32 scales of
the given values for the fp8 ones.
"""

METADATA_DOC = """\
Index arrays of one step (int32, or int64), built on the host by
``qsa_kernels.paging.PagedRequests.step`` and converted with
``StepMetadata.from_host(host_metadata, device=None)``.[jax:  A pytree
(registered dataclass).]

Fields (``T`` rows of ``B`` requests):
    slot_mapping ``[T]``, positions ``[T]``, raw_positions ``[T, 1, 3]``,
    token_to_req ``[T]``, query_start_loc ``[B + 1]``, sequence_lengths ``[B]``
    (after this step), block_table ``[B, W]``, compressed_block_table
    ``[B, Wc]``, compressed_slots ``[T]`` (``-1`` for rows that complete no
    group), compressor_state_block_table ``[B, 1]``, compressor_state_slots
    ``[T]`` (``-1`` for rows the ring does not keep).
"""


@dataclasses.dataclass(frozen=True)
class StateFields:
    """The fields of ``QSAState`` (see :data:`STATE_DOC`); adapters subclass it.

    A subclass sets ``_zeros(shape, dtype, device)``, its framework's
    allocation of a zero array.
    """

    key_cache: Any
    value_cache: Any
    compressor_state_cache: Any
    compressed_key_cache: Any
    k_scale: Any = None
    v_scale: Any = None
    compressed_key_scale: Any = None

    @classmethod
    def zeros(cls, geometry: CacheGeometry, *, kv_heads: int, head_dim: int, index_head_dim: int, dtype: Any,
              index_dtype: Any = None, device: Any = None, cache_dtype: Any = None,
              compressed_key_dtype: Any = None, k_scale: float = 1.0, v_scale: float = 1.0,
              compressed_key_scale: float = 1.0) -> Self:
        """Zero caches of ``geometry``'s sizes (see :data:`STATE_DOC`), with scales for the fp8 ones.

        A subclass also sets ``_scale(value, device)``: a 0-d float32 array.
        The scales are Python numbers, checked here (finite and > 0 once held
        as float32: a scale of 0 zeroes the output, a negative one negates
        logits), all three whether or not their cache is fp8.
        """
        k_scale, v_scale, compressed_key_scale = (
            _scale_value(name, value) for name, value in (
                ("k_scale", k_scale), ("v_scale", v_scale), ("compressed_key_scale", compressed_key_scale)))
        shapes = geometry.state_shapes(kv_heads, head_dim, index_head_dim)
        index_dtype = dtype if index_dtype is None else index_dtype
        cache_dtype = dtype if cache_dtype is None else cache_dtype
        compressed_key_dtype = index_dtype if compressed_key_dtype is None else compressed_key_dtype
        dtypes = dict(key_cache=cache_dtype, value_cache=cache_dtype, compressor_state_cache=index_dtype,
                      compressed_key_cache=compressed_key_dtype)
        try:
            caches = {name: cls._zeros(shape, dtypes[name], device) for name, shape in shapes.items()}
            scales = {}
            if _is_fp8(cache_dtype):
                scales.update(k_scale=cls._scale(k_scale, device), v_scale=cls._scale(v_scale, device))
            if _is_fp8(compressed_key_dtype):
                scales.update(compressed_key_scale=cls._scale(compressed_key_scale, device))
        except Exception as error:  # the framework's own error (torch: a bare AssertionError without CUDA)
            raise ValueError(f"QSAState.zeros: cannot allocate the caches on device={device!r} (the device "
                             f"argument): the framework raised {type(error).__name__}: {error}") from error
        return cls(**caches, **scales)


def _scale_value(name: str, value) -> float:
    """A ``QSAState.zeros`` scale: a finite positive Python or NumPy number, also as float32."""
    scale = FINITE_POSITIVE_NUMBER.canonical("QSAState.zeros", name, value)
    with np.errstate(over="ignore"):
        held = float(np.float32(scale))
    if not (math.isfinite(held) and held > 0):
        raise ValueError(f"QSAState.zeros: {name} must be a finite positive number in float32 (the state holds it "
                         f"as a float32 array), got {describe(value)}")
    return scale


def _is_fp8(dtype) -> bool:
    """Whether a torch / JAX / NumPy dtype (or an ArrayInfo's dtype name) is float8_e4m3fn."""
    return str(dtype).removeprefix("torch.").endswith(FP8_DTYPE) or getattr(dtype, "__name__", "") == FP8_DTYPE


@dataclasses.dataclass(frozen=True)
class MetadataFields:
    """The fields of ``StepMetadata`` (see :data:`METADATA_DOC`); adapters subclass it.

    A subclass sets ``_to_device(numpy_array, device)``.
    """

    slot_mapping: Any
    positions: Any
    raw_positions: Any
    token_to_req: Any
    query_start_loc: Any
    sequence_lengths: Any
    block_table: Any
    compressed_block_table: Any
    compressed_slots: Any
    compressor_state_block_table: Any
    compressor_state_slots: Any

    @classmethod
    def from_host(cls, host: HostStepMetadata, device: Any = None) -> Self:
        """Copies of the arrays of a :class:`qsa_kernels.paging.HostStepMetadata`, on ``device``.

        Always copies (never aliases the host arrays, even on the CPU): the
        pager updates a decode batch's tables in place at its next step.
        """
        return cls(**{name: cls._to_device(np.asarray(getattr(host, name)), device) for name in METADATA_FIELDS})


assert tuple(f.name for f in dataclasses.fields(StateFields)) == STATE_FIELDS + SCALE_FIELDS
assert tuple(f.name for f in dataclasses.fields(MetadataFields)) == METADATA_FIELDS


# ---------------------------------------------------------------------------
# The step as one plan
# ---------------------------------------------------------------------------

#: The plan's array arguments: the step's own, then the state's and the
#: metadata's fields (flattened: the adapters pass them by field name).
STEP_ARRAYS = ("q", "k", "v", "index_q", "index_k") + STATE_FIELDS + METADATA_FIELDS + ("cos_sin", "index_cos_sin")
#: How errors name each array argument: as the caller wrote it.
#: The step's keyword-only arrays after the state's scales (issue 50).
OPTION_ARRAYS = ("sinks",)
LABELS = {**{name: name for name in STEP_ARRAYS + OPTION_ARRAYS},
          **{name: f"state.{name}" for name in STATE_FIELDS + SCALE_FIELDS},
          **{name: f"metadata.{name}" for name in METADATA_FIELDS}}

@dataclasses.dataclass(frozen=True)
class Handle:
    """An array of the composed program: its name there, its metadata, and how errors name it.

    The step's arguments are handles labelled as the caller wrote them
    (``state.key_cache``); a stage's results are handles too, which the step
    labels by the argument they come from where a later stage checks them
    (the rotated ``q`` is still ``q`` to the caller).
    """

    name: str
    info: ArrayInfo
    label: str

    def named(self, label: str) -> "Handle":
        """The same array, named ``label`` in errors."""
        return dataclasses.replace(self, label=label)


class _Composer:
    """Plans the stages in order and concatenates their launches into one Program.

    :meth:`stage` takes a stage's arrays as :class:`Handle` and its options
    as values, plans it under the step's name and the handles' labels (so its
    errors read ``qsa_attention_step: metadata.slot_mapping ...``), renames
    its buffers ``<tag>.<buffer>`` so that names never clash, and returns its
    results as handles (an array updated in place is the handle it was
    given).
    """

    def __init__(self):
        self.buffers: list[Buffer] = []
        self.launches: list[Launch] = []

    def stage(self, tag: str, stage: Stage, **bindings) -> types.SimpleNamespace:
        arrays = {name: value for name, value in bindings.items() if isinstance(value, Handle)}
        options = {name: value for name, value in bindings.items() if not isinstance(value, Handle)}
        program = stage.plan_named(FUNCTION, {name: handle.label for name, handle in arrays.items()},
                                   **{name: handle.info for name, handle in arrays.items()}, **options)
        renamed = {name: handle.name for name, handle in arrays.items()}
        for buffer in program.buffers:
            renamed[buffer.name] = f"{tag}.{buffer.name}"
            self.buffers.append(dataclasses.replace(buffer, name=renamed[buffer.name]))
        for launch in program.launches:
            self.launches.append(dataclasses.replace(launch, inputs=tuple(renamed[n] for n in launch.inputs),
                                                     outputs=tuple(renamed[n] for n in launch.outputs)))
        return types.SimpleNamespace(**{
            name: arrays[name] if name in arrays else Handle(renamed[name], program.buffer(name).info, renamed[name])
            for name in program.results})

    def fuse_last(self, count: int, fuse) -> None:
        """Replace the last ``count`` launches by ``fuse(*launches)`` (one launch doing their work)."""
        self.launches[-count:] = [fuse(*self.launches[-count:])]

    def program(self, results: tuple[Handle, ...]) -> Program:
        return Program(FUNCTION, tuple(self.buffers), tuple(self.launches), tuple(h.name for h in results))


def _check_step(check: Checker, arrays: dict[str, ArrayInfo | None], compress_ratio, token_topk,
                return_token_indices) -> None:
    """The step's own checks: what no single stage can see."""
    # compress_ratio, token_topk and return_token_indices are typed by the stage's memo.
    if token_topk % compress_ratio:
        check.fail("token_topk", f"must be a multiple of compress_ratio = {compress_ratio}", token_topk)
    positions = arrays["positions"]
    rows = positions.shape[0] if positions.ndim else 0
    if rows < 1:
        check.fail("metadata", "must describe at least one row", f"positions of shape {positions.shape}")
    for name in ("q", "k", "v", "index_q", "index_k"):
        info = arrays[name]
        if info.ndim != 3 or info.shape[0] != rows:
            check.fail(name, f"must be [T, heads, dim] with T = {rows} rows like metadata.positions",
                       f"shape {info.shape}")
    _check_attention_inputs(check, arrays)
    if arrays["index_k"].shape[1] != 1:
        check.fail("index_k", "must have one head ([T, 1, DI])", f"shape {arrays['index_k'].shape}")
    if arrays["index_k"].dtype != arrays["index_q"].dtype:
        check.fail("index_k", f"must have index_q's dtype {arrays['index_q'].dtype}", arrays["index_k"].dtype)
    _check_kv_layout(check, arrays)
    _check_metadata_shapes(check, arrays, rows)
    _check_compressed_table_width(check, arrays, compress_ratio)
    # A position past cos_sin gives NaN q rows and so NaN out rows (stage 1's
    # documented signal).  One past index_cos_sin alone would give NaN index
    # queries and pooled keys, which top-k ranks last: a wrong selection that
    # no output shows.  So index_cos_sin covers every position cos_sin does.
    cos_sin, index_cos_sin = arrays["cos_sin"], arrays["index_cos_sin"]
    if cos_sin is not None and cos_sin.ndim == 2 and index_cos_sin.ndim == 2 and index_cos_sin.shape[0] < cos_sin.shape[0]:
        check.fail("index_cos_sin", f"must have at least cos_sin's {cos_sin.shape[0]} rows (positions): a position "
                   "past it alone would give NaN index keys that no output shows", f"shape {index_cos_sin.shape}")


def _check_attention_inputs(check: Checker, arrays: dict[str, ArrayInfo]) -> None:
    """q, k and v as the step takes them, before anything of the state (the order a caller reads
    the signature in): bf16 or fp16 (the attention's dtypes; stage 1 alone takes fp32 too), one
    dtype, one head dim, GQA heads.  Otherwise an fp32 q/k/v with a bf16 state would be reported
    as a wrong ``state.key_cache`` by stage 1, which sees the caches before the attention sees q."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    check.dtype("q", q, ATTENTION_DTYPES)
    check.same_dtype("k", k, "q", q)
    check.same_dtype("v", v, "q", q)
    if k.shape[2] != q.shape[2]:
        check.fail("k", f"must have q's head dim D = {q.shape[2]}", f"shape {k.shape}")
    if v.shape != k.shape:
        check.fail("v", f"must have k's shape {k.shape}", f"shape {v.shape}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        check.fail("q", f"must have a number of heads QH divisible by k's KH = {k.shape[1]}", f"QH = {q.shape[1]}")


def _check_kv_layout(check: Checker, arrays: dict[str, ArrayInfo]) -> None:
    """The state's K/V caches in the flash layout, the one the step reads (stage 1 alone also
    takes the paged layouts, which it tells apart by the caches' shapes, so a head-major cache
    would reach it as a "paged" or mis-sized one and be blamed on the wrong dimension or cache)."""
    key_cache, k = arrays["key_cache"], arrays["k"]
    kv_heads, head_dim = k.shape[1], k.shape[2]
    layout = "[num_pages, page_size, kv_heads, head_dim] (flash layout)"
    if key_cache.ndim != 4 or key_cache.shape[2] != kv_heads or key_cache.shape[3] != head_dim:
        check.fail("state.key_cache", f"must be {layout} with kv_heads = {kv_heads} and head_dim = {head_dim} like k",
                   f"shape {key_cache.shape}")


def _check_compressed_table_width(check: Checker, arrays: dict[str, ArrayInfo], compress_ratio: int) -> None:
    """``compressed_block_table`` must hold every group the KV ``block_table`` can hold.

    A narrower table silently drops the last groups of a long request.  The
    KV table's ``W`` pages of ``P`` say ``max_context > (W - 1) * P``; the
    least such context needs ``ceil(groups / Pc)`` compressed pages
    (:attr:`CacheGeometry.compressed_table_width`), so every geometry passes.
    """
    table, compressed_table = arrays["block_table"], arrays["compressed_block_table"]
    key_cache, compressed_cache = arrays["key_cache"], arrays["compressed_key_cache"]
    if table.ndim != 2 or compressed_table.ndim != 2 or key_cache.ndim < 2 or compressed_cache.ndim < 2:
        return  # the stages name the rank error
    page, compressed_page = key_cache.shape[1], compressed_cache.shape[1]
    if page < 1 or compressed_page < 1:
        return
    least_context = (table.shape[1] - 1) * page + 1
    needed = max(1, -(-(least_context // compress_ratio) // compressed_page))
    if compressed_table.shape[1] < needed:
        check.fail("metadata.compressed_block_table",
                   f"must have at least {needed} columns: the groups of compress_ratio = {compress_ratio} "
                   f"tokens that metadata.block_table's {table.shape[1]} pages of {page} tokens hold, "
                   f"in compressed pages of {compressed_page}", f"shape {compressed_table.shape}")


def _check_table_geometry(check: Checker, arrays: dict[str, ArrayInfo], compress_ratio: int) -> None:
    """``compressed_block_table`` no wider than the most groups the KV ``block_table`` can hold.

    A wider table means metadata made for other page sizes (or another
    ratio) than the state's: pages of 8 tokens read as pages of 4 lose half
    of each request's K/V.  Checked after the stages (their errors name the
    first cause when there is one).
    """
    table, compressed_table = arrays["block_table"], arrays["compressed_block_table"]
    page, compressed_page = arrays["key_cache"].shape[1], arrays["compressed_key_cache"].shape[1]
    most = max(1, -(-(table.shape[1] * page // compress_ratio) // compressed_page))
    if compressed_table.shape[1] > most:
        check.fail("metadata.compressed_block_table",
                   f"must have at most {most} columns (metadata.block_table's {table.shape[1]} pages of "
                   f"state.key_cache's {page} tokens hold no more groups of compress_ratio = {compress_ratio} "
                   f"tokens in state.compressed_key_cache's pages of {compressed_page}): is the metadata made for "
                   "another geometry than the state?", f"shape {compressed_table.shape}")


def _check_metadata_shapes(check: Checker, arrays: dict[str, ArrayInfo], rows: int) -> None:
    """The metadata's arrays agree on T rows and B requests (``B`` = ``sequence_lengths``' length).

    A stage sees some of them at a time; only the step sees that a
    ``block_table`` of fewer rows than requests, or a ``query_start_loc`` of
    ``B`` entries, would drop requests' lookups or pooling.
    """
    for name, expected in (("slot_mapping", (rows,)), ("token_to_req", (rows,)), ("compressed_slots", (rows,)),
                           ("compressor_state_slots", (rows,)), ("raw_positions", (rows, 1, 3))):
        if arrays[name].shape != expected:
            check.fail(f"metadata.{name}", f"must have shape {expected} (T = {rows} rows like metadata.positions)",
                       f"shape {arrays[name].shape}")
    # B, the number of requests, as most of the arrays that carry it say (the odd one out is named).
    counts = {"sequence_lengths": 0, "query_start_loc": -1, "block_table": 0, "compressed_block_table": 0,
              "compressor_state_block_table": 0}
    carried = {name: arrays[name].shape[0] + extra for name, extra in counts.items()
               if arrays[name].ndim == (2 if name.endswith("table") else 1)}  # other ranks: the stages name them
    if not carried:
        return
    votes = list(carried.values())
    requests = max(votes, key=votes.count)  # the first of the most common
    for name, count in carried.items():
        if count != requests:
            what = f"B + 1 = {requests + 1} entries" if name == "query_start_loc" else f"B = {requests} rows"
            check.fail(f"metadata.{name}", f"must have {what}, B = {requests} requests as the other metadata "
                       "arrays say", f"shape {arrays[name].shape}")


@stage(
    arrays=STEP_ARRAYS + SCALE_FIELDS + OPTION_ARRAYS,
    options=dict(compress_ratio=POSITIVE_INT, token_topk=POSITIVE_INT, is_neox=BOOL,
                 softmax_scale=FINITE_NUMBER.or_none(), return_token_indices=BOOL, return_lse=BOOL),
    results=("out", *STATE_FIELDS, when("return_token_indices", "token_indices"), when("return_lse", "lse")),
    doc=STEP_DOC, returns="tuple[Array, QSAState] | tuple[Array, QSAState, Array] | tuple[Array, QSAState, Array, Array]",
    tuning=dict(tuning="step"), labels=LABELS, nullable=("cos_sin",))
def plan_qsa_attention_step(
    q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, index_q: ArrayInfo, index_k: ArrayInfo,
    key_cache: ArrayInfo, value_cache: ArrayInfo, compressor_state_cache: ArrayInfo,
    compressed_key_cache: ArrayInfo,
    slot_mapping: ArrayInfo, positions: ArrayInfo, raw_positions: ArrayInfo, token_to_req: ArrayInfo,
    query_start_loc: ArrayInfo, sequence_lengths: ArrayInfo, block_table: ArrayInfo,
    compressed_block_table: ArrayInfo, compressed_slots: ArrayInfo,
    compressor_state_block_table: ArrayInfo, compressor_state_slots: ArrayInfo,
    cos_sin: ArrayInfo | None, index_cos_sin: ArrayInfo,
    *, compress_ratio: int, token_topk: int, is_neox: bool = True, softmax_scale=None,
    return_token_indices: bool = False,
    k_scale: ArrayInfo | None = None, v_scale: ArrayInfo | None = None,
    compressed_key_scale: ArrayInfo | None = None,
    sinks: ArrayInfo | None = None, return_lse: bool = False,
    tuning: StepTuning | None = None,
) -> Program:
    """Validate every stage of the step and compose their launches into one Program.

    Nothing is launched before every stage is planned, so a call that raises
    leaves every cache as it was.  Results: ``out``, the four caches (updated
    in place), with ``return_token_indices`` ``token_indices``, then with
    ``return_lse`` the attention's ``lse`` ``[T, QH]`` float32 (``sinks``:
    ``[QH]`` float32, the attention's, issue 50).
    ``tuning.fuse_stages``: stage 2 and the index queries' RoPE in one launch
    where that is safe (:func:`_fuses_compression`).
    """
    given = {name: value for name, value in locals().items() if name in STEP_ARRAYS + SCALE_FIELDS}
    check = Checker(FUNCTION)
    _check_step(check, given, compress_ratio, token_topk, return_token_indices)
    _check_scales(check, key_cache, compressed_key_cache, given)
    # The step's arguments, as the caller wrote them; None for absent scales.
    a = types.SimpleNamespace(**{name: None if info is None else Handle(name, info, LABELS[name])
                                 for name, info in given.items()})
    a.sinks = None if sinks is None else Handle("sinks", sinks, LABELS["sinks"])
    rows = index_k.shape[0]
    step = _Composer()

    # 1. RoPE + KV cache.
    rope = step.stage("rope", plan_rope_reshape_and_cache, q=a.q, k=a.k, v=a.v, key_cache=a.key_cache,
                      value_cache=a.value_cache, slot_mapping=a.slot_mapping, positions=a.positions,
                      cos_sin=a.cos_sin, k_scale=a.k_scale, v_scale=a.v_scale, is_neox=is_neox)
    # cos_sin=None: q and k arrive rotated; positions are bounded by index_cos_sin's rows,
    # bit for bit an identity table (cos 1, sin 0) of that many rows.
    table = cos_sin if cos_sin is not None else index_cos_sin
    max_row_position = table.shape[0] if table.ndim else 0  # (a rank error is the stages')
    if cos_sin is None:
        step.launches[-1] = bound_positions(step.launches[-1], max_row_position)

    # 2. Pool first, then overwrite the ring with this step's raw keys; and
    # 3a. RoPE on the index queries: one launch for a few rows, in that order
    # (_fuses_compression), else four.  A row past cos_sin stores nothing (no
    # ring slot, no compressed key), as stage 1 writes no K/V for it.
    if _fuses_compression(rows, tuning):
        index_q_rotated = step.stage(
            "compress_rotate_store", plan_compress_rotate_store, raw_keys=a.index_k, raw_positions=a.raw_positions,
            compressor_state_cache=a.compressor_state_cache,
            compressor_state_block_table=a.compressor_state_block_table, token_to_req=a.token_to_req,
            query_start_loc=a.query_start_loc, logical_positions=a.positions, compressed_slots=a.compressed_slots,
            compressor_state_slots=a.compressor_state_slots, compressed_key_cache=a.compressed_key_cache,
            cos_sin=a.index_cos_sin, index_q=a.index_q, scale=a.compressed_key_scale,
            compress_ratio=compress_ratio, is_neox=is_neox, max_row_position=max_row_position).index_q_out
        if tuning.fuse_rope:  # stage 1 beside it: they touch different arrays (the caches are distinct)
            step.fuse_last(2, rope_compress_store)
    else:
        compress = step.stage(
            "compress", plan_compress_groups, raw_keys=a.index_k, raw_positions=a.raw_positions,
            compressor_state_cache=a.compressor_state_cache,
            compressor_state_block_table=a.compressor_state_block_table, token_to_req=a.token_to_req,
            query_start_loc=a.query_start_loc, logical_positions=a.positions, compressed_slots=a.compressed_slots,
            compress_ratio=compress_ratio)
        step.stage("ring", plan_store_rows_in_table, cache=a.compressor_state_cache,
                   slot_mapping=a.compressor_state_slots, rows=a.index_k, positions=a.positions,
                   max_position=max_row_position)
        # The pooled keys get RoPE at their group's first position: column 0
        # of compress_groups' [T, 3] first_positions.
        pooled = step.stage("rotate_pooled", plan_rope_rows, x=compress.pooled.named("index_k"),
                            positions=compress.first_positions.named("metadata.raw_positions"),
                            cos_sin=a.index_cos_sin, is_neox=is_neox).out
        step.stage("compressed", plan_store_rows_in_table, cache=a.compressed_key_cache,
                   slot_mapping=a.compressed_slots, rows=pooled.named("index_k"), positions=a.positions,
                   max_position=max_row_position, scale=a.compressed_key_scale)
        index_q_rotated = step.stage("rotate_index_q", plan_rope_rows, x=a.index_q, positions=a.positions,
                                     cos_sin=a.index_cos_sin, is_neox=is_neox).out

    # 3. Selection over the compressed keys, this step's groups included.
    tokens = step.stage("select", plan_select_paged_tokens, q=index_q_rotated.named("index_q"),
                        k_cache=a.compressed_key_cache, page_table=a.compressed_block_table,
                        token_to_req=a.token_to_req, query_positions=a.positions,
                        sequence_lengths=a.sequence_lengths, k_scale=a.compressed_key_scale,
                        token_topk=token_topk, compress_ratio=compress_ratio).out

    # 4. Attention over the selected tokens (this step's K/V included).
    attention = step.stage("attention", plan_sparse_paged_attention, q=rope.q_out.named("q"), k_cache=a.key_cache,
                           v_cache=a.value_cache, token_indices=tokens.named("token_topk"), block_table=a.block_table,
                           token_to_req=a.token_to_req, k_scale=a.k_scale, v_scale=a.v_scale, sinks=a.sinks,
                           softmax_scale=softmax_scale, return_lse=return_lse)

    _check_table_geometry(check, given, compress_ratio)
    caches = (a.key_cache, a.value_cache, a.compressor_state_cache, a.compressed_key_cache)
    return step.program((attention.out, *caches) + ((tokens,) if return_token_indices else ())
                        + ((attention.lse,) if return_lse else ()))


def _fuses_compression(rows: int, tuning: StepTuning) -> bool:
    """Whether the step runs stage 2 and the index queries' RoPE as one launch.

    The hazard: pooling reads older group members from each request's ring
    (slot ``position % ring``), and the ring store overwrites slots with this
    step's raw keys.  Across the programs of one launch nothing orders a read
    of one before a write of another, and the slots are metadata *values*
    (``compressor_state_slots``), which a plan never sees.  A prefill chunk
    overwrites slots that its own first group still reads (ratio 2, ring 2:
    position 3 pools position 2, which position 4 overwrites), so its rows
    must all be pooled before any is stored.  The fused launch gives one
    program every row: it pools and stores the compressed keys, waits at a
    barrier, then stores the ring, whatever the slots.  That is decided from
    the static row count: up to ``tuning.fused_max_rows`` rows (a decode
    batch, a short chunk), fused; more rows would serialise on one program,
    so they keep the separate launches, in order.  (One program per request
    would be safe only if each request's ring slots were in its own ring
    block, a property of the values that the plan cannot check.)
    """
    return tuning.fuse_stages and rows <= tuning.fused_max_rows


def _check_scales(check: Checker, key_cache: ArrayInfo, compressed_key_cache: ArrayInfo, scales: dict) -> None:
    """Scales exactly for the fp8 caches (stage 1 alone would accept fp8 caches without
    scales, which attention then refuses): a clear error naming the state's field."""
    for cache, info, names in (("key_cache", key_cache, ("k_scale", "v_scale")),
                               ("compressed_key_cache", compressed_key_cache, ("compressed_key_scale",))):
        for name in names:
            scale = scales[name]
            if _is_fp8(info.dtype) and scale is None:
                check.fail(f"state.{name}", f"must be given (a 0-d or 1-element float array) for a {FP8_DTYPE} "
                           f"state.{cache}", None)
            if not _is_fp8(info.dtype) and scale is not None:
                check.fail(f"state.{name}", f"must be None for a {info.dtype} state.{cache} (scales are for "
                           f"{FP8_DTYPE} caches)", f"an array of shape {scale.shape}")


def state_arguments(function_arguments: dict, state_type: type, metadata_type: type) -> dict:
    """A step call's arguments by name, state and metadata flattened into their fields.

    Checks the containers' types (the adapters' ``QSAState`` and ``StepMetadata``).
    """
    arguments = dict(function_arguments)
    state, metadata = arguments.pop("state"), arguments.pop("metadata")
    for name, value, expected in (("state", state, state_type), ("metadata", metadata, metadata_type)):
        if not isinstance(value, expected):
            raise TypeError(f"{FUNCTION}: {name} must be a {_type_name(expected)}, got {_type_name(type(value))}")
    arguments.update({name: getattr(state, name) for name in STATE_FIELDS + SCALE_FIELDS})
    arguments.update({name: getattr(metadata, name) for name in METADATA_FIELDS})
    return arguments


def public_results(results: tuple, state) -> tuple:
    """The step's public results from the plan's (``out``, the four caches, then what the options add):
    ``(out, state, ...)``, ``state`` itself where every cache is the one it holds (torch's, updated in
    place)."""
    out, caches, rest = results[0], results[1:1 + len(STATE_FIELDS)], results[1 + len(STATE_FIELDS):]
    if not all(map(operator.is_, caches, map(getattr, (state,) * len(STATE_FIELDS), STATE_FIELDS))):
        state = dataclasses.replace(state, **dict(zip(STATE_FIELDS, caches)))
    return (out, state, *rest)


def _type_name(cls: type) -> str:
    """``qsa_torch.QSAState`` rather than ``QSAState``: the two adapters' containers share names."""
    package = cls.__module__.split(".")[0]
    return cls.__name__ if package == "builtins" else f"{package}.{cls.__name__}"

