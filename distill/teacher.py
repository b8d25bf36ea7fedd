"""The in-process teacher: a causal :class:`Transformer` scoring sequences, and the hash
that identifies its parameters.

The contract every teacher implements (:class:`Teacher`, :class:`TeacherInfo`,
:class:`ScoredSequence`, :func:`check_sequences`, :func:`check_compatible`) lives in
:mod:`distill.teacher_contract`, importable without JAX, and is re-exported here. The gRPC
teacher server implements the same protocol; this one runs the causal model directly.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distill.models.logprobs import gathered_log_probs
from distill.models.transformer import Transformer
from distill.teacher_contract import (
    CompatibilityError,
    ScoredSequence,
    Teacher,
    TeacherInfo,
    check_compatible,
    check_sequences,
)
from distill.tokenizer import Tokenizer


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


__all__ = [
    "CompatibilityError",
    "InProcessTeacher",
    "ScoredSequence",
    "Teacher",
    "TeacherInfo",
    "check_compatible",
    "check_sequences",
    "model_hash",
]
