"""Teachers with another tokenizer: score text, map the teacher's log-probs back onto the
student's tokens by byte offsets.

When the teacher's tokenizer differs from the student's, token ids mean nothing across the
two. The learner instead detokenizes each row exactly (:func:`detokenize_exactly`: the
per-token UTF-8 pieces must concatenate to exactly the decoded text, or the row is refused
with :class:`DetokenizeError`), and a :class:`TextTeacher` tokenizes and scores the text
itself (:class:`CrossTokenizerTeacher` does so over any
:class:`~distill.teacher_contract.Teacher`), answering, for each of its completion tokens,
the log-prob and the token's end offset in the completion's UTF-8 bytes
(:class:`TextScores`). :func:`map_to_student` then gives each student token the summed
log-prob of the teacher tokens that *end* inside it (start < end <= student end), so each
row's total equals the teacher's log-probability of that text. A stopped row's stop token
gets the teacher's log-prob of ending there (its first stop id after the text).

Only sequence-level signals survive the mapping: ``reverse_kl`` with the ``sequence``,
``return_to_go`` or ``mean_to_go`` advantage (:func:`check_cross_tokenizer_loss`); the
per-token advantage and the vocabulary-level kinds are refused by name.

Pure numpy (no JAX): a served teacher uses the same :class:`CrossTokenizerTeacher` and the
learner the same :func:`score_completions`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from tokenizers import decoders

from distill.teacher_contract import (
    CompatibilityError,
    ScoredSequence,
    Teacher,
    TeacherInfo,
)
from distill.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, TokenizerError

#: The advantages a cross-tokenizer run may use: each sums the log-ratio over spans that
#: end on student-token boundaries, where the mapped teacher log-probs are exact.
CROSS_TOKENIZER_ADVANTAGES: tuple[str, ...] = ("sequence", "return_to_go", "mean_to_go")

_DIFFERS = "when the teacher's tokenizer differs from the student's"


class DetokenizeError(ValueError):
    """Ids whose per-token UTF-8 pieces do not concatenate to exactly their decoded text
    (special or unknown ids, a byte sequence that is not valid UTF-8, a decoder that is not
    prefix-consistent): the row cannot be aligned by bytes and is refused."""


def check_cross_tokenizer_loss(kind: str, advantage: str, teacher_top_k: int | None) -> None:
    """Raise ``ValueError`` naming the field unless the loss works across tokenizers:
    ``loss.kind == 'reverse_kl'`` (the vocabulary-level kinds compare two distributions over
    one vocabulary), ``loss.advantage`` in :data:`CROSS_TOKENIZER_ADVANTAGES` (a per-token
    log-ratio is not defined where the two tokenizations cut the text differently) and no
    ``loss.teacher_top_k``."""
    problems = []
    if kind != "reverse_kl":
        problems.append(
            f"`loss.kind` must be 'reverse_kl' {_DIFFERS} (the vocabulary-level kinds need one "
            f"shared vocabulary); received {kind!r}"
        )
    if advantage not in CROSS_TOKENIZER_ADVANTAGES:
        problems.append(
            f"`loss.advantage` must be one of {CROSS_TOKENIZER_ADVANTAGES} {_DIFFERS} (a "
            f"per-token log-ratio is not defined across tokenizers); received {advantage!r}"
        )
    if teacher_top_k is not None:
        problems.append(f"`loss.teacher_top_k` must be unset {_DIFFERS}; received {teacher_top_k}")
    if problems:
        raise ValueError("\n".join(problems))


# ---- exact detokenization ---------------------------------------------------------------


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """The byte-level (GPT-2) alphabet: the printable character standing for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _byte_pieces(tokenizer: Tokenizer, ids: list[int]) -> list[bytes] | None:
    """Each id's raw UTF-8 bytes where the tokenizer defines them (characters; byte-level
    BPE tokens, which may hold part of a character); None where only decoding tells."""
    if isinstance(tokenizer, CharTokenizer):
        return [tokenizer.decode([i]).encode("utf-8") for i in ids]
    if isinstance(tokenizer, HFTokenizer) and isinstance(
        tokenizer.backend.decoder, decoders.ByteLevel
    ):
        chars, pieces = _byte_level_chars(), []
        for i in ids:
            token = tokenizer.backend.id_to_token(i) or ""
            if any(char not in chars for char in token):
                return None  # an added token stored as plain text: decode decides
            pieces.append(bytes(chars[char] for char in token))
        return pieces
    return None


@dataclasses.dataclass(frozen=True)
class Detokenized:
    """``text`` decoded from ids, and ``byte_ends`` ``[n]`` int64: each id's end offset in
    ``text.encode('utf-8')`` (non-decreasing; the last equals its length)."""

    text: str
    byte_ends: np.ndarray


def detokenize_exactly(
    tokenizer: Tokenizer, ids: Sequence[int], *, field: str = "completion"
) -> Detokenized:
    """The text of ``ids`` and each id's end byte offset, or :class:`DetokenizeError`
    ("`field` must detokenize exactly; received ...") unless the per-id byte pieces
    concatenate to exactly the UTF-8 of ``decode(ids)``: no special id (pad, mask, bos,
    stop), no id outside the vocabulary, valid UTF-8 overall (a byte-level token may end
    inside a character; the bytes still add up), and a decoding that does not depend on
    context in a way pieces cannot express.

    Pieces come from the tokenizer itself for :class:`~distill.tokenizer.CharTokenizer` and
    byte-level BPE :class:`~distill.tokenizer.HFTokenizer`; any other decoder is measured by
    decoding each prefix (each must be a prefix of the whole text)."""
    must = f"`{field}` must detokenize exactly"
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = list(ids)
    vocab, special = tokenizer.vocab_size, tokenizer.special.special_set()
    for index, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise DetokenizeError(f"{must}; received {token!r} at index {index} (not an id)")
        if not 0 <= token < vocab:
            raise DetokenizeError(
                f"{must}; received id {token} at index {index}, outside [0, {vocab})"
            )
        if token in special:
            raise DetokenizeError(
                f"{must}; received the special id {token} at index {index} (decoding drops it)"
            )
    ids = [int(token) for token in ids]
    try:
        text = tokenizer.decode(ids)
    except TokenizerError as error:  # pragma: no cover - ids were checked above
        raise DetokenizeError(f"{must}; received ids the tokenizer refuses ({error})") from error
    encoded = text.encode("utf-8")
    pieces = _byte_pieces(tokenizer, ids)
    if pieces is not None:
        joined = b"".join(pieces)
        if joined != encoded:
            raise DetokenizeError(
                f"{must}; received token bytes {joined[:64]!r} that decode to {text[:64]!r} "
                "(not valid UTF-8, or a token the decoder changes)"
            )
        ends = np.cumsum([len(piece) for piece in pieces], dtype=np.int64)
        return Detokenized(text, ends.reshape(len(ids)))
    ends, previous = [], 0
    for count in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:count]).encode("utf-8")
        if not encoded.startswith(prefix) or len(prefix) < previous:
            raise DetokenizeError(
                f"{must}; received ids whose first {count} decode to {prefix[:64]!r}, not a "
                f"prefix of the whole text {encoded[:64]!r}"
            )
        previous = len(prefix)
        ends.append(previous)
    return Detokenized(text, np.asarray(ends, np.int64).reshape(len(ids)))


def token_byte_spans(tokenizer: Tokenizer, ids: Sequence[int]) -> np.ndarray:
    """``[n]`` int64: each id's end byte offset in the UTF-8 of ``decode(ids)``; raises
    :class:`DetokenizeError` when the ids do not detokenize exactly
    (:func:`detokenize_exactly`)."""
    return detokenize_exactly(tokenizer, ids).byte_ends


# ---- the text-scoring contract -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TextScores:
    """A teacher's scores of one completion text under its own tokenization.

    ``log_probs`` ``[m]`` float32: log p(teacher token j | prompt, tokens before j) for the
    ``m`` teacher tokens of the completion only (m = 0 for an empty completion);
    ``byte_ends`` ``[m]`` int64: each token's end offset in the completion's UTF-8 bytes
    (non-decreasing; the last equals the completion's byte length). ``stop_log_prob``: for a
    pair scored as stopped, log p(the teacher's first stop id | prompt, completion), else
    None. ``refusal``: why the teacher could not score this pair exactly (its tokenizer does
    not round-trip the text, the pair is longer than its ``max_length``); the arrays are
    then empty."""

    log_probs: np.ndarray
    byte_ends: np.ndarray
    stop_log_prob: float | None = None
    refusal: str | None = None

    def __post_init__(self) -> None:
        log_probs = np.asarray(self.log_probs, np.float32)
        byte_ends = np.asarray(self.byte_ends, np.int64)
        if log_probs.ndim != 1 or byte_ends.shape != log_probs.shape:
            raise ValueError(
                "`log_probs` and `byte_ends` must be 1-D of one length; received "
                f"{log_probs.shape} and {byte_ends.shape}"
            )
        if byte_ends.size and (byte_ends[0] < 0 or (np.diff(byte_ends) < 0).any()):
            raise ValueError(
                f"`byte_ends` must be non-negative and non-decreasing; received "
                f"{byte_ends.tolist()}"
            )
        if self.refusal is not None and (log_probs.size or self.stop_log_prob is not None):
            raise ValueError("`log_probs` must be empty (and no stop) for a refused pair")
        object.__setattr__(self, "log_probs", log_probs)
        object.__setattr__(self, "byte_ends", byte_ends)
        if self.stop_log_prob is not None:
            object.__setattr__(self, "stop_log_prob", float(self.stop_log_prob))

    @classmethod
    def refused(cls, reason: str) -> TextScores:
        return cls(np.zeros(0, np.float32), np.zeros(0, np.int64), refusal=reason)


class TextTeacher(Protocol):
    """A teacher that scores text with its own tokenizer (in-process:
    :class:`CrossTokenizerTeacher`; served: the ``ScoreText`` RPC).

    ``score_text(prompts, completions, stopped=None)``: one :class:`TextScores` per pair,
    in order. The teacher tokenizes prompt and completion separately (no merge across the
    boundary), scores ``[bos] + prompt ids + completion ids`` (plus its first stop id where
    ``stopped[i]``) and returns the completion part. A pair it cannot score exactly comes
    back refused (``TextScores.refusal``); malformed arguments raise ``ValueError`` naming
    the field."""

    def info(self) -> TeacherInfo: ...

    def score_text(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        *,
        stopped: Sequence[bool] | None = None,
    ) -> list[TextScores]: ...


def _check_texts(name: str, values: Sequence[str]) -> list[str]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValueError(f"`{name}` must be a sequence of str; received {type(values).__name__}")
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(f"`{name}[{index}]` must be a str; received {type(value).__name__}")
    return list(values)


def check_text_pairs(
    prompts: Sequence[str], completions: Sequence[str], stopped: Sequence[bool] | None
) -> tuple[list[str], list[str], list[bool]]:
    """The arguments of :meth:`TextTeacher.score_text` as lists, or ``ValueError`` naming
    the field: at least one pair, one prompt per completion, ``stopped`` (default all False)
    one bool per pair. Every text teacher (in-process or served) accepts exactly these."""
    prompts, completions = (
        _check_texts("prompts", prompts),
        _check_texts("completions", completions),
    )
    if not completions:
        raise ValueError("`completions` must hold at least one completion; received 0")
    if len(prompts) != len(completions):
        raise ValueError(
            f"`prompts` must hold one prompt per completion ({len(completions)}); received "
            f"{len(prompts)}"
        )
    flags = [False] * len(completions) if stopped is None else list(stopped)
    if len(flags) != len(completions) or not all(isinstance(f, bool | np.bool_) for f in flags):
        raise ValueError(
            f"`stopped` must hold one bool per completion ({len(completions)}); received {flags!r}"
        )
    return prompts, completions, [bool(flag) for flag in flags]


class CrossTokenizerTeacher:
    """:class:`TextTeacher` over any :class:`~distill.teacher_contract.Teacher` and its
    tokenizer (``teacher_tokenizer`` must have the teacher's tokenizer hash, else
    :class:`~distill.teacher_contract.CompatibilityError`). It is also a ``Teacher``
    (``score`` delegates), so one object serves both paths.

    ``score_text`` encodes each prompt and completion separately with the teacher's
    tokenizer, checks that the completion's ids decode back to exactly the completion and
    measures their byte ends (:func:`detokenize_exactly`), and scores every pair in one
    ``teacher.score`` call. A pair is refused (not raised) when its text cannot be encoded,
    does not round-trip, or is longer than the teacher's ``max_length`` with its ``[bos]``,
    prompt and stop."""

    def __init__(self, teacher: Teacher, teacher_tokenizer: Tokenizer):
        info = teacher.info()
        got = teacher_tokenizer.content_hash()
        if got != info.tokenizer_hash:
            raise CompatibilityError(
                f"`teacher_tokenizer` must be the teacher's tokenizer (hash "
                f"{info.tokenizer_hash!r}); received one with hash {got!r}"
            )
        self.teacher = teacher
        self.tokenizer = teacher_tokenizer
        self._info = info

    def info(self) -> TeacherInfo:
        return self._info

    def score(
        self, sequences: Sequence[Sequence[int]], *, top_k: int | None = None
    ) -> list[ScoredSequence]:
        return self.teacher.score(sequences, top_k=top_k)

    def score_text(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        *,
        stopped: Sequence[bool] | None = None,
    ) -> list[TextScores]:
        prompts, completions, stopped = check_text_pairs(prompts, completions, stopped)
        tokenizer, info = self.tokenizer, self._info
        bos, stop = tokenizer.special.bos_id, tokenizer.special.stop_ids[0]
        out: list[TextScores | None] = [None] * len(completions)
        plans = []  # (pair, prompt length, completion byte ends, sequence)
        for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            name = f"completions[{index}]"
            try:
                prompt_ids = tokenizer.encode(prompt)
                completion_ids = tokenizer.encode(completion)
            except TokenizerError as error:
                out[index] = TextScores.refused(
                    f"`prompts[{index}]` and `{name}` must be encodable by the teacher's "
                    f"tokenizer; received {error}"
                )
                continue
            try:
                decoded = detokenize_exactly(tokenizer, completion_ids, field=name)
            except DetokenizeError as error:
                out[index] = TextScores.refused(str(error))
                continue
            if decoded.text != completion:
                out[index] = TextScores.refused(
                    f"`{name}` must tokenize and decode back to itself under the teacher's "
                    f"tokenizer; received {completion[:64]!r}, which decodes as "
                    f"{decoded.text[:64]!r}"
                )
                continue
            sequence = [bos, *prompt_ids, *completion_ids, *([stop] if stopped[index] else [])]
            if len(sequence) > info.max_length:
                out[index] = TextScores.refused(
                    f"`{name}` must fit the teacher's max_length {info.max_length} with its "
                    f"bos, prompt and stop; received {len(sequence)} teacher ids"
                )
                continue
            if len(sequence) - 1 - len(prompt_ids) == 0:  # empty completion, not stopped
                out[index] = TextScores(np.zeros(0, np.float32), np.zeros(0, np.int64))
                continue
            plans.append((index, len(prompt_ids), decoded.byte_ends, sequence))
        if plans:
            scored = self.teacher.score([plan[3] for plan in plans])
            if len(scored) != len(plans):
                raise ValueError(
                    f"`teacher.score` must return one result per sequence ({len(plans)}); "
                    f"received {len(scored)}"
                )
            for (index, prompt_length, byte_ends, _), result in zip(plans, scored, strict=True):
                # Entry i scores token i + 1; the completion starts at token 1 + prompt_length.
                log_probs = np.asarray(result.log_probs, np.float32)
                m = byte_ends.size
                out[index] = TextScores(
                    log_probs[prompt_length : prompt_length + m],
                    byte_ends,
                    stop_log_prob=float(log_probs[prompt_length + m]) if stopped[index] else None,
                )
        return [scores for scores in out if scores is not None]


# ---- mapping back onto the student's tokens --------------------------------------------------


def map_to_student(text_scores: TextScores, student_byte_ends: np.ndarray) -> np.ndarray:
    """``[n]`` float32: each student token's share of the teacher's log-probs, from the same
    completion bytes on both sides. Student token i spans bytes ``(end[i-1], end[i]]`` and
    gets the sum of the teacher tokens whose end falls in it (teacher token j goes to the
    first student token with ``end[i] >= teacher_end[j]``), so the row's total equals the
    teacher's total (summed in float64). Tokens that cover part of a character work the
    same way: offsets are bytes.

    Both tokenizations cover the same bytes, so their last ends coincide; anything else
    (a teacher token ending beyond the last student token, teacher tokens for an empty
    student completion or none for a non-empty one) is a contract violation and raises
    ``ValueError`` rather than being folded in silently. The stop token is not part of the
    text: see :func:`score_completions`."""
    student = np.asarray(student_byte_ends, np.int64)
    if student.ndim != 1 or (student.size and (student[0] < 0 or (np.diff(student) < 0).any())):
        raise ValueError(
            "`student_byte_ends` must be 1-D, non-negative and non-decreasing; received "
            f"{student.tolist()}"
        )
    teacher_ends, log_probs = text_scores.byte_ends, text_scores.log_probs
    student_total = int(student[-1]) if student.size else 0
    teacher_total = int(teacher_ends[-1]) if teacher_ends.size else 0
    if student_total != teacher_total:
        raise ValueError(
            f"`text_scores.byte_ends` must end at the student's last byte end {student_total} "
            f"(the same completion bytes); received {teacher_total}"
        )
    out = np.zeros(student.size, np.float64)
    if teacher_ends.size:
        if not student.size:
            raise ValueError(
                "`text_scores` must hold no teacher tokens for an empty student completion; "
                f"received {teacher_ends.size}"
            )
        np.add.at(out, np.searchsorted(student, teacher_ends, side="left"), log_probs)
    return out.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class MappedRow:
    """The teacher's signal on one row's student completion ids: ``log_probs`` ``[n]``
    float32 (one per id, the stop id included), or None with ``refusal`` saying why the row
    could not be scored exactly (the row must then carry no loss)."""

    log_probs: np.ndarray | None
    refusal: str | None = None


def score_completions(
    teacher: TextTeacher,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
) -> list[MappedRow]:
    """Cross-tokenizer teacher scores of the student's rows, one :class:`MappedRow` each.

    ``prompts``: each row's student prompt ids (decoded with ``skip_special``, so the bos and
    any other special id are dropped: the prompt only conditions the teacher).
    ``completions``: each row's student completion ids, cut after the first stop (a stop id
    may only come last; the row is then scored as stopped and the stop id gets the
    teacher's log-prob of its own first stop id after the text). The completion text must
    detokenize exactly (:func:`detokenize_exactly`), else the row is refused here; rows the
    teacher refuses come back refused too. One ``teacher.score_text`` call for the rest."""
    if len(prompts) != len(completions):
        raise ValueError(
            f"`prompts` must hold one prompt per completion ({len(completions)}); received "
            f"{len(prompts)}"
        )
    stops = set(tokenizer.special.stop_ids)
    rows: list[MappedRow | None] = [None] * len(completions)
    plans = []  # (row, prompt text, completion text, byte ends, stopped)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids = list(np.asarray(completion).tolist())
        stopped = bool(ids) and ids[-1] in stops
        try:
            decoded = detokenize_exactly(tokenizer, ids[:-1] if stopped else ids)
        except DetokenizeError as error:
            rows[row] = MappedRow(None, f"row {row}: {error}")
            continue
        prompt_text = tokenizer.decode(list(np.asarray(prompt).tolist()))
        plans.append((row, prompt_text, decoded.text, decoded.byte_ends, stopped))
    if plans:
        scored = teacher.score_text(
            [plan[1] for plan in plans],
            [plan[2] for plan in plans],
            stopped=[plan[4] for plan in plans],
        )
        if len(scored) != len(plans):
            raise ValueError(
                f"`teacher.score_text` must return one result per pair ({len(plans)}); "
                f"received {len(scored)}"
            )
        for (row, _, _, byte_ends, stopped), result in zip(plans, scored, strict=True):
            if result.refusal is not None:
                rows[row] = MappedRow(None, f"row {row}: {result.refusal}")
                continue
            values = map_to_student(result, byte_ends)
            if stopped:
                if result.stop_log_prob is None:
                    raise ValueError(
                        f"`stop_log_prob` must be given for a stopped pair; row {row} has none"
                    )
                values = np.append(values, np.float32(result.stop_log_prob))
            rows[row] = MappedRow(values.astype(np.float32))
    return [row for row in rows if row is not None]


__all__ = [
    "CROSS_TOKENIZER_ADVANTAGES",
    "CrossTokenizerTeacher",
    "DetokenizeError",
    "Detokenized",
    "MappedRow",
    "TextScores",
    "TextTeacher",
    "check_cross_tokenizer_loss",
    "check_text_pairs",
    "detokenize_exactly",
    "map_to_student",
    "score_completions",
    "token_byte_spans",
]
