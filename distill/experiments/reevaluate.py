"""Re-evaluate the finished cells of a parallelism run on a larger eval set; trains nothing.

The grid's own evaluation (``--eval-prompts`` x ``--samples``: 128 completions by default)
cannot resolve one point of exact match (one completion is 0.8 points). This loads each
finished cell's teacher and final student from the run directory and evaluates both on the
first ``--prompts`` eval prompts (a superset of the grid's) x ``--samples``, at the given
schedule points and thresholds, at temperature 1 with the cell's seed::

    python -m distill.experiments.reevaluate --run-dir runs/parallelism/copy \\
        --prompts 256 --samples 4 --ks 8 16 --thresholds 0.9

Each cell's record goes to ``reevaluations/<cell>__<prompts>x<samples>.json``, reused when
present: a point it lacks (another ``--ks`` or ``--thresholds``) is measured and added to it,
and the table printed shows the points asked for. ``--split validation`` measures the same on
held-out prompts that are never reported, into ``reevaluations/validation/``: ``bar`` chooses
the point it reports from those. ``--cells NAME...`` re-scores only the named cells. Only
cells with a record in ``cells/`` are read, so an unfinished OPD run is never trained from
here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from distill.experiments.parallelism import (
    EVALUATION_SPLITS,
    FORMAT,
    LOSS_VARIANTS,
    SWEPT_RULES,
    ExperimentConfig,
    Phases,
    cell_job,
    cell_name,
    load_cells,
)
from distill.experiments.run_dir import ExperimentError, error, read_json, write_json

Log = Callable[[str], None]


def run_config(run_dir: Path) -> ExperimentConfig:
    """The configuration a parallelism run directory was started with."""
    stored = read_json(run_dir / "experiment.json")
    if stored is None or stored.get("format") != FORMAT:
        found = None if stored is None else stored.get("format")
        raise error("run_dir", f"hold a {FORMAT} run (experiment.json)", found)
    config = dict(stored["config"])
    for name in ("ks", "thresholds", "overrides"):
        config[name] = tuple(config[name])
    return ExperimentConfig(**config)


def finished_cell(
    run_dir: Path, trained: ExperimentConfig, cell: dict[str, Any], log: Log
) -> tuple[Any, Any, Any]:
    """``(job, teacher, student)`` of one finished cell: its job under the ``trained``
    configuration (whose contracts the run directory holds), its teacher and its final
    student (restored; nothing is trained: the cell's record exists)."""
    from distill.job import job_tokenizer
    from distill.opd import run_opd
    from distill.pipeline import in_process_teacher, load_teacher_run

    spec, objective, loss, seed = cell["task"], cell["objective"], cell["loss"], cell["seed"]
    job = cell_job(spec, objective, loss, seed, trained)
    teacher = load_teacher_run(job, run_dir / "teachers" / f"{spec}__seed{seed}")
    student = Phases(run_dir, trained, log).warm_student(spec, objective, seed, job, teacher)
    if LOSS_VARIANTS[loss].opd:
        # A finished OPD run is restored and trains nothing (its cell record exists).
        run_opd(
            job,
            student,
            in_process_teacher(job, teacher),
            job_tokenizer(job),
            run_dir=run_dir / "opd" / cell_name(spec, objective, loss, seed),
            progress=False,
            log=log,
        )
    return job, teacher, student


def reevaluate_cell(
    run_dir: Path,
    trained: ExperimentConfig,
    evaluation: ExperimentConfig,
    cell: dict[str, Any],
    log: Log,
    split: str = "eval",
) -> dict[str, Any]:
    """Load one finished cell's teacher and final student (:func:`finished_cell`) and
    evaluate both with the ``evaluation`` configuration (``eval_prompts`` x ``samples``,
    ``ks``, ``thresholds``) on ``split``."""
    job, teacher, student = finished_cell(run_dir, trained, cell, log)
    return evaluation_record(run_dir, evaluation, cell, job, teacher, student, log, split)


def evaluation_record(
    run_dir: Path,
    evaluation: ExperimentConfig,
    cell: dict[str, Any],
    job: Any,
    teacher: Any,
    student: Any,
    log: Log,
    split: str = "eval",
) -> dict[str, Any]:
    """The teacher's and ``student``'s evaluations on the first ``evaluation.eval_prompts``
    prompts of ``split``, as the record :func:`reevaluate` stores."""
    evaluating = Phases(run_dir, evaluation, log, split)
    teacher_report = evaluating.evaluate_teacher(job, teacher, cell["seed"])
    return {
        "cell": cell,
        "split": split,
        "prompts": evaluation.eval_prompts,
        "samples": evaluation.samples,
        "teacher": teacher_report.to_dict(),
        "points": evaluating.evaluate(job, student, cell["seed"]),
    }


def reevaluate(
    run_dir: str | Path,
    *,
    prompts: int,
    samples: int,
    ks: Sequence[int],
    thresholds: Sequence[float],
    split: str = "eval",
    cells: Sequence[str] | None = None,
    log: Log = print,
) -> dict[str, dict[str, Any]]:
    """Re-evaluate the finished cells of ``run_dir`` (all of them, or those ``cells`` names)
    on ``split`` (``"eval"``, or ``"validation"`` to choose an evaluation point on prompts
    that are never reported); returns the records by cell name. Raises
    :class:`ExperimentError` naming ``split`` or ``cells`` (a name with no finished cell)."""
    if split not in EVALUATION_SPLITS:
        raise error("split", f"be one of {list(EVALUATION_SPLITS)}", split)
    run_dir = Path(run_dir)
    trained = run_config(run_dir)
    evaluation = dataclasses.replace(
        trained,
        eval_prompts=prompts,
        samples=samples,
        ks=tuple(ks),
        thresholds=tuple(thresholds),
    )
    finished = load_cells(run_dir)
    if cells is not None:
        unknown = [name for name in cells if name not in finished]
        if unknown or not cells:
            raise error("cells", f"name finished cells of the run (of {list(finished)})", unknown)
        finished = {name: finished[name] for name in cells}
    records = {}
    for name, record in finished.items():
        path = record_path(run_dir, name, prompts, samples, split)
        stored = read_json(path)
        if stored is None:
            stored = reevaluate_cell(run_dir, trained, evaluation, record["cell"], log, split)
            write_json(path, stored)
            log(f"wrote {path}")
        else:
            have = {point_key(point) for point in stored["points"]}
            missing_ks = [k for k in ks if ("schedule", k) not in have]
            missing_thresholds = [t for t in thresholds if ("threshold", t) not in have]
            if missing_ks or missing_thresholds:
                # Each point is its own seeded evaluation, so a point added later is the
                # one a single call would have measured; the record keeps every point.
                job, _, student = finished_cell(run_dir, trained, record["cell"], log)
                added = Phases(run_dir, evaluation, log, split).evaluate(
                    job,
                    student,
                    record["cell"]["seed"],
                    ks=missing_ks,
                    thresholds=missing_thresholds,
                )
                # A learned rule's point comes back with every call; it is already stored.
                new_points = [point for point in added if point_key(point) not in have]
                stored["points"] += new_points
                write_json(path, stored)
                log(f"added {len(new_points)} point(s) to {path}")
        records[name] = {**stored, "points": requested_points(stored["points"], ks, thresholds)}
    return records


def record_path(run_dir: Path, name: str, prompts: int, samples: int, split: str) -> Path:
    """Where :func:`reevaluate` keeps a cell's record: ``reevaluations/`` for the eval split,
    ``reevaluations/validation/`` for the validation split."""
    folder = run_dir / "reevaluations"
    return (folder if split == "eval" else folder / split) / f"{name}__{prompts}x{samples}.json"


def point_key(point: dict[str, Any]) -> tuple[str, Any]:
    """``(rule, setting)``: what identifies an evaluation point in a record."""
    return point["rule"], point["setting"]


def requested_keys(ks: Sequence[int], thresholds: Sequence[float]) -> list[tuple[str, Any]]:
    """The keys of the schedule and threshold points ``ks`` and ``thresholds`` ask for."""
    return [("schedule", k) for k in ks] + [("threshold", t) for t in thresholds]


def requested_points(
    points: Sequence[dict[str, Any]], ks: Sequence[int], thresholds: Sequence[float]
) -> list[dict[str, Any]]:
    """The ``points`` at ``ks`` then ``thresholds``, in that order, then any point of a
    learned commit rule (measured as trained, whatever was asked)."""
    by_key = {point_key(point): point for point in points}
    keys = requested_keys(ks, thresholds)
    learned = [point for point in points if point["rule"] not in SWEPT_RULES]
    return [by_key[key] for key in keys if key in by_key] + learned


def table(records: dict[str, dict[str, Any]]) -> str:
    """One markdown row per cell: the teacher, then each point's exact match (tokens per
    forward), its miss kinds and where the misses start."""
    lines = []
    for name, record in records.items():
        if not lines:
            heads = [f"{p['rule']} {p['setting']}" for p in record["points"]]
            lines.append("| cell | completions | teacher | " + " | ".join(heads) + " |")
            lines.append("|---" * (3 + len(heads)) + "|")
        cells = [
            f"{p['overall']:.3f} ({p['tokens_per_forward']:.2f}; misses {p.get('misses', {})}; "
            f"first wrong index {p.get('first_miss_at', {})})"
            for p in record["points"]
        ]
        teacher = record["teacher"]["overall"]
        count = record["teacher"]["count"]
        lines.append(f"| {name} | {count} | {teacher:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def evaluation_arguments(parser: argparse.ArgumentParser, *, ks: Sequence[int]) -> None:
    """Add the run directory and evaluation-size flags shared by the re-scoring commands."""
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--ks", nargs="+", type=int, default=list(ks))
    parser.add_argument("--thresholds", nargs="+", type=float, default=[0.9])


def run_command(
    command: Callable[[], dict[str, dict[str, Any]]],
    render: Callable[[dict[str, dict[str, Any]]], str] = table,
) -> int:
    """Run ``command``, print its records with ``render``; an :class:`ExperimentError` is
    printed as ``error: ...`` on stderr with exit status 2."""
    try:
        records = command()
    except ExperimentError as failure:
        print(f"error: {failure}", file=sys.stderr)
        return 2
    print(render(records))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distill.experiments.reevaluate",
        description="Re-evaluate a parallelism run's finished cells on more eval prompts.",
    )
    evaluation_arguments(parser, ks=[8, 16])
    parser.add_argument(
        "--split",
        choices=EVALUATION_SPLITS,
        default="eval",
        help="validation: held-out prompts never reported, on which `bar` chooses the point "
        "it reports from the eval records",
    )
    parser.add_argument(
        "--cells",
        nargs="+",
        help="only these finished cells (names as in the run's cells/ folder); default all",
    )
    args = parser.parse_args(argv)
    return run_command(
        lambda: reevaluate(
            args.run_dir,
            prompts=args.prompts,
            samples=args.samples,
            ks=args.ks,
            thresholds=args.thresholds,
            split=args.split,
            cells=args.cells,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
