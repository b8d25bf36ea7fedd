"""The OPD phase is resumable: interrupted runs end bitwise identical to an uninterrupted one,
the data ledger proves exactly-once, and every run-contract field refuses a changed setup."""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from distill import checkpoint, opd, pipeline
from distill.checkpoint import ContractMismatch, RunCheckpointer
from distill.config import JobConfig, load_config
from distill.teacher import InProcessTeacher, model_hash

OVERRIDES = [
    "teacher.d_model=32",
    "teacher.d_ff=64",
    "student.d_model=32",
    "student.d_ff=64",
    "student_init=scratch",
    "data.batch_size=4",
    "opd.steps=4",
    "opd.checkpoint_every=2",
    "opd.eval_examples=4",
    "opd.optimizer.learning_rate=0.01",
]
SILENT = dict(progress=False, log=lambda _: None)


def tiny_job(*extra):
    return load_config("deploy/configs/tiny.yaml", JobConfig, [*OVERRIDES, *extra])


def models(job):
    teacher = pipeline.Transformer(job.teacher, rngs=nnx.Rngs(0))
    student = pipeline.Transformer(job.student, rngs=nnx.Rngs(1))
    return teacher, student


def params(model):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    job = tiny_job()
    tokenizer = pipeline.job_tokenizer(job)
    teacher_model, student = models(job)
    teacher = InProcessTeacher(teacher_model, tokenizer)
    run = tmp_path_factory.mktemp("opd")
    history, reports = opd.run_opd(job, student, teacher, tokenizer, run_dir=run, **SILENT)
    return job, tokenizer, teacher, run, history, reports, params(student)


def test_interrupted_opd_resumes_bitwise_identical_with_every_sample_trained_once(
    uninterrupted, tmp_path
):
    job, tokenizer, teacher, _, history, reports, expected = uninterrupted
    losses = []
    for stop in (1, 3, None):  # each call starts from the same initial student, as a CLI would
        _, student = models(job)
        part, got_reports = opd.run_opd(
            job, student, teacher, tokenizer, run_dir=tmp_path, stop_after=stop, **SILENT
        )
        losses += [metrics["loss"] for metrics in part]
    assert losses == [metrics["loss"] for metrics in history]
    for got, want in zip(params(student), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert [step for step, _ in got_reports] == [step for step, _ in reports] == [0, 4]
    assert got_reports[-1][1] == reports[-1][1]
    progress = json.loads((tmp_path / "checkpoints" / "4" / "progress" / "metadata").read_text())
    assert progress["ledger"] == [[0, 4 * 4]] and progress["policy_version"] == 4


def test_a_finished_run_called_again_trains_nothing(uninterrupted):
    job, tokenizer, teacher, run, _, reports, expected = uninterrupted
    _, student = models(job)
    history, again = opd.run_opd(job, student, teacher, tokenizer, run_dir=run, **SILENT)
    assert history == [] and [step for step, _ in again] == [step for step, _ in reports]
    for got, want in zip(params(student), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def contract(job, teacher, student):
    return pipeline.phase_contract(
        job,
        pipeline.job_tokenizer(job),
        "opd",
        teacher_hash=teacher.info().model_hash,
        student_hash=model_hash(student),
    )


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.threshold=0.5", "rollout.threshold"),
        ("rollout.temperature=0.7", "rollout.temperature"),
        ("rollout.greedy=true", "rollout.greedy"),
        ("student.block_size=2", "student.block_size"),
        ("loss.kind=jsd", "loss.kind"),
        ("loss.advantage=sequence", "loss.advantage"),
        ("loss.group_size=2", "loss.group_size"),
        ("opd.optimizer.learning_rate=0.02", "training.optimizer.learning_rate"),
        ("opd.steps=6", "training.steps"),
        ("opd.eval_examples=8", "eval_examples"),
        ("data.seed=7", "data.seed"),
        ("seed=3", "seed"),
        ("tokenizer.stop_tokens=['|']", "special_ids.stop"),
        ("teacher.rope_theta=500.0", "teacher.rope_theta"),
    ],
)
def test_each_changed_opd_contract_field_is_refused_by_name(uninterrupted, override, field):
    _, _, teacher, run, *_ = uninterrupted
    job = tiny_job(override)
    _, student = models(tiny_job())
    with pytest.raises(ContractMismatch, match=f"`{field}`"):
        RunCheckpointer.open(run, contract(job, teacher, student))


def test_a_different_teacher_or_starting_student_is_refused(uninterrupted, tmp_path):
    job, tokenizer, teacher, run, *_ = uninterrupted
    _, student = models(job)
    other = InProcessTeacher(pipeline.Transformer(job.teacher, rngs=nnx.Rngs(5)), tokenizer)
    with pytest.raises(ContractMismatch, match="`teacher_hash`"):
        RunCheckpointer.open(run, contract(job, other, student))
    moved = pipeline.Transformer(job.student, rngs=nnx.Rngs(6))
    with pytest.raises(ContractMismatch, match="`student_start_hash`"):
        opd.run_opd(job, moved, teacher, tokenizer, run_dir=run, **SILENT)


def test_a_different_topology_is_recorded_not_refused(uninterrupted, monkeypatch):
    job, _, teacher, run, *_ = uninterrupted
    _, student = models(job)
    real = checkpoint.topology()
    monkeypatch.setattr(checkpoint, "topology", lambda: real | {"device_count": 8})
    opened = RunCheckpointer.open(run, contract(job, teacher, student))
    assert opened.recorded_changes == {"topology.device_count": (real["device_count"], 8)}
    opened.close()


def test_a_corrupt_latest_opd_checkpoint_falls_back_and_retrains_the_same_steps(
    uninterrupted, tmp_path
):
    job, tokenizer, teacher, run, _, _, expected = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for path in (copy / "checkpoints" / "4" / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"")
    _, student = models(job)
    history, _ = opd.run_opd(job, student, teacher, tokenizer, run_dir=copy, **SILENT)
    assert len(history) == 2  # steps 2 and 3 again, from the good checkpoint at step 2
    for got, want in zip(params(student), expected, strict=True):
        np.testing.assert_array_equal(got, want)
