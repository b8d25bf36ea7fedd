"""Training phases of a job, resumable: teacher training and student warm-up.

Each phase owns a run directory (:mod:`distill.checkpoint`): it opens it with its run
contract (refusing a changed setup), resumes from the newest good checkpoint, trains in
segments of ``checkpoint_every`` steps reading the data stream at positions
``[step * batch, (step + 1) * batch)`` (so the saved step is the trained data position and
nothing is skipped or repeated), checkpoints after each segment, and writes an evaluation
report (``eval.json``) at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distill.checkpoint import RunCheckpointer, extend_ledger, read_contract, restored_ledger
from distill.config import JobConfig, ModelConfig, PhaseConfig, StopFill
from distill.cross_tokenizer import CrossTokenizerTeacher
from distill.curves import CURVES_DIR, CurveWriter
from distill.data.stream import TaskStream
from distill.diffusion.objectives import CausalLM, Objective
from distill.evaluate import EvalReport, evaluate_student, evaluate_teacher
from distill.job import (
    JobPlan,
    completion_length,
    job_teacher_tokenizer,
    job_tokenizer,
    phase_contract,
)
from distill.models.planner import trunk_state
from distill.models.transformer import Transformer
from distill.teacher import InProcessTeacher, Teacher, model_hash
from distill.tokenizer import Tokenizer
from distill.train import Trainer, TrainingObjective, fit, make_train_state

Log = Callable[[str], None]


def phase_train_state(model: Transformer, phase: PhaseConfig) -> nnx.Optimizer:
    """The optimizer of a phase (a cosine schedule spans the phase's steps)."""
    return make_train_state(
        model, phase.optimizer, phase.steps if phase.optimizer.schedule == "cosine" else None
    )


def _horizon(job: JobConfig) -> int:
    return completion_length(job)


def _train_phase(
    run_dir: Path,
    contract: dict[str, Any],
    model: Transformer,
    phase: PhaseConfig,
    objective: TrainingObjective,
    job: JobConfig,
    tokenizer: Tokenizer,
    *,
    progress: bool,
    log: Log,
    stop_after: int | None = None,
    stop_fill: StopFill = "none",
) -> list[dict[str, float]]:
    optimizer = phase_train_state(model, phase)
    checkpointer = RunCheckpointer.open(run_dir, contract)
    restored = checkpointer.restore_latest((optimizer, model))
    step = 0 if restored is None else restored.step
    if restored is not None:
        log(
            f"resumed {run_dir} at step {step}"
            + (f" (skipped {restored.skipped})" * bool(restored.skipped))
        )
    stream = TaskStream(job.data)
    ledger = restored_ledger(restored, step * stream.batch_size, run_dir)
    trainer = Trainer(model, optimizer)
    history: list[dict[str, float]] = []
    end = phase.steps if stop_after is None else min(phase.steps, stop_after)
    # Only a phase with steps to run opens a curves file: a finished one is left unchanged.
    curves = CurveWriter(run_dir / CURVES_DIR, resume_step=step) if step < end else None
    try:
        while step < end:
            segment = min(phase.checkpoint_every - step % phase.checkpoint_every, end - step)
            history += fit(
                trainer,
                objective,
                stream,
                tokenizer,
                steps=segment,
                horizon=_horizon(job),
                seed=job.seed,
                start_step=step,
                microbatches=phase.optimizer.microbatches,
                progress=progress,
                on_step=lambda index, metrics: curves.scalars("train", metrics, index + 1),
                stop_fill=stop_fill,
            )
            start, step = step, step + segment
            ledger = extend_ledger(ledger, start * stream.batch_size, step * stream.batch_size)
            checkpointer.save(
                step,
                (optimizer, model),
                {
                    "data_position": step * stream.batch_size,
                    "ledger": ledger,
                    "last": history[-1] if history else {},
                },
            )
    finally:
        if curves is not None:
            curves.close()
        checkpointer.close()
    return history


def _write_report(run_dir: Path, report: EvalReport) -> None:
    (run_dir / "eval.json").write_text(json.dumps(report.to_dict(), indent=2, sort_keys=True))


def train_teacher(
    job: JobConfig,
    run_dir: str | Path,
    *,
    progress: bool = True,
    log: Log = print,
    stop_after: int | None = None,
) -> tuple[Transformer, EvalReport | None]:
    """Train (or resume) the causal teacher with next-token CE; evaluate when complete.
    ``stop_after`` ends early at that step (a checkpoint is still written), for tests."""
    run_dir = Path(run_dir)
    tokenizer = job_teacher_tokenizer(job)
    model = Transformer(job.teacher, rngs=nnx.Rngs(job.seed))
    _train_phase(
        run_dir,
        phase_contract(job, tokenizer, "teacher_training"),
        model,
        job.teacher_training,
        CausalLM(),
        job,
        tokenizer,
        progress=progress,
        log=log,
        stop_after=stop_after,
    )
    if stop_after is not None and stop_after < job.teacher_training.steps:
        return model, None
    examples = TaskStream(job.data, split="eval").batch(0, job.teacher_training.eval_examples)
    report = evaluate_teacher(model, tokenizer, examples, horizon=_horizon(job), seed=job.seed)
    _write_report(run_dir, report)
    log(f"teacher exact match {report.overall:.3f} {report.accuracy}")
    return model, report


def load_teacher_run(job: JobConfig, run_dir: str | Path) -> Transformer:
    """The trained teacher of a finished teacher-training run of this job."""
    tokenizer = job_teacher_tokenizer(job)
    model = Transformer(job.teacher, rngs=nnx.Rngs(job.seed))
    optimizer = phase_train_state(model, job.teacher_training)
    checkpointer = RunCheckpointer.open(run_dir, phase_contract(job, tokenizer, "teacher_training"))
    restored = checkpointer.restore_latest((optimizer, model))
    checkpointer.close()
    if restored is None or restored.step < job.teacher_training.steps:
        raise ValueError(
            f"`teacher_run` must hold a finished teacher ({job.teacher_training.steps} steps); "
            f"{run_dir} has {None if restored is None else restored.step}"
        )
    return model


def in_process_teacher(job: JobConfig, model: Transformer) -> Teacher:
    """The job's teacher in this process: ``model`` with the teacher's tokenizer, wrapped to
    score text (:class:`~distill.cross_tokenizer.CrossTokenizerTeacher`) when the job sets
    ``teacher_tokenizer``."""
    tokenizer = job_teacher_tokenizer(job)
    teacher = InProcessTeacher(model, tokenizer)
    if job.teacher_tokenizer is None:
        return teacher
    return CrossTokenizerTeacher(teacher, tokenizer)


def load_student_run(
    job: JobConfig,
    run_dir: str | Path,
    *,
    teacher: Transformer | None = None,
    log: Log = print,
) -> Transformer:
    """The warmed-up student of a finished student warm-up run of this job (``teacher`` is
    needed when ``student_init`` is 'teacher': the run's contract names its hash).

    The run may differ from the job in the planner head alone (``student.planner_hidden``;
    the warm-up objectives never read the head, so a warm-up serves any commit rule): the
    trunk is restored bitwise, and a head the job asks for and the run lacks (or has at
    another width) starts at its initialization (zero output: commit probability 1/2),
    while a head the job does not use is dropped. Either is logged through ``log``. Every
    other contract field must match (:class:`~distill.checkpoint.ContractMismatch`)."""
    tokenizer = job_tokenizer(job)
    saved = read_contract(run_dir)
    # The contract leaves planner_hidden out when there is no head (job.LATER_FIELDS).
    saved_width = (
        job.student.planner_hidden
        if saved is None
        else saved.get("student", {}).get("planner_hidden")
    )
    warmed_up = job.model_copy(
        update={
            "student": ModelConfig.model_validate(
                job.student.model_dump() | {"planner_hidden": saved_width}
            )
        }
    )
    model = Transformer(warmed_up.student, rngs=nnx.Rngs(job.seed + 1))
    optimizer = phase_train_state(model, job.student_warmup)
    teacher_hash = None
    if job.student_init == "teacher":
        if teacher is None:
            raise ValueError("`teacher` must be given when student_init is 'teacher'")
        teacher_hash = model_hash(teacher)
    contract = phase_contract(warmed_up, tokenizer, "student_warmup", teacher_hash=teacher_hash)
    checkpointer = RunCheckpointer.open(run_dir, contract)
    restored = checkpointer.restore_latest((optimizer, model))
    checkpointer.close()
    if restored is None or restored.step < job.student_warmup.steps:
        raise ValueError(
            f"`student_run` must hold a finished warm-up ({job.student_warmup.steps} steps); "
            f"{run_dir} has {None if restored is None else restored.step}"
        )
    wanted_width = job.student.planner_hidden
    if saved_width == wanted_width:
        return model
    # A fresh student of the job's config holds exactly the head a warm-up with it would
    # have started from (the head is created last, from its own stream); the trunk is the run's.
    student = Transformer(job.student, rngs=nnx.Rngs(job.seed + 1))
    nnx.update(student, trunk_state(model))
    if wanted_width is None:
        log(
            f"dropped the planner head (width {saved_width}) of warm-up run {run_dir}: "
            f"commit_rule {job.rollout.commit_rule!r} does not use it; trunk restored"
        )
    else:
        found = "has none" if saved_width is None else f"has width {saved_width}"
        log(
            f"initialized a fresh planner head (width {wanted_width}, commit probability "
            f"1/2) on the trunk of warm-up run {run_dir}, which {found}"
        )
    return student


def init_student(job: JobConfig, teacher: Transformer | None) -> Transformer:
    """A fresh student, or (``student_init: teacher``) one holding the teacher's weights."""
    student = Transformer(job.student, rngs=nnx.Rngs(job.seed + 1))
    if job.student_init == "teacher":
        if teacher is None:
            raise ValueError("`teacher` must be given when student_init is 'teacher'")
        # Copies, not shared buffers: training donates the student's buffers.
        nnx.update(student, jax.tree.map(jnp.copy, nnx.state(teacher, nnx.Param)))
    return student


def warmup_student(
    job: JobConfig,
    run_dir: str | Path,
    *,
    teacher: Transformer | None = None,
    progress: bool = True,
    log: Log = print,
    stop_after: int | None = None,
) -> tuple[Transformer, EvalReport | None]:
    """Warm up (or resume) the block-diffusion student with ``job.objective``."""
    run_dir = Path(run_dir)
    tokenizer = job_tokenizer(job)
    model = init_student(job, teacher)
    objective = Objective(job.objective, tokenizer.special.mask_id)
    teacher_hash = model_hash(teacher) if job.student_init == "teacher" else None
    _train_phase(
        run_dir,
        phase_contract(job, tokenizer, "student_warmup", teacher_hash=teacher_hash),
        model,
        job.student_warmup,
        objective,
        job,
        tokenizer,
        progress=progress,
        log=log,
        stop_after=stop_after,
        stop_fill=job.objective.stop_fill,
    )
    if stop_after is not None and stop_after < job.student_warmup.steps:
        return model, None
    report = evaluate_student_job(job, model, tokenizer, job.student_warmup.eval_examples)
    _write_report(run_dir, report)
    log(
        f"student exact match {report.overall:.3f} at {report.tokens_per_forward:.2f} "
        f"tokens/forward {report.accuracy}"
    )
    return model, report


def evaluate_student_job(
    job: JobConfig, model: Transformer, tokenizer: Tokenizer, count: int
) -> EvalReport:
    settings = JobPlan(job, tokenizer).settings
    examples = TaskStream(job.data, split="eval").batch(0, count)
    return evaluate_student(model, tokenizer, examples, settings, seed=job.seed)
