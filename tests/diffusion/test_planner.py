"""The commit planner: sampled, forced-progress commit decisions recorded in the trace and
replayed exactly (per step and packed) under live, old and reference parameters."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distill.config import ConfigError, ModelConfig, RolloutConfig
from distill.diffusion import replay
from distill.diffusion.denoise import SamplingSettings, rollout
from distill.models.transformer import Transformer
from tests.diffusion.conftest import COMPLETION

CONTRACTS = [("same_position", "all_masked"), ("shifted", "seed_and_mask")]


def planner_student(student, scale=2.0, bias=0.0, seed=1):
    """The shared tiny student with a planner head whose logits vary by slot."""
    config = ModelConfig(**{**student.config.model_dump(), "planner_hidden": 16})
    model = Transformer(config, rngs=nnx.Rngs(0))
    kernel = model.planner.out.kernel
    kernel[...] = scale * jax.random.normal(jax.random.key(seed), kernel.shape)
    model.planner.out.bias[...] = jnp.full(model.planner.out.bias.shape, bias)
    return model


def settings_for(tokenizer, alignment, canvas):
    config = RolloutConfig(
        max_completion_length=COMPLETION,
        alignment=alignment,
        canvas=canvas,
        commit_rule="planner",
        temperature=0.8,
    )
    return SamplingSettings.from_config(config, tokenizer.special)


@functools.partial(nnx.jit, static_argnames=("num_steps",))
def per_step(model, trace, num_steps):
    return replay.replay_decisions_per_step(model, trace, num_steps=num_steps)


@functools.partial(nnx.jit, static_argnames=("num_chunks", "dense", "chunks_per_forward"))
def packed(model, trace, num_chunks, dense=False, chunks_per_forward=None):
    return replay.replay_decisions_packed(
        model, trace, num_chunks=num_chunks, dense=dense, chunks_per_forward=chunks_per_forward
    )


@functools.partial(nnx.jit, static_argnames=("num_steps",))
def token_logps_per_step(model, trace, num_steps):
    return replay.replay_per_step(model, trace, num_steps=num_steps)


@functools.partial(nnx.jit, static_argnames=("num_chunks",))
def token_logps_packed(model, trace, num_chunks):
    return replay.replay_packed(model, trace, num_chunks=num_chunks)


@pytest.fixture(scope="module")
def planner(student):
    return planner_student(student)


@pytest.fixture(scope="module", params=CONTRACTS, ids=["same_position", "shifted"])
def case(request, planner, tokenizer, prompts):
    trace = rollout(
        planner, prompts, settings_for(tokenizer, *request.param), seed=0, global_step=0
    )
    replay.validate_trace(trace, tokenizer.vocab_size)
    return trace


def test_a_student_without_a_planner_has_exactly_the_old_parameters(student):
    config = ModelConfig(**{**student.config.model_dump(), "planner_hidden": 16})
    with_planner = nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param))
    without = nnx.to_pure_dict(nnx.state(student, nnx.Param))
    assert set(with_planner) - set(without) == {"planner"}
    trunk = {key: value for key, value in with_planner.items() if key != "planner"}
    assert jax.tree.structure(trunk) == jax.tree.structure(without)
    for a, b in zip(jax.tree.leaves(trunk), jax.tree.leaves(without), strict=True):
        np.testing.assert_array_equal(a, b)


def test_planner_rollout_records_every_draw(case):
    steps = np.asarray(case.action_steps)
    completion = np.asarray(case.completion_mask)
    drawn, committed = (np.asarray(a) for a in replay.decision_layout(case))
    decisions = np.asarray(case.decision_logps)
    assert (decisions[drawn] < 0).all() and (decisions[~drawn] == 0).all()
    # Each step draws, commits at least one slot, and costs exactly one forward.
    used = [len(np.unique(steps[row][completion[row]])) for row in range(len(steps))]
    np.testing.assert_array_equal(np.asarray(case.forwards), used)
    # Some steps commit several slots and some slots wait: the draws are exercised.
    assert 1.0 < case.tokens_per_forward() < COMPLETION
    assert (drawn & ~committed).any()


def test_forced_commits_happen_only_when_no_draw_commits(case):
    steps = np.asarray(case.action_steps)
    forced = np.asarray(case.forced)
    _, committed = (np.asarray(a) for a in replay.decision_layout(case))
    step_of = np.asarray(replay.decision_steps(case))
    for row, slot in zip(*np.nonzero(forced), strict=True):
        step = steps[row, slot]
        assert (steps[row] == step).sum() == 1  # a forced commit is alone in its step
        assert not committed[row][step_of[row] == step].any()  # and no draw committed there


@pytest.mark.parametrize("bias, forced_all", [(-40.0, True), (40.0, False)])
def test_forced_progress_bounds_the_planner(student, tokenizer, prompts, bias, forced_all):
    """A planner that never draws a commit still finishes (one forced slot per step); one
    that always commits takes each block in one step (an anchor step under shifted)."""
    model = planner_student(student, scale=0.0, bias=bias)
    settings = settings_for(tokenizer, "same_position", "all_masked")
    trace = rollout(model, prompts, settings, seed=1, global_step=0)
    replay.validate_trace(trace, tokenizer.vocab_size)
    completion = np.asarray(trace.completion_mask)
    forced = np.asarray(trace.forced)
    if forced_all:
        np.testing.assert_array_equal(forced, completion)
        assert trace.tokens_per_forward() == 1.0
    else:
        assert not forced.any()
        steps = np.asarray(trace.action_steps)
        windows = np.arange(steps.shape[1]) // trace.block_size
        for row in range(len(steps)):
            assert len(np.unique(steps[row][completion[row]])) == len(
                np.unique(windows[completion[row]])
            )


@pytest.mark.parametrize("path", ["per_step", "dense", "block_sparse", "grouped"])
def test_replay_reproduces_the_decision_log_probs(planner, case, path):
    n = replay.num_steps_bucket(case)
    if path == "per_step":
        logps = per_step(planner, case, n)
    else:
        logps = packed(
            planner,
            case,
            n,
            dense=path == "dense",
            chunks_per_forward=n // 2 if path == "grouped" else None,
        )
    np.testing.assert_allclose(logps, case.decision_logps, atol=1e-5, rtol=0)


def test_replay_under_other_parameters_agrees_across_paths(planner, case):
    """Old and reference parameters: every path gives the same (different) log-probs."""
    n = replay.num_steps_bucket(case)
    for changed in ("planner", "trunk"):
        other = nnx.clone(planner)
        if changed == "planner":
            other.planner.out.bias[...] = other.planner.out.bias[...] + 0.7
        else:
            kernel = other.layers[0].mlp.up_proj.kernel
            kernel[...] = kernel[...] * 3.0
        reference = per_step(other, case, n)
        assert np.abs(np.asarray(reference - case.decision_logps)).max() > 1e-3
        np.testing.assert_allclose(packed(other, case, n), reference, atol=1e-5, rtol=0)
        np.testing.assert_allclose(packed(other, case, n, dense=True), reference, atol=1e-5)
        np.testing.assert_allclose(
            token_logps_packed(other, case, n),
            token_logps_per_step(other, case, n),
            atol=1e-5,
            rtol=0,
        )


def test_gradient_of_the_decisions_reaches_planner_and_trunk(planner, case):
    n = replay.num_steps_bucket(case)

    def total(model):
        return jnp.sum(replay.replay_decisions_packed(model, case, num_chunks=n))

    grads = nnx.jit(nnx.grad(total))(planner)
    for module in (grads.planner, grads.layers[1]):
        leaves = jax.tree.leaves(nnx.state(module))
        assert all(bool(jnp.isfinite(leaf).all()) for leaf in leaves)
        assert sum(float(jnp.abs(leaf).sum()) for leaf in leaves) > 0


def test_same_seed_gives_the_same_planner_trace(planner, tokenizer, prompts, case):
    again = rollout(planner, prompts, case.settings, seed=0, global_step=0)
    for field in ("tokens", "action_steps", "decision_logps", "forced"):
        np.testing.assert_array_equal(getattr(again, field), getattr(case, field))


def test_planner_rule_needs_a_planner_head(student, tokenizer, prompts):
    settings = settings_for(tokenizer, "same_position", "all_masked")
    with pytest.raises(ValueError, match="`model.config.planner_hidden` must be set"):
        rollout(student, prompts, settings, seed=0, global_step=0)
    with pytest.raises(ConfigError, match="`model.planner_hidden` must be None"):
        ModelConfig(vocab_size=8, attention_type="causal", planner_hidden=4)


def test_edited_decisions_are_refused(case):
    drawn, _ = replay.decision_layout(case)
    outside = np.argwhere(~np.asarray(drawn))[0]
    decisions = np.array(case.decision_logps)
    decisions[tuple(outside)] = -0.5
    bad = dataclasses.replace(case, decision_logps=jnp.asarray(decisions))
    with pytest.raises(replay.TraceError, match="`trace.decision_logps` must be 0"):
        replay.validate_trace(bad)
    with pytest.raises(replay.TraceError, match="`trace.forced` must be given"):
        replay.validate_trace(dataclasses.replace(case, forced=None))
