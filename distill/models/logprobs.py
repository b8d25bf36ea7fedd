"""Log-probabilities of chosen tokens without materializing ``[B, N, V]`` logits.

The output projection is applied one vocabulary chunk at a time with an online
log-sum-exp (``lax.scan`` with a rematerialized body), so memory grows with
``B * N * vocab_chunk`` instead of ``B * N * V``, in the forward and in the gradient.

Precision does not depend on the logit scale: the row maximum is subtracted from the raw
logits (the chosen one read from the same logits as the maximum) before the temperature is
applied, so a confident token's log-prob is ``-log(sum)`` with no term of the size of the
logits. Subtracting two separately rounded values near the logit scale instead
(``logit - logsumexp``, or ``logits / T - max`` which XLA may contract into one
fused multiply-add) errs by about ``|logit| * eps``: 1e-4 at logits near 1000. Rollout and
replay both normalize this way (:func:`tempered_log_softmax`, :func:`gathered_log_probs`),
so they agree to float32 precision at any logit scale.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp


def check_temperature(temperature: Any) -> None:
    """A sampling temperature is a static, finite number > 0 (inf flattens every
    distribution to uniform, NaN poisons it)."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        raise ValueError(f"`temperature` must be a finite number > 0; received {temperature!r}")


def _check_excluded(excluded_id: Any, vocab: int) -> None:
    # A negative id would exclude an id counted from the end (or, chunked, nothing at all).
    if excluded_id is None:
        return
    if (
        isinstance(excluded_id, bool)
        or not isinstance(excluded_id, numbers.Integral)
        or not 0 <= excluded_id < vocab
    ):
        raise ValueError(f"`excluded_id` must be an id in [0, {vocab}); received {excluded_id!r}")


def tempered_log_softmax(
    logits: jax.Array, temperature: float = 1.0, excluded_id: int | None = None
) -> jax.Array:
    """``log softmax(logits / temperature)`` over the last axis, float32, with
    ``excluded_id`` (the mask id) at -inf: the full-vocabulary twin of
    :func:`gathered_log_probs`, rounded the same way."""
    check_temperature(temperature)
    _check_excluded(excluded_id, logits.shape[-1])
    logits = logits.astype(jnp.float32)
    if excluded_id is not None:
        logits = logits.at[..., excluded_id].set(-jnp.inf)
    # The result does not depend on the shift, so it carries no gradient.
    top = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
    shifted = (logits - top) / temperature
    return shifted - jnp.log(jnp.exp(shifted).sum(-1, keepdims=True))


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
    to it is the caller's to handle: its value here is not -inf). A target outside
    ``[0, V)`` gives NaN. ``vocab_chunk=None`` computes the full logits at once (the dense
    reference).
    """
    if hidden.ndim != 3 or targets.ndim not in (2, 3) or targets.shape[:2] != hidden.shape[:2]:
        raise ValueError(
            f"`targets` must be [B, N] or [B, N, k] matching hidden {hidden.shape[:2]}; "
            f"received {targets.shape}"
        )
    check_temperature(temperature)
    d_model, vocab = output_embedding.shape
    _check_excluded(excluded_id, vocab)
    if hidden.shape[-1] != d_model:
        raise ValueError(
            f"`output_embedding` must be [{hidden.shape[-1]}, V]; received {output_embedding.shape}"
        )
    h = hidden.astype(jnp.float32)
    weights = output_embedding.astype(jnp.float32)
    ids = targets if targets.ndim == 3 else targets[..., None]  # [B, N, k]

    def absorb(carry, columns: jax.Array, start):
        """Fold the vocabulary chunk ``[start, start + width)`` into the running maximum of
        the raw logits (``top``), the sum of ``exp((logit - top) / T)`` and the targets' raw
        logits."""
        top, total, chosen = carry
        width = columns.shape[1]
        logits = jnp.einsum("bnd,dv->bnv", h, columns)
        local = ids - start
        found = jnp.take_along_axis(logits, jnp.clip(local, 0, width - 1), axis=-1)
        chosen = jnp.where((local >= 0) & (local < width), found, chosen)
        if excluded_id is not None:
            logits = jnp.where(start + jnp.arange(width) == excluded_id, -jnp.inf, logits)
        # The result does not depend on the shift, so it carries no gradient (as in
        # jax.nn.logsumexp); the chosen logits and the sum still do.
        new_top = jnp.maximum(top, jax.lax.stop_gradient(logits.max(-1)))
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)  # no inf - inf before any logit
        rescale = jnp.exp((top - shift) / temperature)
        total = total * rescale + jnp.exp((logits - shift[..., None]) / temperature).sum(-1)
        return new_top, total, chosen

    rows = h.shape[:2]
    carry = (
        jnp.full(rows, -jnp.inf, jnp.float32),
        jnp.zeros(rows, jnp.float32),
        jnp.full(ids.shape, jnp.nan, jnp.float32),  # stays NaN for an id outside [0, V)
    )
    if vocab_chunk is None or vocab_chunk >= vocab:
        carry = absorb(carry, weights, 0)
    else:
        # Walk the vocabulary in place (dynamic slices of W, no padded or transposed copy);
        # a remainder shorter than a chunk is one more static slice.
        n_full = vocab // vocab_chunk

        @jax.checkpoint
        def body(carry, index):
            start = index * vocab_chunk
            columns = jax.lax.dynamic_slice_in_dim(weights, start, vocab_chunk, axis=1)
            return absorb(carry, columns, start), None

        carry, _ = jax.lax.scan(body, carry, jnp.arange(n_full))
        if vocab % vocab_chunk:
            tail = n_full * vocab_chunk
            carry = absorb(carry, weights[:, tail:], tail)
    top, total, chosen = carry
    # The temperature comes after the shift: a target at the row maximum gives exactly 0.
    log_probs = (chosen - top[..., None]) / temperature - jnp.log(total)[..., None]
    return log_probs if targets.ndim == 3 else log_probs[..., 0]
