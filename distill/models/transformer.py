"""One Llama-style decoder for the causal teacher and the block-diffusion student.

RMSNorm, RoPE on logical positions (Hugging Face "rotate half" convention, optionally with
``linear`` or ``llama3`` frequency scaling), SwiGLU MLP, grouped-query attention with
optional q/k/v biases (Qwen2), tied or untied embeddings, float32 or bfloat16 parameters. The
attention pattern comes from :mod:`distill.models.masks`: ``causal`` or ``block_diffusion``
over logical positions and segments, optionally with packed canvas chunks, optionally
against a :class:`~distill.models.kv_cache.KVCache` of clean tokens.

Shapes: ``tokens``, ``positions``, ``segment_ids``, ``chunk_ids`` are ``[B, L]`` int;
logits are ``[B, L, vocab_size]`` float32. Segment 0 marks padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distill.config import ModelConfig
from distill.models import masks
from distill.models.kv_cache import KVCache
from distill.models.planner import CommitPlanner
from distill.models.sharding import constrain


class LogitsModel(Protocol):
    """Anything that maps a token layout to next/same-position logits."""

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        chunk_ids: jax.Array | None = None,
    ) -> jax.Array: ...


def _init(names: tuple[str, ...], std: float) -> nnx.Initializer:
    # Annotations only: placement happens in sharding.shard_module, never at init.
    return nnx.with_partitioning(nnx.initializers.normal(stddev=std), names, eager_sharding=False)


def _zeros(names: tuple[str, ...]) -> nnx.Initializer:
    return nnx.with_partitioning(nnx.initializers.zeros_init(), names, eager_sharding=False)


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies ``[head_dim / 2]`` float32 of ``config``, with its scaling.

    Computed once on the host in float32, in the order of operations of Hugging Face's
    ``modeling_rope_utils`` (default, ``linear`` and ``llama3`` variants), so a converted
    checkpoint rotates exactly as its reference implementation does.
    """
    dim = config.resolved_head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponents)).astype(
        np.float32
    )
    factor = np.float32(config.rope_scaling_factor)
    if config.rope_scaling == "linear":
        return (inv_freq / factor).astype(np.float32)
    if config.rope_scaling == "llama3":
        low, high = (
            np.float32(config.rope_low_freq_factor),
            np.float32(config.rope_high_freq_factor),
        )
        old_context = np.float32(config.rope_original_max_position)
        low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rotary_embedding(
    x: jax.Array,
    positions: jax.Array,
    theta: float,
    *,
    inv_freq: Sequence[float] | np.ndarray | None = None,
) -> jax.Array:
    """Rotate ``x`` ``[B, T, H, D]`` by its logical ``positions`` ``[B, T]``.

    ``inv_freq`` (``[D / 2]``, e.g. from :func:`rope_inverse_frequencies`) overrides the
    unscaled frequencies ``theta ** (-2i / D)``.
    """
    half = x.shape[-1] // 2
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) / half))
    else:
        inv_freq = jnp.asarray(inv_freq, dtype=jnp.float32)
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.resolved_head_dim
        self.rope_theta = config.rope_theta
        # Static (hashable) host constants: the same frequencies on every device.
        self.inv_freq = tuple(float(f) for f in rope_inverse_frequencies(config))
        std, d = config.init_std, config.d_model
        common = dict(use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
        qkv = dict(common, use_bias=config.attention_bias)
        self.q_proj = nnx.Linear(
            d,
            self.n_heads * self.head_dim,
            kernel_init=_init(("embed", "heads"), std),
            bias_init=_zeros(("heads",)),
            **qkv,
        )
        self.k_proj = nnx.Linear(
            d,
            self.n_kv_heads * self.head_dim,
            kernel_init=_init(("embed", "kv_heads"), std),
            bias_init=_zeros(("kv_heads",)),
            **qkv,
        )
        self.v_proj = nnx.Linear(
            d,
            self.n_kv_heads * self.head_dim,
            kernel_init=_init(("embed", "kv_heads"), std),
            bias_init=_zeros(("kv_heads",)),
            **qkv,
        )
        self.o_proj = nnx.Linear(
            self.n_heads * self.head_dim, d, kernel_init=_init(("heads", "embed"), std), **common
        )

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        cached: tuple[jax.Array, jax.Array] | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attend ``x`` ``[B, T, d]`` to (cached keys ++ its own keys) under ``mask``
        ``[B, T, S + T]``. Returns the output and this call's own post-RoPE (k, v)."""
        batch, length, _ = x.shape
        q, k, v = self._project(x, positions)
        new_kv = (k, v)
        if cached is not None:
            k = jnp.concatenate([cached[0].astype(k.dtype), k], axis=1)
            v = jnp.concatenate([cached[1].astype(v.dtype), v], axis=1)
        group = self.n_heads // self.n_kv_heads
        q = q.reshape(batch, length, self.n_kv_heads, group, self.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(self.head_dim))
        allowed = mask[:, None, None, :, :]
        scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        # A query with no visible key (padding) gets an exact zero output, not a uniform mix.
        probs = jnp.where(jnp.any(allowed, axis=-1, keepdims=True), probs, 0.0)
        out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
        out = out.reshape(batch, length, self.n_heads * self.head_dim)
        return self.o_proj(out), new_kv

    def attend_chunks(
        self,
        x: jax.Array,
        positions: jax.Array,
        clean: tuple[jax.Array, jax.Array],
        mask_clean: jax.Array,
        mask_own: jax.Array,
    ) -> jax.Array:
        """Block-sparse attention of canvas chunks ``x`` ``[B, C, K, d]``: each chunk sees
        the clean keys ``clean`` (``[B, S, Hkv, D]`` each) under ``mask_clean``
        ``[B, C, K, S]`` and its own keys under ``mask_own`` ``[B, C, K, K]``; never another
        chunk. Cost grows with C * K * (S + K), not with (S + C * K) ** 2."""
        batch, n_chunks, size, _ = x.shape
        flat = x.reshape(batch, n_chunks * size, -1)
        q, k, v = self._project(flat, positions.reshape(batch, n_chunks * size))
        group = self.n_heads // self.n_kv_heads
        q = q.reshape(batch, n_chunks, size, self.n_kv_heads, group, self.head_dim)
        k = k.reshape(batch, n_chunks, size, self.n_kv_heads, self.head_dim)
        v = v.reshape(batch, n_chunks, size, self.n_kv_heads, self.head_dim)
        clean_k, clean_v = (a.astype(k.dtype) for a in clean)
        f32 = jnp.float32
        to_clean = jnp.einsum("bcqhgd,bshd->bchgqs", q, clean_k, preferred_element_type=f32)
        to_own = jnp.einsum("bcqhgd,bckhd->bchgqk", q, k, preferred_element_type=f32)
        scores = jnp.concatenate([to_clean, to_own], axis=-1) / jnp.sqrt(f32(self.head_dim))
        allowed = jnp.concatenate([mask_clean, mask_own], axis=-1)[:, :, None, None]
        scores = jnp.where(allowed, scores, jnp.finfo(f32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(jnp.any(allowed, axis=-1, keepdims=True), probs, 0.0).astype(v.dtype)
        n_clean = clean_k.shape[1]
        out = jnp.einsum("bchgqs,bshd->bcqhgd", probs[..., :n_clean], clean_v) + jnp.einsum(
            "bchgqk,bckhd->bcqhgd", probs[..., n_clean:], v
        )
        return self.o_proj(out.reshape(batch, n_chunks, size, self.n_heads * self.head_dim))

    def _project(self, x: jax.Array, positions: jax.Array):
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, length, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, length, self.n_kv_heads, self.head_dim)
        q = rotary_embedding(q, positions, self.rope_theta, inv_freq=self.inv_freq)
        k = rotary_embedding(k, positions, self.rope_theta, inv_freq=self.inv_freq)
        return q, k, v


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        std = config.init_std
        common = dict(use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
        d, ff = config.d_model, config.d_ff
        self.gate_proj = nnx.Linear(d, ff, kernel_init=_init(("embed", "mlp"), std), **common)
        self.up_proj = nnx.Linear(d, ff, kernel_init=_init(("embed", "mlp"), std), **common)
        self.down_proj = nnx.Linear(ff, d, kernel_init=_init(("mlp", "embed"), std), **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = nnx.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(constrain(hidden, ("batch", "length", "mlp")))


def _rms_norm(config: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(
        config.d_model,
        epsilon=config.norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",), eager_sharding=False),
        rngs=rngs,
    )


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.input_norm = _rms_norm(config, rngs)
        self.attention = Attention(config, rngs=rngs)
        self.post_attention_norm = _rms_norm(config, rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, positions, mask, cached):
        attended, new_kv = self.attention(self.input_norm(x), positions, mask, cached)
        x = x + attended
        x = x + self.mlp(self.post_attention_norm(x))
        return constrain(x, ("batch", "length", "embed")), new_kv

    def chunks(self, x, positions, clean, mask_clean, mask_own):
        x = x + self.attention.attend_chunks(
            self.input_norm(x), positions, clean, mask_clean, mask_own
        )
        return x + self.mlp(self.post_attention_norm(x))


class Transformer(nnx.Module):
    """The decoder. ``config.attention_type`` fixes its attention pattern."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size,
            config.d_model,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            embedding_init=_init(("vocab", "embed"), config.init_std),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs) for _ in range(config.n_layers)])
        self.final_norm = _rms_norm(config, rngs)
        self.lm_head = (
            None
            if config.tie_embeddings
            else nnx.Linear(
                config.d_model,
                config.vocab_size,
                use_bias=False,
                dtype=config.dtype,
                param_dtype=config.param_dtype,
                kernel_init=_init(("embed", "vocab"), config.init_std),
                rngs=rngs,
            )
        )
        # Created last, from its own stream, so a student with a planner shares every other
        # parameter's initial value with one without.
        self.planner = (
            None
            if config.planner_hidden is None
            else CommitPlanner(config, rngs=nnx.Rngs(rngs.params()))
        )

    # ---- public API -------------------------------------------------------------------

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        chunk_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Logits ``[B, L, V]`` float32 of a full forward (no cache)."""
        return self.logits(self.hidden_states(tokens, positions, segment_ids, chunk_ids=chunk_ids))

    def hidden_states(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        chunk_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Final normalized hidden states ``[B, L, d_model]`` (logits = ``logits(hidden)``)."""
        return self._self_attend(tokens, positions, segment_ids, chunk_ids)[0]

    def _self_attend(self, tokens, positions, segment_ids, chunk_ids):
        self._check_layout(tokens, positions, segment_ids, chunk_ids)
        mask = masks.self_attention_mask(
            positions,
            segment_ids,
            attention_type=self.config.attention_type,
            block_size=self.config.block_size,
            chunk_ids=chunk_ids,
        )
        return self._run(tokens, positions, mask, cache=None)

    def prefill(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Hidden states ``[B, L, d]`` of a full forward and a cache of exactly its ``L``
        slots (for canvas chunks or decoding after it). Cheaper than :meth:`decode_hidden`
        against an empty cache, which would also attend over the empty slots."""
        hidden, new_kv = self._self_attend(tokens, positions, segment_ids, None)
        return hidden, KVCache(
            keys=tuple(k for k, _ in new_kv),
            values=tuple(v for _, v in new_kv),
            positions=positions.astype(jnp.int32),
            segment_ids=segment_ids.astype(jnp.int32),
        )

    def decode(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: KVCache,
        *,
        write_index: int | jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Logits of ``T`` new tokens attending to ``cache`` and to each other.

        With ``write_index`` the new tokens' keys/values are stored at slots
        ``[write_index, write_index + T)`` of the returned cache (do this only for clean
        tokens: a committed block, or each teacher token); without it the cache is unchanged
        (a denoising step over a canvas that is not final yet).
        """
        hidden, cache = self.decode_hidden(
            tokens, positions, segment_ids, cache, write_index=write_index
        )
        return self.logits(hidden), cache

    def decode_hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: KVCache,
        *,
        write_index: int | jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """:meth:`decode` returning final hidden states ``[B, T, d]`` instead of logits."""
        self._check_layout(tokens, positions, segment_ids, None)
        if isinstance(write_index, int) and not (
            0 <= write_index <= cache.capacity - tokens.shape[1]
        ):
            raise ValueError(
                f"`write_index` must be in [0, {cache.capacity - tokens.shape[1]}] for "
                f"{tokens.shape[1]} tokens; received {write_index}"
            )
        mask = masks.attention_mask(
            positions,
            segment_ids,
            jnp.concatenate([cache.positions, positions], axis=1),
            jnp.concatenate([cache.segment_ids, segment_ids], axis=1),
            attention_type=self.config.attention_type,
            block_size=self.config.block_size,
        )
        hidden, new_kv = self._run(tokens, positions, mask, cache=cache)
        if write_index is not None:
            cache = cache.write(
                tuple(k for k, _ in new_kv),
                tuple(v for _, v in new_kv),
                positions,
                segment_ids,
                write_index,
            )
        return hidden, cache

    def chunk_hidden_states(
        self,
        clean: KVCache,
        chunk_tokens: jax.Array,
        chunk_positions: jax.Array,
        chunk_segments: jax.Array,
    ) -> jax.Array:
        """Hidden states ``[B, C, K, d]`` of canvas chunks against a cache of clean tokens.

        Chunk c (``[B, C, K]`` tokens, logical positions, segments; segment 0 = empty slot)
        is a copy of one block b: it sees cached clean keys of its segment in blocks < b and
        its own slots, exactly as in the dense packed layout of
        :func:`~distill.models.masks.pack_canvas_chunks`, at block-sparse cost.
        """
        if self.config.attention_type != "block_diffusion":
            raise ValueError(
                "`attention_type` must be 'block_diffusion' for canvas chunks; received "
                f"{self.config.attention_type!r}"
            )
        if chunk_tokens.ndim != 3:
            raise ValueError(f"`chunk_tokens` must be [B, C, K]; received {chunk_tokens.shape}")
        mask_clean, mask_own = masks.chunk_masks(
            chunk_positions,
            chunk_segments,
            clean.positions,
            clean.segment_ids,
            block_size=self.config.block_size,
        )
        x = self.embed(chunk_tokens)
        for index, layer in enumerate(self.layers):
            x = layer.chunks(
                x,
                chunk_positions,
                (clean.keys[index], clean.values[index]),
                mask_clean,
                mask_own,
            )
        return self.final_norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Project hidden states ``[..., d]`` to float32 logits ``[..., V]``."""
        out = self.embed.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        return constrain(out.astype(jnp.float32), ("batch", "length", "vocab"))

    def commit_logits(self, hidden: jax.Array) -> jax.Array:
        """The planner's commit logits ``[...]`` float32 of hidden states ``[..., d]``."""
        if self.planner is None:
            raise ValueError(
                "`model.config.planner_hidden` must be set for commit logits (a student with "
                "a planner head); received None"
            )
        return self.planner(hidden)

    def output_embedding(self) -> jax.Array:
        """The ``[d_model, vocab]`` matrix that maps hidden states to logits."""
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    # ---- internals --------------------------------------------------------------------

    def _run(
        self, tokens: jax.Array, positions: jax.Array, mask: jax.Array, cache: KVCache | None
    ) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        x = constrain(self.embed(tokens), ("batch", "length", "embed"))
        new_kv = []
        for index, layer in enumerate(self.layers):
            cached = None if cache is None else (cache.keys[index], cache.values[index])
            x, kv = layer(x, positions, mask, cached)
            new_kv.append(kv)
        return self.final_norm(x), new_kv

    def _check_layout(self, tokens, positions, segment_ids, chunk_ids) -> None:
        if tokens.ndim != 2:
            raise ValueError(f"`tokens` must be [B, L]; received shape {tokens.shape}")
        for name, array in (
            ("positions", positions),
            ("segment_ids", segment_ids),
            ("chunk_ids", chunk_ids),
        ):
            if array is not None and array.shape != tokens.shape:
                raise ValueError(
                    f"`{name}` must have the shape of tokens {tokens.shape}; received {array.shape}"
                )
        if chunk_ids is not None and self.config.attention_type != "block_diffusion":
            raise ValueError(
                "`chunk_ids` must be None unless attention_type is 'block_diffusion'; "
                f"received chunks with {self.config.attention_type!r}"
            )
