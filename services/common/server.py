"""What every gRPC server of the project shares: address, auth, TLS, limits, health,
reflection, graceful stop.

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

import dataclasses
import ssl
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth import BearerTokenInterceptor
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


def start_server(
    config: ServerConfig,
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    *,
    on_stop: Callable[[], None] | None = None,
) -> RunningServer:
    """Build, bind and start a server; ``register(server)`` adds the caller's servicers and
    ``service_names`` (full names, e.g. ``distill.v1.TeacherService``) are reported by health
    and reflection. Raises :class:`ConfigError` naming `address` when it cannot be bound."""
    credentials = None
    if config.tls_cert_file is not None:
        key = _read_pem(config.tls_key_file, "tls_key_file")
        cert = _read_pem(config.tls_cert_file, "tls_cert_file")
        _check_key_pair(config.tls_cert_file, config.tls_key_file)
        credentials = grpc.ssl_server_credentials([(key, cert)])
    interceptors = [] if config.token is None else [BearerTokenInterceptor(config.token)]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        # No SO_REUSEPORT: a second server on a taken port must fail, not share its traffic.
        options=[*config.channel_options, ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection(
        (*service_names, health_name, reflection.SERVICE_NAME), server
    )
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


__all__ = ["RunningServer", "ServerConfig", "is_loopback", "split_address", "start_server"]
