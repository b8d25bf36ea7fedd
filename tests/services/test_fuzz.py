"""Fuzzing the wire (issue #15, item 3): hypothesis builds ``TraceRow`` pushes for the
learner, ``ScoreRequest`` / ``ScoreTextRequest`` for the teacher and raw bytes for both, with
random field values (out of range, NaN / inf, empty, huge repeated fields within the receive
limit), and sends them to live servers on loopback. Every answer must be OK or a status the
services document for a caller's mistake; never ``INTERNAL`` or ``UNKNOWN`` (a handler that
crashed), and each server keeps serving.

Fixed budget, reproducible: ``derandomize=True`` and ``max_examples`` per message type
(:data:`EXAMPLES`); no deadline (the first calls compile).
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distill import pipeline
from distill.diffusion.denoise import rollout
from distill.opd.learner import OpdLearner
from distill.opd.records import RolloutBatch
from distill.teacher import InProcessTeacher
from services.common.auth import bearer_metadata
from services.common.config import ServerConfig
from services.learner.service import SERVICE_NAME as LEARNER
from services.learner.service import LearnerRuntime
from services.proto import learner_pb2, learner_pb2_grpc, teacher_pb2, teacher_pb2_grpc
from services.proto.rollout_pb2 import TraceRow
from services.rollout.messages import rows_to_proto
from services.teacher.server import SERVICE_NAME as TEACHER
from services.teacher.server import TeacherServerConfig, serve_teacher
from tests.support.fakes import tiny_char_teacher, tiny_job, tiny_models

#: Examples per message type.
EXAMPLES = 200
TOKEN = "fuzz-token"
AUTH = bearer_metadata(TOKEN)
WAIT_S = 60
LEARNER_MAX_BYTES = 256 << 10
Code = grpc.StatusCode
#: What a caller's mistake may be answered with (never INTERNAL or UNKNOWN).
ALLOWED = {Code.OK, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.FAILED_PRECONDITION}
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
DOUBLES = st.floats(allow_nan=True, allow_infinity=True)


def small_or(values, big):
    """Mostly values near the valid range, sometimes anything of the type."""
    return st.one_of(values, big)


def code_of(thunk):
    try:
        thunk()
    except grpc.RpcError as error:
        return error.code(), error.details()
    return Code.OK, ""


# ---- learner --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def learner():
    job = tiny_job("opd.steps=2")
    teacher_model, student = tiny_models(job)
    tokenizer = pipeline.job_tokenizer(job)
    opd = OpdLearner(
        job, student, InProcessTeacher(teacher_model, tokenizer), tokenizer, log=lambda _: None
    )
    runtime = LearnerRuntime(
        opd,
        shards_per_step=2,
        publish=lambda version, weights: None,
        server_config=ServerConfig(token=TOKEN, max_message_bytes=LEARNER_MAX_BYTES),
        # a fuzzed AcquireWork that gets WAIT need not hold the test for the default second
        acquire_wait_s=0.05,
    )
    address = runtime.start()
    trace = rollout(
        opd.student,
        opd.prompts(0, [0, 1]),
        opd.settings,
        seed=job.seed,
        global_step=0,
        row_ids=[0, 1],
    )
    batch = RolloutBatch.from_trace(
        trace,
        step=0,
        policy_version=0,
        row_ids=[0, 1],
        stream_positions=[opd.stream_positions(0)[row] for row in (0, 1)],
    )
    rows = rows_to_proto(batch, seed=job.seed, worker_id="fuzz")
    channel = grpc.insecure_channel(address, options=ServerConfig().channel_options)
    yield runtime, channel, learner_pb2_grpc.LearnerServiceStub(channel), rows
    channel.close()
    runtime.stop(grace_s=1)


def assert_learner_serves(stub):
    status = stub.Status(learner_pb2.StatusRequest(), metadata=AUTH, timeout=WAIT_S)
    assert status.total_steps == 2 and not status.error


SETTINGS_EDITS = st.fixed_dictionaries(
    {},
    optional={
        "alignment": st.sampled_from(["same_position", "shifted", "", "x" * 300]),
        "commit_rule": st.sampled_from(["threshold", "schedule", "", "?"]),
        "threshold": DOUBLES,
        "confidence": st.sampled_from(["max_prob", "sampled_prob", "nope"]),
        "schedule_steps": INT32,
        "strategy": st.text(max_size=20),
        "temperature": DOUBLES,
        "greedy": st.booleans(),
        "stop_when_done": st.booleans(),
        "completion_length": small_or(st.integers(-4, 64), INT32),
        "mask_id": small_or(st.integers(-2, 60), INT32),
        "pad_id": small_or(st.integers(-2, 60), INT32),
        "stop_ids": st.lists(small_or(st.integers(-2, 60), INT32), max_size=8),
    },
)

ROW_EDITS = st.fixed_dictionaries(
    {},
    optional={
        "step": small_or(st.integers(-2, 4), INT64),
        "row_id": small_or(st.integers(-2, 16), INT64),
        "stream_position": small_or(st.integers(-2, 64), INT64),
        "policy_version": small_or(st.integers(-2, 2), INT64),
        "seed": small_or(st.integers(-2, 2), INT64),
        "worker_id": st.text(max_size=64),
        "block_size": small_or(st.integers(-2, 16), INT32),
        "forwards": small_or(st.integers(-2, 64), INT32),
        "completion_text": st.text(max_size=64),
        "completion_ids": st.lists(INT32, max_size=64),
    },
)

SLOT_VALUES = {
    "tokens": small_or(st.integers(-2, 60), INT32),
    "positions": small_or(st.integers(-2, 200), INT32),
    "segment_ids": small_or(st.integers(-2, 3), INT32),
    "prompt_mask": st.booleans(),
    "completion_mask": st.booleans(),
    "action_steps": small_or(st.integers(-2, 40), INT32),
    "action_logps": FLOATS,
}


@st.composite
def slot_edits(draw):
    """Point edits of per-slot arrays, or a whole array replaced (any length, up to a few
    thousand entries: huge repeated fields well within the receive limit)."""
    edits = []
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(sorted(SLOT_VALUES)))
        if draw(st.booleans()):
            edits.append((name, draw(st.integers(0, 2**16)), draw(SLOT_VALUES[name])))
        else:
            length = draw(st.sampled_from([0, 1, 7, 64, 4096]))
            value = draw(SLOT_VALUES[name])
            edits.append((name, None, [value] * length))
    return edits


@st.composite
def pushes(draw, base):
    """A push: 0-3 rows, each a valid row edited (settings, identity, slots), possibly
    repeated or reordered."""
    count = draw(st.integers(0, 3))
    out = []
    for _ in range(count):
        row = TraceRow.FromString(base[draw(st.integers(0, len(base) - 1))].SerializeToString())
        for name, value in draw(ROW_EDITS).items():
            if name == "completion_ids":
                del row.completion_ids[:]
                row.completion_ids.extend(value)
            else:
                setattr(row, name, value)
        settings_edits = draw(SETTINGS_EDITS)
        for name, value in settings_edits.items():
            if name == "stop_ids":
                del row.settings.stop_ids[:]
                row.settings.stop_ids.extend(value)
            else:
                setattr(row.settings, name, value)
        if draw(st.integers(0, 20)) == 0:
            row.ClearField("settings")
        for name, index, value in draw(slot_edits()):
            field = getattr(row, name)
            if index is None:
                del field[:]
                field.extend(value)
            elif len(field):
                field[index % len(field)] = value
        out.append(row)
    return out


def test_fuzzed_trace_pushes_never_crash_the_learner(learner):
    runtime, _, stub, rows = learner
    # The fuzz starts from rows the learner accepts: the unedited push is taken (teeth).
    code, details = code_of(lambda: stub.PushTraces(iter(rows[:1]), metadata=AUTH, timeout=WAIT_S))
    assert code == Code.OK, (code, details)
    seen: dict[Code, int] = {}
    first_refusal: list[str] = []

    @FUZZ
    @given(push=pushes(rows))
    def check(push):
        code, details = code_of(lambda: stub.PushTraces(iter(push), metadata=AUTH, timeout=WAIT_S))
        seen[code] = seen.get(code, 0) + 1
        assert code in ALLOWED, (code, details)
        if code == Code.INVALID_ARGUMENT:
            first_refusal[:] = first_refusal or [details]
            assert details.startswith("`"), details  # names the field

    check()
    assert_learner_serves(stub)
    assert sum(seen.values()) >= EXAMPLES, seen
    assert seen.get(Code.INVALID_ARGUMENT), (seen, first_refusal)


def test_fuzzed_work_requests_and_raw_bytes_never_crash_the_learner(learner):
    _, channel, stub, _ = learner
    seen: dict[Code, int] = {}
    methods = ["AcquireWork", "Status", "PushTraces"]

    @FUZZ
    @given(
        method=st.sampled_from(methods),
        body=st.one_of(
            st.binary(max_size=512),
            st.text(max_size=256).map(
                lambda worker: learner_pb2.WorkRequest(worker_id=worker).SerializeToString()
            ),
        ),
    )
    def check(method, body):
        path = f"/{LEARNER}/{method}"
        if method == "PushTraces":
            push = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
            code, details = code_of(lambda: push(iter([body]), metadata=AUTH, timeout=WAIT_S))
        else:
            unary = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            code, details = code_of(lambda: unary(body, metadata=AUTH, timeout=WAIT_S))
        seen[code] = seen.get(code, 0) + 1
        assert code in ALLOWED, (method, code, details)

    check()
    assert_learner_serves(stub)
    assert sum(seen.values()) >= EXAMPLES, seen


# ---- teacher --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher():
    model = tiny_char_teacher(max_length=32, seed=0)
    server_config = TeacherServerConfig(
        token=TOKEN,
        max_request_sequences=8,
        max_request_tokens=256,
        max_request_candidate_ids=2048,
        max_request_text_bytes=1024,
        max_delay_ms=0,
    )
    with (
        serve_teacher(model, server_config) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        yield server, channel, teacher_pb2_grpc.TeacherServiceStub(channel)


def assert_teacher_serves(stub):
    reply = stub.Score(
        teacher_pb2.ScoreRequest(sequences=[teacher_pb2.TokenSequence(ids=[2, 5, 7])]),
        metadata=AUTH,
        timeout=WAIT_S,
    )
    assert len(reply.sequences[0].log_probs) == 2


# Mostly short sequences of valid ids (so many requests reach the model), some anything.
IDS = st.lists(small_or(st.integers(0, 50), INT32), max_size=12) | st.lists(
    st.integers(0, 50), min_size=30, max_size=300
)


VALID_IDS = st.lists(st.integers(0, 50), min_size=2, max_size=12)


@st.composite
def plausible_score_requests(draw):
    """Requests near the valid ones: most are scored, some miss by one field."""
    request = teacher_pb2.ScoreRequest(
        sequences=[
            teacher_pb2.TokenSequence(ids=ids)
            for ids in draw(st.lists(VALID_IDS, min_size=1, max_size=4))
        ],
        top_k=draw(st.sampled_from([0, 0, 1, 4, 51, 52, -1])),
    )
    if draw(st.booleans()):
        request.shared_prompt.ids.extend(draw(VALID_IDS))
    if draw(st.booleans()):
        request.candidates = draw(st.integers(1, 3))
        for sequence in request.sequences:
            n = len(sequence.ids) + len(request.shared_prompt.ids) - 1
            size = n * request.candidates + draw(st.sampled_from([0, 0, 0, 1, -1]))
            ids = draw(st.lists(st.integers(-1, 51), min_size=size, max_size=size))
            request.candidate_ids.add().ids.extend(ids)
    return request


@st.composite
def wild_score_requests(draw):
    request = teacher_pb2.ScoreRequest(
        sequences=[teacher_pb2.TokenSequence(ids=ids) for ids in draw(st.lists(IDS, max_size=10))],
        top_k=draw(small_or(st.integers(-1, 52), INT32)),
        candidates=draw(st.one_of(st.just(0), st.integers(-1, 5), INT32)),
    )
    if draw(st.booleans()):
        request.shared_prompt.ids.extend(draw(IDS))
    if request.candidates or draw(st.integers(0, 4)) == 0:
        for sequence in request.sequences:
            n = max(len(sequence.ids) - 1 + len(request.shared_prompt.ids), 0)
            want = n * max(min(request.candidates, 8), 0)
            length = draw(st.sampled_from([want, want, max(want - 1, 0), want + 1]))
            entry = request.candidate_ids.add()
            values = small_or(st.integers(0, 50), INT32)
            entry.ids.extend(draw(st.lists(values, min_size=length, max_size=length)))
    return request


def score_requests():
    return st.one_of(plausible_score_requests(), wild_score_requests())


def test_fuzzed_score_requests_never_crash_the_teacher(teacher):
    _, _, stub = teacher
    seen: dict[Code, int] = {}

    @FUZZ
    @given(request=score_requests())
    def check(request):
        code, details = code_of(lambda: stub.Score(request, metadata=AUTH, timeout=WAIT_S))
        seen[code] = seen.get(code, 0) + 1
        assert code in ALLOWED, (code, details)
        if code != Code.OK:
            assert details.startswith("`"), details

    check()
    assert_teacher_serves(stub)
    assert seen.get(Code.OK) and seen.get(Code.INVALID_ARGUMENT), seen


TEXT = st.text(max_size=64) | st.text(alphabet="ab \n", min_size=200, max_size=700)


def test_fuzzed_text_requests_and_raw_bytes_never_crash_the_teacher(teacher):
    _, channel, stub = teacher
    seen: dict[Code, int] = {}
    text_requests = st.lists(
        st.builds(teacher_pb2.TextPair, prompt=TEXT, completion=TEXT, stopped=st.booleans()),
        max_size=10,
    ).map(lambda pairs: teacher_pb2.ScoreTextRequest(pairs=pairs).SerializeToString())

    @FUZZ
    @given(
        method=st.sampled_from(["ScoreText", "Score", "Info"]),
        body=st.one_of(text_requests, st.binary(max_size=512)),
    )
    def check(method, body):
        unary = channel.unary_unary(
            f"/{TEACHER}/{method}", request_serializer=None, response_deserializer=None
        )
        code, details = code_of(lambda: unary(body, metadata=AUTH, timeout=WAIT_S))
        seen[code] = seen.get(code, 0) + 1
        assert code in ALLOWED, (method, code, details)

    check()
    assert_teacher_serves(stub)
    assert seen.get(Code.OK) and seen.get(Code.INVALID_ARGUMENT), seen
