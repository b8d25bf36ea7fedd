"""A rollout worker: the block-diffusion student at a policy version, generating the rows
the learner assigns and streaming their traces back.

Loop: ``AcquireWork`` from the learner -> load that policy version's weights if the student
holds another (``fetch_weights(version)``; the Ray actor reads them from the object store) ->
roll out the shard's prompts with the per-row RNG (each row a pure function of parameters,
seed, step and row id, so a regenerated row is identical) -> cut each completion at its first
stop token -> ``PushTraces``. It ends when the learner answers DONE or ``stop`` is set.

Both calls retry a learner that is briefly unreachable (``retry_policy``; e.g. restarting)
instead of ending the worker: repeating them is safe. A repeated ``AcquireWork`` whose
first answer was lost hands out again what the first assigned (the worker id is the same);
a repeated ``PushTraces`` of rows the learner already took is refused by its scheduler (the
shard is no longer outstanding), so no row is counted or trained twice and a finished
rollout is not lost while the learner is away.
The worker imports JAX; its callers (the Ray actor) import this module inside methods.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from flax import nnx

from distill.config import JobConfig
from distill.data.stream import TaskStream, encode_example
from distill.diffusion.denoise import rollout
from distill.evaluate import completion_text
from distill.job import JobPlan
from distill.models.transformer import Transformer
from distill.opd.learner import load_weights
from distill.opd.records import RolloutBatch
from services.common.auth import bearer_metadata
from services.common.channel import CallFailure, call_with_retry, open_channel
from services.common.config import RetryPolicy
from services.proto import learner_pb2, learner_pb2_grpc, rollout_pb2
from services.rollout.messages import rows_to_proto

FetchWeights = Callable[[int], dict[str, Any]]


class LearnerCallError(RuntimeError):
    """A call to the learner failed (status and reason in the message)."""


class RolloutWorker:
    """Rolls out the shards the learner at ``learner_address`` hands out (module docstring).
    ``call_timeout_s`` bounds every call attempt to the learner; ``retry_policy`` says how
    long a failing call keeps retrying (:func:`~services.common.channel.call_with_retry`);
    past it the worker fails with :class:`LearnerCallError` naming the call, the address,
    the attempts and the seconds."""

    def __init__(
        self,
        job: JobConfig,
        *,
        worker_id: str,
        learner_address: str,
        fetch_weights: FetchWeights,
        token: str | None = None,
        call_timeout_s: float = 120.0,
        retry_policy: RetryPolicy | None = None,
        max_message_bytes: int = 64 << 20,
    ):
        self.plan = JobPlan.from_job(job)
        self.job = job
        self.worker_id = worker_id
        self.fetch_weights = fetch_weights
        self.call_timeout_s = call_timeout_s
        self.retry_policy = RetryPolicy() if retry_policy is None else retry_policy
        self.learner_address = learner_address
        self.student = Transformer(job.student, rngs=nnx.Rngs(0))
        self.version: int | None = None
        self.stream = TaskStream(job.data)
        self._metadata = bearer_metadata(token)
        self._channel = open_channel(learner_address, max_message_bytes=max_message_bytes)
        self._stub = learner_pb2_grpc.LearnerServiceStub(self._channel)
        self.rows_pushed = 0
        self.rollout_seconds = 0.0

    def _call(self, name: str, method, request):
        def describe(failure: CallFailure) -> LearnerCallError:
            spent = (
                f", retry budget spent (budget_s={self.retry_policy.budget_s:g})"
                if failure.transient
                else ""
            )
            return LearnerCallError(
                f"learner call {name} to {self.learner_address} failed: {failure.code.name}: "
                f"{failure.details} [{failure.attempts} attempts in {failure.elapsed_s:.1f} s"
                f"{spent}]"
            )

        return call_with_retry(
            method,
            request,
            timeout_s=self.call_timeout_s,
            metadata=self._metadata,
            policy=self.retry_policy,
            describe=describe,
        )

    def _push(self, messages: list, **call):
        # A fresh iterator per attempt: a retried push sends every row again.
        return self._stub.PushTraces(iter(messages), **call)

    def prompts(self, step: int, row_start: int, row_count: int) -> list[list[int]]:
        """The encoded prompts of rows ``[row_start, row_start + row_count)`` of ``step``."""
        group = self.job.loss.group_size
        prompts_per_step = self.plan.prompts_per_step
        examples = self.stream.batch(step * prompts_per_step, prompts_per_step)
        rows = range(row_start, row_start + row_count)
        return [encode_example(examples[row // group], self.plan.tokenizer)[0] for row in rows]

    def roll_out(self, work: learner_pb2.WorkAssignment) -> learner_pb2.PushSummary:
        """Generate one assigned shard and push it; returns the learner's answer."""
        return self.push(self.trace_rows(work))

    def trace_rows(self, work: learner_pb2.WorkAssignment) -> list[rollout_pb2.TraceRow]:
        """The trace rows of one assigned shard, generated with its policy version."""
        if self.version != work.policy_version:
            load_weights(self.student, self.fetch_weights(work.policy_version))
            self.version = work.policy_version
        rows = list(range(work.row_start, work.row_start + work.row_count))
        started = time.perf_counter()
        trace = rollout(
            self.student,
            self.prompts(work.step, work.row_start, work.row_count),
            self.plan.settings,
            seed=work.seed,
            global_step=work.step,
            row_ids=rows,
        )
        batch = RolloutBatch.from_trace(
            trace,
            step=work.step,
            policy_version=work.policy_version,
            row_ids=rows,
            stream_positions=list(work.stream_positions),
        )
        self.rollout_seconds += time.perf_counter() - started
        completions = trace.completions()
        texts = [completion_text(self.plan.tokenizer, ids) for ids in completions]
        return list(
            rows_to_proto(
                batch,
                seed=work.seed,
                worker_id=self.worker_id,
                completions=completions,
                texts=texts,
            )
        )

    def acquire(self) -> learner_pb2.WorkAssignment:
        """``AcquireWork`` for this worker (retried while the learner is unreachable)."""
        request = learner_pb2.WorkRequest(worker_id=self.worker_id)
        return self._call("AcquireWork", self._stub.AcquireWork, request)

    def push(self, messages: list[rollout_pb2.TraceRow]) -> learner_pb2.PushSummary:
        """``PushTraces`` of ``messages``, retried while the learner is unreachable (module
        docstring); returns the learner's answer (rows accepted, dropped as stale, refused)."""
        summary = self._call("PushTraces", self._push, list(messages))
        self.rows_pushed += summary.accepted
        return summary

    def run(self, stop: threading.Event | None = None) -> dict[str, float]:
        """Work until the learner answers DONE (or ``stop`` is set); returns counters."""
        stop = stop or threading.Event()
        shards = 0
        while not stop.is_set():
            work = self.acquire()
            if work.kind == learner_pb2.WorkAssignment.DONE:
                break
            if work.kind == learner_pb2.WorkAssignment.WAIT:
                # The learner already held the call back (long poll); ask again at once.
                stop.wait(work.retry_after_ms / 1000)
                continue
            self.roll_out(work)
            shards += 1
        return {
            "shards": float(shards),
            "rows_pushed": float(self.rows_pushed),
            "rollout_seconds": self.rollout_seconds,
        }

    def close(self) -> None:
        self._channel.close()
