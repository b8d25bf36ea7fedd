"""Benchmark: block-diffusion student forward on the current block, prefix KV cache vs full.

Measures the cost of scoring the last block of a sequence (the block being denoised) two
ways, both giving the logits of the same ``block_size`` tokens:

- cached: the clean prefix's keys/values already sit in a :class:`KVCache` (filled once,
  outside the timing); each call is ``Transformer.decode`` of the block with no write, which
  is what one denoising step pays with the cache;
- full: each call is a full forward over the whole sequence, keeping the last block's logits,
  which is what a cache-less denoiser pays per step.

Both paths are jitted once and warmed up; the logits are checked to agree before timing.
Timing alternates the paths in rounds (A, B, A, B, ...) so machine noise hits both alike, and
the report gives per path the median time per call, throughput counted as block tokens
scored per second, and the cached/full throughput ratio measured in this same run.

Run: ``make bench`` or ``.venv/bin/python bench/bench_prefix_cache.py [--seq-len 512 ...]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from timing import time_calls  # noqa: E402

from distill.config import ModelConfig  # noqa: E402
from distill.models.kv_cache import KVCache  # noqa: E402
from distill.models.transformer import Transformer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512, help="total tokens per row")
    parser.add_argument("--block-size", type=int, default=16, help="diffusion block size")
    parser.add_argument("--batch", type=int, default=8, help="rows per call")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--calls", type=int, default=5, help="calls per path per round")
    args = parser.parse_args()
    if args.seq_len % args.block_size or args.seq_len <= args.block_size:
        parser.error("--seq-len must be a multiple of --block-size and longer than one block")
    if min(args.batch, args.rounds, args.calls) < 1:
        parser.error("--batch, --rounds and --calls must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    seq_len, block, batch = args.seq_len, args.block_size, args.batch
    prefix_len = seq_len - block
    config = ModelConfig(
        vocab_size=256,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        d_ff=1024,
        attention_type="block_diffusion",
        block_size=block,
        max_length=seq_len,
    )
    print(f"jax {jax.__version__}; device {jax.devices()[0]} (backend {jax.default_backend()})")
    print(
        f"model: d_model={config.d_model} n_layers={config.n_layers} n_heads={config.n_heads} "
        f"n_kv_heads={config.n_kv_heads} d_ff={config.d_ff} vocab={config.vocab_size} "
        f"dtype={config.dtype} attention={config.attention_type}"
    )
    print(
        f"shape: batch={batch} seq_len={seq_len} block_size={block} "
        f"(prefix {prefix_len} cached tokens, block positions {prefix_len}..{seq_len - 1}); "
        f"rounds={args.rounds} calls/round={args.calls}"
    )

    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    tokens = jax.random.randint(jax.random.key(1), (batch, seq_len), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    segments = jnp.ones((batch, seq_len), jnp.int32)
    prefix = (tokens[:, :prefix_len], positions[:, :prefix_len], segments[:, :prefix_len])
    current = (tokens[:, prefix_len:], positions[:, prefix_len:], segments[:, prefix_len:])

    @jax.jit
    def fill(state, cache, tok, pos, seg):
        _, cache = nnx.merge(graphdef, state).decode(tok, pos, seg, cache, write_index=0)
        return cache

    @jax.jit
    def cached_block(state, cache, tok, pos, seg):
        logits, _ = nnx.merge(graphdef, state).decode(tok, pos, seg, cache)
        return logits

    @jax.jit
    def full_block(state, tok, pos, seg):
        return nnx.merge(graphdef, state)(tok, pos, seg)[:, -block:]

    cache = fill(state, KVCache.init(config, batch, prefix_len), *prefix)
    jax.block_until_ready(cache)

    def run_cached() -> jax.Array:
        return cached_block(state, cache, *current)

    def run_full() -> jax.Array:
        return full_block(state, tokens, positions, segments)

    # Warm-up (compiles each path once) and the agreement check.
    cached_logits, full_logits = np.asarray(run_cached()), np.asarray(run_full())
    np.testing.assert_allclose(cached_logits, full_logits, atol=1e-4)
    diff = float(np.max(np.abs(cached_logits - full_logits)))
    print(f"check: block logits {cached_logits.shape} agree (max |diff| {diff:.2e} <= 1e-4)")
    time_calls(run_cached, 2)
    time_calls(run_full, 2)

    per_call: dict[str, list[float]] = {"cached": [], "full": []}
    for _ in range(args.rounds):
        per_call["cached"].append(time_calls(run_cached, args.calls))
        per_call["full"].append(time_calls(run_full, args.calls))

    scored = batch * block  # useful work per call: the block tokens scored
    throughput = {}
    for name, label in (("cached", "cached (decode block vs KV cache)"), ("full", "full forward")):
        times = per_call[name]
        median = statistics.median(times)
        throughput[name] = scored / median
        print(
            f"{label:34s} median {median * 1e3:9.2f} ms/call "
            f"(rounds {min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}), "
            f"{throughput[name]:11.0f} block tokens/s"
        )
    print(f"ratio cached/full throughput: {throughput['cached'] / throughput['full']:.1f}x")


if __name__ == "__main__":
    main()
