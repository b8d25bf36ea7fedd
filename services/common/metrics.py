"""Prometheus metrics of a gRPC server, through ``prometheus_client``.

Each server owns a :class:`RpcMetrics` on its own ``CollectorRegistry`` (two servers in one
process never share counters): calls by method and status code, a latency histogram per
method, and unparsable request bodies per method. A service adds its own metrics to the same
``registry`` (the teacher: batch size and fill, queue depth, scored tokens, compiles).
:func:`serve_metrics` exposes a registry over HTTP with the library's own server, only when
an address is configured; the config requires loopback unless a host is named explicitly.
"""

from __future__ import annotations

import dataclasses

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from services.common.config import split_address

#: Latency buckets in seconds: sub-millisecond health checks to minute-long batches.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RpcMetrics:
    """``distill_rpc_requests_total{method,code}``, ``distill_rpc_latency_seconds{method}``
    and ``distill_rpc_malformed_total{method}`` on ``registry`` (a new one by default).
    :meth:`observe` and :meth:`malformed` are the hooks :func:`services.common.server.
    start_aio_server` calls."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = CollectorRegistry() if registry is None else registry
        self.requests = Counter(
            "distill_rpc_requests",
            "Finished calls by method and gRPC status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "distill_rpc_latency_seconds",
            "Call latency from the handler's start to its end, by method.",
            ["method"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.malformed_requests = Counter(
            "distill_rpc_malformed",
            "Request bodies that did not parse as the method's message, by method.",
            ["method"],
            registry=self.registry,
        )

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.requests.labels(method=method, code=code.name).inc()
        self.latency.labels(method=method).observe(seconds)

    def malformed(self, method: str) -> None:
        self.malformed_requests.labels(method=method).inc()

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when absent), e.g. ``value("distill_rpc_requests_total",
        method=..., code="OK")``; for tests and status pages."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found


@dataclasses.dataclass
class MetricsEndpoint:
    """A running ``/metrics`` HTTP endpoint: ``address`` (bound ``host:port``), ``stop()``."""

    host: str
    port: int
    _server: object
    _thread: object

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10.0)


def serve_metrics(registry: CollectorRegistry, address: str) -> MetricsEndpoint:
    """Serve ``registry`` at ``http://address/metrics`` (port 0: a free one) on a daemon
    thread, with ``prometheus_client``'s own HTTP server."""
    host, port = split_address(address)
    server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    return MetricsEndpoint(host, server.server_address[1], server, thread)
