"""One table from errors to gRPC statuses, and the abort every servicer uses."""

import grpc
import pytest

from distill.config import ConfigError
from services.common.auth import TokenError
from services.common.status import StatusError, Unavailable, abort_with, reason_of, status_of


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Unavailable("`queue` must have room"), grpc.StatusCode.UNAVAILABLE),
        (ValueError("`ids` must be ints"), grpc.StatusCode.INVALID_ARGUMENT),
        (ConfigError("`field` must be set"), grpc.StatusCode.INVALID_ARGUMENT),
        (TokenError("`token` must be ASCII"), grpc.StatusCode.INVALID_ARGUMENT),
        (TimeoutError("slow"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (NotImplementedError("later"), grpc.StatusCode.UNIMPLEMENTED),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
        (KeyError("k"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_error_has_one_status(error, code):
    assert status_of(error) == code


def test_replay_trace_errors_are_invalid_arguments():
    from distill.diffusion.replay import TraceError

    assert status_of(TraceError("`trace` must match")) == grpc.StatusCode.INVALID_ARGUMENT


class Aborted(Exception):
    pass


class Context:
    """Records ``abort`` and raises, as grpc's servicer context does."""

    def abort(self, code, details):
        self.aborted = (code, details)
        raise Aborted


@pytest.mark.parametrize(
    ("error", "aborted"),
    [
        (ValueError("`top_k` must be >= 0; received -1"), "`top_k` must be >= 0; received -1"),
        (StatusError(grpc.StatusCode.CANCELLED, "`call` was cancelled"), "`call` was cancelled"),
        (RuntimeError("out of memory"), "teacher failed: RuntimeError: out of memory"),
    ],
)
def test_abort_with_sends_the_status_and_the_reason(error, aborted):
    context = Context()
    with pytest.raises(Aborted):
        abort_with(context, error, failed="teacher")
    assert context.aborted == (status_of(error), aborted)
    assert reason_of(error, failed="teacher") == aborted
