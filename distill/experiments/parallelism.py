"""Accuracy vs parallelism: warm-up objectives alone and followed by OPD losses, per task.

Command (resumable: rerun the same command after an interruption; a progress bar counts the
cells)::

    python -m distill.experiments.parallelism --run-dir runs/parallelism \\
        --tasks agree16 --objectives mdlm --losses none reverse_kl+mean_to_go --seeds 0 1 2

A *cell* is (task spec, warm-up objective, OPD loss variant, seed). Each cell runs the
in-process pipeline: the causal teacher (:func:`distill.pipeline.train_teacher`), the
block-diffusion warm-up with the objective (:func:`distill.pipeline.warmup_student`), then,
unless the variant is ``none``, OPD (:func:`distill.opd.run_opd`) from the warmed-up student.
Teachers are shared by the cells of one (task, seed), warm-ups by those of one (task,
objective, seed); every phase keeps its checkpoints under the run directory and resumes from
them. The trained student is then evaluated at temperature 1 on the eval split:

* the ``schedule`` rule at each of ``--ks`` tokens per forward (most confident first; see
  :func:`distill.evaluate.at_parallelism`): tokens per forward is *measured*, and falls below
  the nominal value where a completion starts or ends inside a block;
* the adaptive ``threshold`` rule at each of ``--thresholds``;
* the commit rule the variant trained with, when it is neither of those (the extension point
  of a learned commit policy: register a :class:`LossVariant` whose overrides set its
  ``rollout.commit_rule``, and its own rule is evaluated as one more point).

Each finished cell is one JSON file, ``cells/<task>__<objective>__<loss>__seed<seed>.json``
(written atomically; a rerun reuses it). ``report.md`` then gives, per task, the teacher and
every (objective, loss) row: exact match at each point (mean and standard deviation over
seeds, with the measured tokens per forward), the free-letter entropy and distinct fraction,
and the AUP (:func:`distill.evaluate.aup`) of the schedule curve, of the threshold sweep and
of both; ``plot-<task>.png`` draws the curves. The AUP's ``y_max`` is the best accuracy any
point of that task reached (teacher included), in percent.

A run directory belongs to one setting of the step counts and evaluation sizes:
``experiment.json`` holds it, and a rerun with another value is refused naming the fields
(the grid axes, ``--tasks`` ``--objectives`` ``--losses`` ``--seeds``, may change: new cells
are added next to the old ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

from distill.experiments.run_dir import (
    ExperimentError,
    check_run_dir,
    read_json,
    write_json,
)
from distill.experiments.run_dir import error as _error

__all__ = [
    "LOSS_VARIANTS",
    "OBJECTIVES",
    "TASK_SPECS",
    "ExperimentConfig",
    "ExperimentError",
    "LossVariant",
    "TaskSpec",
    "cell_job",
    "check_overrides",
    "main",
    "override_argument",
    "register_loss_variant",
    "report",
    "run",
]

FORMAT = "distill.experiments.parallelism/v1"
ROOT = Path(__file__).resolve().parents[2]

Log = Callable[[str], None]


# ---- the grid's axes -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A task stream: a job config of ``deploy/configs/`` plus dotted overrides."""

    name: str
    config: str
    overrides: tuple[str, ...] = ()


def _long(task: str) -> TaskSpec:
    return TaskSpec(task, "deploy/configs/long-tasks.yaml", (f"data.tasks=[{task}]",))


#: Task specs by name: the demo's ``agree`` (3-6 letters), ``agree`` at 16 letters, each
#: deterministic task at 16-32 tokens, and their mixture.
TASK_SPECS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("agree", "deploy/configs/agree.yaml", ("rollout.threshold=0.9",)),
        TaskSpec("agree16", "deploy/configs/agree16.yaml"),
        _long("copy"),
        _long("reverse"),
        _long("sort"),
        _long("addition"),
        _long("addition_lsb"),
        TaskSpec("long-mix", "deploy/configs/long-tasks.yaml"),
    )
}


def _objectives() -> tuple[str, ...]:
    from distill.config import ObjectiveKind

    # block_ce is the plain block-diffusion CE, not one of the research note's warm-ups.
    return tuple(kind for kind in get_args(ObjectiveKind) if kind != "block_ce")


#: The warm-up objectives compared (``objective.kind`` values).
OBJECTIVES: tuple[str, ...] = _objectives()


@dataclasses.dataclass(frozen=True)
class LossVariant:
    """An OPD recipe: dotted job overrides applied on top of the task's job (``loss.*``, and
    ``rollout.*`` for a variant that rolls out with its own commit rule). ``opd=False``: the
    warm-up alone, no OPD."""

    name: str
    overrides: tuple[str, ...] = ()
    opd: bool = True


#: OPD loss variants by name. A new recipe is one more entry, added with
#: :func:`register_loss_variant`; a commit rule of its own (e.g. ``planner``) is then
#: evaluated as an extra point.
LOSS_VARIANTS: dict[str, LossVariant] = {}


def register_loss_variant(variant: LossVariant) -> LossVariant:
    """Add ``variant`` to :data:`LOSS_VARIANTS` (a name may be registered once)."""
    if not isinstance(variant, LossVariant):
        raise _error("variant", "be a LossVariant", variant)
    if not variant.name or "__" in variant.name or "/" in variant.name:
        raise _error("variant.name", "be non-empty without '__' or '/'", variant.name)
    if variant.name in LOSS_VARIANTS:
        raise _error("variant.name", "not be registered already", variant.name)
    LOSS_VARIANTS[variant.name] = variant
    return variant


#: The planner head's width and the per-forward cost of the ``planner+cost`` variant (nats
#: per forward: with ``mean_to_go`` advantages a cost c reads as c over the tokens left).
PLANNER_HIDDEN = 32
PLANNER_FORWARD_COST = 1.0
_PLANNER = (
    "loss.kind=reverse_kl",
    "loss.advantage=mean_to_go",
    "rollout.commit_rule=planner",
    f"student.planner_hidden={PLANNER_HIDDEN}",
)

for _variant in (
    LossVariant("none", opd=False),
    LossVariant("reverse_kl+mean_to_go", ("loss.kind=reverse_kl", "loss.advantage=mean_to_go")),
    LossVariant("reverse_kl+sequence", ("loss.kind=reverse_kl", "loss.advantage=sequence")),
    LossVariant("forward_kl", ("loss.kind=forward_kl",)),
    LossVariant("jsd", ("loss.kind=jsd",)),
    # The learned commit policy (docs/opd.md): the joint reverse-KL policy gradient over
    # tokens and commit decisions, without and with a per-forward cost in the reward.
    LossVariant("planner", _PLANNER),
    LossVariant("planner+cost", (*_PLANNER, f"loss.forward_cost={PLANNER_FORWARD_COST}")),
):
    register_loss_variant(_variant)


# ---- configuration ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """What every cell of a run directory shares (its identity, ``experiment.json``).

    Step counts of the three phases (``teacher_steps`` None: the task config's own),
    ``checkpoint_every`` (every phase), ``eval_prompts`` eval prompts sampled ``samples``
    times each, the schedule points ``ks`` (tokens per forward), the ``thresholds``, and
    dotted job ``overrides`` applied to every cell before its own (e.g. smaller models).
    """

    warmup_steps: int = 300
    opd_steps: int = 150
    teacher_steps: int | None = None
    checkpoint_every: int = 100
    eval_prompts: int = 32
    samples: int = 4
    ks: tuple[int, ...] = (1, 2, 4, 8, 16)
    thresholds: tuple[float, ...] = (0.5, 0.7, 0.9, 0.99)
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def integer(name: str, value: Any, low: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise _error(name, f"be an int >= {low}", value)

        integer("warmup_steps", self.warmup_steps, 1)
        integer("opd_steps", self.opd_steps, 1)
        if self.teacher_steps is not None:
            integer("teacher_steps", self.teacher_steps, 1)
        integer("checkpoint_every", self.checkpoint_every, 1)
        integer("eval_prompts", self.eval_prompts, 1)
        integer("samples", self.samples, 1)
        if not self.ks or len(set(self.ks)) != len(self.ks):
            raise _error("ks", "be distinct ints >= 1", self.ks)
        for k in self.ks:
            integer("ks", k, 1)
        if len(set(self.thresholds)) != len(self.thresholds) or not all(
            isinstance(t, int | float) and not isinstance(t, bool) and 0.0 <= t <= 1.0
            for t in self.thresholds
        ):
            raise _error("thresholds", "be distinct numbers in [0, 1]", self.thresholds)
        check_overrides(self.overrides)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def check_overrides(overrides: Sequence[str], *, path_safe: bool = False) -> None:
    """Raise :class:`ExperimentError` naming ``overrides`` unless it is a sequence of dotted
    ``a.b=value`` strings (without '/' when ``path_safe``: they name a directory)."""
    if isinstance(overrides, str) or any(
        not isinstance(override, str) or "=" not in override or (path_safe and "/" in override)
        for override in overrides
    ):
        rule = "be dotted a.b=value strings" + (" without '/'" if path_safe else "")
        raise _error("overrides", rule, overrides)


def _phase_overrides(job: Any, phase: str, steps: int, config: ExperimentConfig) -> list[str]:
    """The experiment's length, checkpoint cadence and eval size for ``phase``; a cosine
    warm-up of the task config's own that would not fit ``steps`` shrinks to a tenth."""
    optimizer = getattr(job, phase).optimizer
    out = [
        f"{phase}.steps={steps}",
        f"{phase}.checkpoint_every={min(config.checkpoint_every, steps)}",
        # The phases' own evaluations have the experiment's batch shape: compiled once.
        f"{phase}.eval_examples={config.eval_prompts * config.samples}",
    ]
    if optimizer.schedule == "cosine" and steps <= optimizer.warmup_steps:
        out.append(f"{phase}.optimizer.warmup_steps={steps // 10}")
    return out


def cell_job(spec: str, objective: str, loss: str, seed: int, config: ExperimentConfig) -> Any:
    """The validated :class:`~distill.config.JobConfig` of one cell.

    The experiment's phase lengths are applied before ``config.overrides``, so an override
    is validated against the steps its phase runs (``opd.optimizer.warmup_steps=100`` with
    ``opd_steps`` 4000 holds whatever the task config's own ``opd.steps``), and an
    override of a phase's length, cadence or warm-up wins; the cell's seed, objective and
    loss variant win over every override."""
    from distill.config import load_config

    if spec not in TASK_SPECS:
        raise _error("tasks", f"name known task specs ({', '.join(TASK_SPECS)})", spec)
    if objective not in OBJECTIVES:
        raise _error("objectives", f"name known objectives ({', '.join(OBJECTIVES)})", objective)
    if loss not in LOSS_VARIANTS:
        raise _error("losses", f"name known loss variants ({', '.join(LOSS_VARIANTS)})", loss)
    task = TASK_SPECS[spec]
    path = ROOT / task.config
    own = load_config(path, overrides=task.overrides)
    lengths = _phase_overrides(
        own, "teacher_training", config.teacher_steps or own.teacher_training.steps, config
    )
    lengths += _phase_overrides(own, "student_warmup", config.warmup_steps, config)
    lengths += _phase_overrides(own, "opd", config.opd_steps, config)
    cell = [f"seed={seed}", f"objective.kind={objective}", *LOSS_VARIANTS[loss].overrides]
    overrides = [*task.overrides, *lengths, *config.overrides, *cell]
    return load_config(path, overrides=overrides)


# ---- files -----------------------------------------------------------------------------------


def cell_name(spec: str, objective: str, loss: str, seed: int) -> str:
    return f"{spec}__{objective}__{loss}__seed{seed}"


def _record_name(record: Mapping[str, Any]) -> str:
    cell = record["cell"]
    return cell_name(cell["task"], cell["objective"], cell["loss"], cell["seed"])


# ---- one cell --------------------------------------------------------------------------------


# The splits a run is scored on (``train`` never is); ``validation`` only for choices.
EVALUATION_SPLITS = ("eval", "validation")
# The commit rules evaluated at given settings (``--ks``, ``--thresholds``); a learned rule
# is evaluated as trained.
SWEPT_RULES = ("schedule", "threshold")


def _point(rule: str, setting: float | int | str, report: Any) -> dict[str, Any]:
    return {"rule": rule, "setting": setting, **report.to_dict()}


class Phases:
    """The shared phases of a run, each computed once per process and resumed from disk.
    Evaluations read the first ``config.eval_prompts`` prompts of ``split`` (``"eval"``; the
    held-out ``"validation"`` for choices made from measurements)."""

    def __init__(self, run_dir: Path, config: ExperimentConfig, log: Log, split: str = "eval"):
        if split not in EVALUATION_SPLITS:
            raise _error("split", f"be one of {list(EVALUATION_SPLITS)}", split)
        self.run_dir, self.config, self.log, self.split = run_dir, config, log, split
        self._teachers: dict[tuple[str, int], Any] = {}

    def eval_examples(self, job: Any) -> list[Any]:
        from distill.data.stream import TaskStream

        return TaskStream(job.data, split=self.split).batch(0, self.config.eval_prompts)

    def evaluate_teacher(self, job: Any, model: Any, seed: int) -> Any:
        """The causal teacher's :class:`~distill.evaluate.EvalReport` on this run's eval set."""
        from distill.evaluate import evaluate_teacher
        from distill.job import completion_length, job_teacher_tokenizer

        return evaluate_teacher(
            model,
            job_teacher_tokenizer(job),
            self.eval_examples(job),
            horizon=completion_length(job),
            seed=seed,
            samples_per_prompt=self.config.samples,
        )

    def teacher(self, spec: str, seed: int, job: Any) -> tuple[Any, dict[str, Any]]:
        from distill.pipeline import load_teacher_run, train_teacher

        key = (spec, seed)
        if key not in self._teachers:
            directory = self.run_dir / "teachers" / f"{spec}__seed{seed}"
            done = directory / "eval.json"
            if done.is_file():
                model = load_teacher_run(job, directory)
            else:
                model, _ = train_teacher(job, directory, progress=False, log=self.log)
            path = directory / "experiment-eval.json"
            record = read_json(path)
            if record is None:
                record = self.evaluate_teacher(job, model, seed).to_dict()
                write_json(path, record)
            self._teachers[key] = (model, record)
        return self._teachers[key]

    def warm_student(self, spec: str, objective: str, seed: int, job: Any, teacher: Any) -> Any:
        """A fresh copy of the warmed-up student, loaded for ``job`` (OPD trains its student
        in place). The warm-up is shared by every loss variant of (task, objective, seed): it
        trains from the variant-free job, so it is the same whichever cell runs first (a
        planner variant's head is then added at its init by ``load_student_run``)."""
        from distill.pipeline import load_student_run, warmup_student

        directory = self.run_dir / "warmup" / f"{spec}__{objective}__seed{seed}"
        if not (directory / "eval.json").is_file():  # written when the warm-up finished
            warmup_job = cell_job(spec, objective, "none", seed, self.config)
            warmup_student(warmup_job, directory, teacher=teacher, progress=False, log=self.log)
        return load_student_run(job, directory, teacher=teacher, log=self.log)

    def evaluate(
        self,
        job: Any,
        student: Any,
        seed: int,
        *,
        ks: Sequence[int] | None = None,
        thresholds: Sequence[float] | None = None,
    ) -> list[dict[str, Any]]:
        """``student``'s points: at each of ``ks`` then ``thresholds`` (the configuration's
        when None), then as trained for a learned commit rule. Each point is measured with
        ``seed`` on its own, so which other points are asked for changes none of them."""
        from distill.evaluate import at_parallelism, at_threshold, evaluate_student
        from distill.job import JobPlan

        plan = JobPlan.from_job(job)
        base = plan.settings
        examples = self.eval_examples(job)
        block = job.student.block_size
        points = []

        def measure(settings: Any) -> Any:
            return evaluate_student(
                student,
                plan.tokenizer,
                examples,
                settings,
                seed=seed,
                samples_per_prompt=self.config.samples,
            )

        for k in self.config.ks if ks is None else ks:
            points.append(_point("schedule", k, measure(at_parallelism(base, k, block))))
        for threshold in self.config.thresholds if thresholds is None else thresholds:
            points.append(_point("threshold", threshold, measure(at_threshold(base, threshold))))
        if base.commit_rule not in SWEPT_RULES:
            points.append(_point(base.commit_rule, "as trained", measure(base)))
        return points


def restore_saved(
    job: Any, student: Any, teacher: Any, directory: Path, log: Log
) -> tuple[int, list[tuple[int, Any]]]:
    """Restore the newest checkpoint of the OPD run in ``directory`` onto ``student`` (the
    student it started from; left as it is when nothing was saved) without training;
    returns the restored step and the run's evaluations ``(step, report)``. For a run the
    guard stopped: its live parameters hold an update that was never saved."""
    from distill.job import job_tokenizer
    from distill.opd import OpdLearner
    from distill.pipeline import in_process_teacher

    learner = OpdLearner(
        job,
        student,
        in_process_teacher(job, teacher),
        job_tokenizer(job),
        run_dir=directory,
        log=log,
    )
    try:
        return learner.step, learner.reports
    finally:
        learner.close()


def run_cell(phases: Phases, spec: str, objective: str, loss: str, seed: int) -> dict[str, Any]:
    """Train (or resume) and evaluate one cell; returns its record."""
    from distill.job import job_tokenizer
    from distill.opd import PolicyRegression, run_opd
    from distill.pipeline import in_process_teacher

    config = phases.config
    job = cell_job(spec, objective, loss, seed, config)
    teacher, teacher_report = phases.teacher(spec, seed, job)
    student = phases.warm_student(spec, objective, seed, job, teacher)
    evaluations: list[tuple[int, Any]] = []
    stopped = None
    if LOSS_VARIANTS[loss].opd:
        directory = phases.run_dir / "opd" / cell_name(spec, objective, loss, seed)
        # A finished OPD run is restored, not retrained; its evaluations come from the
        # checkpoint, so a cell recomputed after an interruption records the same ones.
        try:
            _, evaluations = run_opd(
                job,
                student,
                in_process_teacher(job, teacher),
                job_tokenizer(job),
                run_dir=directory,
                progress=False,
                log=phases.log,
            )
        except PolicyRegression as error:
            # The job's guard stopped a run that was making the student worse: the cell is
            # a result (this recipe fails here), measured at the newest saved checkpoint.
            phases.log(f"{cell_name(spec, objective, loss, seed)}: {error}")
            student = phases.warm_student(spec, objective, seed, job, teacher)
            step, evaluations = restore_saved(job, student, teacher, directory, phases.log)
            stopped = {"step": step, "reason": str(error)}
    return {
        "format": FORMAT,
        "cell": {"task": spec, "objective": objective, "loss": loss, "seed": seed},
        "job": job.model_dump(mode="json"),
        "teacher": teacher_report,
        "points": phases.evaluate(job, student, seed),
        "opd_evaluations": [
            {"step": step, "report": report.to_dict()} for step, report in evaluations
        ],
        # None, or where the guard stopped OPD ({"step", "reason"}): the points are that
        # checkpoint's.
        "stopped": stopped,
    }


def run(
    config: ExperimentConfig,
    run_dir: str | os.PathLike[str],
    *,
    tasks: Sequence[str],
    objectives: Sequence[str],
    losses: Sequence[str],
    seeds: Sequence[int],
    progress: bool = True,
    log: Log | None = None,
) -> dict[str, Any]:
    """Run (or resume) every cell of the grid, then write ``report.md`` and the plots over
    every cell file in ``run_dir``. Returns the cells by name."""
    import tqdm

    for field, values, known in (
        ("tasks", tasks, TASK_SPECS),
        ("objectives", objectives, OBJECTIVES),
        ("losses", losses, LOSS_VARIANTS),
    ):
        if not values or any(value not in known for value in values):
            raise _error(field, f"name known values ({', '.join(known)})", list(values))
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise _error("seeds", "be ints >= 0", list(seeds))
    run_dir = Path(run_dir)
    check_run_dir(run_dir, FORMAT, config.to_dict())
    grid = [
        (spec, objective, loss, seed)
        for spec in tasks
        for seed in seeds
        for objective in objectives
        for loss in losses
    ]
    for cell in grid:  # fail on a bad combination before any training
        cell_job(*cell, config)
    bar = tqdm.tqdm(grid, disable=not progress, desc="cells", unit="cell")
    say = log or (bar.write if progress else (lambda message: None))
    phases = Phases(run_dir, config, say)
    for cell in bar:
        name = cell_name(*cell)
        path = run_dir / "cells" / f"{name}.json"
        bar.set_postfix_str(name)
        if path.is_file():
            say(f"reusing {path}")
            continue
        write_json(path, run_cell(phases, *cell))
        say(f"wrote {path}")
    cells = load_cells(run_dir)
    (run_dir / "report.md").write_text(report(cells, run_dir, config))
    say(f"wrote {run_dir / 'report.md'}")
    return cells


def load_cells(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {
        path.stem: json.loads(path.read_text())
        for path in sorted((Path(run_dir) / "cells").glob("*.json"))
    }


# ---- report ----------------------------------------------------------------------------------


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def _fmt(values: Sequence[float], digits: int = 3) -> str:
    mean, sd = _mean_sd(values)
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def _aups(points: Sequence[dict[str, Any]], y_max: float) -> dict[str, float]:
    from distill.evaluate import aup

    out = {}
    for label, rules in (("schedule", {"schedule"}), ("threshold", {"threshold"}), ("all", None)):
        chosen = [p for p in points if rules is None or p["rule"] in rules]
        if chosen:
            out[label] = aup(
                [max(p["tokens_per_forward"], 1e-9) for p in chosen],
                [100.0 * p["overall"] for p in chosen],
                y_max=y_max,
            )
    return out


def command(config: ExperimentConfig, run_dir: Path | str, grid: Mapping[str, Sequence]) -> str:
    """The command line that reproduces (or resumes) ``grid``'s cells under ``config`` (every
    setting spelled out, so a later change of a default cannot change what it runs)."""
    parts = ["python -m distill.experiments.parallelism", f"--run-dir {run_dir}"]
    for flag in ("tasks", "objectives", "losses", "seeds"):
        parts.append(f"--{flag} " + " ".join(str(value) for value in grid[flag]))
    for field in dataclasses.fields(ExperimentConfig):
        value = getattr(config, field.name)
        if value is None:
            continue
        if field.name == "overrides":
            parts += [f"--set {override}" for override in value]
            continue
        shown = " ".join(str(v) for v in value) if isinstance(value, tuple) else str(value)
        parts.append(f"--{field.name.replace('_', '-')} {shown}")
    return " ".join(parts)


def report(
    cells: Mapping[str, Mapping[str, Any]],
    run_dir: Path | None = None,
    config: ExperimentConfig | None = None,
) -> str:
    """``report.md``: per task, the teacher and each (objective, loss) row over seeds (mean ±
    population standard deviation), the plot (written next to it with ``run_dir``) and, with
    ``config``, the command that reproduces the task's cells."""
    lines = ["# Accuracy vs parallelism", ""]
    lines += [
        "Exact match at temperature 1 on the eval split (mean ± sd over seeds), with the "
        "measured tokens per forward in parentheses; AUP (d3LLM, accuracies in percent, "
        "`y_max` = the task's best accuracy of any point, teacher included) of the schedule "
        "points, of the threshold sweep and of both. H: free-letter entropy (bits) of correct "
        "`agree` answers; D: distinct completions per prompt (fraction).",
        "",
    ]
    by_task: dict[str, list[Mapping[str, Any]]] = {}
    for record in cells.values():
        by_task.setdefault(record["cell"]["task"], []).append(record)
    for task, records in sorted(by_task.items()):
        rows: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for record in records:
            rows.setdefault((record["cell"]["objective"], record["cell"]["loss"]), []).append(
                record
            )
        teachers = {record["cell"]["seed"]: record["teacher"] for record in records}
        y_max = 100.0 * max(
            [t["overall"] for t in teachers.values()]
            + [p["overall"] for record in records for p in record["points"]]
        )
        settings = [
            (p["rule"], p["setting"])
            for p in sorted(records, key=lambda r: len(r["points"]))[-1]["points"]
        ]
        header = ["row", "seeds"] + [
            f"{'k' if rule == 'schedule' else 'τ' if rule == 'threshold' else rule}={setting}"
            for rule, setting in settings
        ]
        rule, setting = settings[0]
        at = f"{'k' if rule == 'schedule' else 'τ' if rule == 'threshold' else rule}={setting}"
        header += ["AUP sched.", "AUP thresh.", "AUP all", f"H ({at})", f"D ({at})"]
        lines += [f"## {task}", "", "| " + " | ".join(header) + " |"]
        lines.append("|" + "---|" * len(header))
        teacher_acc = [t["overall"] for t in teachers.values()]
        teacher_aup = [100.0 * t["overall"] for t in teachers.values()]
        teacher_row = ["teacher (causal)", str(len(teachers))]
        teacher_row += [
            f"{_fmt(teacher_acc)} (1.00)" if i == 0 else "" for i in range(len(settings))
        ]
        teacher_row += [_fmt(teacher_aup, 1)] * 3
        teacher_row += [
            _fmt([t["agree_entropy_bits"] for t in teachers.values()], 2),
            _fmt([t["distinct_fraction"] for t in teachers.values()], 2),
        ]
        lines.append("| " + " | ".join(teacher_row) + " |")
        for (objective, loss), group in sorted(rows.items()):
            row = [f"{objective} + {loss}" if loss != "none" else f"{objective} (warm-up)"]
            row.append(str(len(group)))
            for rule, setting in settings:
                found = [
                    p
                    for record in group
                    for p in record["points"]
                    if (p["rule"], p["setting"]) == (rule, setting)
                ]
                accuracy = _fmt([p["overall"] for p in found])
                speed = _mean_sd([p["tokens_per_forward"] for p in found])[0]
                row.append(f"{accuracy} ({speed:.2f})" if found else "-")
            aups = [_aups(record["points"], y_max) for record in group]
            for label in ("schedule", "threshold", "all"):
                row.append(_fmt([a[label] for a in aups if label in a], 1))
            first = [record["points"][0] for record in group]
            row.append(_fmt([p["agree_entropy_bits"] for p in first], 2))
            row.append(_fmt([p["distinct_fraction"] for p in first], 2))
            lines.append("| " + " | ".join(row) + " |")
        for record in sorted(records, key=_record_name):
            if record.get("stopped"):
                lines.append(
                    f"\n`{_record_name(record)}`: OPD stopped by the guard at step "
                    f"{record['stopped']['step']} (measured at that checkpoint): "
                    f"{record['stopped']['reason']}"
                )
        if run_dir is not None:
            name = f"plot-{task}.png"
            _plot(Path(run_dir) / name, task, teachers, rows)
            lines += ["", f"![{task}]({name})"]
        if config is not None and run_dir is not None:
            grid = {
                "tasks": [task],
                "objectives": sorted({r["cell"]["objective"] for r in records}),
                "losses": sorted({r["cell"]["loss"] for r in records}),
                "seeds": sorted({r["cell"]["seed"] for r in records}),
            }
            lines += ["", "```", command(config, run_dir, grid), "```"]
        lines.append("")
    return "\n".join(lines)


def _plot(
    path: Path,
    task: str,
    teachers: Mapping[int, Mapping[str, Any]],
    rows: Mapping[tuple[str, str], Sequence[Mapping[str, Any]]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for (objective, loss), group in sorted(rows.items()):
        label = f"{objective} + {loss}" if loss != "none" else f"{objective} (warm-up)"
        for rule, style in (("schedule", "-"), ("threshold", "--")):
            by_setting: dict[Any, list[tuple[float, float]]] = {}
            for record in group:
                for p in record["points"]:
                    if p["rule"] == rule:
                        by_setting.setdefault(p["setting"], []).append(
                            (p["tokens_per_forward"], p["overall"])
                        )
            if not by_setting:
                continue
            curve = sorted(
                (statistics.fmean(x for x, _ in v), statistics.fmean(y for _, y in v))
                for v in by_setting.values()
            )
            axis.plot(
                [x for x, _ in curve],
                [y for _, y in curve],
                style,
                marker="o",
                label=f"{label} ({rule})",
            )
    accuracy = statistics.fmean(t["overall"] for t in teachers.values())
    axis.scatter([1.0], [accuracy], marker="*", s=160, color="black", label="teacher")
    axis.set_xlabel("measured tokens committed per forward")
    axis.set_ylabel("exact match (temperature 1)")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    axis.set_title(f"{task}: accuracy vs parallelism")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---- command line ----------------------------------------------------------------------------


def override_argument(parser: argparse.ArgumentParser, scope: str, example: str) -> None:
    """Add the repeatable ``--set A.B=VALUE`` flag (dotted job overrides for ``scope``),
    collected in ``args.overrides``."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="A.B=VALUE",
        help=f"a dotted job override for {scope} (repeatable), e.g. {example}",
    )


def _parser() -> argparse.ArgumentParser:
    defaults = ExperimentConfig()
    parser = argparse.ArgumentParser(
        prog="python -m distill.experiments.parallelism",
        description="Accuracy vs parallelism over tasks x warm-up objectives x OPD losses x "
        "seeds (resumable; see the module docstring).",
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--tasks", nargs="+", default=["agree16"], choices=list(TASK_SPECS))
    parser.add_argument("--objectives", nargs="+", default=["mdlm"], choices=list(OBJECTIVES))
    parser.add_argument(
        "--losses",
        nargs="+",
        default=["none", "reverse_kl+mean_to_go"],
        metavar="LOSS",
        help=f"loss variants: {', '.join(LOSS_VARIANTS)}",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--opd-steps", type=int, default=defaults.opd_steps)
    parser.add_argument(
        "--teacher-steps", type=int, default=None, help="default: the task config's"
    )
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    parser.add_argument("--eval-prompts", type=int, default=defaults.eval_prompts)
    parser.add_argument("--samples", type=int, default=defaults.samples)
    parser.add_argument("--ks", nargs="+", type=int, default=list(defaults.ks))
    parser.add_argument("--thresholds", nargs="+", type=float, default=list(defaults.thresholds))
    override_argument(parser, "every cell", "student.d_model=32")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = ExperimentConfig(
            warmup_steps=args.warmup_steps,
            opd_steps=args.opd_steps,
            teacher_steps=args.teacher_steps,
            checkpoint_every=args.checkpoint_every,
            eval_prompts=args.eval_prompts,
            samples=args.samples,
            ks=tuple(args.ks),
            thresholds=tuple(args.thresholds),
            overrides=tuple(args.overrides),
        )
        run(
            config,
            args.run_dir,
            tasks=args.tasks,
            objectives=args.objectives,
            losses=args.losses,
            seeds=args.seeds,
            progress=not args.quiet,
        )
    except ExperimentError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
