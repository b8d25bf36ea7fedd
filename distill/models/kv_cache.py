"""Key/value cache of clean tokens for autoregressive and block-by-block decoding.

A cache has a fixed capacity of slots shared by all rows (left-padded layouts keep slot
indices aligned across rows). Each slot stores post-RoPE keys and values per layer plus the
logical position and segment id of its token; segment 0 marks an empty slot, which the mask
treats as padding. Writing is functional: :meth:`KVCache.write` returns a new cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from distill.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per layer ``keys``/``values`` ``[B, S, n_kv_heads, head_dim]``; ``positions`` and
    ``segment_ids`` ``[B, S]`` int32 (segment 0 = empty slot)."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    positions: jax.Array
    segment_ids: jax.Array

    @classmethod
    def init(cls, config: ModelConfig, batch_size: int, capacity: int) -> KVCache:
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1; received {batch_size}")
        if capacity < 1:
            raise ValueError(f"`capacity` must be >= 1; received {capacity}")
        shape = (batch_size, capacity, config.n_kv_heads, config.resolved_head_dim)
        dtype = jnp.dtype(config.dtype)
        empty = tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))
        return cls(
            keys=empty,
            values=empty,
            positions=jnp.zeros((batch_size, capacity), jnp.int32),
            segment_ids=jnp.zeros((batch_size, capacity), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    def write(
        self,
        keys: tuple[jax.Array, ...],
        values: tuple[jax.Array, ...],
        positions: jax.Array,
        segment_ids: jax.Array,
        index: int | jax.Array,
    ) -> KVCache:
        """Store ``T`` new slots (per-layer ``[B, T, Hkv, D]``) starting at slot ``index``.

        ``index`` may be traced; the caller guarantees ``index + T <= capacity`` (JAX clamps
        out-of-range dynamic slices, which would silently overwrite the last slots).
        """
        index = jnp.asarray(index, jnp.int32)
        zero = jnp.zeros((), jnp.int32)

        def put(store: jax.Array, new: jax.Array) -> jax.Array:
            start = (zero, index) + (zero,) * (store.ndim - 2)
            return jax.lax.dynamic_update_slice(store, new.astype(store.dtype), start)

        return KVCache(
            keys=tuple(put(s, n) for s, n in zip(self.keys, keys, strict=True)),
            values=tuple(put(s, n) for s, n in zip(self.values, values, strict=True)),
            positions=put(self.positions, positions.astype(jnp.int32)),
            segment_ids=put(self.segment_ids, segment_ids.astype(jnp.int32)),
        )
