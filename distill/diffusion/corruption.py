"""Canvases and the four masks of the sequence contract (DESIGN section 3).

Given a :class:`~distill.diffusion.layout.BlockLayout` (validity from ``segment_ids``,
``completion_mask`` = positions the student generates), :func:`corrupt` draws one noise
level per (row, logical block), uniform in ``[min_noise, 1]``, and corrupts each eligible
completion position with that probability:

- ``same_position`` + ``all_masked``: every corrupted position becomes the mask id and is a
  target; targets are scored at their own position.
- ``shifted`` + ``seed_and_mask``: a block's first slot (anchor) is never corrupted but is
  always a target (scored from the previous logical position, i.e. the previous block).

Every block with at least one eligible position keeps at least one target (the eligible
position with the smallest draw is forced when the draw corrupted none). Padding and the
prompt are never corrupted and never targets. Masks nest: valid ⊇ completion ⊇ target ⊇
corrupted (except anchors, which are targets without being corrupted).

Randomness is per row (one key per row), so splitting a batch into microbatches does not
change any row's corruption.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from distill.config import check_contract
from distill.diffusion.layout import BlockLayout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Corruption:
    """``canvas`` ``[B, L]`` int32 input tokens; ``corruption_mask``, ``target_mask`` bool;
    ``noise`` float32, the noise level of each slot's block (1 outside the completion)."""

    canvas: jax.Array
    corruption_mask: jax.Array
    target_mask: jax.Array
    noise: jax.Array


def anchor_mask(layout: BlockLayout) -> jax.Array:
    """Completion slots that start a logical block."""
    return layout.completion_mask & (layout.positions % layout.block_size == 0)


def block_noise(
    keys: jax.Array, n_blocks: int, *, min_noise: float, antithetic: bool = False
) -> jax.Array:
    """``[B, n_blocks]`` noise levels in ``[min_noise, 1]``, one key per row.

    ``antithetic`` stratifies each row's blocks: ``u_b = (u + b / n_blocks) mod 1``.
    """
    if not 0.0 < min_noise <= 1.0:
        raise ValueError(f"`min_noise` must be in (0, 1]; received {min_noise}")
    if antithetic:
        base = jax.vmap(lambda key: jax.random.uniform(key, ()))(keys)
        uniform = (base[:, None] + jnp.arange(n_blocks) / n_blocks) % 1.0
    else:
        uniform = jax.vmap(lambda key: jax.random.uniform(key, (n_blocks,)))(keys)
    return min_noise + (1.0 - min_noise) * uniform


def corrupt(
    layout: BlockLayout,
    keys: jax.Array,
    *,
    alignment: str,
    canvas: str,
    min_noise: float,
    mask_id: int,
    antithetic: bool = False,
) -> Corruption:
    """Corrupt ``layout``'s completion with per-block noise; ``keys`` holds one key per row."""
    check_contract(alignment, canvas)
    if keys.shape != layout.tokens.shape[:1]:
        raise ValueError(
            f"`keys` must hold one key per row ({layout.tokens.shape[0]}); received {keys.shape}"
        )
    batch, length = layout.tokens.shape
    n_blocks = length // layout.block_size + 1  # logical blocks are < length / block_size + 1
    noise_keys, draw_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    levels = block_noise(noise_keys, n_blocks, min_noise=min_noise, antithetic=antithetic)
    block = layout.positions // layout.block_size
    noise = jnp.where(
        layout.completion_mask, jnp.take_along_axis(levels, block, axis=1), 1.0
    ).astype(jnp.float32)
    draws = jax.vmap(lambda key: jax.random.uniform(key, (length,)))(draw_keys)

    anchors = (
        anchor_mask(layout) if canvas == "seed_and_mask" else jnp.zeros_like(layout.completion_mask)
    )
    eligible = layout.completion_mask & ~anchors
    corrupted = eligible & (draws < noise)
    # Force one target in every block that has eligible positions but no target yet.
    big = jnp.float32(2.0)
    per_block = jax.vmap(lambda values, ids: jax.ops.segment_min(values, ids, n_blocks))
    per_block_any = jax.vmap(lambda values, ids: jax.ops.segment_max(values, ids, n_blocks))
    smallest = per_block(jnp.where(eligible, draws, big), block)
    has_target = per_block_any((corrupted | anchors).astype(jnp.int32), block) > 0
    needs = jnp.take_along_axis(~has_target, block, axis=1)
    forced = eligible & needs & (draws == jnp.take_along_axis(smallest, block, axis=1))
    corrupted = corrupted | forced
    return Corruption(
        canvas=jnp.where(corrupted, mask_id, layout.tokens).astype(jnp.int32),
        corruption_mask=corrupted,
        target_mask=corrupted | anchors,
        noise=noise,
    )
