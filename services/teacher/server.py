"""The teacher scoring server: any :class:`distill.teacher_contract.Teacher` behind gRPC.

It runs on ``grpc.aio`` (:func:`services.common.server.start_aio_server`): a waiting call
holds no thread; what bounds the work in flight is the queue (``max_queue_requests``) and
each method's concurrency limit. The bearer token is checked before a request body is read,
a body larger than the largest valid request (``max_receive_bytes``, derived from the
limits) is refused by gRPC before it is parsed, and a body that does not parse is answered
``INVALID_ARGUMENT`` and counted. Health reports ``NOT_SERVING`` until the teacher's warm-up
(every compiled shape) is done and again as soon as a drain starts.

``Score`` validates a request, queues it on a
:class:`~services.teacher.batching.DynamicBatcher` (one worker thread, so the teacher is
only ever called from one thread, one batch at a time; requests of the same variant share
batches) and answers each sequence's scores. Variants, combinable: the log-prob of each
actual next token (always); the teacher's ``top_k``; log-probs at ``candidates`` ids the
caller chooses per position; continuations of one ``shared_prompt`` (prefilled once).
``Info`` answers the teacher's :class:`~distill.teacher_contract.TeacherInfo` and its
compiled buckets. Statuses (mapped from errors by :mod:`services.common.status`), each with a
reason reading "`field` must ...; received ...":

* ``INVALID_ARGUMENT``: empty batch, a sequence of fewer than 2 ids (a continuation of 1),
  an id outside ``[0, vocab_size)``, a sequence longer than the teacher's ``max_length``,
  ``top_k`` or ``candidates`` outside ``[0, largest bucket]``, candidate ids of the wrong
  count, a body that is not a ``ScoreRequest``. The server keeps serving.
* ``RESOURCE_EXHAUSTED``: more than ``max_request_sequences`` sequences,
  ``max_request_tokens`` ids or ``max_request_candidate_ids`` candidate ids in one request,
  a body over ``max_receive_bytes``, or a response that would exceed ``max_message_bytes``:
  split the request (the same one would fail again).
* ``UNAVAILABLE``: a full queue (``max_queue_requests``), a method at its concurrency limit,
  a stopping server: transient, clients retry with backoff. This is the one status of
  back-pressure, in code, proto and docs.
* ``UNAUTHENTICATED``: missing or wrong bearer token (when the server has one).
* ``DEADLINE_EXCEEDED`` / ``CANCELLED``: the caller's deadline passed or it went away;
  its sequences not yet in a batch are dropped.
* ``INTERNAL``: the teacher failed; every request in that batch gets the reason.

:func:`serve_teacher` starts it with health, reflection and, when ``metrics_address`` is
set, a Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import NamedTuple, Self

import grpc
import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field, model_validator

from distill.cross_tokenizer import CrossTokenizerTeacher, check_text_pairs
from distill.teacher_contract import ScoredSequence, Teacher, TeacherInfo, check_sequences
from distill.tokenizer import Tokenizer
from services.common.config import ServerConfig, config_error, is_loopback, split_address
from services.common.metrics import MetricsEndpoint, RpcMetrics, serve_metrics
from services.common.server import AsyncRunningServer, start_aio_server
from services.common.status import StatusError, Unavailable, reason_of, status_of
from services.proto import teacher_pb2, teacher_pb2_grpc
from services.teacher.batching import BatcherStats, DynamicBatcher
from services.teacher.messages import info_to_proto, scored_to_proto, text_scores_to_proto

#: Full gRPC name of the service, as health and reflection report it.
SERVICE_NAME = teacher_pb2.DESCRIPTOR.services_by_name["TeacherService"].full_name
# Upper bound of the wire size of one scored position: a float log-prob, and per top-k
# entry a float and an int32 varint (<= 5 bytes), per candidate a float; plus per-sequence
# framing.
_BYTES_PER_POSITION, _BYTES_PER_TOP_ENTRY, _BYTES_PER_CANDIDATE = 4, 9, 4
_BYTES_PER_SEQUENCE = 16
# Wire size bounds of a request: a valid id is a varint of at most 3 bytes (ids < 2**21);
# 5 covers any non-negative int32.
_BYTES_PER_ID = 5
# Without a closed set of compiled candidate counts, the largest K a request may ask for.
_MAX_CANDIDATES = 1024


class TeacherServerConfig(ServerConfig):
    """Transport settings (:class:`~services.common.config.ServerConfig`) plus batching,
    request limits and metrics.

    Batching: one teacher call takes at most ``max_batch_sequences`` sequences and
    ``max_batch_tokens`` padded ids (rows x longest), waiting at most ``max_delay_ms`` (in
    [0, 10000]) after the oldest queued request for company; ``bucket_rows`` pads the row
    count to a power of two so a jitted teacher compiles once per bucket. Limits per
    request: ``max_request_sequences``, ``max_request_tokens`` (sum of lengths; >= 2, one
    sequence of two ids), ``max_request_candidate_ids``, ``max_request_text_bytes``; the
    largest body accepted (``max_receive_bytes``) follows from them. At most
    ``max_queue_requests`` requests wait; more are refused with ``UNAVAILABLE`` (retry
    later). ``method_limits``: concurrency limits by full method name over the defaults of
    :data:`services.common.server.DEFAULT_METHOD_LIMITS`. ``warm_shared_prompts``: the
    warm-up also compiles the shared-prompt shapes (many more; without it the first
    shared-prompt request of each shape compiles). ``metrics_address``: ``host:port``
    of the Prometheus endpoint (off when unset; loopback unless ``metrics_public``). Every
    count is an int >= 1.
    """

    max_batch_sequences: int = Field(default=32, ge=1, strict=True)
    max_batch_tokens: int = Field(default=16384, ge=1, strict=True)
    max_delay_ms: float = Field(default=2.0, ge=0, le=10_000)
    bucket_rows: bool = True
    max_request_sequences: int = Field(default=256, ge=1, strict=True)
    max_request_tokens: int = Field(default=65536, ge=1, strict=True)
    max_request_candidate_ids: int = Field(default=524288, ge=1, strict=True)
    max_request_text_bytes: int = Field(default=1 << 20, ge=1, strict=True)
    max_queue_requests: int = Field(default=1024, ge=1, strict=True)
    method_limits: dict[str, int] = Field(default_factory=dict)
    warm_shared_prompts: bool = False
    metrics_address: str | None = None
    metrics_public: bool = False

    @model_validator(mode="after")
    def _check_limits(self) -> Self:
        if self.max_request_tokens < 2:
            raise config_error(
                "max_request_tokens", "be >= 2 (one sequence of two ids)", self.max_request_tokens
            )
        for method, limit in self.method_limits.items():
            if not method.startswith("/") or limit < 1:
                raise config_error(
                    f"method_limits[{method!r}]",
                    "map a full method name ('/package.Service/Method') to a limit >= 1",
                    limit,
                )
        if self.metrics_address is not None:
            host, _ = split_address(self.metrics_address)
            if not self.metrics_public and not is_loopback(host):
                raise config_error(
                    "metrics_address",
                    "be loopback unless metrics_public is set (the endpoint has no auth)",
                    self.metrics_address,
                )
        return self

    @property
    def max_receive_bytes(self) -> int:
        """The largest request body accepted: the largest valid ``ScoreRequest`` (ids,
        candidate ids, per-sequence framing) or ``ScoreTextRequest`` (text), plus slack."""
        score = (
            self.max_request_tokens * _BYTES_PER_ID
            + self.max_request_candidate_ids * _BYTES_PER_ID
            + 2 * self.max_request_sequences * _BYTES_PER_SEQUENCE
        )
        text = self.max_request_text_bytes + self.max_request_sequences * _BYTES_PER_SEQUENCE
        return max(score, text) + 4096


class ScoreVariant(NamedTuple):
    """How a batch is scored; requests share a batch only when equal: the shared prompt's
    ids (None: whole sequences), ``top_k`` (0: none) and ``candidates`` (K; 0: none)."""

    prompt: tuple[int, ...] | None
    top_k: int
    candidates: int


@dataclasses.dataclass(frozen=True)
class ScoreItem:
    """One sequence (or continuation) to score and its candidate ids ``[n - 1, K]``."""

    ids: np.ndarray
    candidate_ids: np.ndarray | None
    length: int  # the scored length, shared prompt included


@dataclasses.dataclass(frozen=True)
class ParsedScore:
    variant: ScoreVariant
    items: list[ScoreItem]


def _largest(buckets: tuple[int, ...] | None, fallback: int) -> int:
    return fallback if not buckets else max(buckets)


def validate_score_request(
    request: teacher_pb2.ScoreRequest,
    info: TeacherInfo,
    config: TeacherServerConfig,
    *,
    top_k_buckets: tuple[int, ...] | None = None,
    candidate_buckets: tuple[int, ...] | None = None,
) -> ParsedScore:
    """The request as a :class:`ParsedScore`, or a
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
    vocab, top_k, candidates = info.vocab_size, request.top_k, request.candidates
    top_limit = min(vocab, _largest(top_k_buckets, vocab))
    if not 0 <= top_k <= top_limit:
        bucket = "" if top_limit == vocab else ", the largest compiled top-k bucket"
        raise StatusError(
            invalid, f"`top_k` must be in [0, {top_limit}] (0: none{bucket}); received {top_k}"
        )
    candidate_limit = _largest(candidate_buckets, _MAX_CANDIDATES)
    if not 0 <= candidates <= candidate_limit:
        raise StatusError(
            invalid,
            f"`candidates` must be in [0, {candidate_limit}] (0: none; the largest compiled "
            f"candidate bucket); received {candidates}",
        )
    shared = request.HasField("shared_prompt")
    prompt = np.asarray(request.shared_prompt.ids, np.int64) if shared else None
    prompt_length = 0 if prompt is None else prompt.size
    if shared and prompt_length == 0:
        raise StatusError(invalid, "`shared_prompt.ids` must hold at least 1 id; received 0")
    total = prompt_length + sum(len(sequence.ids) for sequence in request.sequences)
    if total > config.max_request_tokens:
        raise StatusError(
            exhausted,
            f"`sequences` must hold at most {config.max_request_tokens} ids in all (server "
            f"limit max_request_tokens); received {total}",
        )
    if shared:
        for index, sequence in enumerate(request.sequences):
            if len(sequence.ids) < 1:
                raise StatusError(
                    invalid,
                    f"`sequences[{index}].ids` must hold at least 1 id (a continuation of "
                    "shared_prompt); received 0",
                )
        full = [np.concatenate([prompt, np.asarray(s.ids, np.int64)]) for s in request.sequences]
        field = "shared_prompt + sequences[{index}].ids"
    else:
        full = [sequence.ids for sequence in request.sequences]
        field = "sequences[{index}].ids"
    try:
        sequences = check_sequences(full, info, field=field)
    except ValueError as error:
        raise StatusError(invalid, str(error)) from None
    positions = sum(len(ids) - 1 for ids in sequences)
    candidate_arrays: list[np.ndarray | None] = [None] * count
    if candidates:
        if len(request.candidate_ids) != count:
            raise StatusError(
                invalid,
                f"`candidate_ids` must hold one entry per sequence ({count}); received "
                f"{len(request.candidate_ids)}",
            )
        if positions * candidates > config.max_request_candidate_ids:
            raise StatusError(
                exhausted,
                f"`candidate_ids` must hold at most {config.max_request_candidate_ids} ids in "
                f"all (server limit max_request_candidate_ids); received "
                f"{positions * candidates}",
            )
        for index, (entry, ids) in enumerate(zip(request.candidate_ids, sequences, strict=True)):
            chosen = np.asarray(entry.ids, np.int64)
            want = (len(ids) - 1) * candidates
            if chosen.size != want:
                raise StatusError(
                    invalid,
                    f"`candidate_ids[{index}].ids` must hold (n - 1) x candidates = {want} ids; "
                    f"received {chosen.size}",
                )
            bad = np.flatnonzero((chosen < 0) | (chosen >= vocab))
            if bad.size:
                raise StatusError(
                    invalid,
                    f"`candidate_ids[{index}].ids` must hold ids in [0, {vocab}); received "
                    f"{int(chosen[bad[0]])} at entry {int(bad[0])}",
                )
            candidate_arrays[index] = chosen.astype(np.int32).reshape(len(ids) - 1, candidates)
    elif len(request.candidate_ids):
        raise StatusError(
            invalid,
            "`candidate_ids` must be empty when candidates is 0; received "
            f"{len(request.candidate_ids)} entries",
        )
    size = count * _BYTES_PER_SEQUENCE + positions * (
        _BYTES_PER_POSITION + top_k * _BYTES_PER_TOP_ENTRY + candidates * _BYTES_PER_CANDIDATE
    )
    if size > config.max_message_bytes:
        raise StatusError(
            exhausted,
            f"`top_k` must keep the response within max_message_bytes="
            f"{config.max_message_bytes}; received top_k={top_k}, candidates={candidates} for "
            f"{positions} positions (up to {size} bytes): lower them or split the request",
        )
    variant = ScoreVariant(
        None if prompt is None else tuple(int(i) for i in prompt), top_k, candidates
    )
    items = []
    for ids, chosen in zip(sequences, candidate_arrays, strict=True):
        scored = ids if prompt is None else ids[prompt_length:]
        items.append(ScoreItem(scored, chosen, len(ids)))
    return ParsedScore(variant, items)


class TeacherMetrics(RpcMetrics):
    """The server's :class:`~services.common.metrics.RpcMetrics` plus the teacher's own:
    ``distill_teacher_batch_rows`` (real rows per call), ``distill_teacher_batch_fill``
    (real tokens / padded tokens per call), ``distill_teacher_scored_tokens_total``
    (positions scored; its rate is tokens/s), ``distill_teacher_queue_requests`` (waiting
    now) and ``distill_teacher_compiles`` (shapes the teacher compiled so far)."""

    def __init__(self):
        super().__init__()
        self.batch_rows = Histogram(
            "distill_teacher_batch_rows",
            "Real (non-filler) rows per teacher call.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )
        self.batch_fill = Histogram(
            "distill_teacher_batch_fill",
            "Real tokens over padded tokens (rows x longest) per teacher call.",
            buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=self.registry,
        )
        self.scored_tokens = Counter(
            "distill_teacher_scored_tokens",
            "Positions scored (one per next-token log-prob answered).",
            registry=self.registry,
        )
        self.queue_requests = Gauge(
            "distill_teacher_queue_requests",
            "Requests waiting for a batch.",
            registry=self.registry,
        )
        self.compiles = Gauge(
            "distill_teacher_compiles",
            "Distinct shapes the teacher has compiled since it started (-1: not reported).",
            registry=self.registry,
        )

    def batch(self, rows: int, padded_rows: int, items) -> None:
        lengths = [item.length for item in items]
        self.batch_rows.observe(rows)
        self.batch_fill.observe(sum(lengths) / max(1, padded_rows * max(lengths)))
        self.scored_tokens.inc(sum(length - 1 for length in lengths))


def _filler(variant: ScoreVariant) -> ScoreItem:
    """A filler row for row buckets: the shortest valid item of ``variant``."""
    ids = np.zeros(1 if variant.prompt is not None else 2, np.int32)
    length = ids.size + (0 if variant.prompt is None else len(variant.prompt))
    chosen = None
    if variant.candidates:
        chosen = np.zeros((length - 1, variant.candidates), np.int32)
    return ScoreItem(ids, chosen, length)


def _score_items(teacher: Teacher, items: list[ScoreItem], variant: ScoreVariant):
    """One teacher call for a batch of one variant (runs on the batcher's thread)."""
    options: dict = {"top_k": variant.top_k or None}
    if variant.candidates:  # only then: a teacher without candidate scoring still serves
        options["candidate_ids"] = [item.candidate_ids for item in items]
    ids = [item.ids for item in items]
    if variant.prompt is None:
        return teacher.score(ids, **options)
    return teacher.score_shared(np.asarray(variant.prompt, np.int32), ids, **options)


class _BatchedTeacher:
    """The served teacher as a blocking :class:`Teacher` whose calls go through the batcher
    (so text scoring, run on a worker thread, shares batches with ``Score`` and the teacher
    is still called from one thread only)."""

    def __init__(self, servicer: TeacherServicer):
        self._servicer = servicer

    def info(self) -> TeacherInfo:
        return self._servicer.info

    def score(self, sequences, *, top_k=None) -> list[ScoredSequence]:
        items = [ScoreItem(np.asarray(ids, np.int32), None, len(ids)) for ids in sequences]
        # No timeout here: the caller's deadline is enforced where it waits (ScoreText),
        # and a stopping batcher still scores or fails what it holds.
        return self._servicer.batcher.submit(items, ScoreVariant(None, top_k or 0, 0)).result()


async def _abort(context: grpc.aio.ServicerContext, error: BaseException, failed: str = "handler"):
    await context.abort(status_of(error), reason_of(error, failed=failed))


class TeacherServicer(teacher_pb2_grpc.TeacherServiceServicer):
    """``TeacherService`` over ``teacher`` on ``grpc.aio``, batching concurrent ``Score``
    calls on one worker thread. Call :meth:`close` after the server stopped
    (``serve_teacher`` does)."""

    def __init__(
        self,
        teacher: Teacher,
        config: TeacherServerConfig,
        metrics: TeacherMetrics,
        tokenizer: Tokenizer | None = None,
    ):
        self.teacher = teacher
        self.config = config
        self.metrics = metrics
        self.info = teacher.info()
        # Set once the warm-up is done: until then Score is UNAVAILABLE (health says
        # NOT_SERVING), so the teacher is never called from the warm-up and the batcher at once.
        self.ready = False
        shapes = getattr(teacher, "shapes", None)
        self.top_k_buckets = None if shapes is None else tuple(shapes.top_ks)
        self.candidate_buckets = None if shapes is None else tuple(shapes.candidates)
        message = info_to_proto(self.info)
        message.top_k_buckets.extend(self.top_k_buckets or ())
        message.candidate_buckets.extend(self.candidate_buckets or ())
        # Text scoring needs the teacher's own tokenizer (checked against its hash here).
        self.text_teacher = (
            None if tokenizer is None else CrossTokenizerTeacher(_BatchedTeacher(self), tokenizer)
        )
        message.scores_text = self.text_teacher is not None
        self._info_message = message
        self.batcher: DynamicBatcher = DynamicBatcher(
            lambda items, variant: _score_items(teacher, items, variant),
            max_batch_sequences=config.max_batch_sequences,
            max_batch_tokens=config.max_batch_tokens,
            max_delay_s=config.max_delay_ms / 1000,
            max_queue_requests=config.max_queue_requests,
            bucket_rows=config.bucket_rows,
            filler=_filler,
            length=lambda item: item.length,
            name="teacher-batcher",
            on_batch=metrics.batch,
        )
        metrics.queue_requests.set_function(lambda: self.batcher.stats().queued)
        compile_count = getattr(teacher, "compile_count", None)
        metrics.compiles.set_function(lambda: -1 if compile_count is None else compile_count())

    def close(self) -> None:
        self.batcher.stop()

    async def Info(self, request: teacher_pb2.InfoRequest, context: grpc.aio.ServicerContext):
        return self._info_message

    async def Score(self, request: teacher_pb2.ScoreRequest, context: grpc.aio.ServicerContext):
        try:
            if not self.ready:
                raise Unavailable(
                    "`teacher` must finish its warm-up (compiling every bucketed shape) "
                    "before scoring; received a call during it: retry later"
                )
            parsed = validate_score_request(
                request,
                self.info,
                self.config,
                top_k_buckets=self.top_k_buckets,
                candidate_buckets=self.candidate_buckets,
            )
            # A full queue or a stopping batcher is Unavailable: clients retry with backoff
            # (a request over a limit is RESOURCE_EXHAUSTED: it would fail the same way).
            future = self.batcher.submit(parsed.items, parsed.variant)
        except Exception as error:
            await _abort(context, error)
        remaining = context.time_remaining()
        try:
            # wrap_future: cancelling the wait (the caller went away) cancels the queued
            # request, whose sequences not yet in a batch are then dropped.
            results = await asyncio.wait_for(asyncio.wrap_future(future), remaining)
        except TimeoutError:
            future.cancel()
            await _abort(
                context,
                StatusError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "`deadline` must leave time to score the request; it passed while queued",
                ),
            )
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as error:
            # A ValueError is the teacher refusing what validation let through
            # (INVALID_ARGUMENT); anything else is the teacher failing (INTERNAL).
            await _abort(context, error, failed="teacher")
        variant = parsed.variant
        response = teacher_pb2.ScoreResponse(top_k=variant.top_k, candidates=variant.candidates)
        try:
            response.sequences.extend(
                scored_to_proto(scored, item.length, variant.top_k, variant.candidates)
                for scored, item in zip(results, parsed.items, strict=True)
            )
        except ValueError as error:
            await _abort(
                context, StatusError(grpc.StatusCode.INTERNAL, f"teacher answered badly: {error}")
            )
        return response

    def _score_text(self, pairs: tuple[list[str], list[str], list[bool]]):
        prompts, completions, stopped = pairs
        return self.text_teacher.score_text(prompts, completions, stopped=stopped)

    async def ScoreText(
        self, request: teacher_pb2.ScoreTextRequest, context: grpc.aio.ServicerContext
    ):
        try:
            if not self.ready:
                raise Unavailable(
                    "`teacher` must finish its warm-up before scoring; received a call during "
                    "it: retry later"
                )
            if self.text_teacher is None:
                raise StatusError(
                    grpc.StatusCode.UNIMPLEMENTED,
                    "`ScoreText` must be served with the teacher's tokenizer; this server has "
                    "none (Info.scores_text is false)",
                )
            pairs = validate_text_request(request, self.config)
        except Exception as error:
            await _abort(context, error)
        try:
            # Tokenizing and waiting for the batch happen on a worker thread, off the loop.
            results = await asyncio.wait_for(
                asyncio.to_thread(self._score_text, pairs), context.time_remaining()
            )
        except TimeoutError:
            await _abort(
                context,
                StatusError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "`deadline` must leave time to score the request; it passed while queued",
                ),
            )
        except Exception as error:
            await _abort(context, error, failed="teacher")
        return teacher_pb2.ScoreTextResponse(
            scores=[text_scores_to_proto(result) for result in results]
        )


def validate_text_request(
    request: teacher_pb2.ScoreTextRequest, config: TeacherServerConfig
) -> tuple[list[str], list[str], list[bool]]:
    """``(prompts, completions, stopped)`` of a ``ScoreTextRequest``, or a
    :class:`~services.common.status.StatusError`: at least one pair, at most
    ``max_request_sequences`` pairs and ``max_request_text_bytes`` of text."""
    count = len(request.pairs)
    if count == 0:
        raise StatusError(
            grpc.StatusCode.INVALID_ARGUMENT, "`pairs` must hold at least one pair; received 0"
        )
    if count > config.max_request_sequences:
        raise StatusError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"`pairs` must hold at most {config.max_request_sequences} pairs per request "
            f"(server limit max_request_sequences); received {count}",
        )
    size = sum(len(pair.prompt.encode()) + len(pair.completion.encode()) for pair in request.pairs)
    if size > config.max_request_text_bytes:
        raise StatusError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"`pairs` must hold at most {config.max_request_text_bytes} bytes of text (server "
            f"limit max_request_text_bytes); received {size}",
        )
    try:
        return check_text_pairs(
            [pair.prompt for pair in request.pairs],
            [pair.completion for pair in request.pairs],
            [pair.stopped for pair in request.pairs],
        )
    except ValueError as error:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None


@dataclasses.dataclass
class TeacherServer:
    """A running teacher server: ``port``, ``address`` (bound ``host:port``), ``info``,
    ``stats()`` (batching counters), ``metrics`` (Prometheus registry and values),
    ``metrics_endpoint`` (when ``metrics_address`` is set), ``stop()`` (graceful; health
    turns ``NOT_SERVING`` first; idempotent), ``wait()``."""

    running: AsyncRunningServer
    servicer: TeacherServicer
    metrics: TeacherMetrics
    metrics_endpoint: MetricsEndpoint | None = None

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
        try:
            self.running.stop(grace_s)
        finally:
            if self.metrics_endpoint is not None:
                self.metrics_endpoint.stop()
                self.metrics_endpoint = None

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.running.wait(timeout_s)

    def __enter__(self) -> TeacherServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_teacher(
    teacher: Teacher,
    config: TeacherServerConfig | None = None,
    *,
    tokenizer: Tokenizer | None = None,
) -> TeacherServer:
    """Serve ``teacher`` on ``config.address`` (default ``127.0.0.1:0``: loopback, a free
    port) until ``stop()``. Health reports ``NOT_SERVING`` while the teacher's ``warm_up()``
    (when it has one) compiles every bucketed shape, then ``SERVING``; returns after that.
    ``ScoreText`` is served with ``tokenizer`` (default: the teacher's ``tokenizer``
    attribute, as an ``InProcessTeacher`` has)."""
    config = TeacherServerConfig() if config is None else config
    metrics = TeacherMetrics()
    tokenizer = getattr(teacher, "tokenizer", None) if tokenizer is None else tokenizer
    servicer = TeacherServicer(teacher, config, metrics, tokenizer)
    try:
        running = start_aio_server(
            config,
            lambda server: teacher_pb2_grpc.add_TeacherServiceServicer_to_server(servicer, server),
            [SERVICE_NAME],
            max_receive_bytes=config.max_receive_bytes,
            method_limits=config.method_limits,
            observe=metrics.observe,
            on_malformed=metrics.malformed,
            on_stop=servicer.close,
            serving=False,
        )
    except BaseException:
        servicer.close()
        raise
    server = TeacherServer(running, servicer, metrics)
    try:
        warm_up = getattr(teacher, "warm_up", None)
        if warm_up is not None:
            # On this thread: Score refuses calls until it ends (servicer.ready).
            warm_up(**({"shared": True} if config.warm_shared_prompts else {}))
        servicer.ready = True
        if config.metrics_address is not None:
            server.metrics_endpoint = serve_metrics(metrics.registry, config.metrics_address)
        running.set_serving(True)
    except BaseException:
        server.stop(0)
        raise
    return server
