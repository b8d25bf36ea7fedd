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
    distill score (--hf-checkpoint DIR | --gguf FILE|smollm2) TEXT [--top-k K]
    distill score --server ADDR [--token-file F] [--tls-root-cert F]
                  (--hf-checkpoint DIR TEXT | --gguf FILE|smollm2 TEXT | --ids "ID ...")
                  [--top-k K]
    distill serve teacher (--hf-checkpoint DIR | --gguf FILE|smollm2
                  | CONFIG --teacher-run DIR [--set a.b=value ...])
                  [--address HOST:PORT] [--token-file F] [--tls-cert F --tls-key F]
                  [--max-batch-sequences N] [--max-batch-tokens N] [--max-delay-ms MS]
                  [--max-request-sequences N] [--max-request-tokens N] [--max-queue-requests N]

CONFIG is a job YAML (see ``deploy/configs/``); ``--set`` applies dotted overrides. Runs
resume from their newest checkpoint and refuse a changed setup (the run contract). Errors in
the configuration or the run contract are printed as one line per field, exit status 2; a
refused call to a server is printed with the server's reason, exit status 1.

``score --server`` scores through a running teacher server; with ``--hf-checkpoint`` only the
checkpoint's tokenizer is read (and must match the server's), with ``--ids`` the text is
whitespace-separated token ids. ``--gguf`` reads a GGUF file instead of a checkpoint directory
(``smollm2``: SmolLM2-135M-Instruct, fetched into the cache on first use; see
``distill.models.gguf``). ``serve teacher`` prints ``serving teacher on HOST:PORT``
once it accepts calls and stops gracefully on SIGINT / SIGTERM. Tokens come from
``--token-file`` or the ``DISTILL_TOKEN`` environment variable, never the command line.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from distill.checkpoint import ContractMismatch
from distill.config import ConfigError, JobConfig, load_config


def _job(args: argparse.Namespace) -> JobConfig:
    # The services' job spec: the library's job plus its `cluster:` section, so one YAML
    # serves every command.
    from services.common.config import JobSpec

    return load_config(args.config, JobSpec, args.set)


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
    tokenizer = checkpoint.tokenizer
    ids = [tokenizer.special.bos_id, *tokenizer.encode(args.text)]
    scored = InProcessTeacher(model, tokenizer).score([ids], top_k=args.top_k)[0]
    _print_scores(ids, scored, tokenizer)


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
    tokenizer = checkpoint.tokenizer
    ids = [tokenizer.special.bos_id, *tokenizer.encode(args.text)]
    scored = InProcessTeacher(model, tokenizer).score([ids], top_k=args.top_k)[0]
    _print_scores(ids, scored, tokenizer)


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
        scored = teacher.score([ids], top_k=args.top_k)[0]
    _print_scores(ids, scored, tokenizer)


def _print_scores(ids, scored, tokenizer) -> None:
    """One line per scored position (token, log-prob, top-k), then the total. Without a
    tokenizer tokens are shown as ids."""

    def show(token: int) -> str:
        if tokenizer is None:
            return str(int(token))
        return repr(tokenizer.decode([int(token)], skip_special=False))

    print(f"{'position':>8}  {'token':>12}  {'log-prob':>9}")
    for position, (token, log_prob) in enumerate(zip(ids[1:], scored.log_probs, strict=True)):
        line = f"{position + 1:>8}  {show(token):>12}  {log_prob:9.4f}"
        if scored.top_ids is not None:
            top = ", ".join(
                f"{show(i)}:{lp:.2f}"
                for i, lp in zip(
                    scored.top_ids[position], scored.top_log_probs[position], strict=True
                )
            )
            line += f"  top: {top}"
        print(line)
    print(f"total {float(scored.log_probs.sum()):.4f} nats over {len(scored.log_probs)} tokens")


def _served_teacher(args: argparse.Namespace):
    """The in-process teacher ``serve teacher`` serves: an HF checkpoint or a trained run."""
    from distill.teacher import InProcessTeacher

    if args.gguf is not None:
        from distill.models import gguf

        _gguf_alone(**{"--hf-checkpoint": args.hf_checkpoint, "CONFIG": args.config})
        model, checkpoint = gguf.load_teacher(gguf.resolve_gguf(args.gguf))
        return InProcessTeacher(model, checkpoint.tokenizer)
    if (args.hf_checkpoint is None) == (args.config is None):
        raise ConfigError(
            "`--hf-checkpoint` or CONFIG with `--teacher-run` must be given, not both; "
            f"received {'both' if args.hf_checkpoint else 'neither'}"
        )
    if args.config is not None and args.teacher_run is None:
        raise ConfigError("`--teacher-run` must be given with CONFIG; received none")
    if args.hf_checkpoint is not None:
        from distill.models.hf import load_teacher

        model, checkpoint = load_teacher(args.hf_checkpoint)
        return InProcessTeacher(model, checkpoint.tokenizer)
    from distill import pipeline

    job = _job(args)
    return InProcessTeacher(
        pipeline.load_teacher_run(job, args.teacher_run), pipeline.job_tokenizer(job)
    )


def _serve_teacher(args: argparse.Namespace) -> None:
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
    )
    teacher = _served_teacher(args)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        server = serve_teacher(teacher, config)
        info = server.info
        print(
            f"teacher: vocab {info.vocab_size}, max_length {info.max_length}, model_hash "
            f"{info.model_hash[:12]}, tokenizer_hash {info.tokenizer_hash[:12]}; auth "
            f"{'bearer token' if config.token else 'none'}; tls "
            f"{'on' if config.tls_cert_file else 'off'}"
        )
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
    score.add_argument("--top-k", type=int, default=None)
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
        from services.jobs.api import JobsApiError
        from services.jobs.driver import JobFailed

        if not isinstance(error, JobFailed | JobsApiError):
            raise
        print(f"distill {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
