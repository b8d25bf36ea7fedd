"""Rollout layouts: block-aligned left padding, validation."""

import numpy as np
import pytest

from distill.diffusion.layout import build_rollout_layout, completion_windows


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
