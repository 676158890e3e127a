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

With at most ``StepTuning.fused_max_rows`` rows, stage 2 and the index
queries' RoPE are one launch (``compress.plan_compress_rotate_store``) in
that order, bit for bit the separate launches (:func:`_fuses_compression`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from .attention import plan_sparse_paged_attention
from .compress import plan_compress_groups, plan_compress_rotate_store, plan_store_cache_rows
from .launch import ArrayInfo, Buffer, Launch, Program, cached_plan
from .paging import METADATA_FIELDS, STATE_FIELDS
from .rope_cache import plan_rope_reshape_and_cache
from .select import plan_select_paged_tokens
from .tuning import StepTuning
from .validate import BOOL, FINITE_NUMBER, FP8_DTYPE, POSITIVE_INT, Checker

if TYPE_CHECKING:  # annotations only
    from .paging import CacheGeometry, HostStepMetadata

__all__ = ["plan_qsa_attention_step", "state_arguments", "step_results", "STEP_DOC", "STATE_DOC",
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
        ``rope_reshape_and_cache``).
    index_cos_sin: ``[max_position_i, 2*FI]`` RoPE table of the indexer heads,
        ``max_position_i >= max_position`` (cos_sin's rows).  A position past
        cos_sin gives a NaN ``out`` row and writes no K/V (stage 1's signal).
    compress_ratio: tokens per compressed group; the ring holds at least that
        many slots.
    token_topk: tokens selected per row (a multiple of compress_ratio), plus
        the causal tail of up to ``compress_ratio - 1`` tokens.
    is_neox: NeoX (split halves) or GPT-J (interleaved) RoPE, for both tables.
    softmax_scale: attention scale, default ``D ** -0.5``.
    return_token_indices: also return the selected tokens.

Returns:
    ``(out [T, QH, D], state)`` and, with ``return_token_indices``,
    ``token_indices [T, token_topk + compress_ratio - 1]`` int32 last (logical
    positions of each row's request, ``-1`` padding).[torch:  ``state`` holds
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
        """
        shapes = geometry.state_shapes(kv_heads, head_dim, index_head_dim)
        index_dtype = dtype if index_dtype is None else index_dtype
        cache_dtype = dtype if cache_dtype is None else cache_dtype
        compressed_key_dtype = index_dtype if compressed_key_dtype is None else compressed_key_dtype
        dtypes = dict(key_cache=cache_dtype, value_cache=cache_dtype, compressor_state_cache=index_dtype,
                      compressed_key_cache=compressed_key_dtype)
        caches = {name: cls._zeros(shape, dtypes[name], device) for name, shape in shapes.items()}
        scales = {}
        if _is_fp8(cache_dtype):
            scales.update(k_scale=cls._scale(k_scale, device), v_scale=cls._scale(v_scale, device))
        if _is_fp8(compressed_key_dtype):
            scales.update(compressed_key_scale=cls._scale(compressed_key_scale, device))
        return cls(**caches, **scales)


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
LABELS = {**{name: name for name in STEP_ARRAYS},
          **{name: f"state.{name}" for name in STATE_FIELDS + SCALE_FIELDS},
          **{name: f"metadata.{name}" for name in METADATA_FIELDS}}

class _Composer:
    """Plans the stages one after another and concatenates their launches into one Program.

    Every stage's buffers are renamed ``<stage>.<buffer>`` so names never
    clash; its arguments are renamed to what they are bound to (a step
    argument, updated in place where the stage updates it, or an earlier
    stage's buffer).  A stage's validation error is re-raised naming the
    step and the step argument its argument is bound to.
    """

    def __init__(self, arrays: dict[str, ArrayInfo]):
        self.infos = dict(arrays)  # every name bound so far: arguments and buffers
        self.buffers: list[Buffer] = []
        self.launches: list[Launch] = []
        self.checking_only = False

    def info(self, name: str) -> ArrayInfo:
        return self.infos[name]

    def buffer(self, buffer: Buffer) -> None:
        self.infos[buffer.name] = buffer.info
        if not self.checking_only:
            self.buffers.append(buffer)

    @contextlib.contextmanager
    def checks_only(self):
        """Stages planned inside only validate (their errors as always): their launches and
        buffers are left out of the program (a fused launch does their work)."""
        self.checking_only = True
        try:
            yield
        finally:
            self.checking_only = False

    def stage(self, tag: str, plan, bindings: dict[str, str], options: dict, *,
              infos: dict[str, ArrayInfo] | None = None, labels: dict[str, str] | None = None,
              scalars: dict[str, int] | None = None) -> dict[str, str]:
        """Plan one stage; returns its results' names in the composed program.

        ``bindings``: stage argument -> bound name; ``infos`` overrides the
        ArrayInfo a stage argument is planned with (a view of the bound
        array); ``labels`` names arguments bound to intermediates in errors;
        ``scalars`` overrides launch scalars the stage derives from such a view.
        """
        infos = infos or {}
        arrays = {arg: infos.get(arg, self.infos[name]) for arg, name in bindings.items()}
        try:
            program = plan(**arrays, **options)
        except (ValueError, TypeError) as error:
            if not str(error).startswith(f"{plan.function}: "):
                raise
            names = {arg: (labels or {}).get(arg, LABELS.get(name, name)) for arg, name in bindings.items()}
            names.update({option: option for option in options})
            raise type(error)(_relabel(str(error), plan.function, names)) from None
        renamed = dict(bindings)
        for buffer in program.buffers:
            renamed[buffer.name] = f"{tag}.{buffer.name}"
            self.buffer(dataclasses.replace(buffer, name=renamed[buffer.name]))
        for launch in () if self.checking_only else program.launches:
            self.launches.append(dataclasses.replace(
                launch, inputs=tuple(renamed[n] for n in launch.inputs),
                outputs=tuple(renamed[n] for n in launch.outputs),
                scalars={**launch.scalars, **{k: v for k, v in (scalars or {}).items() if k in launch.scalars}}))
        return {name: renamed[name] for name in program.results}

    def program(self, results: tuple[str, ...]) -> Program:
        return Program(FUNCTION, tuple(self.buffers), tuple(self.launches), results)


def _relabel(message: str, function: str, names: dict[str, str]) -> str:
    """A stage's ``"<stage>: <arg> ..."`` message as the step's ``"qsa_attention_step: <label> ..."``.

    Other stage arguments the message mentions (``must have q's dtype``) are
    renamed too; the ``got ...`` part is left as it is.
    """
    body = message.removeprefix(f"{function}: ")
    expected, got = (body.rsplit(", got ", 1) + [None])[:2] if ", got " in body else (body, None)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True))
                         + r")(?!\w)('(?!s))?")

    def rename(match):  # "raw_keys' dtype" -> "index_k's dtype"
        label = names[match.group(1)]
        return label + ("" if not match.group(2) else "'" if label.endswith("s") else "'s")

    expected = pattern.sub(rename, expected)
    return f"{FUNCTION}: {expected}" + ("" if got is None else f", got {got}")


def _check_step(check: Checker, arrays: dict[str, ArrayInfo | None], compress_ratio, token_topk,
                return_token_indices) -> None:
    """The step's own checks: what no single stage can see."""
    # compress_ratio, token_topk and return_token_indices are typed by cached_plan.
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
    if arrays["index_k"].shape[1] != 1:
        check.fail("index_k", "must have one head ([T, 1, DI])", f"shape {arrays['index_k'].shape}")
    if arrays["index_k"].dtype != arrays["index_q"].dtype:
        check.fail("index_k", f"must have index_q's dtype {arrays['index_q'].dtype}", arrays["index_k"].dtype)
    _check_compressed_table_width(check, arrays, compress_ratio)
    # A position past cos_sin gives NaN q rows and so NaN out rows (stage 1's
    # documented signal).  One past index_cos_sin alone would give NaN index
    # queries and pooled keys, which top-k ranks last: a wrong selection that
    # no output shows.  So index_cos_sin covers every position cos_sin does.
    cos_sin, index_cos_sin = arrays["cos_sin"], arrays["index_cos_sin"]
    if cos_sin.ndim == 2 and index_cos_sin.ndim == 2 and index_cos_sin.shape[0] < cos_sin.shape[0]:
        check.fail("index_cos_sin", f"must have at least cos_sin's {cos_sin.shape[0]} rows (positions): a position "
                   "past it alone would give NaN index keys that no output shows", f"shape {index_cos_sin.shape}")


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


@cached_plan(options=dict(compress_ratio=POSITIVE_INT, token_topk=POSITIVE_INT, is_neox=BOOL,
                          softmax_scale=FINITE_NUMBER.or_none(), return_token_indices=BOOL))
def plan_qsa_attention_step(
    q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, index_q: ArrayInfo, index_k: ArrayInfo,
    key_cache: ArrayInfo, value_cache: ArrayInfo, compressor_state_cache: ArrayInfo,
    compressed_key_cache: ArrayInfo,
    slot_mapping: ArrayInfo, positions: ArrayInfo, raw_positions: ArrayInfo, token_to_req: ArrayInfo,
    query_start_loc: ArrayInfo, sequence_lengths: ArrayInfo, block_table: ArrayInfo,
    compressed_block_table: ArrayInfo, compressed_slots: ArrayInfo,
    compressor_state_block_table: ArrayInfo, compressor_state_slots: ArrayInfo,
    cos_sin: ArrayInfo, index_cos_sin: ArrayInfo,
    *, compress_ratio: int, token_topk: int, is_neox: bool = True, softmax_scale=None,
    return_token_indices: bool = False,
    k_scale: ArrayInfo | None = None, v_scale: ArrayInfo | None = None,
    compressed_key_scale: ArrayInfo | None = None,
    tuning: StepTuning | None = None,
) -> Program:
    """Validate every stage of the step and compose their launches into one Program.

    Nothing is launched before every stage is planned, so a call that raises
    leaves every cache as it was.  Results: ``out``, the four caches (updated
    in place) and, with ``return_token_indices``, ``token_indices``.
    ``tuning.fuse_stages``: stage 2 and the index queries' RoPE in one launch
    where that is safe (:func:`_fuses_compression`).
    """
    arrays = {name: value for name, value in locals().items() if name in STEP_ARRAYS}
    check = Checker(FUNCTION)
    _check_step(check, arrays, compress_ratio, token_topk, return_token_indices)
    scales = dict(k_scale=k_scale, v_scale=v_scale, compressed_key_scale=compressed_key_scale)
    _check_scales(check, key_cache, compressed_key_cache, scales)
    step = _Composer({**arrays, **{name: info for name, info in scales.items() if info is not None}})
    # fp8 caches: their scales bound to the stages that write and read them.
    kv_scales = dict(k_scale="k_scale", v_scale="v_scale") if k_scale is not None else {}
    key_scale = "compressed_key_scale" if compressed_key_scale is not None else None
    rows, _, index_dim = index_k.shape

    # 1. RoPE + KV cache.
    rope = step.stage("rope", plan_rope_reshape_and_cache, dict(
        q="q", k="k", v="v", key_cache="key_cache", value_cache="value_cache",
        slot_mapping="slot_mapping", positions="positions", cos_sin="cos_sin", **kv_scales), dict(is_neox=is_neox))

    # 2. Pool first, then overwrite the ring with this step's raw keys; and
    # 3a. RoPE on the index queries.  Fused: these stages are planned for
    # their checks (the same errors either way) and one launch does their work.
    fused = _fuses_compression(rows, tuning)
    with step.checks_only() if fused else contextlib.nullcontext():
        compress = step.stage("compress", plan_compress_groups, dict(
            raw_keys="index_k", raw_positions="raw_positions", compressor_state_cache="compressor_state_cache",
            compressor_state_block_table="compressor_state_block_table", token_to_req="token_to_req",
            query_start_loc="query_start_loc", logical_positions="positions",
            compressed_slots="compressed_slots"), dict(compress_ratio=compress_ratio))
        step.stage("ring", plan_store_cache_rows, dict(
            cache="compressor_state_cache", slot_mapping="compressor_state_slots", rows="index_k"), {})
        # The pooled keys get RoPE at their group's first position: column 0 of
        # compress_groups' [T, 3] first_positions, read in place (stride 3).
        first_positions = compress["first_positions"]
        pooled = _rotate(step, "rotate_pooled", compress["pooled"], first_positions, is_neox,
                         labels=dict(q="index_k", positions="metadata.raw_positions"),
                         positions_stride=step.info(first_positions).strides[0])
        step.stage("compressed", plan_store_cache_rows, dict(
            cache="compressed_key_cache", slot_mapping="compressed_slots", rows=pooled,
            **(dict(scale=key_scale) if key_scale else {})), {}, labels=dict(rows="index_k"))
        rotated_index_q = _rotate(step, "rotate_index_q", "index_q", "positions", is_neox)
    if fused:
        rotated_index_q = step.stage("compress_rotate_store", plan_compress_rotate_store, dict(
            raw_keys="index_k", raw_positions="raw_positions", compressor_state_cache="compressor_state_cache",
            compressor_state_block_table="compressor_state_block_table", token_to_req="token_to_req",
            query_start_loc="query_start_loc", logical_positions="positions", compressed_slots="compressed_slots",
            compressor_state_slots="compressor_state_slots", compressed_key_cache="compressed_key_cache",
            cos_sin="index_cos_sin", index_q="index_q", **(dict(scale=key_scale) if key_scale else {})),
            dict(compress_ratio=compress_ratio, is_neox=is_neox))["index_q_out"]

    # 3. Selection over the compressed keys, this step's groups included.
    select = step.stage("select", plan_select_paged_tokens, dict(
        q=rotated_index_q, k_cache="compressed_key_cache", page_table="compressed_block_table",
        token_to_req="token_to_req", query_positions="positions", sequence_lengths="sequence_lengths",
        **(dict(k_scale=key_scale) if key_scale else {})),
        dict(token_topk=token_topk, compress_ratio=compress_ratio), labels=dict(q="index_q"))

    # 4. Attention over the selected tokens (this step's K/V included).
    attention = step.stage("attention", plan_sparse_paged_attention, dict(
        q=rope["q_out"], k_cache="key_cache", v_cache="value_cache", token_indices=select["out"],
        block_table="block_table", token_to_req="token_to_req", **kv_scales), dict(softmax_scale=softmax_scale),
        labels=dict(q="q", token_indices="token_topk"))

    results = (attention["out"],) + STATE_FIELDS + ((select["out"],) if return_token_indices else ())
    return step.program(results)


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


def _rotate(step: _Composer, tag: str, x: str, positions: str, is_neox: bool, *,
            labels: dict[str, str] | None = None, positions_stride: int = 1) -> str:
    """RoPE on ``x [R, H, DI]`` by ``index_cos_sin``: stage 1 with caches no slot reaches.

    Stage 1 also rotates k rows (here: head 0 of x, a view) and writes them to
    a cache; the caches here are buffers of zero pages, so every slot is out
    of range and nothing is written.  Returns the name of the rotated x.
    """
    info = step.info(x)
    rows, _, dim = info.shape
    scratch = Buffer(f"{tag}.no_cache", (0, 1, 1, dim), info.dtype)
    step.buffer(scratch)
    head = ArrayInfo((rows, 1, dim), info.dtype, info.strides)
    positions_info = step.info(positions)
    contiguous_positions = ArrayInfo.contiguous((rows,), positions_info.dtype)
    labels = labels or {}
    label = labels.get("q", LABELS.get(x, x))
    labels = {**dict(q=label, k=label, v=label, cos_sin="index_cos_sin",
                     key_cache="index_k", value_cache="index_k", slot_mapping="metadata.slot_mapping"),
              **labels}
    results = step.stage(tag, plan_rope_reshape_and_cache, dict(
        q=x, k=x, v=x, key_cache=scratch.name, value_cache=scratch.name, slot_mapping="slot_mapping",
        positions=positions, cos_sin="index_cos_sin"), dict(is_neox=is_neox),
        infos=dict(k=head, v=head, positions=contiguous_positions if positions_stride != 1 else positions_info),
        labels=labels, scalars=dict(pos_sr=positions_stride) if positions_stride != 1 else None)
    return results["q_out"]


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


def step_results(results: tuple, state, return_token_indices: bool):
    """``(out, state[, token_indices])`` from the plan's results."""
    out, *caches = results[:1 + len(STATE_FIELDS)]
    state = dataclasses.replace(state, **dict(zip(STATE_FIELDS, caches)))
    return (out, state, results[-1]) if return_token_indices else (out, state)


def _type_name(cls: type) -> str:
    """``qsa_torch.QSAState`` rather than ``QSAState``: the two adapters' containers share names."""
    package = cls.__module__.split(".")[0]
    return cls.__name__ if package == "builtins" else f"{package}.{cls.__name__}"


plan_qsa_attention_step.labels = LABELS
