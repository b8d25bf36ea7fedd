"""Canvases and the four masks of the sequence contract (DESIGN section 3).

Given a :class:`~distill.diffusion.layout.BlockLayout` (validity from ``segment_ids``,
``completion_mask`` = positions the student generates), :func:`corrupt` draws one noise
level per (row, logical block), uniform in ``[min_noise, 1]``, and corrupts each eligible
completion position with that probability:

- ``same_position`` + ``all_masked``: every corrupted position becomes the mask id and is a
  target; targets are scored at their own position.
- ``shifted`` + ``seed_and_mask``: a block's first slot (anchor) is never corrupted but is
  always a target (scored from the previous logical position, i.e. the previous block).

Every block with at least one eligible position keeps at least one target: when the draw
corrupted none, exactly one is forced, the eligible position with the smallest draw (ties to
the lowest logical position; :func:`forced_targets`). Padding and the prompt are never
corrupted and never targets. Masks nest: valid ⊇ completion ⊇ target ⊇ corrupted (except
anchors, which are targets without being corrupted). ``shifted`` + ``seed_and_mask`` needs
``block_size >= 2``: a one-slot block is all anchor, so nothing would ever be corrupted.

Randomness is per row (one key per row), so splitting a batch into microbatches does not
change any row's corruption.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

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


def check_mask_id(mask_id: int, field: str = "mask_id") -> None:
    """A mask id is a static token id: a Python (or numpy) integer >= 0. A negative one would
    index the vocabulary from the end, so it is refused rather than wrapped."""
    if isinstance(mask_id, bool) or not isinstance(mask_id, int | np.integer) or mask_id < 0:
        raise ValueError(f"`{field}` must be a token id >= 0; received {mask_id!r}")


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


def forced_targets(
    draws: jax.Array,
    eligible: jax.Array,
    has_target: jax.Array,
    block: jax.Array,
    positions: jax.Array,
    n_blocks: int,
) -> jax.Array:
    """``[B, L]`` bool: exactly one slot in every block (ids ``block`` ``[B, L]`` in
    ``[0, n_blocks)``) that has ``eligible`` slots but no ``has_target`` slot: the eligible
    slot with the smallest draw, ties to the lowest logical position (``positions``).
    Nothing elsewhere."""
    per_block_min = jax.vmap(lambda values, ids: jax.ops.segment_min(values, ids, n_blocks))
    per_block_any = jax.vmap(lambda values, ids: jax.ops.segment_max(values, ids, n_blocks))
    smallest = per_block_min(jnp.where(eligible, draws, jnp.float32(2.0)), block)
    tied = eligible & (draws == jnp.take_along_axis(smallest, block, axis=1))
    # Equal float32 draws do happen; every tied slot would otherwise be forced.
    lowest = jnp.iinfo(jnp.int32).max
    first = per_block_min(jnp.where(tied, positions, lowest).astype(jnp.int32), block)
    chosen = tied & (positions == jnp.take_along_axis(first, block, axis=1))
    covered = per_block_any(has_target.astype(jnp.int32), block) > 0
    return chosen & ~jnp.take_along_axis(covered, block, axis=1)


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
    check_mask_id(mask_id)
    if canvas == "seed_and_mask" and layout.block_size < 2:
        raise ValueError(
            "`layout.block_size` must be >= 2 with the shifted + seed_and_mask contract (a "
            f"block of 1 is all anchor: nothing is ever corrupted); received {layout.block_size}"
        )
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
    forced = forced_targets(draws, eligible, corrupted | anchors, block, layout.positions, n_blocks)
    corrupted = corrupted | forced
    return Corruption(
        canvas=jnp.where(corrupted, mask_id, layout.tokens).astype(jnp.int32),
        corruption_mask=corrupted,
        target_mask=corrupted | anchors,
        noise=noise,
    )
