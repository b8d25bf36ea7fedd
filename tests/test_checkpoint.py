"""Run contract and resume: refused changes, corrupt checkpoints, bitwise-identical resume."""

import json
import logging
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from distill import pipeline
from distill.checkpoint import (
    CONTRACT_FILE,
    ContractMismatch,
    RunCheckpointer,
    contract_differences,
    is_recorded_field,
    split_differences,
    topology,
)
from distill.config import JobConfig, load_config
from distill.curves import read_curves

SHORT = [
    "teacher.d_model=32",
    "teacher.d_ff=64",
    "student.d_model=32",
    "student.d_ff=64",
    "teacher_training.steps=6",
    "teacher_training.checkpoint_every=2",
    "teacher_training.eval_examples=8",
    "teacher_training.optimizer.warmup_steps=2",
    "data.batch_size=8",
]


def tiny_job(*extra):
    return load_config("deploy/configs/tiny.yaml", JobConfig, [*SHORT, *extra])


def params(model):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("whole")
    model, report = pipeline.train_teacher(tiny_job(), run, progress=False, log=lambda _: None)
    return run, params(model), report


def test_three_interruptions_then_resume_is_bitwise_identical_and_exactly_once(
    tmp_path, uninterrupted
):
    _, expected, _ = uninterrupted
    job = tiny_job()
    for stop in (1, 3, 4):  # mid-segment stops too: a checkpoint is written at each
        pipeline.train_teacher(job, tmp_path, progress=False, stop_after=stop, log=lambda _: None)
    model, _ = pipeline.train_teacher(job, tmp_path, progress=False, log=lambda _: None)
    for got, want in zip(params(model), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    progress = json.loads((tmp_path / "checkpoints" / "6" / "progress" / "metadata").read_text())
    assert progress["ledger"] == [[0, 6 * 8]]  # every position once, in order
    curves = read_curves(tmp_path / "tensorboard")
    assert [step for step, _ in curves["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert curves == read_curves(uninterrupted[0] / "tensorboard")


def test_progress_records_the_trained_data_position(uninterrupted):
    run, _, _ = uninterrupted
    progress = json.loads((run / "checkpoints" / "6" / "progress" / "metadata").read_text())
    assert progress["step"] == 6 and progress["data_position"] == 6 * 8


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("teacher.rope_theta=500.0", "teacher.rope_theta"),
        ("teacher_training.optimizer.learning_rate=0.01", "training.optimizer.learning_rate"),
        ("teacher_training.steps=8", "training.steps"),
        ("data.seed=5", "data.seed"),
        ("data.tasks=[copy]", "data.tasks"),
        ("seed=3", "seed"),
        ("tokenizer.stop_tokens=['|']", "tokenizer_hash"),
    ],
)
def test_each_changed_contract_field_is_refused_by_name(uninterrupted, tmp_path, override, field):
    run, _, _ = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    with pytest.raises(ContractMismatch, match=f"`{field}`"):
        pipeline.train_teacher(tiny_job(override), copy, progress=False, log=lambda _: None)


def test_contract_differences_list_old_and_new_values():
    differences = contract_differences({"a": {"b": 1}, "c": [1, 2]}, {"a": {"b": 2}, "c": (1, 2)})
    assert differences == {"a.b": (1, 2)}


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_good_step(uninterrupted, tmp_path):
    run, _, _ = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    # Truncate every file of the newest step's state.
    for path in (copy / "checkpoints" / "6" / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"")
    job = tiny_job()
    messages = []
    model = pipeline.Transformer(job.teacher, rngs=nnx.Rngs(0))
    optimizer = pipeline.make_train_state(model, job.teacher_training.optimizer, 6)
    checkpointer = RunCheckpointer.open(
        copy, pipeline.phase_contract(job, pipeline.job_tokenizer(job), "teacher_training")
    )
    before = params(model)
    restored = checkpointer.restore_latest((optimizer, model))
    messages.append(restored)
    assert restored.step == 4 and restored.skipped == (6,)
    assert any(not np.array_equal(a, b) for a, b in zip(params(model), before, strict=True))


def test_student_warmup_refuses_to_resume_from_a_different_teacher(tmp_path):
    job = tiny_job(
        "student_warmup.steps=2",
        "student_warmup.optimizer.warmup_steps=1",
        "student_warmup.eval_examples=4",
    )
    silent = dict(progress=False, log=lambda _: None, stop_after=1)
    teacher = pipeline.Transformer(job.teacher, rngs=nnx.Rngs(0))
    pipeline.warmup_student(job, tmp_path, teacher=teacher, **silent)
    other = pipeline.Transformer(job.teacher, rngs=nnx.Rngs(1))
    with pytest.raises(ContractMismatch, match="`teacher_hash`"):
        pipeline.warmup_student(job, tmp_path, teacher=other, **silent)


# ---- the contract travels with the checkpoint --------------------------------------------

CONTRACT = {"teacher_hash": "aaaa", "rollout": {"block_size": 4, "temperature": 1.0}}
OTHER_TEACHER = CONTRACT | {"teacher_hash": "bbbb"}


def small_model(seed):
    return nnx.Linear(3, 2, rngs=nnx.Rngs(seed))


def write_run(directory, contract=CONTRACT, step=1):
    checkpointer = RunCheckpointer.open(directory, contract)
    checkpointer.save(step, small_model(0), {"data_position": step})
    checkpointer.close()


def test_a_run_whose_contract_json_is_missing_is_refused_by_name(tmp_path):
    write_run(tmp_path)
    (tmp_path / CONTRACT_FILE).unlink()
    for contract in (OTHER_TEACHER, CONTRACT):  # the missing file alone is the refusal
        with pytest.raises(ContractMismatch, match=f"^`{CONTRACT_FILE}` must exist"):
            RunCheckpointer.open(tmp_path, contract)
    assert not (tmp_path / CONTRACT_FILE).exists()


def test_a_checkpoint_whose_stored_contract_differs_is_refused_by_field(tmp_path):
    write_run(tmp_path)
    (tmp_path / CONTRACT_FILE).write_text(json.dumps(OTHER_TEACHER))  # a replaced contract
    checkpointer = RunCheckpointer.open(tmp_path, OTHER_TEACHER)
    model = small_model(1)
    before = params(model)
    with pytest.raises(ContractMismatch, match="`teacher_hash` must equal .*'aaaa'"):
        checkpointer.restore_latest(model)
    for got, want in zip(params(model), before, strict=True):
        np.testing.assert_array_equal(got, want)  # nothing loaded
    checkpointer.close()


def test_a_checkpoint_carries_the_contract_it_was_written_under(tmp_path):
    write_run(tmp_path, step=3)
    stored = json.loads((tmp_path / "checkpoints" / "3" / "contract" / "metadata").read_text())
    assert stored == CONTRACT
    checkpointer = RunCheckpointer.open(tmp_path, CONTRACT)
    model = small_model(1)
    assert checkpointer.restore_latest(model).step == 3
    for got, want in zip(params(model), params(small_model(0)), strict=True):
        np.testing.assert_array_equal(got, want)
    checkpointer.close()


def test_a_checkpoint_written_before_contracts_were_stored_still_restores(tmp_path):
    (tmp_path / CONTRACT_FILE).write_text(json.dumps(CONTRACT))
    legacy = ocp.CheckpointManager(  # the layout of earlier runs: state and progress only
        tmp_path / "checkpoints",
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True),
        item_names=("state", "progress"),
    )
    pure = nnx.to_pure_dict(nnx.state(small_model(0)))
    legacy.save(
        2,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(pure), progress=ocp.args.JsonSave({"step": 2})
        ),
    )
    legacy.wait_until_finished()
    legacy.close()
    with pytest.raises(ContractMismatch, match="`teacher_hash`"):
        RunCheckpointer.open(tmp_path, OTHER_TEACHER)
    checkpointer = RunCheckpointer.open(tmp_path, CONTRACT)
    model = small_model(1)
    assert checkpointer.restore_latest(model).step == 2
    for got, want in zip(params(model), params(small_model(0)), strict=True):
        np.testing.assert_array_equal(got, want)
    checkpointer.close()


# ---- must match versus recorded: a run moves to other hardware --------------------------

CPU_RUN = CONTRACT | {
    "topology": {"process_count": 1, "device_count": 1, "platform": "cpu", "device_kind": "cpu"}
}
TPU_SLICE = CONTRACT | {
    "topology": {
        "process_count": 4,
        "device_count": 16,
        "platform": "tpu",
        "device_kind": "TPU v6 lite",
    }
}


def test_split_differences_records_the_topology_and_requires_everything_else():
    must, recorded = split_differences(
        contract_differences(CPU_RUN, TPU_SLICE | {"teacher_hash": "bbbb"})
    )
    assert must == {"teacher_hash": ("aaaa", "bbbb")}
    assert recorded == {
        "topology.device_count": (1, 16),
        "topology.device_kind": ("cpu", "TPU v6 lite"),
        "topology.platform": ("cpu", "tpu"),
        "topology.process_count": (1, 4),
    }
    assert is_recorded_field("topology") and not is_recorded_field("topology_seed")


def test_a_run_trained_on_cpu_resumes_on_a_tpu_slice_with_a_warning(tmp_path, caplog):
    write_run(tmp_path, CPU_RUN, step=2)
    with caplog.at_level(logging.WARNING, logger="distill.checkpoint"):
        checkpointer = RunCheckpointer.open(tmp_path, TPU_SLICE)
        model = small_model(1)
        assert checkpointer.restore_latest(model).step == 2
    for got, want in zip(params(model), params(small_model(0)), strict=True):
        np.testing.assert_array_equal(got, want)  # the same parameters on the new hardware
    assert checkpointer.recorded_changes["topology.platform"] == ("cpu", "tpu")
    assert "topology.process_count 1 -> 4" in caplog.text
    checkpointer.save(3, model, {"data_position": 3})
    checkpointer.close()
    # The run's contract.json keeps where it started; each step records where it was written.
    assert json.loads((tmp_path / CONTRACT_FILE).read_text()) == CPU_RUN
    step = json.loads((tmp_path / "checkpoints" / "3" / "contract" / "metadata").read_text())
    assert step["topology"] == TPU_SLICE["topology"]


def test_a_run_from_an_older_topology_record_resumes(tmp_path):
    older = CONTRACT | {"topology": {"process_count": 1, "device_count": 1, "platform": "cpu"}}
    write_run(tmp_path, older, step=1)
    checkpointer = RunCheckpointer.open(tmp_path, CPU_RUN)
    assert checkpointer.restore_latest(small_model(1)).step == 1
    assert checkpointer.recorded_changes == {"topology.device_kind": ("<absent>", "cpu")}
    checkpointer.close()


def test_a_changed_setup_is_refused_on_any_topology_naming_only_what_must_match(tmp_path):
    write_run(tmp_path, CPU_RUN)
    with pytest.raises(ContractMismatch) as refused:
        RunCheckpointer.open(
            tmp_path, TPU_SLICE | {"rollout": {"block_size": 8, "temperature": 1.0}}
        )
    assert set(refused.value.differences) == {"rollout.block_size"}
    (tmp_path / CONTRACT_FILE).write_text(json.dumps(TPU_SLICE | {"teacher_hash": "bbbb"}))
    checkpointer = RunCheckpointer.open(tmp_path, TPU_SLICE | {"teacher_hash": "bbbb"})
    with pytest.raises(ContractMismatch) as refused:  # the step's own contract still decides
        checkpointer.restore_latest(small_model(1))
    assert set(refused.value.differences) == {"teacher_hash"}
    checkpointer.close()


def test_checkpoint_processes_must_include_the_calling_process(tmp_path):
    with pytest.raises(ValueError, match=r"^`processes` must be process indices in \[0, 1\)"):
        RunCheckpointer.open(tmp_path, CONTRACT, processes={1})
    with pytest.raises(ValueError, match="`processes` must"):
        RunCheckpointer.open(tmp_path, CONTRACT, processes=set())


def test_the_topology_names_process_and_device_counts_platform_and_kind():
    recorded = topology()
    assert recorded == {
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
    }
