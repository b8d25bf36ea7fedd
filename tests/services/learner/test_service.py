"""LearnerService on loopback: work assignment, pushes checked row by row, malformed traces
refused with INVALID_ARGUMENT naming the field while the service keeps serving, and the
runtime training what the workers pushed."""

import threading

import grpc
import numpy as np
import pytest

from distill import pipeline
from distill.curves import read_curves
from distill.diffusion.denoise import rollout
from distill.opd.learner import OpdLearner
from distill.opd.records import RolloutBatch
from distill.teacher import InProcessTeacher
from services.learner.service import LearnerRuntime
from services.proto import learner_pb2, learner_pb2_grpc
from services.rollout.messages import rows_to_proto
from services.rollout.worker import RolloutWorker
from tests.support.fakes import tiny_job, tiny_models


def local_runtime(job, *, shards_per_step, wrap_teacher=lambda teacher: teacher, **options):
    """A started LearnerRuntime over a tiny in-process learner (``wrap_teacher`` may replace
    its teacher); returns (runtime, published weights by version, address)."""
    teacher_model, student = tiny_models(job)
    tokenizer = pipeline.job_tokenizer(job)
    teacher = wrap_teacher(InProcessTeacher(teacher_model, tokenizer))
    learner = OpdLearner(job, student, teacher, tokenizer, log=lambda _: None)
    published = {}
    runtime = LearnerRuntime(
        learner,
        shards_per_step=shards_per_step,
        publish=lambda version, weights: published.__setitem__(version, weights),
        step_timeout_s=120,
        **options,
    )
    return runtime, published, runtime.start()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    job = tiny_job("opd.steps=2", "loss.max_staleness=0")
    runtime, published, address = local_runtime(
        job, shards_per_step=2, tensorboard_dir=tmp_path_factory.mktemp("tensorboard")
    )
    channel = grpc.insecure_channel(address)
    stub = learner_pb2_grpc.LearnerServiceStub(channel)
    yield job, runtime, stub, published, address
    channel.close()
    runtime.stop(grace_s=1)


def valid_rows(job, runtime, step=0, rows=(0, 1)):
    learner = runtime.learner
    trace = rollout(
        learner.student,
        learner.prompts(step, list(rows)),
        learner.settings,
        seed=job.seed,
        global_step=step,
        row_ids=list(rows),
    )
    positions = [learner.stream_positions(step)[row] for row in rows]
    batch = RolloutBatch.from_trace(
        trace, step=step, policy_version=0, row_ids=list(rows), stream_positions=positions
    )
    return rows_to_proto(batch, seed=job.seed, worker_id="test")


def first_completion(row):
    return list(row.completion_mask).index(True)


def corrupt(rows, edit):
    rows = [type(row).FromString(row.SerializeToString()) for row in rows]
    edit(rows[0])
    return rows


def push_error(stub, rows):
    with pytest.raises(grpc.RpcError) as raised:
        stub.PushTraces(iter(rows), timeout=30)
    return raised.value


@pytest.mark.parametrize(
    "field, edit",
    [
        ("action_logps", lambda row: row.action_logps.pop()),
        ("trace.tokens", lambda row: row.tokens.__setitem__(0, 10_000)),
        # 4 is an ordinary id: the row is well formed but made under another mask id.
        ("trace.settings.mask_id", lambda row: setattr(row.settings, "mask_id", 4)),
        # 3 is the stop id: such settings are refused before they are compared.
        ("settings.stop_ids", lambda row: setattr(row.settings, "mask_id", 3)),
        ("trace.block_size", lambda row: setattr(row, "block_size", 5)),
        ("trace.stream_positions", lambda row: setattr(row, "stream_position", 99)),
        ("trace.row_ids", lambda row: setattr(row, "row_id", 1000)),
        ("policy_version", lambda row: setattr(row, "policy_version", 7)),
        ("action_logps", lambda row: row.action_logps.__setitem__(first_completion(row), np.nan)),
    ],
)
def test_a_malformed_trace_is_refused_naming_the_field_and_the_learner_keeps_serving(
    service, field, edit
):
    job, runtime, stub, *_ = service
    before = runtime.counters.invalid_pushes
    error = push_error(stub, corrupt(valid_rows(job, runtime), edit))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"`{field}" in error.details() or field in error.details(), error.details()
    assert runtime.counters.invalid_pushes == before + 1
    status = stub.Status(learner_pb2.StatusRequest(), timeout=10)
    assert status.invalid_pushes == before + 1 and status.accepted_rows == 0


def test_an_empty_push_is_refused(service):
    _, _, stub, *_ = service
    error = push_error(stub, [])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "`rows`" in error.details()


def test_rows_of_work_that_was_never_assigned_are_refused_and_counted(service):
    job, runtime, stub, *_ = service
    summary = stub.PushTraces(iter(valid_rows(job, runtime, step=1, rows=(0,))), timeout=30)
    assert (summary.accepted, summary.refused) == (0, 1)


def test_workers_push_assigned_shards_and_the_runtime_trains_them(service):
    job, runtime, stub, published, address = service
    trainer = threading.Thread(target=runtime.run, daemon=True)
    trainer.start()
    workers = [
        RolloutWorker(
            job,
            worker_id=f"w{index}",
            learner_address=address,
            fetch_weights=published.__getitem__,
            call_timeout_s=120,
        )
        for index in range(2)
    ]
    counts = [None, None]

    def work(index):
        counts[index] = workers[index].run()

    threads = [threading.Thread(target=work, args=(index,), daemon=True) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    trainer.join(timeout=300)
    assert not trainer.is_alive() and runtime.learner.step == 2
    assert sum(count["rows_pushed"] for count in counts) == 2 * runtime.learner.plan.rows_per_step
    assert sorted(published) == [0, 1, 2]
    status = stub.Status(learner_pb2.StatusRequest(), timeout=10)
    assert status.done and status.step == 2 and not status.error
    assert runtime.learner.ledger == [[0, 2 * job.data.batch_size]]
    assert all(np.isfinite(metrics["loss"]) for metrics in runtime.history)
    tags = set(read_curves(runtime.tensorboard_dir))
    assert {
        "opd/loss",
        "opd/teacher_seconds",
        "opd/publish_seconds",
        "opd/tokens_per_second",
    } <= tags
    assert "eval/exact_match" in tags
    done = stub.AcquireWork(learner_pb2.WorkRequest(worker_id="late"), timeout=10)
    assert done.kind == learner_pb2.WorkAssignment.DONE
    for worker in workers:
        worker.close()


@pytest.mark.parametrize(
    ("field", "value"), [("step_timeout_s", 0.0), ("acquire_wait_s", 0.0), ("acquire_wait_s", 61.0)]
)
def test_the_runtime_refuses_waits_out_of_range_naming_the_field(service, field, value):
    _, runtime, _, _, _ = service
    with pytest.raises(ValueError, match=f"`{field}` must"):
        LearnerRuntime(
            runtime.learner,
            shards_per_step=2,
            publish=lambda version, weights: None,
            **{field: value},
        )


def test_a_guard_trip_fails_the_runtime_by_name_and_tells_the_workers_done(tmp_path):
    from distill.opd.guard import PolicyRegression
    from tests.support.fakes import ScriptedTeacher

    job = tiny_job(
        "opd.steps=4", "guard.max_teacher_logp_drop=1.0", "guard.window=1", "loss.max_staleness=0"
    )
    # Each scoring call is 5 nats lower than the last: step 1 is 5 below the start.
    runtime, published, address = local_runtime(
        job, shards_per_step=1, wrap_teacher=lambda teacher: ScriptedTeacher(teacher, drift=5.0)
    )
    failure = []

    def train():
        try:
            runtime.run()
        except PolicyRegression as error:
            failure.append(error)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    worker = RolloutWorker(
        job,
        worker_id="w0",
        learner_address=address,
        fetch_weights=published.__getitem__,
        call_timeout_s=120,
    )
    try:
        counts = worker.run()
        trainer.join(timeout=300)
        assert not trainer.is_alive() and len(failure) == 1
        assert runtime.learner.step == 1  # step 1's update tripped the guard, unsaved
        assert counts["rows_pushed"] == 2 * runtime.learner.plan.rows_per_step
        with grpc.insecure_channel(address) as channel:
            stub = learner_pb2_grpc.LearnerServiceStub(channel)
            status = stub.Status(learner_pb2.StatusRequest(), timeout=10)
            assert status.done and "PolicyRegression" in status.error
            assert "guard.max_teacher_logp_drop=1.0" in status.error
            done = stub.AcquireWork(learner_pb2.WorkRequest(worker_id="late"), timeout=10)
            assert done.kind == learner_pb2.WorkAssignment.DONE
    finally:
        worker.close()
        runtime.stop(grace_s=1)
