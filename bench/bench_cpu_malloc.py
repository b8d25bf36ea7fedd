"""Benchmark: training steps on CPU with glibc's default malloc vs ``distill.allocator``'s
settings (one arena, no mmap'd chunks, no trimming), side by side in one run.

XLA:CPU allocates each step's temporary buffer on a worker thread; with glibc's defaults a
buffer that large is a fresh ``mmap`` every step, faulted in page by page
(:mod:`distill.allocator`). The settings only take effect at process start, so each
measurement is a fresh process (``--worker``) that builds the `sort` experiment's student
warm-up (4-layer student, batch 32, antithetic MDLM: the recipe of docs/quality.md) or its
causal teacher (``--phase teacher``), compiles the step, runs ``--warmup`` steps, then
times ``--steps`` steps. The two settings alternate for ``--rounds`` rounds. Printed per
setting: the median seconds per step, minor page faults per step and the share of the
process's CPU time spent in the kernel; then the ratio default / tuned of the step time.
It fails unless every process trained the same losses, bitwise (the settings move buffers,
not arithmetic).

Run: ``.venv/bin/python bench/bench_cpu_malloc.py [--phase warmup|teacher] [--rounds 3]``
(about 40 s per process on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill.allocator import GLIBC_TUNABLES, training_environment  # noqa: E402

#: The overrides of the `sort` recipe in docs/quality.md that shape the trained step.
RECIPE = (
    "teacher.n_layers=4",
    "student.n_layers=4",
    "objective.antithetic=true",
    "objective.min_noise=0.2",
)


TIMED = ("step_s", "faults_per_step", "kernel_share")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("warmup", "teacher"), default="warmup")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    parser.add_argument("--rounds", type=int, default=3, help="alternating process pairs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Time ``args.steps`` training steps in this process; return per-step figures."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from flax import nnx

    from distill.data.stream import TaskStream
    from distill.diffusion.objectives import CausalLM, Objective
    from distill.experiments.parallelism import ExperimentConfig, cell_job
    from distill.models.transformer import Transformer
    from distill.pipeline import (
        completion_length,
        init_student,
        job_teacher_tokenizer,
        job_tokenizer,
        phase_train_state,
    )
    from distill.train import Trainer, batch_keys, task_layout

    job = cell_job("sort", "mdlm", "none", 0, ExperimentConfig(overrides=RECIPE))
    if args.phase == "warmup":
        tokenizer = job_tokenizer(job)
        model = init_student(job, None)
        objective = Objective(job.objective, tokenizer.special.mask_id)
        phase, stop_fill = job.student_warmup, job.objective.stop_fill
    else:
        tokenizer = job_teacher_tokenizer(job)
        model = Transformer(job.teacher, rngs=nnx.Rngs(job.seed))
        objective, phase, stop_fill = CausalLM(), job.teacher_training, "none"
    trainer = Trainer(model, phase_train_state(model, phase))
    stream = TaskStream(job.data)
    size = stream.batch_size

    def step(index: int) -> float:
        layout = task_layout(
            stream.batch(index * size, size),
            tokenizer,
            horizon=completion_length(job),
            block_size=model.config.block_size,
            stop_fill=stop_fill,
        )
        metrics = trainer.step(layout, batch_keys(0, index, size), index, objective=objective)
        return float(jax.block_until_ready(metrics["loss"]))

    for index in range(args.warmup + 1):
        step(index)
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    losses = [step(index) for index in range(args.warmup + 1, args.warmup + 1 + args.steps)]
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {
        "step_s": seconds / args.steps,
        "faults_per_step": (after.ru_minflt - before.ru_minflt) / args.steps,
        "kernel_share": system / max(user + system, 1e-9),
        "losses": losses,
    }


def measure(args: argparse.Namespace, tuned: bool) -> dict[str, Any]:
    env = {name: value for name, value in os.environ.items() if name != GLIBC_TUNABLES}
    if tuned:
        env = training_environment(env)
    command = [sys.executable, __file__, "--worker", "--phase", args.phase]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    results: dict[str, list[dict[str, Any]]] = {"default": [], "tuned": []}
    for round_index in range(args.rounds):
        for name in ("default", "tuned"):
            results[name].append(measure(args, tuned=name == "tuned"))
            latest = results[name][-1]
            print(
                f"round {round_index + 1} {name:>7}: {latest['step_s'] * 1e3:7.1f} ms/step, "
                f"{latest['faults_per_step']:8.0f} faults/step, "
                f"kernel {latest['kernel_share']:.0%}",
                flush=True,
            )
    # The settings move buffers, not arithmetic: every run trains the same losses, bitwise.
    losses = {json.dumps(run["losses"]) for runs in results.values() for run in runs}
    if len(losses) != 1:
        raise SystemExit("the runs' training losses differ: the settings changed a result")
    medians = {
        name: {key: statistics.median(run[key] for run in runs) for key in TIMED}
        for name, runs in results.items()
    }
    print(f"\n{args.phase} step, {args.steps} timed steps x {args.rounds} rounds (medians):")
    for name, values in medians.items():
        print(
            f"  {name:>7}: {values['step_s'] * 1e3:7.1f} ms/step, "
            f"{values['faults_per_step']:8.0f} faults/step, kernel {values['kernel_share']:.0%}"
        )
    print(f"  training losses of all {2 * args.rounds} processes: equal, bitwise")
    ratio = medians["default"]["step_s"] / medians["tuned"]["step_s"]
    print(f"  default / tuned step time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
