"""The ``distill`` command.

    distill demo                       the end-to-end demo (same as ``make demo``)
    distill train-teacher CONFIG --run-dir DIR [--set a.b=value ...]
    distill warmup-student CONFIG --run-dir DIR [--teacher-run DIR] [--set a.b=value ...]
    distill score --hf-checkpoint DIR TEXT [--top-k K]

CONFIG is a job YAML (see ``deploy/configs/``); ``--set`` applies dotted overrides. Runs
resume from their newest checkpoint and refuse a changed setup (the run contract). Errors in
the configuration or the run contract are printed as one line per field, exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from distill.checkpoint import ContractMismatch
from distill.config import ConfigError, JobConfig, load_config


def _job(args: argparse.Namespace) -> JobConfig:
    return load_config(args.config, JobConfig, args.set)


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


def _score(args: argparse.Namespace) -> None:
    from distill.models.hf import load_teacher
    from distill.teacher import InProcessTeacher

    model, checkpoint = load_teacher(args.hf_checkpoint)
    tokenizer = checkpoint.tokenizer
    ids = [tokenizer.special.bos_id, *tokenizer.encode(args.text)]
    scored = InProcessTeacher(model, tokenizer).score([ids], top_k=args.top_k)[0]
    print(f"{'position':>8}  {'token':>12}  {'log-prob':>9}")
    for position, (token, log_prob) in enumerate(zip(ids[1:], scored.log_probs, strict=True)):
        text = tokenizer.decode([token], skip_special=False)
        line = f"{position + 1:>8}  {text!r:>12}  {log_prob:9.4f}"
        if scored.top_ids is not None:
            top = ", ".join(
                f"{tokenizer.decode([int(i)], skip_special=False)!r}:{lp:.2f}"
                for i, lp in zip(
                    scored.top_ids[position], scored.top_log_probs[position], strict=True
                )
            )
            line += f"  top: {top}"
        print(line)
    print(f"total {float(scored.log_probs.sum()):.4f} nats over {len(scored.log_probs)} tokens")


def _demo(args: argparse.Namespace) -> None:
    from distill import demo

    demo.main(args.demo_args)


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

    score = commands.add_parser("score", help="teacher log-probs of a text (HF checkpoint)")
    score.add_argument("text")
    score.add_argument("--hf-checkpoint", required=True, help="Llama / Qwen2 checkpoint dir")
    score.add_argument("--top-k", type=int, default=None)
    score.set_defaults(run=_score)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ConfigError, ContractMismatch) as error:
        print(f"distill {args.command}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
