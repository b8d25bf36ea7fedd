"""The accuracy-vs-parallelism experiment (``distill.experiments.parallelism``): its grid
and configuration, and a one-cell run with a handful of steps that is resumed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from distill.config import ConfigError
from distill.experiments import parallelism as experiment
from distill.experiments.polish import (
    kept_points,
    kept_side,
    polish,
    selection_score,
    selection_table,
)
from distill.experiments.reevaluate import reevaluate, table

TINY = (
    "teacher.d_model=32",
    "teacher.d_ff=64",
    "student.d_model=32",
    "student.d_ff=64",
    "data.batch_size=4",
)
CONFIG = experiment.ExperimentConfig(
    warmup_steps=2,
    opd_steps=2,
    teacher_steps=2,
    checkpoint_every=1,
    eval_prompts=2,
    samples=2,
    ks=(1, 16),
    thresholds=(0.9,),
    overrides=TINY,
)
CELL = "agree16__mdlm__reverse_kl+mean_to_go__seed0"
GRID = {
    "tasks": ["agree16"],
    "objectives": ["mdlm"],
    "losses": ["reverse_kl+mean_to_go"],
    "seeds": [0],
}


def test_the_grid_names_the_issue_objectives_and_losses():
    assert set(experiment.OBJECTIVES) == {"mdlm", "self_corrupted", "coordination", "cmd"}
    assert list(experiment.LOSS_VARIANTS) == [
        "none",
        "reverse_kl+mean_to_go",
        "reverse_kl+sequence",
        "forward_kl",
        "jsd",
        "planner",
        "planner+cost",
    ]
    assert {"agree16", "copy", "reverse", "sort", "addition", "addition_lsb"} <= set(
        experiment.TASK_SPECS
    )
    for name in ("addition", "addition_lsb"):  # validated: the rows fit the 128-slot models
        job = experiment.cell_job(name, "mdlm", "none", 0, CONFIG)
        assert job.data.tasks == (name,) and (job.data.min_length, job.data.max_length) == (16, 32)
    with pytest.raises(experiment.ExperimentError, match="`variant.name` must not be"):
        experiment.register_loss_variant(experiment.LOSS_VARIANTS["none"])


def test_a_cell_job_applies_the_objective_loss_seed_and_steps():
    job = experiment.cell_job("reverse", "cmd", "reverse_kl+sequence", 2, CONFIG)
    assert job.data.tasks == ("reverse",) and (job.data.min_length, job.data.max_length) == (16, 32)
    assert (job.objective.kind, job.loss.kind, job.loss.advantage) == (
        "cmd",
        "reverse_kl",
        "sequence",
    )
    assert (job.seed, job.student_warmup.steps, job.opd.steps) == (2, 2, 2)
    assert job.student.d_model == 32
    assert experiment.cell_job("agree16", "mdlm", "jsd", 0, CONFIG).loss.kind == "jsd"
    with pytest.raises(experiment.ExperimentError, match="`losses` must name"):
        experiment.cell_job("agree16", "mdlm", "no-such-loss", 0, CONFIG)


def test_an_override_is_validated_against_the_experiments_phase_length():
    # reverse's task config runs OPD for 200 steps; the experiment runs 400, so a 300-step
    # learning-rate warm-up fits, in the warm-up-only cell as in the OPD cell.
    config = experiment.ExperimentConfig(
        warmup_steps=2,
        opd_steps=400,
        teacher_steps=2,
        overrides=(*TINY, "opd.optimizer.schedule=cosine", "opd.optimizer.warmup_steps=300"),
    )
    for loss in ("none", "reverse_kl+mean_to_go"):
        job = experiment.cell_job("reverse", "mdlm", loss, 1, config)
        assert (job.opd.steps, job.opd.optimizer.warmup_steps, job.seed) == (400, 300, 1)
    # The task config's own cosine warm-up (50 steps) shrinks to fit a 2-step phase.
    short = experiment.cell_job("reverse", "mdlm", "none", 0, CONFIG)
    assert short.student_warmup.optimizer.warmup_steps == 0
    too_long = dataclasses.replace(config, opd_steps=300)
    with pytest.raises(ConfigError, match="`opd.steps` must exceed"):
        experiment.cell_job("reverse", "mdlm", "none", 0, too_long)
    # The cell's seed wins over an override of it.
    seeded = dataclasses.replace(CONFIG, overrides=(*TINY, "seed=7"))
    assert experiment.cell_job("reverse", "mdlm", "none", 2, seeded).seed == 2


def test_the_planner_variants_roll_out_with_the_learned_commit_rule():
    plain = experiment.cell_job("agree16", "mdlm", "planner", 0, CONFIG)
    costly = experiment.cell_job("agree16", "mdlm", "planner+cost", 0, CONFIG)
    for job in (plain, costly):
        assert (job.rollout.commit_rule, job.loss.kind, job.loss.advantage) == (
            "planner",
            "reverse_kl",
            "mean_to_go",
        )
        assert job.student.planner_hidden == experiment.PLANNER_HIDDEN
    assert (plain.loss.forward_cost, costly.loss.forward_cost) == (
        0.0,
        experiment.PLANNER_FORWARD_COST,
    )


def test_config_is_validated():
    with pytest.raises(experiment.ExperimentError, match="`ks` must"):
        experiment.ExperimentConfig(ks=(0,))
    with pytest.raises(experiment.ExperimentError, match="`thresholds` must"):
        experiment.ExperimentConfig(thresholds=(1.5,))
    with pytest.raises(experiment.ExperimentError, match="`opd_steps` must"):
        experiment.ExperimentConfig(opd_steps=0)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("parallelism")
    cells = experiment.run(CONFIG, run_dir, progress=False, log=lambda message: None, **GRID)
    return run_dir, cells


@pytest.mark.slow
def test_reevaluation_scores_the_finished_cell_on_more_prompts_and_trains_nothing(finished):
    run_dir, _ = finished
    checkpoints = run_dir / "opd" / CELL / "checkpoints"
    before = sorted(path.name for path in checkpoints.iterdir())
    quiet = dict(prompts=3, samples=2, ks=[16], thresholds=[0.9], log=lambda message: None)
    record = reevaluate(run_dir, **quiet)[CELL]
    assert (record["prompts"], record["samples"], record["teacher"]["count"]) == (3, 2, 6)
    assert [(p["rule"], p["setting"], p["count"]) for p in record["points"]] == [
        ("schedule", 16, 6),
        ("threshold", 0.9, 6),
    ]
    assert set(record["points"][0]["misses"]) == {"stopped_late", "stopped_early", "wrong_symbols"}
    assert sorted(path.name for path in checkpoints.iterdir()) == before
    saved = run_dir / "reevaluations" / f"{CELL}__3x2.json"
    assert json.loads(saved.read_text()) == record
    assert reevaluate(run_dir, **quiet)[CELL] == record  # reused, not recomputed
    assert CELL in table({CELL: record}) and "schedule 16" in table({CELL: record})


@pytest.mark.slow
def test_reevaluation_at_another_threshold_adds_the_point_a_single_call_would_measure(finished):
    run_dir, _ = finished
    quiet = dict(prompts=2, samples=2, ks=[16], thresholds=[0.9], log=lambda message: None)
    first = reevaluate(run_dir, **quiet)[CELL]
    wider = reevaluate(run_dir, **(quiet | {"thresholds": [0.5, 0.9]}))[CELL]
    assert [(p["rule"], p["setting"]) for p in wider["points"]] == [
        ("schedule", 16),
        ("threshold", 0.5),
        ("threshold", 0.9),
    ]
    assert [wider["points"][0], wider["points"][2]] == first["points"]  # reused
    saved = run_dir / "reevaluations" / f"{CELL}__2x2.json"
    assert len(json.loads(saved.read_text())["points"]) == 3  # the record keeps every point
    assert reevaluate(run_dir, **quiet)[CELL] == first  # the table shows what was asked
    saved.unlink()
    assert reevaluate(run_dir, **(quiet | {"thresholds": [0.5, 0.9]}))[CELL] == wider
    # Held-out prompts (for `bar` to choose a point on) are kept apart from the eval records.
    with pytest.raises(experiment.ExperimentError, match="`split` must be one of"):
        reevaluate(run_dir, **quiet, split="train")
    held_out = reevaluate(run_dir, **quiet, split="validation")[CELL]
    assert held_out["split"] == "validation" and held_out["teacher"]["count"] == 4
    stored = run_dir / "reevaluations" / "validation" / f"{CELL}__2x2.json"
    assert json.loads(stored.read_text()) == held_out
    assert json.loads(saved.read_text())["split"] == "eval"


@pytest.mark.slow
def test_reevaluation_of_named_cells_scores_only_those_and_refuses_an_unfinished_name(finished):
    run_dir, _ = finished
    quiet = dict(prompts=2, samples=2, ks=[16], thresholds=[0.9], log=lambda message: None)
    # A second finished cell (a copy of the record under another name) that is not asked for.
    other = run_dir / "cells" / "other__seed0.json"
    other.write_text((run_dir / "cells" / f"{CELL}.json").read_text())
    try:
        assert set(reevaluate(run_dir, **quiet, cells=[CELL])) == {CELL}
        assert not (run_dir / "reevaluations" / "other__seed0__2x2.json").exists()
        for cells in ([CELL.replace("seed0", "seed1")], []):
            with pytest.raises(experiment.ExperimentError, match="`cells` must name finished"):
                reevaluate(run_dir, **quiet, cells=cells)
    finally:
        other.unlink()


@pytest.mark.slow
def test_a_polish_stage_continues_each_opd_cell_keeps_the_held_out_winner_and_reuses_it(finished):
    run_dir, _ = finished
    checkpoints = run_dir / "opd" / CELL / "checkpoints"
    before = sorted(path.name for path in checkpoints.iterdir())
    quiet = dict(prompts=2, samples=2, ks=[16], thresholds=[0.9], log=lambda message: None)
    # The stage trains on one-forward-per-block rollouts: its override names the stage.
    stage = f"{CELL}__forward_kl__2__lr0.0001__rollout.threshold=0.0"
    settings = dict(
        loss="forward_kl",
        steps=2,
        learning_rate=1e-4,
        validation_prompts=3,
        overrides=["rollout.threshold=0.0"],
    )
    with pytest.raises(experiment.ExperimentError, match="`overrides` must give a valid job"):
        polish(run_dir, **(settings | {"overrides": ["rollout.threshold=2.0"]}), **quiet)
    assert not (run_dir / "polish").exists()  # refused before anything trained
    record = polish(run_dir, **settings, **quiet)[stage]
    assert record["polish"] == {
        "loss": "forward_kl",
        "steps": 2,
        "learning_rate": 1e-4,
        "overrides": ["rollout.threshold=0.0"],
    }
    for points in (record["points"], record["before"]):
        assert [(p["rule"], p["count"]) for p in points] == [("schedule", 4), ("threshold", 4)]
    validation = record["validation"]
    assert (validation["prompts"], validation["samples"]) == (3, 2)
    for points in (validation["before"], validation["after"]):
        assert [(p["rule"], p["count"]) for p in points] == [("schedule", 6), ("threshold", 6)]
    assert record["kept"] == kept_side(validation["before"], validation["after"])
    improved = record["kept"] == "after"
    assert kept_points(record) == (record["points"] if improved else record["before"])
    assert (run_dir / record["kept_run"] / "checkpoints").is_dir()
    assert stage in selection_table({stage: record})
    contract = json.loads((run_dir / "polish" / stage / "contract.json").read_text())
    assert "forward_kl" in json.dumps(contract)
    assert contract["rollout"]["threshold"] == 0.0
    assert sorted(path.name for path in (run_dir / "polish" / stage / "checkpoints").iterdir())
    assert sorted(path.name for path in checkpoints.iterdir()) == before  # the cell is only read
    assert (run_dir / "polish" / f"{stage}__2x2__val3.json").is_file()
    again = polish(run_dir, **settings, **quiet)[stage]
    assert again == record  # reused, not retrained
    # The kept student was judged at these points; other points are another judgement.
    with pytest.raises(experiment.ExperimentError, match="`ks and thresholds` must be the points"):
        polish(run_dir, **settings, **(quiet | {"thresholds": [0.5, 0.9]}))


@pytest.mark.slow
def test_a_polish_stage_the_guard_stops_is_judged_at_its_last_checkpoint(finished, monkeypatch):
    from distill import pipeline
    from tests.support.fakes import ScriptedTeacher

    run_dir, _ = finished
    real = pipeline.in_process_teacher
    # Each scoring call is 5 nats lower than the last: the stage's second step trips.
    monkeypatch.setattr(
        pipeline,
        "in_process_teacher",
        lambda job, model: ScriptedTeacher(real(job, model), drift=5.0),
    )
    guard = ["guard.max_teacher_logp_drop=1.0", "guard.window=1"]
    said: list[str] = []
    settings = dict(loss="forward_kl", steps=3, learning_rate=1e-4, validation_prompts=3)
    evaluation = dict(prompts=2, samples=2, ks=[16], thresholds=[0.9])
    records = polish(run_dir, **settings, **evaluation, overrides=guard, log=said.append)
    stage = "__".join((f"{CELL}__forward_kl__3__lr0.0001", *guard))
    record = records[stage]
    saved = sorted(
        int(path.name) for path in (run_dir / "polish" / stage / "checkpoints").iterdir()
    )
    assert record["stopped"]["step"] == saved[-1] == 1  # step 2 tripped and was not saved
    assert "guard.max_teacher_logp_drop=1.0" in record["stopped"]["reason"]
    assert any(line.startswith(f"{stage}: `metrics.teacher_logp` must stay") for line in said)
    assert record["kept"] == kept_side(
        record["validation"]["before"], record["validation"]["after"]
    )
    assert "stage stopped by the guard at step 1" in selection_table(records)
    again = polish(run_dir, **settings, **evaluation, overrides=guard, log=said.append)
    assert again == records  # the stopped stage's record is reused, not retrained


def test_the_kept_student_must_win_on_held_out_prompts_strictly():
    def points(*scores):
        return [{"overall": score} for score in scores]

    assert selection_score(points(1.0, 0.5)) == 0.75
    assert kept_side(points(0.8, 0.9), points(0.9, 0.9)) == "after"
    assert kept_side(points(0.9, 0.9), points(0.9, 0.9)) == "before"  # a tie keeps no stage
    assert kept_side(points(0.9, 0.9), points(1.0, 0.7)) == "before"
    with pytest.raises(experiment.ExperimentError, match="`points` must hold"):
        selection_score([])
    record = {"points": points(0.9), "before": points(0.8), "kept": "before"}
    assert kept_points(record) == points(0.8)
    assert kept_points(record | {"kept": "after"}) == points(0.9)


def test_evaluation_phases_read_only_held_out_splits(tmp_path):
    with pytest.raises(
        experiment.ExperimentError, match=r"`split` must be one of \[.eval., .validation.\]"
    ):
        experiment.Phases(tmp_path, CONFIG, print, "train")


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("loss", {"loss": "none"}),
        ("loss", {"loss": "no_such_loss"}),
        ("steps", {"steps": 0}),
        ("learning_rate", {"learning_rate": 0.0}),
        ("validation_prompts", {"validation_prompts": 0}),
        ("overrides", {"overrides": ["rollout.threshold"]}),
        ("overrides", {"overrides": ["data.path=a/b"]}),
        ("overrides", {"overrides": "rollout.threshold=0.0"}),
    ],
)
def test_a_polish_stage_refuses_bad_settings_naming_the_field(tmp_path, field, changes):
    settings = dict(loss="forward_kl", steps=2, learning_rate=1e-4, prompts=2, samples=2)
    with pytest.raises(experiment.ExperimentError, match=f"`{field}` must"):
        polish(tmp_path, **(settings | changes), ks=[16], thresholds=[0.9])


def test_reevaluation_refuses_a_directory_that_is_not_a_parallelism_run(tmp_path):
    with pytest.raises(experiment.ExperimentError, match="`run_dir` must hold"):
        reevaluate(tmp_path, prompts=3, samples=2, ks=[16], thresholds=[0.9])


@pytest.mark.slow
def test_a_one_cell_grid_writes_its_cell_and_the_report(finished):
    run_dir, cells = finished
    record = json.loads((run_dir / "cells" / f"{CELL}.json").read_text())
    assert cells == {CELL: record}
    assert record["cell"] == {
        "task": "agree16",
        "objective": "mdlm",
        "loss": "reverse_kl+mean_to_go",
        "seed": 0,
    }
    assert [(p["rule"], p["setting"]) for p in record["points"]] == [
        ("schedule", 1),
        ("schedule", 16),
        ("threshold", 0.9),
    ]
    one, sixteen = record["points"][0], record["points"][1]
    assert one["tokens_per_forward"] == 1.0 and sixteen["tokens_per_forward"] > 4.0
    assert one["count"] == 4 and one["distinct_fraction"] is not None
    assert record["teacher"]["tokens_per_forward"] == 1.0
    assert [entry["step"] for entry in record["opd_evaluations"]] == [0, 2]
    text = (run_dir / "report.md").read_text()
    for needle in (
        "## agree16",
        "teacher (causal)",
        "mdlm + reverse_kl+mean_to_go",
        "AUP sched.",
        "k=16",
        "τ=0.9",
        "plot-agree16.png",
        "--tasks agree16 --objectives mdlm --losses reverse_kl+mean_to_go --seeds 0 "
        "--warmup-steps 2 --opd-steps 2 --teacher-steps 2",
        "--set student.d_model=32",
    ):
        assert needle in text
    assert (run_dir / "plot-agree16.png").stat().st_size > 0


@pytest.mark.slow
def test_a_second_invocation_reuses_the_finished_cell(finished):
    run_dir, cells = finished
    path = run_dir / "cells" / f"{CELL}.json"
    before = path.stat().st_mtime_ns
    said: list[str] = []
    again = experiment.run(CONFIG, run_dir, progress=False, log=said.append, **GRID)
    assert again == cells and path.stat().st_mtime_ns == before
    assert f"reusing {path}" in said


@pytest.mark.slow
def test_an_interrupted_cell_is_recomputed_from_its_checkpoints_identically(finished):
    run_dir, cells = finished
    (run_dir / "cells" / f"{CELL}.json").unlink()  # as if stopped before the cell was written
    said: list[str] = []
    again = experiment.run(CONFIG, run_dir, progress=False, log=said.append, **GRID)
    assert again == cells
    # nothing was retrained: the OPD run was restored at its last step
    assert any("at step 2" in message for message in said)


def test_a_run_directory_refuses_other_step_counts(tmp_path):
    (tmp_path / "experiment.json").write_text(
        json.dumps({"format": experiment.FORMAT, "config": CONFIG.to_dict()})
    )
    other = experiment.ExperimentConfig(
        **{
            **CONFIG.to_dict(),
            "opd_steps": 3,
            "ks": (1, 16),
            "thresholds": (0.9,),
            "overrides": TINY,
        }
    )
    with pytest.raises(experiment.ExperimentError, match="opd_steps: 2 -> 3"):
        experiment.run(other, tmp_path, progress=False, **GRID)


def test_the_command_line_refuses_an_unknown_loss(tmp_path, capsys):
    assert experiment.main(["--run-dir", str(tmp_path), "--losses", "no-such-loss"]) == 2
    assert "`losses` must name" in capsys.readouterr().err


@pytest.mark.slow
def test_a_planner_cell_shares_the_warm_up_and_is_evaluated_with_its_own_rule(finished):
    run_dir, cells = finished
    warmup = run_dir / "warmup" / "agree16__mdlm__seed0"
    before = sorted(path.stat().st_mtime_ns for path in warmup.rglob("*") if path.is_file())
    said: list[str] = []
    grid = {**GRID, "losses": ["planner"]}
    after = experiment.run(CONFIG, run_dir, progress=False, log=said.append, **grid)
    record = after["agree16__mdlm__planner__seed0"]
    # the reverse-KL cell's warm-up (trained without the head) is reused, not retrained
    assert sorted(path.stat().st_mtime_ns for path in warmup.rglob("*") if path.is_file()) == before
    assert (
        json.loads((warmup / "contract.json").read_text())["student"].get("planner_hidden") is None
    )
    assert any("initialized a fresh planner head" in message for message in said)
    assert [(p["rule"], p["setting"]) for p in record["points"]][-1] == ("planner", "as trained")
    assert record["points"][-1]["count"] == 4
    assert [entry["step"] for entry in record["opd_evaluations"]] == [0, 2]
    assert after[CELL] == cells[CELL]


@pytest.mark.slow
def test_a_cell_the_guard_stops_is_recorded_and_measured_at_its_last_checkpoint(
    tmp_path, monkeypatch
):
    from distill import pipeline
    from tests.support.fakes import ScriptedTeacher

    real = pipeline.in_process_teacher
    # Each scoring call is 5 nats lower than the last: step 1's window is 5 below the start.
    monkeypatch.setattr(
        pipeline,
        "in_process_teacher",
        lambda job, model: ScriptedTeacher(real(job, model), drift=5.0),
    )
    guarded = dataclasses.replace(
        CONFIG, overrides=(*TINY, "guard.max_teacher_logp_drop=1.0", "guard.window=1")
    )
    said: list[str] = []
    cells = experiment.run(guarded, tmp_path, progress=False, log=said.append, **GRID)
    record = cells[CELL]
    assert record["stopped"]["step"] == 1
    assert "guard.max_teacher_logp_drop=1.0" in record["stopped"]["reason"]
    assert [entry["step"] for entry in record["opd_evaluations"]] == [0]
    assert len(record["points"]) == 3  # the student of the step-1 checkpoint was evaluated
    assert any(line.startswith(f"{CELL}: `metrics.teacher_logp` must stay") for line in said)
    assert f"`{CELL}`: OPD stopped by the guard at step 1" in (tmp_path / "report.md").read_text()
