"""``RemoteTeacher``: the :class:`distill.teacher.Teacher` protocol over gRPC.

A learner holding a ``RemoteTeacher`` calls ``info()`` and ``score()`` exactly as it would an
``InProcessTeacher``; the scores are the same float32 values. Each call has a deadline
(``timeout_s``); a call that finds the server ``UNAVAILABLE`` (not started yet, restarting,
connection dropped, queue full) is retried ``retries`` more times with exponential backoff
and jitter. Other statuses are not retried: they would fail the same way again. A batch
larger than one request may be is split into several requests. A refused call raises
:class:`TeacherServerError` whose message starts with the server's reason ("`field` must
...; received ..."); ``INVALID_ARGUMENT`` raises :class:`InvalidTeacherRequest`, which is also
a ``ValueError`` like the in-process teacher's refusals.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from distill.teacher import ScoredSequence, TeacherInfo
from services.auth import bearer_metadata
from services.proto import teacher_pb2, teacher_pb2_grpc
from services.teacher_messages import info_from_proto, scored_from_proto

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
    """A :class:`~distill.teacher.Teacher` served at ``address`` (``host:port``).

    ``token``: bearer token (read one with :func:`services.auth.read_token`).
    ``tls_root_cert_file``: PEM roots to verify a TLS server with (``None``: plaintext, for
    loopback or a trusted network); ``tls_server_name`` overrides the name checked against
    its certificate. ``timeout_s``: deadline of each attempt. ``retries``: extra attempts
    after ``UNAVAILABLE``, waiting ``backoff_s * 2**attempt`` (at most ``max_backoff_s``,
    times a random factor in [0.5, 1] so many clients do not retry in lockstep).
    ``max_message_bytes``, ``max_request_sequences`` and ``max_request_tokens`` should match
    the server's: :meth:`score` splits a large batch into requests within them (a learner's
    batch is often larger than one request may be).
    """

    def __init__(
        self,
        address: str,
        *,
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
        if not timeout_s > 0:
            raise ValueError(f"`timeout_s` must be > 0; received {timeout_s!r}")
        if retries < 0:
            raise ValueError(f"`retries` must be >= 0; received {retries!r}")
        if not 0 <= backoff_s <= max_backoff_s:
            raise ValueError(
                f"`backoff_s` must be in [0, max_backoff_s={max_backoff_s}]; received {backoff_s!r}"
            )
        for field, value in (
            ("max_request_sequences", max_request_sequences),
            ("max_request_tokens", max_request_tokens),
            ("max_message_bytes", max_message_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{field}` must be a positive int; received {value!r}")
        if tls_server_name is not None and tls_root_cert_file is None:
            raise ValueError(
                "`tls_root_cert_file` must be given with tls_server_name (a name override "
                "on a plaintext channel would verify nothing); received None"
            )
        self.address = address
        self.max_request_sequences = max_request_sequences
        self.max_request_tokens = max_request_tokens
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._metadata = bearer_metadata(token)
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls_server_name is not None:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls_root_cert_file is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            roots = Path(tls_root_cert_file).read_bytes()
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
            self._channel = grpc.secure_channel(address, credentials, options=options)
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
        attempt = 0
        while True:
            try:
                return method(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as error:
                code = error.code()
                if code == grpc.StatusCode.UNAVAILABLE and attempt < self.retries:
                    delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                    time.sleep(delay * random.uniform(0.5, 1.0))
                    attempt += 1
                    continue
                kind = (
                    InvalidTeacherRequest
                    if code == grpc.StatusCode.INVALID_ARGUMENT
                    else TeacherServerError
                )
                raise kind(code, error.details() or "", self.address, attempt + 1) from None
