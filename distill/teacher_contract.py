"""The teacher contract, importable without JAX: what a learner needs to know about a
teacher, whether it runs in this process or behind gRPC.

``Teacher.score`` takes token id sequences and returns, for each, the log-probability of
every actual next token (position i scores token i+1: one prefill, no generation), plus the
teacher's top-k ids and log-probs when asked (:class:`ScoredSequence`); ``Teacher.info``
describes its vocabulary, special ids, hashes and max length (:class:`TeacherInfo`).
:func:`check_sequences` is the one input check every teacher applies, and
:func:`check_compatible` the check a learner runs on a teacher's info before any training
step. Only numpy and :mod:`distill.tokenizer` are imported, so a gRPC client process
(:mod:`services.teacher.client`) does not load JAX; the in-process implementation lives in
:mod:`distill.teacher`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from distill.tokenizer import Tokenizer


class CompatibilityError(ValueError):
    """Teacher and student disagree on the vocabulary or special ids."""


@dataclasses.dataclass(frozen=True)
class TeacherInfo:
    """What a teacher scores with: ``vocab_size`` (ids are in ``[0, vocab_size)``), its
    special ids, the sha256 of its tokenizer and parameters, and ``max_length`` (the longest
    sequence it scores)."""

    vocab_size: int
    pad_id: int
    bos_id: int
    mask_id: int
    stop_ids: tuple[int, ...]
    tokenizer_hash: str
    model_hash: str
    max_length: int


@dataclasses.dataclass(frozen=True)
class ScoredSequence:
    """``log_probs`` ``[n - 1]`` float32: entry i is log p(token i+1 | tokens 0..i).
    ``top_ids`` / ``top_log_probs`` ``[n - 1, k]`` when top-k was requested."""

    log_probs: np.ndarray
    top_ids: np.ndarray | None = None
    top_log_probs: np.ndarray | None = None


class Teacher(Protocol):
    """Anything that scores sequences: in-process (:class:`distill.teacher.InProcessTeacher`)
    or served (:class:`services.teacher.client.RemoteTeacher`). ``score`` accepts what
    :func:`check_sequences` accepts (else ``ValueError`` naming the field) and ``top_k`` in
    ``[1, vocab_size]`` or ``None``; it returns one :class:`ScoredSequence` per sequence, in
    order."""

    def info(self) -> TeacherInfo: ...

    def score(
        self, sequences: Sequence[Sequence[int]], *, top_k: int | None = None
    ) -> list[ScoredSequence]: ...


def check_compatible(teacher: TeacherInfo, tokenizer: Tokenizer, student_vocab: int) -> None:
    """Refuse a teacher whose vocabulary or special ids differ from the student's."""
    special = tokenizer.special
    # The student may have exactly one more row than the teacher: the appended mask token
    # (see docs/models.md); every teacher id means the same token for both.
    appended_mask = student_vocab == teacher.vocab_size + 1 == special.mask_id + 1
    expected = {
        "vocab_size": (student_vocab, teacher.vocab_size + (1 if appended_mask else 0)),
        "pad_id": (special.pad_id, teacher.pad_id),
        "bos_id": (special.bos_id, teacher.bos_id),
        "mask_id": (special.mask_id, teacher.mask_id),
        "stop_ids": (tuple(special.stop_ids), tuple(teacher.stop_ids)),
        "tokenizer_hash": (tokenizer.content_hash(), teacher.tokenizer_hash),
    }
    problems = [
        f"`teacher.{field}` must equal the student's {want!r}; received {got!r}"
        for field, (want, got) in expected.items()
        if want != got
    ]
    if problems:
        raise CompatibilityError("\n".join(problems))


def check_sequences(
    sequences: Sequence[Sequence[int]], info: TeacherInfo, *, field: str = "sequences[{index}]"
) -> list[np.ndarray]:
    """The sequences as int32 arrays, or ``ValueError`` naming the field (``field`` formats
    one sequence's name from its ``index``): at least one sequence, each 1-D with 2 to
    ``info.max_length`` ids in ``[0, info.vocab_size)``. Every teacher (in-process or served)
    accepts exactly these."""
    if len(sequences) == 0:
        raise ValueError("`sequences` must hold at least one sequence; received 0")
    vocab, out = info.vocab_size, []
    for index, sequence in enumerate(sequences):
        name = field.format(index=index)
        ids = np.asarray(sequence)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"`{name}` must be a 1-D sequence of int ids; received {ids.shape}")
        if ids.size < 2:
            raise ValueError(f"`{name}` must hold at least 2 ids; received {ids.size}")
        if ids.size > info.max_length:
            raise ValueError(
                f"`{name}` must hold at most {info.max_length} ids (the teacher's max_length); "
                f"received {ids.size}"
            )
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            raise ValueError(
                f"`{name}` must hold ids in [0, {vocab}); received {int(ids[bad[0]])} at "
                f"position {int(bad[0])}"
            )
        out.append(ids.astype(np.int32))
    return out
