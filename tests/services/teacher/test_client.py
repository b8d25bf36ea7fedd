"""RemoteTeacher and the server plumbing against a fake teacher (no model, no JAX compiles):
retries on transient failures only (a server restarted on its port), a retry budget that ends a lasting outage with the address named, a full queue,
teacher failures, deadlines, TLS, replicas' addresses, and a client process that never
loads JAX."""

import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from distill.teacher_contract import ScoredSequence, TeacherInfo
from services.common.config import ServerConfig
from services.common.server import start_server
from services.proto import teacher_pb2, teacher_pb2_grpc
from services.teacher.client import RemoteTeacher, TeacherServerError
from services.teacher.messages import info_to_proto
from services.teacher.server import SERVICE_NAME, TeacherServerConfig, serve_teacher

ROOT = Path(__file__).resolve().parents[3]
WAIT_S = 60
INFO = TeacherInfo(
    vocab_size=10,
    pad_id=0,
    bos_id=1,
    mask_id=9,
    stop_ids=(2,),
    tokenizer_hash="t" * 64,
    model_hash="m" * 64,
    max_length=32,
)


class FakeTeacher:
    """Log-prob of token t is -t; calls can be held at a gate; ``[7, 7]`` makes it raise."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.calls = 0

    def info(self):
        return INFO

    def score(self, sequences, *, top_k=None):
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        if any(list(s) == [7, 7] for s in sequences):
            raise RuntimeError("out of teacher memory")
        out = []
        for s in sequences:
            log_probs = -np.asarray(s[1:], np.float32)
            top = (
                None
                if top_k is None
                else np.tile(np.arange(top_k, dtype=np.int32), (len(s) - 1, 1))
            )
            out.append(
                ScoredSequence(log_probs, top, None if top is None else -top.astype(np.float32))
            )
        return out


@pytest.fixture
def fake():
    return FakeTeacher()


def test_scores_and_top_k_round_trip_exactly(fake):
    with serve_teacher(fake) as server, RemoteTeacher(server.address) as remote:
        assert remote.info() == INFO
        (scored,) = remote.score([[1, 3, 5]], top_k=2)
        np.testing.assert_array_equal(scored.log_probs, [-3, -5])
        np.testing.assert_array_equal(scored.top_ids, [[0, 1], [0, 1]])
        np.testing.assert_array_equal(scored.top_log_probs, [[0, -1], [0, -1]])


class FlakyInfo(teacher_pb2_grpc.TeacherServiceServicer):
    """Answers Info with ``code`` for the first ``failures`` calls, then succeeds."""

    def __init__(self, failures, code=grpc.StatusCode.UNAVAILABLE):
        self.failures, self.code, self.calls = failures, code, 0

    def Info(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(self.code, "`teacher` must be loaded; received a call while loading")
        return info_to_proto(INFO)


def flaky_server(servicer):
    return start_server(
        ServerConfig(),
        lambda server: teacher_pb2_grpc.add_TeacherServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )


def test_unavailable_is_retried_with_backoff_until_it_succeeds():
    servicer = FlakyInfo(failures=2)
    with flaky_server(servicer) as server:
        remote = RemoteTeacher(server.address, retries=2, backoff_s=0.01)
        assert remote.info() == INFO and servicer.calls == 3


def test_unavailable_past_the_retries_raises_with_the_servers_reason():
    servicer = FlakyInfo(failures=5)
    with flaky_server(servicer) as server:
        remote = RemoteTeacher(server.address, retries=1, backoff_s=0.01)
        with pytest.raises(TeacherServerError, match="^`teacher` must be loaded.*2 attempts") as e:
            remote.info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and servicer.calls == 2


def test_other_statuses_are_not_retried():
    servicer = FlakyInfo(failures=5, code=grpc.StatusCode.FAILED_PRECONDITION)
    with flaky_server(servicer) as server:
        with pytest.raises(TeacherServerError, match="FAILED_PRECONDITION"):
            RemoteTeacher(server.address, retries=3, backoff_s=0.01).info()
        assert servicer.calls == 1


def test_no_server_at_the_address_is_unavailable_after_the_retries():
    with flaky_server(FlakyInfo(0)) as server:
        address = server.address
    with pytest.raises(TeacherServerError) as caught:
        RemoteTeacher(address, retries=1, backoff_s=0.01, timeout_s=10).info()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_teacher_restarted_on_its_port_loses_no_call_of_concurrent_clients(fake):
    # Four clients keep scoring while the server stops gracefully and comes back on the
    # same port 3 s later (longer than the 2 s backoff cap): with the default retry policy
    # every call succeeds, those made during the outage by retrying.
    server = serve_teacher(fake, TeacherServerConfig(grace_s=1.0))
    address, port = server.address, server.port
    stop, errors, done, longest = threading.Event(), [], [0] * 4, [0.0] * 4

    def client(index):
        with RemoteTeacher(address, timeout_s=WAIT_S) as remote:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    (scored,) = remote.score([[1, index + 2]])
                    assert scored.log_probs.tolist() == [-(index + 2)]
                except Exception as error:  # every failure is the test's failure
                    errors.append(error)
                    return
                longest[index] = max(longest[index], time.monotonic() - started)
                done[index] += 1

    def wait_for(condition, what):
        deadline = time.monotonic() + WAIT_S
        while not condition():
            assert not errors, errors
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    threads = [threading.Thread(target=client, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    restarted = None
    try:
        wait_for(lambda: min(done) >= 3, "every client to score before the stop")
        server.stop()
        time.sleep(3.0)
        restarted = serve_teacher(FakeTeacher(), TeacherServerConfig(address=f"127.0.0.1:{port}"))
        assert restarted.address == address
        after_restart = list(done)
        wait_for(
            lambda: all(d >= a + 3 for d, a in zip(done, after_restart, strict=True)),
            "every client to score after the restart",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
        if restarted is not None:
            restarted.stop()
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    assert restarted.stats().requests >= 12
    # Calls were in flight across the outage (they waited it out rather than failing).
    assert max(longest) >= 2.0


def test_a_teacher_that_stays_down_fails_within_the_budget_naming_the_address(fake):
    with serve_teacher(fake) as server:
        address = server.address
    remote = RemoteTeacher(address, budget_s=2.0, backoff_s=0.1, max_backoff_s=0.5, timeout_s=10)
    started = time.monotonic()
    with pytest.raises(TeacherServerError) as caught:
        remote.score([[1, 2]])
    took = time.monotonic() - started
    error = caught.value
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.address == address
    assert error.attempts >= 3 and error.elapsed_s >= 2.0
    assert took < 2.0 + 10  # the budget plus at most one attempt's deadline
    assert f"[teacher server {address}: UNAVAILABLE; {error.attempts} attempts in " in str(error)
    assert str(error).endswith(", retry budget spent (budget_s=2)]")


def test_a_full_queue_is_unavailable_and_the_server_recovers(fake):
    config = TeacherServerConfig(max_queue_requests=1, max_delay_ms=0.0)
    with serve_teacher(fake, config) as server:
        fake.gate.clear()
        clients = [RemoteTeacher(server.address, timeout_s=WAIT_S, retries=0) for _ in range(3)]
        results = {}
        held = threading.Thread(target=lambda: results.update(a=clients[0].score([[1, 2]])))
        held.start()
        assert fake.entered.wait(WAIT_S)  # first request is inside the teacher
        queued = threading.Thread(target=lambda: results.update(b=clients[1].score([[1, 3]])))
        queued.start()
        for _ in range(WAIT_S * 20):  # until the second request waits in the queue
            if server.stats().requests == 2:
                break
            threading.Event().wait(0.05)
        with pytest.raises(TeacherServerError) as caught:
            clients[2].score([[1, 4]])
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE  # transient: clients retry
        assert caught.value.reason.startswith("`queue` must have room for the request")
        fake.gate.set()
        held.join(WAIT_S), queued.join(WAIT_S)
        assert results["a"][0].log_probs.tolist() == [-2] and results["b"][
            0
        ].log_probs.tolist() == [-3]
        assert clients[2].score([[1, 4]])[0].log_probs.tolist() == [-4]


def test_a_failing_teacher_is_internal_with_its_reason_and_the_server_keeps_serving(fake):
    with serve_teacher(fake) as server, RemoteTeacher(server.address) as remote:
        with pytest.raises(TeacherServerError, match="RuntimeError: out of teacher memory") as e:
            remote.score([[7, 7]])
        assert e.value.code == grpc.StatusCode.INTERNAL
        assert remote.score([[1, 5]])[0].log_probs.tolist() == [-5]


def test_a_deadline_that_passes_while_queued_is_deadline_exceeded(fake):
    with serve_teacher(fake) as server:
        fake.gate.clear()
        remote = RemoteTeacher(server.address, timeout_s=0.2, retries=0)
        with pytest.raises(TeacherServerError) as caught:
            remote.score([[1, 2]])
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        fake.gate.set()
        assert RemoteTeacher(server.address).score([[1, 6]])[0].log_probs.tolist() == [-6]


def test_response_size_over_the_message_limit_is_refused_before_scoring(fake):
    config = TeacherServerConfig(max_message_bytes=1000)
    with serve_teacher(fake, config) as server, RemoteTeacher(server.address) as remote:
        with pytest.raises(TeacherServerError, match="^`top_k` must keep the response within"):
            remote.score([[1] * 30], top_k=10)
        assert fake.calls == 0


def self_signed(directory):
    """A throwaway certificate for ``localhost`` and its key, as PEM files."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


def test_tls_with_a_token(fake, tmp_path):
    cert, key = self_signed(tmp_path)
    config = TeacherServerConfig(token="tok", tls_cert_file=cert, tls_key_file=key)
    with serve_teacher(fake, config) as server:
        secure = RemoteTeacher(
            server.address, token="tok", tls_root_cert_file=cert, tls_server_name="localhost"
        )
        assert secure.score([[1, 8]])[0].log_probs.tolist() == [-8]
        with pytest.raises(TeacherServerError) as caught:  # plaintext cannot talk to it
            RemoteTeacher(server.address, token="tok", retries=0, timeout_s=10).info()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_garbage_tls_certificate_is_refused_naming_the_field(fake, tmp_path):
    _, key = self_signed(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text(
        "-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n"
    )
    config = TeacherServerConfig(token="tok", tls_cert_file=str(garbage), tls_key_file=key)
    with pytest.raises(ValueError, match="`tls_cert_file` must hold a PEM certificate chain"):
        serve_teacher(fake, config)


def test_a_tls_name_override_without_roots_is_refused():
    with pytest.raises(ValueError, match="`tls_root_cert_file` must be given"):
        RemoteTeacher("127.0.0.1:1", tls_server_name="localhost")


def test_score_request_message_is_what_the_contract_says():
    request = teacher_pb2.ScoreRequest(sequences=[teacher_pb2.TokenSequence(ids=[1, 2, 3])])
    field = request.sequences[0].DESCRIPTOR.fields_by_name["ids"]
    assert field.is_packed and request.top_k == 0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "^`address` or `addresses` must be given, not both; received address=None"),
        (
            {"address": "127.0.0.1:1", "addresses": ["127.0.0.1:2"]},
            "^`address` or `addresses` must be given, not both",
        ),
        ({"addresses": ["teacher-0:1", "teacher-1:1"]}, "^`addresses` must be host:port with IP"),
        ({"address": "127.0.0.1:1", "retries": -1}, "^`retries` must be greater than or equal"),
        ({"address": "127.0.0.1:1", "backoff_s": 9.0}, r"^`backoff_s` must be in \[0, max_back"),
    ],
)
def test_bad_client_arguments_name_the_field(arguments, message):
    with pytest.raises(ValueError, match=message):
        RemoteTeacher(**arguments)


def test_replica_addresses_share_one_round_robin_channel(fake):
    with serve_teacher(fake) as first, serve_teacher(FakeTeacher()) as second:
        addresses = [first.address, second.address]
        with RemoteTeacher(addresses=addresses, retries=0) as remote:
            assert remote.address == ",".join(addresses) and remote.addresses == tuple(addresses)
            scores = [remote.score([[1, 2, 3]])[0].log_probs.tolist() for _ in range(6)]
    assert scores == [[-2, -3]] * 6
    assert first.stats().requests + second.stats().requests == 6


def test_the_teacher_client_process_never_loads_jax():
    # A learner-side process that only calls a teacher server must stay light: the client
    # imports the teacher contract, not distill.teacher (JAX, Flax).
    code = "import sys, services.teacher.client; assert 'jax' not in sys.modules, 'jax loaded'"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
