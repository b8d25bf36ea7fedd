"""A rollout worker: the block-diffusion student at a policy version, generating the rows
the learner assigns and streaming their traces back.

Loop: ``AcquireWork`` from the learner -> load that policy version's weights if the student
holds another (``fetch_weights(version)``; the Ray actor reads them from the object store) ->
roll out the shard's prompts with the per-row RNG (each row a pure function of parameters,
seed, step and row id, so a regenerated row is identical) -> cut each completion at its first
stop token -> ``PushTraces``. It ends when the learner answers DONE or ``stop`` is set.
The worker imports JAX; its callers (the Ray actor) import this module inside methods.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
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
from services.common.channel import open_channel
from services.proto import learner_pb2, learner_pb2_grpc
from services.rollout.messages import rows_to_proto

FetchWeights = Callable[[int], dict[str, Any]]


class LearnerCallError(RuntimeError):
    """A call to the learner failed (status and reason in the message)."""


class RolloutWorker:
    """Rolls out the shards the learner at ``learner_address`` hands out (module docstring).
    ``call_timeout_s`` bounds every call to the learner."""

    def __init__(
        self,
        job: JobConfig,
        *,
        worker_id: str,
        learner_address: str,
        fetch_weights: FetchWeights,
        token: str | None = None,
        call_timeout_s: float = 120.0,
        max_message_bytes: int = 64 << 20,
    ):
        self.plan = JobPlan.from_job(job)
        self.job = job
        self.worker_id = worker_id
        self.fetch_weights = fetch_weights
        self.call_timeout_s = call_timeout_s
        self.student = Transformer(job.student, rngs=nnx.Rngs(0))
        self.version: int | None = None
        self.stream = TaskStream(job.data)
        self._metadata = bearer_metadata(token)
        self._channel = open_channel(learner_address, max_message_bytes=max_message_bytes)
        self._stub = learner_pb2_grpc.LearnerServiceStub(self._channel)
        self.rows_pushed = 0
        self.rollout_seconds = 0.0

    def _call(self, method, request):
        try:
            return method(request, timeout=self.call_timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise LearnerCallError(
                f"learner call failed: {error.code().name}: {error.details()}"
            ) from None

    def prompts(self, step: int, row_start: int, row_count: int) -> list[list[int]]:
        """The encoded prompts of rows ``[row_start, row_start + row_count)`` of ``step``."""
        group = self.job.loss.group_size
        prompts_per_step = self.plan.prompts_per_step
        examples = self.stream.batch(step * prompts_per_step, prompts_per_step)
        rows = range(row_start, row_start + row_count)
        return [encode_example(examples[row // group], self.plan.tokenizer)[0] for row in rows]

    def roll_out(self, work: learner_pb2.WorkAssignment) -> learner_pb2.PushSummary:
        """Generate one assigned shard and push it; returns the learner's answer."""
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
        messages = rows_to_proto(
            batch, seed=work.seed, worker_id=self.worker_id, completions=completions, texts=texts
        )
        summary = self._call(self._stub.PushTraces, iter(messages))
        self.rows_pushed += summary.accepted
        return summary

    def run(self, stop: threading.Event | None = None) -> dict[str, float]:
        """Work until the learner answers DONE (or ``stop`` is set); returns counters."""
        stop = stop or threading.Event()
        request = learner_pb2.WorkRequest(worker_id=self.worker_id)
        shards = 0
        while not stop.is_set():
            work = self._call(self._stub.AcquireWork, request)
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
