"""Benchmark: exact replay of a rollout trace, packed canvas chunks vs one forward per step.

A rollout of the block-diffusion student records, per completion slot, the step at which it
was committed. Replaying the trace (the log-probs of the committed tokens under the canvas
each step saw) can be done two ways that give the same log-probs:

- per-step (:func:`~distill.diffusion.replay.replay_per_step`): one full forward of the
  whole row per step, ``S`` forwards of ``P + L`` tokens (``lax.scan``, each step
  rematerialized with ``jax.checkpoint`` in the gradient);
- packed (:func:`~distill.diffusion.replay.replay_packed`): the clean row once, plus one
  chunk of ``block`` tokens per (row, step) holding that step's canvas of its block. The
  default ``dense=False`` attends each chunk to the clean keys only (block-sparse);
  ``dense=True`` runs the packed row under the dense mask (timed in the forward only).

The regime is set by a ``schedule`` commit rule that commits about ``--tokens-per-step``
tokens per step; the regime actually measured (steps per row, tokens per step) is read
back from the trace. Before timing, the script checks that the paths give the same
log-probs on the completion (and the rollout's own ``action_logps``) and that the
per-step and packed gradients agree. Each path is compiled once ahead of time, warmed up,
then timed in interleaved rounds (A, B, ...); the report gives the median time per call
and the per-step/packed ratios for the forward (log-probs) and the gradient (of the summed
completion log-probs w.r.t. all parameters), against the token-count bound
``S * (P + L) / (P + L + S * block)``.

``--both`` (default) also runs ``--long-completion`` (512) with ``--long-batch`` rows (fewer
than the main batch: per-step replay at that length is slow on a few CPU cores), but only
when its cost, extrapolated from the first run's per-step timings, fits in what is left of
``--budget-s`` seconds of wall time; otherwise it says so and prints the command that runs
it on its own (``--budget-s 0`` removes the limit).

Run: ``make bench`` or ``.venv/bin/python bench/bench_replay.py [--completion 128 ...]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from timing import time_calls  # noqa: E402

from distill.config import ModelConfig, RolloutConfig  # noqa: E402
from distill.diffusion.denoise import SamplingSettings, Trace, rollout  # noqa: E402
from distill.diffusion.layout import completion_windows  # noqa: E402
from distill.diffusion.replay import (  # noqa: E402
    num_steps_bucket,
    replay_packed,
    replay_per_step,
    validate_trace,
)
from distill.models.transformer import Transformer  # noqa: E402
from distill.tokenizer import SpecialIds  # noqa: E402

SPECIAL = SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=(3,))
VOCAB = 256


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--completion", type=int, default=128, help="completion tokens per row")
    parser.add_argument("--block-size", type=int, default=16, help="diffusion block size")
    parser.add_argument("--batch", type=int, default=4, help="rows per call")
    parser.add_argument(
        "--tokens-per-step", type=int, default=4, help="schedule_steps = completion // this"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--calls", type=int, default=1, help="calls per path per round")
    parser.add_argument(
        "--both",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run --long-completion (with --long-batch rows and --long-rounds rounds)",
    )
    parser.add_argument("--long-completion", type=int, default=512)
    parser.add_argument("--long-batch", type=int, default=1)
    parser.add_argument("--long-rounds", type=int, default=1)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=180.0,
        help="wall-time budget for the whole script; the long run is skipped if its estimate "
        "does not fit (0: no limit)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in ("prompt", "completion", "long_completion", "batch", "long_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.rounds, args.long_rounds, args.calls, args.tokens_per_step) < 1:
        parser.error("--rounds, --long-rounds, --calls and --tokens-per-step must be >= 1")
    return args


def make_trace(
    model: Transformer, prompt_len: int, completion: int, batch: int, tps: int, seed: int
) -> Trace:
    rollout_config = RolloutConfig(
        commit_rule="schedule",
        schedule_steps=max(1, completion // tps),
        max_completion_length=completion,
        temperature=1.0,
        stop_when_done=False,  # every row generates its whole completion: a fixed regime
    )
    settings = SamplingSettings.from_config(rollout_config, SPECIAL)
    rng = np.random.default_rng(seed)
    low = max(SPECIAL.pad_id, SPECIAL.mask_id, SPECIAL.bos_id, *SPECIAL.stop_ids) + 1
    prompts = rng.integers(low, VOCAB, size=(batch, prompt_len)).tolist()
    trace = rollout(model, prompts, settings, seed=seed, global_step=0)
    validate_trace(trace, VOCAB)
    return trace


def max_rel_diff(a, b) -> float:
    leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30)) for x, y in leaves
    )


def run_size(
    args: argparse.Namespace, completion: int, batch: int, rounds: int
) -> dict[str, float]:
    """Run one size; return the median seconds per call of each path, plus the per-step
    work ``S * T * B`` (``work``) and the compile + rollout seconds (``setup``)."""
    block, prompt_len = args.block_size, args.prompt
    config = ModelConfig(
        vocab_size=VOCAB,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        d_ff=1024,
        attention_type="block_diffusion",
        block_size=block,
        max_length=prompt_len + completion + 2 * block,
    )
    model = Transformer(config, rngs=nnx.Rngs(args.seed))
    setup_start = start = time.perf_counter()
    trace = make_trace(model, prompt_len, completion, batch, args.tokens_per_step, args.seed)
    rollout_s = time.perf_counter() - start

    completion_mask = np.asarray(trace.completion_mask)
    steps = np.asarray(trace.action_steps)
    steps_per_row = steps.max(axis=1) + 1
    committed = completion_mask.sum(axis=1)
    s_mean = float(steps_per_row.mean())
    num = num_steps_bucket(trace)
    row_len = trace.tokens.shape[1]
    total = prompt_len + completion
    bound = s_mean * total / (total + s_mean * block)
    print(
        f"\n=== prompt {prompt_len} + completion {completion}, block {block}, batch {batch}, "
        f"schedule_steps {trace.settings.schedule_steps}, rounds {rounds} x {args.calls} calls"
    )
    print(
        f"regime (from the trace): steps/row {steps_per_row.min()}..{steps_per_row.max()} "
        f"(mean {s_mean:.1f}), tokens/step {float((committed / steps_per_row).mean()):.2f}, "
        f"trace tokens/forward {trace.tokens_per_forward():.2f}; num_steps bucket {num}; "
        f"layout row {row_len} slots; rollout+validate {rollout_s:.1f} s"
    )
    layout_bound = s_mean * row_len / (row_len + s_mean * block)
    print(
        f"token-count bound S*(P+L)/(P+L+S*block) = {s_mean:.0f}*{total}/({total}+"
        f"{s_mean:.0f}*{block}) = {bound:.2f}x (with the {row_len}-slot layout row both "
        f"paths actually run: {layout_bound:.2f}x)"
    )

    graphdef, state = nnx.split(model)

    def per_step(state, trace):
        return replay_per_step(nnx.merge(graphdef, state), trace, num_steps=num)

    def packed(state, trace):
        return replay_packed(nnx.merge(graphdef, state), trace, num_chunks=num)

    def packed_dense(state, trace):
        return replay_packed(nnx.merge(graphdef, state), trace, num_chunks=num, dense=True)

    def grad_of(fn):
        def loss(state, trace):
            return jnp.sum(jnp.where(trace.completion_mask, fn(state, trace), 0.0))

        return jax.grad(loss)

    paths = {
        "fwd per-step": per_step,
        "fwd packed": packed,
        "fwd packed dense": packed_dense,
        "grad per-step": grad_of(per_step),
        "grad packed": grad_of(packed),
    }
    compiled, outputs = {}, {}
    compile_s = 0.0
    for name, fn in paths.items():
        start = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(state, trace).compile()
        mid = time.perf_counter()
        outputs[name] = jax.block_until_ready(compiled[name](state, trace))  # warm-up call
        end = time.perf_counter()
        compile_s += mid - start
        print(f"  {name:17s} compile {mid - start:6.1f} s, warm-up call {end - mid:7.2f} s")

    # Agreement checks (on the warm-up outputs).
    reference = np.asarray(outputs["fwd per-step"])[completion_mask]
    logged = np.asarray(trace.action_logps)[completion_mask]
    for name in ("fwd packed", "fwd packed dense"):
        got = np.asarray(outputs[name])[completion_mask]
        print(
            f"check: {name} vs per-step log-probs max |diff| {np.max(np.abs(got - reference)):.2e}"
        )
        np.testing.assert_allclose(got, reference, atol=1e-4)
    diff = np.max(np.abs(reference - logged))
    print(f"check: per-step log-probs vs trace.action_logps max |diff| {diff:.2e}")
    np.testing.assert_allclose(reference, logged, atol=1e-4)
    grad_diff = max_rel_diff(outputs["grad packed"], outputs["grad per-step"])
    print(f"check: packed vs per-step gradient, max |diff| / max |grad| per leaf {grad_diff:.2e}")
    if grad_diff > 1e-3:
        raise AssertionError(f"gradients disagree: relative diff {grad_diff:.2e}")

    per_call: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in compiled.items():
            per_call[name].append(time_calls(lambda fn=fn: fn(state, trace), args.calls))
    median = {name: statistics.median(times) for name, times in per_call.items()}
    for name, times in per_call.items():
        print(
            f"{name:17s} median {median[name] * 1e3:10.1f} ms/call "
            f"(rounds {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})"
        )
    pairs = {
        "forward (block-sparse)": ("fwd per-step", "fwd packed"),
        "forward (dense packed)": ("fwd per-step", "fwd packed dense"),
        "gradient (block-sparse)": ("grad per-step", "grad packed"),
    }
    for label, (slow, fast) in pairs.items():
        ratio = median[slow] / median[fast]
        by_round = ", ".join(
            f"{a / b:.2f}" for a, b in zip(per_call[slow], per_call[fast], strict=True)
        )
        print(
            f"ratio per-step/packed {label:24s}: {ratio:5.2f}x "
            f"({ratio / bound:.0%} of the {bound:.2f}x token bound; per round {by_round})"
        )
    return {
        **median,
        "work": float(steps_per_row.max() * row_len * batch),
        "setup": rollout_s + compile_s,
        "elapsed": time.perf_counter() - setup_start,
    }


def main() -> None:
    args = parse_args()
    print(f"jax {jax.__version__}; device {jax.devices()[0]} (backend {jax.default_backend()})")
    print(
        f"model: d_model=256 n_layers=4 n_heads=8 n_kv_heads=4 d_ff=1024 vocab={VOCAB} "
        f"float32 attention=block_diffusion block_size={args.block_size}; special ids "
        f"{SPECIAL}; rollout: schedule rule (confidence), temperature 1.0, stop_when_done off"
    )
    start = time.perf_counter()
    first = run_size(args, args.completion, args.batch, args.rounds)
    if not args.both or args.long_completion == args.completion:
        return
    long_c, long_b = args.long_completion, args.long_batch
    # Per-step cost grows with steps * row slots * rows (attention a bit faster still); the
    # packed paths are a small fraction of it. One warm-up call plus the timed rounds.
    steps = -(-long_c // args.tokens_per_step)
    prompt_blocks = args.prompt // args.block_size
    first_window = 1 << (prompt_blocks - 1).bit_length() if prompt_blocks else 0
    slots = (first_window + completion_windows(long_c, args.block_size)) * args.block_size
    scale = steps * slots * long_b / first["work"]
    per_call = scale * (first["fwd per-step"] + first["grad per-step"]) * 1.2
    estimate = (1 + args.long_rounds) * per_call + 3 * first["setup"]
    left = args.budget_s - (time.perf_counter() - start)
    command = (
        f"bench/bench_replay.py --completion {long_c} --batch {long_b} "
        f"--rounds {args.long_rounds} --no-both"
    )
    if args.budget_s and estimate > left:
        print(
            f"\nskipped completion {long_c} (batch {long_b}): estimated {estimate:.0f} s "
            f"(per-step forward + gradient ~{per_call:.0f} s per call) does not fit the "
            f"{max(left, 0):.0f} s left of --budget-s {args.budget_s:.0f}; run it on its own with "
            f"`{command}` or raise --budget-s (0: no limit)"
        )
        return
    if long_b != args.batch:
        print(
            f"\nnote: completion {long_c} runs with batch {long_b} (not {args.batch}) and "
            f"{args.long_rounds} round(s): per-step replay and its gradient at that length are "
            "too slow on 2 CPU cores for the time budget"
        )
    run_size(args, long_c, long_b, args.long_rounds)


if __name__ == "__main__":
    main()
