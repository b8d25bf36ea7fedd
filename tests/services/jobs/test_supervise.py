"""The driver's supervision of a running job names the learner when the learner dies,
whichever of its calls notices first: its run, or the status call the driver polls between
looks at that run (a raw Ray error must never reach the user)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from services.jobs.driver import JobFailed, Watchdog, _supervise


def test_a_learner_that_dies_under_the_status_call_fails_the_job_naming_the_learner(
    ray_session,
):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class SlowRun:
        """Stands in for a learner's run that Ray has not yet reported failed."""

        def run(self):
            time.sleep(120)

    @ray.remote(num_cpus=0)
    class Learner:
        def status(self):
            return {"step": 0}

        def log_lines(self, start):
            return []

    slow, dead = SlowRun.remote(), Learner.remote()
    ray.get(dead.status.remote(), timeout=60)
    ray.kill(dead)
    learner = SimpleNamespace(run=slow.run, status=dead.status, log_lines=dead.log_lines)
    try:
        with pytest.raises(JobFailed, match="(?s)^the learner failed: .*Actor.*rerun the same"):
            _supervise(learner, {}, 4, 0, False, lambda line: None, Watchdog(None, 0))
    finally:
        ray.kill(slow)


def test_a_guard_trip_says_a_rerun_trips_again_and_what_to_change(tmp_path):
    from distill.opd.guard import PolicyRegression
    from services.jobs.driver import _learner_failed

    (tmp_path / "opd" / "checkpoints" / "40").mkdir(parents=True)
    raised = SimpleNamespace(cause=PolicyRegression("`metrics.teacher_logp` must stay ..."))
    message = str(_learner_failed(raised, tmp_path))
    assert message.startswith("the learner failed: PolicyRegression: `metrics.teacher_logp`")
    assert "from its newest checkpoint (step 40) and trips again" in message
    assert "lower opd.optimizer.learning_rate and use a new run directory" in message
    other = str(_learner_failed(RuntimeError("boom"), tmp_path))
    assert "rerun the same command with the same run directory to resume" in other
