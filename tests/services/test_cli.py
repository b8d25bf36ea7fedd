"""The `distill` command: configuration errors are one line per field, exit status 2."""

from services import cli


def test_unknown_override_is_reported_by_field_with_exit_status_two(tmp_path, capsys):
    status = cli.main(
        [
            "train-teacher",
            "deploy/configs/tiny.yaml",
            "--run-dir",
            str(tmp_path),
            "--set",
            "teacher.n_layers=-1",
        ]
    )
    assert status == 2
    assert "`teacher.n_layers` must be greater than 0" in capsys.readouterr().err


def test_warmup_from_teacher_requires_a_teacher_run(tmp_path, capsys):
    status = cli.main(["warmup-student", "deploy/configs/tiny.yaml", "--run-dir", str(tmp_path)])
    assert status == 2
    assert "`--teacher-run`" in capsys.readouterr().err


def test_short_teacher_run_through_the_cli_writes_checkpoints_and_a_report(tmp_path):
    overrides = [
        "teacher.d_model=32",
        "teacher.d_ff=64",
        "student.d_model=32",
        "student.d_ff=64",
        "teacher_training.steps=2",
        "teacher_training.optimizer.warmup_steps=1",
        "teacher_training.eval_examples=4",
        "data.batch_size=4",
    ]
    args = ["train-teacher", "deploy/configs/tiny.yaml", "--run-dir", str(tmp_path), "--quiet"]
    for override in overrides:
        args += ["--set", override]
    assert cli.main(args) == 0
    assert (tmp_path / "contract.json").exists() and (tmp_path / "eval.json").exists()
    assert (tmp_path / "checkpoints" / "2").is_dir()
