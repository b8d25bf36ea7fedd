"""A distributed job of the tiny config run on a thread, with handles on its actors: shared
by the end-to-end fault, preemption and soak tests and the TPU placement job test.

The fixtures over it: ``phases`` in ``tests/e2e/conftest.py``, ``ray_session`` (an embedded
Ray per module) in ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

from distill.config import load_config
from services.common.config import JobSpec
from services.jobs.driver import actor_name
from tests.support.fakes import TINY_MODELS, TINY_PHASES

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
BATCH = 4
OVERRIDES = [
    *TINY_MODELS,
    *TINY_PHASES,
    f"data.batch_size={BATCH}",
    f"opd.steps={STEPS}",
    "opd.checkpoint_every=2",
    "cluster.rollout.count=2",
    "cluster.teacher.count=1",
    "cluster.step_timeout_s=300",
    # Generous on two shared cores: a restarted replica imports JAX and loads its teacher.
    "cluster.teacher_retry.budget_s=120",
]
#: Every bounded wait of these tests (each names what it waited for).
WAIT_S = 240.0


def job_with(*extra: str) -> JobSpec:
    return load_config(ROOT / "deploy/configs/tiny.yaml", JobSpec, [*OVERRIDES, *extra])


def train_phases(root: Path) -> Path:
    """Teacher training and student warm-up of :func:`job_with`'s job in ``root``."""
    from distill import pipeline

    job = job_with()
    pipeline.train_teacher(job, root / "teacher", progress=False, log=lambda _: None)
    pipeline.warmup_student(job, root / "student", progress=False, log=lambda _: None)
    return root


def fresh_run(phases: Path, path: Path) -> Path:
    for name in ("teacher", "student"):
        shutil.copytree(phases / name, path / name)
    return path


class RunningJob:
    """``run_job`` on a thread (``options``: further keywords of ``run_job``), with handles
    to reach its actors while it runs."""

    def __init__(self, job: JobSpec, run: Path, **options):
        from services.jobs.driver import run_job

        self.run = run
        self.result = None
        self.error: BaseException | None = None
        self.lines: list[str] = []  # what the driver logged

        def target():
            try:
                self.result = run_job(job, run, progress=False, log=self.lines.append, **options)
            except BaseException as error:
                self.error = error

        self.thread = threading.Thread(target=target, name="job")
        self.thread.start()

    def actor(self, role: str):
        """The actor ``role`` (e.g. ``rollout-0``), waiting until the job has placed it."""
        import ray

        deadline = time.monotonic() + WAIT_S
        while True:
            self.check_running(f"actor {role} to be placed")
            try:
                return ray.get_actor(actor_name(self.run, role))
            except ValueError:
                assert time.monotonic() < deadline, f"timed out waiting for actor {role}"
                time.sleep(0.2)

    def call(self, role: str, method: str, what: str):
        import ray

        try:
            return ray.get(getattr(self.actor(role), method).remote(), timeout=WAIT_S)
        except ray.exceptions.GetTimeoutError:
            raise AssertionError(f"timed out after {WAIT_S:.0f} s waiting for {what}") from None

    def status(self) -> dict:
        return self.call("learner", "status", "the learner's status")

    def wait_status(self, condition, what: str) -> dict:
        deadline = time.monotonic() + WAIT_S
        while True:
            self.check_running(what)
            status = self.status()
            if status and condition(status):
                return status
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {status}"
            time.sleep(0.05)

    def check_running(self, what: str) -> None:
        if not self.thread.is_alive():
            raise AssertionError(f"the job ended while waiting for {what}: {self.error!r}")

    def finish(self, what: str = "the job to finish"):
        self.thread.join(WAIT_S * 2)
        assert not self.thread.is_alive(), f"timed out waiting for {what}"
        return self.result, self.error


def new_pid(job: RunningJob, role: str, old: int) -> tuple[int, float]:
    """The pid of ``role`` once Ray has restarted it, and the seconds that took."""
    started = time.monotonic()
    deadline = started + WAIT_S
    while True:
        pid = job.call(role, "pid", f"{role} to answer")
        if pid != old:
            return pid, time.monotonic() - started
        assert time.monotonic() < deadline, f"timed out waiting for {role} to restart"
        time.sleep(0.2)


def signal_pid(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.kill(pid, signum)


def ledger(run: Path) -> list[list[int]]:
    """The data ledger of the newest OPD checkpoint."""
    steps = [int(p.name) for p in (run / "opd" / "checkpoints").iterdir() if p.name.isdigit()]
    metadata = run / "opd" / "checkpoints" / str(max(steps)) / "progress" / "metadata"
    progress = json.loads(metadata.read_text())
    assert progress["policy_version"] == max(steps) == STEPS
    return progress["ledger"]


def rows_per_step(job: JobSpec) -> int:
    return job.data.batch_size * job.loss.group_size
