"""Rollout layouts: block-aligned left padding, validation."""

import numpy as np
import pytest

from distill.diffusion.layout import (
    build_rollout_layout,
    build_training_layout,
    completion_windows,
)


def layout_of(prompts, completion=5, block=4):
    return build_rollout_layout(
        prompts,
        completion_length=completion,
        block_size=block,
        pad_id=0,
        mask_id=1,
        vocab_size=20,
    )


def test_physical_windows_are_logical_blocks_in_every_row():
    layout = layout_of([[5] * 3, [6] * 9, [7] * 12])
    positions, segments = np.asarray(layout.positions), np.asarray(layout.segment_ids)
    for row in range(3):
        valid = segments[row] != 0
        slots = np.flatnonzero(valid)
        assert ((slots - positions[row][valid]) % 4 == 0).all()
        assert np.array_equal(positions[row][valid], np.arange(valid.sum()))
    # Every row's first completion token sits in the same window.
    first = np.argmax(np.asarray(layout.completion_mask), axis=1)
    assert len(set(first // 4)) == 1 and first[0] // 4 == layout.first_window


def test_completion_starts_masked_and_prompt_is_clean():
    layout = layout_of([[5, 6], [7]])
    tokens, completion = np.asarray(layout.tokens), np.asarray(layout.completion_mask)
    assert (tokens[completion] == 1).all() and completion.sum(axis=1).tolist() == [5, 5]
    assert np.asarray(layout.prompt_mask).sum(axis=1).tolist() == [2, 1]


def test_window_count_is_static_for_a_bucket_of_prompt_lengths():
    shapes = {layout_of([[5] * n]).tokens.shape for n in (4, 5, 7)}
    assert len(shapes) == 1
    assert completion_windows(5, 4) == 2 and completion_windows(8, 4) == 3


@pytest.mark.parametrize(
    ("prompts", "field"),
    [
        ([], "prompts"),
        ([[]], "prompts[0]"),
        ([[5], [1, 5]], "prompts[1]"),  # contains the mask id
        ([[25]], "prompts[0]"),  # outside the vocabulary
    ],
)
def test_bad_prompts_are_refused_by_name(prompts, field):
    with pytest.raises(ValueError, match=f"`{field.replace('[', '.').replace(']', '.')}"):
        layout_of(prompts)


def test_rows_may_have_shorter_completions():
    layout = build_rollout_layout(
        [[5] * 3, [6] * 6],
        completion_length=5,
        completion_lengths=[2, 5],
        block_size=4,
        pad_id=0,
        mask_id=1,
        vocab_size=20,
    )
    assert np.asarray(layout.completion_mask).sum(axis=1).tolist() == [2, 5]
    with pytest.raises(ValueError, match="`completion_lengths.1.`"):
        build_rollout_layout(
            [[5], [6]],
            completion_length=5,
            completion_lengths=[2, 6],
            block_size=4,
            pad_id=0,
            mask_id=1,
            vocab_size=20,
        )


STOP = 2


def training_layout_of(prompts, answers, horizon=9, block=4, fill_id=STOP):
    return build_training_layout(
        prompts,
        answers,
        horizon=horizon,
        block_size=block,
        pad_id=0,
        mask_id=1,
        vocab_size=20,
        fill_id=fill_id,
    )


def test_stop_fill_extends_each_answer_to_the_end_of_its_block_and_trains_it():
    # Prompts of 3 and 6 ids, answers (ending in the stop) of 2 and 2: logical ends 5 and 8.
    layout = training_layout_of([[5] * 3, [6] * 6], [[7, STOP], [8, STOP]])
    completion = np.asarray(layout.completion_mask)
    tokens = np.asarray(layout.tokens)
    assert completion.sum(axis=1).tolist() == [5, 2]  # 5 -> 8 (3 stops added); 8 ends a block
    assert tokens[0][completion[0]].tolist() == [7, STOP, STOP, STOP, STOP]
    assert np.array_equal(np.asarray(layout.loss_weights), completion.astype(np.float32))
    unfilled = training_layout_of([[5] * 3, [6] * 6], [[7, STOP], [8, STOP]], fill_id=None)
    assert np.asarray(unfilled.completion_mask).sum(axis=1).tolist() == [2, 2]


def test_stop_fill_never_passes_the_horizon():
    # Prompt 1 id, horizon 2: the rollout's canvas ends at logical 3, inside the first block.
    layout = training_layout_of([[5]], [[STOP]], horizon=2)
    assert np.asarray(layout.completion_mask).sum() == 2


def test_a_filled_training_row_has_the_rollouts_valid_slots_in_its_stop_block():
    """The warm-up must not see where the completion ends: in the stop's block, the slots a
    rollout holds as masks are valid (attended) in the training row too."""
    prompts, answers, horizon, block = [[5] * 3, [6] * 5, [4] * 9], [[7, STOP]] * 3, 9, 4
    training = training_layout_of(prompts, answers, horizon=horizon, block=block)
    rollout = build_rollout_layout(
        prompts, completion_length=horizon, block_size=block, pad_id=0, mask_id=1, vocab_size=20
    )
    assert training.tokens.shape == rollout.tokens.shape
    for row in range(len(prompts)):
        stop_slot = np.flatnonzero(np.asarray(training.tokens)[row] == STOP)[0]
        window = slice(stop_slot // block * block, stop_slot // block * block + block)
        assert np.array_equal(
            np.asarray(training.segment_ids)[row, window],
            np.asarray(rollout.segment_ids)[row, window],
        ), row


@pytest.mark.parametrize("fill_id", [1, 20, -1, True, 2.0])
def test_a_bad_fill_id_is_refused_by_name(fill_id):
    with pytest.raises(ValueError, match="`fill_id` must"):
        training_layout_of([[5]], [[STOP]], fill_id=fill_id)
