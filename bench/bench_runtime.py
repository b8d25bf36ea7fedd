"""Benchmark: the distributed OPD runtime vs the in-process loop, and rollout/learning
overlap (``loss.max_staleness: 1``) vs strictly alternating (``0``), in one run.

The job is the demo's (``deploy/configs/agree.yaml``, shortened phases). Every process is
limited to one core: the in-process loop runs here with XLA's CPU backend on one thread
(``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``, set
before JAX is imported) pinned to core 0, and each actor of the distributed runs gets the
same flags through ``cluster.<role>.cpu_threads=1`` and a core through
``cluster.<role>.cpu_affinity``: the learner and the teacher it waits on share core 0, the
one rollout worker has core 1.

Steady-state time per step is the median over steps after ``--skip`` warm-up steps (which
compile): for the in-process loop the wall time of rollout + train; for the distributed
runs the learner's time from one step's end to the next (waiting for rollouts, teacher
scores, replay and update, weight publication). Printed: steps per minute of each, the
ratios (overlap: staleness 1 / staleness 0; distributed / in-process), and the shares of a
distributed step spent publishing weights and waiting on the teacher.

Run: ``.venv/bin/python bench/bench_runtime.py [--steps 14 --skip 4]`` (a few minutes).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
).strip()
for _name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED"):
    os.environ[_name] = "0"

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill import pipeline  # noqa: E402
from distill.config import load_config  # noqa: E402
from distill.opd.learner import OpdLearner  # noqa: E402
from distill.teacher import InProcessTeacher  # noqa: E402
from services.cluster.placement import start_ray  # noqa: E402
from services.common.config import JobSpec  # noqa: E402
from services.jobs.driver import run_job  # noqa: E402


def job_for(steps: int, staleness: int, extra: list[str]) -> JobSpec:
    overrides = [
        "teacher_training.steps=30",
        "teacher_training.eval_examples=8",
        "student_warmup.steps=30",
        "student_warmup.eval_examples=8",
        f"opd.steps={steps}",
        f"opd.checkpoint_every={steps}",
        "opd.eval_examples=8",
        f"loss.max_staleness={staleness}",
        "cluster.teacher.count=1",
        "cluster.rollout.count=1",
        "cluster.teacher.cpu_threads=1",
        "cluster.rollout.cpu_threads=1",
        "cluster.learner.cpu_threads=1",
        # The learner and the teacher (which the learner waits on) share core 0, the
        # rollout worker has core 1: the overlap the runtime can give on two cores.
        "cluster.learner.cpu_affinity=[0]",
        "cluster.teacher.cpu_affinity=[0]",
        "cluster.rollout.cpu_affinity=[1]",
        *extra,
    ]
    return load_config(ROOT / "deploy/configs/agree.yaml", JobSpec, overrides)


def in_process_step_seconds(job: JobSpec, run: Path) -> list[float]:
    tokenizer = pipeline.job_tokenizer(job)
    teacher = InProcessTeacher(pipeline.load_teacher_run(job, run / "teacher"), tokenizer)
    student = pipeline.load_student_run(job, run / "student")
    learner = OpdLearner(job, student, teacher, tokenizer, log=lambda _: None)
    # The in-process loop on core 0 alone, as the learner is in the distributed runs.
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    seconds = []
    for _ in range(job.opd.steps):
        start = time.perf_counter()
        learner.train(learner.roll_out())
        seconds.append(time.perf_counter() - start)
    os.sched_setaffinity(0, previous)
    learner.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=4, help="warm-up steps left out")
    parser.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    args = parser.parse_args()
    if args.skip >= args.steps - 2:
        parser.error("`--skip` must leave at least 3 timed steps")

    work = Path(tempfile.mkdtemp(prefix="distill-bench-runtime-"))
    try:
        base = job_for(args.steps, 0, args.set)
        phases = work / "phases"
        print("training tiny phases (teacher, warm-up) ...", flush=True)
        pipeline.train_teacher(base, phases / "teacher", progress=False, log=lambda _: None)
        pipeline.warmup_student(base, phases / "student", progress=False, log=lambda _: None)

        def fresh(name: str) -> Path:
            run = work / name
            for phase in ("teacher", "student"):
                shutil.copytree(phases / phase, run / phase)
            return run

        start_ray(None, base.cluster, work / "ray")
        results: dict[str, list[float]] = {}
        shares: dict[str, tuple[float, float]] = {}
        parts: dict[str, dict[str, float]] = {}
        for staleness in (0, 1):
            name = f"distributed, max_staleness {staleness}"
            print(f"{name} ...", flush=True)
            result = run_job(
                job_for(args.steps, staleness, args.set),
                fresh(f"staleness{staleness}"),
                progress=False,
                log=lambda _: None,
            )
            steady = result.history[args.skip :]
            results[name] = [m["step_seconds"] for m in steady]
            total = sum(m["step_seconds"] for m in steady)
            parts[name] = {
                part: statistics.median(m[f"{part}_seconds"] for m in steady) * 1000
                for part in ("wait", "train", "teacher", "publish", "step")
            }
            shares[name] = (
                sum(m["publish_seconds"] for m in steady) / total,
                sum(m["teacher_seconds"] for m in steady) / total,
            )
        print("in-process loop ...", flush=True)
        results["in-process loop"] = in_process_step_seconds(base, fresh("in_process"))[args.skip :]
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    per_minute = {name: 60.0 / statistics.median(values) for name, values in results.items()}
    print(
        f"\njob: deploy/configs/agree.yaml, {args.steps} OPD steps, median of the last "
        f"{args.steps - args.skip}; every process on one core"
    )
    print(f"{'runtime':<34} {'steps/min':>10}")
    for name, value in per_minute.items():
        print(f"{name:<34} {value:>10.1f}")
    overlap = (
        per_minute["distributed, max_staleness 1"] / per_minute["distributed, max_staleness 0"]
    )
    local = per_minute["in-process loop"]
    print(f"\noverlap (max_staleness 1 / 0):                 {overlap:.2f}x")
    for staleness in (0, 1):
        name = f"distributed, max_staleness {staleness}"
        print(
            f"distributed (staleness {staleness}) / in-process:     {per_minute[name] / local:.2f}x"
        )
    print("\nmedian milliseconds per step (wait: for the step's rollouts; train includes teacher)")
    for name, values in parts.items():
        print(f"{name}: " + ", ".join(f"{part} {ms:.0f}" for part, ms in values.items()))
    for name, (publish, teacher) in shares.items():
        print(f"{name}: weight publication {publish:.1%} of step time, teacher calls {teacher:.1%}")


if __name__ == "__main__":
    main()
