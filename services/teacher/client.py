"""``RemoteTeacher``: the :class:`distill.teacher_contract.Teacher` protocol over gRPC.

A learner holding a ``RemoteTeacher`` calls ``info()`` and ``score()`` exactly as it would an
``InProcessTeacher``; the scores are the same float32 values. It reaches one server
(``address``) or several replicas of one teacher (``addresses``) through one channel that
sends consecutive calls round-robin to the ready replicas (see
:mod:`services.common.channel`). Each call has a deadline (``timeout_s``); a call that finds
the server away (``UNAVAILABLE``: not started yet, restarting, stopping, connection dropped,
queue full; gRPC's own overload refusal; a call the server cancelled while stopping) is
retried with exponential backoff and jitter for up to ``budget_s`` seconds (30 s by
default, enough for a replica to restart), then fails naming the address, the attempts and
the time spent. Other statuses are not retried: they would fail the same way again. A batch larger than one request may be is split
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
import numpy as np

from distill.cross_tokenizer import TextScores, check_text_pairs
from distill.teacher_contract import ScoredSequence, TeacherInfo
from services.common.auth import bearer_metadata
from services.common.channel import CallFailure, call_with_retry, channel_target, open_channel
from services.common.config import RetryPolicy
from services.proto import teacher_pb2, teacher_pb2_grpc
from services.teacher.messages import info_from_proto, scored_from_proto, text_scores_from_proto

_T = TypeVar("_T")


class TeacherServerError(RuntimeError):
    """A call to the teacher server failed: ``code`` (``grpc.StatusCode``), ``reason`` (the
    server's details), ``address``, ``attempts`` and ``elapsed_s`` (seconds since the first
    attempt began). The message starts with the reason; after retries it ends with the
    attempts, the seconds and the limit that ended them (``gave_up``, e.g. "retry budget
    spent (budget_s=30)")."""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str,
        address: str,
        attempts: int = 1,
        *,
        elapsed_s: float | None = None,
        gave_up: str | None = None,
    ):
        tried = ""
        if attempts > 1 or gave_up is not None:
            tried = f"; {attempts} attempt{'' if attempts == 1 else 's'}"
            if elapsed_s is not None:
                tried += f" in {elapsed_s:.1f} s"
            if gave_up is not None:
                tried += f", {gave_up}"
        super().__init__(f"{reason} [teacher server {address}: {code.name}{tried}]")
        self.code = code
        self.reason = reason
        self.address = address
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.gave_up = gave_up

    def __reduce__(self):
        # Pickled across processes (a Ray actor's error reaches the driver) with every field.
        arguments = (self.code, self.reason, self.address, self.attempts)
        return _rebuild_error, (type(self), arguments, self.elapsed_s, self.gave_up)


def _rebuild_error(kind, arguments, elapsed_s, gave_up):
    return kind(*arguments, elapsed_s=elapsed_s, gave_up=gave_up)


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
    its certificate. ``timeout_s``: deadline of each attempt. Retries (see
    :class:`~services.common.config.RetryPolicy` and
    :func:`services.common.channel.call_with_retry`): after a transient failure wait
    ``backoff_s * 2**attempt`` (at most ``max_backoff_s``, times a random factor in
    [0.5, 1] so many clients do not retry in lockstep) and try again, until ``budget_s``
    seconds have passed since the call first failed or ``retries`` extra attempts were
    made (``None``: no count limit). ``retry_policy`` gives all four at once instead.
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
        retries: int | None = None,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
        budget_s: float = 30.0,
        retry_policy: RetryPolicy | None = None,
        tls_root_cert_file: str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
        max_message_bytes: int = 64 << 20,
        max_request_sequences: int = 256,
        max_request_tokens: int = 65536,
        max_request_candidate_ids: int = 524288,
        max_request_text_bytes: int = 1 << 20,
    ):
        if (address is None) == (addresses is None):
            raise ValueError(
                "`address` or `addresses` must be given, not both; received "
                f"address={address!r}, addresses={addresses!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"`timeout_s` must be > 0; received {timeout_s!r}")
        self.retry_policy = retry_policy or RetryPolicy(
            retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s, budget_s=budget_s
        )
        for field, value in (
            ("max_request_sequences", max_request_sequences),
            ("max_request_tokens", max_request_tokens),
            ("max_request_candidate_ids", max_request_candidate_ids),
            ("max_request_text_bytes", max_request_text_bytes),
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
        self.max_request_candidate_ids = max_request_candidate_ids
        self.max_request_text_bytes = max_request_text_bytes
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
        self,
        sequences: Sequence[Sequence[int]],
        *,
        top_k: int | None = None,
        candidate_ids: Sequence[np.ndarray] | None = None,
    ) -> list[ScoredSequence]:
        """As :meth:`distill.teacher.InProcessTeacher.score`: per sequence of n ids, the
        ``[n - 1]`` log-probs of each next token, plus ``[n - 1, top_k]`` top ids/log-probs,
        plus ``[n - 1, K]`` log-probs at ``candidate_ids`` (one ``[n - 1, K]`` int array per
        sequence, one K for all)."""
        top_k, width = _check_options(top_k, candidate_ids, len(sequences))
        out: list[ScoredSequence] = []
        for start, end in self._request_ranges(sequences, top_k, width):
            chosen = None if candidate_ids is None else candidate_ids[start:end]
            out += self._score_request(sequences[start:end], top_k, chosen)
        return out

    def score_shared(
        self,
        prompt: Sequence[int],
        continuations: Sequence[Sequence[int]],
        *,
        top_k: int | None = None,
        candidate_ids: Sequence[np.ndarray] | None = None,
    ) -> list[ScoredSequence]:
        """As :meth:`distill.teacher.InProcessTeacher.score_shared`: the scores of each
        ``prompt + continuation`` (``[P + C - 1]`` entries), the prompt prefilled once per
        request on the server. ``candidate_ids``: one ``[P + C - 1, K]`` array per
        continuation."""
        top_k, width = _check_options(top_k, candidate_ids, len(continuations))
        prompt = [int(i) for i in prompt]
        out: list[ScoredSequence] = []
        for start, end in self._request_ranges(continuations, top_k, width, len(prompt)):
            chosen = None if candidate_ids is None else candidate_ids[start:end]
            out += self._score_request(continuations[start:end], top_k, chosen, prompt)
        return out

    def score_text(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        *,
        stopped: Sequence[bool] | None = None,
    ) -> list[TextScores]:
        """The :class:`~distill.cross_tokenizer.TextTeacher` protocol over the ``ScoreText``
        RPC: the teacher tokenizes and scores each pair with its own tokenizer. Pairs are
        split into requests within ``max_request_sequences`` and ``max_request_text_bytes``."""
        prompts, completions, flags = check_text_pairs(prompts, completions, stopped)
        out: list[TextScores] = []
        start, size = 0, 0
        for index in range(len(completions) + 1):
            cost = (
                0
                if index == len(completions)
                else (len(prompts[index].encode()) + len(completions[index].encode()))
            )
            full = index - start + 1 > self.max_request_sequences or (
                size + cost > self.max_request_text_bytes
            )
            if index == len(completions) or (index > start and full):
                request = teacher_pb2.ScoreTextRequest(
                    pairs=[
                        teacher_pb2.TextPair(prompt=p, completion=c, stopped=f)
                        for p, c, f in zip(
                            prompts[start:index],
                            completions[start:index],
                            flags[start:index],
                            strict=True,
                        )
                    ]
                )
                response = self._call(self._stub.ScoreText, request)
                if len(response.scores) != index - start:
                    raise TeacherServerError(
                        grpc.StatusCode.INTERNAL,
                        f"`scores` must hold {index - start} results; received "
                        f"{len(response.scores)}",
                        self.address,
                    )
                try:
                    out += [text_scores_from_proto(message) for message in response.scores]
                except ValueError as error:
                    raise TeacherServerError(
                        grpc.StatusCode.INTERNAL, str(error), self.address
                    ) from None
                start, size = index, 0
            size += cost
        return out

    def _request_ranges(
        self,
        sequences: Sequence[Sequence[int]],
        top_k: int,
        candidates: int = 0,
        prompt_length: int = 0,
    ) -> list[tuple[int, int]]:
        """Consecutive ranges of ``sequences`` that each fit the request limits (sequences,
        ids, candidate ids, and an estimated response of at most half ``max_message_bytes``).
        A sequence too large on its own goes alone, and the server's refusal names the
        limit. With a shared prompt, each request carries it once."""
        # float32 log-prob + top-k ids and log-probs + candidate log-probs, varints
        per_position = 5 + 9 * top_k + 5 * candidates
        budget = self.max_message_bytes // 2
        ranges, start, tokens, size, chosen = [], 0, prompt_length, 0, 0
        for index, sequence in enumerate(sequences):
            length = len(sequence)
            positions = max(prompt_length + length - 1, 0)
            cost = positions * per_position
            full = (
                index - start + 1 > self.max_request_sequences
                or tokens + length > self.max_request_tokens
                or size + cost > budget
                or chosen + positions * candidates > self.max_request_candidate_ids
            )
            if index > start and full:
                ranges.append((start, index))
                start, tokens, size, chosen = index, prompt_length, 0, 0
            tokens, size = tokens + length, size + cost
            chosen += positions * candidates
        if len(sequences) > start or not ranges:
            ranges.append((start, len(sequences)))
        return ranges

    def _score_request(
        self,
        sequences: Sequence[Sequence[int]],
        top_k: int,
        candidate_ids: Sequence[np.ndarray] | None = None,
        prompt: Sequence[int] | None = None,
    ) -> list[ScoredSequence]:
        lengths = [len(sequence) + (0 if prompt is None else len(prompt)) for sequence in sequences]
        request = teacher_pb2.ScoreRequest(
            sequences=[teacher_pb2.TokenSequence(ids=list(map(int, s))) for s in sequences],
            top_k=top_k,
        )
        candidates = 0
        if candidate_ids is not None:
            candidates = int(np.shape(candidate_ids[0])[-1])
            request.candidates = candidates
            request.candidate_ids.extend(
                teacher_pb2.TokenSequence(ids=np.asarray(chosen).ravel().tolist())
                for chosen in candidate_ids
            )
        if prompt is not None:
            request.shared_prompt.ids.extend(prompt)
        response = self._call(self._stub.Score, request)
        if len(response.sequences) != len(lengths):
            raise TeacherServerError(
                grpc.StatusCode.INTERNAL,
                f"`sequences` must hold {len(lengths)} results; received {len(response.sequences)}",
                self.address,
            )
        try:
            return [
                scored_from_proto(message, length, top_k, candidates)
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

    def _error(self, failure: CallFailure) -> TeacherServerError:
        kind = (
            InvalidTeacherRequest
            if failure.code == grpc.StatusCode.INVALID_ARGUMENT
            else TeacherServerError
        )
        policy, gave_up = self.retry_policy, None
        if failure.transient:
            if policy.retries is not None and failure.attempts > policy.retries:
                gave_up = f"retry count reached (retries={policy.retries})"
            else:
                gave_up = f"retry budget spent (budget_s={policy.budget_s:g})"
        return kind(
            failure.code,
            failure.details,
            self.address,
            failure.attempts,
            elapsed_s=failure.elapsed_s,
            gave_up=gave_up,
        )


def _check_options(
    top_k: int | None, candidate_ids: Sequence[np.ndarray] | None, count: int
) -> tuple[int, int]:
    """``top_k`` as the wire's int (0: none) and the candidate width K (0: none), or
    ``ValueError`` naming the field; the server checks the ids themselves."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"`top_k` must be None or an int >= 1; received {top_k!r}")
    if candidate_ids is None:
        return top_k or 0, 0
    if len(candidate_ids) != count:
        raise ValueError(
            f"`candidate_ids` must hold one array per sequence ({count}); received "
            f"{len(candidate_ids)}"
        )
    widths = {int(np.shape(chosen)[-1]) if np.ndim(chosen) == 2 else -1 for chosen in candidate_ids}
    if len(widths) != 1 or min(widths) < 1:
        raise ValueError(
            "`candidate_ids` must be [n - 1, K] int arrays with one K >= 1 for all; received "
            f"widths {sorted(widths)}"
        )
    return top_k or 0, widths.pop()
