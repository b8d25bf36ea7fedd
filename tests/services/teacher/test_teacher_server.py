"""The teacher scoring server on loopback: same scores as in-process, validation that keeps
serving, limits, auth, health, reflection, concurrent callers, one client over two replicas,
the CLI in a subprocess.

One tiny causal model is served for the whole module. Sequences stay <= 16 ids and requests
hold 1, 2 or 4 sequences, so the teacher compiles for few shapes.
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from flax import nnx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from distill.config import ConfigError, ModelConfig
from distill.models.transformer import Transformer
from distill.teacher import InProcessTeacher, ScoredSequence, TeacherInfo, check_compatible
from distill.tokenizer import CharTokenizer
from services import cli
from services.common.auth import bearer_metadata
from services.proto import teacher_pb2, teacher_pb2_grpc
from services.teacher.client import InvalidTeacherRequest, RemoteTeacher, TeacherServerError
from services.teacher.server import SERVICE_NAME, TeacherServerConfig, serve_teacher

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "s3cret-teacher-token"
MAX_LENGTH = 64
WAIT_S = 120  # bound on any single wait; only reached when something hangs


@pytest.fixture(scope="module")
def teacher():
    tokenizer = CharTokenizer()
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        attention_type="causal",
        init_std=0.2,
        max_length=MAX_LENGTH,
    )
    return InProcessTeacher(Transformer(config, rngs=nnx.Rngs(0)), tokenizer)


@pytest.fixture(scope="module")
def server(teacher):
    config = TeacherServerConfig(
        token=TOKEN,
        max_batch_sequences=8,
        max_delay_ms=5.0,
        max_request_sequences=16,
        max_request_tokens=400,
    )
    with serve_teacher(teacher, config) as running:
        yield running


@pytest.fixture(scope="module")
def remote(server):
    with RemoteTeacher(server.address, token=TOKEN, timeout_s=WAIT_S) as client:
        yield client


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as opened:
        yield opened


def random_sequences(rng, count, vocab):
    return [rng.integers(0, vocab, rng.integers(2, 17)).tolist() for _ in range(count)]


def assert_same_scores(got, want, *, exact):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if exact:
            np.testing.assert_array_equal(a.log_probs, b.log_probs)
        else:
            np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=1e-6, atol=1e-6)
        assert (a.top_ids is None) == (b.top_ids is None)
        if b.top_ids is not None:
            np.testing.assert_array_equal(a.top_ids, b.top_ids)
            np.testing.assert_allclose(a.top_log_probs, b.top_log_probs, rtol=1e-6, atol=1e-6)


def score_raw(channel, request, token=TOKEN):
    stub = teacher_pb2_grpc.TeacherServiceStub(channel)
    return stub.Score(request, metadata=bearer_metadata(token), timeout=WAIT_S)


def request_of(sequences, top_k=0):
    return teacher_pb2.ScoreRequest(
        sequences=[teacher_pb2.TokenSequence(ids=s) for s in sequences], top_k=top_k
    )


# ---- scores and info ---------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [None, 3])
@pytest.mark.parametrize("count", [1, 4])
def test_served_scores_are_bitwise_the_in_process_scores(teacher, remote, top_k, count):
    # Alone on the server, a request of a power-of-two count is one batch of the same shape
    # as the direct call, so the float32 results are identical.
    sequences = random_sequences(np.random.default_rng(count), count, teacher.info().vocab_size)
    got = remote.score(sequences, top_k=top_k)
    assert_same_scores(got, teacher.score(sequences, top_k=top_k), exact=True)
    assert all(isinstance(s, ScoredSequence) and s.log_probs.dtype == np.float32 for s in got)
    if top_k:
        assert got[0].top_ids.shape == (len(sequences[0]) - 1, top_k)


def test_a_call_without_a_deadline_is_scored(teacher, channel):
    # A plain stub call (grpcurl without -max-time, most non-Python clients) has no deadline.
    stub = teacher_pb2_grpc.TeacherServiceStub(channel)
    reply = stub.Score(request_of([[2, 5, 7]]), metadata=bearer_metadata(TOKEN))
    want = teacher.score([[2, 5, 7]])[0].log_probs
    np.testing.assert_array_equal(np.asarray(reply.sequences[0].log_probs, np.float32), want)


def test_a_batch_over_the_request_limits_is_split_by_the_client(teacher, server):
    sequences = random_sequences(np.random.default_rng(11), 40, teacher.info().vocab_size)
    assert len(sequences) > 16 or sum(map(len, sequences)) > 400  # one request is refused
    with RemoteTeacher(
        server.address,
        token=TOKEN,
        timeout_s=WAIT_S,
        max_request_sequences=16,
        max_request_tokens=400,
    ) as client:
        got = client.score(sequences, top_k=2)
    assert_same_scores(got, teacher.score(sequences, top_k=2), exact=False)


def test_info_matches_and_the_compatibility_check_runs_on_the_remote_info(teacher, remote):
    info = remote.info()
    assert isinstance(info, TeacherInfo) and info == teacher.info()
    check_compatible(info, teacher.tokenizer, teacher.info().vocab_size)


def test_concurrent_clients_each_get_their_own_results(teacher, server):
    vocab = teacher.info().vocab_size
    rng = np.random.default_rng(7)
    jobs = []  # (sequences, top_k, expected) per request, computed before any traffic
    for index in range(24):
        sequences = random_sequences(rng, int(rng.choice([1, 2, 4])), vocab)
        top_k = 3 if index % 3 == 0 else None
        jobs.append((sequences, top_k, teacher.score(sequences, top_k=top_k)))
    results, errors = {}, []
    start = threading.Barrier(6)

    def client(worker):
        try:
            with RemoteTeacher(server.address, token=TOKEN, timeout_s=WAIT_S) as teacher_:
                start.wait(WAIT_S)
                for index in range(worker, len(jobs), 6):
                    sequences, top_k, _ = jobs[index]
                    results[index] = teacher_.score(sequences, top_k=top_k)
        except Exception as error:  # surfaced below; a thread cannot fail the test itself
            errors.append(error)

    threads = [threading.Thread(target=client, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not errors and sorted(results) == list(range(len(jobs)))
    for index, (_, _, expected) in enumerate(jobs):
        # Batch composition changes XLA's reduction order: a few float32 ulps at most.
        assert_same_scores(results[index], expected, exact=False)


# ---- several replicas behind one client ----------------------------------------------------


def test_one_client_sends_calls_round_robin_to_two_replicas(teacher):
    # The second replica has the same weights in its own module (the two batcher threads
    # never share one); the jitted scorer is shared, so nothing new compiles.
    twin = InProcessTeacher(Transformer(teacher.model.config, rngs=nnx.Rngs(0)), teacher.tokenizer)
    assert twin.info() == teacher.info()
    config = TeacherServerConfig(token=TOKEN, max_delay_ms=0.0)
    sequence = [2, 5, 6, 9]
    want = teacher.score([sequence])[0].log_probs
    with (
        serve_teacher(teacher, config) as first,
        serve_teacher(twin, config) as second,
        RemoteTeacher(
            addresses=[first.address, second.address], token=TOKEN, timeout_s=WAIT_S
        ) as remote,
    ):
        assert remote.info() == teacher.info()
        calls, deadline = 0, time.monotonic() + WAIT_S

        def counts():
            return first.stats().requests, second.stats().requests

        # Until both connections are up, round-robin only has the ready one to pick.
        while min(counts()) == 0 and calls < 100 and time.monotonic() < deadline:
            np.testing.assert_array_equal(remote.score([sequence])[0].log_probs, want)
            calls += 1
        assert min(counts()) >= 1 and sum(counts()) == calls, (counts(), calls)
        before = counts()
        for _ in range(8):  # both ready: consecutive calls alternate
            np.testing.assert_array_equal(remote.score([sequence])[0].log_probs, want)
        after = counts()
    assert [b - a for a, b in zip(before, after, strict=True)] == [4, 4], (before, after)


# ---- validation keeps serving --------------------------------------------------------------

INVALID = [
    ([], 0, "^`sequences` must hold at least one sequence; received 0$"),
    ([[2]], 0, r"^`sequences\[0\]\.ids` must hold at least 2 ids; received 1$"),
    ([[2, 5], [2, -1]], 0, r"^`sequences\[1\]\.ids` must hold ids in \[0, 51\); received -1 at"),
    ([[2, 51, 3]], 0, r"^`sequences\[0\]\.ids` must hold ids in \[0, 51\); received 51 at pos"),
    ([[2] * (MAX_LENGTH + 1)], 0, r"^`sequences\[0\]\.ids` must hold at most 64 ids .*received 65"),
    ([[2, 5]], -1, r"^`top_k` must be in \[0, 51\] \(0: none\); received -1$"),
    ([[2, 5]], 52, r"^`top_k` must be in \[0, 51\] \(0: none\); received 52$"),
]


@pytest.mark.parametrize(("sequences", "top_k", "reason"), INVALID)
def test_invalid_requests_are_refused_with_the_field_and_the_server_keeps_serving(
    channel, remote, sequences, top_k, reason
):
    with pytest.raises(grpc.RpcError) as caught:
        score_raw(channel, request_of(sequences, top_k))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(reason, caught.value.details()), caught.value.details()
    assert len(remote.score([[2, 5, 6]])[0].log_probs) == 2


def test_remote_teacher_raises_the_servers_reason_as_a_value_error(remote):
    with pytest.raises(ValueError, match=r"^`sequences\[0\]\.ids` must hold ids in \[0, 51\)") as e:
        remote.score([[2, 99]])
    assert isinstance(e.value, InvalidTeacherRequest)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError, match="^`top_k` must be None or an int >= 1; received 0"):
        remote.score([[2, 5]], top_k=0)


@pytest.mark.parametrize(
    ("sequences", "reason"),
    [
        ([[2, 5]] * 17, "at most 16 sequences per request (server limit max_request_sequences)"),
        ([[2] * 50] * 9, "at most 400 ids in all (server limit max_request_tokens); received 450"),
    ],
)
def test_requests_over_the_limits_are_resource_exhausted(remote, sequences, reason):
    with pytest.raises(TeacherServerError) as caught:
        remote.score(sequences)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason in str(caught.value) and str(caught.value).startswith("`sequences` must")
    assert len(remote.score([[2, 5, 6]])[0].log_probs) == 2


# ---- auth, health, reflection ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "received"), [(None, "received none"), ("wrong", "received a different token")]
)
def test_calls_without_the_right_token_are_unauthenticated(channel, token, received):
    stub = teacher_pb2_grpc.TeacherServiceStub(channel)
    for call, request in (
        (stub.Info, teacher_pb2.InfoRequest()),
        (stub.Score, request_of([[2, 5]])),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            call(request, metadata=bearer_metadata(token), timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert caught.value.details().startswith("`authorization` metadata must be")
        assert received in caught.value.details()
    info = stub.Info(teacher_pb2.InfoRequest(), metadata=bearer_metadata(TOKEN), timeout=WAIT_S)
    assert info.vocab_size == 51


def test_health_reports_serving_without_a_token(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_teacher_service_and_its_schema(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
    ]
    listed, schema = list(stub.ServerReflectionInfo(iter(requests), timeout=WAIT_S))
    names = {service.name for service in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert schema.file_descriptor_response.file_descriptor_proto


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"max_batch_sequences": 0},
            "`max_batch_sequences` must be greater than or equal to 1; received 0",
        ),
        ({"max_batch_tokens": True}, "`max_batch_tokens` must be a valid integer; received True"),
        ({"max_delay_ms": -1.0}, "`max_delay_ms` must be greater than or equal to 0; received"),
        ({"max_delay_ms": 1e5}, "`max_delay_ms` must be less than or equal to 10000; received"),
        ({"max_request_tokens": 1}, "`max_request_tokens` must be >= 2 (one sequence of two"),
        ({"grace_s": float("nan")}, "`grace_s` must be greater than or equal to 0; received nan"),
        ({"token": ""}, "`token` must be non-empty or None; received ''"),
        ({"max_queue": 3}, "`max_queue` is not a known field; received 3"),
        ({"address": "localhost"}, "`address` must be host:port"),
        ({"address": "0.0.0.0:0"}, "`token` must be set when `address` is not loopback"),
        ({"tls_cert_file": "cert.pem"}, "`tls_key_file` must be given together"),
        ({"max_workers": 8, "max_concurrent_rpcs": 4}, "`max_concurrent_rpcs` must be >= max"),
    ],
)
def test_bad_server_configs_name_the_field(fields, message):
    with pytest.raises(ConfigError) as caught:
        TeacherServerConfig(**fields)
    assert str(caught.value).startswith(message)


def test_a_taken_port_is_refused_naming_the_address(teacher, server):
    with pytest.raises(ConfigError, match="^`address` must be free to bind"):
        serve_teacher(teacher, TeacherServerConfig(address=server.address))


def test_the_token_is_not_in_the_config_repr():
    assert TOKEN not in repr(TeacherServerConfig(token=TOKEN))


# ---- the CLI: a Hugging Face checkpoint served from a subprocess ----------------------------


def tiny_llama_checkpoint(directory):
    """A random 2-layer Llama with a 20-word WordLevel tokenizer (as tests/models/test_hf.py)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<unk>", "<s>", "</s>", "<pad>", *(f"w{i}" for i in range(28))]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save(str(directory / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(special))
    return directory


def test_serve_teacher_cli_scores_an_hf_checkpoint_and_stops_on_sigterm(tmp_path, capsys):
    checkpoint = tiny_llama_checkpoint(tmp_path / "llama")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)  # a token file others can read is refused
    env = os.environ | {"JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "float32"}
    env.pop("DISTILL_TOKEN", None)
    stderr = open(tmp_path / "server.err", "w")  # noqa: SIM115 - closed below
    command = [sys.executable, "-m", "services.cli", "serve", "teacher"]
    command += ["--hf-checkpoint", str(checkpoint), "--token-file", str(token_file)]
    command += ["--shapes", "none"]  # the warm-up of the default shapes: tests/services/test_cli.py
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    try:
        address = None
        while address is None:
            try:
                line = lines.get(timeout=WAIT_S)
            except queue.Empty:
                pytest.fail(f"no 'serving teacher on' line; stderr: {stderr.name}")
            if line.startswith("serving teacher on "):
                address = line.split()[-1]
        assert address.startswith("127.0.0.1:") and int(address.split(":")[1]) > 0

        text = "w3 w1 w5 w7"
        served = ["score", "--server", address, "--token-file", str(token_file)]
        assert cli.main([*served, "--hf-checkpoint", str(checkpoint), text, "--top-k", "2"]) == 0
        through_server = capsys.readouterr().out
        assert cli.main(["score", "--hf-checkpoint", str(checkpoint), text, "--top-k", "2"]) == 0
        assert through_server == capsys.readouterr().out
        assert through_server.count("top:") == 4

        assert cli.main([*served, "--ids", "1 7 5 9"]) == 0
        assert "over 3 tokens" in capsys.readouterr().out
        assert cli.main([*served, "--ids", "1 7 99"]) == 1
        assert "must hold ids in [0, 32); received 99" in capsys.readouterr().err
        wrong = tmp_path / "wrong"
        wrong.write_text("nope")
        wrong.chmod(0o600)
        assert (
            cli.main(["score", "--server", address, "--token-file", str(wrong), "--ids", "1 7"])
            == 1
        )
        assert "UNAUTHENTICATED" in capsys.readouterr().err

        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
        rest = []
        while not lines.empty():
            rest.append(lines.get())
        assert any(line.startswith("stopped: ") for line in rest), rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT_S)
        stderr.close()


def test_serve_teacher_cli_needs_one_teacher_source(capsys):
    assert cli.main(["serve", "teacher"]) == 2
    assert (
        "`--hf-checkpoint` or CONFIG with `--teacher-run` must be given" in capsys.readouterr().err
    )
    assert cli.main(["serve", "teacher", "deploy/configs/tiny.yaml"]) == 2
    assert "`--teacher-run` must be given with CONFIG" in capsys.readouterr().err


def test_a_trained_teacher_run_is_served_with_its_job_tokenizer(tmp_path):
    overrides = ["teacher.d_model=32", "teacher.d_ff=64", "student.d_model=32", "student.d_ff=64"]
    overrides += ["teacher_training.steps=2", "teacher_training.optimizer.warmup_steps=1"]
    overrides += ["teacher_training.eval_examples=2", "data.batch_size=2"]
    sets = [part for override in overrides for part in ("--set", override)]
    run = ["deploy/configs/tiny.yaml", *sets]
    assert cli.main(["train-teacher", *run, "--run-dir", str(tmp_path), "--quiet"]) == 0
    serve = ["serve", "teacher", *run, "--teacher-run", str(tmp_path), "--shapes", "none"]
    args = cli.build_parser().parse_args(serve)
    teacher = cli._served_teacher(args)
    with serve_teacher(teacher) as server, RemoteTeacher(server.address) as remote:
        assert remote.info() == teacher.info()
        sequence = [teacher.info().bos_id, *teacher.tokenizer.encode("12+3")]
        assert_same_scores(remote.score([sequence]), teacher.score([sequence]), exact=True)
