"""The distributed runtime keeps the in-process loop's results: teacher replicas, rollout
workers and the learner as Ray actors over gRPC (embedded local Ray on loopback).

- max_staleness 0, one rollout worker: traces, per-step losses and final parameters equal
  the in-process loop's, bit for bit;
- two rollout workers: identical traces (tokens, action steps), losses and parameters
  within 1e-5;
- `distill run` killed with SIGKILL mid-OPD and rerun with the same command finishes with
  every data sample trained exactly once and the same parameters as an uninterrupted run.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from distill import opd, pipeline
from distill.checkpoint import RunCheckpointer
from distill.config import load_config
from distill.opd.records import load_batch
from distill.teacher import InProcessTeacher
from services.common.config import JobSpec
from services.jobs.driver import run_job
from tests.support.fakes import TINY_MODELS, TINY_PHASES, set_args

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = [
    *TINY_MODELS,
    *TINY_PHASES,
    "opd.steps=4",
    "opd.checkpoint_every=2",
    "loss.max_staleness=0",
    "cluster.record_traces=true",
    "cluster.step_timeout_s=300",
]
STEPS = 4


def job_with(*extra):
    return load_config(ROOT / "deploy/configs/tiny.yaml", JobSpec, [*OVERRIDES, *extra])


def opd_params(job, opd_dir, start):
    student = pipeline.Transformer(job.student, rngs=nnx.Rngs(0))
    nnx.update(student, jax.tree.map(np.array, nnx.state(start)))
    optimizer = pipeline.phase_train_state(student, job.opd)
    contract = json.loads((opd_dir / "contract.json").read_text())
    checkpointer = RunCheckpointer.open(opd_dir, contract)
    restored = checkpointer.restore_latest((optimizer, student))
    checkpointer.close()
    params = [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(student, nnx.Param))]
    return restored, params


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """Finished teacher and warm-up runs, shared by every run below (copied in)."""
    root = tmp_path_factory.mktemp("phases")
    job = job_with()
    pipeline.train_teacher(job, root / "teacher", progress=False, log=lambda _: None)
    pipeline.warmup_student(job, root / "student", progress=False, log=lambda _: None)
    return root


def fresh_run(phases, path):
    for name in ("teacher", "student"):
        shutil.copytree(phases / name, path / name)
    return path


@pytest.fixture(scope="module")
def in_process(phases, tmp_path_factory):
    job = job_with()
    run = fresh_run(phases, tmp_path_factory.mktemp("in_process"))
    tokenizer = pipeline.job_tokenizer(job)
    teacher = InProcessTeacher(pipeline.load_teacher_run(job, run / "teacher"), tokenizer)
    student = pipeline.load_student_run(job, run / "student")
    history, _ = opd.run_opd(
        job,
        student,
        teacher,
        tokenizer,
        run_dir=run / "opd",
        trace_dir=run / "opd" / "traces",
        progress=False,
        log=lambda _: None,
    )
    return run, history


def distributed(phases, path, *extra):
    job = job_with(*extra)
    run = fresh_run(phases, path)
    result = run_job(job, run, progress=False, log=lambda _: None)
    return job, run, result


def traces(run):
    return [load_batch(run / "opd" / "traces" / f"step-{step:07d}.npz") for step in range(STEPS)]


def test_one_worker_on_policy_matches_the_in_process_loop_bitwise(
    phases, in_process, ray_session, tmp_path
):
    local, local_history = in_process
    job, run, result = distributed(
        phases, tmp_path / "run", "cluster.rollout.count=1", "cluster.teacher.count=1"
    )
    assert result.status["step"] == STEPS and result.status["dropped_stale_rows"] == 0
    assert result.actors == {"teacher replicas": 1, "rollout workers": 1, "learner": 1}
    for got, want in zip(traces(run), traces(local), strict=True):
        for name, array in want.slots.items():
            np.testing.assert_array_equal(got.slots[name], array, err_msg=name)
        assert got.policy_version == want.policy_version == got.step
    assert [m["loss"] for m in result.history] == [m["loss"] for m in local_history]
    start = pipeline.load_student_run(job, run / "student")
    restored, params = opd_params(job, run / "opd", start)
    assert restored.step == STEPS
    assert restored.progress["ledger"] == [[0, STEPS * job.data.batch_size]]
    _, expected = opd_params(job, local / "opd", start)
    for got, want in zip(params, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert list((run / "opd" / "tensorboard").glob("events.out.tfevents.*"))


def test_two_workers_and_two_teacher_replicas_match_within_tolerance(
    phases, in_process, ray_session, tmp_path
):
    local, local_history = in_process
    job, run, result = distributed(
        phases, tmp_path / "run", "cluster.rollout.count=2", "cluster.teacher.count=2"
    )
    assert result.actors["rollout workers"] == 2 and len(result.teacher_addresses) == 2
    for got, want in zip(traces(run), traces(local), strict=True):
        np.testing.assert_array_equal(got.slots["tokens"], want.slots["tokens"])
        np.testing.assert_array_equal(got.slots["action_steps"], want.slots["action_steps"])
    np.testing.assert_allclose(
        [m["loss"] for m in result.history], [m["loss"] for m in local_history], atol=1e-5
    )
    start = pipeline.load_student_run(job, run / "student")
    _, params = opd_params(job, run / "opd", start)
    _, expected = opd_params(job, local / "opd", start)
    for got, want in zip(params, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_sigkill_mid_run_and_rerun_trains_every_sample_exactly_once(phases, in_process, tmp_path):
    local, _ = in_process
    run = fresh_run(phases, tmp_path / "run")
    sets = set_args(*OVERRIDES)
    sets += ["--set", "cluster.rollout.count=1"]
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        str(ROOT / "deploy/configs/tiny.yaml"),
        "--run-dir",
        str(run),
        "--ray-temp-dir",
        str(Path("/tmp") / f"distill-kill-{os.getpid()}"),
        "--quiet",
        *sets,
    ]
    env = os.environ | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    first = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    checkpoint = run / "opd" / "checkpoints" / "2"
    deadline = time.monotonic() + 600
    while not checkpoint.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert checkpoint.exists(), "the first run never reached its step-2 checkpoint"
    # Kill the whole process group: driver, embedded Ray and its actors, mid-step 3.
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    job = job_with()
    start = pipeline.load_student_run(job, run / "student")
    restored, params = opd_params(job, run / "opd", start)
    assert restored.step == STEPS
    assert restored.progress["ledger"] == [[0, STEPS * job.data.batch_size]]
    _, expected = opd_params(job, local / "opd", start)
    for got, want in zip(params, expected, strict=True):
        np.testing.assert_array_equal(got, want)
