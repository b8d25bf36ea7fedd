"""Faults injected into a running distributed job (embedded Ray on loopback, tiny models),
and the fault handling underneath them.

Slow (each a whole job, about a minute on two cores):

- a rollout worker SIGKILLed while it holds a shard: Ray restarts it, the learner hands
  its shard out again at once, the job finishes;
- the only teacher replica SIGKILLed while the learner waits on it: Ray restarts it on the
  same port, the learner's calls retry through the outage, the job finishes;
- the only teacher replica SIGKILLed with no restarts allowed: the job fails within a
  bounded time naming the replica;
- a teacher replica that hangs (SIGSTOP): the watchdog fails the job naming the stage;
- the learner SIGKILLed between two checkpoints: the job fails naming it, and a rerun of
  the same job resumes and finishes;
- the learner SIGKILLed half-way through publishing a version (held there by
  ``LearnerActor.hold_publication``): no worker saw the version, the job fails naming the
  learner and the checkpoint to resume from, and a rerun finishes.

In every finishing case the data ledger of the final checkpoint shows each sample trained
exactly once, the learner accepted each row once (nothing twice), and (for a teacher
outage) no finished rollout was dropped or generated again.

Also slow (a real learner in this process, no Ray): a rollout worker's push retried through
a learner outage longer than several retry intervals is delivered once, and a repeat of it
is refused. Fast: the watchdog's clock and message, and the scheduler handing out again the
shard of a worker that asks for work while holding one (it was restarted) or that the
driver saw gone for good. A preempted slice is in ``test_preemption.py``.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from services.jobs.driver import JobFailed, Watchdog
from services.learner.scheduler import Delivery, WorkKind, WorkScheduler
from tests.support.running_job import (
    BATCH,
    STEPS,
    WAIT_S,
    RunningJob,
    fresh_run,
    job_with,
    ledger,
    new_pid,
    rows_per_step,
    signal_pid,
)

# ---- fast: the watchdog and the scheduler ---------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_watchdog_fails_naming_the_stage_once_no_step_completes_in_time():
    clock = FakeClock()
    watchdog = Watchdog(60.0, 3, clock=clock)
    teacher = {"step": 3, "stage": "teacher", "stage_detail": "step 3 waits for the teacher"}
    clock.now = 59.0
    watchdog.observe(teacher)
    clock.now = 100.0
    watchdog.observe({**teacher, "step": 4})  # a step completed: the clock starts again
    clock.now = 160.0
    watchdog.observe({**teacher, "step": 4})
    clock.now = 161.0
    with pytest.raises(JobFailed) as caught:
        watchdog.observe({**teacher, "step": 4})
    assert str(caught.value) == (
        "`watchdog`: no step completed in 60 s (cluster.watchdog_s; the last completed step "
        "is 4); stalled in teacher: step 3 waits for the teacher"
    )


def test_a_silent_learner_is_the_stalled_stage_and_no_limit_never_fires():
    clock = FakeClock()
    watchdog = Watchdog(10.0, 0, clock=clock)
    watchdog.observe({"step": 0, "stage": "rollout", "stage_detail": "waiting"})
    clock.now = 11.0
    with pytest.raises(JobFailed, match="stalled in learner: the learner did not answer"):
        watchdog.observe(None)
    unlimited = Watchdog(None, 0, clock=clock)
    clock.now = 1e9
    unlimited.observe(None)


def batch_of(assignment):
    """A delivery of ``assignment``'s rows (only the fields the scheduler reads)."""
    shard = assignment.shard

    class Rows:
        step = shard.step
        policy_version = assignment.policy_version
        row_ids = np.arange(shard.row_start, shard.row_start + shard.row_count)

    return Rows()


def test_a_worker_asking_again_while_holding_a_shard_gets_it_back_at_once():
    # A restarted worker (same id) asks for work: the shard its dead process held is
    # handed out again without waiting for reassign_after_s, and trains once.
    work = WorkScheduler(
        start_step=0,
        end_step=2,
        rows_per_step=4,
        shards_per_step=2,
        max_staleness=0,
        stream_positions=lambda step: range(step * 4, step * 4 + 4),
        reassign_after_s=3600.0,
    )
    lost = work.acquire(worker_id="rollout-0")
    other = work.acquire(worker_id="rollout-1")
    assert work.holders() == {
        "rollout-0": [(0, 0, 2)],
        "rollout-1": [(0, 2, 2)],
    }
    again = work.acquire(worker_id="rollout-0")
    assert again.kind is WorkKind.WORK and again.shard == lost.shard
    assert work.counts.released_shards == 1 and work.counts.reassigned_shards == 0
    assert work.deliver(batch_of(again)) is Delivery.ACCEPTED
    assert work.deliver(batch_of(lost)) is Delivery.REFUSED  # the same rows once only
    assert work.deliver(batch_of(other)) is Delivery.ACCEPTED
    assert len(work.wait_step(0, timeout_s=1.0)) == 2 and work.missing(0) == []
    assert work.holders() == {} and work.counts.accepted_rows == 4


def test_a_worker_gone_for_good_has_its_shard_handed_out_at_once_and_trained_once():
    # The driver saw the worker's actor die for good (its slice was preempted).
    work = WorkScheduler(
        start_step=0,
        end_step=1,
        rows_per_step=4,
        shards_per_step=2,
        max_staleness=0,
        stream_positions=lambda step: range(step * 4, step * 4 + 4),
        reassign_after_s=3600.0,
    )
    lost = work.acquire(worker_id="rollout-1")
    survivor = work.acquire(worker_id="rollout-0")
    assert work.release("rollout-1") == 1 and work.release("rollout-1") == 0
    assert work.holders() == {"rollout-0": [(0, 2, 2)]}
    # Its process, not dead yet, asking again: no more work for it (DONE), none held.
    assert work.acquire(worker_id="rollout-1").kind is WorkKind.DONE
    assert work.holders() == {"rollout-0": [(0, 2, 2)]}
    assert work.deliver(batch_of(survivor)) is Delivery.ACCEPTED
    again = work.acquire(worker_id="rollout-0")
    assert again.kind is WorkKind.WORK and again.shard == lost.shard
    # The same rows twice (a late push of the lost worker's, identical): kept once.
    assert work.deliver(batch_of(again)) is Delivery.ACCEPTED
    assert work.deliver(batch_of(lost)) is Delivery.REFUSED
    assert work.missing(0) == [] and work.counts.accepted_rows == 4
    with pytest.raises(ValueError, match="`worker_id` must be a non-empty worker id"):
        work.release("")


# ---- a rollout worker's calls to a learner that is briefly away -----------------------------


@pytest.fixture(scope="module")
def learner_service():
    """A real learner runtime (tiny models, in this process) serving on loopback; not
    training, so what a push delivers stays in its scheduler's counts."""
    from distill import pipeline
    from distill.opd.learner import OpdLearner
    from distill.teacher import InProcessTeacher
    from services.learner.service import LearnerRuntime
    from tests.support.fakes import tiny_job, tiny_models

    job = tiny_job("opd.steps=2", "loss.max_staleness=0")
    teacher_model, student = tiny_models(job)
    tokenizer = pipeline.job_tokenizer(job)
    learner = OpdLearner(
        job, student, InProcessTeacher(teacher_model, tokenizer), tokenizer, log=lambda _: None
    )
    published = {}
    runtime = LearnerRuntime(
        learner,
        shards_per_step=2,
        publish=lambda version, weights: published.__setitem__(version, weights),
        step_timeout_s=120,
    )
    address = runtime.start()
    yield job, runtime, published, address
    runtime.stop(grace_s=1)


def serve_learner_again(runtime, address: str) -> None:
    """The learner's service back on ``address`` (a new server, as after a restart)."""
    from services.common.config import ServerConfig
    from services.common.server import start_server
    from services.learner.service import SERVICE_NAME, LearnerServicer
    from services.proto import learner_pb2_grpc

    servicer = LearnerServicer(runtime)
    runtime._server = start_server(
        ServerConfig(address=address),
        lambda server: learner_pb2_grpc.add_LearnerServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )


@pytest.mark.slow
def test_a_push_retried_through_a_learner_outage_is_delivered_once_and_a_repeat_is_refused(
    learner_service,
):
    from services.common.config import RetryPolicy
    from services.proto import learner_pb2
    from services.rollout.worker import LearnerCallError, RolloutWorker

    job, runtime, published, address = learner_service
    policy = RetryPolicy(backoff_s=0.1, max_backoff_s=0.4, budget_s=60)

    def worker(worker_id: str, retry_policy: RetryPolicy) -> RolloutWorker:
        return RolloutWorker(
            job,
            worker_id=worker_id,
            learner_address=address,
            fetch_weights=published.__getitem__,
            call_timeout_s=30,
            retry_policy=retry_policy,
        )

    patient, hasty = worker("w0", policy), worker("w1", RetryPolicy(budget_s=0.5))
    try:
        work = patient.acquire()
        assert work.kind == learner_pb2.WorkAssignment.WORK
        rows = patient.trace_rows(work)  # a finished rollout, not yet delivered
        runtime._server.stop(0)  # the learner goes away (as while it restarts)
        # A budget shorter than the outage gives up, naming the call and the address.
        with pytest.raises(LearnerCallError) as gave_up:
            hasty.push(rows)
        message = str(gave_up.value)
        assert message.startswith(f"learner call PushTraces to {address} failed: UNAVAILABLE")
        assert "retry budget spent (budget_s=0.5)" in message
        # Away for several retry intervals, then back on the same address.
        back = threading.Event()

        def come_back():
            serve_learner_again(runtime, address)
            back.set()

        timer = threading.Timer(8 * policy.max_backoff_s, come_back)
        timer.start()
        try:
            summary = patient.push(rows)
        finally:
            timer.join(WAIT_S)
        assert back.is_set()  # delivered by a retry, after the outage
        assert (summary.accepted, summary.refused) == (len(rows), 0)
        counts = runtime.scheduler.counts
        assert counts.accepted_rows == len(rows)
        assert runtime.scheduler.missing(work.step) == [
            (start, count) for start, count in runtime.scheduler.bounds if start != work.row_start
        ]
        # A retry of a push the learner already took (its answer lost) counts nothing twice.
        again = patient.push(rows)
        assert (again.accepted, again.refused) == (0, len(rows))
        assert counts.accepted_rows == len(rows) and counts.refused_rows == len(rows)
        assert patient.rows_pushed == len(rows)
    finally:
        patient.close()
        hasty.close()


# ---- slow: a running job --------------------------------------------------------------------


@pytest.mark.slow
def test_a_rollout_worker_killed_mid_rollout_is_restarted_and_every_sample_trains_once(
    phases, ray_session, tmp_path
):
    job = job_with()
    running = RunningJob(job, fresh_run(phases, tmp_path / "run"))
    pid = running.call("rollout-0", "pid", "the rollout worker's pid")
    running.wait_status(lambda s: s["step"] >= 1, "step 1 to train")
    # Freeze the worker; kill it once it holds a shard (between AcquireWork and the end of
    # its PushTraces: mid-rollout), else let it go on and try again.
    deadline = time.monotonic() + WAIT_S
    while True:
        signal_pid(pid, signal.SIGSTOP)
        if "rollout-0" in running.status()["assigned"]:
            signal_pid(pid, signal.SIGKILL)
            break
        signal_pid(pid, signal.SIGCONT)
        assert time.monotonic() < deadline, "timed out waiting for rollout-0 to hold a shard"
        time.sleep(0.05)
    _, restart_s = new_pid(running, "rollout-0", pid)
    result, error = running.finish()
    assert error is None, error
    status = result.status
    assert status["step"] == STEPS and status["error"] == ""
    # Not asserted: released_shards >= 1. The worker may have finished pushing its shard
    # between the status read and the SIGSTOP (the learner then has nothing to release);
    # what must hold either way is below.
    assert status["accepted_rows"] == STEPS * rows_per_step(job)  # none accepted twice
    assert ledger(running.run) == [[0, STEPS * BATCH]]
    print(f"rollout worker restarted in {restart_s:.1f} s")


@pytest.mark.slow
def test_the_only_teacher_replica_killed_mid_request_comes_back_and_nothing_is_lost(
    phases, ray_session, tmp_path
):
    job = job_with()
    running = RunningJob(job, fresh_run(phases, tmp_path / "run"))
    pid = running.call("teacher-0", "pid", "the teacher replica's pid")
    running.wait_status(lambda s: s["step"] >= 1, "step 1 to train")
    # Freeze the replica; once the learner waits on it (a request in flight), kill it.
    signal_pid(pid, signal.SIGSTOP)
    try:
        running.wait_status(lambda s: s["stage"] == "teacher", "a teacher call in flight")
    finally:
        signal_pid(pid, signal.SIGKILL)
    _, restart_s = new_pid(running, "teacher-0", pid)
    result, error = running.finish()
    assert error is None, error
    status = result.status
    assert status["step"] == STEPS and status["error"] == ""
    # The outage discarded no finished rollout and made none again.
    assert status["dropped_stale_rows"] == status["refused_rows"] == 0
    assert status["released_shards"] == status["reassigned_shards"] == 0
    assert status["accepted_rows"] == STEPS * rows_per_step(job)
    assert ledger(running.run) == [[0, STEPS * BATCH]]
    assert max(m["teacher_seconds"] for m in result.history) >= 1.0  # waited out the restart
    print(f"teacher replica restarted in {restart_s:.1f} s")


@pytest.mark.slow
def test_a_teacher_replica_gone_for_good_fails_the_job_naming_it(phases, ray_session, tmp_path):
    running = RunningJob(
        job_with("cluster.teacher.max_restarts=0"), fresh_run(phases, tmp_path / "run")
    )
    pid = running.call("teacher-0", "pid", "the teacher replica's pid")
    running.wait_status(lambda s: s["step"] >= 1, "step 1 to train")
    signal_pid(pid, signal.SIGKILL)
    killed = time.monotonic()
    _, error = running.finish("the job to fail")
    assert isinstance(error, JobFailed), error
    assert str(error).startswith("teacher replica 0 failed: ")
    assert time.monotonic() - killed < 60.0  # bounded: the driver watches the replica


@pytest.mark.slow
def test_a_hung_teacher_trips_the_watchdog_naming_the_stage(phases, ray_session, tmp_path):
    # The limit must exceed the first step (evaluation and compiles: 20-40 s on an idle
    # 2-core machine, over 60 s when it is shared).
    limit_s = 90
    running = RunningJob(
        job_with(f"cluster.watchdog_s={limit_s}", "cluster.teacher_timeout_s=600"),
        fresh_run(phases, tmp_path / "run"),
    )
    pid = running.call("teacher-0", "pid", "the teacher replica's pid")
    running.wait_status(lambda s: s["step"] >= 1, "step 1 to train")
    signal_pid(pid, signal.SIGSTOP)  # alive, connected, never answering
    try:
        _, error = running.finish("the watchdog to fail the job")
    finally:
        signal_pid(pid, signal.SIGKILL)
    assert isinstance(error, JobFailed), error
    message = str(error)
    assert message.startswith(f"`watchdog`: no step completed in {limit_s} s (cluster.watchdog_s;")
    assert "stalled in teacher: step " in message and "waits for the teacher" in message


@pytest.mark.slow
def test_the_learner_killed_between_checkpoints_fails_naming_it_and_a_rerun_trains_each_sample_once(
    phases, ray_session, tmp_path
):
    job = job_with()
    run = fresh_run(phases, tmp_path / "run")
    running = RunningJob(job, run)
    pid = running.call("learner", "pid", "the learner's pid")
    running.wait_status(lambda s: s["step"] >= 3, "step 3 to train (after checkpoint 2)")
    signal_pid(pid, signal.SIGKILL)
    _, error = running.finish("the job to fail")
    assert isinstance(error, JobFailed) and str(error).startswith("the learner failed: "), error
    checkpoints = {int(p.name) for p in (run / "opd" / "checkpoints").iterdir() if p.name.isdigit()}
    assert 2 in checkpoints and STEPS not in checkpoints
    rerun = RunningJob(job, run)
    result, error = rerun.finish("the rerun to finish")
    assert error is None, error
    assert result.status["step"] == STEPS
    assert ledger(run) == [[0, STEPS * BATCH]]


def checkpoint_steps(run: Path) -> set[int]:
    return {int(p.name) for p in (run / "opd" / "checkpoints").iterdir() if p.name.isdigit()}


@pytest.mark.slow
def test_the_learner_killed_while_publishing_weights_shows_no_half_version_and_a_rerun_trains_each_sample_once(
    phases, ray_session, tmp_path
):
    import ray

    job = job_with()
    run = fresh_run(phases, tmp_path / "run")
    running = RunningJob(job, run)
    learner = running.actor("learner")
    held = 4  # the version published right after checkpoint 4 is written
    ray.get(learner.hold_publication.remote(held), timeout=WAIT_S)
    pid = running.call("learner", "pid", "the learner's pid")
    deadline = time.monotonic() + WAIT_S
    while not running.call("learner", "publication_held", f"the publication of {held} held"):
        running.check_running(f"the learner to be publishing version {held}")
        assert time.monotonic() < deadline, f"timed out waiting for the publication of {held}"
        time.sleep(0.1)
    # Half-way: the weights are in the object store, but no worker can see the version...
    with pytest.raises(TimeoutError, match=f"weights of policy version {held} were not published"):
        ray.get(learner.weights.remote(held, 0.5), timeout=WAIT_S)
    # ...nor is any shard rolled out with it handed out.
    status = running.status()
    staleness = job.loss.max_staleness
    held_steps = [step for shards in status["assigned"].values() for step, _, _ in shards]
    assert all(step - staleness < held for step in held_steps), status["assigned"]
    assert status["accepted_rows"] <= (held + staleness) * rows_per_step(job)
    signal_pid(pid, signal.SIGKILL)
    _, error = running.finish("the job to fail")
    assert isinstance(error, JobFailed), error
    message = str(error)
    assert message.startswith("the learner failed: ") and "rerun the same command" in message
    newest = max(checkpoint_steps(run))
    assert newest <= held and f"resume from its newest checkpoint (step {newest})" in message
    rerun = RunningJob(job, run)
    result, error = rerun.finish("the rerun to finish")
    assert error is None, error
    assert result.status["step"] == STEPS
    assert len(result.history) == STEPS - newest  # resumed at the newest checkpoint
    # Every step after it rolled out and trained once; the ledger shows each sample once.
    assert result.status["accepted_rows"] == (STEPS - newest) * rows_per_step(job)
    assert ledger(run) == [[0, STEPS * BATCH]]
