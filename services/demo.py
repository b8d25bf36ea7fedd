"""`make demo`: the whole product end to end with tiny models on the CPU.

1. train (or reuse, from ``runs/demo/teacher``) a tiny causal teacher;
2. warm up a block-diffusion student with the MDLM objective (or reuse it);
3. run (or resume, from ``runs/demo/opd``) on-policy distillation on the distributed
   runtime on an embedded local Ray (``services/jobs/driver.py``, the same as ``distill
   run``): the teacher scoring server as a Ray actor, two rollout workers streaming their
   traces over gRPC to the learner actor, which scores them with the teacher, replays them
   exactly and publishes versioned weights back through the object store. Steps 1-2 run as
   Ray tasks. ``--runtime in-process`` runs the in-process loop instead;
4. evaluate teacher, warmed-up student and OPD student at temperature 1 across commit
   thresholds (tokens per forward from 1 to the whole completion) and write
   ``runs/demo/report.md``, ``report.json`` and ``accuracy_vs_parallelism.png``.

The job is ``deploy/configs/agree.yaml``: the ``agree`` probe, where independent parallel
sampling fails and OPD has to teach the student's parallel marginals to agree.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from distill import opd, pipeline
from distill.config import load_config
from distill.data.stream import TaskStream
from distill.evaluate import EvalReport, evaluate_student
from distill.teacher import InProcessTeacher
from services.common.config import JobSpec
from services.teacher.client import RemoteTeacher
from services.teacher.server import serve_teacher

THRESHOLDS = (0.0, 0.5, 0.9, 1.0)


def _sweep(job, model, tokenizer, count: int) -> list[tuple[float, EvalReport]]:
    examples = TaskStream(job.data, split="eval").batch(0, count)
    out = []
    for threshold in THRESHOLDS:
        rollout = job.rollout.model_copy(update={"threshold": threshold})
        settings = opd.rollout_settings(job.model_copy(update={"rollout": rollout}), tokenizer)
        out.append((threshold, evaluate_student(model, tokenizer, examples, settings, seed=1)))
    return out


def _plot(path: Path, teacher: EvalReport, curves: dict[str, list[tuple[float, EvalReport]]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for label, points in curves.items():
        ordered = sorted((report.tokens_per_forward, report.overall) for _, report in points)
        xs, ys = [x for x, _ in ordered], [y for _, y in ordered]
        axis.plot(xs, ys, marker="o", label=label)
    axis.scatter([1.0], [teacher.overall], marker="*", s=160, color="black", label="teacher")
    axis.set_xlabel("tokens committed per forward")
    axis.set_ylabel("exact match (temperature 1)")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend()
    axis.set_title("accuracy vs parallelism")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _opd_student(job, run: Path, teacher, tokenizer):
    """The OPD student of a finished OPD run (restored through the learner, which checks the
    run contract)."""
    from distill.opd.learner import OpdLearner

    student = pipeline.load_student_run(job, run / "student")
    learner = OpdLearner(job, student, teacher, tokenizer, run_dir=run / "opd", log=lambda _: None)
    learner.close()
    return student, learner.reports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/configs/agree.yaml")
    parser.add_argument("--run-dir", default="runs/demo")
    parser.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    parser.add_argument("--eval-examples", type=int, default=128)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument(
        "--runtime",
        choices=("distributed", "in-process"),
        default="distributed",
        help="OPD on the embedded Ray (teacher replicas, rollout workers and the learner as "
        "actors over gRPC; default) or the in-process loop",
    )
    parser.add_argument("--ray-temp-dir", default=None, help="temp dir of the embedded Ray")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    job = load_config(args.config, JobSpec, args.set, path_field="config")
    run = Path(args.run_dir)
    tokenizer = pipeline.job_tokenizer(job)
    progress = not args.quiet
    print(f"== job {args.config} (seed {job.seed}); runs in {run}")

    history: list[dict[str, float]] = []
    if args.runtime == "distributed":
        from services.jobs.driver import run_job

        print(
            "== 1-3/4 teacher, student warm-up and on-policy distillation on the embedded Ray: "
            f"{job.cluster.teacher.count} teacher replica(s), {job.cluster.rollout.count} "
            "rollout worker(s), 1 learner"
        )
        result = run_job(job, run, ray_temp_dir=args.ray_temp_dir, progress=progress)
        history = result.history
        runtime = "distributed (Ray, gRPC): " + ", ".join(
            f"{count} {name}" for name, count in result.actors.items()
        )
        teacher = pipeline.load_teacher_run(job, run / "teacher")
        teacher_report = EvalReport(**json.loads((run / "teacher" / "eval.json").read_text()))
        student = pipeline.load_student_run(job, run / "student")
        local = InProcessTeacher(teacher, tokenizer)
    else:
        print("== 1/4 causal teacher")
        teacher, teacher_report = pipeline.train_teacher(job, run / "teacher", progress=progress)
        print("== 2/4 student warm-up")
        student, _ = pipeline.warmup_student(job, run / "student", progress=progress)
        print("== 3/4 on-policy distillation (in-process, teacher over gRPC on loopback)")
        local = InProcessTeacher(teacher, tokenizer)
        with serve_teacher(local) as server, RemoteTeacher(server.address) as scorer:
            history, _ = opd.run_opd(
                job,
                pipeline.load_student_run(job, run / "student"),
                scorer,
                tokenizer,
                run_dir=run / "opd",
                progress=progress,
            )
        runtime = "in-process loop, teacher served on loopback"
    warmed = _sweep(job, student, tokenizer, args.eval_examples)
    distilled_student, reports = _opd_student(job, run, local, tokenizer)
    print("== 4/4 evaluation across commit thresholds")
    distilled = _sweep(job, distilled_student, tokenizer, args.eval_examples)

    rows = [("teacher (causal)", None, teacher_report)]
    rows += [("warmed-up student", t, r) for t, r in warmed]
    rows += [("OPD student", t, r) for t, r in distilled]
    lines = [
        f"# Demo report: {args.config}, seed {job.seed}",
        "",
        "Exact match at temperature 1 on the eval split; tokens per forward counts committed "
        "completion tokens per student forward (1 for the autoregressive teacher).",
        "",
        "| model | threshold | tokens / forward | "
        + " | ".join(teacher_report.accuracy)
        + " | overall | agree entropy (bits) |",
        "|---|---|---|" + "---|" * len(teacher_report.accuracy) + "---|---|",
    ]
    for name, threshold, report in rows:
        accuracy = " | ".join(
            f"{report.accuracy.get(task, 0.0):.3f}" for task in teacher_report.accuracy
        )
        entropy = report.agree_entropy_bits
        entropy = "-" if entropy is None else f"{abs(entropy):.2f}"
        lines.append(
            f"| {name} | {'-' if threshold is None else threshold} | "
            f"{report.tokens_per_forward:.2f} | {accuracy} | {report.overall:.3f} | {entropy} |"
        )
    lines += [
        "",
        f"OPD: {job.opd.steps} steps, loss {job.loss.kind} / {job.loss.advantage}, "
        f"max_staleness {job.loss.max_staleness}; runtime {runtime}.",
    ]
    lines.append(f"Wall time {time.perf_counter() - start:.0f} s.")
    (run / "report.md").write_text("\n".join(lines) + "\n")
    (run / "report.json").write_text(
        json.dumps(
            {
                "teacher": teacher_report.to_dict(),
                "warmed_up": [{"threshold": t, **r.to_dict()} for t, r in warmed],
                "opd": [{"threshold": t, **r.to_dict()} for t, r in distilled],
                "opd_evaluations": [{"step": s, **r.to_dict()} for s, r in reports],
                "runtime": runtime,
                "opd_last_metrics": history[-1] if history else {},
            },
            indent=2,
        )
    )
    _plot(
        run / "accuracy_vs_parallelism.png",
        teacher_report,
        {"warmed-up student": warmed, "OPD student": distilled},
    )
    print("\n".join(lines))
    print(
        f"\nwrote {run / 'report.md'}, {run / 'report.json'}, {run / 'accuracy_vs_parallelism.png'}"
    )


if __name__ == "__main__":
    main()
