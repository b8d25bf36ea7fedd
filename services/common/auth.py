"""Bearer-token authentication for every gRPC server, and where tokens come from.

A caller sends ``authorization: Bearer <token>`` metadata; :class:`BearerTokenInterceptor`
compares it with the server's token in constant time (:func:`hmac.compare_digest`) and
answers ``UNAUTHENTICATED`` when it is missing or wrong, before the handler runs. The health
and reflection services stay open so load balancers and ``grpcurl`` work without secrets
(they reveal nothing but liveness and the service schema).

Tokens are never taken from the command line (it shows in ``ps`` and shell history): they
come from a file (``--token-file``) or the ``DISTILL_TOKEN`` environment variable. A token
file that its group or other users may read or write is refused, as ssh refuses such a key:
anyone else on the host could take the token (``chmod 600`` it).
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

#: Environment variable holding the token when no token file is given.
TOKEN_ENV = "DISTILL_TOKEN"
#: Method prefixes that need no token: standard health checks and server reflection.
OPEN_METHOD_PREFIXES: tuple[str, ...] = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


class TokenError(ValueError):
    """A token file or variable is unusable. Messages read "`field` must ...; received ..."."""


def read_token(
    token_file: str | os.PathLike[str] | None = None, *, env: str = TOKEN_ENV
) -> str | None:
    """The token in ``token_file`` (surrounding whitespace stripped), else the one in the
    environment variable ``env``, else ``None``. An empty or unreadable file is an error: a
    server must not silently start without the auth its operator asked for. So is a file
    whose group or others have any permission (on POSIX; checked on the opened file, so a
    swap between check and read changes nothing): the token would not be secret."""
    if token_file is not None:
        try:
            with Path(token_file).open("rb") as opened:
                _check_private(os.fstat(opened.fileno()).st_mode, os.fspath(token_file))
                token = opened.read().decode("utf-8").strip()
        except OSError as error:
            raise TokenError(
                f"`--token-file` must be a readable file; received {os.fspath(token_file)!r} "
                f"({error.strerror})"
            ) from error
        except UnicodeDecodeError as error:
            raise TokenError(
                f"`--token-file` must hold a token of printable ASCII without spaces; "
                f"received {os.fspath(token_file)!r}, which is not text"
            ) from error
        if not token:
            raise TokenError(
                f"`--token-file` must hold a non-empty token; received an empty file "
                f"{os.fspath(token_file)!r}"
            )
        _check_token(token, "--token-file")
        return token
    token = os.environ.get(env, "").strip()
    if not token:
        return None
    _check_token(token, env)
    return token


def _check_private(mode: int, path: str) -> None:
    """Refuse a token file its group or others can access (POSIX modes only)."""
    if os.name != "posix" or not mode & 0o077:
        return
    who = " and ".join(name for name, bits in (("group", 0o070), ("others", 0o007)) if mode & bits)
    raise TokenError(
        f"`--token-file` must be accessible by its owner only, like an ssh key (run "
        f"`chmod 600 {path}`, or mount a secret with mode 0400); received {path!r} with mode "
        f"{stat.S_IMODE(mode):04o}, open to {who}"
    )


def _check_token(token: str, field: str) -> None:
    # gRPC metadata values must be printable ASCII; a stray byte would fail every call later.
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise TokenError(
            f"`{field}` must hold a token of printable ASCII without spaces; received "
            f"{len(token)} characters that are not"
        )


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (empty without one)."""
    return () if token is None else (("authorization", f"Bearer {token}"),)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only with ``authorization: Bearer <token>``; health and
    reflection (:data:`OPEN_METHOD_PREFIXES`) are always let through."""

    def __init__(self, token: str, *, open_prefixes: Iterable[str] = OPEN_METHOD_PREFIXES):
        if not token:
            raise TokenError("`token` must be non-empty; received an empty token")
        self._expected = f"Bearer {token}".encode()
        self._open_prefixes = tuple(open_prefixes)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open_prefixes):
            return handler
        reason = check_bearer(handler_call_details.invocation_metadata, self._expected)
        return handler if reason is None else _deny(handler, reason)


def check_bearer(metadata, expected: bytes) -> str | None:
    """None when ``metadata`` (gRPC invocation metadata) carries ``authorization: <expected>``
    (``expected`` = ``b"Bearer <token>"``; the scheme is matched case-insensitively, the
    token in constant time), else the reason to answer ``UNAUTHENTICATED`` with."""
    received = None
    for key, value in metadata or ():
        if key == "authorization":
            received = value.encode() if isinstance(value, str) else value
            break
    if received is not None:
        scheme, _, token = received.partition(b" ")
        want_scheme, _, want_token = expected.partition(b" ")
        if scheme.lower() == want_scheme.lower() and hmac.compare_digest(token, want_token):
            return None
    return "`authorization` metadata must be 'Bearer <token>' with the server's token; " + (
        "received none" if received is None else "received a different token"
    )


def _deny(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that aborts UNAUTHENTICATED."""

    def abort(_request, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        abort,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
