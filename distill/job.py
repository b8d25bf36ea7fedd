"""What a job needs, derived once from its config: tokenizer, rollout settings, phase
contracts and the typed progress record of a resumable phase.

Everything here except :meth:`JobPlan.settings` (which builds the JAX-side
:class:`~distill.diffusion.denoise.SamplingSettings`) is importable without JAX, so a driver
or client process can derive a job's tokenizer and contract without loading it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from distill.config import JobConfig, PhaseConfig
from distill.data.stream import TaskStream
from distill.data.tasks import answer_horizon
from distill.tokenizer import Tokenizer, TokenizerError, tokenizer_from_spec

if TYPE_CHECKING:
    from distill.diffusion.denoise import SamplingSettings

PHASES = ("teacher_training", "student_warmup", "opd")


def job_tokenizer(job: JobConfig) -> Tokenizer:
    """The job's (the student's) tokenizer; its vocabulary must match the student's, and the
    teacher's too unless the job sets ``teacher_tokenizer``."""
    tokenizer = tokenizer_from_spec(job.tokenizer)
    roles = ("student",) if job.teacher_tokenizer is not None else ("teacher", "student")
    for role in roles:
        size = getattr(job, role).vocab_size
        if role == "teacher" and job.mask_appended:
            # The teacher has one row fewer: the student's appended mask token.
            if size != tokenizer.vocab_size - 1:
                raise ValueError(
                    f"`teacher.vocab_size` must equal the tokenizer's {tokenizer.vocab_size} "
                    f"- 1 (mask_appended); received {size}"
                )
        elif size != tokenizer.vocab_size:
            raise ValueError(
                f"`{role}.vocab_size` must equal the tokenizer's {tokenizer.vocab_size}; "
                f"received {size}"
            )
    return tokenizer


def job_teacher_tokenizer(job: JobConfig) -> Tokenizer:
    """The teacher's tokenizer: ``teacher_tokenizer`` when set (errors name
    `teacher_tokenizer.<key>`), else the job's; its vocabulary must match the teacher's
    (or be one larger, when it appended a mask token the model does not have)."""
    if job.teacher_tokenizer is None:
        return job_tokenizer(job)
    try:
        tokenizer = tokenizer_from_spec(job.teacher_tokenizer)
    except TokenizerError as error:
        message = str(error)
        if message.startswith("`tokenizer"):
            raise TokenizerError(f"`teacher_{message[1:]}") from error
        raise
    size, mask = job.teacher.vocab_size, tokenizer.special.mask_id
    if size != tokenizer.vocab_size and not (tokenizer.vocab_size == size + 1 == mask + 1):
        raise ValueError(
            f"`teacher.vocab_size` must equal the teacher tokenizer's {tokenizer.vocab_size}; "
            f"received {size}"
        )
    return tokenizer


def completion_length(job: JobConfig) -> int:
    """The rollout horizon: ``rollout.max_completion_length``, or (unset) the longest answer
    the job's tasks can have."""
    configured = job.rollout.max_completion_length
    return (
        configured
        if configured is not None
        else answer_horizon(job.data.tasks, job.data.max_length)
    )


def _phase(config: PhaseConfig) -> dict[str, Any]:
    # eval size and checkpoint cadence do not change what is trained
    return {"steps": config.steps, "optimizer": config.optimizer.model_dump()}


#: Config fields added after runs were first saved, with the value that means "not used":
#: at that value a field is left out of the contract, so a run saved before it existed still
#: resumes (its contract lacks the field); set to anything else it is recorded and must match.
LATER_FIELDS: Mapping[tuple[str, str], Any] = MappingProxyType(
    {
        ("teacher", "planner_hidden"): None,
        ("student", "planner_hidden"): None,
        ("loss", "forward_cost"): 0.0,
        # `none` is the warm-up layout from before the field existed; the default (`block`)
        # trains other rows, so a warm-up saved before it is refused unless `none` is asked.
        ("objective", "stop_fill"): "none",
    }
)


def _dump(section: str, config: BaseModel) -> dict[str, Any]:
    """``config.model_dump()`` without the :data:`LATER_FIELDS` of ``section`` at their
    not-used value."""
    dumped = config.model_dump()
    for (where, field), unused in LATER_FIELDS.items():
        if where == section and field in dumped and dumped[field] == unused:
            del dumped[field]
    return dumped


def phase_contract(
    job: JobConfig,
    tokenizer: Tokenizer,
    phase: str,
    *,
    teacher_hash: str | None = None,
    student_hash: str | None = None,
    phase_config: PhaseConfig | None = None,
    topology: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything a resumed phase must share with the run it resumes: for a student
    initialized from the teacher, the teacher's parameter hash; for OPD, the teacher's
    model hash (as its scoring server reports it) and the hash of the student it started
    from, plus the rollout and loss configs. ``phase_config`` overrides the job's config of
    that phase (a caller training with another one); ``topology`` defaults to this process's
    (:func:`distill.checkpoint.topology`, which loads JAX)."""
    if phase not in PHASES:
        raise ValueError(f"`phase` must be one of {PHASES}; received {phase!r}")
    if topology is None:
        from distill.checkpoint import topology as current_topology

        topology = current_topology()
    contract: dict[str, Any] = {
        "phase": phase,
        "tokenizer_hash": tokenizer.content_hash(),
        "special_ids": {
            "pad": tokenizer.special.pad_id,
            "mask": tokenizer.special.mask_id,
            "bos": tokenizer.special.bos_id,
            "stop": list(tokenizer.special.stop_ids),
        },
        "data": TaskStream(job.data).stream_spec(),
        "seed": job.seed,
        "topology": topology,
    }
    if phase == "teacher_training":
        contract |= {
            "teacher": _dump("teacher", job.teacher),
            "training": _phase(phase_config or job.teacher_training),
        }
    elif phase == "student_warmup":
        contract |= {
            "student": _dump("student", job.student),
            "student_init": job.student_init,
            "teacher_hash": teacher_hash,
            "objective": _dump("objective", job.objective),
            "training": _phase(phase_config or job.student_warmup),
        }
    else:
        contract |= {
            "student": _dump("student", job.student),
            "teacher": _dump("teacher", job.teacher),
            "teacher_hash": teacher_hash,
            "student_start_hash": student_hash,
            "rollout": job.rollout.model_dump() | {"completion_length": completion_length(job)},
            "loss": _dump("loss", job.loss),
            "training": _phase(phase_config or job.opd),
            # The run's saved evaluations are one curve: resuming must not change its set.
            "eval_examples": (phase_config or job.opd).eval_examples,
        }
        if job.teacher_tokenizer is not None:
            contract["teacher_tokenizer"] = dict(job.teacher_tokenizer)
    return contract


@dataclasses.dataclass(frozen=True)
class Progress:
    """The progress record saved with every checkpoint of a phase.

    ``step``: updates applied; ``data_position``: stream position of the trained data (the
    first untrained prompt); ``ledger``: ``[start, end)`` stream ranges trained by this
    state's lineage; ``policy_version``: the version of the saved parameters (= ``step``);
    ``evaluations``: ``(step, report dict)`` pairs; ``last``: the last step's metrics;
    ``start_teacher_logp``: OPD only, the teacher's per-token log-prob of the first step's
    rollouts (the start the regression guard compares with; ``None`` before that step)."""

    step: int
    data_position: int
    ledger: tuple[tuple[int, int], ...] = ()
    policy_version: int = 0
    evaluations: tuple[tuple[int, dict[str, Any]], ...] = ()
    last: dict[str, float] = dataclasses.field(default_factory=dict)
    start_teacher_logp: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data_position": self.data_position,
            "ledger": [list(entry) for entry in self.ledger],
            "policy_version": self.policy_version,
            "evaluations": [{"step": at, "report": report} for at, report in self.evaluations],
            "last": dict(self.last),
            "start_teacher_logp": self.start_teacher_logp,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Progress:
        return cls(
            step=int(record["step"]),
            data_position=int(record.get("data_position", 0)),
            ledger=tuple((int(a), int(b)) for a, b in record.get("ledger", [])),
            policy_version=int(record.get("policy_version", record["step"])),
            evaluations=tuple(
                (int(entry["step"]), dict(entry["report"]))
                for entry in record.get("evaluations", [])
            ),
            last=dict(record.get("last", {})),
            start_teacher_logp=(
                None
                if record.get("start_teacher_logp") is None
                else float(record["start_teacher_logp"])
            ),
        )


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """A validated job and what every process derives from it, built once."""

    job: JobConfig
    tokenizer: Tokenizer

    @classmethod
    def from_job(cls, job: JobConfig) -> JobPlan:
        return cls(job, job_tokenizer(job))

    @property
    def completion_length(self) -> int:
        return completion_length(self.job)

    @property
    def prompts_per_step(self) -> int:
        return self.job.data.batch_size

    @property
    def rows_per_step(self) -> int:
        """Rollout rows per OPD step: prompts x ``loss.group_size`` rollouts each."""
        return self.job.data.batch_size * self.job.loss.group_size

    @functools.cached_property
    def settings(self) -> SamplingSettings:
        """The rollout's sampling settings (completion horizon filled in); loads JAX."""
        from distill.diffusion.denoise import SamplingSettings

        rollout = self.job.rollout.model_copy(
            update={"max_completion_length": self.completion_length}
        )
        return SamplingSettings.from_config(rollout, self.tokenizer.special)

    def with_threshold(self, threshold: float) -> SamplingSettings:
        """The rollout settings at another commit threshold (evaluation sweeps)."""
        return dataclasses.replace(self.settings, threshold=threshold)

    def contract(self, phase: str, **kwargs: Any) -> dict[str, Any]:
        return phase_contract(self.job, self.tokenizer, phase, **kwargs)
