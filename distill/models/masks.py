"""Attention masks, all built from logical positions, segment ids and canvas-chunk ids.

One rule covers every layout (DESIGN sections 3-4). A slot is *valid* iff its segment id is
non-zero (validity never comes from token values). Slots with chunk id 0 are *clean*; slots
with chunk id c > 0 belong to canvas chunk c, a copy of one block at the same logical
positions. Query q may attend to key k iff both are valid, they share a segment, and

- clean q, clean k:  ``causal``: pos(k) <= pos(q); ``block_diffusion``: block(k) <= block(q);
- chunk q, clean k:  block(k) < block(q)   (only fully committed earlier blocks);
- chunk q, chunk k:  chunk(k) == chunk(q)   (bidirectional inside the chunk);
- clean q, chunk k:  never.

``block = position // block_size``; a partial final block needs no special case. The same
rule, evaluated between new queries and cached keys, is the KV-cache mask.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from distill.config import AttentionType

ATTENTION_TYPES: tuple[AttentionType, ...] = ("causal", "block_diffusion")


def check_attention_type(attention_type: str) -> None:
    if attention_type not in ATTENTION_TYPES:
        raise ValueError(
            f"`attention_type` must be one of {ATTENTION_TYPES}; received {attention_type!r}"
        )


def block_ids(positions: jax.Array, block_size: int) -> jax.Array:
    """Block index of each logical position (``positions // block_size``)."""
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1; received {block_size}")
    return positions // block_size


def attention_mask(
    q_positions: jax.Array,
    q_segments: jax.Array,
    k_positions: jax.Array,
    k_segments: jax.Array,
    *,
    attention_type: AttentionType,
    block_size: int,
    q_chunks: jax.Array | None = None,
    k_chunks: jax.Array | None = None,
) -> jax.Array:
    """Boolean mask ``[B, Lq, Lk]`` (True = may attend) for queries against keys.

    All inputs are int arrays ``[B, Lq]`` (queries) or ``[B, Lk]`` (keys). Chunk ids are
    optional (absent = all clean) and only meaningful for ``block_diffusion``.
    """
    check_attention_type(attention_type)
    qp, kp = q_positions[:, :, None], k_positions[:, None, :]
    qs, ks = q_segments[:, :, None], k_segments[:, None, :]
    allowed = (qs != 0) & (ks != 0) & (qs == ks)
    if attention_type == "causal":
        if q_chunks is not None or k_chunks is not None:
            raise ValueError("`chunk_ids` must be None for causal attention; received chunks")
        return allowed & (kp <= qp)
    qb, kb = block_ids(qp, block_size), block_ids(kp, block_size)
    if q_chunks is None and k_chunks is None:
        return allowed & (kb <= qb)
    qc = (jnp.zeros_like(q_positions) if q_chunks is None else q_chunks)[:, :, None]
    kc = (jnp.zeros_like(k_positions) if k_chunks is None else k_chunks)[:, None, :]
    clean_q, clean_k = qc == 0, kc == 0
    rule = jnp.where(
        clean_q,
        clean_k & (kb <= qb),
        (clean_k & (kb < qb)) | (kc == qc),
    )
    return allowed & rule


def self_attention_mask(
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    attention_type: AttentionType,
    block_size: int,
    chunk_ids: jax.Array | None = None,
) -> jax.Array:
    """Mask ``[B, L, L]`` of a row against itself (see :func:`attention_mask`)."""
    return attention_mask(
        positions,
        segment_ids,
        positions,
        segment_ids,
        attention_type=attention_type,
        block_size=block_size,
        q_chunks=chunk_ids,
        k_chunks=chunk_ids,
    )


def chunk_masks(
    chunk_positions: jax.Array,
    chunk_segments: jax.Array,
    clean_positions: jax.Array,
    clean_segments: jax.Array,
    *,
    block_size: int,
) -> tuple[jax.Array, jax.Array]:
    """The packed-canvas rule split per chunk, for block-sparse attention.

    Chunks are ``[B, C, K]``; clean keys ``[B, S]``. Returns ``mask_clean`` ``[B, C, K, S]``
    (clean keys of the same segment in earlier blocks) and ``mask_own`` ``[B, C, K, K]``
    (valid slots of the same chunk and segment). Together they equal the rows of
    :func:`self_attention_mask` over :func:`pack_canvas_chunks` for the chunk queries.
    """
    batch, n_chunks, size = chunk_positions.shape
    mask_clean = attention_mask(
        chunk_positions.reshape(batch, n_chunks * size),
        chunk_segments.reshape(batch, n_chunks * size),
        clean_positions,
        clean_segments,
        attention_type="block_diffusion",
        block_size=block_size,
        q_chunks=jnp.ones((batch, n_chunks * size), jnp.int32),
        k_chunks=jnp.zeros_like(clean_positions),
    ).reshape(batch, n_chunks, size, -1)
    qs, ks = chunk_segments[..., :, None], chunk_segments[..., None, :]
    mask_own = (qs != 0) & (ks != 0) & (qs == ks)
    return mask_clean, mask_own


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """A row of clean tokens followed by canvas chunks, all ``[B, L + C * K]`` int32.

    ``chunk_ids`` is 0 on the clean prefix and c (1-based) on chunk c's ``K`` slots.
    ``source_slots`` maps each chunk slot to the clean slot it copies (-1: empty slot).
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    chunk_ids: jax.Array
    source_slots: jax.Array


def pack_canvas_chunks(
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    chunk_sources: jax.Array,
    chunk_tokens: jax.Array,
) -> PackedLayout:
    """Append canvas chunks to clean rows.

    Args:
      tokens, positions, segment_ids: the clean rows, ``[B, L]`` int.
      chunk_sources: ``[B, C, K]`` int, the clean slot each chunk slot copies, or -1 for an
        empty slot (a partial block or a padding chunk). The slots of one chunk must all
        lie in one block of one segment; the mask relies on it.
      chunk_tokens: ``[B, C, K]`` int, the canvas held by each chunk slot.

    Chunk slots copy the logical position and segment of their source slot, so RoPE and the
    mask treat a chunk exactly like its block; empty slots get segment 0 (invalid).
    """
    if tokens.ndim != 2 or positions.shape != tokens.shape or segment_ids.shape != tokens.shape:
        raise ValueError(
            "`tokens`, `positions`, `segment_ids` must share a [B, L] shape; received "
            f"{tokens.shape}, {positions.shape}, {segment_ids.shape}"
        )
    if chunk_sources.ndim != 3 or chunk_tokens.shape != chunk_sources.shape:
        raise ValueError(
            "`chunk_sources` and `chunk_tokens` must share a [B, C, K] shape; received "
            f"{chunk_sources.shape}, {chunk_tokens.shape}"
        )
    if chunk_sources.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"`chunk_sources` must have batch {tokens.shape[0]}; received {chunk_sources.shape}"
        )
    batch, n_chunks, chunk_len = chunk_sources.shape
    present = chunk_sources >= 0
    safe = jnp.where(present, chunk_sources, 0).reshape(batch, n_chunks * chunk_len)
    gathered_pos = jnp.take_along_axis(positions, safe, axis=1)
    gathered_seg = jnp.take_along_axis(segment_ids, safe, axis=1)
    flat_present = present.reshape(batch, n_chunks * chunk_len)
    chunk_pos = jnp.where(flat_present, gathered_pos, 0)
    chunk_seg = jnp.where(flat_present, gathered_seg, 0)
    chunk_index = jnp.broadcast_to(
        jnp.repeat(jnp.arange(1, n_chunks + 1, dtype=jnp.int32), chunk_len),
        (batch, n_chunks * chunk_len),
    )
    clean_sources = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return PackedLayout(
        tokens=jnp.concatenate([tokens, chunk_tokens.reshape(batch, -1)], axis=1).astype(jnp.int32),
        positions=jnp.concatenate([positions, chunk_pos], axis=1).astype(jnp.int32),
        segment_ids=jnp.concatenate([segment_ids, chunk_seg], axis=1).astype(jnp.int32),
        chunk_ids=jnp.concatenate([jnp.zeros_like(tokens), chunk_index], axis=1).astype(jnp.int32),
        source_slots=jnp.concatenate(
            [clean_sources, jnp.where(present, chunk_sources, -1).reshape(batch, -1)], axis=1
        ).astype(jnp.int32),
    )
