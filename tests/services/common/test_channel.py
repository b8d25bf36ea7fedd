"""The shared client side: one target for several replicas, channel options, and retrying
transient failures (UNAVAILABLE, gRPC's overload refusal, a server's cancel; never a
caller's own cancel) with capped exponential backoff and jitter inside a count and a time
budget (a fake stub method and a fake clock; one real server for a caller's cancel)."""

import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distill.config import ConfigError
from services.common.channel import (
    CallFailure,
    call_with_retry,
    channel_target,
    is_transient,
    open_channel,
)
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
    def __init__(self, code, details="`server` must be up; received", cancelled=False):
        self._code, self._details, self._cancelled = code, details, cancelled

    def code(self):
        return self._code

    def details(self):
        return self._details

    def cancelled(self):
        return self._cancelled


class FakeClock:
    """Monotonic time that moves only when slept through or when a call takes time."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class Failing:
    """A stub method failing with ``errors`` (codes or errors) in turn, then answering
    ``"ok"``."""

    def __init__(self, *errors):
        self.errors = [e if isinstance(e, grpc.RpcError) else FakeRpcError(e) for e in errors]
        self.calls = []

    def __call__(self, request, *, timeout, metadata):
        self.calls.append((request, timeout, metadata))
        if len(self.calls) <= len(self.errors):
            raise self.errors[len(self.calls) - 1]
        return "ok"


class Refused(Exception):
    pass


def call(method, policy, clock):
    return call_with_retry(
        method,
        "request",
        timeout_s=3.0,
        metadata=(("authorization", "Bearer t"),),
        policy=policy,
        describe=Refused,
        clock=clock,
        sleep=clock.sleep,
    )


@pytest.fixture
def clock():
    return FakeClock()


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def test_unavailable_is_retried_with_capped_exponential_backoff_and_jitter(clock):
    method = Failing(*[UNAVAILABLE] * 4)
    policy = RetryPolicy(backoff_s=0.1, max_backoff_s=0.3)
    assert call(method, policy, clock) == "ok"
    assert method.calls == [("request", 3.0, (("authorization", "Bearer t"),))] * 5
    assert len(clock.sleeps) == 4
    for waited, full in zip(clock.sleeps, [0.1, 0.2, 0.3, 0.3], strict=True):
        assert full * 0.5 <= waited <= full


def test_past_the_retry_count_the_callers_error_gets_the_failure(clock):
    method = Failing(*[UNAVAILABLE] * 5)
    with pytest.raises(Refused) as caught:
        call(method, RetryPolicy(retries=2, backoff_s=0.0), clock)
    (failure,) = caught.value.args
    assert isinstance(failure, CallFailure) and failure.transient
    assert (failure.code, failure.attempts, len(method.calls)) == (UNAVAILABLE, 3, 3)
    assert failure.details.startswith("`server` must be up")


def test_retrying_stops_when_the_time_budget_is_spent_with_a_last_attempt_at_its_end(clock):
    # An outage longer than the budget: attempts fail at once (nothing listens), waits
    # grow to the cap, the last wait is cut so the final attempt comes at the budget's end.
    method = Failing(*[UNAVAILABLE] * 1000)
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=4.0, budget_s=10.0)
    with pytest.raises(Refused) as caught:
        call(method, policy, clock)
    (failure,) = caught.value.args
    assert failure.transient and failure.elapsed_s == pytest.approx(10.0)
    assert sum(clock.sleeps) == pytest.approx(10.0) and failure.attempts == len(method.calls)
    assert 4 <= failure.attempts <= 10  # waits of 0.25-0.5, 0.5-1, 1-2, 2-4, then <= 4 each


def test_an_outage_shorter_than_the_budget_is_ridden_out(clock):
    # A server away for 20 s of fake time (a restart) with the default policy: no error.
    outage_ends = 20.0

    def restarting(request, *, timeout, metadata):
        if clock.now < outage_ends:
            raise FakeRpcError(UNAVAILABLE, "failed to connect to all addresses")
        return "ok"

    assert call(restarting, RetryPolicy(), clock) == "ok"
    assert outage_ends <= clock.now <= outage_ends + RetryPolicy().max_backoff_s


def test_the_budget_counts_from_the_first_failure_not_the_first_attempt(clock):
    # A call that ran 100 s before the server went away still gets the whole budget.
    calls = []

    def long_then_restarting(request, *, timeout, metadata):
        calls.append(clock.now)
        clock.now += 100.0 if len(calls) == 1 else 0.0
        if clock.now < 120.0:
            raise FakeRpcError(UNAVAILABLE, "Cancelling all calls")
        return "ok"

    assert call(long_then_restarting, RetryPolicy(budget_s=30.0), clock) == "ok"
    assert len(calls) > 2 and 120.0 <= clock.now <= 130.0


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (FakeRpcError(UNAVAILABLE, "Cancelling all calls"), True),
        (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!"), True),
        (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "`sequences` must hold <= 8"), False),
        (FakeRpcError(grpc.StatusCode.CANCELLED, "`call` was cancelled by the server"), True),
        (FakeRpcError(grpc.StatusCode.CANCELLED, "Channel closed!"), False),
        (FakeRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"), False),
        (FakeRpcError(grpc.StatusCode.CANCELLED, "Cancelled", cancelled=True), False),
        (FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "`ids` must ..."), False),
        (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), False),
        (FakeRpcError(grpc.StatusCode.INTERNAL, "teacher failed"), False),
    ],
)
def test_which_failures_are_transient(error, transient, clock):
    assert is_transient(error) is transient
    method = Failing(error)
    if transient:
        assert call(method, RetryPolicy(), clock) == "ok" and len(method.calls) == 2
    else:
        with pytest.raises(Refused) as caught:
            call(method, RetryPolicy(), clock)
        (failure,) = caught.value.args
        assert (failure.code, failure.attempts, failure.transient) == (error.code(), 1, False)
        assert len(method.calls) == 1 and clock.sleeps == []


def test_a_call_the_caller_cancels_by_closing_its_channel_is_not_retried():
    entered = threading.Event()

    def slow(request, context):
        entered.set()
        time.sleep(2.0)
        return request

    # A bare gRPC server (bytes in, bytes out): only the client side is under test.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Slow", {"Echo": grpc.unary_unary_rpc_method_handler(slow)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        opened = open_channel(f"127.0.0.1:{port}", max_message_bytes=1 << 20)
        failures = []

        def echo():
            try:
                call_with_retry(
                    opened.unary_unary("/test.Slow/Echo"),
                    b"ping",
                    timeout_s=30,
                    metadata=(),
                    policy=RetryPolicy(),
                    describe=Refused,
                )
            except Refused as refused:
                failures.append(refused.args[0])

        caller = threading.Thread(target=echo)
        caller.start()
        assert entered.wait(30), "the call never reached the server"
        opened.close()
        caller.join(30)
        assert not caller.is_alive(), "the cancelled call did not return"
    finally:
        server.stop(0)
    (failure,) = failures
    assert (failure.code, failure.details, failure.attempts, failure.transient) == (
        grpc.StatusCode.CANCELLED,
        "Channel closed!",
        1,
        False,
    )


def test_grpc_overload_is_retried_until_a_call_slot_frees():
    # One call slot: while it is taken, gRPC itself refuses other calls RESOURCE_EXHAUSTED
    # "Concurrent RPC limit exceeded" (the thread-pool server's maximum_concurrent_rpcs);
    # that passes, so call_with_retry retries it until the slot frees.
    gate, entered = threading.Event(), threading.Event()

    def held(request, context):
        entered.set()
        assert gate.wait(30)
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), maximum_concurrent_rpcs=1)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Held", {"Echo": grpc.unary_unary_rpc_method_handler(held)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    results, failures = {}, []

    def echo(name, policy):
        with open_channel(f"127.0.0.1:{port}", max_message_bytes=1 << 20) as opened:
            try:
                results[name] = call_with_retry(
                    opened.unary_unary("/test.Held/Echo"),
                    name.encode(),
                    timeout_s=30,
                    metadata=(),
                    policy=policy,
                    describe=Refused,
                )
            except Refused as refused:
                failures.append(refused.args[0])

    try:
        holder = threading.Thread(target=echo, args=("held", RetryPolicy()))
        holder.start()
        assert entered.wait(30), "the first call never reached the server"
        echo("probe", RetryPolicy(retries=0))
        (probe,) = failures
        assert probe.code == grpc.StatusCode.RESOURCE_EXHAUSTED and probe.transient
        assert probe.details.startswith("Concurrent RPC limit exceeded")
        waiting = threading.Thread(target=echo, args=("retried", RetryPolicy(backoff_s=0.05)))
        waiting.start()
        time.sleep(0.5)  # refused and retried a few times meanwhile
        gate.set()
        holder.join(30), waiting.join(30)
        assert not holder.is_alive() and not waiting.is_alive()
    finally:
        gate.set()
        server.stop(0)
    assert results == {"held": b"held", "retried": b"retried"} and len(failures) == 1
