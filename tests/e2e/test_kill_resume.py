"""Slow: a teacher-training process and an OPD process, each killed with SIGKILL mid-run and
resumed, end with the same parameters, bit for bit, as uninterrupted runs; the trained data
positions form one contiguous range with no sample trained twice."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from distill import pipeline
from distill.checkpoint import RunCheckpointer
from distill.config import JobConfig, load_config

OVERRIDES = [
    "teacher.d_model=32",
    "teacher.d_ff=64",
    "student.d_model=32",
    "student.d_ff=64",
    "teacher_training.steps=12",
    "teacher_training.checkpoint_every=2",
    "teacher_training.eval_examples=4",
    "teacher_training.optimizer.warmup_steps=2",
    "data.batch_size=8",
]


def command(run_dir):
    args = [sys.executable, "-m", "services.cli", "train-teacher", "deploy/configs/tiny.yaml"]
    args += ["--run-dir", str(run_dir), "--quiet"]
    for override in OVERRIDES:
        args += ["--set", override]
    return args


def final_params(run_dir):
    job = load_config("deploy/configs/tiny.yaml", JobConfig, OVERRIDES)
    model = pipeline.Transformer(job.teacher, rngs=nnx.Rngs(123))  # overwritten by restore
    optimizer = pipeline.make_train_state(model, job.teacher_training.optimizer, 12)
    contract = pipeline.phase_contract(job, pipeline.job_tokenizer(job), "teacher_training")
    checkpointer = RunCheckpointer.open(run_dir, contract)
    restored = checkpointer.restore_latest((optimizer, model))
    checkpointer.close()
    assert restored.step == 12
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]


def kill_after_second_checkpoint(args, run_dir):
    """Start ``args`` and SIGKILL it as soon as its step-4 checkpoint exists: mid-run,
    between checkpoints of a 12-step run saving every 2 steps."""
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "4").is_dir():
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] < 12


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_is_bitwise_identical(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(command(whole), check=True, timeout=600, capture_output=True)

    kill_after_second_checkpoint(command(killed), killed)

    subprocess.run(command(killed), check=True, timeout=600, capture_output=True)
    for got, want in zip(final_params(killed), final_params(whole), strict=True):
        np.testing.assert_array_equal(got, want)

    # The data ledger: every checkpoint records the trained position; the lineage of the
    # final model read positions [0, 12 * 8) once each.
    progress = json.loads((killed / "checkpoints" / "12" / "progress" / "metadata").read_text())
    assert progress["data_position"] == 12 * 8
    assert progress["ledger"] == [[0, 12 * 8]]


# ---- the OPD phase: `distill opd` killed mid-run ---------------------------------------------

OPD_OVERRIDES = [
    *OVERRIDES[:4],
    "student_init=scratch",
    "data.batch_size=4",
    "teacher_training.steps=2",
    "teacher_training.optimizer.warmup_steps=1",
    "teacher_training.eval_examples=2",
    "student_warmup.steps=2",
    "student_warmup.optimizer.warmup_steps=1",
    "student_warmup.eval_examples=2",
    "opd.steps=12",
    "opd.checkpoint_every=2",
    "opd.eval_examples=2",
]


def opd_command(run_dir, teacher_run, student_run):
    args = [sys.executable, "-m", "services.cli", "opd", "deploy/configs/tiny.yaml", "--quiet"]
    args += ["--run-dir", str(run_dir), "--teacher-run", str(teacher_run)]
    args += ["--student-run", str(student_run)]
    for override in OPD_OVERRIDES:
        args += ["--set", override]
    return args


def opd_final(job, run_dir, student_run):
    student = pipeline.load_student_run(job, student_run)
    optimizer = pipeline.phase_train_state(student, job.opd)
    checkpointer = RunCheckpointer.open(
        run_dir, json.loads((run_dir / "contract.json").read_text())
    )
    restored = checkpointer.restore_latest((optimizer, student))
    checkpointer.close()
    assert restored.step == 12
    params = [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(student, nnx.Param))]
    return params, restored.progress


@pytest.mark.slow
def test_sigkill_mid_opd_then_resume_is_bitwise_identical_and_exactly_once(tmp_path):
    from services import cli

    job = load_config("deploy/configs/tiny.yaml", JobConfig, OPD_OVERRIDES)
    config = ["deploy/configs/tiny.yaml", "--quiet"]
    config += [part for override in OPD_OVERRIDES for part in ("--set", override)]
    teacher_run, student_run = tmp_path / "teacher", tmp_path / "student"
    assert cli.main(["train-teacher", *config, "--run-dir", str(teacher_run)]) == 0
    assert cli.main(["warmup-student", *config, "--run-dir", str(student_run)]) == 0
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(
        opd_command(whole, teacher_run, student_run), check=True, timeout=600, capture_output=True
    )

    kill_after_second_checkpoint(opd_command(killed, teacher_run, student_run), killed)

    subprocess.run(
        opd_command(killed, teacher_run, student_run), check=True, timeout=600, capture_output=True
    )
    got, progress = opd_final(job, killed, student_run)
    want, _ = opd_final(job, whole, student_run)
    for got_leaf, want_leaf in zip(got, want, strict=True):
        np.testing.assert_array_equal(got_leaf, want_leaf)
    assert progress["ledger"] == [[0, 12 * 4]] and progress["policy_version"] == 12
