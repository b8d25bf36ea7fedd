"""``RemoteTeacher``: the :class:`distill.teacher_contract.Teacher` protocol over gRPC.

A learner holding a ``RemoteTeacher`` calls ``info()`` and ``score()`` exactly as it would an
``InProcessTeacher``; the scores are the same float32 values. It reaches one server
(``address``) or several replicas of one teacher (``addresses``) through one channel that
sends consecutive calls round-robin to the ready replicas (see
:mod:`services.common.channel`). Each call has a deadline (``timeout_s``); a call that finds
the server ``UNAVAILABLE`` (not started yet, restarting, connection dropped, queue full) is
retried ``retries`` more times with exponential backoff and jitter. Other statuses are not
retried: they would fail the same way again. A batch larger than one request may be is split
into several requests. A refused call raises :class:`TeacherServerError` whose message starts
with the server's reason ("`field` must ...; received ..."); ``INVALID_ARGUMENT`` raises
:class:`InvalidTeacherRequest`, which is also a ``ValueError`` like the in-process teacher's
refusals.

Only the contract (:mod:`distill.teacher_contract`) is imported from ``distill``, so a
process that only calls a teacher server does not load JAX.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from distill.teacher_contract import ScoredSequence, TeacherInfo
from services.common.auth import bearer_metadata
from services.common.channel import call_with_retry, channel_target, open_channel
from services.common.config import RetryPolicy
from services.proto import teacher_pb2, teacher_pb2_grpc
from services.teacher.messages import info_from_proto, scored_from_proto

_T = TypeVar("_T")


class TeacherServerError(RuntimeError):
    """A call to the teacher server failed: ``code`` (``grpc.StatusCode``) and ``reason``
    (the server's details)."""

    def __init__(self, code: grpc.StatusCode, reason: str, address: str, attempts: int = 1):
        tried = "" if attempts == 1 else f", {attempts} attempts"
        super().__init__(f"{reason} [teacher server {address}: {code.name}{tried}]")
        self.code = code
        self.reason = reason
        self.address = address


class InvalidTeacherRequest(TeacherServerError, ValueError):
    """The server refused the request as malformed (``INVALID_ARGUMENT``)."""


class RemoteTeacher:
    """A :class:`~distill.teacher_contract.Teacher` served at ``address`` (``host:port``), or
    by the replicas at ``addresses`` (one of the two).

    ``addresses``: several ``host:port`` with IP literals of one family, or one DNS name
    that resolves to every replica (see :func:`services.common.channel.channel_target`);
    they share one channel, which sends consecutive calls to the next ready replica
    (``round_robin``), so a replica that is down or restarting is skipped, and a call that
    finds one ``UNAVAILABLE`` is retried on another. Every replica must serve the same
    teacher (same :meth:`info`).
    ``token``: bearer token (read one with :func:`services.common.auth.read_token`).
    ``tls_root_cert_file``: PEM roots to verify a TLS server with (``None``: plaintext, for
    loopback or a trusted network); ``tls_server_name`` overrides the name checked against
    its certificate. ``timeout_s``: deadline of each attempt. ``retries``: extra attempts
    after ``UNAVAILABLE``, waiting ``backoff_s * 2**attempt`` (at most ``max_backoff_s``,
    times a random factor in [0.5, 1] so many clients do not retry in lockstep; see
    :class:`~services.common.config.RetryPolicy`).
    ``max_message_bytes``, ``max_request_sequences`` and ``max_request_tokens`` should match
    the server's: :meth:`score` splits a large batch into requests within them (a learner's
    batch is often larger than one request may be).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        addresses: Sequence[str] | None = None,
        token: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 4,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        tls_root_cert_file: str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
        max_message_bytes: int = 64 << 20,
        max_request_sequences: int = 256,
        max_request_tokens: int = 65536,
    ):
        if (address is None) == (addresses is None):
            raise ValueError(
                "`address` or `addresses` must be given, not both; received "
                f"address={address!r}, addresses={addresses!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"`timeout_s` must be > 0; received {timeout_s!r}")
        self.retry_policy = RetryPolicy(
            retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s
        )
        for field, value in (
            ("max_request_sequences", max_request_sequences),
            ("max_request_tokens", max_request_tokens),
            ("max_message_bytes", max_message_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{field}` must be a positive int; received {value!r}")
        if addresses is None:
            self.addresses: tuple[str, ...] = (address,)
            target, lb_policy = address, None
        else:
            target, lb_policy = channel_target(addresses), "round_robin"
            self.addresses = tuple(addresses)
        #: The server(s), as error messages name them.
        self.address = ",".join(self.addresses)
        self.max_request_sequences = max_request_sequences
        self.max_request_tokens = max_request_tokens
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self._metadata = bearer_metadata(token)
        self._channel = open_channel(
            target,
            max_message_bytes=max_message_bytes,
            tls_root_cert_file=tls_root_cert_file,
            tls_server_name=tls_server_name,
            lb_policy=lb_policy,
        )
        self._stub = teacher_pb2_grpc.TeacherServiceStub(self._channel)

    def info(self) -> TeacherInfo:
        """The served teacher's vocabulary, special ids, hashes and max length."""
        return info_from_proto(self._call(self._stub.Info, teacher_pb2.InfoRequest()))

    def score(
        self, sequences: Sequence[Sequence[int]], *, top_k: int | None = None
    ) -> list[ScoredSequence]:
        """As :meth:`distill.teacher.InProcessTeacher.score`: per sequence of n ids, the
        ``[n - 1]`` log-probs of each next token, plus ``[n - 1, top_k]`` top ids/log-probs."""
        if top_k is not None and (isinstance(top_k, bool) or top_k < 1):
            raise ValueError(f"`top_k` must be None or >= 1; received {top_k!r}")
        out: list[ScoredSequence] = []
        for start, end in self._request_ranges(sequences, top_k or 0):
            out += self._score_request(sequences[start:end], top_k)
        return out

    def _request_ranges(
        self, sequences: Sequence[Sequence[int]], top_k: int
    ) -> list[tuple[int, int]]:
        """Consecutive ranges of ``sequences`` that each fit the request limits (sequences,
        ids, and an estimated response of at most half ``max_message_bytes``). A sequence
        too large on its own goes alone, and the server's refusal names the limit."""
        per_position = 5 + 9 * top_k  # float32 log-prob + top-k ids and log-probs, varints
        budget = self.max_message_bytes // 2
        ranges, start, tokens, size = [], 0, 0, 0
        for index, sequence in enumerate(sequences):
            length, cost = len(sequence), max(len(sequence) - 1, 0) * per_position
            full = (
                index - start + 1 > self.max_request_sequences
                or tokens + length > self.max_request_tokens
                or size + cost > budget
            )
            if index > start and full:
                ranges.append((start, index))
                start, tokens, size = index, 0, 0
            tokens, size = tokens + length, size + cost
        if len(sequences) > start or not ranges:
            ranges.append((start, len(sequences)))
        return ranges

    def _score_request(
        self, sequences: Sequence[Sequence[int]], top_k: int | None
    ) -> list[ScoredSequence]:
        lengths = [len(sequence) for sequence in sequences]
        request = teacher_pb2.ScoreRequest(
            sequences=[teacher_pb2.TokenSequence(ids=list(map(int, s))) for s in sequences],
            top_k=top_k or 0,
        )
        response = self._call(self._stub.Score, request)
        if len(response.sequences) != len(lengths):
            raise TeacherServerError(
                grpc.StatusCode.INTERNAL,
                f"`sequences` must hold {len(lengths)} results; received {len(response.sequences)}",
                self.address,
            )
        try:
            return [
                scored_from_proto(message, length, top_k or 0)
                for message, length in zip(response.sequences, lengths, strict=True)
            ]
        except ValueError as error:
            raise TeacherServerError(grpc.StatusCode.INTERNAL, str(error), self.address) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RemoteTeacher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Callable[..., _T], request: object) -> _T:
        return call_with_retry(
            method,
            request,
            timeout_s=self.timeout_s,
            metadata=self._metadata,
            policy=self.retry_policy,
            describe=self._error,
        )

    def _error(self, code: grpc.StatusCode, reason: str, attempts: int) -> TeacherServerError:
        kind = (
            InvalidTeacherRequest
            if code == grpc.StatusCode.INVALID_ARGUMENT
            else TeacherServerError
        )
        return kind(code, reason, self.address, attempts)
