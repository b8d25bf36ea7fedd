"""The teacher contract, importable without JAX: what a learner needs to know about a
teacher, whether it runs in this process or behind gRPC.

``Teacher.score`` takes token id sequences and returns, for each, the log-probability of
every actual next token (position i scores token i+1: one prefill, no generation), plus the
teacher's top-k ids and log-probs and the log-probs of given candidate ids when asked
(:class:`ScoredSequence`); ``Teacher.score_shared`` scores several continuations of one
prompt with the prompt computed once; ``Teacher.info`` describes its vocabulary, special
ids, hashes and max length (:class:`TeacherInfo`). :class:`ScoreShapes` is the closed set of
padded shapes a teacher compiles. :func:`check_sequences` (with
:func:`check_shared_sequences` and :func:`check_candidate_ids`) is the one input check every
teacher applies, and :func:`check_compatible` the check a learner runs on a teacher's info
before any training step. Only numpy and :mod:`distill.tokenizer` are imported, so a gRPC client process
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
    special ids, the sha256 of its tokenizer and parameters, ``max_length`` (the longest
    sequence it scores) and ``tokenizer_kind`` (``"char"``, ``"hf"``, or ``"unknown"``): with
    ``tokenizer_hash``, what a learner needs to choose same-tokenizer scoring or
    cross-tokenizer scoring (:mod:`distill.cross_tokenizer`)."""

    vocab_size: int
    pad_id: int
    bos_id: int
    mask_id: int
    stop_ids: tuple[int, ...]
    tokenizer_hash: str
    model_hash: str
    max_length: int
    tokenizer_kind: str = "unknown"


@dataclasses.dataclass(frozen=True)
class ScoredSequence:
    """``log_probs`` ``[n - 1]`` float32: entry i is log p(token i+1 | tokens 0..i).
    ``top_ids`` (int32) / ``top_log_probs`` (float32) ``[n - 1, k]`` when top-k was
    requested, best first. ``candidate_log_probs`` ``[n - 1, K]`` float32 when candidate ids
    were given: entry [i, j] is log p(candidate_ids[i, j] | tokens 0..i)."""

    log_probs: np.ndarray
    top_ids: np.ndarray | None = None
    top_log_probs: np.ndarray | None = None
    candidate_log_probs: np.ndarray | None = None


def _increasing(name: str, values, *, allow_empty: bool) -> tuple[int, ...]:
    values = tuple(values) if isinstance(values, list | tuple) else values
    if (
        not isinstance(values, tuple)
        or (not values and not allow_empty)
        or any(isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1 for v in values)
        or any(a >= b for a, b in zip(values, values[1:], strict=False))
    ):
        what = "a" if allow_empty else "a non-empty"
        raise ValueError(
            f"`{name}` must be {what} tuple of strictly increasing positive ints; "
            f"received {values!r}"
        )
    return tuple(int(v) for v in values)


def _bucket_of(buckets: tuple[int, ...], n: int, message: str) -> int:
    for bucket in buckets:
        if bucket >= n:
            return bucket
    raise ValueError(f"{message}; received {n}")


def _powers_of_two(start: int, stop: int) -> tuple[int, ...]:
    """``start, 2 * start, ...`` below ``stop``, then ``stop`` itself."""
    out, value = [], start
    while value < stop:
        out.append(value)
        value *= 2
    return (*out, stop)


@dataclasses.dataclass(frozen=True)
class ScoreShapes:
    """The closed set of shapes a teacher compiles, so a warmed-up teacher never compiles
    while serving: every call is padded up to a bucket.

    ``rows``: batch buckets (a call with more rows than the largest is split); ``lengths``:
    padded sequence lengths (for a shared-prompt call, the prompt and the continuations are
    bucketed separately); ``top_ks``: top-k buckets (the answer is truncated to the requested
    k; "no top-k" is always allowed); ``candidates``: buckets for the number K of candidate
    ids per position (padded with id 0, truncated). Each tuple holds strictly increasing
    positive ints; ``rows`` and ``lengths`` are non-empty, an empty ``top_ks`` /
    ``candidates`` refuses every top-k / candidate request.
    """

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    top_ks: tuple[int, ...] = ()
    candidates: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("rows", "lengths", "top_ks", "candidates"):
            value = _increasing(
                name, getattr(self, name), allow_empty=name in ("top_ks", "candidates")
            )
            object.__setattr__(self, name, value)

    @classmethod
    def default(cls, max_length: int, max_rows: int) -> ScoreShapes:
        """Rows ``1, 2, 4, ...`` up to ``max_rows``; lengths ``16, 32, 64, ...`` up to
        ``max_length`` (the last bucket is ``max_length`` itself, so padding wastes less than
        half of any call); top-k buckets ``(8, 64)`` (a teacher caps them at its vocabulary)
        and candidate buckets ``(8, 64)``. For ``default(2048, 64)``: 7 row and 8 length
        buckets, 7 * 8 * (1 + 2 + 2) = 280 :meth:`combinations`."""
        for name, value in (("max_length", max_length), ("max_rows", max_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int; received {value!r}")
        lengths = (max_length,) if max_length <= 16 else _powers_of_two(16, max_length)
        return cls(
            rows=_powers_of_two(1, max_rows),
            lengths=lengths,
            top_ks=(8, 64),
            candidates=(8, 64),
        )

    def row_bucket(self, n: int) -> int:
        """The smallest row bucket >= ``n``, else ``ValueError``."""
        return _bucket_of(
            self.rows, n, f"`rows` must be at most {self.rows[-1]} (the largest row bucket)"
        )

    def length_bucket(self, n: int) -> int:
        """The smallest length bucket >= ``n``, else ``ValueError``."""
        return _bucket_of(
            self.lengths,
            n,
            f"`length` must be at most {self.lengths[-1]} (the largest length bucket)",
        )

    def top_k_bucket(self, k: int) -> int:
        """The smallest top-k bucket >= ``k``, else ``ValueError``."""
        if not self.top_ks:
            raise ValueError(f"`top_k` must be None (no top-k buckets); received {k}")
        return _bucket_of(
            self.top_ks, k, f"`top_k` must be at most {self.top_ks[-1]} (the largest top-k bucket)"
        )

    def candidate_bucket(self, k: int) -> int:
        """The smallest candidate bucket >= ``k`` (ids per position), else ``ValueError``."""
        if not self.candidates:
            raise ValueError(f"`candidate_ids` must be None (no candidate buckets); received {k}")
        return _bucket_of(
            self.candidates,
            k,
            f"`candidate_ids` must hold at most {self.candidates[-1]} ids per position (the "
            "largest candidate bucket)",
        )

    def combinations(self) -> tuple[tuple[int, int, int, int], ...]:
        """Every ``(rows, length, top_k or 0, candidates or 0)`` a :meth:`Teacher.score` call
        can compile, in a fixed order: per (rows, length) the forward ``(r, l, 0, 0)``, one
        top-k head ``(r, l, k, 0)`` per top-k bucket and one candidate head ``(r, l, 0, K)``
        per candidate bucket. Top-k and candidates are never compiled together (a call with
        both runs both heads on the forward's hidden states), so the set has
        ``len(rows) * len(lengths) * (1 + len(top_ks) + len(candidates))`` entries."""
        return tuple(
            combo
            for r in self.rows
            for length in self.lengths
            for combo in (
                (r, length, 0, 0),
                *((r, length, k, 0) for k in self.top_ks),
                *((r, length, 0, c) for c in self.candidates),
            )
        )

    def shared_combinations(self, max_length: int) -> tuple[tuple[int, int, int], ...]:
        """Every ``(rows, prompt_length, continuation_length)`` bucket triple a
        :meth:`Teacher.score_shared` call can reach when prompt plus continuation hold at
        most ``max_length`` ids (at least one each): the pairs of length buckets whose
        smallest members fit together, for every row bucket."""

        def smallest(index: int) -> int:
            return 1 if index == 0 else self.lengths[index - 1] + 1

        pairs = [
            (lp, lc)
            for i, lp in enumerate(self.lengths)
            for j, lc in enumerate(self.lengths)
            if smallest(i) + smallest(j) <= max_length
        ]
        return tuple((r, lp, lc) for r in self.rows for lp, lc in pairs)


class Teacher(Protocol):
    """Anything that scores sequences: in-process (:class:`distill.teacher.InProcessTeacher`)
    or served (:class:`services.teacher.client.RemoteTeacher`).

    Every method validates its whole input before any work and refuses bad input with a
    ``ValueError`` of the form "`field` must ...; received ..." (``sequences[2]``,
    ``top_k``, ``candidate_ids[0]``, ``prompt``, ``continuations[1]``).
    """

    def info(self) -> TeacherInfo: ...

    def score(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        top_k: int | None = None,
        candidate_ids: Sequence[np.ndarray] | None = None,
    ) -> list[ScoredSequence]:
        """One :class:`ScoredSequence` per sequence, in order.

        ``sequences``: what :func:`check_sequences` accepts (2 to ``max_length`` ids in
        ``[0, vocab_size)`` each). ``top_k``: ``None`` or in ``[1, vocab_size]`` (a teacher
        with :class:`ScoreShapes` also refuses a k above its largest top-k bucket); it fills
        ``top_ids`` / ``top_log_probs`` ``[n - 1, top_k]``. ``candidate_ids``: ``None`` or
        what :func:`check_candidate_ids` accepts (per sequence ``[n - 1, K]`` int ids, one K
        for the call); it fills ``candidate_log_probs`` ``[n - 1, K]``."""
        ...

    def score_shared(
        self,
        prompt: Sequence[int],
        continuations: Sequence[Sequence[int]],
        *,
        top_k: int | None = None,
        candidate_ids: Sequence[np.ndarray] | None = None,
    ) -> list[ScoredSequence]:
        """Score G continuations of one prompt, the prompt computed once: result g equals
        ``score([prompt + continuations[g]], ...)[0]`` (all ``n - 1`` entries of the
        concatenation, prompt positions included), up to float rounding.

        ``prompt`` and ``continuations`` are what :func:`check_shared_sequences` accepts (a
        prompt of >= 1 id, each continuation >= 1 id, each concatenation within
        ``max_length``); ``top_k`` as in :meth:`score`; ``candidate_ids[g]`` is
        ``[len(prompt) + len(continuations[g]) - 1, K]`` (checked against the
        concatenations)."""
        ...


def check_compatible(
    teacher: TeacherInfo,
    tokenizer: Tokenizer,
    student_vocab: int,
    *,
    cross_tokenizer_ok: bool = False,
) -> None:
    """Refuse a teacher whose vocabulary or special ids differ from the student's.

    ``cross_tokenizer_ok``: a teacher whose tokenizer hash differs from the student's is
    accepted as is (its ids mean nothing to the student: it scores text, see
    :mod:`distill.cross_tokenizer`); a teacher with the student's tokenizer hash is still
    checked in full."""
    if cross_tokenizer_ok and teacher.tokenizer_hash != tokenizer.content_hash():
        return
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


def _check_ids(
    sequence, name: str, vocab: int, *, min_ids: int, max_ids: int, limit: str
) -> np.ndarray:
    """One 1-D id sequence as int32, or ``ValueError`` naming it."""
    ids = np.asarray(sequence)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"`{name}` must be a 1-D sequence of int ids; received {ids.shape}")
    if ids.size < min_ids:
        plural = "id" if min_ids == 1 else "ids"
        raise ValueError(f"`{name}` must hold at least {min_ids} {plural}; received {ids.size}")
    if ids.size > max_ids:
        raise ValueError(f"`{name}` must hold at most {max_ids} ids ({limit}); received {ids.size}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise ValueError(
            f"`{name}` must hold ids in [0, {vocab}); received {int(ids[bad[0]])} at "
            f"position {int(bad[0])}"
        )
    return ids.astype(np.int32)


def check_sequences(
    sequences: Sequence[Sequence[int]], info: TeacherInfo, *, field: str = "sequences[{index}]"
) -> list[np.ndarray]:
    """The sequences as int32 arrays, or ``ValueError`` naming the field (``field`` formats
    one sequence's name from its ``index``): at least one sequence, each 1-D with 2 to
    ``info.max_length`` ids in ``[0, info.vocab_size)``. Every teacher (in-process or served)
    accepts exactly these."""
    if len(sequences) == 0:
        raise ValueError("`sequences` must hold at least one sequence; received 0")
    return [
        _check_ids(
            sequence,
            field.format(index=index),
            info.vocab_size,
            min_ids=2,
            max_ids=info.max_length,
            limit="the teacher's max_length",
        )
        for index, sequence in enumerate(sequences)
    ]


def check_shared_sequences(
    prompt: Sequence[int], continuations: Sequence[Sequence[int]], info: TeacherInfo
) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(prompt, continuations)`` as int32 arrays, or ``ValueError`` naming the field: a 1-D
    ``prompt`` of 1 to ``max_length - 1`` ids, at least one continuation, each 1-D with at
    least 1 id and at most ``max_length - len(prompt)``, all ids in ``[0, vocab_size)``. The
    concatenations are then exactly what :func:`check_sequences` accepts."""
    vocab, max_length = info.vocab_size, info.max_length
    prompt = _check_ids(
        prompt,
        "prompt",
        vocab,
        min_ids=1,
        max_ids=max_length - 1,
        limit="the teacher's max_length less one continuation id",
    )
    if len(continuations) == 0:
        raise ValueError("`continuations` must hold at least one sequence; received 0")
    room = max_length - prompt.size
    out = [
        _check_ids(
            sequence,
            f"continuations[{index}]",
            vocab,
            min_ids=1,
            max_ids=room,
            limit=f"the teacher's max_length {max_length} less the prompt's {prompt.size}",
        )
        for index, sequence in enumerate(continuations)
    ]
    return prompt, out


def check_candidate_ids(
    candidate_ids: Sequence[np.ndarray],
    sequences: Sequence[Sequence[int]],
    info: TeacherInfo,
    *,
    field: str = "candidate_ids[{index}]",
) -> list[np.ndarray]:
    """The candidate ids as int32 arrays, or ``ValueError`` naming the field (``field``
    formats one entry's name from its ``index``): one entry per sequence, entry s a 2-D int
    array ``[len(sequences[s]) - 1, K]`` of ids in ``[0, info.vocab_size)``, with the same
    ``K >= 1`` for every entry (row i lists the ids to score after tokens 0..i)."""
    if len(candidate_ids) != len(sequences):
        raise ValueError(
            f"`candidate_ids` must hold one array per sequence ({len(sequences)}); received "
            f"{len(candidate_ids)}"
        )
    vocab, width, out = info.vocab_size, None, []
    for index, (ids, sequence) in enumerate(zip(candidate_ids, sequences, strict=True)):
        name = field.format(index=index)
        ids = np.asarray(ids)
        positions = len(sequence) - 1
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"`{name}` must be a 2-D int array [{positions}, K]; received "
                f"{ids.dtype} {ids.shape}"
            )
        if ids.shape[0] != positions or ids.shape[1] < 1:
            raise ValueError(
                f"`{name}` must have shape [{positions}, K] with K >= 1 (one row per scored "
                f"position); received {ids.shape}"
            )
        if width is not None and ids.shape[1] != width:
            raise ValueError(
                f"`{name}` must hold K = {width} ids per position like `"
                f"{field.format(index=0)}` (one K per call); received {ids.shape[1]}"
            )
        width = ids.shape[1]
        bad = np.argwhere((ids < 0) | (ids >= vocab))
        if bad.size:
            row, column = (int(v) for v in bad[0])
            raise ValueError(
                f"`{name}` must hold ids in [0, {vocab}); received {int(ids[row, column])} at "
                f"[{row}, {column}]"
            )
        out.append(ids.astype(np.int32))
    return out
