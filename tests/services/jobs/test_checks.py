"""Before step 0 the driver checks its teacher replicas over gRPC: compatible with the
student, one model, deterministic. An incompatible or non-deterministic teacher stops the
job by name."""

import pytest

from distill import pipeline
from distill.data.stream import TaskStream, encode_example
from distill.teacher import InProcessTeacher
from distill.teacher_contract import CompatibilityError
from services.jobs.checks import TeacherSelfTestError, check_teachers
from services.teacher.client import RemoteTeacher
from services.teacher.server import serve_teacher
from tests.support.fakes import ScriptedTeacher, tiny_job, tiny_models


@pytest.fixture(scope="module")
def setup():
    job = tiny_job()
    teacher_model, _ = tiny_models(job)
    tokenizer = pipeline.job_tokenizer(job)
    prompt, answer = encode_example(TaskStream(job.data).batch(0, 1)[0], tokenizer)
    return job, InProcessTeacher(teacher_model, tokenizer), tokenizer, prompt + answer


def served_check(teachers, setup):
    job, _, tokenizer, probe = setup
    servers = [serve_teacher(teacher) for teacher in teachers]
    clients = [RemoteTeacher(server.address, timeout_s=60) for server in servers]
    try:
        return check_teachers(
            clients, [s.address for s in servers], tokenizer, job.student.vocab_size, probe
        )
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.stop(grace_s=1)


def test_two_identical_replicas_pass(setup):
    _, teacher, *_ = setup
    info = served_check([teacher, teacher], setup)
    assert info.model_hash == teacher.info().model_hash


@pytest.mark.parametrize(
    "change, field",
    [({"vocab_size": 60}, "teacher.vocab_size"), ({"stop_ids": (7,)}, "teacher.stop_ids")],
)
def test_an_incompatible_teacher_is_refused_naming_the_mismatch(setup, change, field):
    _, teacher, *_ = setup
    with pytest.raises(CompatibilityError, match=f"`{field}` must equal the student's"):
        served_check([ScriptedTeacher(teacher, **change)], setup)


def test_replicas_serving_different_models_are_refused(setup):
    _, teacher, *_ = setup
    other = ScriptedTeacher(teacher, model_hash="0" * 64)
    with pytest.raises(CompatibilityError, match="`teacher.model_hash` must be the same"):
        served_check([teacher, other], setup)


def test_a_non_deterministic_teacher_fails_the_self_test_by_name(setup):
    _, teacher, *_ = setup
    with pytest.raises(
        TeacherSelfTestError, match=r"determinism self-test failed: 127\.0\.0\.1:\d+ scored"
    ):
        served_check([ScriptedTeacher(teacher, drift=1e-3)], setup)
