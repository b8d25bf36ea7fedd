"""Access control on every service (issue #15, item 5): the learner and the teacher each
refuse a missing or wrong bearer token on every RPC (``UNAUTHENTICATED``, reason naming
`authorization`), accept the scheme in any case, serve TLS with a certificate generated
here (the client verifying it), bind loopback by default and refuse a non-loopback bind
without a token by name; a token file open to others is refused naming it; and a whole
distributed job run with a token writes it into none of its logs.

Already covered elsewhere (not repeated): ``read_token`` file rules and modes
(common/test_auth.py), the teacher's token / health / reflection over plaintext
(teacher/test_teacher_server.py), unauthenticated bodies refused before parsing
(teacher/test_endpoint_hardening.py), ServerConfig field errors (common/test_config.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distill import pipeline
from distill.config import ConfigError
from distill.opd.learner import OpdLearner
from distill.teacher import InProcessTeacher
from services import cli
from services.common.auth import TokenError, read_token
from services.common.config import ClusterConfig, ServerConfig
from services.learner.service import SERVICE_NAME as LEARNER
from services.learner.service import LearnerRuntime
from services.proto import learner_pb2, teacher_pb2
from services.teacher.client import RemoteTeacher
from services.teacher.server import SERVICE_NAME as TEACHER
from services.teacher.server import TeacherServerConfig, serve_teacher
from tests.support.fakes import tiny_char_teacher, tiny_job, tiny_models

TOKEN = "acl-Zq8r2VtY6pLw4Xn0"
WAIT_S = 60
AUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def self_signed(directory: Path, name: str = "localhost") -> tuple[Path, Path]:
    """A self-signed server certificate for localhost and 127.0.0.1, and its key (0600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = directory / "server.pem", directory / "server.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return cert_file, key_file


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    return self_signed(root / "server"), self_signed(root / "stranger")[0]


def tls_channel(address: str, cert_file: Path) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates=cert_file.read_bytes())
    return grpc.secure_channel(address, credentials)


@pytest.fixture(scope="module")
def teacher_server(tls):
    (cert_file, key_file), _ = tls
    teacher = tiny_char_teacher(max_length=64, seed=0)
    server_config = TeacherServerConfig(
        token=TOKEN, tls_cert_file=str(cert_file), tls_key_file=str(key_file)
    )
    with serve_teacher(teacher, server_config) as server:
        yield server


@pytest.fixture(scope="module")
def learner_server(tls):
    (cert_file, key_file), _ = tls
    job = tiny_job("opd.steps=2")
    teacher_model, student = tiny_models(job)
    tokenizer = pipeline.job_tokenizer(job)
    learner = OpdLearner(
        job, student, InProcessTeacher(teacher_model, tokenizer), tokenizer, log=lambda _: None
    )
    runtime = LearnerRuntime(
        learner,
        shards_per_step=2,
        publish=lambda version, weights: None,
        server_config=ServerConfig(
            token=TOKEN, tls_cert_file=str(cert_file), tls_key_file=str(key_file)
        ),
    )
    runtime.start()
    yield runtime
    runtime.stop(grace_s=1)


@pytest.fixture(scope="module", params=["learner", "teacher"])
def service(request, tls):
    """(service name, address, {method: serialized valid request}) of a running server."""
    cert_file = tls[0][0]
    if request.param == "learner":
        runtime = request.getfixturevalue("learner_server")
        calls = {
            "AcquireWork": learner_pb2.WorkRequest(worker_id="acl"),
            "Status": learner_pb2.StatusRequest(),
        }
        name, address = LEARNER, runtime.address
    else:
        server = request.getfixturevalue("teacher_server")
        calls = {
            "Score": teacher_pb2.ScoreRequest(sequences=[teacher_pb2.TokenSequence(ids=[2, 5])]),
            "ScoreText": teacher_pb2.ScoreTextRequest(
                pairs=[teacher_pb2.TextPair(prompt="a", completion="b")]
            ),
            "Info": teacher_pb2.InfoRequest(),
        }
        name, address = TEACHER, server.address
    with tls_channel(address, cert_file) as channel:
        yield name, channel, {m: r.SerializeToString() for m, r in calls.items()}


def call(channel, name, method, body, metadata=()):
    """A call with raw bytes; PushTraces (client streaming) sends ``body`` as one message."""
    path = f"/{name}/{method}"
    if method == "PushTraces":
        stub = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
        return stub(iter([body]), metadata=metadata, timeout=WAIT_S)
    stub = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    return stub(body, metadata=metadata, timeout=WAIT_S)


def methods_of(name, calls):
    """Every RPC of the service: the valid calls, plus PushTraces for the learner (an empty
    row: refused for its content only once it is authenticated)."""
    every = dict(calls)
    if name == LEARNER:
        every["PushTraces"] = b""
    return every


REFUSED_METADATA = [
    pytest.param((), "received none", id="none"),
    pytest.param((("authorization", f"Bearer {TOKEN}x"),), "different", id="wrong-token"),
    pytest.param((("authorization", "Bearer"),), "different", id="scheme-only"),
    pytest.param((("authorization", f"Basic {TOKEN}"),), "different", id="basic-scheme"),
    pytest.param((("authorization", TOKEN),), "different", id="no-scheme"),
    pytest.param((("authorization", f"Bearer  {TOKEN}"),), "different", id="two-spaces"),
    pytest.param((("authorization", f"Bearer {TOKEN[:-1]}"),), "different", id="prefix"),
    pytest.param((("x-token", TOKEN),), "received none", id="other-header"),
]


@pytest.mark.parametrize(("metadata", "received"), REFUSED_METADATA)
def test_every_rpc_without_the_right_token_is_unauthenticated(service, metadata, received):
    name, channel, calls = service
    for method, body in methods_of(name, calls).items():
        with pytest.raises(grpc.RpcError) as caught:
            call(channel, name, method, body, metadata)
        assert caught.value.code() == AUTHENTICATED, (method, caught.value.details())
        details = caught.value.details()
        assert details.startswith("`authorization` metadata must be") and received in details


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_scheme_is_matched_in_any_case(service, scheme):
    name, channel, calls = service
    for method, body in calls.items():
        assert call(channel, name, method, body, (("authorization", f"{scheme} {TOKEN}"),))


def test_health_stays_open_without_a_token(service):
    name, channel, _ = service
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=WAIT_S)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# ---- TLS --------------------------------------------------------------------------------------


def address_of(request, which):
    if which == "learner":
        return request.getfixturevalue("learner_server").address
    return request.getfixturevalue("teacher_server").address


@pytest.mark.parametrize("which", ["learner", "teacher"])
def test_a_plaintext_client_and_one_trusting_another_certificate_cannot_connect(
    request, tls, which
):
    address = address_of(request, which)
    name = LEARNER if which == "learner" else TEACHER
    method, body = ("Status", b"") if which == "learner" else ("Info", b"")
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with tls_channel(address, tls[0][0]) as trusted:
        assert call(trusted, name, method, body, auth) is not None  # the right root verifies
    for channel in (grpc.insecure_channel(address), tls_channel(address, tls[1])):
        with channel, pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(f"/{name}/{method}")(body, metadata=auth, timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_teacher_client_verifies_the_server_certificate(teacher_server, tls):
    cert_file = tls[0][0]
    with RemoteTeacher(
        teacher_server.address, token=TOKEN, tls_root_cert_file=str(cert_file)
    ) as remote:
        assert len(remote.score([[2, 5, 7]])[0].log_probs) == 2
    with (
        RemoteTeacher(
            teacher_server.address, token="wrong", tls_root_cert_file=str(cert_file)
        ) as remote,
        pytest.raises(Exception, match="`authorization`"),
    ):
        remote.info()


def test_a_key_that_does_not_match_the_certificate_is_refused_by_field(tls):
    from services.common.server import start_server

    (cert_file, _), stranger = tls
    config = ServerConfig(
        tls_cert_file=str(cert_file), tls_key_file=str(stranger.parent / "server.key")
    )
    with pytest.raises(ConfigError, match="^`tls_cert_file` must hold a PEM certificate chain"):
        start_server(config, lambda server: None, [])


# ---- binds --------------------------------------------------------------------------------------


def test_every_service_binds_loopback_by_default():
    assert ServerConfig().address.startswith("127.0.0.1:")
    assert TeacherServerConfig().address.startswith("127.0.0.1:")
    assert ClusterConfig().host == "127.0.0.1"
    args = cli.build_parser().parse_args(["serve", "teacher", "--hf-checkpoint", "x"])
    assert args.address.startswith("127.0.0.1:")


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", "10.1.2.3:50051", "example.com:1"])
@pytest.mark.parametrize("config", [ServerConfig, TeacherServerConfig], ids=["learner", "teacher"])
def test_a_non_loopback_bind_without_a_token_is_refused_naming_token(config, address):
    with pytest.raises(ConfigError, match="^`token` must be set when `address` is not loopback"):
        config(address=address)
    assert config(address=address, token=TOKEN).token == TOKEN  # with a token it may


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_job_on_a_non_loopback_host_without_a_token_file_is_refused(host):
    with pytest.raises(
        ConfigError, match="^`cluster.token_file` must be set when `host` is not loop"
    ):
        ClusterConfig(host=host)


def test_a_non_loopback_learner_with_a_token_serves(learner_server):
    """The learner's server on all interfaces (allowed with a token) refuses strangers."""
    runtime = learner_server
    config = ServerConfig(address="0.0.0.0:0", token=TOKEN)
    from services.common.server import start_server
    from services.learner.service import LearnerServicer
    from services.proto import learner_pb2_grpc

    servicer = LearnerServicer(runtime)
    server = start_server(
        config,
        lambda s: learner_pb2_grpc.add_LearnerServiceServicer_to_server(servicer, s),
        [LEARNER],
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as caught:
                call(channel, LEARNER, "Status", b"")
            assert caught.value.code() == AUTHENTICATED
            assert call(channel, LEARNER, "Status", b"", (("authorization", f"bearer {TOKEN}"),))
    finally:
        server.stop(0)


# ---- token files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_score_refuses_a_token_file_others_can_read_by_name(tmp_path, capsys, mode):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(mode)
    argv = ["score", "--server", "127.0.0.1:1", "--token-file", str(token_file), "--ids", "2 5"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("distill score: `--token-file` must be accessible by its owner only")
    assert str(token_file) in err and TOKEN not in err


def test_a_job_token_file_others_can_read_is_refused_by_name(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o644)
    job = tiny_job(f"cluster.token_file={token_file}")
    with pytest.raises(TokenError, match="must be accessible by its owner only") as caught:
        read_token(job.cluster.token_file)
    assert str(token_file) in str(caught.value) and TOKEN not in str(caught.value)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        pytest.param(["--address", "0.0.0.0:0"], "`token` must be set when", id="public-no-token"),
        pytest.param(["--address", "[::]:0"], "`token` must be set when", id="public-v6-no-token"),
        pytest.param(
            ["--token-file", "{open}"], "`--token-file` must be accessible", id="open-file"
        ),
    ],
)
def test_serve_teacher_refuses_an_unprotected_bind_before_loading(tmp_path, capsys, extra, field):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o644)
    extra = [arg.format(open=token_file) for arg in extra]
    argv = ["serve", "teacher", "--hf-checkpoint", str(tmp_path / "missing"), *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distill serve: {field}"), err
    assert TOKEN not in err


def test_a_job_refuses_an_open_token_file_before_it_starts_ray(tmp_path, monkeypatch):
    from services.jobs import driver

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o644)
    job = tiny_job(f"cluster.token_file={token_file}")

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the token file was checked")

    monkeypatch.setattr(driver, "start_ray", no_ray)
    with pytest.raises(TokenError, match="`--token-file` must be accessible by its owner"):
        driver.run_job(job, tmp_path / "run", progress=False, log=lambda _: None)


# ---- the token in no log ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_distributed_job_with_a_token_writes_it_into_no_log(tmp_path):
    from services.jobs.driver import run_job

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    job = tiny_job(
        "teacher_training.steps=2",
        "teacher_training.optimizer.warmup_steps=1",
        "teacher_training.eval_examples=2",
        "student_warmup.steps=2",
        "student_warmup.optimizer.warmup_steps=1",
        "student_warmup.eval_examples=2",
        "opd.steps=2",
        "opd.checkpoint_every=2",
        "cluster.rollout.count=1",
        "cluster.step_timeout_s=300",
        f"cluster.token_file={token_file}",
    )
    run_dir = tmp_path / "run"
    temp = Path("/tmp") / f"distill-acl-{os.getpid()}"
    lines: list[str] = []
    try:
        result = run_job(job, run_dir, ray_temp_dir=temp, progress=False, log=lines.append)
        assert result.status["step"] == 2
        searched = 0
        needle = TOKEN.encode()
        for root in (run_dir, temp):
            for path in root.rglob("*"):
                if path.is_file() and not path.is_symlink():
                    try:
                        data = path.read_bytes()
                    except OSError:
                        continue  # sockets, vanished files
                    searched += 1
                    assert needle not in data, f"the token is in {path}"
        logs = list(temp.rglob("session_*/logs/*"))
        assert logs and searched > len(logs), (searched, len(logs))
        assert not any(TOKEN in line for line in lines)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_the_job_config_carries_the_token_file_not_the_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    job = tiny_job(f"cluster.token_file={token_file}")
    assert TOKEN not in job.model_dump_json() and TOKEN not in repr(job)
    assert TOKEN not in repr(ServerConfig(token=TOKEN))
