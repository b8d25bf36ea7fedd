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
from distill.curves import read_curves
from distill.teacher import InProcessTeacher, model_hash

OVERRIDES = [
    # One layer each: resume, ledger and contract checks do not depend on depth, and every
    # rollout, update and evaluation shape here is compiled once per module.
    "teacher.d_model=32",
    "teacher.d_ff=64",
    "teacher.n_layers=1",
    "student.d_model=32",
    "student.d_ff=64",
    "student.n_layers=1",
    "student_init=scratch",
    "data.batch_size=4",
    "opd.steps=4",
    "opd.checkpoint_every=2",
    "opd.eval_examples=4",
    "opd.optimizer.learning_rate=0.01",
]
SILENT = dict(progress=False, log=lambda _: None)
QUIET = dict(log=lambda _: None)


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
    # the TensorBoard curves of the three calls are those of the uninterrupted run
    run = uninterrupted[3]
    curves = read_curves(tmp_path / "tensorboard")
    assert [step for step, _ in curves["opd/loss"]] == [1, 2, 3, 4]
    assert curves == read_curves(run / "tensorboard")
    assert [step for step, _ in curves["eval/exact_match"]] == [0, 4]


def test_a_finished_run_called_again_trains_nothing(uninterrupted):
    job, tokenizer, teacher, run, _, reports, expected = uninterrupted
    _, student = models(job)
    history, again = opd.run_opd(job, student, teacher, tokenizer, run_dir=run, **SILENT)
    assert history == [] and [step for step, _ in again] == [step for step, _ in reports]
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1  # no new file
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


# ---- warm-starting a planner student from a warm-up trained without one (issue #16) ----

PLANNER = ("rollout.commit_rule=planner", "student.planner_hidden=8")
WARMUP = (
    "student_warmup.steps=2",
    "student_warmup.checkpoint_every=2",
    "student_warmup.optimizer.warmup_steps=1",
    "student_warmup.eval_examples=2",
)


def trunk_and_head(model):
    """``(trunk, planner)`` flat ``{path: array}`` parameters ({} head without a planner)."""
    flat = {
        path: np.asarray(variable[...])
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    head = {path: value for path, value in flat.items() if path[0] == "planner"}
    return {path: value for path, value in flat.items() if path[0] != "planner"}, head


def assert_bitwise_equal(got, want):
    assert got.keys() == want.keys()
    for path, value in want.items():
        np.testing.assert_array_equal(got[path], value, err_msg=str(path))


def warm_up(tmp_path_factory, *overrides):
    job = tiny_job(*WARMUP, *overrides)
    run = tmp_path_factory.mktemp("warmup")
    student, _ = pipeline.warmup_student(job, run, **SILENT)
    return run, trunk_and_head(student)


@pytest.fixture(scope="module")
def warmed_up_without_planner(tmp_path_factory):
    return warm_up(tmp_path_factory)


@pytest.fixture(scope="module")
def warmed_up_with_planner(tmp_path_factory):
    return warm_up(tmp_path_factory, *PLANNER)


def test_a_warmup_without_planner_gives_a_planner_student_its_trunk_and_a_fresh_head(
    warmed_up_without_planner,
):
    run, (saved_trunk, _) = warmed_up_without_planner
    job = tiny_job(*WARMUP, *PLANNER)
    messages = []
    student = pipeline.load_student_run(job, run, log=messages.append)
    trunk, head = trunk_and_head(student)
    assert_bitwise_equal(trunk, saved_trunk)
    fresh = pipeline.Transformer(job.student, rngs=nnx.Rngs(job.seed + 1))
    assert_bitwise_equal(head, trunk_and_head(fresh)[1])
    assert not np.any(head[("planner", "out", "kernel")])
    hidden = jax.random.normal(jax.random.key(0), (3, job.student.d_model))
    np.testing.assert_array_equal(jax.nn.sigmoid(student.commit_logits(hidden)), 0.5)
    assert len(messages) == 1 and "initialized a fresh planner head" in messages[0]
    # Only the head may differ: any other change of the warm-up's setup is still refused.
    with pytest.raises(ContractMismatch, match="`student.d_ff`") as refused:
        pipeline.load_student_run(tiny_job(*WARMUP, *PLANNER, "student.d_ff=128"), run)
    assert "planner_hidden" not in str(refused.value)


def test_a_warm_started_planner_student_trains_and_its_opd_run_keeps_its_commit_rule(
    warmed_up_without_planner, tmp_path
):
    run, _ = warmed_up_without_planner
    job = tiny_job(*WARMUP, *PLANNER)
    tokenizer = pipeline.job_tokenizer(job)
    teacher = InProcessTeacher(models(job)[0], tokenizer)

    def learner(job):
        student = pipeline.load_student_run(job, run, log=lambda _: None)
        return opd.OpdLearner(job, student, teacher, tokenizer, run_dir=tmp_path, **QUIET)

    first = learner(job)
    metrics = first.train(first.roll_out())
    first.save(metrics)
    first.close()
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert np.any(trunk_and_head(first.student)[1][("planner", "out", "kernel")])
    # The fresh head is a function of the job's seed: the same start, so the run resumes...
    resumed = learner(job)
    assert resumed.step == 1
    resumed.close()
    # ...and, as for any OPD run, refuses another commit rule (with or without the head).
    for changed in (tiny_job(*WARMUP, "student.planner_hidden=8"), tiny_job(*WARMUP)):
        with pytest.raises(ContractMismatch, match="`rollout.commit_rule`"):
            learner(changed)


def test_a_planner_head_the_job_does_not_use_is_dropped_and_one_it_does_is_kept(
    warmed_up_with_planner,
):
    """A warm-up with the planner serves every commit rule: a job without a planner gets its
    trunk (the head is dropped, logged), one of the head's width gets the saved head, one of
    another width a fresh head."""
    run, (saved_trunk, saved_head) = warmed_up_with_planner
    planner_job = tiny_job(*WARMUP, *PLANNER)
    initial = pipeline.Transformer(planner_job.student, rngs=nnx.Rngs(planner_job.seed + 1))
    assert_bitwise_equal(saved_head, trunk_and_head(initial)[1])  # the warm-up never reads it
    messages = []
    plain = pipeline.load_student_run(tiny_job(*WARMUP), run, log=messages.append)
    assert plain.planner is None
    assert_bitwise_equal(trunk_and_head(plain)[0], saved_trunk)
    assert len(messages) == 1 and "dropped the planner head (width 8)" in messages[0]

    same = pipeline.load_student_run(planner_job, run, log=messages.append)
    assert_bitwise_equal(trunk_and_head(same)[1], saved_head)
    assert len(messages) == 1

    wider = tiny_job(*WARMUP, *PLANNER, "student.planner_hidden=16")
    other = pipeline.load_student_run(wider, run, log=messages.append)
    assert_bitwise_equal(trunk_and_head(other)[0], saved_trunk)
    fresh = pipeline.Transformer(wider.student, rngs=nnx.Rngs(wider.seed + 1))
    assert_bitwise_equal(trunk_and_head(other)[1], trunk_and_head(fresh)[1])
    assert "which has width 8" in messages[-1]
