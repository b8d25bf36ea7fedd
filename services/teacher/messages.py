"""Conversions between the teacher's wire messages (``protos/teacher.proto``) and the
:mod:`distill.teacher_contract` types, shared by the server and
:class:`~services.teacher.client.RemoteTeacher`.

Floats travel as proto ``float`` (float32), the dtype the teacher computes in, so log-probs
arrive bit-identical to what the teacher returned.
"""

from __future__ import annotations

import numpy as np

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
    )


def scored_to_proto(scored: ScoredSequence, length: int, top_k: int) -> teacher_pb2.SequenceScores:
    """The scores of one ``length``-id sequence; raises ``ValueError`` naming the field when
    the teacher returned the wrong shape (a server bug, not the caller's)."""
    positions = length - 1
    log_probs = np.asarray(scored.log_probs, np.float32)
    if log_probs.shape != (positions,):
        raise ValueError(f"`log_probs` must have shape ({positions},); received {log_probs.shape}")
    message = teacher_pb2.SequenceScores(log_probs=log_probs.tolist())
    if top_k:
        for field in ("top_ids", "top_log_probs"):
            value = getattr(scored, field)
            if value is None or np.shape(value) != (positions, top_k):
                raise ValueError(
                    f"`{field}` must have shape ({positions}, {top_k}); received "
                    f"{None if value is None else np.shape(value)}"
                )
        message.top_ids.extend(np.asarray(scored.top_ids, np.int32).ravel().tolist())
        message.top_log_probs.extend(np.asarray(scored.top_log_probs, np.float32).ravel().tolist())
    return message


def scored_from_proto(
    message: teacher_pb2.SequenceScores, length: int, top_k: int
) -> ScoredSequence:
    """A :class:`ScoredSequence` of a ``length``-id sequence; raises ``ValueError`` naming
    the field when the server answered with the wrong number of entries."""
    positions = length - 1
    log_probs = np.array(message.log_probs, np.float32)
    if log_probs.shape != (positions,):
        raise ValueError(f"`log_probs` must hold {positions} entries; received {log_probs.size}")
    if not top_k:
        return ScoredSequence(log_probs=log_probs)
    top_ids = np.array(message.top_ids, np.int32)
    top_log_probs = np.array(message.top_log_probs, np.float32)
    for field, value in (("top_ids", top_ids), ("top_log_probs", top_log_probs)):
        if value.size != positions * top_k:
            raise ValueError(
                f"`{field}` must hold {positions} x {top_k} entries; received {value.size}"
            )
    return ScoredSequence(
        log_probs=log_probs,
        top_ids=top_ids.reshape(positions, top_k),
        top_log_probs=top_log_probs.reshape(positions, top_k),
    )
