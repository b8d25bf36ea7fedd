"""Conversions between the teacher's wire messages (``protos/teacher.proto``) and the
:mod:`distill.teacher_contract` types, shared by the server and
:class:`~services.teacher.client.RemoteTeacher`.

Floats travel as proto ``float`` (float32), the dtype the teacher computes in, so log-probs
arrive bit-identical to what the teacher returned.
"""

from __future__ import annotations

import numpy as np

from distill.cross_tokenizer import TextScores
from distill.teacher_contract import ScoredSequence, TeacherInfo
from services.proto import teacher_pb2


def info_to_proto(info: TeacherInfo) -> teacher_pb2.InfoResponse:
    return teacher_pb2.InfoResponse(
        vocab_size=info.vocab_size,
        pad_id=info.pad_id,
        bos_id=info.bos_id,
        mask_id=info.mask_id,
        stop_ids=list(info.stop_ids),
        tokenizer_hash=info.tokenizer_hash,
        model_hash=info.model_hash,
        max_length=info.max_length,
        tokenizer_kind=info.tokenizer_kind,
    )


def info_from_proto(message: teacher_pb2.InfoResponse) -> TeacherInfo:
    return TeacherInfo(
        vocab_size=message.vocab_size,
        pad_id=message.pad_id,
        bos_id=message.bos_id,
        mask_id=message.mask_id,
        stop_ids=tuple(message.stop_ids),
        tokenizer_hash=message.tokenizer_hash,
        model_hash=message.model_hash,
        max_length=message.max_length,
        tokenizer_kind=message.tokenizer_kind or "unknown",
    )


def _check_shape(scored: ScoredSequence, field: str, shape: tuple[int, int]) -> np.ndarray:
    value = getattr(scored, field, None)
    if value is None or np.shape(value) != shape:
        raise ValueError(
            f"`{field}` must have shape {shape}; received "
            f"{None if value is None else np.shape(value)}"
        )
    return np.asarray(value)


def scored_to_proto(
    scored: ScoredSequence, length: int, top_k: int, candidates: int = 0
) -> teacher_pb2.SequenceScores:
    """The scores of one ``length``-id sequence; raises ``ValueError`` naming the field when
    the teacher returned the wrong shape (a server bug, not the caller's)."""
    positions = length - 1
    log_probs = np.asarray(scored.log_probs, np.float32)
    if log_probs.shape != (positions,):
        raise ValueError(f"`log_probs` must have shape ({positions},); received {log_probs.shape}")
    message = teacher_pb2.SequenceScores(log_probs=log_probs.tolist())
    if top_k:
        top_ids = _check_shape(scored, "top_ids", (positions, top_k))
        top_log_probs = _check_shape(scored, "top_log_probs", (positions, top_k))
        message.top_ids.extend(top_ids.astype(np.int32).ravel().tolist())
        message.top_log_probs.extend(top_log_probs.astype(np.float32).ravel().tolist())
    if candidates:
        chosen = _check_shape(scored, "candidate_log_probs", (positions, candidates))
        message.candidate_log_probs.extend(chosen.astype(np.float32).ravel().tolist())
    return message


def _reshaped(message, field: str, positions: int, width: int, dtype) -> np.ndarray:
    value = np.array(getattr(message, field), dtype)
    if value.size != positions * width:
        raise ValueError(
            f"`{field}` must hold {positions} x {width} entries; received {value.size}"
        )
    return value.reshape(positions, width)


def scored_from_proto(
    message: teacher_pb2.SequenceScores, length: int, top_k: int, candidates: int = 0
) -> ScoredSequence:
    """A :class:`ScoredSequence` of a ``length``-id sequence; raises ``ValueError`` naming
    the field when the server answered with the wrong number of entries."""
    positions = length - 1
    log_probs = np.array(message.log_probs, np.float32)
    if log_probs.shape != (positions,):
        raise ValueError(f"`log_probs` must hold {positions} entries; received {log_probs.size}")
    fields: dict[str, np.ndarray] = {}
    if top_k:
        fields["top_ids"] = _reshaped(message, "top_ids", positions, top_k, np.int32)
        fields["top_log_probs"] = _reshaped(message, "top_log_probs", positions, top_k, np.float32)
    if candidates:
        fields["candidate_log_probs"] = _reshaped(
            message, "candidate_log_probs", positions, candidates, np.float32
        )
    return ScoredSequence(log_probs=log_probs, **fields)


def text_scores_to_proto(scores: TextScores) -> teacher_pb2.TextScores:
    message = teacher_pb2.TextScores(
        log_probs=np.asarray(scores.log_probs, np.float32).tolist(),
        byte_ends=np.asarray(scores.byte_ends, np.int64).tolist(),
        refusal=scores.refusal or "",
    )
    if scores.stop_log_prob is not None:
        message.stop_log_prob = scores.stop_log_prob
    return message


def text_scores_from_proto(message: teacher_pb2.TextScores) -> TextScores:
    """A :class:`TextScores`; raises ``ValueError`` naming the field when the server's
    answer is inconsistent."""
    if message.refusal:
        return TextScores.refused(message.refusal)
    return TextScores(
        np.array(message.log_probs, np.float32),
        np.array(message.byte_ends, np.int64),
        stop_log_prob=message.stop_log_prob if message.HasField("stop_log_prob") else None,
    )
