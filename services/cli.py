"""The ``distill`` command.

    distill demo                       the end-to-end demo (same as ``make demo``)
    distill run CONFIG --run-dir DIR [--address RAY_ADDRESS] [--set a.b=value ...]
                  the whole job on Ray (embedded local Ray unless an address is given)
    distill submit CONFIG --run-dir DIR [--address http://HOST:8265] [--wait] [--set ...]
    distill status JOB | logs JOB [--follow] | stop JOB | list     [--address ...]
                  the Ray Jobs API verbs (address else $RAY_ADDRESS else 127.0.0.1:8265)
    distill train-teacher CONFIG --run-dir DIR [--set a.b=value ...]
    distill warmup-student CONFIG --run-dir DIR [--teacher-run DIR] [--set a.b=value ...]
    distill opd CONFIG --run-dir DIR --student-run DIR (--teacher-run DIR | --teacher-server
                  ADDR [--token-file F] [--tls-root-cert F]) [--set a.b=value ...]
    distill score (--hf-checkpoint DIR | --gguf FILE|smollm2) TEXT [--top-k K] [--json]
    distill score --server ADDR [--token-file F] [--tls-root-cert F]
                  (--hf-checkpoint DIR TEXT | --gguf FILE|smollm2 TEXT | --ids "ID ...")
                  [--top-k K] [--json]
    distill serve teacher (--hf-checkpoint DIR | --gguf FILE|smollm2
                  | CONFIG --teacher-run DIR [--set a.b=value ...])
                  [--address HOST:PORT] [--token-file F] [--tls-cert F --tls-key F]
                  [--max-batch-sequences N] [--max-batch-tokens N] [--max-delay-ms MS]
                  [--max-request-sequences N] [--max-request-tokens N] [--max-queue-requests N]
                  [--shapes auto|default|none] [--max-length N] [--warm-shared-prompts]
                  [--metrics-address HOST:PORT [--metrics-public]]

CONFIG is a job YAML (see ``deploy/configs/``); ``--set`` applies dotted overrides. Runs
resume from their newest checkpoint and refuse a changed setup (the run contract). Errors in
the configuration or the run contract are printed as one line per field, exit status 2; a
refused call to a server is printed with the server's reason, exit status 1.

``score`` prints one row per scored token (position, token, id, log-prob, and the token's
rank in the teacher's distribution, 1 = its most likely token; ``--top-k K``: its K best),
then ``total T nats over N tokens (mean ..., perplexity ...)``; ``--json`` prints one JSON
object instead (``ids``, ``tokens``, ``log_probs``, ``ranks``, ``top_k``, ``total_log_prob``,
``mean_log_prob``, ...). In process the ranks are exact; through a server they are exact
within the server's largest top-k bucket (and an answer of at most 16 MiB), beyond it shown
as ``>K`` (``null`` in JSON). ``score --server`` scores through a running teacher server;
with ``--hf-checkpoint`` only the checkpoint's tokenizer is read (and must match the
server's), with ``--ids`` the text is whitespace-separated token ids. ``--gguf`` reads a GGUF
file instead of a checkpoint directory (``smollm2``: SmolLM2-135M-Instruct, fetched into the
cache on first use; see ``distill.models.gguf``).

``serve teacher`` compiles its closed set of shapes (``--shapes``, see
:func:`_score_shapes`) before it serves; it prints the teacher and its warm-up (shapes
compiled, seconds) on one line, ``metrics on http://HOST:PORT/metrics`` when
``--metrics-address`` is set, then ``serving teacher on HOST:PORT`` once it accepts calls,
and stops gracefully on SIGINT / SIGTERM. Tokens come from
``--token-file`` or the ``DISTILL_TOKEN`` environment variable, never the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading

from distill.checkpoint import ContractMismatch
from distill.config import ConfigError, JobConfig, load_config


def _job(args: argparse.Namespace) -> JobConfig:
    # The services' job spec: the library's job plus its `cluster:` section, so one YAML
    # serves every command.
    from services.common.config import JobSpec

    return load_config(args.config, JobSpec, args.set, path_field="config")


def _submit(args: argparse.Namespace) -> None:
    from services.jobs import api

    submission = api.submit(_job(args), args.run_dir, address=args.address, job_id=args.job_id)
    print(f"submitted {submission.job_id} to {submission.address}", flush=True)
    if args.wait:
        final = api.wait(submission.job_id, args.address, timeout_s=args.timeout)
        print(f"{submission.job_id}: {final}")
        if final != "SUCCEEDED":
            raise api.JobsApiError(f"job {submission.job_id} ended {final}")


def _status(args: argparse.Namespace) -> None:
    from services.jobs import api

    info = api.status(args.job, args.address)
    print(
        f"{info['job_id']}: {info['status']}" + (f" ({info['message']})" if info["message"] else "")
    )


def _logs(args: argparse.Namespace) -> None:
    from services.jobs import api

    if args.follow:
        for chunk in api.follow(args.job, args.address):
            print(chunk, end="", flush=True)
    else:
        print(api.logs(args.job, args.address), end="")


def _stop(args: argparse.Namespace) -> None:
    from services.jobs import api

    stopped = api.stop(args.job, args.address)
    print(f"{args.job}: {'stop requested' if stopped else 'already ended'}")


def _list(args: argparse.Namespace) -> None:
    from services.jobs import api

    for job in api.list_jobs(args.address):
        print(f"{job['job_id']}  {job['status']:<9}  {job['entrypoint']}")


def _run(args: argparse.Namespace) -> None:
    from services.jobs.driver import run_job

    result = run_job(
        _job(args),
        args.run_dir,
        address=args.address,
        ray_temp_dir=args.ray_temp_dir,
        progress=not args.quiet,
    )
    status = result.status
    last = result.evaluations[-1] if result.evaluations else None
    print(
        f"finished: step {status['step']}/{status['total_steps']}, {status['accepted_rows']} "
        f"rows accepted, {status['dropped_stale_rows']} dropped as stale, "
        f"{status['refused_rows']} refused; actors "
        + ", ".join(f"{count} {name}" for name, count in result.actors.items())
    )
    if last is not None:
        print(
            f"last evaluation (step {last['step']}): exact match {last['overall']:.3f} at "
            f"{last['tokens_per_forward']:.2f} tokens/forward"
        )


def _train_teacher(args: argparse.Namespace) -> None:
    from distill import pipeline

    pipeline.train_teacher(_job(args), args.run_dir, progress=not args.quiet)


def _warmup_student(args: argparse.Namespace) -> None:
    from distill import pipeline

    job = _job(args)
    teacher = None
    if args.teacher_run is not None:
        teacher = pipeline.load_teacher_run(job, args.teacher_run)
    elif job.student_init == "teacher":
        raise ConfigError("`--teacher-run` must be given when student_init is 'teacher'")
    pipeline.warmup_student(job, args.run_dir, teacher=teacher, progress=not args.quiet)


def _opd(args: argparse.Namespace) -> None:
    from distill import opd, pipeline
    from distill.teacher import InProcessTeacher

    job = _job(args)
    tokenizer = pipeline.job_tokenizer(job)
    if (args.teacher_run is None) == (args.teacher_server is None):
        raise ConfigError(
            "`--teacher-run` or `--teacher-server` must be given, not both; received "
            f"{'both' if args.teacher_run else 'neither'}"
        )
    teacher_model = None
    if args.teacher_run is not None:
        teacher_model = pipeline.load_teacher_run(job, args.teacher_run)
    elif job.student_init == "teacher":
        raise ConfigError(
            "`--teacher-run` must be given when student_init is 'teacher' (the warm-up run's "
            "contract names the teacher's parameters)"
        )
    student = pipeline.load_student_run(job, args.student_run, teacher=teacher_model)
    if teacher_model is not None:
        teacher = InProcessTeacher(teacher_model, tokenizer)
        opd.run_opd(job, student, teacher, tokenizer, run_dir=args.run_dir, progress=not args.quiet)
        return
    from services.common.auth import read_token
    from services.teacher.client import RemoteTeacher

    token = read_token(args.token_file)
    with RemoteTeacher(
        args.teacher_server, token=token, tls_root_cert_file=args.tls_root_cert
    ) as teacher:
        opd.run_opd(job, student, teacher, tokenizer, run_dir=args.run_dir, progress=not args.quiet)


def _score(args: argparse.Namespace) -> None:
    if args.server is not None:
        _score_remote(args)
        return
    if args.ids:
        raise ConfigError("`--ids` must come with `--server`; received no `--server`")
    if args.gguf is not None:
        _score_gguf(args)
        return
    if args.hf_checkpoint is None:
        raise ConfigError("`--hf-checkpoint` or `--server` must be given; received neither")
    from distill.models.hf import load_teacher
    from distill.teacher import InProcessTeacher

    model, checkpoint = load_teacher(args.hf_checkpoint)
    _score_local(args, InProcessTeacher(model, checkpoint.tokenizer))


def _gguf_alone(**others: object) -> None:
    """Refuse ``--gguf`` together with another teacher source (``flag=value`` pairs)."""
    given = [f"`{name}`" for name, value in others.items() if value]
    if given:
        raise ConfigError(
            f"`--gguf` must be the only teacher source; received `--gguf` and {', '.join(given)}"
        )


def _score_gguf(args: argparse.Namespace) -> None:
    from distill.models import gguf
    from distill.teacher import InProcessTeacher

    _gguf_alone(**{"--hf-checkpoint": args.hf_checkpoint})
    model, checkpoint = gguf.load_teacher(gguf.resolve_gguf(args.gguf))
    _score_local(args, InProcessTeacher(model, checkpoint.tokenizer))


def _score_local(args: argparse.Namespace, teacher) -> None:
    """Score ``args.text`` with an in-process teacher: ranks are exact (the call asks for the
    whole vocabulary as its top-k, so it holds ``n x vocab`` log-probs and ids)."""
    tokenizer, info = teacher.tokenizer, teacher.info()
    ids = [tokenizer.special.bos_id, *tokenizer.encode(args.text)]
    _check_top_k(args.top_k, info.vocab_size)
    scored = teacher.score([ids], top_k=info.vocab_size)[0]
    _report_scores(args, ids, scored, tokenizer, info, window=info.vocab_size)


def _score_remote(args: argparse.Namespace) -> None:
    from services.common.auth import read_token
    from services.teacher.client import RemoteTeacher

    if args.gguf is not None:
        _gguf_alone(**{"--hf-checkpoint": args.hf_checkpoint, "--ids": args.ids})
    if (args.hf_checkpoint is None and args.gguf is None) == (not args.ids):
        raise ConfigError(
            "`--hf-checkpoint` (for its tokenizer) or `--ids` must be given with `--server`, "
            f"not both; received {'both' if args.ids else 'neither'}"
        )
    token = read_token(args.token_file)
    with RemoteTeacher(args.server, token=token, tls_root_cert_file=args.tls_root_cert) as teacher:
        info = teacher.info()
        tokenizer = None
        if args.ids:
            try:
                ids = [int(token) for token in args.text.replace(",", " ").split()]
            except ValueError:
                raise ConfigError(
                    f"`text` must be whitespace-separated token ids with --ids; received "
                    f"{args.text!r}"
                ) from None
        else:
            if args.gguf is not None:
                from distill.models import gguf

                tokenizer = gguf.load_tokenizer(gguf.resolve_gguf(args.gguf))
            else:
                from distill.models.hf import load_tokenizer

                tokenizer = load_tokenizer(args.hf_checkpoint)
            if tokenizer.content_hash() != info.tokenizer_hash:
                flag = "--gguf" if args.gguf is not None else "--hf-checkpoint"
                raise ConfigError(
                    f"`{flag}` tokenizer must be the served teacher's "
                    f"({info.tokenizer_hash[:12]}...); received {tokenizer.content_hash()[:12]}..."
                )
            ids = [info.bos_id, *tokenizer.encode(args.text)]
        _check_top_k(args.top_k, info.vocab_size)
        window = _served_rank_window(teacher, info, len(ids) - 1)
        scored = teacher.score([ids], top_k=max(window, args.top_k or 0))[0]
    _report_scores(args, ids, scored, tokenizer, info, window=window)


#: Largest top-k answer (ids and log-probs, about 9 bytes an entry) ``score --server`` asks
#: for to rank the actual tokens, well within the default 64 MiB message limit.
_RANK_ANSWER_BYTES = 16 << 20


def _check_top_k(top_k: int | None, vocab: int) -> None:
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ConfigError(f"`--top-k` must be in [1, {vocab}] (the vocabulary); received {top_k}")


def _served_rank_window(teacher, info, positions: int) -> int:
    """How deep ``score --server`` asks for the teacher's top-k to rank each actual token:
    the whole vocabulary when the server allows it (no top-k buckets) and the answer stays
    within :data:`_RANK_ANSWER_BYTES`, else its largest top-k bucket or that size limit.
    A token outside this window has rank ``>window``."""
    from services.proto import teacher_pb2

    # The compiled buckets are only on the wire message (RemoteTeacher.info() answers the
    # contract's TeacherInfo), so ask Info through the client's own call path.
    message = teacher._call(teacher._stub.Info, teacher_pb2.InfoRequest())
    window = min(info.vocab_size, max(message.top_k_buckets, default=info.vocab_size))
    return max(1, min(window, _RANK_ANSWER_BYTES // (9 * max(1, positions))))


def _ranks(ids, scored, window: int) -> list[int | None]:
    """Per scored position, the 1-based rank of the actual next token in the teacher's
    distribution (its place in the sorted top-k), or None when it is outside the
    ``window`` best."""
    import numpy as np

    out: list[int | None] = []
    for position, token in enumerate(ids[1:]):
        found = np.flatnonzero(scored.top_ids[position, :window] == int(token))
        out.append(int(found[0]) + 1 if found.size else None)
    return out


def _report_scores(args, ids, scored, tokenizer, info, *, window: int) -> None:
    """Print the scores of ``ids`` as a table (``--json``: one JSON object). ``scored``
    holds the teacher's top-k at least ``window`` deep (ranks) and ``--top-k`` deep."""
    import numpy as np

    ranks = _ranks(ids, scored, window)
    log_probs = [float(lp) for lp in scored.log_probs]
    total = float(np.sum(scored.log_probs, dtype=np.float64))
    mean = total / len(log_probs)

    def text(token: int) -> str | None:
        if tokenizer is None:
            return None
        return tokenizer.decode([int(token)], skip_special=False)

    top = None
    if args.top_k is not None:
        top = [
            [
                (int(i), float(lp))
                for i, lp in zip(
                    scored.top_ids[position, : args.top_k],
                    scored.top_log_probs[position, : args.top_k],
                    strict=True,
                )
            ]
            for position in range(len(log_probs))
        ]
    if args.json:
        report = {
            "model_hash": info.model_hash,
            "vocab_size": info.vocab_size,
            "input_ids": [int(i) for i in ids],
            "ids": [int(i) for i in ids[1:]],
            "tokens": None if tokenizer is None else [text(i) for i in ids[1:]],
            "log_probs": log_probs,
            "ranks": ranks,
            "rank_window": window,
            "total_log_prob": total,
            "mean_log_prob": mean,
            "num_tokens": len(log_probs),
            "perplexity": math.exp(-mean),
        }
        if top is not None:
            report["top_k"] = [
                [{"id": i, "token": text(i), "log_prob": lp} for i, lp in entries]
                for entries in top
            ]
        print(json.dumps(report))
        return

    def show(token: int) -> str:
        return str(int(token)) if tokenizer is None else repr(text(token))

    width = max(12, *(len(show(token)) for token in ids[1:]))
    print(f"{'position':>8}  {'token':<{width}}  {'id':>6}  {'log-prob':>9}  {'rank':>6}")
    for position, (token, log_prob, rank) in enumerate(zip(ids[1:], log_probs, ranks, strict=True)):
        shown = str(rank) if rank is not None else f">{window}"
        line = f"{position + 1:>8}  {show(token):<{width}}  {int(token):>6}  {log_prob:9.4f}  "
        line += f"{shown:>6}"
        if top is not None:
            line += "  top: " + ", ".join(f"{show(i)}:{lp:.2f}" for i, lp in top[position])
        print(line)
    exact = "" if window >= info.vocab_size else f"; ranks beyond {window} shown as >{window}"
    print(
        f"total {total:.4f} nats over {len(log_probs)} tokens (mean {mean:.4f} nats/token, "
        f"perplexity {math.exp(-mean):.2f}{exact})"
    )


def _served_teacher(args: argparse.Namespace):
    """The in-process teacher ``serve teacher`` serves (a GGUF file, an HF checkpoint or a
    trained run), built with the :class:`~distill.teacher_contract.ScoreShapes` that
    :func:`_score_shapes` picks. ``--max-length`` (GGUF and HF only) caps the served
    sequence length and with it the length buckets."""
    from distill.teacher import InProcessTeacher

    if args.max_length is not None and args.max_length < 2:
        raise ConfigError(f"`--max-length` must be >= 2; received {args.max_length}")
    if args.gguf is not None:
        from distill.models import gguf

        _gguf_alone(**{"--hf-checkpoint": args.hf_checkpoint, "CONFIG": args.config})
        model, checkpoint = gguf.load_teacher(
            gguf.resolve_gguf(args.gguf), max_length=args.max_length
        )
        tokenizer = checkpoint.tokenizer
    else:
        if (args.hf_checkpoint is None) == (args.config is None):
            raise ConfigError(
                "`--hf-checkpoint` or CONFIG with `--teacher-run` must be given, not both; "
                f"received {'both' if args.hf_checkpoint else 'neither'}"
            )
        if args.config is not None and args.teacher_run is None:
            raise ConfigError("`--teacher-run` must be given with CONFIG; received none")
        if args.hf_checkpoint is not None:
            from distill.models.hf import load_teacher

            model, checkpoint = load_teacher(args.hf_checkpoint, max_length=args.max_length)
            tokenizer = checkpoint.tokenizer
        else:
            if args.max_length is not None:
                raise ConfigError(
                    "`--max-length` must come with --hf-checkpoint or --gguf (a trained run "
                    f"serves its job's teacher.max_length); received {args.max_length} with "
                    "CONFIG"
                )
            from distill import pipeline

            job = _job(args)
            model = pipeline.load_teacher_run(job, args.teacher_run)
            tokenizer = pipeline.job_tokenizer(job)
    shapes, _ = _score_shapes(args, model.config.max_length)
    return InProcessTeacher(model, tokenizer, shapes=shapes)


def _score_shapes(args: argparse.Namespace, max_length: int):
    """``(shapes, why)``: the :class:`~distill.teacher_contract.ScoreShapes` ``serve
    teacher`` compiles before serving (None: each shape compiles on first use) and a phrase
    saying why.

    ``--shapes default``: ``ScoreShapes.default(max_length, max_batch_sequences)``. ``none``:
    no buckets. ``auto`` (the default): the default buckets when their largest call,
    ``max_batch_sequences x max_length`` padded ids, is within ``max_batch_tokens`` (the
    warm-up then runs no call larger than serving could), else none -- a long-context model
    would compile and run calls far beyond any batch the server forms; cap it with
    ``--max-length``."""
    from distill.teacher_contract import ScoreShapes

    rows = args.max_batch_sequences
    if args.shapes == "none":
        return None, "--shapes none"
    if args.shapes == "auto" and rows * max_length > args.max_batch_tokens:
        return None, (
            f"auto: max_batch_sequences {rows} x max_length {max_length} > max_batch_tokens "
            f"{args.max_batch_tokens}"
        )
    return ScoreShapes.default(max_length, rows), f"{args.shapes}: ScoreShapes.default"


def _describe_shapes(shapes) -> str:
    def span(values) -> str:
        return f"{values[0]}..{values[-1]}" if len(values) > 1 else str(values[0])

    return (
        f"rows {span(shapes.rows)} x lengths {span(shapes.lengths)}; top-k "
        f"{', '.join(map(str, shapes.top_ks)) or 'none'}; candidates "
        f"{', '.join(map(str, shapes.candidates)) or 'none'}"
    )


def _serve_teacher(args: argparse.Namespace) -> None:
    import time

    from services.common.auth import read_token
    from services.teacher.server import TeacherServerConfig, serve_teacher

    config = TeacherServerConfig(
        address=args.address,
        token=read_token(args.token_file),
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        max_batch_sequences=args.max_batch_sequences,
        max_batch_tokens=args.max_batch_tokens,
        max_delay_ms=args.max_delay_ms,
        max_request_sequences=args.max_request_sequences,
        max_request_tokens=args.max_request_tokens,
        max_queue_requests=args.max_queue_requests,
        warm_shared_prompts=args.warm_shared_prompts,
        metrics_address=args.metrics_address,
        metrics_public=args.metrics_public,
    )
    from distill.cache import enable_compile_cache

    # Before anything compiles: a restarted server reads its warm-up from disk.
    compile_cache = enable_compile_cache(args.compile_cache)
    teacher = _served_teacher(args)
    _, why = _score_shapes(args, teacher.model.config.max_length)
    if teacher.shapes is None and args.warm_shared_prompts:
        raise ConfigError(
            "`--warm-shared-prompts` must come with compiled shapes (--shapes default, or "
            f"auto when it picks them); received it with no shapes ({why})"
        )
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        before, started = teacher.compile_count(), time.monotonic()
        server = serve_teacher(teacher, config)  # warms up (compiles) before it returns
        compiled, seconds = teacher.compile_count() - before, time.monotonic() - started
        info = server.info
        if teacher.shapes is None:
            warm = f"shapes none ({why}): each shape compiles on first use"
        else:
            shared = " and shared prompts" if args.warm_shared_prompts else ""
            warm = (
                f"warm-up compiled {compiled} shapes{shared} in {seconds:.1f} s "
                f"({_describe_shapes(teacher.shapes)}); compile cache "
                f"{compile_cache if compile_cache is not None else 'off'}"
            )
        print(
            f"teacher: vocab {info.vocab_size}, max_length {info.max_length}, model_hash "
            f"{info.model_hash[:12]}, tokenizer_hash {info.tokenizer_hash[:12]}; auth "
            f"{'bearer token' if config.token else 'none'}; tls "
            f"{'on' if config.tls_cert_file else 'off'}; {warm}"
        )
        if server.metrics_endpoint is not None:
            print(f"metrics on http://{server.metrics_endpoint.address}/metrics")
        # The line scripts wait for (the port is the bound one when 0 was asked for).
        print(f"serving teacher on {server.address}", flush=True)
        while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly
            pass
        print("stopping (graceful)", flush=True)
        server.stop()
        stats = server.stats()
        print(
            f"stopped: {stats.requests} requests in {stats.batches} batches "
            f"({stats.sequences} sequences)",
            flush=True,
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _demo(args: argparse.Namespace) -> None:
    from services import demo

    demo.main(args.demo_args)


def _teacher_server_defaults() -> dict[str, object]:
    from services.teacher.server import TeacherServerConfig

    return {name: field.default for name, field in TeacherServerConfig.model_fields.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distill", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run the end-to-end demo")
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    demo.set_defaults(run=_demo)

    for name, handler, text in (
        ("train-teacher", _train_teacher, "train the causal teacher (next-token CE)"),
        ("warmup-student", _warmup_student, "warm up the block-diffusion student"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("config", help="job YAML")
        command.add_argument("--run-dir", required=True, help="checkpoints + contract + eval")
        command.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
        command.add_argument("--quiet", action="store_true", help="no progress bar")
        if name == "warmup-student":
            command.add_argument("--teacher-run", help="a finished train-teacher run dir")
        command.set_defaults(run=handler)

    run = commands.add_parser(
        "run",
        help="run (or resume) a whole job on Ray: phases, teacher replicas, rollout workers, "
        "learner",
    )
    run.add_argument("config", help="job YAML (with an optional cluster: section)")
    run.add_argument("--run-dir", required=True, help="teacher/, student/ and opd/ run dirs")
    run.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (else $RAY_ADDRESS, else an embedded local Ray on loopback)",
    )
    run.add_argument("--ray-temp-dir", default=None, help="temp dir of an embedded Ray")
    run.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(run=_run)

    address_help = "the cluster's Jobs API, http://HOST:8265 (else $RAY_ADDRESS, else local)"
    submit = commands.add_parser("submit", help="submit `distill run` to a Ray cluster's Jobs API")
    submit.add_argument("config", help="job YAML (validated here, with --set applied)")
    submit.add_argument("--run-dir", required=True, help="run directory on the cluster")
    submit.add_argument("--address", default=None, help=address_help)
    submit.add_argument("--job-id", default=None, help="submission id (default: Ray's)")
    submit.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    submit.add_argument("--wait", action="store_true", help="wait for the job to end")
    submit.add_argument("--timeout", type=float, default=24 * 3600.0, help="with --wait")
    submit.set_defaults(run=_submit)
    for name, handler, text in (
        ("status", _status, "a submitted job's status"),
        ("logs", _logs, "a submitted job's log"),
        ("stop", _stop, "stop a submitted job (rerun `distill submit` to resume it)"),
    ):
        verb = commands.add_parser(name, help=text)
        verb.add_argument("job", help="job (submission) id")
        verb.add_argument("--address", default=None, help=address_help)
        if name == "logs":
            verb.add_argument("--follow", action="store_true", help="until the job ends")
        verb.set_defaults(run=handler)
    listing = commands.add_parser("list", help="jobs of a Ray cluster")
    listing.add_argument("--address", default=None, help=address_help)
    listing.set_defaults(run=_list)

    distill = commands.add_parser(
        "opd", help="on-policy distillation of a warmed-up student (resumable)"
    )
    distill.add_argument("config", help="job YAML")
    distill.add_argument("--run-dir", required=True, help="checkpoints + contract")
    distill.add_argument("--student-run", required=True, help="a finished warmup-student run")
    distill.add_argument("--teacher-run", help="a finished train-teacher run (in-process)")
    distill.add_argument("--teacher-server", metavar="HOST:PORT", help="a teacher server")
    distill.add_argument("--token-file", help="bearer token for --teacher-server")
    distill.add_argument("--tls-root-cert", help="PEM roots to verify a TLS teacher server")
    distill.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    distill.add_argument("--quiet", action="store_true", help="no progress bar")
    distill.set_defaults(run=_opd)

    score = commands.add_parser(
        "score", help="teacher log-probs of a text (HF checkpoint, or through a server)"
    )
    score.add_argument("text", help="text to score (token ids with --ids)")
    score.add_argument(
        "--hf-checkpoint",
        help="Llama / Qwen2 checkpoint dir (with --server: only its tokenizer is read)",
    )
    score.add_argument(
        "--gguf",
        metavar="FILE",
        help="GGUF file, or `smollm2` (fetched on first use; with --server: only its tokenizer)",
    )
    score.add_argument("--server", metavar="HOST:PORT", help="score through a teacher server")
    score.add_argument("--token-file", help="bearer token for --server (else $DISTILL_TOKEN)")
    score.add_argument("--tls-root-cert", help="PEM roots to verify a TLS --server")
    score.add_argument("--ids", action="store_true", help="TEXT is token ids (with --server)")
    score.add_argument("--top-k", type=int, default=None, help="show the teacher's K best")
    score.add_argument("--json", action="store_true", help="print one JSON object")
    score.set_defaults(run=_score)

    serve = commands.add_parser("serve", help="run a gRPC server until SIGINT / SIGTERM")
    servers = serve.add_subparsers(dest="server", required=True)
    teacher = servers.add_parser("teacher", help="the teacher scoring server")
    teacher.add_argument("config", nargs="?", help="job YAML (with --teacher-run)")
    teacher.add_argument("--teacher-run", help="a finished train-teacher run dir")
    teacher.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    teacher.add_argument("--hf-checkpoint", help="Llama / Qwen2 checkpoint dir")
    teacher.add_argument(
        "--gguf", metavar="FILE", help="GGUF file, or `smollm2` (fetched on first use)"
    )
    teacher.add_argument("--address", default="127.0.0.1:0", help="HOST:PORT (port 0: any)")
    teacher.add_argument("--token-file", help="bearer token callers must send")
    teacher.add_argument("--tls-cert", help="PEM server certificate chain (with --tls-key)")
    teacher.add_argument("--tls-key", help="PEM server private key (with --tls-cert)")
    defaults = _teacher_server_defaults()
    for flag, kind in (
        ("max_batch_sequences", int),
        ("max_batch_tokens", int),
        ("max_delay_ms", float),
        ("max_request_sequences", int),
        ("max_request_tokens", int),
        ("max_queue_requests", int),
    ):
        teacher.add_argument(
            f"--{flag.replace('_', '-')}", type=kind, default=defaults[flag], metavar="N"
        )
    teacher.add_argument(
        "--shapes",
        choices=("auto", "default", "none"),
        default="auto",
        help="compiled shapes: default = ScoreShapes.default(max_length, max_batch_sequences), "
        "warmed up before serving; none = compile on first use; auto (default): default when "
        "max_batch_sequences x max_length <= max_batch_tokens, else none",
    )
    teacher.add_argument(
        "--max-length",
        type=int,
        default=None,
        metavar="N",
        help="longest sequence served (--hf-checkpoint / --gguf; default: the model's)",
    )
    teacher.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|off",
        help="JAX's persistent compilation cache, so a restart skips compiling (default: "
        "$DISTILL_COMPILE_CACHE, else ~/.cache/distill/jax under $DISTILL_CACHE; off: none)",
    )
    teacher.add_argument(
        "--warm-shared-prompts",
        action="store_true",
        help="the warm-up also compiles the shared-prompt shapes (many more)",
    )
    teacher.add_argument(
        "--metrics-address", metavar="HOST:PORT", help="Prometheus /metrics endpoint (port 0: any)"
    )
    teacher.add_argument(
        "--metrics-public",
        action="store_true",
        help="allow a non-loopback --metrics-address (the endpoint has no auth)",
    )
    teacher.set_defaults(run=_serve_teacher)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from services.common.auth import TokenError
    from services.teacher.client import TeacherServerError

    try:
        args.run(args)
    except (ConfigError, ContractMismatch, TokenError) as error:
        print(f"distill {args.command}: {error}", file=sys.stderr)
        return 2
    except TeacherServerError as error:
        print(f"distill {args.command}: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        # A guard trip is an outcome of the run, not a bug: its message says what to change.
        # (distill.opd imports JAX: only looked up once something failed.)
        from distill.opd.guard import PolicyRegression
        from services.jobs.api import JobsApiError
        from services.jobs.driver import JobFailed

        if not isinstance(error, JobFailed | JobsApiError | PolicyRegression):
            raise
        print(f"distill {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
