"""The shared client side: one target for several replicas, channel options, and retrying
UNAVAILABLE with capped exponential backoff and jitter (a fake stub method, no server)."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distill.config import ConfigError
from services.common import channel as channel_module
from services.common.channel import call_with_retry, channel_target, open_channel
from services.common.config import RetryPolicy, ServerConfig
from services.common.server import start_server


@pytest.mark.parametrize(
    ("addresses", "target"),
    [
        (["127.0.0.1:5"], "127.0.0.1:5"),
        (["teacher.svc:50051"], "teacher.svc:50051"),
        (["127.0.0.1:5", "10.0.0.2:6"], "ipv4:127.0.0.1:5,10.0.0.2:6"),
        (["[::1]:5", "[fe80::1]:6"], "ipv6:[::1]:5,[fe80::1]:6"),
    ],
)
def test_replica_addresses_become_one_target(addresses, target):
    assert channel_target(addresses) == target


@pytest.mark.parametrize(
    ("addresses", "message"),
    [
        ([], "`addresses` must be a non-empty sequence of host:port"),
        ("127.0.0.1:5", "`addresses` must be a non-empty sequence of host:port"),
        (["a.svc:5", "b.svc:5"], "`addresses` must be host:port with IP literals"),
        (["127.0.0.1", "127.0.0.1:6"], "`addresses` must be host:port with IP literals"),
        (["127.0.0.1:5", "[::1]:6"], "`addresses` must be all IPv4 or all IPv6"),
    ],
)
def test_targets_gRPC_cannot_balance_are_refused(addresses, message):
    with pytest.raises(ConfigError) as caught:
        channel_target(addresses)
    assert str(caught.value).startswith(message)


def test_channel_refuses_a_name_override_without_roots_and_unreadable_roots(tmp_path):
    with pytest.raises(ValueError, match="^`tls_root_cert_file` must be given"):
        open_channel("127.0.0.1:1", max_message_bytes=1024, tls_server_name="localhost")
    with pytest.raises(ConfigError, match="^`tls_root_cert_file` must be a readable PEM file"):
        open_channel("127.0.0.1:1", max_message_bytes=1024, tls_root_cert_file=tmp_path / "no")


def test_a_round_robin_channel_reaches_two_servers():
    with (
        start_server(ServerConfig(), lambda server: None, []) as first,
        start_server(ServerConfig(), lambda server: None, []) as second,
    ):
        target = channel_target([first.address, second.address])
        with open_channel(target, max_message_bytes=1 << 20, lb_policy="round_robin") as opened:
            stub = health_pb2_grpc.HealthStub(opened)
            for _ in range(4):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class Failing:
    """A stub method failing with ``codes`` in turn, then answering ``"ok"``."""

    def __init__(self, *codes):
        self.codes, self.calls = list(codes), []

    def __call__(self, request, *, timeout, metadata):
        self.calls.append((request, timeout, metadata))
        if len(self.calls) <= len(self.codes):
            raise FakeRpcError(self.codes[len(self.calls) - 1], "`server` must be up; received")
        return "ok"


class Refused(Exception):
    pass


def describe(code, details, attempts):
    return Refused(code, details, attempts)


@pytest.fixture
def sleeps(monkeypatch):
    waited = []
    monkeypatch.setattr(channel_module.time, "sleep", waited.append)
    return waited


def call(method, policy):
    return call_with_retry(
        method,
        "request",
        timeout_s=3.0,
        metadata=(("authorization", "Bearer t"),),
        policy=policy,
        describe=describe,
    )


def test_unavailable_is_retried_with_capped_exponential_backoff_and_jitter(sleeps):
    method = Failing(*[grpc.StatusCode.UNAVAILABLE] * 4)
    policy = RetryPolicy(retries=4, backoff_s=0.1, max_backoff_s=0.3)
    assert call(method, policy) == "ok"
    assert method.calls == [("request", 3.0, (("authorization", "Bearer t"),))] * 5
    assert len(sleeps) == 4
    for waited, full in zip(sleeps, [0.1, 0.2, 0.3, 0.3], strict=True):
        assert full * 0.5 <= waited <= full


def test_unavailable_past_the_retries_raises_the_callers_error(sleeps):
    method = Failing(*[grpc.StatusCode.UNAVAILABLE] * 5)
    with pytest.raises(Refused) as caught:
        call(method, RetryPolicy(retries=2, backoff_s=0.0))
    code, details, attempts = caught.value.args
    assert (code, attempts, len(method.calls)) == (grpc.StatusCode.UNAVAILABLE, 3, 3)
    assert details.startswith("`server` must be up")


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED]
)
def test_other_statuses_fail_at_once(sleeps, code):
    method = Failing(code)
    with pytest.raises(Refused) as caught:
        call(method, RetryPolicy(retries=3))
    assert caught.value.args[0] == code and caught.value.args[2] == 1
    assert len(method.calls) == 1 and sleeps == []
