"""The teacher endpoint tried as an attacker and a busy user would: open streams that must
not stall scoring, oversized and unparsable bodies from strangers, per-method limits,
warm-up before SERVING, NOT_SERVING on drain, and metrics that count what happened.

Every wait is bounded (``WAIT_S``); the one latency assertion compares against a baseline
measured in the same test with a generous margin.
"""

import contextlib
import logging
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from distill.teacher import InProcessTeacher
from services.common.auth import bearer_metadata
from services.proto import teacher_pb2, teacher_pb2_grpc
from services.teacher.server import SERVICE_NAME, TeacherServerConfig, serve_teacher
from tests.support.fakes import tiny_char_teacher
from tests.support.network import free_port

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "s3cret-teacher-token"
WAIT_S = 120  # bound on any single wait; only reached when something hangs
SCORE = f"/{SERVICE_NAME}/Score"
INFO = f"/{SERVICE_NAME}/Info"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def tiny_teacher() -> InProcessTeacher:
    return tiny_char_teacher(max_length=64)


@pytest.fixture(scope="module")
def teacher():
    return tiny_teacher()


@pytest.fixture(scope="module")
def server(teacher):
    config = TeacherServerConfig(
        token=TOKEN,
        max_batch_sequences=8,
        max_request_sequences=16,
        max_request_tokens=400,
        metrics_address="127.0.0.1:0",
    )
    with serve_teacher(teacher, config) as running:
        yield running


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as opened:
        yield opened


def score_request(sequences, top_k=0):
    return teacher_pb2.ScoreRequest(
        sequences=[teacher_pb2.TokenSequence(ids=s) for s in sequences], top_k=top_k
    )


def raw_call(channel, method):
    """A unary call sending and receiving raw bytes (no client-side parsing)."""
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)


def timed_scores(channel, count=5) -> list[float]:
    stub = teacher_pb2_grpc.TeacherServiceStub(channel)
    request = score_request([[2, 5, 7, 9], [3, 4]])
    seconds = []
    for _ in range(count):
        started = time.monotonic()
        stub.Score(request, metadata=bearer_metadata(TOKEN), timeout=WAIT_S)
        seconds.append(time.monotonic() - started)
    return seconds


class HeldReflectionStream:
    """A reflection stream that sent one request and stays open until :meth:`close`."""

    def __init__(self, channel):
        self._done = threading.Event()

        def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            self._done.wait(WAIT_S)

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        self.call = stub.ServerReflectionInfo(requests(), timeout=WAIT_S)

    def first(self):
        return next(self.call)

    def close(self):
        self._done.set()
        self.call.cancel()


# ---- open streams do not stall scoring ------------------------------------------------------


def test_64_open_reflection_streams_and_64_health_watches_leave_score_at_its_latency(
    server, channel
):
    timed_scores(channel, 2)  # compiled shapes
    baseline = statistics.median(timed_scores(channel))
    health = health_pb2_grpc.HealthStub(channel)
    streams, watches = [], []
    try:
        for _ in range(64):
            stream = HeldReflectionStream(channel)
            streams.append(stream)
            assert stream.first().list_services_response.service
        for _ in range(64):
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
            watches.append(watch)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        assert server.running.guard.in_flight(REFLECTION) == 64
        loaded = statistics.median(timed_scores(channel))
        # Generous: a thread-pool server times out here (its 32 threads are all held).
        assert loaded <= max(10 * baseline, baseline + 1.0), (baseline, loaded)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for stream in streams:
            stream.close()
        for watch in watches:
            watch.cancel()


def test_a_method_at_its_concurrency_limit_answers_unavailable_naming_it(teacher):
    config = TeacherServerConfig(method_limits={REFLECTION: 2})
    with (
        serve_teacher(teacher, config) as limited,
        grpc.insecure_channel(limited.address) as channel,
    ):
        held = [HeldReflectionStream(channel) for _ in range(2)]
        try:
            for stream in held:
                stream.first()
            extra = HeldReflectionStream(channel)
            with pytest.raises(grpc.RpcError) as caught:
                extra.first()
            extra.close()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert caught.value.details().startswith(f"`{REFLECTION}` must have fewer than 2")
            stub = teacher_pb2_grpc.TeacherServiceStub(channel)
            assert stub.Score(score_request([[2, 5]]), timeout=WAIT_S).sequences
        finally:
            for stream in held:
                stream.close()


# ---- strangers' bodies ------------------------------------------------------------------------


def test_an_unauthenticated_body_is_refused_before_it_is_parsed(server, channel):
    malformed_before = server.metrics.value(
        "distill_rpc_malformed_total", method=SCORE
    )  # garbage that would count as malformed if it were parsed
    garbage = b"\xff" * 4096
    for metadata in ((), bearer_metadata("wrong")):
        with pytest.raises(grpc.RpcError) as caught:
            raw_call(channel, SCORE)(garbage, metadata=metadata, timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.metrics.value("distill_rpc_malformed_total", method=SCORE) == malformed_before


def test_a_malformed_body_is_invalid_argument_counted_and_not_logged(server, channel, caplog):
    before = server.metrics.value("distill_rpc_malformed_total", method=SCORE)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as caught:
                raw_call(channel, SCORE)(
                    b"\x0a\xff\xff\xff", metadata=bearer_metadata(TOKEN), timeout=WAIT_S
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith("`request` must be a valid Score request")
    assert server.metrics.value("distill_rpc_malformed_total", method=SCORE) == before + 3
    assert not [record for record in caplog.records if record.exc_info], caplog.text
    assert timed_scores(channel, 1)  # still serving


def test_the_receive_limit_follows_the_request_limits(server, channel):
    config = server.servicer.config
    assert config.max_receive_bytes < 4 << 20  # not gRPC's or the old 64 MiB
    too_big = b"\x00" * (config.max_receive_bytes + 1)
    with pytest.raises(grpc.RpcError) as caught:
        raw_call(channel, SCORE)(too_big, metadata=bearer_metadata(TOKEN), timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert timed_scores(channel, 1)


SERVE_SCRIPT = """
import sys
from tests.services.teacher.test_endpoint_hardening import TOKEN, tiny_teacher
from services.teacher.server import TeacherServerConfig, serve_teacher
server = serve_teacher(tiny_teacher(), TeacherServerConfig(token=TOKEN))
print(server.address, flush=True)
sys.stdin.read()
server.stop()
"""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def script_server(script: str):
    """Run ``script`` (it prints the server's address, then serves until its stdin closes)
    in its own process; yields ``(process, lines, address)``, ``lines`` a queue of its later
    stdout lines. The process is stopped (stdin closed, else killed) on exit."""
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=os.environ | {"JAX_PLATFORMS": "cpu"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    try:
        try:
            address = lines.get(timeout=WAIT_S).strip()
        except queue.Empty:
            pytest.fail(f"the server process printed no address within {WAIT_S} s")
        yield process, lines, address
    finally:
        process.stdin.close()
        try:
            process.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(WAIT_S)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_60_mib_unauthenticated_request_costs_the_server_no_memory():
    with (
        script_server(SERVE_SCRIPT) as (process, _, address),
        grpc.insecure_channel(address) as channel,
    ):
        timed_scores(channel, 1)
        before = rss_bytes(process.pid)
        body = b"\x0a" * (60 << 20)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as caught:
                raw_call(channel, SCORE)(body, timeout=WAIT_S)
            assert caught.value.code() in (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.UNAUTHENTICATED,
            )
        grown = rss_bytes(process.pid) - before
        # Stated bound: 16 MiB (the body is 60 MiB, sent three times).
        assert grown < 16 << 20, f"server grew {grown / 2**20:.1f} MiB"
        assert timed_scores(channel, 1)


# ---- metrics ----------------------------------------------------------------------------------


def test_after_n_calls_the_request_counter_reads_n_and_the_histogram_has_n_samples(server, channel):
    metrics = server.metrics
    labels = {"method": INFO}
    calls_before = metrics.value("distill_rpc_requests_total", code="OK", **labels)
    samples_before = metrics.value("distill_rpc_latency_seconds_count", **labels)
    stub = teacher_pb2_grpc.TeacherServiceStub(channel)
    for _ in range(7):
        stub.Info(teacher_pb2.InfoRequest(), metadata=bearer_metadata(TOKEN), timeout=WAIT_S)
    assert metrics.value("distill_rpc_requests_total", code="OK", **labels) == calls_before + 7
    assert metrics.value("distill_rpc_latency_seconds_count", **labels) == samples_before + 7
    refused_before = metrics.value(
        "distill_rpc_requests_total", method=INFO, code="UNAUTHENTICATED"
    )
    with pytest.raises(grpc.RpcError):
        stub.Info(teacher_pb2.InfoRequest(), timeout=WAIT_S)
    assert (
        metrics.value("distill_rpc_requests_total", method=INFO, code="UNAUTHENTICATED")
        == refused_before + 1
    )
    tokens_before = metrics.value("distill_teacher_scored_tokens_total")
    stub.Score(score_request([[2, 5, 7], [1, 2]]), metadata=bearer_metadata(TOKEN), timeout=WAIT_S)
    assert metrics.value("distill_teacher_scored_tokens_total") == tokens_before + 3


def test_the_metrics_endpoint_serves_prometheus_text_on_loopback(server):
    endpoint = server.metrics_endpoint
    assert endpoint is not None and endpoint.host == "127.0.0.1"
    with urllib.request.urlopen(f"http://{endpoint.address}/metrics", timeout=WAIT_S) as reply:
        text = reply.read().decode()
    for name in (
        "distill_rpc_requests_total",
        "distill_rpc_latency_seconds_bucket",
        "distill_teacher_batch_rows_bucket",
        "distill_teacher_batch_fill_bucket",
        "distill_teacher_queue_requests",
        "distill_teacher_compiles",
    ):
        assert name in text


def test_the_metrics_address_is_off_by_default_and_loopback_unless_made_public():
    assert TeacherServerConfig().metrics_address is None
    with pytest.raises(ValueError, match="^`metrics_address` must be loopback unless"):
        TeacherServerConfig(metrics_address="0.0.0.0:9100")
    assert TeacherServerConfig(metrics_address="0.0.0.0:9100", metrics_public=True)


# ---- warm-up and drain --------------------------------------------------------------------------


class GatedTeacher:
    """Delegates to a real teacher; ``warm_up`` and ``score`` wait for their gates."""

    def __init__(self, inner):
        self.inner = inner
        self.warm_gate = threading.Event()
        self.score_gate = threading.Event()
        self.scoring = threading.Event()

    def info(self):
        return self.inner.info()

    def warm_up(self):
        assert self.warm_gate.wait(WAIT_S), "warm_gate never opened"

    def score(self, sequences, *, top_k=None):
        self.scoring.set()
        assert self.score_gate.wait(WAIT_S), "score_gate never opened"
        return self.inner.score(sequences, top_k=top_k)


def health_status(channel, service=""):
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S).status


def test_health_is_not_serving_and_score_unavailable_until_the_warm_up_ends(teacher):
    gated = GatedTeacher(teacher)
    gated.score_gate.set()
    address = f"127.0.0.1:{free_port()}"
    started: queue.Queue = queue.Queue()
    thread = threading.Thread(
        target=lambda: started.put(serve_teacher(gated, TeacherServerConfig(address=address)))
    )
    thread.start()
    server = None
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(WAIT_S)
            assert health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = teacher_pb2_grpc.TeacherServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Score(score_request([[2, 5]]), timeout=WAIT_S)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert caught.value.details().startswith("`teacher` must finish its warm-up")
            gated.warm_gate.set()
            server = started.get(timeout=WAIT_S)
            assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
            assert stub.Score(score_request([[2, 5]]), timeout=WAIT_S).sequences
    finally:
        gated.warm_gate.set()
        thread.join(WAIT_S)
        if server is None and not started.empty():
            server = started.get()
        if server is not None:
            server.stop(0)


def test_health_turns_not_serving_when_a_drain_starts_and_in_flight_calls_finish(teacher):
    gated = GatedTeacher(teacher)
    gated.warm_gate.set()
    server = serve_teacher(gated, TeacherServerConfig(grace_s=WAIT_S))
    answers: queue.Queue = queue.Queue()
    with grpc.insecure_channel(server.address) as channel:
        stub = teacher_pb2_grpc.TeacherServiceStub(channel)
        caller = threading.Thread(
            target=lambda: answers.put(stub.Score(score_request([[2, 5, 7]]), timeout=WAIT_S))
        )
        caller.start()
        assert gated.scoring.wait(WAIT_S), "the call never reached the teacher"
        # A balancer watches health: the watch opened before the drain sees it turn.
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        gated.score_gate.set()
        reply = answers.get(timeout=WAIT_S)
        np.testing.assert_array_equal(
            reply.sequences[0].log_probs, teacher.score([[2, 5, 7]])[0].log_probs
        )
        caller.join(WAIT_S)
        stopper.join(WAIT_S)
        assert not stopper.is_alive()
