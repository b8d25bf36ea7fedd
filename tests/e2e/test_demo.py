"""`make demo` runs end to end (the same entry point, shortened, in a subprocess) on the
distributed runtime: an embedded Ray with a teacher replica, two rollout workers and the
learner as actors over gRPC."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_every_phase_and_writes_the_report_and_plot(tmp_path):
    shorter = [
        "teacher_training.steps=30",
        "teacher_training.eval_examples=16",
        "student_warmup.steps=30",
        "student_warmup.eval_examples=16",
        "opd.steps=3",
        "opd.eval_examples=16",
    ]
    command = [sys.executable, "-m", "services.demo", "--run-dir", str(tmp_path), "--quiet"]
    command += ["--ray-temp-dir", f"/tmp/distill-demo-{os.getpid()}"]
    command += ["--eval-examples", "16"]
    for override in shorter:
        command += ["--set", override]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"teacher", "warmed_up", "opd"} <= report.keys()
    # The sweep goes from one token per forward to the whole completion in one forward.
    per_forward = [entry["tokens_per_forward"] for entry in report["opd"]]
    assert per_forward[0] > per_forward[-1] == pytest.approx(1.0)
    assert (tmp_path / "accuracy_vs_parallelism.png").stat().st_size > 1000
    text = (tmp_path / "report.md").read_text()
    assert "| OPD student |" in text
    assert (
        "runtime distributed (Ray, gRPC): 1 teacher replicas, 2 rollout workers, 1 learner" in text
    )
    assert report["runtime"].startswith("distributed")
