"""What every gRPC server of the project shares: address, auth, TLS, limits, health,
reflection, graceful stop.

Two bootstraps over the same settings, TLS, health and reflection: :func:`start_aio_server`
(``grpc.aio``: no thread per waiting call, per-method concurrency limits, the token checked
before a body is read, unparsable bodies answered ``INVALID_ARGUMENT`` and counted; the
teacher uses it) and :func:`start_server` (a thread pool for servicers written as blocking
code; the learner uses it; a body or streamed message that does not parse is answered
``INVALID_ARGUMENT`` there too, not gRPC's ``INTERNAL``).

:func:`start_server` builds a ``grpc.server`` from a
:class:`~services.common.config.ServerConfig`, lets the caller register its servicers, adds
the standard health service (``grpc.health.v1``, every named service reported ``SERVING``
once started) and server reflection, binds, starts, and returns a :class:`RunningServer`
handle with the bound ``port`` and a ``stop()`` that first reports ``NOT_SERVING``, then
lets in-flight calls finish within the grace period.

The settings and their rules (loopback or a token, TLS files in pairs, limits) are in
:mod:`services.common.config`; ``split_address`` and ``is_loopback`` come from there too
and are importable from here.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth import OPEN_METHOD_PREFIXES, BearerTokenInterceptor, check_bearer
from services.common.config import ServerConfig, config_error, is_loopback, split_address


@dataclasses.dataclass
class RunningServer:
    """A started server. ``address`` is the bound ``host:port`` (the real port when 0 was
    asked for). ``stop()`` is idempotent and returns once the server has stopped and
    ``on_stop`` (e.g. a batching worker) has run."""

    server: grpc.Server
    health: health.HealthServicer
    host: str
    port: int
    grace_s: float
    on_stop: Callable[[], None] | None = None
    _stopped: threading.Event = dataclasses.field(default_factory=threading.Event)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace_s: float | None = None) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            # Health first, so balancers stop sending before in-flight calls drain.
            self.health.enter_graceful_shutdown()
            self.server.stop(self.grace_s if grace_s is None else grace_s).wait()
            if self.on_stop is not None:
                self.on_stop()
            self._stopped.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until stopped (by :meth:`stop` from another thread); False on timeout."""
        return self._stopped.wait(timeout_s)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_pem(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise config_error(field, f"be a readable PEM file ({error.strerror})", path) from error


def _check_key_pair(cert_file: str, key_file: str) -> None:
    """Refuse an unparsable certificate or a key that does not match it here, by field: gRPC
    itself only reports a failed bind."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except ssl.SSLError as error:
        raise config_error(
            "tls_cert_file",
            f"hold a PEM certificate chain matching tls_key_file ({error.reason or error})",
            cert_file,
        ) from error


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the config's PEM files (checked by field), or None (plaintext)."""
    if config.tls_cert_file is None:
        return None
    key = _read_pem(config.tls_key_file, "tls_key_file")
    cert = _read_pem(config.tls_cert_file, "tls_cert_file")
    _check_key_pair(config.tls_cert_file, config.tls_key_file)
    return grpc.ssl_server_credentials([(key, cert)])


def _add_health_and_reflection(server, health_servicer, service_names: Sequence[str]) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection(
        (*service_names, health_name, reflection.SERVICE_NAME), server
    )


def start_server(
    config: ServerConfig,
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    *,
    on_stop: Callable[[], None] | None = None,
) -> RunningServer:
    """Build, bind and start a thread-pool server; ``register(server)`` adds the caller's
    servicers and ``service_names`` (full names, e.g. ``distill.v1.LearnerService``) are
    reported by health and reflection. Raises :class:`ConfigError` naming `address` when it
    cannot be bound. (Servers whose calls wait long or may be held open by strangers use
    :func:`start_aio_server`.)"""
    credentials = _server_credentials(config)
    interceptors: list[grpc.ServerInterceptor] = (
        [] if config.token is None else [BearerTokenInterceptor(config.token)]
    )
    interceptors.append(_ParseGuard())  # after the token: strangers' bodies meet auth first
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        # No SO_REUSEPORT: a second server on a taken port must fail, not share its traffic.
        options=[*config.channel_options, ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    register(server)
    health_servicer = health.HealthServicer()
    _add_health_and_reflection(server, health_servicer, service_names)
    try:
        if credentials is None:
            port = server.add_insecure_port(config.address)
        else:
            port = server.add_secure_port(config.address, credentials)
    except RuntimeError as error:  # grpc raises RuntimeError when the bind fails
        raise config_error("address", f"be free to bind ({error})", config.address) from error
    server.start()
    for name in ("", *service_names):  # "" is the whole server, by gRPC convention
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    host, _ = split_address(config.address)
    return RunningServer(server, health_servicer, host, port, config.grace_s, on_stop)


class _ParseGuard(grpc.ServerInterceptor):
    """Answers ``INVALID_ARGUMENT`` for a request body (or a streamed message) that does not
    parse, where a thread-pool server would answer ``INTERNAL`` ("Exception deserializing
    request!"): a malformed message is the caller's fault, and the server keeps serving."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserialize, kind = handler.request_deserializer, _handler_kind(handler)
        behavior = getattr(handler, kind)
        name = handler_call_details.method.rsplit("/", 1)[-1]

        def parse(data: bytes):
            try:
                return deserialize(data)
            except Exception as error:  # a body that is not the message
                return _Malformed(error)

        def refuse(request, context) -> None:
            if isinstance(request, _Malformed):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"`request` must be a valid {name} request message; received a body that "
                    f"does not parse ({type(request.error).__name__})",
                )

        if handler.request_streaming:

            def checked(requests, context):
                for request in requests:
                    refuse(request, context)
                    yield request

            def run(requests, context):
                return behavior(checked(requests, context), context)

        else:

            def run(request, context):
                refuse(request, context)
                return behavior(request, context)

        return _HANDLER_FACTORIES[kind](
            run, request_deserializer=parse, response_serializer=handler.response_serializer
        )


# ---- asynchronous servers ------------------------------------------------------------------
#
# A server on grpc.aio holds no thread per waiting call: its handlers are coroutines on one
# event loop (run here in a daemon thread, so callers keep a plain blocking API). What bounds
# the work in flight is each method's concurrency limit and the servicer's own queue, not a
# thread pool; a stranger holding streams open costs a little memory, never a thread.

#: Concurrency limits per method that apply unless the caller passes its own: the open
#: (token-free) streaming methods get small ones, so nobody can hold unbounded streams.
DEFAULT_METHOD_LIMITS: dict[str, int] = {
    "/grpc.health.v1.Health/Watch": 256,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": 64,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": 64,
}
#: Limit of every other method.
DEFAULT_METHOD_LIMIT = 512


class _Malformed:
    """Stands for a request body that did not parse (the handler answers INVALID_ARGUMENT)."""

    def __init__(self, error: Exception):
        self.error = error


class CallGuard(grpc.aio.ServerInterceptor):
    """Everything a call meets before its handler, in order: the bearer token (refused
    ``UNAUTHENTICATED`` by a handler that never reads the body, so a stranger's bytes are not
    parsed), the method's concurrency limit (``UNAVAILABLE`` with the method named: transient,
    retry), then the handler with a request parser that turns an unparsable body into
    ``INVALID_ARGUMENT`` (counted, not logged). Every finished call is reported to
    ``observe(method, code, seconds)`` when given."""

    def __init__(
        self,
        *,
        token: str | None,
        method_limits: Mapping[str, int],
        default_limit: int,
        observe: Callable[[str, grpc.StatusCode, float], None] | None = None,
        on_malformed: Callable[[str], None] | None = None,
    ):
        self._expected = None if token is None else f"Bearer {token}".encode()
        self._limits = dict(method_limits)
        self._default_limit = default_limit
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._observe = observe
        self._on_malformed = on_malformed

    def in_flight(self, method: str) -> int:
        return self._in_flight[method]

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if self._expected is not None and not method.startswith(OPEN_METHOD_PREFIXES):
            reason = check_bearer(handler_call_details.invocation_metadata, self._expected)
            if reason is not None:
                return self._refused(handler, method, grpc.StatusCode.UNAUTHENTICATED, reason)
        limit = self._limits.get(method, self._default_limit)
        if self._in_flight[method] >= limit:
            return self._refused(
                handler,
                method,
                grpc.StatusCode.UNAVAILABLE,
                f"`{method}` must have fewer than {limit} calls in flight (the method's "
                f"concurrency limit); received one more: retry later",
            )
        return self._guarded(handler, method)

    def _finish(self, method: str, started: float, code: grpc.StatusCode) -> None:
        if self._observe is not None:
            self._observe(method, code, time.monotonic() - started)

    def _refused(self, handler, method: str, code: grpc.StatusCode, reason: str):
        """A handler that answers ``code`` without reading the request: request-streaming in
        shape (the wire is the same for a unary caller), so gRPC never parses the body."""
        guard = self

        async def refuse(_request_iterator, context):
            guard._finish(method, time.monotonic(), code)
            await context.abort(code, reason)

        if handler.response_streaming:

            async def refuse_stream(request_iterator, context):
                await refuse(request_iterator, context)
                yield  # pragma: no cover - abort raised

            return grpc.stream_stream_rpc_method_handler(
                refuse_stream, response_serializer=handler.response_serializer
            )
        return grpc.stream_unary_rpc_method_handler(
            refuse, response_serializer=handler.response_serializer
        )

    def _guarded(self, handler, method: str):
        guard, kind = self, _handler_kind(handler)
        behavior = getattr(handler, kind)
        deserialize = handler.request_deserializer
        if not handler.request_streaming and deserialize is not None:

            def deserialize_or_mark(data: bytes):
                try:
                    return deserialize(data)
                except Exception as error:  # a body that is not the message
                    return _Malformed(error)

        else:
            deserialize_or_mark = deserialize

        async def check_body(request, context) -> None:
            if isinstance(request, _Malformed):
                if guard._on_malformed is not None:
                    guard._on_malformed(method)
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"`request` must be a valid {method.rsplit('/', 1)[-1]} request message; "
                    f"received a body that does not parse ({type(request.error).__name__})",
                )

        def end(context, started: float) -> None:
            guard._in_flight[method] -= 1
            code = context.code()
            guard._finish(method, started, grpc.StatusCode.OK if code is None else code)

        if handler.response_streaming:

            async def run_stream(request, context):
                guard._in_flight[method] += 1
                started = time.monotonic()
                try:
                    await check_body(request, context)
                    result = behavior(request, context)
                    if inspect.isasyncgen(result):
                        async for item in result:
                            yield item
                    else:  # a coroutine writing with context.write (aio health Watch)
                        await result
                finally:
                    end(context, started)

            wrapped = run_stream
        else:

            async def run_unary(request, context):
                guard._in_flight[method] += 1
                started = time.monotonic()
                try:
                    await check_body(request, context)
                    result = behavior(request, context)
                    return await result if inspect.isawaitable(result) else result
                finally:
                    end(context, started)

            wrapped = run_unary
        make = _HANDLER_FACTORIES[kind]
        return make(
            wrapped,
            request_deserializer=deserialize_or_mark,
            response_serializer=handler.response_serializer,
        )


_HANDLER_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _handler_kind(handler: grpc.RpcMethodHandler) -> str:
    return (
        f"{'stream' if handler.request_streaming else 'unary'}_"
        f"{'stream' if handler.response_streaming else 'unary'}"
    )


@dataclasses.dataclass
class AsyncRunningServer:
    """A started ``grpc.aio`` server on its own event-loop thread, with the blocking handle
    :class:`RunningServer` has: ``address``, ``port``, ``stop()`` (health ``NOT_SERVING``
    first, then in-flight calls finish within the grace period; idempotent), ``wait()``,
    ``set_serving()``, and ``run(coroutine)`` to run something on the server's loop."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    host: str
    port: int
    grace_s: float
    service_names: tuple[str, ...]
    guard: CallGuard
    on_stop: Callable[[], None] | None = None
    _stopped: threading.Event = dataclasses.field(default_factory=threading.Event)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def run(self, coroutine, timeout_s: float = 60.0):
        """Run ``coroutine`` on the server's loop and return its result (``TimeoutError``
        naming what it waited for after ``timeout_s``)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(
                f"`server loop` must finish {getattr(coroutine, '__name__', 'a task')} within "
                f"{timeout_s} s; it did not"
            ) from None

    def set_serving(self, serving: bool) -> None:
        """Report every service (and the whole server, "") ``SERVING`` or ``NOT_SERVING``."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )

        async def set_all():
            for name in ("", *self.service_names):
                await self.health.set(name, status)

        self.run(set_all())

    def stop(self, grace_s: float | None = None) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            grace = self.grace_s if grace_s is None else grace_s
            try:
                # Health first, so balancers stop sending before in-flight calls drain.
                self.run(self.health.enter_graceful_shutdown())
                self.run(self.server.stop(grace), timeout_s=grace + 30.0)
            finally:
                if self.on_stop is not None:
                    self.on_stop()
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(30.0)
                self._stopped.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until stopped (by :meth:`stop` from another thread); False on timeout."""
        return self._stopped.wait(timeout_s)

    def __enter__(self) -> AsyncRunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_aio_server(
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    max_receive_bytes: int | None = None,
    method_limits: Mapping[str, int] | None = None,
    default_method_limit: int = DEFAULT_METHOD_LIMIT,
    observe: Callable[[str, grpc.StatusCode, float], None] | None = None,
    on_malformed: Callable[[str], None] | None = None,
    on_stop: Callable[[], None] | None = None,
    serving: bool = True,
) -> AsyncRunningServer:
    """Build, bind and start a ``grpc.aio`` server on a new event-loop thread; ``register``
    adds the caller's (async) servicers. Calls pass a :class:`CallGuard` (token, per-method
    limits: :data:`DEFAULT_METHOD_LIMITS` updated by ``method_limits``, unparsable bodies).
    ``max_receive_bytes`` caps a request (default ``config.max_message_bytes``; servers
    should derive it from their largest valid request). ``serving=False`` starts with health
    ``NOT_SERVING`` (e.g. until a warm-up ends; call ``set_serving(True)``). Raises
    :class:`ConfigError` naming `address` when it cannot be bound."""
    credentials = _server_credentials(config)
    guard = CallGuard(
        token=config.token,
        method_limits={**DEFAULT_METHOD_LIMITS, **(method_limits or {})},
        default_limit=default_method_limit,
        observe=observe,
        on_malformed=on_malformed,
    )
    receive = config.max_message_bytes if max_receive_bytes is None else max_receive_bytes
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-aio", daemon=True)
    thread.start()
    health_servicer: health.aio.HealthServicer | None = None

    async def build() -> tuple[grpc.aio.Server, int]:
        nonlocal health_servicer
        server = grpc.aio.server(
            interceptors=[guard],
            options=[
                ("grpc.max_receive_message_length", receive),
                ("grpc.max_send_message_length", config.max_message_bytes),
                # No SO_REUSEPORT: a second server on a taken port must fail.
                ("grpc.so_reuseport", 0),
            ],
        )
        register(server)
        health_servicer = health.aio.HealthServicer()
        _add_health_and_reflection(server, health_servicer, service_names)
        try:
            if credentials is None:
                port = server.add_insecure_port(config.address)
            else:
                port = server.add_secure_port(config.address, credentials)
        except RuntimeError as error:
            raise config_error("address", f"be free to bind ({error})", config.address) from error
        await server.start()
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *service_names):
            await health_servicer.set(name, status)
        return server, port

    try:
        server, port = asyncio.run_coroutine_threadsafe(build(), loop).result(60.0)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30.0)
        raise
    host, _ = split_address(config.address)
    assert health_servicer is not None
    return AsyncRunningServer(
        server,
        health_servicer,
        loop,
        thread,
        host,
        port,
        config.grace_s,
        tuple(service_names),
        guard,
        on_stop,
    )


__all__ = [
    "AsyncRunningServer",
    "CallGuard",
    "RunningServer",
    "ServerConfig",
    "is_loopback",
    "split_address",
    "start_aio_server",
    "start_server",
]
