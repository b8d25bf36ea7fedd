"""The teacher scoring server: any :class:`distill.teacher_contract.Teacher` behind gRPC.

``Score`` validates a request, queues it on a
:class:`~services.teacher.batching.DynamicBatcher` (one worker thread, so the teacher is
only ever called from one thread, one batch at a time) and answers with each sequence's
scores; ``Info`` answers the teacher's :class:`~distill.teacher_contract.TeacherInfo`.
Statuses (mapped from errors by :mod:`services.common.status`), each with a reason reading
"`field` must ...; received ...":

* ``INVALID_ARGUMENT``: empty batch, a sequence of fewer than 2 ids, an id outside
  ``[0, vocab_size)``, a sequence longer than the teacher's ``max_length``, ``top_k``
  outside ``[0, vocab_size]``. The server keeps serving.
* ``RESOURCE_EXHAUSTED``: more than ``max_request_sequences`` sequences or
  ``max_request_tokens`` ids in one request, or a response that would exceed
  ``max_message_bytes``; split the request.
* ``UNAVAILABLE``: a full queue (``max_queue_requests``) or a stopping server; transient,
  clients retry with backoff.
* ``UNAUTHENTICATED``: missing or wrong bearer token (when the server has one).
* ``DEADLINE_EXCEEDED`` / ``CANCELLED``: the caller's deadline passed or it went away;
  its sequences not yet in a batch are dropped.
* ``INTERNAL``: the teacher failed; every request in that batch gets the reason.

:func:`serve_teacher` starts it with health and reflection (see
:mod:`services.common.server`).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Self

import grpc
import numpy as np
from pydantic import Field, model_validator

from distill.teacher_contract import Teacher, TeacherInfo, check_sequences
from services.common.config import ServerConfig, config_error
from services.common.server import RunningServer, start_server
from services.common.status import StatusError, abort_with
from services.proto import teacher_pb2, teacher_pb2_grpc
from services.teacher.batching import BatcherStats, DynamicBatcher
from services.teacher.messages import info_to_proto, scored_to_proto

# Longest wait on a queued request without a deadline bound (threading's limit is larger).
_MAX_WAIT_S = 7 * 24 * 3600.0

#: Full gRPC name of the service, as health and reflection report it.
SERVICE_NAME = teacher_pb2.DESCRIPTOR.services_by_name["TeacherService"].full_name
# Upper bound of the wire size of one scored position: a float log-prob, and per top-k
# entry a float and an int32 varint (<= 5 bytes); plus per-sequence framing.
_BYTES_PER_POSITION, _BYTES_PER_TOP_ENTRY, _BYTES_PER_SEQUENCE = 4, 9, 16


class TeacherServerConfig(ServerConfig):
    """Transport settings (:class:`~services.common.config.ServerConfig`) plus batching and
    request limits.

    Batching: one teacher call takes at most ``max_batch_sequences`` sequences and
    ``max_batch_tokens`` padded ids (rows x longest), waiting at most ``max_delay_ms`` (in
    [0, 10000]) after the oldest queued request for company; ``bucket_rows`` pads the row
    count to a power of two so a jitted teacher compiles once per bucket. Limits per
    request: ``max_request_sequences``, ``max_request_tokens`` (sum of lengths; >= 2, one
    sequence of two ids). At most ``max_queue_requests`` requests wait; more are refused
    with ``UNAVAILABLE`` (retry later). Every count is an int >= 1.
    """

    max_batch_sequences: int = Field(default=32, ge=1, strict=True)
    max_batch_tokens: int = Field(default=16384, ge=1, strict=True)
    max_delay_ms: float = Field(default=2.0, ge=0, le=10_000)
    bucket_rows: bool = True
    max_request_sequences: int = Field(default=256, ge=1, strict=True)
    max_request_tokens: int = Field(default=65536, ge=1, strict=True)
    max_queue_requests: int = Field(default=1024, ge=1, strict=True)

    @model_validator(mode="after")
    def _check_limits(self) -> Self:
        if self.max_request_tokens < 2:
            raise config_error(
                "max_request_tokens", "be >= 2 (one sequence of two ids)", self.max_request_tokens
            )
        return self


def validate_score_request(
    request: teacher_pb2.ScoreRequest, info: TeacherInfo, config: TeacherServerConfig
) -> tuple[list[np.ndarray], int]:
    """The request's sequences (int32 arrays) and ``top_k``, or a
    :class:`~services.common.status.StatusError` with the status to answer."""
    invalid, exhausted = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    count = len(request.sequences)
    if count == 0:
        raise StatusError(invalid, "`sequences` must hold at least one sequence; received 0")
    if count > config.max_request_sequences:
        raise StatusError(
            exhausted,
            f"`sequences` must hold at most {config.max_request_sequences} sequences per "
            f"request (server limit max_request_sequences); received {count}",
        )
    vocab, top_k = info.vocab_size, request.top_k
    if not 0 <= top_k <= vocab:
        raise StatusError(invalid, f"`top_k` must be in [0, {vocab}] (0: none); received {top_k}")
    total = sum(len(sequence.ids) for sequence in request.sequences)
    if total > config.max_request_tokens:
        raise StatusError(
            exhausted,
            f"`sequences` must hold at most {config.max_request_tokens} ids in all (server "
            f"limit max_request_tokens); received {total}",
        )
    try:
        sequences = check_sequences(
            [sequence.ids for sequence in request.sequences], info, field="sequences[{index}].ids"
        )
    except ValueError as error:
        raise StatusError(invalid, str(error)) from None
    positions = total - count
    size = count * _BYTES_PER_SEQUENCE + positions * (
        _BYTES_PER_POSITION + top_k * _BYTES_PER_TOP_ENTRY
    )
    if size > config.max_message_bytes:
        raise StatusError(
            exhausted,
            f"`top_k` must keep the response within max_message_bytes="
            f"{config.max_message_bytes}; received top_k={top_k} for {positions} positions "
            f"(up to {size} bytes): lower top_k or split the request",
        )
    return sequences, top_k


class TeacherServicer(teacher_pb2_grpc.TeacherServiceServicer):
    """``TeacherService`` over ``teacher``, batching concurrent ``Score`` calls. Call
    :meth:`close` after the gRPC server stopped (``serve_teacher`` does)."""

    def __init__(self, teacher: Teacher, config: TeacherServerConfig):
        self.teacher = teacher
        self.config = config
        self.info = teacher.info()
        self._info_message = info_to_proto(self.info)
        self.batcher: DynamicBatcher = DynamicBatcher(
            lambda sequences, top_k: teacher.score(sequences, top_k=top_k),
            max_batch_sequences=config.max_batch_sequences,
            max_batch_tokens=config.max_batch_tokens,
            max_delay_s=config.max_delay_ms / 1000,
            max_queue_requests=config.max_queue_requests,
            bucket_rows=config.bucket_rows,
            # Filler rows for row buckets: the shortest valid sequence.
            filler=(0, 0),
            name="teacher-batcher",
        )

    def close(self) -> None:
        self.batcher.stop()

    def Info(self, request: teacher_pb2.InfoRequest, context: grpc.ServicerContext):
        return self._info_message

    def Score(self, request: teacher_pb2.ScoreRequest, context: grpc.ServicerContext):
        try:
            sequences, top_k = validate_score_request(request, self.info, self.config)
            # A full queue or a stopping batcher is Unavailable: clients retry with backoff
            # (a request over a limit is RESOURCE_EXHAUSTED: it would fail the same way).
            future = self.batcher.submit(sequences, top_k or None)
        except Exception as error:
            abort_with(context, error)
        # Called when the RPC ends for any reason; after a normal end it is a no-op. False
        # means the RPC already ended: nobody waits for the result.
        if not context.add_callback(future.cancel):
            future.cancel()
        remaining = context.time_remaining()
        # Without a client deadline time_remaining() is astronomically large (too large for
        # a wait); the callback above still cancels the wait if the caller goes away.
        timeout = None if remaining is None or remaining > _MAX_WAIT_S else max(remaining, 0.0)
        try:
            results = future.result(timeout=timeout)
        except CancelledError:
            abort_with(
                context,
                StatusError(grpc.StatusCode.CANCELLED, "`call` was cancelled by the caller"),
            )
        except FutureTimeout:
            future.cancel()
            abort_with(
                context,
                StatusError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "`deadline` must leave time to score the request; it passed while queued",
                ),
            )
        except Exception as error:
            # A ValueError is the teacher refusing what validation let through
            # (INVALID_ARGUMENT); anything else is the teacher failing (INTERNAL).
            abort_with(context, error, failed="teacher")
        response = teacher_pb2.ScoreResponse(top_k=top_k)
        try:
            response.sequences.extend(
                scored_to_proto(scored, len(ids), top_k)
                for scored, ids in zip(results, sequences, strict=True)
            )
        except ValueError as error:
            abort_with(
                context,
                StatusError(grpc.StatusCode.INTERNAL, f"teacher answered badly: {error}"),
            )
        return response


@dataclasses.dataclass
class TeacherServer:
    """A running teacher server: ``port``, ``address`` (bound ``host:port``), ``info``,
    ``stats()`` (batching counters), ``stop()`` (graceful; idempotent), ``wait()``."""

    running: RunningServer
    servicer: TeacherServicer

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def address(self) -> str:
        return self.running.address

    @property
    def info(self) -> TeacherInfo:
        return self.servicer.info

    def stats(self) -> BatcherStats:
        return self.servicer.batcher.stats()

    def stop(self, grace_s: float | None = None) -> None:
        self.running.stop(grace_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.running.wait(timeout_s)

    def __enter__(self) -> TeacherServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_teacher(teacher: Teacher, config: TeacherServerConfig | None = None) -> TeacherServer:
    """Serve ``teacher`` on ``config.address`` (default ``127.0.0.1:0``: loopback, a free
    port) until ``stop()``; returns once it accepts calls."""
    config = TeacherServerConfig() if config is None else config
    servicer = TeacherServicer(teacher, config)
    try:
        running = start_server(
            config,
            lambda server: teacher_pb2_grpc.add_TeacherServiceServicer_to_server(servicer, server),
            [SERVICE_NAME],
            on_stop=servicer.close,
        )
    except BaseException:
        servicer.close()
        raise
    return TeacherServer(running, servicer)
