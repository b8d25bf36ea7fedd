"""Benchmark: teacher scoring served over gRPC (loopback, dynamic batching) vs in process.

One causal teacher, one workload: ``--requests`` score requests of ``--seqs-per-request``
random sequences of ``--seq-len`` ids each (``--top-k`` 0: log-probs only). Three ways to
score it, all giving the same log-probs:

- served: ``--clients`` threads (32 by default), each with its own
  :class:`~services.teacher.client.RemoteTeacher`, send the requests concurrently to a
  :func:`~services.teacher.server.serve_teacher` server on 127.0.0.1 (no token, no TLS); its
  batcher groups them into teacher calls of up to ``--max-batch-sequences`` sequences,
  waiting at most ``--max-delay-ms`` for company. One served path per ``--max-delay-ms``
  value (one server each, on the same teacher): the server's default 2 ms, and a longer
  wait that lets a burst of 32 clients fill a batch. This is what learners talking to a
  teacher server pay (serialization, loopback transport, queueing) and gain (batching
  across callers).
- in-process, per request: ``InProcessTeacher.score`` called once per request, one after
  another -- what each caller would do holding its own copy of the teacher.
- in-process, batched: the same sequences in calls of ``--max-batch-sequences`` -- the
  best a single caller holding all the work at once can do (the server's ceiling).

Before timing, the served log-probs are checked against the in-process ones, and every
shape each path uses is compiled (warm-up). Timing alternates the paths in rounds
(A, B, C, A, ...) so machine noise hits all alike; the report gives per path the median
seconds per round and throughput in scored tokens per second, the served/in-process ratios
measured in this same run, and per served path how many sequences the batcher put in a
teacher call on average (real rows, and rows after padding to a power of two). The headline
number is ``served / in-process batched``: scored tokens/s served to the clients over the
in-process batched jitted forward on the same inputs (target >= 0.85). Nothing is asserted
about times.

Run: ``make bench`` or ``.venv/bin/python bench/bench_teacher_server.py [--clients 32 ...]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `services` from a checkout

from distill.config import ModelConfig  # noqa: E402
from distill.models.transformer import Transformer  # noqa: E402
from distill.teacher import InProcessTeacher  # noqa: E402
from distill.tokenizer import CharTokenizer  # noqa: E402
from services.teacher.client import RemoteTeacher  # noqa: E402
from services.teacher.server import TeacherServerConfig, serve_teacher  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per round")
    parser.add_argument("--seqs-per-request", type=int, default=1, help="sequences per request")
    parser.add_argument("--seq-len", type=int, default=128, help="ids per sequence")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads")
    parser.add_argument("--max-batch-sequences", type=int, default=32, help="server batch cap")
    parser.add_argument(
        "--max-delay-ms",
        type=float,
        nargs="+",
        default=[2.0, 50.0],
        help="server batching wait; one served path (one server) per value",
    )
    parser.add_argument("--top-k", type=int, default=0, help="top-k per position (0: none)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    args = parser.parse_args()
    if min(args.requests, args.seqs_per_request, args.clients, args.rounds) < 1:
        parser.error("--requests, --seqs-per-request, --clients and --rounds must be >= 1")
    if not 2 <= args.seq_len <= 256:
        parser.error("--seq-len must be in [2, 256] (the model's max_length)")
    return args


def main() -> None:
    args = parse_args()
    # 252 characters + 4 specials: a 256-id vocabulary, so the output head is not trivial.
    tokenizer = CharTokenizer("".join(chr(0x100 + i) for i in range(252)))
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        d_ff=1024,
        attention_type="causal",
        max_length=256,
    )
    teacher = InProcessTeacher(Transformer(config, rngs=nnx.Rngs(0)), tokenizer)
    top_k = args.top_k or None
    rng = np.random.default_rng(0)
    requests = [
        rng.integers(0, config.vocab_size, (args.seqs_per_request, args.seq_len)).tolist()
        for _ in range(args.requests)
    ]
    flat = [sequence for request in requests for sequence in request]
    scored_tokens = len(flat) * (args.seq_len - 1)
    cap = args.max_batch_sequences
    print(f"jax {jax.__version__}; device {jax.devices()[0]} (backend {jax.default_backend()})")
    print(
        f"model: d_model={config.d_model} n_layers={config.n_layers} n_heads={config.n_heads} "
        f"n_kv_heads={config.n_kv_heads} d_ff={config.d_ff} vocab={config.vocab_size} "
        f"dtype={config.dtype}"
    )
    print(
        f"workload: {args.requests} requests x {args.seqs_per_request} sequences x "
        f"{args.seq_len} ids, top_k={args.top_k}; served to {args.clients} concurrent clients, "
        f"max_batch_sequences={cap}, max_delay_ms={args.max_delay_ms}; rounds={args.rounds}"
    )

    delays = list(dict.fromkeys(args.max_delay_ms))
    servers = [
        serve_teacher(
            teacher,
            TeacherServerConfig(
                max_batch_sequences=cap,
                max_batch_tokens=cap * args.seq_len,
                max_delay_ms=delay,
                max_workers=max(32, args.clients),
                max_concurrent_rpcs=max(256, args.clients),
            ),
        )
        for delay in delays
    ]
    pool = ThreadPoolExecutor(max_workers=args.clients)

    def served_by(server):
        clients = [RemoteTeacher(server.address) for _ in range(args.clients)]

        def served() -> list:
            futures = [
                pool.submit(clients[index % args.clients].score, request, top_k=top_k)
                for index, request in enumerate(requests)
            ]
            return [scored for future in futures for scored in future.result()]

        served.clients = clients
        return served

    def per_request() -> list:
        return [scored for request in requests for scored in teacher.score(request, top_k=top_k)]

    def batched() -> list:
        return [
            scored
            for start in range(0, len(flat), cap)
            for scored in teacher.score(flat[start : start + cap], top_k=top_k)
        ]

    served_paths = {
        f"served_{delay:g}": served_by(server)
        for delay, server in zip(delays, servers, strict=True)
    }
    # Warm-up: every row bucket the server may use (powers of two up to the cap), then the
    # check that all paths agree.
    rows = 1
    while True:
        teacher.score(flat[: min(rows, cap)], top_k=top_k)
        if rows >= cap:
            break
        rows *= 2
    reference = per_request()
    for name, path in (*served_paths.items(), ("in-process batched", batched)):
        got = path()
        diff = max(
            float(np.max(np.abs(a.log_probs - b.log_probs)))
            for a, b in zip(got, reference, strict=True)
        )
        assert diff <= 1e-4, f"{name} log-probs differ from in-process by {diff}"
        print(f"check: {name} log-probs agree with in-process per request (max |diff| {diff:.1e})")

    paths = {**served_paths, "per_request": per_request, "batched": batched}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    before = [server.stats() for server in servers]
    for _ in range(args.rounds):
        for name, path in paths.items():
            start = time.perf_counter()
            path()
            seconds[name].append(time.perf_counter() - start)
    after = [server.stats() for server in servers]
    for server in servers:
        server.stop()
    pool.shutdown()
    for path in served_paths.values():
        for client in path.clients:
            client.close()

    throughput = {}
    labels = {
        **{
            f"served_{delay:g}": f"served ({args.clients} clients, delay {delay:g} ms)"
            for delay in delays
        },
        "per_request": "in-process, one call per request",
        "batched": f"in-process, batched by {cap}",
    }
    for name, label in labels.items():
        median = statistics.median(seconds[name])
        throughput[name] = scored_tokens / median
        print(
            f"{label:36s} median {median * 1e3:9.1f} ms/round "
            f"(rounds {min(seconds[name]) * 1e3:.1f}-{max(seconds[name]) * 1e3:.1f}), "
            f"{throughput[name]:10.0f} tokens/s"
        )
    for delay, b, a in zip(delays, before, after, strict=True):
        batches = a.batches - b.batches
        print(
            f"server batching (delay {delay:g} ms): {(a.sequences - b.sequences) / batches:.1f} "
            f"sequences per teacher call, {(a.rows - b.rows) / batches:.1f} rows after padding "
            f"to a power of two ({batches} calls in {args.rounds} rounds; in-process batched: "
            f"{len(flat) / -(-len(flat) // cap):.1f})"
        )
    for delay in delays:
        name = f"served_{delay:g}"
        print(
            f"ratio served (delay {delay:g} ms) / in-process per request: "
            f"{throughput[name] / throughput['per_request']:.2f}x"
        )
        print(
            f"ratio served (delay {delay:g} ms) / in-process batched:     "
            f"{throughput[name] / throughput['batched']:.2f}x   (target >= 0.85)"
        )


if __name__ == "__main__":
    main()
