"""The OPD regression guard: it trips only when the window's mean teacher log-prob falls
more than the allowed drop below the first step's, names the steps and the setting, stops
the learner before the update is saved, and keeps its start across a resume."""

import pytest

from distill import pipeline
from distill.config import ConfigError, GuardConfig
from distill.opd.guard import PolicyRegression, TeacherLogpGuard
from distill.opd.learner import OpdLearner
from distill.teacher import InProcessTeacher
from tests.support.fakes import ScriptedTeacher, tiny_job, tiny_models


def test_the_guard_trips_on_the_window_mean_not_on_one_noisy_step():
    guard = TeacherLogpGuard(GuardConfig(max_teacher_logp_drop=0.5, window=3))
    for step, value in enumerate([-0.1, -0.9, -0.1, -0.2, -0.1]):
        guard.observe(step, value)  # one bad step in a window of 3 stays within 0.5
    guard.observe(5, -0.8)
    with pytest.raises(
        PolicyRegression,
        match=r"`metrics.teacher_logp` must stay within guard.max_teacher_logp_drop=0.5 nats "
        r"of its start -0.1000 .* mean of -0.7000 over steps 4-6",
    ):
        guard.observe(6, -1.2)


def test_a_rising_teacher_logp_never_trips_and_no_limit_only_records_the_start():
    guard = TeacherLogpGuard(GuardConfig(max_teacher_logp_drop=0.1, window=2))
    off = TeacherLogpGuard(GuardConfig(window=2))
    for step in range(20):
        guard.observe(step, -2.0 + 0.1 * step)
        off.observe(step, -0.1 - step)
    assert (guard.start, off.start) == (-2.0, -0.1)


def test_guard_settings_and_observations_are_validated_by_name():
    with pytest.raises(ConfigError, match=r"`guard.max_teacher_logp_drop` must be greater"):
        GuardConfig(max_teacher_logp_drop=0.0)
    with pytest.raises(ConfigError, match=r"`guard.window` must be greater than 0"):
        GuardConfig(window=0)
    with pytest.raises(ValueError, match=r"`start` must be a finite log-prob"):
        TeacherLogpGuard(GuardConfig(), start=float("nan"))
    with pytest.raises(ValueError, match=r"`metrics.teacher_logp` must be finite.*step 3"):
        TeacherLogpGuard(GuardConfig()).observe(3, float("-inf"))


def drifting_learner(run_dir, *overrides, drift=1.0):
    """A tiny learner whose teacher scores every call ``drift`` nats lower than the last:
    the teacher's log-prob of the rollouts falls by ``drift`` per step."""
    job = tiny_job("opd.steps=8", "opd.checkpoint_every=1", *overrides)
    teacher_model, student = tiny_models(job)
    tokenizer = pipeline.job_tokenizer(job)
    teacher = ScriptedTeacher(InProcessTeacher(teacher_model, tokenizer), drift=drift)
    return OpdLearner(job, student, teacher, tokenizer, run_dir=run_dir, log=lambda _: None)


def test_a_falling_teacher_logp_stops_the_learner_before_the_update_is_saved(tmp_path):
    learner = drifting_learner(tmp_path, "guard.max_teacher_logp_drop=1.0", "guard.window=2")
    start = None
    # Window means fall ~0.5 (steps 0-1), then ~1.5 (steps 1-2) below the start.
    with pytest.raises(PolicyRegression, match=r"over steps 1-2\. .* saving step 2's update"):
        for _ in range(8):
            metrics = learner.train(learner.roll_out())
            start = metrics["teacher_logp"] if start is None else start
    # Steps 0 and 1 trained and saved; step 2's update is neither counted nor checkpointed.
    assert learner.step == 2 and learner.checkpointer.steps[-1] == 2
    assert learner.guard.start == pytest.approx(start)
    learner.close()


def test_a_resumed_learner_keeps_the_first_steps_start(tmp_path):
    learner = drifting_learner(tmp_path, drift=0.0)
    first = learner.train(learner.roll_out())["teacher_logp"]
    learner.train(learner.roll_out())
    learner.close()
    resumed = drifting_learner(tmp_path, "guard.max_teacher_logp_drop=1.0", drift=0.0)
    assert resumed.step == 2 and resumed.guard.start == pytest.approx(first)
    resumed.close()
