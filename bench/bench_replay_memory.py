"""Benchmark: peak memory of replay log-probs, gathered (chunked vocabulary) vs dense logits.

Replay needs ``log softmax(hidden @ W)[target]`` at every completion slot. Two ways:

- gathered: :func:`~distill.models.logprobs.gathered_log_probs` with ``vocab_chunk`` columns
  of ``W`` at a time and an online log-sum-exp (a rematerialized ``lax.scan``), so only
  ``[B, N, vocab_chunk]`` logits ever exist;
- dense: the full ``[B, N, V]`` logits ``hidden @ W``, ``jax.nn.log_softmax``, then a gather.

Memory is read deterministically from XLA's compiled memory analysis
(``jax.jit(f).lower(*args).compile().memory_analysis()``), not from a sampled process
peak: the script prints the argument, output, alias and temporary sizes and takes
``peak = arguments + outputs - aliased + temporaries``, for the log-probs (forward) and for
their gradient w.r.t. ``hidden`` and ``W``, and the dense/gathered ratio of each. Only the
log-prob head is built (hidden states are random ``[B, N, d]``): the transformer body costs
the same in both paths and is left out. The two paths are checked to agree numerically.

Run: ``make bench`` or ``.venv/bin/python bench/bench_replay_memory.py [--vocab 32768 ...]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from distill.models.logprobs import gathered_log_probs  # noqa: E402

MIB = 2**20
MASK_ID = 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size V")
    parser.add_argument("--seq-len", type=int, default=1024, help="scored positions per row N")
    parser.add_argument("--d-model", type=int, default=256, help="hidden size d")
    parser.add_argument("--batch", type=int, default=2, help="rows B")
    parser.add_argument("--vocab-chunk", type=int, default=4096, help="gathered path chunk")
    args = parser.parse_args()
    if min(args.vocab, args.seq_len, args.d_model, args.batch, args.vocab_chunk) < 1:
        parser.error("all sizes must be >= 1")
    return args


def dense_log_probs(hidden: jax.Array, weights: jax.Array, targets: jax.Array) -> jax.Array:
    """The dense reference: full logits, log-softmax (mask id excluded), gather."""
    logits = jnp.einsum("bnd,dv->bnv", hidden, weights)
    logits = logits.at[..., MASK_ID].set(-jnp.inf)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


def memory(fn, *args) -> tuple[dict[str, int], object]:
    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.memory_analysis()
    sizes = {
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "aliased": analysis.alias_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
    }
    sizes["peak"] = sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temporaries"]
    return sizes, compiled


def main() -> None:
    args = parse_args()
    batch, length, d_model, vocab = args.batch, args.seq_len, args.d_model, args.vocab
    print(f"jax {jax.__version__}; device {jax.devices()[0]} (backend {jax.default_backend()})")
    print(
        f"shape: hidden [{batch}, {length}, {d_model}] float32, W [{d_model}, {vocab}] float32, "
        f"targets [{batch}, {length}]; gathered vocab_chunk={args.vocab_chunk}; mask id "
        f"{MASK_ID} excluded; dense [B, N, V] logits = {batch * length * vocab * 4 / MIB:.0f} MiB"
    )
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (batch, length, d_model), jnp.float32)
    weights = 0.05 * jax.random.normal(keys[1], (d_model, vocab), jnp.float32)
    targets = jax.random.randint(keys[2], (batch, length), MASK_ID + 1, vocab)

    def gathered(hidden, weights, targets):
        return gathered_log_probs(
            hidden, weights, targets, excluded_id=MASK_ID, vocab_chunk=args.vocab_chunk
        )

    def grad_of(fn):
        return jax.grad(lambda h, w, t: jnp.sum(fn(h, w, t)), argnums=(0, 1))

    cases = {
        ("forward", "gathered"): gathered,
        ("forward", "dense"): dense_log_probs,
        ("gradient", "gathered"): grad_of(gathered),
        ("gradient", "dense"): grad_of(dense_log_probs),
    }
    sizes, outputs = {}, {}
    for key, fn in cases.items():
        sizes[key], compiled = memory(fn, hidden, weights, targets)
        outputs[key] = jax.block_until_ready(compiled(hidden, weights, targets))

    lp_diff = float(jnp.max(jnp.abs(outputs["forward", "gathered"] - outputs["forward", "dense"])))
    grad_diff = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(outputs["gradient", "gathered"], outputs["gradient", "dense"], strict=True)
    )
    print(
        f"check: log-probs max |diff| {lp_diff:.2e}; gradients max |diff| / max |grad| "
        f"{grad_diff:.2e}"
    )
    np.testing.assert_allclose(
        np.asarray(outputs["forward", "gathered"]),
        np.asarray(outputs["forward", "dense"]),
        atol=1e-4,
    )
    if grad_diff > 1e-4:
        raise AssertionError(f"gradients disagree: relative diff {grad_diff:.2e}")

    print("memory_analysis, MiB (peak = arguments + outputs - aliased + temporaries):")
    for (kind, path), row in sizes.items():
        cells = "  ".join(f"{name} {value / MIB:8.1f}" for name, value in row.items())
        print(f"  {kind:8s} {path:8s} {cells}")
    for kind in ("forward", "gradient"):
        dense, gathered_ = sizes[kind, "dense"], sizes[kind, "gathered"]
        print(
            f"ratio dense/gathered {kind:8s}: peak {dense['peak'] / gathered_['peak']:5.1f}x "
            f"({dense['peak'] / MIB:.1f} vs {gathered_['peak'] / MIB:.1f} MiB), temporaries "
            f"{dense['temporaries'] / max(gathered_['temporaries'], 1):5.1f}x "
            f"({dense['temporaries'] / MIB:.1f} vs {gathered_['temporaries'] / MIB:.1f} MiB)"
        )


if __name__ == "__main__":
    main()
