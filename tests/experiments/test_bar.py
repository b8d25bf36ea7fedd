"""The long-task bar read from stored records (``python -m distill.experiments.bar``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from distill.experiments.bar import bar_rows, bar_table, main
from distill.experiments.parallelism import FORMAT, ExperimentConfig
from distill.experiments.run_dir import ExperimentError, write_json

CONFIG = ExperimentConfig(
    warmup_steps=20, opd_steps=40, teacher_steps=30, overrides=("student.n_layers=4",)
)


def _point(rule, setting, overall, tokens_per_forward, count):
    return {
        "rule": rule,
        "setting": setting,
        "overall": overall,
        "tokens_per_forward": tokens_per_forward,
        "count": count,
    }


def _teacher(overall, count):
    return {"overall": overall, "count": count, "tokens_per_forward": 1.0}


def _run_dir(root: Path, seed: int, teacher: float, fast: float, slow: float) -> Path:
    """A run directory with one finished cell evaluated on 128 completions: a k = 16 point
    (12 tokens per forward) scoring ``fast`` and a threshold point (6) scoring ``slow``."""
    run_dir = root / f"reverse-s{seed}"
    write_json(
        run_dir / "experiment.json",
        {"format": FORMAT, "config": dataclasses.asdict(CONFIG)},
    )
    cell = {"task": "reverse", "objective": "mdlm", "loss": "reverse_kl+mean_to_go", "seed": seed}
    write_json(
        run_dir / "cells" / f"reverse__mdlm__reverse_kl+mean_to_go__seed{seed}.json",
        {
            "cell": cell,
            "teacher": _teacher(teacher, 128),
            "points": [
                _point("schedule", 16, fast, 12.0, 128),
                _point("threshold", 0.9, slow, 6.0, 128),
            ],
        },
    )
    return run_dir


def _polish(run_dir: Path, seed: int, teacher: float, before: float, after: float, kept: str):
    """A 1024-completion polish record of the run's cell (k = 16 points only)."""
    cell = {"task": "reverse", "objective": "mdlm", "loss": "reverse_kl+mean_to_go", "seed": seed}
    write_json(
        run_dir / "polish" / "stage__256x4__val128.json",
        {
            "cell": cell,
            "teacher": _teacher(teacher, 1024),
            "before": [_point("schedule", 16, before, 12.0, 1024)],
            "points": [_point("schedule", 16, after, 12.0, 1024)],
            "polish": {
                "loss": "forward_kl",
                "steps": 300,
                "learning_rate": 7e-5,
                "overrides": ["rollout.threshold=0.0"],
            },
            "validation": {"prompts": 128, "samples": 4},
            "kept": kept,
        },
    )


def test_each_recipe_and_seed_is_judged_on_its_largest_record_at_the_bar(tmp_path):
    seed0 = _run_dir(tmp_path, 0, teacher=1.0, fast=0.90, slow=1.0)
    seed1 = _run_dir(tmp_path, 1, teacher=0.95, fast=0.97, slow=0.5)
    # Seed 0's stage is kept and is exactly 1 point short (met); seed 1's is rejected.
    _polish(seed0, 0, teacher=1.0, before=0.92, after=0.99, kept="after")
    _polish(seed1, 1, teacher=0.96, before=0.96, after=0.50, kept="before")

    rows = bar_rows([seed0, seed1])

    by_key = {("forward_kl" in row.recipe, row.seed): row for row in rows}
    assert len(rows) == 4
    opd0, opd1 = by_key[(False, 0)], by_key[(False, 1)]
    # The polish record's ``before`` (1024 completions) replaces the cell's own 128.
    assert (opd0.completions, opd0.point["overall"], opd0.met) == (1024, 0.92, False)
    assert opd0.source.endswith("(before)")
    assert (opd1.completions, opd1.teacher, opd1.met) == (1024, 0.96, True)
    stage0, stage1 = by_key[(True, 0)], by_key[(True, 1)]
    assert stage0.point["overall"] == 0.99 and stage0.met
    assert stage0.gap == pytest.approx(0.01)
    # The rejected stage is judged on the student its validation kept.
    assert stage1.point["overall"] == 0.96 and stage1.met
    assert "forward_kl 300 steps at 7e-05 [rollout.threshold=0.0]" in stage1.recipe
    assert "student.n_layers=4" in stage1.recipe and "OPD 40" in stage1.recipe

    table = bar_table(rows)
    assert "| 0, 1 | 1 |" in table  # the OPD recipe: seeds 0 and 1, met on 1
    assert "| 0, 1 | 0, 1 |" in table  # the stage recipe: met on both


def test_points_below_the_parallelism_do_not_count(tmp_path):
    # The threshold point is perfect but runs at 6 tokens per forward.
    run_dir = _run_dir(tmp_path, 0, teacher=1.0, fast=0.5, slow=1.0)
    (row,) = bar_rows([run_dir])
    assert (row.point["rule"], row.met, row.completions) == ("schedule", False, 128)
    (row,) = bar_rows([run_dir], min_tokens_per_forward=5.0)
    assert (row.point["rule"], row.met) == ("threshold", True)
    (row,) = bar_rows([run_dir], min_tokens_per_forward=13.0)
    assert row.point is None and row.gap is None and not row.met
    assert "no point reaches it" in bar_table([row], min_tokens_per_forward=13.0)


def _validation(
    run_dir: Path, seed: int, fast: float, slow: float, *, prompts: int = 128, fast_speed=12.0
) -> None:
    """A validation re-evaluation (``prompts`` x 4) of the run's cell: the k = 16 point
    (``fast_speed`` tokens per forward) scoring ``fast``, the threshold point (9) ``slow``."""
    name = f"reverse__mdlm__reverse_kl+mean_to_go__seed{seed}"
    count = prompts * 4
    write_json(
        run_dir / "reevaluations" / "validation" / f"{name}__{prompts}x4.json",
        {
            "cell": {"seed": seed},
            "split": "validation",
            "teacher": _teacher(1.0, count),
            "points": [
                _point("schedule", 16, fast, fast_speed, count),
                _point("threshold", 0.9, slow, 9.0, count),
            ],
        },
    )


def test_the_reported_point_is_the_one_best_on_validation_when_there_is_one(tmp_path):
    # On eval the threshold point (made 9 tokens per forward) would win: 0.99 vs 0.97.
    run_dir = _run_dir(tmp_path, 0, teacher=1.0, fast=0.97, slow=0.99)
    cell = run_dir / "cells" / "reverse__mdlm__reverse_kl+mean_to_go__seed0.json"
    record = json.loads(cell.read_text())
    record["points"][1]["tokens_per_forward"] = 9.0
    write_json(cell, record)
    (row,) = bar_rows([run_dir])
    assert (row.point["rule"], row.validation_completions, row.met) == ("threshold", None, True)
    assert "best on eval" in bar_table([row])
    # Validation ranks k = 16 first: its eval score is reported, and it misses the bar.
    _validation(run_dir, 0, fast=0.95, slow=0.90)
    (row,) = bar_rows([run_dir])
    assert (row.point["rule"], row.point["overall"]) == ("schedule", 0.97)
    assert (row.validation_completions, row.met) == (512, False)
    assert "chosen on 512 validation completions" in bar_table([row])
    # The largest validation record decides; a point too slow there is not a choice.
    _validation(run_dir, 0, fast=0.95, slow=0.90, prompts=256, fast_speed=6.0)
    (row,) = bar_rows([run_dir])
    assert (row.point["rule"], row.validation_completions, row.met) == ("threshold", 1024, True)


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"run_dirs": []}, "run_dirs"),
        ({"run_dirs": "runs/x"}, "run_dirs"),
        ({"min_tokens_per_forward": 0}, "min_tokens_per_forward"),
        ({"min_tokens_per_forward": True}, "min_tokens_per_forward"),
        ({"within": 1.5}, "within"),
        ({"within": float("nan")}, "within"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(tmp_path, arguments, field):
    given = {"run_dirs": [_run_dir(tmp_path, 0, 1.0, 1.0, 1.0)], **arguments}
    with pytest.raises(ExperimentError, match=f"`{field}` must"):
        bar_rows(**given)


def test_command_prints_the_table_and_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, 0, teacher=1.0, fast=0.995, slow=0.5)
    assert main([str(run_dir)]) == 0
    assert "0.995 (schedule 16, 12.00; best on eval)" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2
    assert "`run_dir` must hold a distill.experiments.parallelism/v1 run" in (
        capsys.readouterr().err
    )


def test_a_polish_stage_is_judged_at_the_point_its_kept_student_won_on_validation(tmp_path):
    run_dir = _run_dir(tmp_path, 0, teacher=1.0, fast=0.9, slow=0.9)
    _polish(run_dir, 0, teacher=1.0, before=0.9, after=0.99, kept="after")
    path = run_dir / "polish" / "stage__256x4__val128.json"
    record = json.loads(path.read_text())
    record["points"].append(_point("threshold", 0.9, 0.995, 11.0, 1024))
    # The stage's held-out points rank k = 16 above the threshold (eval says the opposite).
    record["validation"]["after"] = [
        _point("schedule", 16, 0.98, 12.0, 512),
        _point("threshold", 0.9, 0.97, 11.0, 512),
    ]
    write_json(path, record)
    stage = next(row for row in bar_rows([run_dir]) if "forward_kl" in row.recipe)
    assert (stage.point["rule"], stage.point["overall"]) == ("schedule", 0.99)
    assert stage.validation_completions == 512
