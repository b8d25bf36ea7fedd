"""The OPD learner: one object that owns the student, its optimizer, the run contract, the
data ledger and the evaluations, and trains on rollout batches step by step.

:class:`OpdLearner` is what both runtimes share. The in-process loop (:func:`run_opd`) rolls
out with the learner's own student and calls :meth:`OpdLearner.train`; the distributed
runtime's learner service calls the same method with batches that rollout workers sent over
the network (``services/learner``). Each :meth:`~OpdLearner.train` call:

1. checks the batch: its step is the learner's next step, its rows are exactly that step's
   rows, it was made under the learner's sampling settings and block size, it passes the
   library's trace validation, and it is at most ``loss.max_staleness`` policy versions old
   (:class:`StaleRollout` otherwise: the caller regenerates it);
2. prepares it (teacher scores at learner time) and runs the jitted update;
3. stops the job with :class:`NonFiniteError` (naming the step and metric) when the loss,
   the importance ratio or the gradient norm is not finite, and with
   :class:`~distill.opd.guard.PolicyRegression` when the job's ``guard`` sees the teacher's
   log-prob of the rollouts fall too far (:mod:`distill.opd.guard`), before anything is saved;
4. extends the ledger, evaluates and checkpoints on the phase's cadence.

Rollouts are a pure function of (student parameters, seed, step, row): a rollout in flight
when a run stops is regenerated identically on resume, so nothing is skipped or trained
twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tqdm
from flax import nnx

from distill.checkpoint import RunCheckpointer, extend_ledger, restored_ledger
from distill.config import JobConfig, PhaseConfig
from distill.cross_tokenizer import check_cross_tokenizer_loss
from distill.curves import CURVES_DIR, CurveWriter
from distill.data.stream import TaskStream, encode_example
from distill.data.tasks import Example
from distill.diffusion.denoise import SamplingSettings, rollout
from distill.evaluate import EvalReport, evaluate_student
from distill.job import JobPlan, Progress
from distill.losses import OpdLoss
from distill.models.transformer import Transformer
from distill.opd.batch import prepare_batch, task_rewards, teacher_top_k
from distill.opd.guard import TeacherLogpGuard
from distill.opd.planner_loss import JointLoss
from distill.opd.records import RolloutBatch, merge_batches, save_batch
from distill.opd.update import frozen_copy, opd_update
from distill.pipeline import phase_train_state
from distill.teacher import CompatibilityError, Teacher, check_compatible, model_hash
from distill.tokenizer import Tokenizer

Log = Callable[[str], None]

#: Metrics that must be finite after every update, or the job stops.
FINITE_METRICS = ("loss", "grad_norm", "ratio")


class StaleRollout(ValueError):
    """A rollout older than ``loss.max_staleness`` policy versions: dropped, to regenerate."""


class NonFiniteError(FloatingPointError):
    """An update produced a non-finite loss, ratio or gradient norm: the job stops."""


def rollout_settings(job: JobConfig, tokenizer: Tokenizer) -> SamplingSettings:
    """The job's rollout settings (completion horizon from the config or its tasks)."""
    return JobPlan(job, tokenizer).settings


def student_weights(student: Transformer) -> dict[str, Any]:
    """The student's parameters as a nested dict of numpy arrays (host copies): what a
    learner publishes to rollout workers as one policy version."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(student, nnx.Param)))


def load_weights(student: Transformer, weights: dict[str, Any]) -> None:
    """Set ``student``'s parameters from :func:`student_weights` output (bitwise)."""
    state = nnx.state(student, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(np.asarray, weights))
    nnx.update(student, state)


class OpdLearner:
    """OPD training state of one run (see module docstring).

    ``teacher`` must be compatible with the student (vocabulary, special ids, tokenizer
    hash; checked here), or, when the job sets ``teacher_tokenizer`` and the teacher's
    tokenizer hash differs from the student's, score text (a
    :class:`~distill.cross_tokenizer.TextTeacher`): each row is then detokenized, scored as
    text and mapped back by byte offsets; rows that cannot be are refused (weight 0) and
    counted in the ``refused_rows`` metric (and ``invalid_rows``). With ``run_dir`` the phase is resumable: the run contract holds the
    student's starting hash and the teacher's model hash besides the job's configs, and a
    learner on an existing run continues from its newest good checkpoint (:attr:`step`).
    ``reference`` defaults to a frozen copy of the starting student (used when
    ``loss.kl_reference_weight > 0``).
    """

    def __init__(
        self,
        job: JobConfig,
        student: Transformer,
        teacher: Teacher,
        tokenizer: Tokenizer,
        *,
        phase: PhaseConfig | None = None,
        run_dir: str | Path | None = None,
        reference: Transformer | None = None,
        eval_every: int | None = None,
        trace_dir: str | Path | None = None,
        log: Log = print,
    ):
        self.job, self.student, self.teacher, self.tokenizer = job, student, teacher, tokenizer
        self.phase = job.opd if phase is None else phase
        self.plan = JobPlan(job, tokenizer)
        self.eval_every = eval_every
        self.trace_dir = None if trace_dir is None else Path(trace_dir)
        self.log = log
        info = teacher.info()
        cross_ok = job.teacher_tokenizer is not None
        check_compatible(info, tokenizer, student.config.vocab_size, cross_tokenizer_ok=cross_ok)
        self.loss = (
            JointLoss.from_config(job.loss)
            if job.rollout.commit_rule == "planner"
            else OpdLoss.from_config(job.loss)
        )
        #: The teacher has another tokenizer: it scores text (see distill/cross_tokenizer.py).
        self.cross_tokenizer = cross_ok and info.tokenizer_hash != tokenizer.content_hash()
        if self.cross_tokenizer:
            check_cross_tokenizer_loss(job.loss.kind, job.loss.advantage, job.loss.teacher_top_k)
            if not callable(getattr(teacher, "score_text", None)):
                raise CompatibilityError(
                    "`teacher` must score text (a TextTeacher, e.g. "
                    "distill.cross_tokenizer.CrossTokenizerTeacher) when its tokenizer differs "
                    f"from the student's; received {type(teacher).__name__}"
                )
        self.top_k = None if self.cross_tokenizer else teacher_top_k(self.loss, info)
        self.settings = self.plan.settings
        if reference is None and self.loss.kl_reference_weight > 0:
            reference = frozen_copy(student)
        self.reference = reference
        self.stream = TaskStream(job.data)
        self.evaluation = TaskStream(job.data, split="eval").batch(0, self.phase.eval_examples)
        self.optimizer = phase_train_state(student, self.phase)
        self.checkpointer: RunCheckpointer | None = None
        self.step = 0
        self.ledger: list[list[int]] = []
        self.reports: list[tuple[int, EvalReport]] = []
        self.dropped_stale = 0
        start_teacher_logp = None
        if run_dir is not None:
            contract = self.plan.contract(
                "opd",
                teacher_hash=info.model_hash,
                student_hash=model_hash(student),
                phase_config=self.phase,
            )
            self.checkpointer = RunCheckpointer.open(run_dir, contract)
            restored = self.checkpointer.restore_latest((self.optimizer, student))
            if restored is not None:
                progress = Progress.from_dict(restored.progress)
                self.step = restored.step
                log(f"resumed {run_dir} at step {self.step}")
                self.reports = [(at, EvalReport(**report)) for at, report in progress.evaluations]
                start_teacher_logp = progress.start_teacher_logp
            self.ledger = restored_ledger(
                restored, self.step * self.plan.prompts_per_step, Path(run_dir)
            )
        self.guard = TeacherLogpGuard(job.guard, start_teacher_logp)

    # ---- what a step trains on ---------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version of the live parameters: the number of updates applied."""
        return self.step

    def step_examples(self, step: int) -> list[Example]:
        """The examples of ``step``'s rows (each prompt ``group_size`` times, in row order)."""
        prompts = self.plan.prompts_per_step
        examples = self.stream.batch(step * prompts, prompts)
        return [example for example in examples for _ in range(self.job.loss.group_size)]

    def stream_positions(self, step: int) -> list[int]:
        """The data stream position of each of ``step``'s rows."""
        group = self.job.loss.group_size
        return [
            step * self.plan.prompts_per_step + row // group
            for row in range(self.plan.rows_per_step)
        ]

    def prompts(self, step: int, row_ids: Sequence[int] | None = None) -> list[list[int]]:
        """Encoded prompts of ``step``'s rows (all, or ``row_ids``)."""
        examples = self.step_examples(step)
        rows = range(len(examples)) if row_ids is None else row_ids
        return [encode_example(examples[row], self.tokenizer)[0] for row in rows]

    def roll_out(self, row_ids: Sequence[int] | None = None) -> RolloutBatch:
        """The next step's rollout (all rows, or ``row_ids``) with the live student: what
        the in-process loop trains on. Each row's randomness is a function of (seed, step,
        row), so a resumed run regenerates it exactly."""
        step = self.step
        rows = list(range(self.plan.rows_per_step)) if row_ids is None else list(row_ids)
        trace = rollout(
            self.student,
            self.prompts(step, rows),
            self.settings,
            seed=self.job.seed,
            global_step=step,
            row_ids=rows,
        )
        positions = self.stream_positions(step)
        return RolloutBatch.from_trace(
            trace,
            step=step,
            policy_version=self.policy_version,
            row_ids=rows,
            stream_positions=[positions[row] for row in rows],
        )

    # ---- training ------------------------------------------------------------------------

    def check_rows(self, batch: RolloutBatch) -> None:
        """Refuse rows that are not rows of their step (ids, stream positions) under this
        learner's sampling settings and block size, or that break the replay contract
        (:class:`~distill.diffusion.replay.TraceError`, naming the field). Staleness and the
        step's completeness are checked when it trains (:meth:`check_batch`)."""
        rows = self.plan.rows_per_step
        row_ids = np.asarray(batch.row_ids)
        if (row_ids >= rows).any():
            raise ValueError(
                f"`trace.row_ids` must be in [0, {rows}) (rows of one step); received "
                f"{row_ids.tolist()}"
            )
        positions = np.asarray(self.stream_positions(batch.step))[row_ids]
        if not np.array_equal(batch.stream_positions, positions):
            raise ValueError(
                f"`trace.stream_positions` must be {positions.tolist()} for rows "
                f"{row_ids.tolist()} of step {batch.step}; received "
                f"{np.asarray(batch.stream_positions).tolist()}"
            )
        batch.check_matches(
            self.settings, self.student.config.block_size, self.student.config.vocab_size
        )

    def check_batch(self, batch: RolloutBatch, *, rows_checked: bool = False) -> None:
        """Refuse a batch that is not exactly the next step's rows (see :meth:`check_rows`,
        skipped when its rows were already checked, e.g. as they arrived), or one beyond
        ``loss.max_staleness`` (:class:`StaleRollout`)."""
        if batch.step != self.step:
            raise ValueError(
                f"`trace.step` must be the learner's next step {self.step}; received {batch.step}"
            )
        if not np.array_equal(np.sort(batch.row_ids), np.arange(self.plan.rows_per_step)):
            raise ValueError(
                f"`trace.row_ids` must be exactly rows 0..{self.plan.rows_per_step - 1} of the "
                f"step; received {np.sort(batch.row_ids).tolist()}"
            )
        self.check_staleness(batch.policy_version)
        if not rows_checked:
            self.check_rows(batch)

    def check_staleness(self, policy_version: int) -> None:
        if policy_version > self.policy_version:
            raise ValueError(
                f"`trace.policy_version` must be <= the learner's {self.policy_version}; "
                f"received {policy_version}"
            )
        staleness = self.policy_version - policy_version
        if staleness > self.job.loss.max_staleness:
            raise StaleRollout(
                f"`trace.policy_version` must be within loss.max_staleness="
                f"{self.job.loss.max_staleness} of the learner's {self.policy_version}; "
                f"received {policy_version} ({staleness} versions old)"
            )

    def train(
        self, batch: RolloutBatch | Sequence[RolloutBatch], *, rows_checked: bool = False
    ) -> dict[str, float]:
        """One OPD step on the next step's rollout (one batch or its parts); returns metrics.
        ``rows_checked``: every part already passed :meth:`check_rows`."""
        if not isinstance(batch, RolloutBatch):
            batch = merge_batches(batch)
        self.check_batch(batch, rows_checked=rows_checked)
        step, trace = self.step, batch.to_trace()
        if self.trace_dir is not None:
            save_batch(batch, self.trace_dir / f"step-{step:07d}.npz")
        examples = self.step_examples(step)
        rewards = group_ids = None
        if self.loss.task_reward_weight > 0:
            rewards = task_rewards(examples, trace, self.tokenizer)
            group_ids = [row // self.job.loss.group_size for row in range(len(examples))]
        prepared = prepare_batch(
            trace,
            self.teacher,
            self.tokenizer,
            policy_version=batch.policy_version,
            top_k=self.top_k,
            rewards=rewards,
            group_ids=group_ids,
            cross_tokenizer=self.cross_tokenizer,
        )
        metrics = opd_update(
            self.optimizer,
            self.student,
            prepared,
            self.loss,
            reference=self.reference,
            microbatches=self.phase.optimizer.microbatches,
        )
        for name in FINITE_METRICS:
            if name in metrics and not math.isfinite(metrics[name]):
                raise NonFiniteError(
                    f"`metrics.{name}` must be finite; received {metrics[name]} at step {step} "
                    "(the job stops before saving this update)"
                )
        self.guard.observe(step, metrics["teacher_logp"])
        if prepared.refused_rows is not None:
            metrics["refused_rows"] = float(np.asarray(prepared.refused_rows).sum())
        metrics["tokens_per_forward"] = trace.tokens_per_forward()
        metrics["completion_tokens"] = float(np.asarray(batch.slots["completion_mask"]).sum())
        metrics["cut_without_stop"] = float(1.0 - trace.stopped().mean())
        metrics["staleness"] = float(step - batch.policy_version)
        prompts = self.plan.prompts_per_step
        self.ledger = extend_ledger(self.ledger, step * prompts, (step + 1) * prompts)
        self.step = done = step + 1
        if (self.eval_every and done % self.eval_every == 0 and done < self.phase.steps) or (
            done == self.phase.steps
        ):
            self.evaluate()
        if done % self.phase.checkpoint_every == 0 or done == self.phase.steps:
            self.save(metrics)
        return metrics

    def evaluate(self) -> EvalReport:
        """Evaluate the live student (temperature 1, the job's rollout settings)."""
        report = evaluate_student(
            self.student, self.tokenizer, self.evaluation, self.settings, seed=self.job.seed
        )
        self.log(
            f"step {self.step}: exact match {report.overall:.3f} {report.accuracy} at "
            f"{report.tokens_per_forward:.2f} tokens/forward; agree entropy "
            f"{report.agree_entropy_bits}"
        )
        self.reports.append((self.step, report))
        return report

    def progress(self, last: dict[str, float] | None = None) -> Progress:
        return Progress(
            step=self.step,
            data_position=self.step * self.plan.prompts_per_step,
            ledger=tuple((a, b) for a, b in self.ledger),
            policy_version=self.policy_version,
            evaluations=tuple((at, report.to_dict()) for at, report in self.reports),
            last=dict(last or {}),
            start_teacher_logp=self.guard.start,
        )

    def save(self, last: dict[str, float] | None = None) -> None:
        """Checkpoint the live state (a no-op without a run directory)."""
        if self.checkpointer is not None:
            self.checkpointer.save(
                self.step, (self.optimizer, self.student), self.progress(last).to_dict()
            )

    def weights(self) -> dict[str, Any]:
        """The live parameters as numpy (one policy version; see :func:`student_weights`)."""
        return student_weights(self.student)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None


def run_opd(
    job: JobConfig,
    student: Transformer,
    teacher: Teacher,
    tokenizer: Tokenizer,
    *,
    phase: PhaseConfig | None = None,
    run_dir: str | Path | None = None,
    reference: Transformer | None = None,
    eval_every: int | None = None,
    stop_after: int | None = None,
    trace_dir: str | Path | None = None,
    progress: bool = True,
    log: Log = print,
) -> tuple[list[dict[str, float]], list[tuple[int, EvalReport]]]:
    """OPD in one process for ``phase.steps`` steps (default ``job.opd``) on ``student`` (in
    place): each step rolls out with the live student (strictly on-policy) and trains on it.

    Returns the per-step metrics of the steps run by this call and ``(step, report)``
    evaluations (before training, every ``eval_every`` steps, at the end; a resumed run
    returns the earlier ones too). With ``run_dir``, the per-step metrics and evaluations are
    also written as TensorBoard curves under ``run_dir/tensorboard`` (``opd/*``, ``eval/*``). ``stop_after`` ends early at that step with a checkpoint
    (for tests). ``trace_dir``: keep every trained rollout there (one ``.npz`` per step).
    """
    learner = OpdLearner(
        job,
        student,
        teacher,
        tokenizer,
        phase=phase,
        run_dir=run_dir,
        reference=reference,
        eval_every=eval_every,
        trace_dir=trace_dir,
        log=log,
    )
    end = learner.phase.steps if stop_after is None else min(learner.phase.steps, stop_after)
    # Only a run with steps to train opens a curves file: a finished one is left unchanged.
    curves = (
        CurveWriter(Path(run_dir) / CURVES_DIR, resume_step=learner.step)
        if run_dir is not None and learner.step < end
        else None
    )
    try:
        if learner.step == 0:
            learner.evaluate()
        history: list[dict[str, float]] = []
        for _ in tqdm.trange(learner.step, end, disable=not progress, desc="opd", unit="step"):
            history.append(learner.train(learner.roll_out()))
            if curves is not None:
                curves.scalars("opd", history[-1], learner.step)
                curves.evaluations(learner.reports)
        if curves is not None:
            curves.evaluations(learner.reports)
        if (
            history
            and learner.step % learner.phase.checkpoint_every
            and learner.step != learner.phase.steps
        ):
            learner.save(history[-1])
        return history, learner.reports
    finally:
        if curves is not None:
            curves.close()
        learner.close()
