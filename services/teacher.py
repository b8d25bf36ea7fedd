"""The teacher scoring server: any :class:`distill.teacher.Teacher` behind gRPC.

``Score`` validates a request, queues it on a :class:`~services.batching.DynamicBatcher`
(one worker thread, so the teacher is only ever called from one thread, one batch at a
time) and answers with each sequence's scores; ``Info`` answers the teacher's
:class:`~distill.teacher.TeacherInfo`. Statuses, each with a reason reading "`field` must
...; received ...":

* ``INVALID_ARGUMENT``: empty batch, a sequence of fewer than 2 ids, an id outside
  ``[0, vocab_size)``, a sequence longer than the teacher's ``max_length``, ``top_k``
  outside ``[0, vocab_size]``. The server keeps serving.
* ``RESOURCE_EXHAUSTED``: more than ``max_request_sequences`` sequences or
  ``max_request_tokens`` ids in one request, a response that would exceed
  ``max_message_bytes``, or a full queue (``max_queue_requests``); retry later or split.
* ``UNAUTHENTICATED``: missing or wrong bearer token (when the server has one).
* ``DEADLINE_EXCEEDED`` / ``CANCELLED``: the caller's deadline passed or it went away;
  its sequences not yet in a batch are dropped.
* ``INTERNAL``: the teacher failed; every request in that batch gets the reason.

:func:`serve_teacher` starts it with health and reflection (see :mod:`services.server`).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import numpy as np

from distill.teacher import Teacher, TeacherInfo, check_sequences
from services.batching import BatcherStats, BatcherStopped, DynamicBatcher, QueueFull
from services.proto import teacher_pb2, teacher_pb2_grpc
from services.server import RunningServer, ServerConfig, config_error, start_server
from services.teacher_messages import info_to_proto, scored_to_proto

# Longest wait on a queued request without a deadline bound (threading's limit is larger).
_MAX_WAIT_S = 7 * 24 * 3600.0

#: Full gRPC name of the service, as health and reflection report it.
SERVICE_NAME = teacher_pb2.DESCRIPTOR.services_by_name["TeacherService"].full_name
# Upper bound of the wire size of one scored position: a float log-prob, and per top-k
# entry a float and an int32 varint (<= 5 bytes); plus per-sequence framing.
_BYTES_PER_POSITION, _BYTES_PER_TOP_ENTRY, _BYTES_PER_SEQUENCE = 4, 9, 16


@dataclasses.dataclass(frozen=True)
class TeacherServerConfig(ServerConfig):
    """Transport settings (:class:`ServerConfig`) plus batching and request limits.

    Batching: one teacher call takes at most ``max_batch_sequences`` sequences and
    ``max_batch_tokens`` padded ids (rows x longest), waiting at most ``max_delay_ms`` after
    the oldest queued request for company; ``bucket_rows`` pads the row count to a power of
    two so a jitted teacher compiles once per bucket. Limits per request:
    ``max_request_sequences``, ``max_request_tokens`` (sum of lengths). At most
    ``max_queue_requests`` requests wait; more are refused with ``UNAVAILABLE`` (retry later).
    """

    max_batch_sequences: int = 32
    max_batch_tokens: int = 16384
    max_delay_ms: float = 2.0
    bucket_rows: bool = True
    max_request_sequences: int = 256
    max_request_tokens: int = 65536
    max_queue_requests: int = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in (
            "max_batch_sequences",
            "max_batch_tokens",
            "max_request_sequences",
            "max_request_tokens",
            "max_queue_requests",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise config_error(field, "be an int >= 1", value)
        if not 0 <= self.max_delay_ms <= 10_000:
            raise config_error("max_delay_ms", "be in [0, 10000]", self.max_delay_ms)
        if self.max_request_tokens < 2:
            raise config_error(
                "max_request_tokens", "be >= 2 (one sequence of two ids)", self.max_request_tokens
            )


class RequestError(Exception):
    """A request refused before scoring: ``code`` and a reason naming the field."""

    def __init__(self, code: grpc.StatusCode, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


def validate_score_request(
    request: teacher_pb2.ScoreRequest, info: TeacherInfo, config: TeacherServerConfig
) -> tuple[list[np.ndarray], int]:
    """The request's sequences (int32 arrays) and ``top_k``, or :class:`RequestError`."""
    invalid, exhausted = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    count = len(request.sequences)
    if count == 0:
        raise RequestError(invalid, "`sequences` must hold at least one sequence; received 0")
    if count > config.max_request_sequences:
        raise RequestError(
            exhausted,
            f"`sequences` must hold at most {config.max_request_sequences} sequences per "
            f"request (server limit max_request_sequences); received {count}",
        )
    vocab, top_k = info.vocab_size, request.top_k
    if not 0 <= top_k <= vocab:
        raise RequestError(invalid, f"`top_k` must be in [0, {vocab}] (0: none); received {top_k}")
    total = sum(len(sequence.ids) for sequence in request.sequences)
    if total > config.max_request_tokens:
        raise RequestError(
            exhausted,
            f"`sequences` must hold at most {config.max_request_tokens} ids in all (server "
            f"limit max_request_tokens); received {total}",
        )
    try:
        sequences = check_sequences(
            [sequence.ids for sequence in request.sequences], info, field="sequences[{index}].ids"
        )
    except ValueError as error:
        raise RequestError(invalid, str(error)) from None
    positions = total - count
    size = count * _BYTES_PER_SEQUENCE + positions * (
        _BYTES_PER_POSITION + top_k * _BYTES_PER_TOP_ENTRY
    )
    if size > config.max_message_bytes:
        raise RequestError(
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
            future = self.batcher.submit(sequences, top_k or None)
        except RequestError as error:
            context.abort(error.code, error.reason)
        except QueueFull as error:
            # Transient overload: UNAVAILABLE tells clients to retry with backoff (a request
            # over a limit is RESOURCE_EXHAUSTED: retrying it would fail the same way).
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except BatcherStopped as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        # Called when the RPC ends for any reason; after a normal end it is a no-op. False
        # means the RPC already ended: nobody waits for the result.
        if not context.add_callback(future.cancel):
            future.cancel()
        remaining = context.time_remaining()
        # Without a client deadline time_remaining() is astronomically large (too large for
        # a wait); the callback above still cancels the wait if the caller goes away.
        timeout = None if remaining is None or remaining > _MAX_WAIT_S else max(remaining, 0.0)
        status, reason = None, ""
        try:
            results = future.result(timeout=timeout)
        except CancelledError:
            status, reason = grpc.StatusCode.CANCELLED, "`call` was cancelled by the caller"
        except FutureTimeout:
            future.cancel()
            status = grpc.StatusCode.DEADLINE_EXCEEDED
            reason = "`deadline` must leave time to score the request; it passed while queued"
        except ValueError as error:  # the teacher refused what validation let through
            status, reason = grpc.StatusCode.INVALID_ARGUMENT, str(error)
        except Exception as error:
            status = grpc.StatusCode.INTERNAL
            reason = f"teacher failed: {type(error).__name__}: {error}"
        if status is not None:
            context.abort(status, reason)
        response = teacher_pb2.ScoreResponse(top_k=top_k)
        try:
            response.sequences.extend(
                scored_to_proto(scored, len(ids), top_k)
                for scored, ids in zip(results, sequences, strict=True)
            )
        except ValueError as error:
            context.abort(grpc.StatusCode.INTERNAL, f"teacher answered badly: {error}")
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
