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
    """``log softmax(hidden @ output_embedding / temperature)[targets]``, float32 ``[B, N]``.

    ``hidden`` ``[B, N, d]``; ``output_embedding`` ``[d, V]``; ``targets`` ``[B, N]`` int.
    ``excluded_id`` (the mask id) gets probability zero before normalizing.
    ``vocab_chunk=None`` computes the full logits at once (the dense reference).
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"`targets` must be [B, N] matching hidden {hidden.shape[:2]}; received {targets.shape}"
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
    chosen = jnp.einsum("bnd,dbn->bn", h, jnp.take(weights, targets, axis=1)) / temperature

    def chunk_lse(columns: jax.Array, ids: jax.Array) -> jax.Array:
        logits = jnp.einsum("bnd,dv->bnv", h, columns) / temperature
        drop = ids >= vocab if excluded_id is None else (ids >= vocab) | (ids == excluded_id)
        return jax.nn.logsumexp(jnp.where(drop, -jnp.inf, logits), axis=-1)

    if vocab_chunk is None or vocab_chunk >= vocab:
        lse = chunk_lse(weights, jnp.arange(vocab))
    else:
        n_chunks = -(-vocab // vocab_chunk)
        padded = jnp.pad(weights, ((0, 0), (0, n_chunks * vocab_chunk - vocab)))
        columns = padded.reshape(d_model, n_chunks, vocab_chunk).transpose(1, 0, 2)
        ids = jnp.arange(n_chunks * vocab_chunk).reshape(n_chunks, vocab_chunk)

        @jax.checkpoint
        def body(running, chunk):
            return jnp.logaddexp(running, chunk_lse(*chunk)), None

        start = jnp.full(h.shape[:2], -jnp.inf, jnp.float32)
        lse, _ = jax.lax.scan(body, start, (columns, ids))
    return chosen - lse
