"""Continue the finished OPD cells of a parallelism run with another loss, keep whichever
student scores better on held-out prompts, then evaluate.

Sampled reverse KL moves the student only through the log-prob of what it sampled (a
gradient scaled by 1 - p), so a token the student commits with p ~ 1 is barely corrected
however low the teacher scores it; a mass-covering loss (``forward_kl``: gradient p - q at
every vocabulary entry) pushes it regardless (docs/quality.md). This runs such a second
stage on every finished OPD cell of ``--run-dir``::

    python -m distill.experiments.polish --run-dir runs/parallelism/copy-cos4000-s0 \\
        --loss forward_kl --steps 300 --learning-rate 7e-5 --prompts 256 --samples 4 \\
        --ks 16 --thresholds 0.9 --validation-prompts 128

Each cell's second stage is an OPD run of its own (rollouts from the live student as in the
cell, the loss variant's overrides, ``--steps`` at a constant ``--learning-rate``) under
``polish/<cell>__<loss>__<steps>__lr<rate>/``, resumable from its checkpoints. ``--set
a.b=value`` (repeatable) changes the stage's job on top of the cell's, e.g.
``--set rollout.threshold=0.0`` trains on one-forward-per-block rollouts, the setting where a
student that is right at threshold 0.9 can still be wrong; each such override is appended to
the stage name (``__rollout.threshold=0.0``). The stage
helps some seeds and hurts others, so the student before and after it is scored on the first
``--validation-prompts`` prompts of the ``validation`` split (never trained on, never
reported) and the one with the higher mean exact match over the evaluation points is
``kept`` (the stage must win strictly). A stage the job's guard stops (its rollouts scored
lower and lower by the teacher: ``PolicyRegression``) is judged the same way at its newest
saved checkpoint (the student before it when it saved none) and recorded with ``stopped``
({step, reason}). Both are also evaluated on the eval set; the record (the teacher,
``before``, the continued student's ``points``, ``validation``, ``kept``, ``stopped`` and
the ``kept_run`` whose final checkpoint to use) goes to
``polish/<cell>__<loss>__<steps>__lr<rate>__<prompts>x<samples>__val<n>.json`` and is reused
when present. The cell's own run directory is only read.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distill.experiments.parallelism import (
    LOSS_VARIANTS,
    SWEPT_RULES,
    Phases,
    cell_job,
    check_overrides,
    load_cells,
    override_argument,
    restore_saved,
)
from distill.experiments.reevaluate import (
    Log,
    evaluation_arguments,
    evaluation_record,
    finished_cell,
    point_key,
    requested_keys,
    run_command,
    run_config,
)
from distill.experiments.run_dir import error, read_json, write_json


def polish(
    run_dir: str | Path,
    *,
    loss: str,
    steps: int,
    learning_rate: float,
    prompts: int,
    samples: int,
    ks: Sequence[int],
    thresholds: Sequence[float],
    validation_prompts: int = 128,
    overrides: Sequence[str] = (),
    log: Log = print,
) -> dict[str, dict[str, Any]]:
    """Continue every finished OPD cell of ``run_dir`` with the loss variant ``loss`` for
    ``steps`` steps at ``learning_rate``, choose the student to keep on ``validation_prompts``
    held-out prompts and evaluate both; returns the records by stage name. ``overrides``
    (dotted ``a.b=value`` strings) change the stage's job on top of the cell's.
    Raises :class:`ExperimentError` naming the field for an unknown or non-OPD ``loss``,
    ``steps`` or ``validation_prompts`` < 1, a ``learning_rate`` that is not > 0 or
    ``overrides`` the job configuration refuses (checked before anything trains)."""
    from distill.config import ConfigError
    from distill.job import job_tokenizer
    from distill.opd import PolicyRegression, run_opd
    from distill.pipeline import in_process_teacher

    if loss not in LOSS_VARIANTS or not LOSS_VARIANTS[loss].opd:
        opd = ", ".join(name for name, variant in LOSS_VARIANTS.items() if variant.opd)
        raise error("loss", f"name an OPD loss variant ({opd})", loss)
    for field, value in (("steps", steps), ("validation_prompts", validation_prompts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise error(field, "be an int >= 1", value)
    if not learning_rate > 0:
        raise error("learning_rate", "be > 0", learning_rate)
    check_overrides(overrides, path_safe=True)  # each one is part of the stage's name
    run_dir = Path(run_dir)
    trained = run_config(run_dir)
    second = dataclasses.replace(
        trained,
        opd_steps=steps,
        checkpoint_every=min(trained.checkpoint_every, steps),
        overrides=(
            *trained.overrides,
            f"opd.optimizer.learning_rate={learning_rate}",
            "opd.optimizer.schedule=constant",
            *overrides,
        ),
    )
    evaluation = dataclasses.replace(
        trained, eval_prompts=prompts, samples=samples, ks=tuple(ks), thresholds=tuple(thresholds)
    )
    validating = Phases(
        run_dir, dataclasses.replace(evaluation, eval_prompts=validation_prompts), log, "validation"
    )
    cells = {
        name: stored["cell"]
        for name, stored in load_cells(run_dir).items()
        if LOSS_VARIANTS[stored["cell"]["loss"]].opd
    }
    stage_jobs = {}
    for name, cell in cells.items():
        try:
            stage_jobs[name] = cell_job(cell["task"], cell["objective"], loss, cell["seed"], second)
        except ConfigError as refused:
            raise error("overrides", f"give a valid job ({refused})", list(overrides)) from None
    records = {}
    for name, cell in cells.items():
        stage = "__".join((f"{name}__{loss}__{steps}__lr{learning_rate:g}", *overrides))
        path = run_dir / "polish" / f"{stage}__{prompts}x{samples}__val{validation_prompts}.json"
        record = read_json(path)
        if record is not None:
            stored = [point_key(point) for point in record["validation"]["before"]]
            asked = requested_keys(ks, thresholds) + [
                key for key in stored if key[0] not in SWEPT_RULES
            ]
            if stored != asked:
                # Which student is kept was judged on these points: another set is another
                # judgement, never silently the stored one.
                raise error(
                    "ks and thresholds",
                    f"be the points {path} was judged on ({stored}), or the record removed",
                    {"ks": list(ks), "thresholds": list(thresholds)},
                )
        else:
            job, teacher, student = finished_cell(run_dir, trained, cell, log)
            # Scored before the stage: run_opd trains (or restores) the student in place.
            validation_before = validating.evaluate(job, student, cell["seed"])
            before = Phases(run_dir, evaluation, log).evaluate(job, student, cell["seed"])
            stage_job = stage_jobs[name]
            stopped = None
            try:
                run_opd(
                    stage_job,
                    student,
                    in_process_teacher(stage_job, teacher),
                    job_tokenizer(stage_job),
                    run_dir=run_dir / "polish" / stage,
                    progress=False,
                    log=log,
                )
            except PolicyRegression as regression:
                # The guard stopped a stage that was making the student worse; its live
                # parameters hold the unsaved update, so the stage is judged at its newest
                # saved checkpoint, restored onto the student before it (reloaded: the live
                # one was trained in place; the teacher was not).
                log(f"{stage}: {regression}")
                _, _, student = finished_cell(run_dir, trained, cell, log)
                step, _ = restore_saved(
                    stage_job, student, teacher, run_dir / "polish" / stage, log
                )
                stopped = {"step": step, "reason": str(regression)}
            record = evaluation_record(run_dir, evaluation, cell, stage_job, teacher, student, log)
            validation_after = validating.evaluate(stage_job, student, cell["seed"])
            record["polish"] = {"loss": loss, "steps": steps, "learning_rate": learning_rate}
            if overrides:
                record["polish"]["overrides"] = list(overrides)
            record["before"] = before
            record["validation"] = {
                "prompts": validation_prompts,
                "samples": samples,
                "before": validation_before,
                "after": validation_after,
            }
            record["kept"] = kept_side(validation_before, validation_after)
            # None, or where the guard stopped the stage: "after" is that checkpoint's student.
            record["stopped"] = stopped
            # The run directory (relative to ``run_dir``) whose final checkpoint is kept.
            record["kept_run"] = f"polish/{stage}" if record["kept"] == "after" else f"opd/{name}"
            write_json(path, record)
        records[stage] = record
    return records


def selection_score(points: Sequence[dict[str, Any]]) -> float:
    """The mean exact match over a student's evaluation points (what ``kept`` compares)."""
    if not points:
        raise error("points", "hold at least one evaluation point", list(points))
    return sum(point["overall"] for point in points) / len(points)


def kept_side(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]) -> str:
    """``"after"`` when the stage's held-out points score strictly higher than the points
    before it, else ``"before"`` (a tie keeps the student that had no second stage)."""
    return "after" if selection_score(after) > selection_score(before) else "before"


def kept_points(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The eval-set points of the student a polish record keeps."""
    return record["points"] if record["kept"] == "after" else record["before"]


def selection_table(records: dict[str, dict[str, Any]]) -> str:
    """One markdown row per stage: the teacher, the held-out scores before and after the
    stage, which student is kept, and the eval-set exact match (tokens per forward) of
    before, after and kept at each point."""
    lines = []
    for stage, record in records.items():
        if not lines:
            heads = [f"{p['rule']} {p['setting']}" for p in record["points"]]
            lines.append(
                "| stage | teacher | validation before / after | kept | "
                + " | ".join(f"{head}: before / after / kept" for head in heads)
                + " |"
            )
            lines.append("|---" * (4 + len(heads)) + "|")
        validation = record["validation"]
        cells = [
            " / ".join(
                f"{p['overall']:.3f} ({p['tokens_per_forward']:.2f})" for p in (before, after, kept)
            )
            for before, after, kept in zip(
                record["before"], record["points"], kept_points(record), strict=True
            )
        ]
        lines.append(
            f"| {stage} | {record['teacher']['overall']:.3f} | "
            f"{selection_score(validation['before']):.3f} / "
            f"{selection_score(validation['after']):.3f} | {record['kept']}{stopped_note(record)} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def stopped_note(record: dict[str, Any]) -> str:
    """`` (stage stopped by the guard at step N)`` for a stage the guard stopped, else ``""``
    (records written before the guard have no ``stopped``)."""
    stopped = record.get("stopped")
    return "" if stopped is None else f" (stage stopped by the guard at step {stopped['step']})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distill.experiments.polish",
        description="Continue a parallelism run's finished OPD cells with another loss.",
    )
    evaluation_arguments(parser, ks=[16])
    parser.add_argument("--loss", default="forward_kl")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--learning-rate", type=float, default=7e-5)
    parser.add_argument("--validation-prompts", type=int, default=128)
    override_argument(parser, "the stage", "rollout.threshold=0.0")
    args = parser.parse_args(argv)
    return run_command(
        lambda: polish(
            args.run_dir,
            loss=args.loss,
            steps=args.steps,
            learning_rate=args.learning_rate,
            prompts=args.prompts,
            samples=args.samples,
            ks=args.ks,
            thresholds=args.thresholds,
            validation_prompts=args.validation_prompts,
            overrides=args.overrides,
        ),
        render=selection_table,
    )


if __name__ == "__main__":
    sys.exit(main())
