"""Check the long-task bar from stored records: per recipe and seed, is the student within
``--within`` of its teacher's exact match at >= ``--min-tokens-per-forward`` tokens per
forward? Trains and evaluates nothing::

    python -m distill.experiments.bar runs/parallelism/reverse-s4anti-s0 \\
        runs/parallelism/reverse-s4anti-s1 runs/parallelism/reverse-s4anti-s2

A recipe is what trained the student: the run's configuration without its evaluation
settings (steps of each phase and the job overrides), the cell's objective and loss, and for
a ``polish`` record its second stage (loss, steps, rate, overrides) with the student that
stage's validation kept. Run directories that differ only in their seed therefore share a
recipe. Each (recipe, seed) is judged on its record with the most completions: the cell's
own (``cells/``), a re-evaluation (``reevaluations/``) or a polish record's ``before`` for
the OPD student, the polish record itself for a stage. The student's score is one of its
evaluation points with at least ``--min-tokens-per-forward`` tokens per forward, against the
teacher on the same completions. Which point: the best on held-out validation prompts when
there are validation measurements of that student (``reevaluate --split validation`` for a
cell's student, a polish record's own validation points for a stage), else the best on the
eval set itself (a choice among a handful of points on the completions it reports, so
slightly optimistic; the table says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distill.experiments.parallelism import ExperimentConfig, load_cells
from distill.experiments.polish import kept_points
from distill.experiments.reevaluate import point_key, run_config
from distill.experiments.run_dir import ExperimentError, error, read_json

__all__ = ["BarRow", "bar_rows", "bar_table", "main"]


@dataclasses.dataclass(frozen=True)
class BarRow:
    """One (recipe, seed): the record it is judged on and the verdict.

    ``point`` is the student's evaluation point at >= the bar's tokens per forward that was
    best on validation (``validation_completions`` of them), or best on the eval set itself
    when that is None; None when no point reaches the bar's tokens per forward. ``met`` is
    whether it is within the bar's margin of ``teacher`` (the teacher's exact match on the
    same ``completions``)."""

    recipe: str
    task: str
    seed: int
    source: str
    completions: int
    teacher: float
    point: dict[str, Any] | None
    met: bool
    validation_completions: int | None = None

    @property
    def gap(self) -> float | None:
        """Teacher minus student exact match (None without a qualifying point)."""
        return None if self.point is None else self.teacher - self.point["overall"]


def _base_recipe(config: ExperimentConfig, cell: dict[str, Any]) -> str:
    teacher = "task default" if config.teacher_steps is None else config.teacher_steps
    recipe = (
        f"{cell['task']}: teacher {teacher} steps, {cell['objective']} warm-up "
        f"{config.warmup_steps}, {cell['loss']} OPD {config.opd_steps}"
    )
    return recipe + (f" [{', '.join(config.overrides)}]" if config.overrides else "")


def _stage_recipe(base: str, record: dict[str, Any]) -> str:
    stage = record["polish"]
    overrides = stage.get("overrides", [])
    return (
        f"{base} + {stage['loss']} {stage['steps']} steps at {stage['learning_rate']:g}"
        + (f" [{', '.join(overrides)}]" if overrides else "")
        + f", kept on {record['validation']['prompts']} validation prompts"
    )


def _completions(teacher: dict[str, Any]) -> int:
    return int(teacher["count"])


def _judged(
    recipe: str,
    cell: dict[str, Any],
    source: str,
    teacher: dict[str, Any],
    points: Sequence[dict[str, Any]],
    validation: Sequence[dict[str, Any]],
    min_tokens_per_forward: float,
    within: float,
) -> BarRow:
    fast = {point_key(p): p for p in points if p["tokens_per_forward"] >= min_tokens_per_forward}
    # The validation ranking decides among the eval points fast enough on both sets; without
    # one, the eval points rank themselves.
    ranked = sorted(
        (
            (p["overall"], -order, point_key(p))
            for order, p in enumerate(validation)
            if p["tokens_per_forward"] >= min_tokens_per_forward and point_key(p) in fast
        ),
        reverse=True,
    )
    if ranked:
        best = fast[ranked[0][2]]
        validation_completions = int(validation[0]["count"])
    else:
        best = max(fast.values(), key=lambda p: p["overall"], default=None)
        validation_completions = None
    # A hair of slack so that a gap of exactly ``within`` (0.99 vs 1.00) is not lost to
    # floating-point rounding of the two fractions.
    met = best is not None and teacher["overall"] - best["overall"] <= within + 1e-9
    return BarRow(
        recipe=recipe,
        task=cell["task"],
        seed=int(cell["seed"]),
        source=source,
        completions=_completions(teacher),
        teacher=float(teacher["overall"]),
        point=best,
        met=met,
        validation_completions=validation_completions,
    )


def bar_rows(
    run_dirs: Sequence[str | Path],
    *,
    min_tokens_per_forward: float = 8.0,
    within: float = 0.01,
) -> list[BarRow]:
    """One :class:`BarRow` per (recipe, seed) found in the finished cells and polish records
    of ``run_dirs``, sorted by recipe then seed. Raises :class:`ExperimentError` naming
    ``run_dirs`` (empty), ``run_dir`` (a directory that is not a parallelism run),
    ``min_tokens_per_forward`` (not > 0) or ``within`` (not in [0, 1])."""
    if isinstance(run_dirs, (str, Path)) or not run_dirs:
        raise error("run_dirs", "name at least one parallelism run directory", run_dirs)
    if isinstance(min_tokens_per_forward, bool) or not min_tokens_per_forward > 0:
        raise error("min_tokens_per_forward", "be > 0", min_tokens_per_forward)
    if isinstance(within, bool) or not 0 <= within <= 1:
        raise error("within", "be in [0, 1]", within)
    # (recipe, seed) -> (completions, candidate arguments); the most completions win.
    best: dict[tuple[str, int], tuple[int, tuple]] = {}

    def offer(recipe, cell, source, teacher, points, validation=()) -> None:
        key = (recipe, int(cell["seed"]))
        if key not in best or _completions(teacher) > best[key][0]:
            best[key] = (_completions(teacher), (recipe, cell, source, teacher, points, validation))

    for given in run_dirs:
        run_dir = Path(given)
        config = run_config(run_dir)  # refuses a directory that is not a parallelism run
        cells = load_cells(run_dir)
        bases = {name: _base_recipe(config, stored["cell"]) for name, stored in cells.items()}
        validations = {name: _validation_points(run_dir, name) for name in cells}
        for name, stored in cells.items():
            offer(
                bases[name],
                stored["cell"],
                f"{run_dir}/cells/{name}.json",
                stored["teacher"],
                stored["points"],
                validations[name],
            )
            for path in sorted((run_dir / "reevaluations").glob(f"{name}__*.json")):
                record = read_json(path)
                offer(
                    bases[name],
                    stored["cell"],
                    str(path),
                    record["teacher"],
                    record["points"],
                    validations[name],
                )
        for path in sorted((run_dir / "polish").glob("*.json")):
            record = read_json(path)
            name = next((n for n, s in cells.items() if s["cell"] == record["cell"]), None)
            if name is None:  # a stage whose cell record is gone: no recipe to name
                continue
            cell = record["cell"]
            before = record["before"]
            offer(
                bases[name], cell, f"{path} (before)", record["teacher"], before, validations[name]
            )
            stage = _stage_recipe(bases[name], record)
            # The stage's own held-out points of the student it kept (older records: none).
            kept = record["validation"].get("after" if record["kept"] == "after" else "before", [])
            offer(stage, cell, str(path), record["teacher"], kept_points(record), kept)
    rows = [_judged(*arguments, min_tokens_per_forward, within) for _, arguments in best.values()]
    return sorted(rows, key=lambda row: (row.recipe, row.seed))


def _validation_points(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """The points of cell ``name``'s largest validation re-evaluation ([] without one)."""
    records = [
        read_json(path)
        for path in sorted((run_dir / "reevaluations" / "validation").glob(f"{name}__*.json"))
    ]
    largest = max(records, key=lambda record: _completions(record["teacher"]), default=None)
    return [] if largest is None else largest["points"]


def bar_table(
    rows: Sequence[BarRow], *, min_tokens_per_forward: float = 8.0, within: float = 0.01
) -> str:
    """A markdown table of ``rows`` and, per recipe, the seeds that meet the bar."""
    if not rows:
        return "no finished cells"
    lines = [
        f"| recipe | seed | completions | teacher | student at >= {min_tokens_per_forward:g} "
        f"tokens / forward | gap | within {within:g} |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.point is None:
            student, gap = "no point reaches it", "-"
        else:
            setting = f"{row.point['rule']} {row.point['setting']}"
            chosen = (
                "best on eval"
                if row.validation_completions is None
                else f"chosen on {row.validation_completions} validation completions"
            )
            student = (
                f"{row.point['overall']:.3f} ({setting}, {row.point['tokens_per_forward']:.2f}; "
                f"{chosen})"
            )
            gap = f"{row.gap:+.3f}"
        lines.append(
            f"| {row.recipe} | {row.seed} | {row.completions} | {row.teacher:.3f} | {student} "
            f"| {gap} | {'met' if row.met else 'not met'} |"
        )
    lines += ["", "| recipe | seeds | met on |", "|---|---|---|"]
    recipes: dict[str, list[BarRow]] = {}
    for row in rows:
        recipes.setdefault(row.recipe, []).append(row)
    for recipe, judged in recipes.items():
        seeds = ", ".join(str(row.seed) for row in judged)
        met = ", ".join(str(row.seed) for row in judged if row.met) or "none"
        lines.append(f"| {recipe} | {seeds} | {met} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distill.experiments.bar",
        description="Per recipe and seed: is the student within a margin of its teacher at a "
        "given parallelism? Reads stored records only.",
    )
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--min-tokens-per-forward", type=float, default=8.0)
    parser.add_argument("--within", type=float, default=0.01)
    args = parser.parse_args(argv)
    try:
        rows = bar_rows(
            args.run_dirs, min_tokens_per_forward=args.min_tokens_per_forward, within=args.within
        )
    except ExperimentError as failure:
        print(f"error: {failure}", file=sys.stderr)
        return 2
    print(bar_table(rows, min_tokens_per_forward=args.min_tokens_per_forward, within=args.within))
    return 0


if __name__ == "__main__":
    sys.exit(main())
