"""Log-probabilities of chosen tokens without materializing ``[B, N, V]`` logits.

The output projection is applied one vocabulary chunk at a time with an online
log-sum-exp (``lax.scan`` with a rematerialized body), so memory grows with
``B * N * vocab_chunk`` instead of ``B * N * V``, in the forward and in the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gathered_log_probs(
    hidden: jax.Array,
    output_embedding: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    excluded_id: int | None = None,
    vocab_chunk: int | None = 4096,
) -> jax.Array:
    """``log softmax(hidden @ output_embedding / temperature)[targets]``, float32, shaped
    like ``targets``.

    ``hidden`` ``[B, N, d]``; ``output_embedding`` ``[d, V]``; ``targets`` ``[B, N]`` int, or
    ``[B, N, k]`` for k ids per position (e.g. a teacher's top-k), sharing one log-sum-exp.
    ``excluded_id`` (the mask id) gets probability zero before normalizing (a target equal
    to it is the caller's to handle: its value here is not -inf). ``vocab_chunk=None`` computes the full logits at once (the dense
    reference).
    """
    if hidden.ndim != 3 or targets.ndim not in (2, 3) or targets.shape[:2] != hidden.shape[:2]:
        raise ValueError(
            f"`targets` must be [B, N] or [B, N, k] matching hidden {hidden.shape[:2]}; "
            f"received {targets.shape}"
        )
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0; received {temperature}")
    d_model, vocab = output_embedding.shape
    if hidden.shape[-1] != d_model:
        raise ValueError(
            f"`output_embedding` must be [{hidden.shape[-1]}, V]; received {output_embedding.shape}"
        )
    h = hidden.astype(jnp.float32)
    weights = output_embedding.astype(jnp.float32)
    target_columns = jnp.take(weights, targets, axis=1)  # [d, B, N(, k)]
    chosen = jnp.einsum("bnd,dbn...->bn...", h, target_columns) / temperature

    def chunk_lse(columns: jax.Array, ids: jax.Array) -> jax.Array:
        logits = jnp.einsum("bnd,dv->bnv", h, columns) / temperature
        if excluded_id is not None:
            logits = jnp.where(ids == excluded_id, -jnp.inf, logits)
        return jax.nn.logsumexp(logits, axis=-1)

    if vocab_chunk is None or vocab_chunk >= vocab:
        lse = chunk_lse(weights, jnp.arange(vocab))
        return chosen - lse.reshape(lse.shape + (1,) * (targets.ndim - 2))
    # Walk the vocabulary in place (dynamic slices of W, no padded or transposed copy); a
    # remainder shorter than a chunk is one more static slice.
    n_full = vocab // vocab_chunk

    @jax.checkpoint
    def body(running, index):
        start = index * vocab_chunk
        columns = jax.lax.dynamic_slice_in_dim(weights, start, vocab_chunk, axis=1)
        ids = start + jnp.arange(vocab_chunk)
        return jnp.logaddexp(running, chunk_lse(columns, ids)), None

    lse, _ = jax.lax.scan(body, jnp.full(h.shape[:2], -jnp.inf, jnp.float32), jnp.arange(n_full))
    if vocab % vocab_chunk:
        tail = n_full * vocab_chunk
        lse = jnp.logaddexp(lse, chunk_lse(weights[:, tail:], jnp.arange(tail, vocab)))
    return chosen - lse.reshape(lse.shape + (1,) * (targets.ndim - 2))
