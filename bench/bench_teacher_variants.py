"""Benchmark: teacher scoring variants -- shared prompts, and tokens/s by batch, length and K.

The same causal teacher as ``bench/bench_teacher_server.py`` (d_model 256, 4 layers, a
256-id vocabulary; here ``max_length`` 288 so a 256-id prompt plus a 32-id continuation
fits), scored in process by :class:`~distill.teacher.InProcessTeacher` (jitted; every shape
compiled before timing). Two parts, each timed in interleaved rounds (A, B, A, B, ...) so
machine noise hits every path alike; every ratio printed is measured side by side in this
one run. Nothing is asserted about times.

1. Shared prompt (``--prompt`` P = 256, ``--continuation`` C = 32, ``--group`` G = 8): G
   continuations of one prompt scored by ``score_shared(prompt, continuations)`` (the prompt
   prefilled once into a KV cache, the continuations decoded against it) vs
   ``score([prompt + c for c in continuations])`` (G full sequences). Both give the same
   log-probs (checked first). The report gives the measured speed ratio (of the median
   rounds and of the best rounds, ``--shared-rounds`` 15) next to the token-count bound
   ``G (P + C) / (P + G C)`` (= 4.5 for the defaults): how many more tokens the separate
   path runs through the model. Then the same two calls served over
   loopback gRPC (``RemoteTeacher.score_shared`` vs ``.score``, one client), unless
   ``--no-served``.
2. Throughput table: scored tokens/s (``rows x (length - 1)`` positions per call) for every
   batch in ``--batches`` (1, 8, 32), length in ``--lengths`` (64, 256) and variant: the
   next-token log-probs only, ``top_k = K`` and ``candidates = K`` (K random candidate ids
   per position) for K in ``--ks`` (8, 64). Each cell calls ``score`` enough times per
   round to score at least ``--min-tokens`` positions. The variants of one (batch, length)
   row are timed interleaved with each other (``--table-rounds`` rounds; the best round,
   since other work on a shared machine only adds time), so each variant's throughput over
   the log-probs-only one of its row is a side-by-side ratio; absolute numbers of
   different rows were measured at different times.

On 2 shared CPU cores the defaults take about 3 minutes (compiles included); the table uses
3 rounds to stay there (raise ``--table-rounds`` on a quieter machine).

Run: ``make bench`` or ``.venv/bin/python bench/bench_teacher_variants.py [--part shared ...]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `services` from a checkout

from distill.config import ModelConfig  # noqa: E402
from distill.models.transformer import Transformer  # noqa: E402
from distill.teacher import InProcessTeacher  # noqa: E402
from distill.tokenizer import CharTokenizer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "shared", "table"), default="all")
    parser.add_argument("--prompt", type=int, default=256, help="shared prompt ids (P)")
    parser.add_argument("--continuation", type=int, default=32, help="ids per continuation (C)")
    parser.add_argument("--group", type=int, default=8, help="continuations per prompt (G)")
    parser.add_argument("--shared-rounds", type=int, default=15, help="rounds of part 1")
    parser.add_argument("--no-served", action="store_true", help="skip the served part 1")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 64], help="top-k / candidates")
    parser.add_argument("--table-rounds", type=int, default=3, help="rounds of part 2")
    parser.add_argument("--min-tokens", type=int, default=2048, help="positions per cell/round")
    args = parser.parse_args()
    if min(args.prompt, args.continuation, args.group, args.shared_rounds) < 1:
        parser.error("--prompt, --continuation, --group and --shared-rounds must be >= 1")
    if min(args.table_rounds, args.min_tokens, *args.batches, *args.ks) < 1:
        parser.error("--table-rounds, --min-tokens, --batches and --ks must be >= 1")
    if min(args.lengths) < 2:
        parser.error(f"--lengths must be >= 2; received {args.lengths}")
    if max(args.ks) > 256:
        parser.error(f"--ks must be at most 256 (the vocabulary); received {args.ks}")
    return args


def timed_rounds(
    paths: dict[str, Callable[[], object]], rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """``(median, best)`` seconds per call of each path over ``rounds`` interleaved rounds.
    On a shared machine other work only ever adds time, so the best round is the steadier
    estimate of what a call costs; the median says what a caller typically got."""
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, path in paths.items():
            start = time.perf_counter()
            path()
            seconds[name].append(time.perf_counter() - start)
    return (
        {name: statistics.median(values) for name, values in seconds.items()},
        {name: min(values) for name, values in seconds.items()},
    )


def max_diff(got, want) -> float:
    return max(
        float(np.max(np.abs(a.log_probs - b.log_probs))) for a, b in zip(got, want, strict=True)
    )


def shared_part(args, teacher: InProcessTeacher, rng: np.random.Generator) -> None:
    p, c, g = args.prompt, args.continuation, args.group
    vocab = teacher.info().vocab_size
    prompt = rng.integers(0, vocab, p).tolist()
    continuations = rng.integers(0, vocab, (g, c)).tolist()
    full = [prompt + continuation for continuation in continuations]
    bound = g * (p + c) / (p + g * c)
    print(f"\n== shared prompt: P={p}, C={c}, G={g} (rounds={args.shared_rounds})")
    paths = {
        "shared": lambda: teacher.score_shared(prompt, continuations),
        "separate": lambda: teacher.score(full),
    }
    diff = max_diff(paths["shared"](), paths["separate"]())  # also the warm-up (compiles)
    print(f"check: score_shared log-probs agree with score (max |diff| {diff:.1e})")
    assert diff <= 1e-4, f"score_shared differs from score by {diff}"
    server = clients = None
    if not args.no_served:
        from services.teacher.client import RemoteTeacher
        from services.teacher.server import TeacherServerConfig, serve_teacher

        server = serve_teacher(teacher, TeacherServerConfig(max_batch_tokens=32 * (p + c)))
        remote = RemoteTeacher(server.address)
        clients = [remote]
        paths["served shared"] = lambda: remote.score_shared(prompt, continuations)
        paths["served separate"] = lambda: remote.score(full)
        diff = max_diff(paths["served shared"](), paths["served separate"]())
        print(f"check: served score_shared agrees with served score (max |diff| {diff:.1e})")
    medians, best = timed_rounds(paths, args.shared_rounds)
    if server is not None:
        server.stop()
        for client in clients:
            client.close()
    scored = g * (p + c - 1)
    for name, median in medians.items():
        print(
            f"{name:16s} median {median * 1e3:8.1f} ms/call ({scored / median:6.0f} scored "
            f"tokens/s), best {best[name] * 1e3:8.1f} ms/call ({scored / best[name]:6.0f})"
        )
    print(f"token-count bound G(P+C)/(P+GC) = {g}*{p + c}/{p + g * c} = {bound:.2f}x")
    for where, prefix in (("in-process", ""), ("served", "served ")):
        if f"{prefix}shared" in medians:
            shared, separate = f"{prefix}shared", f"{prefix}separate"
            print(
                f"ratio shared / separate ({where}): median "
                f"{medians[separate] / medians[shared]:.2f}x, best "
                f"{best[separate] / best[shared]:.2f}x"
            )


def table_part(args, teacher: InProcessTeacher, rng: np.random.Generator) -> None:
    vocab = teacher.info().vocab_size
    variants = [("log-probs", {})]
    variants += [(f"top_k={k}", {"top_k": k}) for k in args.ks]
    variants += [(f"candidates={k}", {"candidate_ids": k}) for k in args.ks]
    names = [name for name, _ in variants]
    print(
        f"\n== throughput table: batch {args.batches} x length {args.lengths} x "
        f"{len(variants)} variants (rounds={args.table_rounds} per row, >= {args.min_tokens} "
        "scored positions per cell and round)"
    )
    print("scored tokens/s (in process, jitted; best round); in brackets: / log-probs only")
    print(f"{'batch':>5} {'length':>6}  " + "  ".join(f"{name:>19}" for name in names))
    for batch in args.batches:
        for length in args.lengths:
            sequences = rng.integers(0, vocab, (batch, length)).tolist()
            calls = max(1, -(-args.min_tokens // (batch * (length - 1))))
            cells: dict[str, Callable[[], object]] = {}
            for name, options in variants:
                kwargs: dict = dict(options)
                if "candidate_ids" in kwargs:
                    kwargs["candidate_ids"] = list(
                        rng.integers(0, vocab, (batch, length - 1, kwargs["candidate_ids"]))
                    )

                def cell(kwargs=kwargs, sequences=sequences, calls=calls):
                    for _ in range(calls):
                        teacher.score(sequences, **kwargs)

                teacher.score(sequences, **kwargs)  # compile this shape before timing
                cells[name] = cell
            # The variants of one row are interleaved with each other, so their ratios are
            # measured side by side even when the machine's load drifts between rows.
            _, best = timed_rounds(cells, args.table_rounds)
            scored = calls * batch * (length - 1)
            base = scored / best["log-probs"]
            row = []
            for name in names:
                rate = scored / best[name]
                row.append(f"{rate:>10.0f} ({rate / base:4.2f}x)")
            print(
                f"{batch:>5} {length:>6}  " + "  ".join(f"{cell:>19}" for cell in row), flush=True
            )


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    # 252 characters + 4 specials: a 256-id vocabulary, so the output head is not trivial.
    tokenizer = CharTokenizer("".join(chr(0x100 + i) for i in range(252)))
    max_length = max(args.prompt + args.continuation, *args.lengths)
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        d_ff=1024,
        attention_type="causal",
        max_length=max_length,
    )
    teacher = InProcessTeacher(Transformer(config, rngs=nnx.Rngs(0)), tokenizer)
    print(f"jax {jax.__version__}; device {jax.devices()[0]} (backend {jax.default_backend()})")
    print(
        f"model: d_model={config.d_model} n_layers={config.n_layers} n_heads={config.n_heads} "
        f"n_kv_heads={config.n_kv_heads} d_ff={config.d_ff} vocab={config.vocab_size} "
        f"max_length={config.max_length} dtype={config.dtype}"
    )
    rng = np.random.default_rng(0)
    if args.part in ("all", "shared"):
        shared_part(args, teacher, rng)
    if args.part in ("all", "table"):
        table_part(args, teacher, rng)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
