"""Exact replay: per-step reference and packed fast paths reproduce the rollout."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distill.config import RolloutConfig
from distill.diffusion import replay
from distill.diffusion.denoise import SamplingSettings, rollout
from tests.diffusion.conftest import COMPLETION

CONTRACTS = [("same_position", "all_masked"), ("shifted", "seed_and_mask")]


@functools.partial(nnx.jit, static_argnames=("num_steps",))
def per_step(model, trace, num_steps):
    return replay.replay_per_step(model, trace, num_steps=num_steps, vocab_chunk=16)


@functools.partial(nnx.jit, static_argnames=("num_chunks", "dense", "chunks_per_forward"))
def packed(model, trace, num_chunks, dense=False, chunks_per_forward=None):
    return replay.replay_packed(
        model, trace, num_chunks=num_chunks, dense=dense, chunks_per_forward=chunks_per_forward
    )


def make_trace(student, tokenizer, prompts, alignment, canvas, greedy, seed=0):
    config = RolloutConfig(
        max_completion_length=COMPLETION,
        alignment=alignment,
        canvas=canvas,
        threshold=0.08,  # a mix of one- and multi-token steps with this model
        greedy=greedy,
        temperature=0.8,
    )
    settings = SamplingSettings.from_config(config, tokenizer.special)
    return rollout(student, prompts, settings, seed=seed, global_step=0)


@pytest.fixture(scope="module", params=[(c, g) for c in CONTRACTS for g in (False, True)])
def case(request, student, tokenizer, prompts):
    (alignment, canvas), greedy = request.param
    trace = make_trace(student, tokenizer, prompts, alignment, canvas, greedy)
    replay.validate_trace(trace, tokenizer.vocab_size)
    return trace


def test_rollout_takes_multi_token_steps(case):
    assert 1.0 < case.tokens_per_forward() < COMPLETION


def test_per_step_replay_equals_rollout_log_probs(student, case):
    logps = per_step(student, case, replay.num_steps_bucket(case))
    np.testing.assert_allclose(logps, case.action_logps, atol=1e-5, rtol=0)


def test_dense_packed_replay_equals_rollout_log_probs(student, case):
    logps = packed(student, case, replay.num_steps_bucket(case), dense=True)
    np.testing.assert_allclose(logps, case.action_logps, atol=1e-5, rtol=0)


def test_block_sparse_packed_replay_equals_rollout_log_probs(student, case):
    n = replay.num_steps_bucket(case)
    np.testing.assert_allclose(packed(student, case, n), case.action_logps, atol=1e-5, rtol=0)
    grouped = packed(student, case, n, chunks_per_forward=n // 2)
    np.testing.assert_allclose(grouped, case.action_logps, atol=1e-5, rtol=0)


def test_replay_is_zero_outside_the_completion(student, case):
    logps = np.asarray(packed(student, case, replay.num_steps_bucket(case)))
    assert (logps[~np.asarray(case.completion_mask)] == 0).all()
    assert (logps[np.asarray(case.completion_mask)] < 0).all()


@pytest.fixture(scope="module", params=CONTRACTS)
def stochastic_case(request, student, tokenizer, prompts):
    return make_trace(student, tokenizer, prompts, *request.param, greedy=False)


@pytest.mark.parametrize("path", ["per_step", "packed"])
def test_gradient_through_replay_is_finite_and_non_zero(student, stochastic_case, path):
    case = stochastic_case
    n = replay.num_steps_bucket(case)

    def total(model):
        if path == "per_step":
            logps = replay.replay_per_step(model, case, num_steps=n, vocab_chunk=16)
        else:
            logps = replay.replay_packed(model, case, num_chunks=n)
        return jnp.sum(logps)

    grads = nnx.jit(nnx.grad(total))(student)
    leaves = jax.tree.leaves(nnx.state(grads))
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in leaves)
    assert sum(float(jnp.abs(leaf).sum()) for leaf in leaves) > 0


@pytest.mark.parametrize("contract", CONTRACTS)
def test_replay_equals_rollout_at_a_logit_scale_near_1000(student, tokenizer, prompts, contract):
    """Rollout and replay agree to 1e-5 when logits are large (the final norm scaled so the
    largest logit is about 1000): neither side subtracts two values of the logits' size."""
    probe = make_trace(student, tokenizer, prompts, *contract, greedy=False)
    hidden = student.hidden_states(probe.tokens, probe.positions, probe.segment_ids)
    loud = nnx.clone(student)
    loud.final_norm.scale[...] = loud.final_norm.scale[...] * (
        1000.0 / float(jnp.abs(student.logits(hidden)).max())
    )
    trace = make_trace(loud, tokenizer, prompts, *contract, greedy=False)
    replay.validate_trace(trace, tokenizer.vocab_size)
    hidden = loud.hidden_states(trace.tokens, trace.positions, trace.segment_ids)
    assert 500 < float(jnp.abs(loud.logits(hidden)).max()) < 2000
    n = replay.num_steps_bucket(trace)
    np.testing.assert_allclose(per_step(loud, trace, n), trace.action_logps, atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed(loud, trace, n), trace.action_logps, atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        packed(loud, trace, n, dense=True), trace.action_logps, atol=1e-5, rtol=0
    )


def test_replay_under_other_parameters_gives_other_log_probs(student, case):
    other = nnx.clone(student)
    other.layers[0].mlp.up_proj.kernel[...] = other.layers[0].mlp.up_proj.kernel[...] * 3.0
    logps = packed(other, case, replay.num_steps_bucket(case))
    assert np.abs(np.asarray(logps - case.action_logps)).max() > 1e-3


# ---- fail-closed validation ------------------------------------------------------------


@pytest.fixture(scope="module")
def valid_trace(student, tokenizer, prompts):
    return make_trace(student, tokenizer, prompts, "same_position", "all_masked", False)


def edited(trace, field, edit):
    array = np.array(getattr(trace, field))
    edit(array)
    return dataclasses.replace(trace, **{field: jnp.asarray(array)})


def first_completion_slot(trace, row=0):
    return int(np.argmax(np.asarray(trace.completion_mask)[row]))


def test_non_contiguous_completion_is_refused(valid_trace):
    slot = first_completion_slot(valid_trace) + 2

    def hole(completion):
        completion[0, slot] = False

    trace = edited(valid_trace, "completion_mask", hole)
    trace = edited(trace, "prompt_mask", lambda prompt: prompt.__setitem__((0, slot), True))
    trace = edited(trace, "action_steps", lambda steps: steps.__setitem__((0, slot), -1))
    with pytest.raises(replay.TraceError, match="`trace.completion_mask`.*contiguous"):
        replay.validate_trace(trace)


def test_positions_not_counting_from_zero_are_refused(valid_trace):
    trace = edited(valid_trace, "positions", lambda positions: positions.__iadd__(1))
    with pytest.raises(replay.TraceError, match="`trace.positions`"):
        replay.validate_trace(trace)


def test_unresolved_mask_is_refused(valid_trace):
    slot = first_completion_slot(valid_trace)
    mask_id = valid_trace.settings.mask_id
    trace = edited(valid_trace, "tokens", lambda tokens: tokens.__setitem__((0, slot), mask_id))
    with pytest.raises(replay.TraceError, match="`trace.tokens`.*mask id"):
        replay.validate_trace(trace)


def test_non_finite_log_probs_are_refused(valid_trace):
    slot = first_completion_slot(valid_trace)
    trace = edited(valid_trace, "action_logps", lambda lp: lp.__setitem__((0, slot), np.nan))
    with pytest.raises(replay.TraceError, match="`trace.action_logps`"):
        replay.validate_trace(trace)


def test_action_steps_that_do_not_match_the_completion_are_refused(valid_trace):
    slot = first_completion_slot(valid_trace)
    trace = edited(valid_trace, "action_steps", lambda steps: steps.__setitem__((0, slot), -1))
    with pytest.raises(replay.TraceError, match="`trace.action_steps`"):
        replay.validate_trace(trace)
    trace = edited(valid_trace, "action_steps", lambda steps: steps.__setitem__((0, slot), 50))
    with pytest.raises(replay.TraceError, match="`trace.action_steps`"):
        replay.validate_trace(trace)


def test_blocks_committed_out_of_order_are_refused(valid_trace):
    """A real trace with its first two blocks' step numbers swapped: every other check still
    holds, but replay would score the later block against a clean earlier block that the
    rollout had not committed yet."""
    steps = np.asarray(valid_trace.action_steps)
    window = np.arange(steps.shape[1]) // valid_trace.block_size
    row = next(r for r in range(len(steps)) if len(np.unique(window[steps[r] >= 0])) >= 2)
    first, second = np.unique(window[steps[row] >= 0])[:2]
    in_first = (steps[row] >= 0) & (window == first)
    in_second = (steps[row] >= 0) & (window == second)
    n_first = len(np.unique(steps[row][in_first]))
    n_second = len(np.unique(steps[row][in_second]))

    def swap(array):  # the same steps 0..S-1, each inside one block; the blocks reversed
        array[row, in_second] -= n_first
        array[row, in_first] += n_second

    trace = edited(valid_trace, "action_steps", swap)
    with pytest.raises(
        replay.TraceError,
        match=rf"^`trace.action_steps` must commit blocks in order.*\(row {row}\); got step",
    ):
        replay.validate_trace(trace)


def test_nan_parameters_give_a_trace_that_is_refused(student, tokenizer, prompts):
    broken = nnx.clone(student)
    broken.final_norm.scale[...] = broken.final_norm.scale[...] * jnp.nan
    trace = make_trace(broken, tokenizer, prompts, "same_position", "all_masked", False)
    with pytest.raises(replay.TraceError, match="`trace.action_logps`|`trace.tokens`"):
        replay.validate_trace(trace)


def test_chunks_per_forward_must_divide_the_chunk_count(student, valid_trace):
    with pytest.raises(ValueError, match="`chunks_per_forward`"):
        replay.replay_packed(student, valid_trace, num_chunks=8, chunks_per_forward=3)


def test_heterogeneous_completion_lengths_replay_exactly(student, tokenizer, prompts):
    config = RolloutConfig(max_completion_length=COMPLETION, threshold=0.08, stop_when_done=False)
    settings = SamplingSettings.from_config(config, tokenizer.special)
    lengths = [3, COMPLETION, 7, 1]
    trace = rollout(student, prompts, settings, seed=2, global_step=0, completion_lengths=lengths)
    replay.validate_trace(trace)
    assert np.asarray(trace.completion_mask).sum(axis=1).tolist() == lengths
    n = replay.num_steps_bucket(trace)
    np.testing.assert_allclose(packed(student, trace, n), trace.action_logps, atol=1e-5)


@functools.partial(nnx.jit, static_argnames=("num_chunks",))
def completion_views(model, trace, ids, num_chunks):
    return replay.replay_completion(
        model, trace, num_chunks=num_chunks, distributions=True, gather_ids=ids
    )


def test_completion_replay_distributions_and_gathered_ids_agree_with_the_actions(
    student, stochastic_case, tokenizer
):
    trace = stochastic_case
    vocab, mask_id = tokenizer.vocab_size, trace.settings.mask_id
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=(*trace.tokens.shape, 5)).astype(np.int32)
    ids[..., 0] = mask_id  # the student never samples the mask: -inf there
    views = completion_views(student, trace, jnp.asarray(ids), replay.num_steps_bucket(trace))
    present = np.asarray(views.present)
    full = np.asarray(views.log_probs)
    actions = np.take_along_axis(np.asarray(trace.tokens), np.asarray(views.slots), axis=1)
    at_actions = np.take_along_axis(full, actions[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(at_actions[present], np.asarray(views.logps)[present], atol=1e-5)
    at_ids = np.take_along_axis(ids, np.asarray(views.slots)[..., None], axis=1)
    gathered = np.asarray(views.gathered_logps)
    np.testing.assert_allclose(
        gathered[present][:, 1:],
        np.take_along_axis(full, at_ids, axis=-1)[present][:, 1:],
        atol=1e-5,
    )
    assert np.all(gathered[present][:, 0] == -np.inf)


def test_a_step_count_below_the_traces_is_refused_naming_the_needed_count(student, valid_trace):
    needed = int(np.asarray(valid_trace.action_steps).max()) + 1
    assert needed >= 2
    short = needed - 1
    with pytest.raises(ValueError, match=rf"^`num_steps` must be >= {needed}, .*; received"):
        replay.replay_per_step(student, valid_trace, num_steps=short)
    with pytest.raises(ValueError, match=rf"^`num_chunks` must be >= {needed}, .*; received"):
        replay.replay_packed(student, valid_trace, num_chunks=short)
    with pytest.raises(ValueError, match=rf"^`num_chunks` must be >= {needed}, .*; received"):
        replay.replay_completion(student, valid_trace, num_chunks=short)


def test_under_jit_uncovered_steps_replay_as_nan_in_both_paths(student, valid_trace):
    """Traced, the trace's steps cannot be checked; the actions a short count misses come
    out NaN (a non-finite loss downstream), never 0 or another step's value."""
    steps = np.asarray(valid_trace.action_steps)
    short = int(steps.max())  # one step short
    uncovered = np.asarray(valid_trace.completion_mask) & (steps >= short)
    exact = np.asarray(valid_trace.action_logps)
    for logps in (per_step(student, valid_trace, short), packed(student, valid_trace, short)):
        logps = np.asarray(logps)
        assert np.isnan(logps[uncovered]).all()
        np.testing.assert_allclose(logps[~uncovered], exact[~uncovered], atol=1e-5, rtol=0)
