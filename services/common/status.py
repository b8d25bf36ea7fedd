"""Which gRPC status a servicer answers for which error: one table, used by every service.

A handler raises (or catches) a domain exception and calls :func:`abort_with`; the status
comes from :func:`status_of`, the first matching row wins:

=================================  ======================  =================================
error                              status                  the caller should
=================================  ======================  =================================
:class:`StatusError`               its ``code``            (chosen by the raiser)
:class:`Unavailable` (a full       ``UNAVAILABLE``         retry with backoff
queue, a stopping worker)
``ValueError`` (``ConfigError``,   ``INVALID_ARGUMENT``    fix the request; it would fail
``TraceError``, ``TokenError``,                            the same way again
``CompatibilityError``, ...)
``TimeoutError``                   ``DEADLINE_EXCEEDED``   retry with a longer deadline
``NotImplementedError``            ``UNIMPLEMENTED``       not retry
anything else                      ``INTERNAL``            report it (a server bug)
=================================  ======================  =================================

The reason sent is the error's message, which in this project reads "`field` must ...;
received ..."; for ``INTERNAL`` it is prefixed with what failed and the exception type.
"""

from __future__ import annotations

from typing import NoReturn

import grpc


class StatusError(Exception):
    """A refusal with a status chosen where it is raised (e.g. ``RESOURCE_EXHAUSTED`` for a
    request over a server limit): ``code`` and ``reason``."""

    def __init__(self, code: grpc.StatusCode, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason

    def __reduce__(self):
        # Pickled across processes with its code, not only its message.
        return type(self), (self.code, self.reason)


class Unavailable(RuntimeError):
    """The service cannot take the call now (its queue is full, it is stopping); the same
    call may succeed later, so clients retry ``UNAVAILABLE`` with backoff."""


#: The table of :func:`status_of` after :class:`StatusError`: first matching type wins.
STATUS_OF_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
)


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status a servicer answers for ``error`` (see the module table)."""
    if isinstance(error, StatusError):
        return error.code
    for kind, code in STATUS_OF_ERROR:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def reason_of(error: BaseException, *, failed: str = "handler") -> str:
    """The details sent with :func:`status_of` ``(error)``: the error's message, or for
    ``INTERNAL`` "``failed`` failed: Type: message"."""
    if isinstance(error, StatusError):
        return error.reason
    if status_of(error) == grpc.StatusCode.INTERNAL:
        return f"{failed} failed: {type(error).__name__}: {error}"
    return str(error)


def abort_with(
    context: grpc.ServicerContext, error: BaseException, *, failed: str = "handler"
) -> NoReturn:
    """End the call with ``error``'s status and reason (``failed`` names what failed in an
    ``INTERNAL`` reason, e.g. "teacher"). Raises, as ``context.abort`` does."""
    context.abort(status_of(error), reason_of(error, failed=failed))
    raise AssertionError("context.abort returned")  # grpc always raises; keeps NoReturn true
