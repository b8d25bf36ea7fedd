"""Low-confidence block rollout: commit rules, RNG streams, stop tokens, invariants."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from distill.config import ConfigError, ModelConfig, RolloutConfig
from distill.diffusion import denoise
from distill.diffusion.denoise import SamplingSettings, rollout, row_keys
from distill.models.transformer import Transformer
from tests.diffusion.conftest import COMPLETION


def settings_for(tokenizer, **fields):
    config = RolloutConfig(max_completion_length=COMPLETION, **fields)
    return SamplingSettings.from_config(config, tokenizer.special)


def commits_per_step(trace):
    steps, completion = np.asarray(trace.action_steps), np.asarray(trace.completion_mask)
    return [np.bincount(steps[row][completion[row]]) for row in range(steps.shape[0])]


def test_threshold_one_commits_exactly_one_token_per_step(student, tokenizer, prompts):
    trace = rollout(student, prompts, settings_for(tokenizer, threshold=1.0), seed=0, global_step=0)
    for counts in commits_per_step(trace):
        assert (counts == 1).all()
    assert np.asarray(trace.forwards).tolist() == [COMPLETION] * len(prompts)


def test_threshold_zero_commits_each_block_in_one_step(student, tokenizer, prompts):
    trace = rollout(student, prompts, settings_for(tokenizer, threshold=0.0), seed=0, global_step=0)
    steps, completion = np.asarray(trace.action_steps), np.asarray(trace.completion_mask)
    for row in range(len(prompts)):
        slots = np.flatnonzero(completion[row])
        windows = slots // trace.block_size
        # One step per block touched by the completion, in block order.
        assert np.array_equal(steps[row][slots], windows - windows[0])


def test_schedule_with_steps_equal_to_completion_commits_one_per_step(student, tokenizer, prompts):
    settings = settings_for(tokenizer, commit_rule="schedule", schedule_steps=COMPLETION)
    trace = rollout(student, prompts, settings, seed=0, global_step=0)
    for counts in commits_per_step(trace):
        assert (counts == 1).all()


@pytest.mark.parametrize("strategy", ["random", "entropy", "margin"])
def test_schedule_strategies_respect_the_step_budget(student, tokenizer, prompts, strategy):
    settings = settings_for(
        tokenizer, commit_rule="schedule", schedule_steps=COMPLETION // 2, strategy=strategy
    )
    trace = rollout(student, prompts, settings, seed=0, global_step=0)
    for counts in commits_per_step(trace):
        assert counts.max() <= 2 and counts.min() >= 1


@pytest.mark.parametrize("alignment", ["same_position", "shifted"])
def test_same_seed_gives_the_same_trace_bitwise(student, tokenizer, prompts, alignment):
    canvas = "all_masked" if alignment == "same_position" else "seed_and_mask"
    settings = settings_for(tokenizer, threshold=0.08, alignment=alignment, canvas=canvas)
    first = rollout(student, prompts, settings, seed=3, global_step=5)
    again = rollout(student, prompts, settings, seed=3, global_step=5)
    for field in ("tokens", "action_steps", "action_logps", "forwards"):
        np.testing.assert_array_equal(getattr(first, field), getattr(again, field))
    other = rollout(student, prompts, settings, seed=3, global_step=6)
    assert not np.array_equal(first.tokens, other.tokens)


def test_rows_are_independent_of_each_other(student, tokenizer, prompts):
    settings = settings_for(tokenizer, threshold=0.08)
    base = rollout(student, prompts, settings, seed=1, global_step=0)
    changed_prompt = [tokenizer.encode("ab|"), *prompts[1:]]  # row 0 changes, same length
    changed = rollout(student, changed_prompt, settings, seed=1, global_step=0)
    for field in ("tokens", "action_steps", "action_logps"):
        np.testing.assert_array_equal(
            np.asarray(getattr(base, field))[1:], np.asarray(getattr(changed, field))[1:]
        )
    assert not np.array_equal(np.asarray(base.tokens)[0], np.asarray(changed.tokens)[0])


def test_eval_uses_its_own_stream_and_never_advances_training(student, tokenizer, prompts):
    settings = settings_for(tokenizer, threshold=0.08)
    train = rollout(student, prompts, settings, seed=0, global_step=2, mode="train")
    evaluation = rollout(student, prompts, settings, seed=0, global_step=2, mode="eval")
    train_again = rollout(student, prompts, settings, seed=0, global_step=2, mode="train")
    np.testing.assert_array_equal(train.tokens, train_again.tokens)
    assert not np.array_equal(train.tokens, evaluation.tokens)
    assert not np.array_equal(
        jax.random.key_data(row_keys(0, 2, "train", [0])),
        jax.random.key_data(row_keys(0, 2, "eval", [0])),
    )


@pytest.mark.parametrize("alignment", ["same_position", "shifted"])
def test_mask_id_is_never_committed_and_no_mask_remains(student, tokenizer, prompts, alignment):
    canvas = "all_masked" if alignment == "same_position" else "seed_and_mask"
    settings = settings_for(
        tokenizer, threshold=0.0, alignment=alignment, canvas=canvas, stop_when_done=False
    )
    trace = rollout(student, prompts, settings, seed=4, global_step=0)
    tokens, completion = np.asarray(trace.tokens), np.asarray(trace.completion_mask)
    assert completion.sum(axis=1).tolist() == [COMPLETION] * len(prompts)
    assert not (tokens == tokenizer.special.mask_id).any()


def test_shifted_anchor_is_its_own_action_step(student, tokenizer, prompts):
    settings = settings_for(tokenizer, threshold=0.0, alignment="shifted", canvas="seed_and_mask")
    trace = rollout(student, prompts, settings, seed=0, global_step=0)
    steps, completion = np.asarray(trace.action_steps), np.asarray(trace.completion_mask)
    size = trace.block_size
    for row in range(len(prompts)):
        for slot in np.flatnonzero(completion[row]):
            if slot % size == 0:  # a block's first slot: nothing else shares its step
                assert (steps[row] == steps[row][slot]).sum() == 1


def test_greedy_rollout_does_not_depend_on_the_seed(student, tokenizer, prompts):
    settings = settings_for(tokenizer, greedy=True, threshold=0.08)
    first = rollout(student, prompts, settings, seed=0, global_step=0)
    second = rollout(student, prompts, settings, seed=9, global_step=4)
    np.testing.assert_array_equal(first.tokens, second.tokens)


def test_stop_when_done_spends_no_forwards_after_the_stop_block(student, tokenizer, prompts):
    stop = tokenizer.special.stop_ids[0]
    # A copy of the student that likes the stop token, so some rows stop early.
    biased = nnx.clone(student)
    biased.embed.embedding[...] = biased.embed.embedding[...].at[stop].multiply(40.0)
    stopping = rollout(
        biased, prompts, settings_for(tokenizer, threshold=0.0), seed=0, global_step=0
    )
    running = rollout(
        biased,
        prompts,
        settings_for(tokenizer, threshold=0.0, stop_when_done=False),
        seed=0,
        global_step=0,
    )
    stopped = stopping.stopped()
    assert stopped.any()
    size = stopping.block_size
    completion = np.asarray(stopping.completion_mask)
    for row in range(len(prompts)):
        if not stopped[row]:
            np.testing.assert_array_equal(stopping.tokens[row], running.tokens[row])
            continue
        ids = stopping.completions()[row]
        assert ids[-1] == stop and stop not in ids[:-1]
        slots = np.flatnonzero(completion[row])
        stop_slot = slots[np.flatnonzero(np.asarray(stopping.tokens)[row][slots] == stop)[0]]
        # Generation ends with the block holding the first stop token; everything generated
        # up to there is what the row would have generated anyway.
        assert slots[-1] // size == stop_slot // size
        np.testing.assert_array_equal(
            np.asarray(stopping.tokens)[row][slots], np.asarray(running.tokens)[row][slots]
        )
        assert stopping.forwards[row] <= running.forwards[row]
    assert int(np.asarray(stopping.forwards).sum()) < int(np.asarray(running.forwards).sum())


def test_rollout_with_and_without_prefix_cache_agree(student, tokenizer, prompts):
    settings = settings_for(tokenizer, threshold=0.08, alignment="shifted", canvas="seed_and_mask")
    cached = rollout(student, prompts, settings, seed=0, global_step=0)
    full = rollout(student, prompts, settings, seed=0, global_step=0, prefix_cache=False)
    np.testing.assert_array_equal(cached.tokens, full.tokens)
    np.testing.assert_array_equal(cached.action_steps, full.action_steps)
    np.testing.assert_allclose(cached.action_logps, full.action_logps, atol=1e-5)


def test_filtered_sampling_is_refused_until_replay_supports_it():
    with pytest.raises(ConfigError, match="`rollout.top_k`"):
        RolloutConfig(top_k=5)
    with pytest.raises(ConfigError, match="`rollout.top_p`"):
        RolloutConfig(top_p=0.9)


def test_bad_rollout_arguments_are_named(student, tokenizer, prompts):
    settings = settings_for(tokenizer)
    with pytest.raises(ValueError, match="`mode`"):
        rollout(student, prompts, settings, seed=0, global_step=0, mode="test")
    with pytest.raises(ValueError, match="`row_ids`"):
        rollout(student, prompts, settings, seed=0, global_step=0, row_ids=[0])
    with pytest.raises(ValueError, match="`settings.stop_ids`"):
        # Refused when the settings are built, so no rollout can start with them.
        bad = dataclasses.replace(settings, stop_ids=(settings.mask_id,))
        rollout(student, prompts, bad, seed=0, global_step=0)


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("alignment", {"alignment": "diagonal"}),  # would have run as same_position
        ("commit_rule", {"commit_rule": "sometimes"}),
        ("confidence", {"confidence": "entropy"}),
        ("strategy", {"strategy": "loudest"}),
        ("threshold", {"threshold": 1.5}),
        ("threshold", {"threshold": float("nan")}),
        ("temperature", {"temperature": float("inf")}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": 0.0}),
        ("completion_length", {"completion_length": 0}),
        ("schedule_steps", {"schedule_steps": 0}),
        ("schedule_steps", {"commit_rule": "schedule", "schedule_steps": None}),
        ("mask_id", {"mask_id": -1}),
        ("pad_id", {"pad_id": -1}),
        ("stop_ids", {"stop_ids": [3]}),
        ("greedy", {"greedy": 1}),
    ],
)
def test_hand_built_sampling_settings_are_validated_field_by_field(tokenizer, field, changes):
    with pytest.raises(ValueError, match=rf"^`settings\.{field}` must .*; received"):
        dataclasses.replace(settings_for(tokenizer), **changes)


def test_shifted_rollout_with_one_slot_blocks_is_refused(tokenizer, prompts):
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32,
        block_size=1,
    )  # fmt: skip
    model = Transformer(config, rngs=nnx.Rngs(0))
    settings = settings_for(tokenizer, alignment="shifted", canvas="seed_and_mask")
    with pytest.raises(ValueError, match=r"^`layout.block_size` must be >= 2 .*; received 1$"):
        rollout(model, prompts, settings, seed=0, global_step=0)


def test_threshold_one_never_clears_even_at_a_confidence_of_exactly_one(tokenizer):
    """The documented rule: ``score >= threshold`` only below 1, so a confidence that rounds
    to 1.0 in float32 still commits one slot per step (the lowest of the tied best)."""
    settings = settings_for(tokenizer, threshold=1.0)
    score = np.ones((2, 4), np.float32)
    pending = np.array([[True] * 4, [False, True, True, False]])
    commit = np.asarray(denoise._select(score, pending, np.full(2, 4), settings))
    np.testing.assert_array_equal(commit, [[1, 0, 0, 0], [0, 1, 0, 0]])
