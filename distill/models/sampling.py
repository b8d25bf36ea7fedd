"""Autoregressive sampling from a causal model with a KV cache (the teacher's decoder).

Prompts are left-padded so that they all end at the same slot; one prefill forward writes
the prompts to the cache, then each new token is one forward of a single slot. The whole
loop is one ``jax.jit`` (a ``fori_loop``); the horizon ``max_new_tokens`` is static.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distill.models.kv_cache import KVCache
from distill.models.logprobs import check_temperature
from distill.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class CausalSample:
    """``tokens`` ``[B, max_new_tokens]`` sampled ids and their ``log_probs`` (float32)."""

    tokens: np.ndarray
    log_probs: np.ndarray
    stop_ids: tuple[int, ...]

    def completions(self) -> list[list[int]]:
        """Each row's ids cut after the first stop token (stop token included)."""
        out = []
        for row in self.tokens.tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in self.stop_ids), len(row))
            out.append(row[:cut])
        return out


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy"))
def _sample(
    graphdef,
    state,
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    *,
    max_new_tokens: int,
    greedy: bool,
    excluded: jax.Array,
):
    model: Transformer = nnx.merge(graphdef, state)
    batch, prompt_len = tokens.shape
    cache = KVCache.init(model.config, batch, prompt_len + max_new_tokens)
    logits, cache = model.decode(tokens, positions, segments, cache, write_index=0)
    next_position = positions[:, -1] + 1

    def body(step, carry):
        cache, last_logits, out, out_lp = carry
        log_probs = jax.nn.log_softmax(
            jnp.where(excluded, -jnp.inf, last_logits) / temperature, axis=-1
        )
        if greedy:
            token = jnp.argmax(log_probs, axis=-1)
        else:
            token = jax.random.categorical(jax.random.fold_in(key, step), log_probs, axis=-1)
        token_lp = jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]
        logits, cache = model.decode(
            token[:, None].astype(jnp.int32),
            (next_position + step)[:, None],
            jnp.ones((batch, 1), jnp.int32),
            cache,
            write_index=prompt_len + step,
        )
        out = out.at[:, step].set(token.astype(jnp.int32))
        out_lp = out_lp.at[:, step].set(token_lp)
        return cache, logits[:, 0], out, out_lp

    init = (
        cache,
        logits[:, -1],
        jnp.zeros((batch, max_new_tokens), jnp.int32),
        jnp.zeros((batch, max_new_tokens), jnp.float32),
    )
    _, _, out, out_lp = jax.lax.fori_loop(0, max_new_tokens, body, init)
    return out, out_lp


def sample_causal(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    key: jax.Array,
    pad_id: int,
    stop_ids: Sequence[int],
    excluded_ids: Sequence[int] = (),
    temperature: float = 1.0,
    greedy: bool = False,
) -> CausalSample:
    """Sample ``max_new_tokens`` after each prompt (``excluded_ids`` are never sampled)."""
    if model.config.attention_type != "causal":
        raise ValueError(
            f"`model.attention_type` must be 'causal'; received {model.config.attention_type!r}"
        )
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("`prompts` must be a non-empty list of non-empty id lists")
    if max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be >= 1; received {max_new_tokens}")
    if not greedy:
        check_temperature(temperature)
    vocab = model.config.vocab_size
    for token in excluded_ids:
        # A negative id would index from the end and exclude the wrong token.
        integral = isinstance(token, numbers.Integral) and not isinstance(token, bool)
        if not (integral and 0 <= token < vocab):
            raise ValueError(f"`excluded_ids` must hold ids in [0, {vocab}); received {token!r}")
    width = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    positions = np.zeros_like(tokens)
    segments = np.zeros_like(tokens)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = prompt
        positions[row, width - len(prompt) :] = np.arange(len(prompt))
        segments[row, width - len(prompt) :] = 1
    excluded = np.zeros(model.config.vocab_size, bool)
    excluded[list(excluded_ids)] = True
    graphdef, state = nnx.split(model)
    out, out_lp = _sample(
        graphdef,
        state,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        jnp.asarray(segments),
        key,
        jnp.float32(1.0 if greedy else temperature),
        max_new_tokens=max_new_tokens,
        greedy=greedy,
        excluded=jnp.asarray(excluded),
    )
    return CausalSample(np.asarray(out), np.asarray(out_lp), tuple(stop_ids))
