"""Target alignment by logical position: which slot's logits predict each slot's token.

- ``same_position``: the logits at logical position p predict token p (the slot itself).
- ``shifted``: the logits at logical position p - 1 of the same segment predict token p
  (AR-initialized students keep their causal head). Position 0 of a segment has no source.

Sources are found by matching (segment, position) among valid slots, never by physical
adjacency, so alignment stays correct after any permutation of the physical order (e.g.
load-balanced context-parallel reordering). Padding slots (segment 0) never match, even
when they carry position 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distill.config import Alignment

ALIGNMENTS: tuple[Alignment, ...] = ("same_position", "shifted")


def check_alignment(alignment: str) -> None:
    if alignment not in ALIGNMENTS:
        raise ValueError(f"`alignment` must be one of {ALIGNMENTS}; received {alignment!r}")


def source_slots(positions: jax.Array, segment_ids: jax.Array, alignment: Alignment) -> jax.Array:
    """``[B, L]`` int32: the slot whose logits predict each slot's token, or -1 (none).

    Cost is ``O(B * L^2)`` booleans; fine for the sequence lengths this project trains on.
    """
    check_alignment(alignment)
    offset = 1 if alignment == "shifted" else 0
    valid = segment_ids != 0
    match = (
        valid[:, :, None]
        & valid[:, None, :]
        & (segment_ids[:, :, None] == segment_ids[:, None, :])
        & (positions[:, None, :] == positions[:, :, None] - offset)
    )
    found = match.any(axis=-1)
    return jnp.where(found, jnp.argmax(match, axis=-1), -1).astype(jnp.int32)


def gather_sources(values: jax.Array, sources: jax.Array) -> jax.Array:
    """``values`` ``[B, L, ...]`` taken at ``sources`` ``[B, N]`` (-1 gives slot 0's values;
    callers mask those targets out)."""
    index = jnp.maximum(sources, 0)
    index = index.reshape(index.shape + (1,) * (values.ndim - 2))
    return jnp.take_along_axis(values, index, axis=1)
