"""The in-process teacher: a causal :class:`Transformer` scoring sequences, and the hash
that identifies its parameters.

The contract every teacher implements (:class:`Teacher`, :class:`TeacherInfo`,
:class:`ScoredSequence`, :class:`ScoreShapes`, :func:`check_sequences`,
:func:`check_compatible`, ...) lives in :mod:`distill.teacher_contract`, importable without
JAX, and is re-exported here. The gRPC teacher server implements the same protocol; this one
runs the causal model directly.

Compiled pieces (each a pure jitted function over arrays, one compile per input shape):
``forward`` (hidden states and the actual next tokens' log-probs, ``[rows, length]``), two
heads over those hidden states that stay on the device (``top-k`` of the full log-softmax;
``candidates``: the log-softmax gathered at given ids, never materializing ``[B, L, V]``
logits), and for shared-prompt scoring ``prefill`` (the prompt, one row, into a KV cache)
and ``decode`` (the continuations against that cache, broadcast over rows).
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
    ScoreShapes,
    Teacher,
    TeacherInfo,
    check_candidate_ids,
    check_compatible,
    check_sequences,
    check_shared_sequences,
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


# ---- pure jitted pieces: one compile per input shape, shared by every teacher -----------


@functools.partial(jax.jit, static_argnames=("graphdef", "vocab_chunk"))
def _forward(graphdef, state, tokens, positions, segments, *, vocab_chunk):
    """Hidden states ``[B, L, d]`` (kept on the device for the heads) and the log-prob of
    each actual next token ``[B, L - 1]``."""
    model: Transformer = nnx.merge(graphdef, state)
    hidden = model.hidden_states(tokens, positions, segments)
    log_probs = gathered_log_probs(
        hidden[:, :-1], model.output_embedding(), tokens[:, 1:], vocab_chunk=vocab_chunk
    )
    return hidden, log_probs


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k"))
def _top_k_head(graphdef, state, hidden, *, top_k):
    """Top-k ids ``[B, L, k]`` int32 and log-probs ``[B, L, k]``, best first."""
    model: Transformer = nnx.merge(graphdef, state)
    full = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    top_log_probs, top_ids = jax.lax.top_k(full, top_k)
    return top_ids, top_log_probs


@functools.partial(jax.jit, static_argnames=("graphdef", "vocab_chunk"))
def _candidate_head(graphdef, state, hidden, ids, *, vocab_chunk):
    """Log-probs ``[B, L, K]`` of ``ids`` ``[B, L, K]`` under the full log-softmax, one
    vocabulary chunk at a time (no ``[B, L, V]`` logits)."""
    model: Transformer = nnx.merge(graphdef, state)
    return gathered_log_probs(hidden, model.output_embedding(), ids, vocab_chunk=vocab_chunk)


@functools.partial(jax.jit, static_argnames=("graphdef", "vocab_chunk"))
def _prefill(graphdef, state, tokens, positions, segments, *, vocab_chunk):
    """:func:`_forward` of the prompt (one row) plus its KV cache (exactly ``L`` slots)."""
    model: Transformer = nnx.merge(graphdef, state)
    hidden, cache = model.prefill(tokens, positions, segments)
    log_probs = gathered_log_probs(
        hidden[:, :-1], model.output_embedding(), tokens[:, 1:], vocab_chunk=vocab_chunk
    )
    return hidden, log_probs, cache


@functools.partial(jax.jit, static_argnames=("graphdef", "vocab_chunk"))
def _decode(
    graphdef, state, cache, prompt_hidden, last, tokens, positions, segments, *, vocab_chunk
):
    """Continuations ``[G, Lc]`` (logical positions after the prompt) against the prompt's
    ``cache``. Returns the hidden states that predict each continuation token ``[G, Lc, d]``
    (slot j predicts token j: slot 0 is the prompt's last position ``last``) and those
    tokens' log-probs ``[G, Lc]``."""
    model: Transformer = nnx.merge(graphdef, state)
    rows = tokens.shape[0]
    # One prompt for every row: broadcast in the graph, never copied G times on the host.
    cache = jax.tree.map(lambda a: jnp.broadcast_to(a, (rows, *a.shape[1:])), cache)
    hidden, _ = model.decode_hidden(tokens, positions, segments, cache)
    first = jax.lax.dynamic_slice_in_dim(prompt_hidden, last, 1, axis=1)
    hidden = jnp.concatenate(
        [jnp.broadcast_to(first, (rows, 1, hidden.shape[-1])), hidden[:, :-1]], axis=1
    )
    log_probs = gathered_log_probs(
        hidden, model.output_embedding(), tokens, vocab_chunk=vocab_chunk
    )
    return hidden, log_probs


def _layout(sequences: Sequence[np.ndarray], rows: int, length: int, pad_id: int, offset: int = 0):
    """``[rows, length]`` tokens, logical positions (from ``offset``) and segments (0 on
    padding and on filler rows)."""
    tokens = np.full((rows, length), pad_id, np.int32)
    positions = np.zeros_like(tokens)
    segments = np.zeros_like(tokens)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
        positions[row, : len(sequence)] = offset + np.arange(len(sequence))
        segments[row, : len(sequence)] = 1
    return tokens, positions, segments


class InProcessTeacher:
    """A causal :class:`Transformer` scoring sequences in this process, one prefill per
    batch.

    Without ``shapes`` lengths are padded to multiples of 16 and any row count, top-k and
    candidate count compiles on first use. With ``shapes`` (:class:`ScoreShapes`) every call
    is padded to its buckets (filler rows of padding, dropped from the answer; a call with
    more rows than the largest bucket is split; top-k and candidate counts rounded up and the
    answer truncated), ``info().max_length`` is at most the largest length bucket, and after
    :meth:`warm_up` no :meth:`score` call compiles again.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        vocab_chunk: int = 4096,
        shapes: ScoreShapes | None = None,
    ):
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
        if shapes is not None and not isinstance(shapes, ScoreShapes):
            raise ValueError(f"`shapes` must be a ScoreShapes or None; received {shapes!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_chunk = vocab_chunk
        self.shapes = shapes
        max_length = model.config.max_length
        if shapes is not None:
            # A longer sequence would have no length bucket: refuse it up front, by info.
            max_length = min(max_length, shapes.lengths[-1])
        self._info = TeacherInfo(
            vocab_size=model.config.vocab_size,
            pad_id=tokenizer.special.pad_id,
            bos_id=tokenizer.special.bos_id,
            mask_id=tokenizer.special.mask_id,
            stop_ids=tuple(tokenizer.special.stop_ids),
            tokenizer_hash=tokenizer.content_hash(),
            model_hash=model_hash(model),
            max_length=max_length,
            tokenizer_kind=getattr(tokenizer, "kind", "unknown"),
        )

    def info(self) -> TeacherInfo:
        return self._info

    # ---- shape policy -------------------------------------------------------------------

    def _rows(self, n: int) -> int:
        return n if self.shapes is None else self.shapes.row_bucket(n)

    def _max_rows(self, n: int) -> int:
        return n if self.shapes is None else self.shapes.rows[-1]

    def _length(self, n: int) -> int:
        return _bucket(n) if self.shapes is None else self.shapes.length_bucket(n)

    def _top_k(self, top_k: int | None) -> int | None:
        """The compiled k for a requested ``top_k`` (validated), or None."""
        if top_k is None:
            return None
        vocab = self._info.vocab_size
        if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer):
            raise ValueError(f"`top_k` must be an int in [1, {vocab}] or None; received {top_k!r}")
        if not 1 <= top_k <= vocab:
            raise ValueError(f"`top_k` must be in [1, {vocab}]; received {top_k}")
        if self.shapes is None:
            return int(top_k)
        # A bucket above the vocabulary means the whole vocabulary, sorted.
        return min(self.shapes.top_k_bucket(int(top_k)), vocab)

    def _width(self, k: int) -> int:
        return k if self.shapes is None else self.shapes.candidate_bucket(k)

    # ---- scoring ------------------------------------------------------------------------

    def score(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        top_k: int | None = None,
        candidate_ids: Sequence[np.ndarray] | None = None,
    ) -> list[ScoredSequence]:
        """See :meth:`Teacher.score`: log-probs ``[n - 1]``, top-k ``[n - 1, top_k]`` and
        candidate log-probs ``[n - 1, K]`` per sequence, every input checked first."""
        sequences = check_sequences(sequences, self._info)
        k = self._top_k(top_k)
        width = None
        if candidate_ids is not None:
            candidate_ids = check_candidate_ids(candidate_ids, sequences, self._info)
            width = self._width(candidate_ids[0].shape[1])
        out: list[ScoredSequence] = []
        step = self._max_rows(len(sequences))
        for start in range(0, len(sequences), step):
            out += self._score_rows(
                sequences[start : start + step],
                None if candidate_ids is None else candidate_ids[start : start + step],
                top_k,
                k,
                width,
            )
        return out

    def _score_rows(self, sequences, candidate_ids, top_k, k, width) -> list[ScoredSequence]:
        rows, length = self._rows(len(sequences)), self._length(max(map(len, sequences)))
        tokens, positions, segments = _layout(sequences, rows, length, self._info.pad_id)
        graphdef, state = nnx.split(self.model)
        hidden, log_probs = _forward(
            graphdef, state, tokens, positions, segments, vocab_chunk=self.vocab_chunk
        )
        top_ids = top_log_probs = candidates = None
        if k is not None:
            top_ids, top_log_probs = _top_k_head(graphdef, state, hidden, top_k=k)
            top_ids, top_log_probs = np.asarray(top_ids), np.asarray(top_log_probs)
        if candidate_ids is not None:
            ids = np.zeros((rows, length, width), np.int32)  # padding: id 0, dropped
            for row, row_ids in enumerate(candidate_ids):
                ids[row, : row_ids.shape[0], : row_ids.shape[1]] = row_ids
            candidates = np.asarray(
                _candidate_head(graphdef, state, hidden, ids, vocab_chunk=self.vocab_chunk)
            )
        log_probs = np.asarray(log_probs)
        out = []
        for row, sequence in enumerate(sequences):
            n = len(sequence) - 1
            out.append(
                ScoredSequence(
                    log_probs=log_probs[row, :n],
                    top_ids=None if k is None else top_ids[row, :n, :top_k],
                    top_log_probs=None if k is None else top_log_probs[row, :n, :top_k],
                    candidate_log_probs=None
                    if candidate_ids is None
                    else candidates[row, :n, : candidate_ids[row].shape[1]],
                )
            )
        return out

    def score_shared(
        self,
        prompt: Sequence[int],
        continuations: Sequence[Sequence[int]],
        *,
        top_k: int | None = None,
        candidate_ids: Sequence[np.ndarray] | None = None,
    ) -> list[ScoredSequence]:
        """See :meth:`Teacher.score_shared`. The prompt is prefilled once (one row) into a KV
        cache; the continuations run in one batched forward against it (row- and
        length-bucketed like :meth:`score`; split when more than the largest row bucket)."""
        prompt, continuations = check_shared_sequences(prompt, continuations, self._info)
        k = self._top_k(top_k)
        n_prompt, width = prompt.size, None
        if candidate_ids is not None:
            lengths = [range(n_prompt + c.size) for c in continuations]
            candidate_ids = check_candidate_ids(candidate_ids, lengths, self._info)
            width = self._width(candidate_ids[0].shape[1])
        graphdef, state = nnx.split(self.model)
        p_length = self._length(n_prompt)
        p_tokens, p_positions, p_segments = _layout([prompt], 1, p_length, self._info.pad_id)
        p_hidden, p_log_probs, cache = _prefill(
            graphdef, state, p_tokens, p_positions, p_segments, vocab_chunk=self.vocab_chunk
        )
        # Prompt positions 0..P-2 are the same for every continuation; position P-1 (which
        # predicts each continuation's first token) comes from the decode.
        p_log_probs = np.asarray(p_log_probs)[0, : n_prompt - 1]
        p_top_ids = p_top_log_probs = None
        if k is not None:
            p_top_ids, p_top_log_probs = (
                np.asarray(a)[0, : n_prompt - 1]
                for a in _top_k_head(graphdef, state, p_hidden, top_k=k)
            )
        out: list[ScoredSequence] = []
        step = self._max_rows(len(continuations))
        for start in range(0, len(continuations), step):
            chunk = continuations[start : start + step]
            chunk_ids = None if candidate_ids is None else candidate_ids[start : start + step]
            rows, length = self._rows(len(chunk)), self._length(max(c.size for c in chunk))
            tokens, positions, segments = _layout(
                chunk, rows, length, self._info.pad_id, offset=n_prompt
            )
            hidden, log_probs = _decode(
                graphdef,
                state,
                cache,
                p_hidden,
                np.int32(n_prompt - 1),
                tokens,
                positions,
                segments,
                vocab_chunk=self.vocab_chunk,
            )
            log_probs = np.asarray(log_probs)
            top_ids = top_log_probs = p_candidates = candidates = None
            if k is not None:
                top_ids, top_log_probs = (
                    np.asarray(a) for a in _top_k_head(graphdef, state, hidden, top_k=k)
                )
            if chunk_ids is not None:
                # Continuation part: slot j of row g scores candidate row P-1+j.
                ids = np.zeros((rows, length, width), np.int32)
                for row, (c, row_ids) in enumerate(zip(chunk, chunk_ids, strict=True)):
                    ids[row, : c.size, : row_ids.shape[1]] = row_ids[n_prompt - 1 :]
                candidates = np.asarray(
                    _candidate_head(graphdef, state, hidden, ids, vocab_chunk=self.vocab_chunk)
                )
                # Prompt part: one prompt row, every continuation's ids side by side, so the
                # prompt's vocabulary pass runs once for all of them.
                p_ids = np.zeros((1, p_length, rows, width), np.int32)
                for row, row_ids in enumerate(chunk_ids):
                    p_ids[0, : n_prompt - 1, row, : row_ids.shape[1]] = row_ids[: n_prompt - 1]
                p_candidates = np.asarray(
                    _candidate_head(
                        graphdef,
                        state,
                        p_hidden,
                        p_ids.reshape(1, p_length, rows * width),
                        vocab_chunk=self.vocab_chunk,
                    )
                ).reshape(p_length, rows, width)
            for row, c in enumerate(chunk):
                n = c.size
                out.append(
                    ScoredSequence(
                        log_probs=np.concatenate([p_log_probs, log_probs[row, :n]]),
                        top_ids=None
                        if k is None
                        else np.concatenate([p_top_ids, top_ids[row, :n]])[:, :top_k],
                        top_log_probs=None
                        if k is None
                        else np.concatenate([p_top_log_probs, top_log_probs[row, :n]])[:, :top_k],
                        candidate_log_probs=None
                        if chunk_ids is None
                        else np.concatenate(
                            [p_candidates[: n_prompt - 1, row], candidates[row, :n]]
                        )[:, : chunk_ids[row].shape[1]],
                    )
                )
        return out

    # ---- compiles -----------------------------------------------------------------------

    def compile_count(self) -> int:
        """How many distinct shapes the jitted scoring pieces have compiled so far, counted
        by their jit caches (a new shape or static argument adds one). The pieces are shared
        by every :class:`InProcessTeacher` of this process: one compile serves every teacher
        of the same architecture, and each compile counts once."""
        return sum(
            piece._cache_size()
            for piece in (_forward, _top_k_head, _candidate_head, _prefill, _decode)
        )

    def warm_up(self, *, shared: bool = False) -> int:
        """Compile every shape of ``shapes.combinations()`` by running each piece once on
        dummy inputs; returns how many shapes it compiled (0 without ``shapes``, or when
        already warm). After it, :meth:`score` never compiles.

        ``shared=True`` also compiles what :meth:`score_shared` adds: the prompt prefill per
        length bucket, the decode per ``shapes.shared_combinations(max_length)`` triple, and
        the prompt's heads (one row; top-k per bucket unless 1 is a row bucket, candidates
        per row bucket times candidate bucket ids)."""
        shapes = self.shapes
        if shapes is None:
            return 0
        before = self.compile_count()
        graphdef, state = nnx.split(self.model)
        vocab, chunk = self._info.vocab_size, self.vocab_chunk
        hidden_of: dict[tuple[int, int], jax.Array] = {}

        def dummy(rows: int, length: int):
            tokens = np.full((rows, length), self._info.pad_id, np.int32)
            return tokens, np.zeros_like(tokens), np.ones_like(tokens)

        for rows, length, k, width in shapes.combinations():
            if (rows, length) not in hidden_of:
                hidden_of[rows, length] = jax.block_until_ready(
                    _forward(graphdef, state, *dummy(rows, length), vocab_chunk=chunk)
                )[0]
            hidden = hidden_of[rows, length]
            if k:
                jax.block_until_ready(_top_k_head(graphdef, state, hidden, top_k=min(k, vocab)))
            if width:
                ids = np.zeros((rows, length, width), np.int32)
                jax.block_until_ready(
                    _candidate_head(graphdef, state, hidden, ids, vocab_chunk=chunk)
                )
        hidden_of.clear()
        if shared:
            triples = shapes.shared_combinations(self._info.max_length)
            for p_length in shapes.lengths:
                p_hidden, _, cache = jax.block_until_ready(
                    _prefill(graphdef, state, *dummy(1, p_length), vocab_chunk=chunk)
                )
                for k in shapes.top_ks if 1 not in shapes.rows else ():
                    jax.block_until_ready(
                        _top_k_head(graphdef, state, p_hidden, top_k=min(k, vocab))
                    )
                for rows in shapes.rows:
                    for width in shapes.candidates:
                        ids = np.zeros((1, p_length, rows * width), np.int32)
                        jax.block_until_ready(
                            _candidate_head(graphdef, state, p_hidden, ids, vocab_chunk=chunk)
                        )
                for rows, length in ((r, c) for r, p, c in triples if p == p_length):
                    jax.block_until_ready(
                        _decode(
                            graphdef,
                            state,
                            cache,
                            p_hidden,
                            np.int32(0),
                            *dummy(rows, length),
                            vocab_chunk=chunk,
                        )
                    )
        return self.compile_count() - before


__all__ = [
    "CompatibilityError",
    "InProcessTeacher",
    "ScoreShapes",
    "ScoredSequence",
    "Teacher",
    "TeacherInfo",
    "check_candidate_ids",
    "check_compatible",
    "check_sequences",
    "check_shared_sequences",
    "model_hash",
]
