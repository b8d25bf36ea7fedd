"""The teacher as the learner sees it: a scoring interface, an in-process implementation,
and the compatibility check that runs before any training step.

``Teacher.score`` takes token id sequences and returns, for each, the log-probability of
every actual next token (position i scores token i+1: one prefill, no generation), plus the
teacher's top-k ids and log-probs when asked. The gRPC teacher server implements the same
protocol; the in-process one runs the causal model directly.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distill.models.logprobs import gathered_log_probs
from distill.models.transformer import Transformer
from distill.tokenizer import Tokenizer


class CompatibilityError(ValueError):
    """Teacher and student disagree on the vocabulary or special ids."""


@dataclasses.dataclass(frozen=True)
class TeacherInfo:
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
    def info(self) -> TeacherInfo: ...

    def score(
        self, sequences: Sequence[Sequence[int]], *, top_k: int | None = None
    ) -> list[ScoredSequence]: ...


def model_hash(model: nnx.Module) -> str:
    """sha256 over the parameters (names, shapes, dtypes, bytes) in a fixed order."""
    digest = hashlib.sha256()
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, variable in sorted(flat, key=lambda item: tuple(map(str, item[0]))):
        array = np.asarray(variable[...])
        digest.update("/".join(map(str, path)).encode())
        digest.update(f"{array.shape}{array.dtype}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


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


def _bucket(length: int, multiple: int = 16) -> int:
    return max(multiple, -(-length // multiple) * multiple)


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "vocab_chunk"))
def _score(graphdef, state, tokens, positions, segments, *, top_k, vocab_chunk):
    model: Transformer = nnx.merge(graphdef, state)
    hidden = model.hidden_states(tokens, positions, segments)[:, :-1]
    targets = tokens[:, 1:]
    log_probs = gathered_log_probs(
        hidden, model.output_embedding(), targets, vocab_chunk=vocab_chunk
    )
    if top_k is None:
        return log_probs, None, None
    full = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    top_log_probs, top_ids = jax.lax.top_k(full, top_k)
    return log_probs, top_ids, top_log_probs


class InProcessTeacher:
    """A causal :class:`Transformer` scoring sequences in this process (one prefill each
    batch, lengths bucketed to multiples of 16 so shapes stay few)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, vocab_chunk: int = 4096):
        if model.config.attention_type != "causal":
            raise ValueError(
                "`teacher.attention_type` must be 'causal'; received "
                f"{model.config.attention_type!r}"
            )
        vocab, mask_id = model.config.vocab_size, tokenizer.special.mask_id
        appended_mask = tokenizer.vocab_size == vocab + 1 and mask_id == vocab
        if vocab != tokenizer.vocab_size and not appended_mask:
            raise CompatibilityError(
                f"`teacher.vocab_size` must equal the tokenizer's {tokenizer.vocab_size} (or "
                f"one less, when the tokenizer appended the mask token); received {vocab}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_chunk = vocab_chunk
        self._info = TeacherInfo(
            vocab_size=model.config.vocab_size,
            pad_id=tokenizer.special.pad_id,
            bos_id=tokenizer.special.bos_id,
            mask_id=tokenizer.special.mask_id,
            stop_ids=tuple(tokenizer.special.stop_ids),
            tokenizer_hash=tokenizer.content_hash(),
            model_hash=model_hash(model),
            max_length=model.config.max_length,
        )

    def info(self) -> TeacherInfo:
        return self._info

    def score(
        self, sequences: Sequence[Sequence[int]], *, top_k: int | None = None
    ) -> list[ScoredSequence]:
        sequences = check_sequences(sequences, self._info)
        vocab = self._info.vocab_size
        if top_k is not None and not 1 <= top_k <= vocab:
            raise ValueError(f"`top_k` must be in [1, {vocab}]; received {top_k}")
        width = _bucket(max(len(sequence) for sequence in sequences))
        tokens = np.full((len(sequences), width), self._info.pad_id, np.int32)
        segments = np.zeros_like(tokens)
        positions = np.zeros_like(tokens)
        for row, sequence in enumerate(sequences):
            tokens[row, : len(sequence)] = sequence
            segments[row, : len(sequence)] = 1
            positions[row, : len(sequence)] = np.arange(len(sequence))
        graphdef, state = nnx.split(self.model)
        log_probs, top_ids, top_log_probs = _score(
            graphdef,
            state,
            jnp.asarray(tokens),
            jnp.asarray(positions),
            jnp.asarray(segments),
            top_k=top_k,
            vocab_chunk=self.vocab_chunk,
        )
        log_probs = np.asarray(log_probs)
        out = []
        for row, sequence in enumerate(sequences):
            n = len(sequence) - 1
            out.append(
                ScoredSequence(
                    log_probs=log_probs[row, :n],
                    top_ids=None if top_ids is None else np.asarray(top_ids)[row, :n],
                    top_log_probs=None
                    if top_log_probs is None
                    else np.asarray(top_log_probs)[row, :n],
                )
            )
        return out
