"""Benchmark: block-diffusion rollout with the clean-prefix KV cache vs full recomputation.

:func:`~distill.diffusion.denoise.rollout` generates a completion block by block; each
denoising step needs the logits of the current block. Two ways give the same trace:

- ``prefix_cache=True``: the clean earlier blocks sit in a KV cache; a step is one forward
  of the block's ``block`` tokens against the cache (plus one cache-writing forward per
  block);
- ``prefix_cache=False``: every step recomputes a full forward of the whole row.

The regime is a ``schedule`` commit rule with about ``--tokens-per-step`` tokens per step
(default; with a freshly initialized model a ``threshold`` rule of 0.9 never clears and
commits one token per step, which ``--commit-rule threshold`` measures instead). Both
paths are compiled and warmed up (the slow one by its first call), their traces are checked to be identical (tokens and
action steps equal, action log-probs close), then whole rollouts are timed in interleaved
rounds; the report gives the median time per rollout and the no-cache/cache ratio measured
in this same run.

Run: ``make bench`` or ``.venv/bin/python bench/bench_rollout_cache.py [--completion 256 ...]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from timing import time_calls  # noqa: E402

from distill.config import ModelConfig, RolloutConfig  # noqa: E402
from distill.diffusion.denoise import SamplingSettings, Trace, rollout  # noqa: E402
from distill.diffusion.replay import validate_trace  # noqa: E402
from distill.models.transformer import Transformer  # noqa: E402
from distill.tokenizer import SpecialIds  # noqa: E402

SPECIAL = SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=(3,))
VOCAB = 256


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--completion", type=int, default=256, help="completion tokens per row")
    parser.add_argument("--block-size", type=int, default=16, help="diffusion block size")
    parser.add_argument("--batch", type=int, default=4, help="rows per rollout")
    parser.add_argument("--commit-rule", choices=("schedule", "threshold"), default="schedule")
    parser.add_argument(
        "--tokens-per-step", type=int, default=4, help="schedule rule: steps = completion // this"
    )
    parser.add_argument("--threshold", type=float, default=0.9, help="threshold rule")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--calls", type=int, default=1, help="rollouts per path per round")
    parser.add_argument(
        "--warmup-below-s",
        type=float,
        default=20.0,
        help="an extra warm-up call only for a path whose compile + first call took less",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.prompt, args.completion, args.batch, args.block_size) < 1:
        parser.error("--prompt, --completion, --batch and --block-size must be >= 1")
    if min(args.rounds, args.calls, args.tokens_per_step) < 1:
        parser.error("--rounds, --calls and --tokens-per-step must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    block = args.block_size
    config = ModelConfig(
        vocab_size=VOCAB,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        d_ff=1024,
        attention_type="block_diffusion",
        block_size=block,
        max_length=args.prompt + args.completion + 2 * block,
    )
    if args.commit_rule == "schedule":
        rule = dict(commit_rule="schedule", schedule_steps=args.completion // args.tokens_per_step)
    else:
        rule = dict(commit_rule="threshold", threshold=args.threshold)
    rollout_config = RolloutConfig(
        **rule,
        max_completion_length=args.completion,
        temperature=1.0,
        stop_when_done=False,  # every row generates its whole completion: a fixed regime
    )
    settings = SamplingSettings.from_config(rollout_config, SPECIAL)
    print(f"jax {jax.__version__}; device {jax.devices()[0]} (backend {jax.default_backend()})")
    print(
        f"model: d_model={config.d_model} n_layers={config.n_layers} n_heads={config.n_heads} "
        f"n_kv_heads={config.n_kv_heads} d_ff={config.d_ff} vocab={config.vocab_size} "
        f"dtype={config.dtype} attention={config.attention_type} block_size={block}"
    )
    print(
        f"rollout: batch {args.batch}, prompt {args.prompt}, completion {args.completion}, "
        f"{args.commit_rule} rule ({rule}), temperature 1.0, stop_when_done off; "
        f"rounds={args.rounds} calls/round={args.calls}"
    )

    model = Transformer(config, rngs=nnx.Rngs(args.seed))
    rng = np.random.default_rng(args.seed)
    low = max(SPECIAL.pad_id, SPECIAL.mask_id, SPECIAL.bos_id, *SPECIAL.stop_ids) + 1
    prompts = rng.integers(low, VOCAB, size=(args.batch, args.prompt)).tolist()

    def run(prefix_cache: bool) -> Trace:
        return rollout(
            model, prompts, settings, seed=args.seed, global_step=0, prefix_cache=prefix_cache
        )

    runs = {"cache": lambda: run(True), "no cache": lambda: run(False)}
    traces = {}
    for name, fn in runs.items():
        # The first call compiles and runs once; a path that took under --warmup-below-s
        # seconds gets one more warm-up call (a slow one has run enough to be warm).
        start = time.perf_counter()
        traces[name] = jax.block_until_ready(fn())
        first = time.perf_counter() - start
        warm = f", warm-up {time_calls(fn, 1):.2f} s" if first < args.warmup_below_s else ""
        print(f"  {name:8s} compile + first rollout {first:6.1f} s{warm}")

    cached, full = traces["cache"], traces["no cache"]
    validate_trace(cached, VOCAB)
    completion = np.asarray(cached.completion_mask)
    steps = np.asarray(cached.action_steps)
    steps_per_row = steps.max(axis=1) + 1
    print(
        f"regime (from the trace): steps/row {steps_per_row.min()}..{steps_per_row.max()}, "
        f"tokens/step {float((completion.sum(1) / steps_per_row).mean()):.2f}, "
        f"tokens/forward {cached.tokens_per_forward():.2f}, layout row "
        f"{cached.tokens.shape[1]} slots"
    )
    for field in ("tokens", "action_steps", "completion_mask", "forwards"):
        np.testing.assert_array_equal(
            np.asarray(getattr(cached, field)), np.asarray(getattr(full, field)), err_msg=field
        )
    logp_diff = np.max(np.abs(np.asarray(cached.action_logps) - np.asarray(full.action_logps)))
    np.testing.assert_allclose(
        np.asarray(cached.action_logps), np.asarray(full.action_logps), atol=1e-4
    )
    print(
        "check: traces identical (tokens, action_steps, completion_mask, forwards equal; "
        f"action_logps max |diff| {logp_diff:.2e} <= 1e-4)"
    )

    per_call: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            per_call[name].append(time_calls(fn, args.calls))
    median = {name: statistics.median(times) for name, times in per_call.items()}
    tokens = int(completion.sum())
    for name, label in (("cache", "prefix KV cache"), ("no cache", "full recomputation")):
        times = per_call[name]
        print(
            f"{label:19s} median {median[name] * 1e3:9.1f} ms/rollout "
            f"(rounds {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}), "
            f"{tokens / median[name]:8.0f} completion tokens/s"
        )
    print(f"ratio no-cache/cache time per rollout: {median['no cache'] / median['cache']:.1f}x")


if __name__ == "__main__":
    main()
