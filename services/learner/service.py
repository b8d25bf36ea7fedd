"""The learner service: ``LearnerService`` over gRPC in front of an
:class:`~distill.opd.learner.OpdLearner`, a :class:`~services.learner.scheduler.WorkScheduler`
and one training thread.

- ``AcquireWork``: the next shard for a worker (rows of a step, their stream positions, the
  policy version to roll out with), or WAIT / DONE.
- ``PushTraces`` (client-streaming ``TraceRow``): every row is checked (wire form, identity,
  the job's seed, forwards >= 0, log-probs <= 0 in the completion and 0 outside it, the
  learner's sampling settings and block size, the library's trace validation); any bad
  row refuses the whole push with ``INVALID_ARGUMENT`` naming the field, nothing of it is
  kept and the service keeps serving. Good rows are handed to the scheduler, which keeps,
  drops as stale, or refuses each shard; the answer counts each.
- ``Status``: step, policy version, counters, the training error if any.

:meth:`LearnerRuntime.status` also says which stage the training thread is in (``rollout``:
waiting for a step's traces; ``teacher``: a teacher call in progress; ``learner``: updating,
evaluating, checkpointing or publishing), since when, and which shards each rollout worker
holds: what the job driver's watchdog names when no step completes in time.

:class:`LearnerRuntime` trains step by step: it waits for a step's shards, trains
(:meth:`OpdLearner.train`: teacher scores at learner time, update, ledger, evaluations,
checkpoints), publishes the new weights through ``publish(version, weights)`` (the Ray
actor puts them in the object store) and tells the scheduler. Training curves go to
TensorBoard event files; ``on_metrics`` receives live metrics (the Ray actor exports them
through Ray's metrics API).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from distill.curves import CurveWriter
from distill.opd.learner import OpdLearner
from distill.opd.records import RolloutBatch
from distill.teacher_contract import ScoredSequence, Teacher, TeacherInfo
from services.common.config import ServerConfig
from services.common.server import RunningServer, start_server
from services.common.status import abort_with
from services.learner.scheduler import Delivery, WorkKind, WorkScheduler
from services.proto import learner_pb2, learner_pb2_grpc
from services.rollout.messages import batches_from_rows

#: Full gRPC name of the service, as health and reflection report it.
SERVICE_NAME = learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name

Publish = Callable[[int, dict[str, Any]], None]


class TimedTeacher:
    """A :class:`~distill.teacher_contract.Teacher` (and text teacher, when the wrapped one
    scores text) that adds up the seconds its ``score`` / ``score_text`` calls take (teacher-call time as a share of step time) and tells whether one is in
    progress (``scoring``: the number of sequences of the call in progress, else 0)."""

    def __init__(self, teacher: Teacher):
        self.teacher = teacher
        self.seconds = 0.0
        self.scoring = 0

    def info(self) -> TeacherInfo:
        return self.teacher.info()

    def score(
        self, sequences: Sequence[Sequence[int]], *, top_k: int | None = None
    ) -> list[ScoredSequence]:
        return self._timed(len(sequences), self.teacher.score, sequences, top_k=top_k)

    def score_text(self, prompts, completions, *, stopped=None):
        """The teacher's text scoring (a teacher with another tokenizer), timed the same."""
        return self._timed(
            len(completions), self.teacher.score_text, prompts, completions, stopped=stopped
        )

    def _timed(self, count: int, call, *args, **kwargs):
        start = time.perf_counter()
        self.scoring = count
        try:
            return call(*args, **kwargs)
        finally:
            self.scoring = 0
            self.seconds += time.perf_counter() - start


@dataclasses.dataclass
class LearnerCounters:
    invalid_pushes: int = 0
    error: str = ""


def split_by_shard(batch: RolloutBatch, bounds: Sequence[tuple[int, int]]) -> list[RolloutBatch]:
    """``batch``'s rows cut along the scheduler's shard boundaries (one push may carry rows
    of several shards)."""
    parts = []
    row_ids = np.asarray(batch.row_ids)
    for start, count in bounds:
        picked = np.flatnonzero((row_ids >= start) & (row_ids < start + count))
        if picked.size:
            parts.append(
                dataclasses.replace(
                    batch,
                    row_ids=batch.row_ids[picked],
                    stream_positions=batch.stream_positions[picked],
                    slots={name: array[picked] for name, array in batch.slots.items()},
                    forwards=batch.forwards[picked],
                )
            )
    return parts


def _checked_rows(messages, seed: int):
    """``messages`` checked for what the trace validation does not see: the row's seed (the
    job's, as assigned), its forward count, and its log-probs (0 outside the completion,
    <= 0 in it: a log-prob above 0 is no probability). Raises :class:`ValueError` naming
    the row and field."""
    for index, message in enumerate(messages):
        if message.seed != seed:
            raise ValueError(
                f"`rows[{index}].seed` must be the job's seed {seed} (as assigned); received "
                f"{message.seed}"
            )
        if message.forwards < 0:
            raise ValueError(f"`rows[{index}].forwards` must be >= 0; received {message.forwards}")
        logps = np.asarray(message.action_logps, np.float32)
        inside = np.asarray(message.completion_mask, bool)
        if logps.shape == inside.shape:
            bad = np.flatnonzero(np.where(inside, ~(logps <= 0), logps != 0))
            if bad.size:
                raise ValueError(
                    f"`rows[{index}].action_logps` must be <= 0 in the completion and 0 outside "
                    f"it; received {float(logps[bad[0]])} at slot {int(bad[0])}"
                )
        yield message


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    """``LearnerService`` over a learner and its scheduler (module docstring)."""

    def __init__(self, runtime: LearnerRuntime):
        self.runtime = runtime

    def AcquireWork(self, request: learner_pb2.WorkRequest, context: grpc.ServicerContext):
        # The worker id is stable across a worker's restarts: what it still holds is lost.
        assignment = self.runtime.scheduler.acquire(
            wait_s=self.runtime.acquire_wait_s, worker_id=request.worker_id
        )
        kinds = {
            WorkKind.WORK: learner_pb2.WorkAssignment.WORK,
            WorkKind.WAIT: learner_pb2.WorkAssignment.WAIT,
            WorkKind.DONE: learner_pb2.WorkAssignment.DONE,
        }
        message = learner_pb2.WorkAssignment(
            kind=kinds[assignment.kind], seed=self.runtime.learner.job.seed, retry_after_ms=0
        )
        if assignment.shard is not None:
            message.step = assignment.shard.step
            message.row_start = assignment.shard.row_start
            message.row_count = assignment.shard.row_count
            message.stream_positions.extend(assignment.stream_positions)
            message.policy_version = assignment.policy_version
        return message

    def PushTraces(self, request_iterator, context: grpc.ServicerContext):
        runtime = self.runtime
        try:
            batches = batches_from_rows(_checked_rows(request_iterator, runtime.learner.job.seed))
            if not batches:
                raise ValueError("`rows` must hold at least one trace row; received 0")
            for batch in batches:
                published = runtime.scheduler.trained_step
                if batch.policy_version > published:
                    raise ValueError(
                        f"`rows.policy_version` must be <= the learner's {published}; "
                        f"received {batch.policy_version}"
                    )
                runtime.learner.check_rows(batch)
        except grpc.RpcError:
            raise
        except ValueError as error:
            runtime.counters.invalid_pushes += 1
            abort_with(context, error)
        summary = learner_pb2.PushSummary()
        for batch in batches:
            for part in split_by_shard(batch, runtime.scheduler.bounds):
                outcome = runtime.scheduler.deliver(part)
                if outcome is Delivery.ACCEPTED:
                    summary.accepted += part.rows
                elif outcome is Delivery.STALE:
                    summary.dropped_stale += part.rows
                else:
                    summary.refused += part.rows
        return summary

    def Status(self, request: learner_pb2.StatusRequest, context: grpc.ServicerContext):
        return self.runtime.status_message()


class LearnerRuntime:
    """A learner behind its service (module docstring). ``shards_per_step``: how many pieces
    each step's rows are cut into (one per rollout worker is a good default).
    ``step_timeout_s``: how long a step may wait for its rollouts. ``end_step``: stop there
    (default: the phase's steps). ``tensorboard_dir``: where training curves are written.
    ``acquire_wait_s``: how long ``AcquireWork`` holds a WAIT back for work to appear
    (bounded, so a worker still checks its stop flag regularly)."""

    def __init__(
        self,
        learner: OpdLearner,
        *,
        shards_per_step: int,
        publish: Publish,
        server_config: ServerConfig | None = None,
        step_timeout_s: float = 600.0,
        reassign_after_s: float = 600.0,
        end_step: int | None = None,
        tensorboard_dir: str | Path | None = None,
        on_metrics: Callable[[dict[str, float]], None] | None = None,
        acquire_wait_s: float = 1.0,
    ):
        if not step_timeout_s > 0:
            raise ValueError(f"`step_timeout_s` must be > 0; received {step_timeout_s}")
        if not 0 < acquire_wait_s <= 60:
            raise ValueError(f"`acquire_wait_s` must be in (0, 60]; received {acquire_wait_s}")
        self.acquire_wait_s = acquire_wait_s
        self.learner = learner
        self.publish = publish
        self.end_step = learner.phase.steps if end_step is None else end_step
        self.step_timeout_s = step_timeout_s
        self.tensorboard_dir = tensorboard_dir
        self.on_metrics = on_metrics
        self.counters = LearnerCounters()
        self.history: list[dict[str, float]] = []
        self.teacher = TimedTeacher(learner.teacher)
        learner.teacher = self.teacher
        self.scheduler = WorkScheduler(
            start_step=learner.step,
            end_step=self.end_step,
            rows_per_step=learner.plan.rows_per_step,
            shards_per_step=shards_per_step,
            max_staleness=learner.job.loss.max_staleness,
            stream_positions=learner.stream_positions,
            reassign_after_s=reassign_after_s,
        )
        self._server_config = server_config or ServerConfig()
        self._server: RunningServer | None = None
        self._done = threading.Event()
        # What the training thread does now: "starting", "rollout" (waiting for the traces
        # of ``_stage_step``), "learner" (training; "teacher" while a teacher call runs),
        # "done"; and since when (monotonic seconds).
        self._stage, self._stage_step, self._stage_since = "starting", learner.step, 0.0
        self._set_stage("starting", learner.step)

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("`server` must be started first (call start())")
        return self._server.address

    def start(self) -> str:
        """Publish the starting weights and serve; returns the bound ``host:port``."""
        self.publish(self.learner.policy_version, self.learner.weights())
        servicer = LearnerServicer(self)
        self._server = start_server(
            self._server_config,
            lambda server: learner_pb2_grpc.add_LearnerServiceServicer_to_server(servicer, server),
            [SERVICE_NAME],
        )
        return self._server.address

    def _set_stage(self, stage: str, step: int) -> None:
        self._stage, self._stage_step, self._stage_since = stage, step, time.monotonic()

    def stage(self) -> tuple[str, str]:
        """``(stage, detail)``: what the training thread is doing now (``rollout``,
        ``teacher``, ``learner``, or ``starting`` / ``done``) and, in words, on what."""
        stage, step = self._stage, self._stage_step
        seconds = time.monotonic() - self._stage_since
        if stage == "rollout":
            held = self.scheduler.holders()
            holding = "; ".join(
                f"{worker or 'a worker'} holds (step, row_start, row_count) {shards}"
                for worker, shards in held.items()
            )
            return stage, (
                f"step {step} has waited {seconds:.0f} s for rows (row_start, row_count) "
                f"{self.scheduler.missing(step)} from the rollout workers"
                + (f"; {holding}" if holding else "; no worker holds any of them")
            )
        if stage == "learner" and self.teacher.scoring:
            return "teacher", (
                f"step {step} waits for the teacher to score {self.teacher.scoring} sequences "
                f"(teacher calls of this step so far: {self.teacher.seconds:.0f} s)"
            )
        if stage == "learner":
            return stage, f"step {step}: updating, evaluating, checkpointing or publishing"
        return stage, f"step {step}, for {seconds:.0f} s"

    def status(self) -> dict[str, Any]:
        counts = self.scheduler.counts
        stage, detail = self.stage()
        return {
            "step": self.learner.step,
            "total_steps": self.end_step,
            "policy_version": self.learner.policy_version,
            "accepted_rows": counts.accepted_rows,
            "dropped_stale_rows": counts.dropped_stale_rows,
            "refused_rows": counts.refused_rows,
            "invalid_pushes": self.counters.invalid_pushes,
            "queued_rows": self.scheduler.queued_rows(),
            "done": self._done.is_set(),
            "error": self.counters.error,
            "stage": stage,
            "stage_detail": detail,
            "reassigned_shards": counts.reassigned_shards,
            "released_shards": counts.released_shards,
            "assigned": self.scheduler.holders(),
        }

    def status_message(self) -> learner_pb2.LearnerStatus:
        fields = learner_pb2.LearnerStatus.DESCRIPTOR.fields_by_name
        return learner_pb2.LearnerStatus(
            **{name: value for name, value in self.status().items() if name in fields}
        )

    def run(self) -> list[dict[str, float]]:
        """Train until ``end_step``; returns this call's per-step metrics. Any failure
        closes the scheduler (workers get DONE) and is re-raised."""
        learner = self.learner
        curves = (
            CurveWriter(self.tensorboard_dir, resume_step=learner.step)
            if self.tensorboard_dir is not None and learner.step < self.end_step
            else None
        )
        try:
            self._set_stage("learner", learner.step)
            if learner.step == 0 and not learner.reports:
                learner.evaluate()
            if curves is not None:
                curves.evaluations(learner.reports)
            while learner.step < self.end_step:
                step = learner.step
                waited = time.perf_counter()
                self._set_stage("rollout", step)
                parts = self.scheduler.wait_step(step, self.step_timeout_s)
                self._set_stage("learner", step)
                started = time.perf_counter()
                self.teacher.seconds = 0.0
                # Every row was checked when it was pushed; train checks the step as a whole.
                metrics = learner.train(parts, rows_checked=True)
                trained = time.perf_counter()
                self.publish(learner.policy_version, learner.weights())
                self.scheduler.publish(learner.policy_version)
                published = time.perf_counter()
                metrics |= {
                    "wait_seconds": started - waited,
                    "train_seconds": trained - started,
                    "teacher_seconds": self.teacher.seconds,
                    "publish_seconds": published - trained,
                    "step_seconds": published - waited,
                    "tokens_per_second": metrics["completion_tokens"] / (published - waited),
                    "dropped_stale_rows": float(self.scheduler.counts.dropped_stale_rows),
                }
                self.history.append(metrics)
                if curves is not None:
                    curves.scalars("opd", metrics, learner.step)
                    curves.evaluations(learner.reports)
                if self.on_metrics is not None:
                    self.on_metrics(metrics | {"queued_rows": float(self.scheduler.queued_rows())})
            if (
                self.history
                and learner.step % learner.phase.checkpoint_every
                and (learner.step != learner.phase.steps)
            ):
                learner.save(self.history[-1])
            self.scheduler.close("training finished")
            self._set_stage("done", learner.step)
            return self.history
        except BaseException as error:
            self.counters.error = f"{type(error).__name__}: {error}"
            self.scheduler.close(f"learner stopped: {self.counters.error}")
            raise
        finally:
            self._done.set()
            if curves is not None:
                curves.close()

    def stop(self, grace_s: float | None = None) -> None:
        self.scheduler.close("learner stopped")
        if self._server is not None:
            self._server.stop(grace_s)
        self.learner.close()
