"""The composed QSA attention step: the four stages, in the one order that keeps every cache right.

Framework-neutral: it imports neither torch nor jax.  Each adapter binds a
:class:`Backend` (its stage functions, its state/metadata containers and three
array helpers) and calls :func:`attention_step`; slicing and attribute access
read the same in both frameworks.  The step never looks at array values, so it
is jit- and CUDA-graph-safe whenever the stages are.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import numpy as np

from .paging import METADATA_FIELDS, STATE_FIELDS
from .validate import FP8_DTYPE, Checker

__all__ = ["Backend", "attention_step", "STEP_DOC", "STATE_DOC", "METADATA_DOC",
           "METADATA_FIELDS", "STATE_FIELDS", "SCALE_FIELDS"]

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
    index_cos_sin: ``[max_position, 2*FI]`` RoPE table of the indexer heads.
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
Index arrays of one step (all int32), built on the host by
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
    def zeros(cls, geometry, *, kv_heads, head_dim, index_head_dim, dtype, index_dtype=None, device=None,
              cache_dtype=None, compressed_key_dtype=None, k_scale=1.0, v_scale=1.0, compressed_key_scale=1.0):
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
    def from_host(cls, host, device=None):
        """The arrays of a :class:`qsa_kernels.paging.HostStepMetadata`, on ``device``."""
        return cls(**{name: cls._to_device(np.asarray(getattr(host, name)), device) for name in METADATA_FIELDS})


assert tuple(f.name for f in dataclasses.fields(StateFields)) == STATE_FIELDS + SCALE_FIELDS
assert tuple(f.name for f in dataclasses.fields(MetadataFields)) == METADATA_FIELDS


class Backend(NamedTuple):
    """What an adapter binds for :func:`attention_step`."""

    rope_reshape_and_cache: Callable
    compress_groups: Callable
    store_cache_rows: Callable
    select_paged_tokens: Callable
    sparse_paged_attention: Callable
    state_type: type
    metadata_type: type
    check_arrays: Callable[[str, dict], Any]  # the adapter's type and device checks, naming the argument
    full_like: Callable[[Any, int], Any]  # an array like x, filled with a value
    zeros_like: Callable[[Any], Any]
    contiguous: Callable[[Any], Any]  # torch views -> contiguous tensors; identity in JAX


def _check(backend: Backend, q, k, v, index_q, index_k, state, metadata, cos_sin, index_cos_sin,
           compress_ratio, token_topk) -> None:
    """The step's own checks; each stage then validates its arguments (shapes, dtypes, layouts)."""
    for name, value, expected in (("state", state, backend.state_type), ("metadata", metadata, backend.metadata_type)):
        if not isinstance(value, expected):
            raise TypeError(f"{FUNCTION}: {name} must be a {_type_name(expected)}, got {_type_name(type(value))}")
    arrays = dict(q=q, k=k, v=v, index_q=index_q, index_k=index_k, cos_sin=cos_sin, index_cos_sin=index_cos_sin)
    arrays.update({f"state.{name}": getattr(state, name) for name in STATE_FIELDS})
    arrays.update({f"state.{name}": getattr(state, name) for name in SCALE_FIELDS if getattr(state, name) is not None})
    arrays.update({f"metadata.{name}": getattr(metadata, name) for name in METADATA_FIELDS})
    backend.check_arrays(FUNCTION, arrays)
    check = Checker(FUNCTION)
    for name, value in (("compress_ratio", compress_ratio), ("token_topk", token_topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            check.fail(name, "must be a positive int", repr(value))
    if token_topk % compress_ratio:
        check.fail("token_topk", f"must be a multiple of compress_ratio = {compress_ratio}", token_topk)
    rows = metadata.positions.shape[0]
    if rows < 1:
        check.fail("metadata", "must describe at least one row", f"positions of shape {tuple(metadata.positions.shape)}")
    for name, array in (("q", q), ("k", k), ("v", v), ("index_q", index_q), ("index_k", index_k)):
        if len(array.shape) != 3 or array.shape[0] != rows:
            check.fail(name, f"must be [T, heads, dim] with T = {rows} rows like metadata.positions",
                       f"shape {tuple(array.shape)}")
    if index_k.shape[1] != 1:
        check.fail("index_k", "must have one head ([T, 1, DI])", f"shape {tuple(index_k.shape)}")
    _check_scales(check, state)


def _is_fp8(dtype) -> bool:
    """Whether a torch / JAX / NumPy dtype is float8_e4m3fn."""
    return str(dtype).removeprefix("torch.").endswith(FP8_DTYPE) or getattr(dtype, "__name__", "") == FP8_DTYPE


def _check_scales(check: Checker, state) -> None:
    """Scales exactly for the fp8 caches, checked before any stage writes (stage 1 alone would accept
    fp8 caches without scales, which attention then refuses)."""
    for cache, scales in (("key_cache", ("k_scale", "v_scale")), ("compressed_key_cache", ("compressed_key_scale",))):
        dtype = str(getattr(state, cache).dtype).removeprefix("torch.")
        for name in scales:
            scale = getattr(state, name)
            if _is_fp8(dtype) and scale is None:
                check.fail(f"state.{name}", f"must be given (a 0-d or 1-element float array) for a {FP8_DTYPE} "
                           f"state.{cache}", None)
            if not _is_fp8(dtype) and scale is not None:
                check.fail(f"state.{name}", f"must be None for a {dtype} state.{cache} (scales are for "
                           f"{FP8_DTYPE} caches)", f"an array of shape {tuple(scale.shape)}")


def _type_name(cls: type) -> str:
    """``qsa_torch.QSAState`` rather than ``QSAState``: the two adapters' containers share names."""
    package = cls.__module__.split(".")[0]
    return cls.__name__ if package == "builtins" else f"{package}.{cls.__name__}"


def _rotate(backend: Backend, x, positions, cos_sin, is_neox: bool):
    """RoPE on ``x [R, H, D]`` at ``positions``: stage 1 with every slot -1, so no cache is touched.

    Stage 1 rotates k rows too and writes them to a cache; here k is one
    head of x and the caches are one-slot scratch arrays that no slot reaches.
    """
    head = x[:, :1]
    scratch_k = backend.zeros_like(x[None, :1, :1])
    scratch_v = backend.zeros_like(x[None, :1, :1])
    no_slots = backend.full_like(positions, -1)
    rotated, *_ = backend.rope_reshape_and_cache(x, head, head, scratch_k, scratch_v, no_slots,
                                                 positions, cos_sin, is_neox=is_neox)
    return rotated


def attention_step(backend: Backend, q, k, v, index_q, index_k, state, metadata, cos_sin, index_cos_sin, *,
                   compress_ratio: int, token_topk: int, is_neox: bool = True, softmax_scale=None,
                   return_token_indices: bool = False):
    """The step of ``STEP_DOC`` over the adapter's ``backend``."""
    _check(backend, q, k, v, index_q, index_k, state, metadata, cos_sin, index_cos_sin, compress_ratio, token_topk)
    m = metadata

    # 1. RoPE + KV cache.
    q, _, key_cache, value_cache = backend.rope_reshape_and_cache(
        q, k, v, state.key_cache, state.value_cache, m.slot_mapping, m.positions, cos_sin, is_neox=is_neox,
        k_scale=state.k_scale, v_scale=state.v_scale)

    # 2. Pool first, then overwrite the ring with this step's raw keys.
    pooled, first_positions = backend.compress_groups(
        index_k, m.raw_positions, state.compressor_state_cache, m.compressor_state_block_table,
        m.token_to_req, m.query_start_loc, m.positions, m.compressed_slots, compress_ratio)
    ring = backend.store_cache_rows(state.compressor_state_cache, m.compressor_state_slots, index_k)
    pooled = _rotate(backend, pooled, backend.contiguous(first_positions[:, 0]), index_cos_sin, is_neox)
    compressed = backend.store_cache_rows(state.compressed_key_cache, m.compressed_slots, pooled,
                                          scale=state.compressed_key_scale)

    # 3. Selection over the compressed keys, this step's groups included.
    index_q = _rotate(backend, index_q, m.positions, index_cos_sin, is_neox)
    token_indices = backend.select_paged_tokens(
        index_q, compressed, m.compressed_block_table, m.token_to_req, m.positions, m.sequence_lengths,
        token_topk, compress_ratio, k_scale=state.compressed_key_scale)

    # 4. Attention over the selected tokens (this step's K/V included).
    out = backend.sparse_paged_attention(q, key_cache, value_cache, token_indices, m.block_table,
                                         m.token_to_req, softmax_scale, k_scale=state.k_scale, v_scale=state.v_scale)

    state = dataclasses.replace(state, key_cache=key_cache, value_cache=value_cache,
                                compressor_state_cache=ring, compressed_key_cache=compressed)
    return (out, state, token_indices) if return_token_indices else (out, state)
