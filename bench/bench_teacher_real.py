"""Benchmark: the real teacher (SmolLM2-135M-Instruct, GGUF) scoring real text, served over
gRPC vs in process, by batch and length.

The teacher is :func:`distill.models.gguf.load_teacher` of ``--gguf`` (default ``smollm2``:
the file in the cache, fetched on first use as ``make teacher-gguf`` does), float32, 30
layers, a 49,152-id vocabulary. The inputs are windows of Shakespeare speeches from the
corpus the project ships (:func:`distill.experiments.smollm2_opd.speeches`, train split),
tokenized by the model's own tokenizer: row ``i`` of a call of ``length`` ids is the ``i``-th
consecutive window of ``length`` ids. Only the actual next tokens' log-probs are scored (no
top-k, no candidates): ``rows x (length - 1)`` scored tokens per call.

One :class:`~distill.teacher.InProcessTeacher` with a closed set of shapes (rows: powers of
two up to the server's batch cap; lengths: exactly the lengths measured) serves both paths;
its warm-up compiles every shape before anything is timed and is reported separately (count
and seconds); the compiles during timing are reported too (0: the shape set is closed).

1. Grid: for each batch in ``--batches`` (rows per request) and length in ``--lengths``, the
   same rows scored in process (``InProcessTeacher.score``) and served (one request to a
   :func:`~services.teacher.server.serve_teacher` server on 127.0.0.1, started in this
   process as ``bench/bench_teacher_server.py`` does, by one
   :class:`~services.teacher.client.RemoteTeacher`). Each timed sample makes enough calls
   to score ``--min-tokens`` positions. Repetitions are interleaved at the finest grain: in
   each of ``--reps`` repetitions every cell times both paths back to back, the order
   alternating between repetitions, so the machine's load drifts over both alike. Per cell:
   the median scored tokens/s of each path, and the median (and range) over repetitions of
   the paired ratio served / in-process.
2. Concurrent clients (unless ``--clients 0``): ``--clients`` threads, each with its own
   ``RemoteTeacher``, each sending ``--client-requests`` one-row requests of
   ``--client-length`` ids one after another, so the server's batcher groups rows of
   different clients into one teacher call. Against the same rows in process, one call per
   request (what each caller alone would do) and in calls of the batch cap (the server's
   ceiling). Interleaved like the grid; the batcher's mean rows per teacher call reported.

Before timing, the served log-probs of the smallest and the largest cell are checked against
the in-process ones, and the text's mean log-prob per token is printed next to that of the
same ids shuffled (real text scores far higher: the tokenizer and the weights fit together).
Nothing is asserted about times. ``--json FILE`` writes every sample. ``--quick`` is a tiny
grid (batches 1 and 2, length 32, two clients, two repetitions) for a smoke run; flags given
explicitly override it.

The server runs in this process (its gRPC threads and batcher share the GIL with the
clients), like the other teacher benches. On 2 CPU cores shared at load average 9-21 the
defaults took 13-20 minutes (loading 20-34 s, the 12-shape warm-up 3-4 minutes, a repetition
of the grid 2-3 minutes); a quieter machine scores several times faster and should fit 5-8
minutes (see docs/performance.md).

Run: ``make bench`` or ``.venv/bin/python bench/bench_teacher_real.py [--quick] [--reps 5]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `services` from a checkout

from timing import time_calls  # noqa: E402

from distill.experiments.smollm2_opd import speeches  # noqa: E402
from distill.models import gguf  # noqa: E402
from distill.teacher import InProcessTeacher  # noqa: E402
from distill.teacher_contract import ScoreShapes  # noqa: E402
from services.teacher.client import RemoteTeacher  # noqa: E402
from services.teacher.server import TeacherServerConfig, serve_teacher  # noqa: E402

#: The grid and concurrency settings: the default run and ``--quick``.
DEFAULTS = {
    "batches": [1, 4, 8],
    "lengths": [64, 128, 256],
    "clients": 8,
    "client_requests": 1,
    "client_length": 128,
    "reps": 3,
    "min_tokens": 128,
}
QUICK = {
    "batches": [1, 2],
    "lengths": [32],
    "clients": 2,
    "client_requests": 1,
    "client_length": 32,
    "reps": 2,
    "min_tokens": 0,
}
IN_PROCESS, SERVED = "in-process", "served"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default="smollm2", help="GGUF file, or `smollm2` (cached)")
    parser.add_argument("--quick", action="store_true", help="tiny grid (a smoke run)")
    parser.add_argument("--batches", type=int, nargs="+", help="rows per request (1 4 8)")
    parser.add_argument("--lengths", type=int, nargs="+", help="ids per row (64 128 256)")
    parser.add_argument("--clients", type=int, help="concurrent clients (8; 0: skip part 2)")
    parser.add_argument("--client-requests", type=int, help="requests per client (1)")
    parser.add_argument("--client-length", type=int, help="ids per client request (128)")
    parser.add_argument("--reps", type=int, help="interleaved repetitions (3)")
    parser.add_argument("--min-tokens", type=int, help="scored positions per sample (128)")
    parser.add_argument("--max-delay-ms", type=float, default=2.0, help="server batching wait")
    parser.add_argument("--json", type=Path, help="write every sample and summary here")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(*args.batches, args.client_requests, args.reps) < 1:
        parser.error("--batches, --client-requests and --reps must be >= 1")
    if args.clients < 0 or args.min_tokens < 0:
        parser.error("--clients and --min-tokens must be >= 0")
    if min(*args.lengths, args.client_length) < 2:
        parser.error("--lengths and --client-length must be >= 2 (one scored position)")
    return args


def powers_of_two_up_to(n: int) -> tuple[int, ...]:
    """``1, 2, 4, ...`` up to the first power of two >= ``n`` (the batcher's row buckets)."""
    rows = [1]
    while rows[-1] < n:
        rows.append(rows[-1] * 2)
    return tuple(rows)


def text_ids(tokenizer, needed: int) -> np.ndarray:
    """At least ``needed`` ids of real text: train-split speeches joined by blank lines,
    tokenized as one text (so no id boundary is an artifact of joining)."""
    found = speeches("train")
    count = 64
    while True:
        text = "\n\n".join("\n".join(speech) for speech in found[:count])
        ids = np.asarray(tokenizer.encode(text), np.int32)
        if ids.size >= needed or count >= len(found):
            break
        count *= 2
    if ids.size < needed:
        raise ValueError(f"`corpus` must hold {needed} ids of text; received {ids.size}")
    return ids


def windows(ids: np.ndarray, rows: int, length: int, start: int = 0) -> list[list[int]]:
    """``rows`` consecutive windows of ``length`` ids, from window ``start`` on."""
    return [ids[(start + i) * length : (start + i + 1) * length].tolist() for i in range(rows)]


def max_diff(got, want) -> float:
    return max(
        float(np.max(np.abs(a.log_probs - b.log_probs))) for a, b in zip(got, want, strict=True)
    )


def interleaved(paths: dict[str, tuple[Callable[[], object], int]], reps_index: int):
    """Seconds per call of each path (``fn``, ``calls``), timed back to back; the order is
    reversed on odd repetitions so neither path always runs first."""
    names = list(paths) if reps_index % 2 == 0 else list(reversed(paths))
    return {name: time_calls(paths[name][0], paths[name][1]) for name in names}


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    results: dict = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    }
    print(f"jax {jax.__version__}; device {jax.devices()[0]} (backend {jax.default_backend()})")
    print(f"cpus {os.cpu_count()}; load average {load_average()} (1, 5, 15 min) at start")
    results["load_average_start"] = list(os.getloadavg())

    lengths = sorted({*args.lengths, *([args.client_length] if args.clients else [])})
    cap = max(*args.batches, args.clients)
    path = gguf.resolve_gguf(args.gguf)
    load_start = time.perf_counter()
    model, checkpoint = gguf.load_teacher(path, max_length=lengths[-1])
    load_s = time.perf_counter() - load_start
    config = model.config
    shapes = ScoreShapes(rows=powers_of_two_up_to(cap), lengths=tuple(lengths))
    teacher = InProcessTeacher(model, checkpoint.tokenizer, shapes=shapes)
    print(
        f"model: {path.name} ({dict(checkpoint.tensor_types)}), loaded in {load_s:.1f} s; "
        f"d_model={config.d_model} n_layers={config.n_layers} n_heads={config.n_heads} "
        f"n_kv_heads={config.n_kv_heads} d_ff={config.d_ff} vocab={config.vocab_size} "
        f"max_length={config.max_length} dtype={config.dtype}"
    )

    # Warm-up: every (rows, length) bucket, before the server exists and before any timing.
    warm_start = time.perf_counter()
    compiled = teacher.warm_up()
    warm_s = time.perf_counter() - warm_start
    print(
        f"warm-up: compiled {compiled} shapes in {warm_s:.1f} s (rows {list(shapes.rows)} x "
        f"lengths {list(shapes.lengths)}; excluded from every timing below)"
    )
    results["warm_up"] = {"compiles": compiled, "seconds": warm_s, "load_seconds": load_s}

    server = serve_teacher(
        teacher,
        TeacherServerConfig(
            max_batch_sequences=cap,
            max_batch_tokens=cap * lengths[-1],
            max_delay_ms=args.max_delay_ms,
            max_workers=max(32, args.clients),
        ),
    )
    remote = RemoteTeacher(server.address)
    needed = max(
        max(args.batches) * max(args.lengths),
        args.clients * args.client_requests * args.client_length,
    )
    ids = text_ids(checkpoint.tokenizer, needed)
    print(
        f"server on {server.address}: max_batch_sequences {cap}, max_delay_ms "
        f"{args.max_delay_ms:g}; text: {ids.size} ids of train-split speeches"
    )

    # Check (untimed; also the first calls through gRPC): both paths agree on the smallest
    # and the largest cell (every cell runs the same code; checking all costs a repetition).
    cells = [(batch, length) for batch in args.batches for length in args.lengths]
    rows_of = {cell: windows(ids, *cell) for cell in cells}
    checked = sorted({min(cells, key=lambda c: c[0] * c[1]), max(cells, key=lambda c: c[0] * c[1])})
    worst = 0.0
    for cell in checked:
        worst = max(worst, max_diff(remote.score(rows_of[cell]), teacher.score(rows_of[cell])))
    assert worst <= 1e-4, f"served log-probs differ from in-process by {worst}"
    print(f"check: served log-probs equal in-process on cells {checked} (max |diff| {worst:.1e})")
    length = args.lengths[0]
    sample = rows_of[(args.batches[0], length)][0]
    shuffled = np.random.default_rng(0).permutation(sample).tolist()
    real, mixed = (float(np.mean(s.log_probs)) for s in teacher.score([sample, shuffled]))
    print(f"check: real text {real:.2f} nats/token vs the same {length} ids shuffled {mixed:.2f}")
    results["check"] = {"max_abs_diff": worst, "real_nats": real, "shuffled_nats": mixed}
    timing_compiles = teacher.compile_count()

    # ---- part 1: the grid -------------------------------------------------------------------
    samples: dict[tuple[int, int], dict[str, list[float]]] = {
        cell: {IN_PROCESS: [], SERVED: []} for cell in cells
    }
    calls_of = {cell: max(1, -(-args.min_tokens // (cell[0] * (cell[1] - 1)))) for cell in cells}
    print(
        f"\n== grid: batch {args.batches} x length {args.lengths}, {args.reps} interleaved "
        f"repetitions, >= {args.min_tokens} scored positions per sample"
    )
    for rep in range(args.reps):
        for cell in cells:
            rows, calls = rows_of[cell], calls_of[cell]
            paths = {
                IN_PROCESS: (lambda rows=rows: teacher.score(rows), calls),
                SERVED: (lambda rows=rows: remote.score(rows), calls),
            }
            for name, seconds in interleaved(paths, rep).items():
                samples[cell][name].append(seconds)
        print(
            f"repetition {rep + 1}/{args.reps} done at {time.perf_counter() - started:.0f} s "
            f"(load {load_average()})",
            flush=True,
        )

    print(
        "\nscored tokens/s (median over repetitions); ratio served / in-process: median of "
        "the paired repetitions [min-max]"
    )
    print(f"{'batch':>5} {'length':>6} {'in-process':>11} {'served':>9}  ratio")
    grid = []
    for cell in cells:
        batch, length = cell
        scored = batch * (length - 1)
        rate = {name: [scored / s for s in samples[cell][name]] for name in (IN_PROCESS, SERVED)}
        ratios = [s / i for s, i in zip(rate[SERVED], rate[IN_PROCESS], strict=True)]
        row = {
            "batch": batch,
            "length": length,
            "calls_per_sample": calls_of[cell],
            "in_process_tokens_per_s": statistics.median(rate[IN_PROCESS]),
            "served_tokens_per_s": statistics.median(rate[SERVED]),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "seconds_per_call": samples[cell],
        }
        grid.append(row)
        print(
            f"{batch:>5} {length:>6} {row['in_process_tokens_per_s']:>11.0f} "
            f"{row['served_tokens_per_s']:>9.0f}  {row['ratio_median']:.2f}x "
            f"[{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]"
        )
    results["grid"] = grid

    # ---- part 2: concurrent clients ---------------------------------------------------------
    if args.clients:
        results["concurrent"] = concurrent_part(args, teacher, server, ids, cap)

    results["compiles_during_timing"] = teacher.compile_count() - timing_compiles
    server.stop()
    remote.close()
    print(f"\ncompiles during timing: {results['compiles_during_timing']} (closed shape set)")
    print(f"load average {load_average()} (1, 5, 15 min) at end")
    results["load_average_end"] = list(os.getloadavg())
    results["total_seconds"] = time.perf_counter() - started
    print(f"total {results['total_seconds']:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


def concurrent_part(args, teacher: InProcessTeacher, server, ids: np.ndarray, cap: int) -> dict:
    clients, per_client, length = args.clients, args.client_requests, args.client_length
    requests = [
        [windows(ids, 1, length, start=c * per_client + r) for r in range(per_client)]
        for c in range(clients)
    ]
    flat = [request[0] for client in requests for request in client]
    scored = len(flat) * (length - 1)
    remotes = [RemoteTeacher(server.address) for _ in range(clients)]
    pool = ThreadPoolExecutor(max_workers=clients)

    def served() -> list:
        def one_client(index: int) -> list:
            return [s for request in requests[index] for s in remotes[index].score(request)]

        futures = [pool.submit(one_client, index) for index in range(clients)]
        return [s for future in futures for s in future.result()]

    def per_request() -> list:
        return [s for row in flat for s in teacher.score([row])]

    def batched() -> list:
        return [
            s
            for start in range(0, len(flat), cap)
            for s in teacher.score(flat[start : start + cap])
        ]

    diff = max_diff(served(), per_request())
    assert diff <= 1e-4, f"concurrent served log-probs differ from in-process by {diff}"
    print(
        f"\n== concurrent clients: {clients} clients x {per_client} requests x 1 row x {length} "
        f"ids ({scored} scored positions per round), {args.reps} interleaved repetitions; "
        f"check: served equals in-process (max |diff| {diff:.1e})"
    )
    paths = {
        "served": (served, 1),
        "in-process per request": (per_request, 1),
        f"in-process batched by {cap}": (batched, 1),
    }
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    stats_before = server.stats()
    for rep in range(args.reps):
        for name, value in interleaved(paths, rep).items():
            seconds[name].append(value)
    stats_after = server.stats()
    pool.shutdown()
    for client in remotes:
        client.close()

    rate = {name: [scored / s for s in values] for name, values in seconds.items()}
    out: dict = {"clients": clients, "requests_per_client": per_client, "length": length}
    for name, values in rate.items():
        print(
            f"{name:28s} {statistics.median(values):8.0f} scored tokens/s (median; "
            f"{min(values):.0f}-{max(values):.0f})"
        )
        out[f"{name} tokens_per_s"] = statistics.median(values)
    for baseline in list(paths)[1:]:
        ratios = [s / b for s, b in zip(rate["served"], rate[baseline], strict=True)]
        print(
            f"ratio served / {baseline}: {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}-{max(ratios):.2f}]"
        )
        out[f"ratio served / {baseline}"] = statistics.median(ratios)
    batches = stats_after.batches - stats_before.batches
    sequences = stats_after.sequences - stats_before.sequences
    padded = stats_after.rows - stats_before.rows
    print(
        f"server batching: {sequences / batches:.1f} rows per teacher call ({padded / batches:.1f} "
        f"after padding to a power of two; {batches} calls over {args.reps} rounds; "
        f"{clients} would fill one)"
    )
    out.update(rows_per_call=sequences / batches, padded_rows_per_call=padded / batches)
    out["seconds_per_round"] = seconds
    return out


if __name__ == "__main__":
    main()
