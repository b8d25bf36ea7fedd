"""Bad input catalog (issue #15, item 3), table-driven: every RPC of the teacher and the
learner and the CLI's job commands, each fed malformed requests or arguments. Every case
asserts the exact status (or exit) code and a message naming the field; after every RPC case
the server still answers a valid call.

Rows that already exist elsewhere are not repeated here:

=========================================  ================================================
Existing test                              Rows
=========================================  ================================================
teacher/test_teacher_server.py INVALID     Score: empty batch, 1 id, id -1, id = vocab,
                                           over max_length, top_k -1 / vocab + 1
teacher/test_teacher_server.py limits      Score: > max_request_sequences, > request ids
teacher/test_score_variants.py             candidate ids out of vocab, candidates > bucket,
                                           top_k above the largest bucket, ScoreText
                                           without the tokenizer (UNIMPLEMENTED)
teacher/test_endpoint_hardening.py         Score: unparsable body, body > receive limit,
                                           60 MiB unauthenticated body
learner/test_service.py                    PushTraces: short action_logps, token 10000,
                                           other mask id, mask id = stop id, block size,
                                           stream position, row id 1000, policy version 7,
                                           NaN log-prob, empty push
test_cli.py                                unknown --set field (exit 2), score --top-k
                                           beyond vocabulary, serve teacher flags
e2e/test_jobs_api.py (slow)                status/logs/stop of an unknown job and a dead
                                           address on a real Ray head
=========================================  ================================================
"""

from __future__ import annotations

import http.server
import json
import math
import threading

import grpc
import pytest

from distill import pipeline
from distill.diffusion.denoise import rollout
from distill.opd.learner import OpdLearner
from distill.opd.records import RolloutBatch
from distill.teacher import InProcessTeacher
from services import cli
from services.common.auth import bearer_metadata
from services.common.config import ServerConfig
from services.learner.service import SERVICE_NAME as LEARNER
from services.learner.service import LearnerRuntime
from services.proto import learner_pb2, learner_pb2_grpc, teacher_pb2, teacher_pb2_grpc
from services.rollout.messages import rows_to_proto
from services.teacher.server import SERVICE_NAME as TEACHER
from services.teacher.server import TeacherServerConfig, serve_teacher
from tests.support.fakes import ROOT, tiny_char_teacher, tiny_job, tiny_models
from tests.support.network import free_port

TOKEN = "bad-inputs-token"
AUTH = bearer_metadata(TOKEN)
WAIT_S = 60
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
LEARNER_MAX_BYTES = 1 << 20  # the learner fixture's message limit


def raw(channel, method):
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)


# ---- teacher --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_server():
    teacher = tiny_char_teacher(max_length=64, seed=0)
    server_config = TeacherServerConfig(
        token=TOKEN, max_request_sequences=8, max_request_tokens=256, max_request_text_bytes=512
    )
    with (
        serve_teacher(teacher, server_config) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        yield server, channel, teacher_pb2_grpc.TeacherServiceStub(channel)


def seqs(*sequences, **fields):
    return teacher_pb2.ScoreRequest(
        sequences=[teacher_pb2.TokenSequence(ids=s) for s in sequences], **fields
    )


def ids(values):
    return teacher_pb2.TokenSequence(ids=values)


def pairs(*items):
    return teacher_pb2.ScoreTextRequest(
        pairs=[teacher_pb2.TextPair(prompt=p, completion=c, stopped=s) for p, c, s in items]
    )


# (case id, request, code, field named in the details)
SCORE_CASES = [
    ("int32-min-id", seqs([2, -(2**31)]), INVALID, "`sequences[0].ids`"),
    ("int32-max-id", seqs([2, 2**31 - 1]), INVALID, "`sequences[0].ids`"),
    ("mask-id-wrong-vocab-second-seq", seqs([2, 5], [2, 9999]), INVALID, "`sequences[1].ids`"),
    ("empty-sequence", seqs([]), INVALID, "`sequences[0].ids`"),
    ("empty-second-sequence", seqs([2, 5], []), INVALID, "`sequences[1].ids`"),
    ("top-k-int32-min", seqs([2, 5], top_k=-(2**31)), INVALID, "`top_k`"),
    ("top-k-int32-max", seqs([2, 5], top_k=2**31 - 1), INVALID, "`top_k`"),
    ("candidates-negative", seqs([2, 5], candidates=-1), INVALID, "`candidates`"),
    ("candidates-huge", seqs([2, 5], candidates=2**31 - 1), INVALID, "`candidates`"),
    (
        "candidate-ids-without-candidates",
        seqs([2, 5], candidate_ids=[ids([1])]),
        INVALID,
        "`candidate_ids`",
    ),
    ("candidate-ids-missing", seqs([2, 5, 6], candidates=2), INVALID, "`candidate_ids`"),
    (
        "candidate-ids-wrong-count",
        seqs([2, 5, 6], candidates=2, candidate_ids=[ids([1, 2, 3])]),
        INVALID,
        "`candidate_ids[0].ids`",
    ),
    (
        "candidate-ids-negative",
        seqs([2, 5], candidates=1, candidate_ids=[ids([-1])]),
        INVALID,
        "`candidate_ids[0].ids`",
    ),
    (
        "candidate-ids-one-entry-too-many",
        seqs([2, 5], candidates=1, candidate_ids=[ids([1]), ids([1])]),
        INVALID,
        "`candidate_ids`",
    ),
    (
        "shared-prompt-empty",
        seqs([5], shared_prompt=ids([])),
        INVALID,
        "`shared_prompt.ids`",
    ),
    (
        "shared-prompt-empty-continuation",
        seqs([5], [], shared_prompt=ids([2])),
        INVALID,
        "`sequences[1].ids`",
    ),
    (
        "shared-prompt-out-of-vocab",
        seqs([5], shared_prompt=ids([2, 51])),
        INVALID,
        "`shared_prompt + sequences[0].ids`",
    ),
    (
        "shared-prompt-over-max-length",
        seqs([5], shared_prompt=ids([2] * 64)),
        INVALID,
        "`shared_prompt + sequences[0].ids`",
    ),
    ("over-long-ids", seqs([2] * 257), EXHAUSTED, "`sequences`"),
    ("too-many-sequences", seqs(*[[2, 5]] * 9), EXHAUSTED, "`sequences`"),
    ("shared-prompt-counts-in-ids", seqs([5], shared_prompt=ids([2] * 256)), EXHAUSTED, "`seq"),
]

TEXT_CASES = [
    ("no-pairs", pairs(), INVALID, "`pairs`"),
    ("too-many-pairs", pairs(*[("a", "b", False)] * 9), EXHAUSTED, "`pairs`"),
    ("over-long-text", pairs(("a" * 400, "b" * 200, True)), EXHAUSTED, "`pairs`"),
]


def assert_teacher_serves(stub):
    reply = stub.Score(seqs([2, 5, 7]), metadata=AUTH, timeout=WAIT_S)
    assert len(reply.sequences[0].log_probs) == 2
    assert stub.Info(teacher_pb2.InfoRequest(), metadata=AUTH, timeout=WAIT_S).vocab_size == 51


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [pytest.param(r, c, f, id=i) for i, r, c, f in SCORE_CASES],
)
def test_teacher_score_refuses_bad_requests_by_field(teacher_server, request_, code, field):
    _, _, stub = teacher_server
    with pytest.raises(grpc.RpcError) as caught:
        stub.Score(request_, metadata=AUTH, timeout=WAIT_S)
    assert caught.value.code() == code, caught.value.details()
    assert caught.value.details().startswith(field), caught.value.details()
    assert_teacher_serves(stub)


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [pytest.param(r, c, f, id=i) for i, r, c, f in TEXT_CASES],
)
def test_teacher_score_text_refuses_bad_requests_by_field(teacher_server, request_, code, field):
    _, _, stub = teacher_server
    with pytest.raises(grpc.RpcError) as caught:
        stub.ScoreText(request_, metadata=AUTH, timeout=WAIT_S)
    assert caught.value.code() == code, caught.value.details()
    assert caught.value.details().startswith(field), caught.value.details()
    assert_teacher_serves(stub)


# Raw bodies: (case id, method, body, code, field). Field 1 of ScoreTextRequest is a
# message: a truncated length prefix or an invalid UTF-8 string does not parse.
TEACHER_RAW_CASES = [
    ("score-text-truncated", f"/{TEACHER}/ScoreText", b"\x0a\x05ab", INVALID, "`request`"),
    (
        "score-text-invalid-utf8",
        f"/{TEACHER}/ScoreText",
        b"\x0a\x04\x0a\x02\xff\xfe",
        INVALID,
        "`request`",
    ),
    ("info-garbage", f"/{TEACHER}/Info", b"\x0a\xff\xff\xff", INVALID, "`request`"),
    ("score-wrong-wire-type", f"/{TEACHER}/Score", b"\x0d\x00\x00", INVALID, "`request`"),
    ("score-too-large", f"/{TEACHER}/Score", b"\x00" * (4 << 20), EXHAUSTED, ""),
]


@pytest.mark.parametrize(
    ("method", "body", "code", "field"),
    [pytest.param(m, b, c, f, id=i) for i, m, b, c, f in TEACHER_RAW_CASES],
)
def test_teacher_refuses_malformed_bodies(teacher_server, method, body, code, field):
    _, channel, stub = teacher_server
    with pytest.raises(grpc.RpcError) as caught:
        raw(channel, method)(body, metadata=AUTH, timeout=WAIT_S)
    assert caught.value.code() == code, caught.value.details()
    assert caught.value.details().startswith(field), caught.value.details()
    assert_teacher_serves(stub)


# ---- learner --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def learner_service():
    job = tiny_job("opd.steps=2", "loss.max_staleness=0")
    teacher_model, student = tiny_models(job)
    tokenizer = pipeline.job_tokenizer(job)
    learner = OpdLearner(
        job, student, InProcessTeacher(teacher_model, tokenizer), tokenizer, log=lambda _: None
    )
    runtime = LearnerRuntime(
        learner,
        shards_per_step=2,
        publish=lambda version, weights: None,
        server_config=ServerConfig(max_message_bytes=LEARNER_MAX_BYTES),
        step_timeout_s=120,
    )
    address = runtime.start()
    trace = rollout(
        learner.student,
        learner.prompts(0, [0, 1]),
        learner.settings,
        seed=job.seed,
        global_step=0,
        row_ids=[0, 1],
    )
    positions = [learner.stream_positions(0)[row] for row in (0, 1)]
    batch = RolloutBatch.from_trace(
        trace, step=0, policy_version=0, row_ids=[0, 1], stream_positions=positions
    )
    rows = rows_to_proto(batch, seed=job.seed, worker_id="test")
    channel = grpc.insecure_channel(address, options=ServerConfig().channel_options)
    yield runtime, channel, learner_pb2_grpc.LearnerServiceStub(channel), rows
    channel.close()
    runtime.stop(grace_s=1)


def completion_at(row, nth=0):
    return [i for i, flag in enumerate(row.completion_mask) if flag][nth]


def prompt_at(row):
    return list(row.prompt_mask).index(True)


def set_logp(row, index, value):
    row.action_logps[index] = value


def set_step(row, index, value):
    row.action_steps[index] = value


def set_mask(row, name, index, value):
    getattr(row, name)[index] = value


def clear_slots(row):
    for name in (
        "tokens",
        "positions",
        "segment_ids",
        "prompt_mask",
        "completion_mask",
        "action_steps",
        "action_logps",
    ):
        row.ClearField(name)


def set_settings(**fields):
    def edit(row):
        for name, value in fields.items():
            if name == "stop_ids":
                del row.settings.stop_ids[:]
                row.settings.stop_ids.extend(value)
            else:
                setattr(row.settings, name, value)

    return edit


def set_field(name, value):
    return lambda row: setattr(row, name, value)


# (case id, edit of the first row, code, text the details must contain (the field)).
PUSH_CASES = [
    ("no-settings", lambda row: row.ClearField("settings"), INVALID, "`rows[0].settings`"),
    ("empty-slots", clear_slots, INVALID, "`rows[0].tokens`"),
    ("positions-short", lambda row: row.positions.pop(), INVALID, "`rows[0].positions`"),
    ("tokens-long", lambda row: row.tokens.append(4), INVALID, "`rows[0].positions`"),
    ("negative-step", set_field("step", -1), INVALID, "`rows[0].step`"),
    ("negative-row-id", set_field("row_id", -1), INVALID, "`rows[0].row_id`"),
    ("negative-stream-position", set_field("stream_position", -3), INVALID, "stream_position"),
    ("negative-policy-version", set_field("policy_version", -1), INVALID, "policy_version"),
    ("block-size-zero", set_field("block_size", 0), INVALID, "`rows[0].block_size`"),
    ("row-id-int64-max", set_field("row_id", 2**63 - 1), INVALID, "`trace.row_ids`"),
    ("policy-version-int64-max", set_field("policy_version", 2**63 - 1), INVALID, "policy_ver"),
    ("step-int64-max", set_field("step", 2**63 - 1), INVALID, "step"),
    ("step-beyond-the-run", set_field("step", 10**6), INVALID, "step"),
    ("negative-token", lambda row: row.tokens.__setitem__(0, -1), INVALID, "tokens"),
    ("token-int32-max", lambda row: row.tokens.__setitem__(0, 2**31 - 1), INVALID, "tokens"),
    ("duplicate-stop-ids", set_settings(stop_ids=[3, 3]), INVALID, "stop_ids"),
    ("mask-id-among-stop-ids", set_settings(stop_ids=[3, 1]), INVALID, "stop_ids"),
    ("no-stop-ids", set_settings(stop_ids=[]), INVALID, "stop_ids"),
    ("unknown-alignment", set_settings(alignment="sideways"), INVALID, "alignment"),
    ("unknown-commit-rule", set_settings(commit_rule="vote"), INVALID, "commit_rule"),
    ("threshold-nan", set_settings(threshold=math.nan), INVALID, "threshold"),
    ("threshold-inf", set_settings(threshold=math.inf), INVALID, "threshold"),
    ("temperature-nan", set_settings(temperature=math.nan), INVALID, "temperature"),
    ("temperature-negative", set_settings(temperature=-1.0), INVALID, "temperature"),
    ("completion-length-negative", set_settings(completion_length=-4), INVALID, "completion"),
    ("pad-id-out-of-vocab", set_settings(pad_id=10_000), INVALID, "pad_id"),
    (
        "logp-positive-inf",
        lambda row: set_logp(row, completion_at(row), math.inf),
        INVALID,
        "action_logps",
    ),
    (
        "logp-negative-inf",
        lambda row: set_logp(row, completion_at(row), -math.inf),
        INVALID,
        "action_logps",
    ),
    (
        "logp-positive",
        lambda row: set_logp(row, completion_at(row), 0.5),
        INVALID,
        "action_logps",
    ),
    ("logp-outside-completion", lambda row: set_logp(row, 0, -1.0), INVALID, "action_logps"),
    (
        "action-step-missing-in-completion",
        lambda row: set_step(row, completion_at(row), -1),
        INVALID,
        "action_steps",
    ),
    ("action-step-in-prompt", lambda row: set_step(row, prompt_at(row), 0), INVALID, "action"),
    (
        "action-step-huge",
        lambda row: set_step(row, completion_at(row), 2**31 - 1),
        INVALID,
        "action_steps",
    ),
    (
        "prompt-and-completion-overlap",
        lambda row: set_mask(row, "prompt_mask", completion_at(row), True),
        INVALID,
        "mask",
    ),
    (
        "completion-mask-dropped",
        lambda row: set_mask(row, "completion_mask", completion_at(row), False),
        INVALID,
        "",
    ),
    ("negative-forwards", set_field("forwards", -1), INVALID, "forwards"),
    ("wrong-seed", set_field("seed", 12345), INVALID, "seed"),
]


def push_error(stub, rows):
    with pytest.raises(grpc.RpcError) as caught:
        stub.PushTraces(iter(rows), timeout=WAIT_S)
    return caught.value


def copy_rows(rows):
    return [type(row).FromString(row.SerializeToString()) for row in rows]


def assert_learner_serves(stub, invalid_before=None):
    status = stub.Status(learner_pb2.StatusRequest(), timeout=WAIT_S)
    assert status.total_steps == 2 and not status.error
    if invalid_before is not None:
        assert status.invalid_pushes == invalid_before + 1
    assert stub.AcquireWork(learner_pb2.WorkRequest(worker_id="probe"), timeout=WAIT_S).kind


@pytest.mark.parametrize(
    ("edit", "code", "field"),
    [pytest.param(e, c, f, id=i) for i, e, c, f in PUSH_CASES],
)
def test_learner_push_traces_refuses_bad_rows_by_field(learner_service, edit, code, field):
    runtime, _, stub, rows = learner_service
    before = runtime.counters.invalid_pushes
    bad = copy_rows(rows)
    edit(bad[0])
    error = push_error(stub, bad)
    assert error.code() == code, error.details()
    assert field in error.details(), error.details()
    assert_learner_serves(stub, before)


# (case id, rows to push, code, field).
PUSH_STREAM_CASES = [
    # The second row is fine but the first is bad: the whole push is refused.
    (
        "one-bad-row-of-two",
        lambda rows: [_with(rows[0], set_field("block_size", 0)), rows[1]],
        INVALID,
        "`rows[0].block_size`",
    ),
    (
        "bad-second-row",
        lambda rows: [rows[0], _with(rows[1], set_field("row_id", -1))],
        INVALID,
        "`rows[1].row_id`",
    ),
    (
        "two-rows-under-other-settings",
        lambda rows: [rows[0], _with(rows[1], set_settings(temperature=0.25))],
        INVALID,
        "temperature",
    ),
    (
        "oversized-row",
        lambda rows: [_with(rows[0], set_field("completion_text", "x" * LEARNER_MAX_BYTES))],
        EXHAUSTED,
        "",
    ),
]


def _with(row, edit):
    row = type(row).FromString(row.SerializeToString())
    edit(row)
    return row


@pytest.mark.parametrize(
    ("make", "code", "field"),
    [pytest.param(m, c, f, id=i) for i, m, c, f in PUSH_STREAM_CASES],
)
def test_learner_push_traces_refuses_bad_streams(learner_service, make, code, field):
    runtime, _, stub, rows = learner_service
    error = push_error(stub, make(rows))
    assert error.code() == code, error.details()
    assert field in error.details(), error.details()
    assert_learner_serves(stub)


LEARNER_RAW_CASES = [
    ("acquire-invalid-utf8-worker", "AcquireWork", b"\x0a\x02\xff\xfe", INVALID, "`request`"),
    ("acquire-truncated", "AcquireWork", b"\x0a\x09ab", INVALID, "`request`"),
    ("acquire-over-long-worker", "AcquireWork", None, EXHAUSTED, ""),
    ("status-garbage", "Status", b"\x0a\xff\xff\xff", INVALID, "`request`"),
    ("status-wrong-wire-type", "Status", b"\x0d\x00\x00", INVALID, "`request`"),
]


@pytest.mark.parametrize(
    ("method", "body", "code", "field"),
    [pytest.param(m, b, c, f, id=i) for i, m, b, c, f in LEARNER_RAW_CASES],
)
def test_learner_refuses_malformed_bodies(learner_service, method, body, code, field):
    _, channel, stub, _ = learner_service
    if body is None:  # a worker id over the message limit
        body = learner_pb2.WorkRequest(worker_id="w" * LEARNER_MAX_BYTES).SerializeToString()
    with pytest.raises(grpc.RpcError) as caught:
        raw(channel, f"/{LEARNER}/{method}")(body, timeout=WAIT_S)
    assert caught.value.code() == code, caught.value.details()
    assert caught.value.details().startswith(field), caught.value.details()
    assert_learner_serves(stub)


def test_learner_push_traces_refuses_an_unparsable_row(learner_service):
    _, channel, stub, rows = learner_service
    push = channel.stream_unary(
        f"/{LEARNER}/PushTraces", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as caught:
        push(iter([rows[0].SerializeToString(), b"\x52\x05ab"]), timeout=WAIT_S)
    assert caught.value.code() == INVALID, caught.value.details()
    assert caught.value.details().startswith("`request`"), caught.value.details()
    assert_learner_serves(stub)


# ---- CLI ------------------------------------------------------------------------------------


class FakeJobsApi(http.server.BaseHTTPRequestHandler):
    """Ray's Jobs API as far as an unknown job goes: the version, then 404 for any job."""

    def do_GET(self):  # noqa: N802
        if self.path == "/api/version":
            body = json.dumps({"version": "4", "ray_version": "2.40.0", "ray_commit": "x"})
            self._answer(200, body)
        else:
            self._answer(404, f"Job {self.path.split('/')[3]} does not exist")

    def do_POST(self):  # noqa: N802
        self._answer(404, f"Job {self.path.split('/')[3]} does not exist")

    def _answer(self, code, body):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if code == 200 else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def jobs_api():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeJobsApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


TINY = str(ROOT / "deploy/configs/tiny.yaml")

# (case id, argv ({api}: the fake Jobs API, {closed}: a closed loopback port, {tmp}: a
# temp dir), exit code, text stderr must contain (the field)).
CLI_CASES = [
    ("status-unknown-job", ["status", "nojob", "--address", "{api}"], 1, "`JOB`"),
    ("logs-unknown-job", ["logs", "nojob", "--address", "{api}"], 1, "`JOB`"),
    ("stop-unknown-job", ["stop", "nojob", "--address", "{api}"], 1, "`JOB`"),
    ("status-unreachable", ["status", "j", "--address", "{closed}"], 1, "`--address`"),
    ("logs-unreachable", ["logs", "j", "--address", "{closed}"], 1, "`--address`"),
    ("stop-unreachable", ["stop", "j", "--address", "{closed}"], 1, "`--address`"),
    ("list-unreachable", ["list", "--address", "{closed}"], 1, "`--address`"),
    ("status-not-http", ["status", "j", "--address", "127.0.0.1:1"], 1, "`--address`"),
    ("logs-not-http", ["logs", "j", "--address", "ray://h:10001"], 1, "`--address`"),
    ("stop-empty-job", ["stop", "", "--address", "{closed}"], 1, "`--address`"),
    (
        "submit-unreachable",
        ["submit", TINY, "--run-dir", "{tmp}/r", "--address", "{closed}"],
        1,
        "`--address`",
    ),
    ("submit-missing-config", ["submit", "{tmp}/none.yaml", "--run-dir", "{tmp}/r"], 2, "`config`"),
    ("run-missing-config", ["run", "{tmp}/none.yaml", "--run-dir", "{tmp}/r"], 2, "`config`"),
    ("run-config-is-a-dir", ["run", "{tmp}", "--run-dir", "{tmp}/r"], 2, "`config`"),
    ("run-bad-yaml", ["run", "{tmp}/bad.yaml", "--run-dir", "{tmp}/r"], 2, "`config`"),
    ("submit-bad-yaml", ["submit", "{tmp}/bad.yaml", "--run-dir", "{tmp}/r"], 2, "`config`"),
    ("run-unknown-override", ["run", TINY, "--run-dir", "{tmp}/r", "--set", "x.y=1"], 2, "`x"),
    (
        "run-non-loopback-host-without-token",
        ["run", TINY, "--run-dir", "{tmp}/r", "--set", "cluster.host=10.1.2.3"],
        2,
        "`cluster.token_file`",
    ),
    (
        "submit-bad-override",
        ["submit", TINY, "--run-dir", "{tmp}/r", "--set", "opd.steps=-1"],
        2,
        "`opd.steps`",
    ),
    ("score-ids-without-server", ["score", "--ids", "2 5"], 2, "`--ids`"),
    ("score-no-source", ["score", "hello"], 2, "`--hf-checkpoint`"),
]


def cli_args(argv, tmp_path, jobs_api):
    closed = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "bad.yaml").write_text("teacher: [unclosed\n")
    values = {"api": jobs_api, "closed": closed, "tmp": str(tmp_path)}
    return [arg.format(**values) for arg in argv]


@pytest.mark.parametrize(
    ("argv", "code", "field"),
    [pytest.param(a, c, f, id=i) for i, a, c, f in CLI_CASES],
)
def test_cli_refuses_bad_arguments_by_field(argv, code, field, tmp_path, jobs_api, capsys):
    args = cli_args(argv, tmp_path, jobs_api)
    assert cli.main(args) == code
    err = capsys.readouterr().err
    assert err.startswith(f"distill {args[0]}: ") and field in err, err
    assert err.count("\n") == 1, err  # one line, no traceback


SCORE_IDS_CASES = [
    ("not-numbers", "two five", 2, "`text`"),
    ("float-ids", "2.5 5", 2, "`text`"),
    ("out-of-vocab", "2 99", 1, "`sequences[0].ids`"),
    ("negative-id", "2 -1", 1, "`sequences[0].ids`"),
    ("single-id", "2", 1, "`sequences[0].ids`"),
    ("empty", "", 1, "`sequences[0].ids`"),
    ("over-long", " ".join(["2"] * 300), 1, "`sequences`"),
]


@pytest.mark.parametrize(
    ("text", "code", "field"),
    [pytest.param(t, c, f, id=i) for i, t, c, f in SCORE_IDS_CASES],
)
def test_cli_score_refuses_bad_ids_by_field(teacher_server, text, code, field, monkeypatch, capsys):
    server, _, stub = teacher_server
    monkeypatch.setenv("DISTILL_TOKEN", TOKEN)
    assert cli.main(["score", "--server", server.address, "--ids", text]) == code
    err = capsys.readouterr().err
    assert err.startswith("distill score: ") and field in err, err
    assert_teacher_serves(stub)


def test_cli_score_with_a_wrong_token_is_refused_by_name(teacher_server, monkeypatch, capsys):
    server, _, stub = teacher_server
    monkeypatch.setenv("DISTILL_TOKEN", "wrong")
    assert cli.main(["score", "--server", server.address, "--ids", "2 5"]) == 1
    assert "`authorization`" in capsys.readouterr().err
    assert_teacher_serves(stub)
