"""The OPD learner's checks: staleness (drop beyond max_staleness, importance-correct and
clip within it), non-finite updates stop the job, traces that are not the step's rows are
refused, and a step's parts from several workers merge into the in-process batch."""

import dataclasses

import jax
import numpy as np
import pytest

from distill import pipeline
from distill.diffusion.replay import TraceError
from distill.opd.learner import NonFiniteError, OpdLearner, StaleRollout
from distill.opd.records import load_batch, merge_batches, save_batch
from distill.teacher import InProcessTeacher
from tests.support.fakes import tiny_job, tiny_models


def make_learner(*overrides):
    job = tiny_job(*overrides)
    teacher_model, student = tiny_models(job)
    tokenizer = pipeline.job_tokenizer(job)
    teacher = InProcessTeacher(teacher_model, tokenizer)
    return OpdLearner(job, student, teacher, tokenizer, log=lambda _: None)


def roll(learner, step, rows=None):
    """Rows of ``step`` rolled out with the live student (version = the learner's)."""
    live = learner.step
    learner.step = step  # roll_out rolls out the learner's next step
    try:
        batch = learner.roll_out(rows)
    finally:
        learner.step = live
    return dataclasses.replace(batch, policy_version=live)


@pytest.fixture(scope="module")
def stale_run():
    """A learner with max_staleness 1 and a tight PPO clip; the rollout of step 2 made with
    version 1 and one made with version 0 (kept from before those updates)."""
    learner = make_learner("loss.max_staleness=1", "loss.ppo_clip=0.0001", "opd.steps=6")
    old = roll(learner, 2)  # version 0
    learner.train(roll(learner, 0))
    one_old = roll(learner, 2)  # version 1
    learner.train(roll(learner, 1))
    return learner, old, one_old


def test_a_trace_two_versions_old_is_dropped(stale_run):
    learner, old, _ = stale_run
    assert (learner.step, old.policy_version) == (2, 0)
    with pytest.raises(
        StaleRollout, match=r"`trace.policy_version` must be within loss.max_staleness=1"
    ):
        learner.train(old)
    assert learner.step == 2


def test_a_trace_one_version_old_is_importance_corrected_and_clipped(stale_run):
    learner, _, one_old = stale_run
    metrics = learner.train(one_old)
    assert metrics["staleness"] == 1.0
    assert metrics["ratio"] != 1.0
    assert metrics["clip_fraction"] > 0.0


def test_on_policy_ratios_are_one_and_nothing_is_clipped():
    learner = make_learner("loss.ppo_clip=0.0001")
    metrics = learner.train(roll(learner, 0))
    assert metrics["staleness"] == 0.0
    assert abs(metrics["ratio"] - 1.0) < 1e-5 and metrics["clip_fraction"] == 0.0


def test_a_non_finite_update_stops_the_job_naming_step_and_metric():
    learner = make_learner()
    params = jax.tree.map(lambda x: x * np.nan, learner.weights())
    from distill.opd.learner import load_weights

    batch = roll(learner, 0)
    load_weights(learner.student, params)
    with pytest.raises(
        NonFiniteError, match=r"`metrics\.(loss|grad_norm|ratio)` must be finite.*step 0"
    ):
        learner.train(batch)
    assert learner.ledger == []


def test_a_trace_that_is_not_the_next_steps_rows_is_refused():
    learner = make_learner()
    with pytest.raises(ValueError, match="`trace.step` must be the learner's next step 0"):
        learner.train(roll(learner, 1))
    with pytest.raises(ValueError, match="`trace.row_ids` must be exactly rows"):
        learner.train(roll(learner, 0, rows=[0, 1]))
    batch = roll(learner, 0)
    tampered = dataclasses.replace(batch, stream_positions=batch.stream_positions + 1)
    with pytest.raises(ValueError, match="`trace.stream_positions` must be"):
        learner.train(tampered)
    other = dataclasses.replace(batch, settings=dataclasses.replace(batch.settings, threshold=0.5))
    with pytest.raises(TraceError, match="`trace.settings.threshold` must equal the learner's 0.9"):
        learner.train(other)


def test_parts_from_two_workers_merge_into_the_whole_batch(tmp_path):
    learner = make_learner()
    whole = roll(learner, 0)
    rows = learner.plan.rows_per_step
    second, first = (
        roll(learner, 0, list(range(rows // 2, rows))),
        roll(learner, 0, list(range(rows // 2))),
    )
    merged = merge_batches([second, first])
    np.testing.assert_array_equal(merged.row_ids, whole.row_ids)
    np.testing.assert_array_equal(merged.stream_positions, whole.stream_positions)
    for name in (
        "tokens",
        "action_steps",
        "positions",
        "segment_ids",
        "prompt_mask",
        "completion_mask",
    ):
        np.testing.assert_array_equal(merged.slots[name], whole.slots[name], err_msg=name)
    np.testing.assert_allclose(merged.slots["action_logps"], whole.slots["action_logps"], atol=1e-5)
    save_batch(merged, tmp_path / "batch.npz")
    loaded = load_batch(tmp_path / "batch.npz")
    assert loaded.settings == merged.settings and loaded.step == merged.step
    for name, array in merged.slots.items():
        np.testing.assert_array_equal(loaded.slots[name], array)
