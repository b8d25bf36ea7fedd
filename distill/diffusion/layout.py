"""Block layouts: left-padded rows whose physical block windows are logical blocks.

Rows with different prompt lengths are left-padded by whole blocks so that, in every row,
physical slot ``w * block_size + j`` holds logical position ``(w - shift_row) * block_size
+ j``: each physical window of ``block_size`` slots is one logical block of every row, and
the window holding each row's first completion token is the same (``first_window``). A
denoiser can then walk the windows in lockstep and share one KV cache slot index per window.

The same layout serves rollout (completion slots start as the mask id and the denoiser
fills them) and training (completion slots hold the reference answer). The window count is
static (``first_window`` is bucketed to a power of two, the completion horizon is fixed) so
shapes do not change from batch to batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """``[B, L]`` arrays, ``L = num_windows * block_size``; segment 0 marks padding.
    ``loss_weights`` (float32) is 1 on the completion unless a caller says otherwise."""

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    prompt_mask: jax.Array
    completion_mask: jax.Array
    loss_weights: jax.Array
    block_size: int = dataclasses.field(metadata={"static": True})
    first_window: int = dataclasses.field(metadata={"static": True})

    @property
    def num_windows(self) -> int:
        return self.tokens.shape[1] // self.block_size


def completion_windows(completion_length: int, block_size: int) -> int:
    """Windows a completion can span when it may start anywhere inside a block."""
    return math.ceil((completion_length + block_size - 1) / block_size)


def _bucket(value: int) -> int:
    return 0 if value == 0 else 1 << (value - 1).bit_length()


def build_rollout_layout(
    prompts: Sequence[Sequence[int]],
    *,
    completion_length: int,
    block_size: int,
    pad_id: int,
    mask_id: int,
    vocab_size: int,
    completion_lengths: Sequence[int] | None = None,
) -> BlockLayout:
    """Lay out ``prompts`` for block-by-block denoising: completion slots hold the mask id.

    ``completion_length`` is the static horizon; ``completion_lengths`` optionally gives
    each row a shorter completion (heterogeneous batches share one compiled shape).
    """
    if completion_lengths is None:
        completion_lengths = [completion_length] * len(prompts)
    if len(completion_lengths) != len(prompts):
        raise ValueError(
            f"`completion_lengths` must have one entry per prompt ({len(prompts)}); "
            f"received {len(completion_lengths)}"
        )
    for row, wanted in enumerate(completion_lengths):
        if not 1 <= wanted <= completion_length:
            raise ValueError(
                f"`completion_lengths[{row}]` must be in [1, {completion_length}]; "
                f"received {wanted}"
            )
    return build_layout(
        prompts,
        [[mask_id] * wanted for wanted in completion_lengths],
        horizon=completion_length,
        block_size=block_size,
        pad_id=pad_id,
        mask_id=mask_id,
        vocab_size=vocab_size,
        completions_field="completion_lengths",
        allow_mask_in_completion=True,
    )


def build_training_layout(
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    *,
    horizon: int,
    block_size: int,
    pad_id: int,
    mask_id: int,
    vocab_size: int,
    fill_id: int | None = None,
) -> BlockLayout:
    """Lay out (prompt, reference answer) pairs for training; answers are the completion.

    With ``fill_id`` (a stop id), each answer is extended with it to the end of the block
    holding its last token, never past ``horizon`` ids: the slots a rollout still holds as
    masks in the stop's block. Without it those slots are padding, invisible to attention,
    so a student trained on such rows can read where its completion ends from the padding,
    a cue no rollout gives it. ``fill_id`` must be in ``[0, vocab_size)`` and not the mask id.
    """
    if fill_id is not None and len(answers) == len(prompts):  # else build_layout refuses
        if isinstance(fill_id, bool) or not isinstance(fill_id, int):
            raise ValueError(f"`fill_id` must be an int token id; received {fill_id!r}")
        if not 0 <= fill_id < vocab_size or fill_id == mask_id:
            raise ValueError(
                f"`fill_id` must be in [0, {vocab_size}) and not the mask id {mask_id}; "
                f"received {fill_id}"
            )
        answers = [
            [*answer, *[fill_id] * _block_fill(len(prompt), len(answer), horizon, block_size)]
            for prompt, answer in zip(prompts, answers, strict=True)
        ]
    return build_layout(
        prompts,
        answers,
        horizon=horizon,
        block_size=block_size,
        pad_id=pad_id,
        mask_id=mask_id,
        vocab_size=vocab_size,
        completions_field="answers",
        allow_mask_in_completion=False,
    )


def _block_fill(prompt_length: int, answer_length: int, horizon: int, block_size: int) -> int:
    """Slots after an answer up to the end of its last block, capped at ``horizon``."""
    if answer_length == 0 or block_size < 1:
        return 0  # build_layout refuses these rows with the field named
    end = prompt_length + answer_length
    block_end = -(-end // block_size) * block_size
    return max(0, min(block_end, prompt_length + horizon) - end)


def _check_ids(field: str, ids: np.ndarray, vocab_size: int, mask_id: int | None) -> None:
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"`{field}` must be a non-empty id list; received {ids.tolist()!r}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"`{field}` must hold ids in [0, {vocab_size}); received {ids.min()}..{ids.max()}"
        )
    if mask_id is not None and (ids == mask_id).any():
        raise ValueError(
            f"`{field}` must not contain the mask id {mask_id}; received it at index "
            f"{int(np.argmax(ids == mask_id))}"
        )


def build_layout(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    horizon: int,
    block_size: int,
    pad_id: int,
    mask_id: int,
    vocab_size: int,
    completions_field: str = "completions",
    allow_mask_in_completion: bool = False,
) -> BlockLayout:
    """Place each (prompt, completion) row so that windows are blocks (module docstring).

    Fails closed on an empty batch, an empty prompt or completion, ids outside
    ``[0, vocab_size)``, a mask id in a prompt (or in a completion unless allowed), or a
    completion longer than ``horizon``.
    """
    if not prompts:
        raise ValueError("`prompts` must hold at least one prompt; received an empty batch")
    if len(completions) != len(prompts):
        raise ValueError(
            f"`{completions_field}` must have one entry per prompt ({len(prompts)}); "
            f"received {len(completions)}"
        )
    if horizon < 1:
        raise ValueError(f"`completion_length` must be >= 1; received {horizon}")
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1; received {block_size}")
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        _check_ids(f"prompts[{row}]", np.asarray(prompt, np.int64), vocab_size, mask_id)
        completion_ids = np.asarray(completion, np.int64)
        _check_ids(
            f"{completions_field}[{row}]",
            completion_ids,
            vocab_size,
            None if allow_mask_in_completion else mask_id,
        )
        if completion_ids.size > horizon:
            raise ValueError(
                f"`{completions_field}[{row}]` must have at most {horizon} ids; received "
                f"{completion_ids.size}"
            )
    first_window = _bucket(max(len(prompt) // block_size for prompt in prompts))
    num_windows = first_window + completion_windows(horizon, block_size)
    batch, length = len(prompts), num_windows * block_size
    tokens = np.full((batch, length), pad_id, np.int32)
    positions = np.zeros((batch, length), np.int32)
    segments = np.zeros((batch, length), np.int32)
    prompt_mask = np.zeros((batch, length), bool)
    completion_mask = np.zeros((batch, length), bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        shift = (first_window - len(prompt) // block_size) * block_size
        total = len(prompt) + len(completion)
        slots = np.arange(shift, shift + total)
        tokens[row, slots] = np.concatenate(
            [np.asarray(prompt, np.int32), np.asarray(completion, np.int32)]
        )
        positions[row, slots] = np.arange(total)
        segments[row, slots] = 1
        prompt_mask[row, slots[: len(prompt)]] = True
        completion_mask[row, slots[len(prompt) :]] = True
    return BlockLayout(
        tokens=jnp.asarray(tokens),
        positions=jnp.asarray(positions),
        segment_ids=jnp.asarray(segments),
        prompt_mask=jnp.asarray(prompt_mask),
        completion_mask=jnp.asarray(completion_mask),
        loss_weights=jnp.asarray(completion_mask, jnp.float32),
        block_size=block_size,
        first_window=first_window,
    )
