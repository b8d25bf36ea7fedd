"""Validated settings every service shares: where and how a server listens
(:class:`ServerConfig`), how a client retries (:class:`RetryPolicy`), and the address
helpers both use.

Configs are frozen pydantic models on :class:`distill.config.ConfigModel`: unknown fields
are refused, and every failure raises :class:`~distill.config.ConfigError` with one line
per problem reading "`field` must ...; received ...". Defaults are safe for a single
machine: loopback address, no TLS. A server reachable from other hosts must have a bearer
token (see :mod:`services.common.auth`); TLS is opt-in with a certificate and key file.
"""

from __future__ import annotations

import ipaddress
from typing import ClassVar, Self

from pydantic import Field, model_validator

from distill.config import ConfigError, ConfigModel, JobConfig
from services.cluster.tpu import SliceRequest

_MIB = 1 << 20


def config_error(field: str, must: str, received: object) -> ConfigError:
    """A :class:`ConfigError` reading "`field` must ...; received ..."."""
    return ConfigError(f"`{field}` must {must}; received {received!r}")


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts in brackets) as ``(host, port)``; raises naming `address`."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise config_error(
            "address", "be host:port with a port in [0, 65535] (0: any free port)", address
        )
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerConfig(ConfigModel):
    """Transport settings every server shares.

    ``address``: ``host:port`` to bind; port 0 picks a free one (see ``RunningServer.port``).
    ``token``: bearer token callers must send; required unless ``address`` is loopback; not
    shown in ``repr``. ``tls_cert_file`` / ``tls_key_file``: PEM server certificate chain
    and private key; both or neither. ``max_message_bytes``: largest request and response
    message. ``max_workers``: handler threads (each waiting call holds one).
    ``max_concurrent_rpcs``: calls beyond this are refused with ``RESOURCE_EXHAUSTED`` by
    gRPC itself; at least ``max_workers``. ``grace_s``: how long ``stop()`` lets in-flight
    calls finish (>= 0).
    """

    address: str = "127.0.0.1:0"
    token: str | None = Field(default=None, repr=False)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    max_message_bytes: int = Field(default=64 * _MIB, ge=1, strict=True)
    max_workers: int = Field(default=32, ge=1, strict=True)
    max_concurrent_rpcs: int = Field(default=256, ge=1, strict=True)
    grace_s: float = Field(default=5.0, ge=0)

    @model_validator(mode="after")
    def _check_transport(self) -> Self:
        host, _ = split_address(self.address)
        if self.token is not None and not self.token:
            raise config_error("token", "be non-empty or None", "")
        if self.token is None and not is_loopback(host):
            raise config_error(
                "token",
                f"be set when `address` is not loopback ({self.address}): anyone who can reach "
                "it could use the server",
                None,
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise config_error(
                "tls_key_file" if self.tls_key_file is None else "tls_cert_file",
                "be given together with the other TLS file",
                None,
            )
        if self.max_concurrent_rpcs < self.max_workers:
            raise config_error(
                "max_concurrent_rpcs",
                f"be >= max_workers={self.max_workers} (threads beyond it would idle)",
                self.max_concurrent_rpcs,
            )
        return self

    @property
    def channel_options(self) -> list[tuple[str, int]]:
        """Message-size options; clients should use the same ones."""
        return message_size_options(self.max_message_bytes)


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel / server options capping sent and received messages."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


class RetryPolicy(ConfigModel):
    """How a client retries a call that failed in a way that may pass: the server answered
    ``UNAVAILABLE`` (not started yet, restarting, stopping, connection dropped, queue full),
    gRPC's own overload refusal (``RESOURCE_EXHAUSTED`` "Concurrent RPC limit exceeded"), or
    the server cancelled the call (``CANCELLED`` that the caller did not ask for). See
    :func:`services.common.channel.call_with_retry`.

    Retry ``n`` (from 0) comes ``min(max_backoff_s, backoff_s * 2**n)`` seconds after the
    failure, times a random factor in ``[0.5, 1]`` (jitter, so many clients do not retry in
    lockstep). Retrying stops at whichever comes first: ``retries`` extra attempts (``None``:
    no count limit), or ``budget_s`` seconds since the call first failed (the last wait is
    cut short so one more attempt is made at the budget's end). The default budget, 30 s,
    covers a restart of a teacher replica (a few seconds for a tiny model, tens for a large
    one on a busy host); a longer outage fails the call with an error naming the address,
    the attempts and the time spent. ``backoff_s`` is at most ``max_backoff_s``; the
    default cap (2 s) means a server that comes back is found within about 2 s.
    """

    retries: int | None = Field(default=None, ge=0, strict=True)
    backoff_s: float = Field(default=0.2, ge=0)
    max_backoff_s: float = Field(default=2.0, ge=0)
    budget_s: float = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _check_backoff(self) -> Self:
        if self.backoff_s > self.max_backoff_s:
            raise config_error(
                "backoff_s", f"be in [0, max_backoff_s={self.max_backoff_s}]", self.backoff_s
            )
        return self

    def delay_s(self, attempt: int) -> float:
        """The wait before retry ``attempt`` (0 for the first), before jitter."""
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** min(attempt, 64))


#: Restarts per actor unless a role's ``max_restarts`` says otherwise. A teacher replica
#: comes back on its address and a rollout worker's lost shard is handed out again, so both
#: are restarted; the learner holds the run's state and is not (rerun to resume).
DEFAULT_MAX_RESTARTS: dict[str, int] = {"teacher": 3, "rollout": 3, "learner": 0}


class RoleConfig(ConfigModel):
    """How many actors of one role a job places, and what each asks Ray for.

    ``count``: actors (teacher replicas, rollout workers; the learner is always one).
    ``num_cpus`` / ``num_gpus`` / ``resources``: Ray resources per actor (custom resources,
    e.g. a TPU slice head ``{"TPU-v5e-8-head": 1}``). ``cpu_threads``: when set, the actor's
    process runs XLA's CPU backend with that many threads (one core each for benchmarks).
    ``cpu_affinity``: when set, the actor's process runs only on these core ids (Linux
    ``sched_setaffinity``; a benchmark's way to give each process its own core).
    ``max_restarts``: how many times Ray restarts one such actor after its process dies
    (``None``: the role's default, :data:`DEFAULT_MAX_RESTARTS`; the learner is never
    restarted in place: the job fails naming it and a rerun resumes from its checkpoint).
    ``slice``: when set (``{accelerator_type: v6e, topology: 4x4}``, see
    :class:`~services.cluster.tpu.SliceRequest`), each of the role's ``count`` actors is a
    whole TPU slice instead: one host actor per host of the slice, all of them one
    ``jax.distributed`` world, host 0 the role's endpoint (docs/tpu-placement.md). The slice
    placement asks for the hosts' chips itself, so ``num_gpus`` and ``resources`` stay empty;
    a world does not survive one of its processes restarting, so ``max_restarts`` is 0."""

    count: int = Field(default=1, ge=1, strict=True)
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    cpu_threads: int | None = Field(default=None, ge=1)
    cpu_affinity: tuple[int, ...] | None = None
    max_restarts: int | None = Field(default=None, ge=0, strict=True)
    slice: SliceRequest | None = None

    def restarts(self, role: str) -> int:
        """``max_restarts``, or the default of ``role`` (``teacher``, ``rollout``,
        ``learner``); 0 for a role placed on slices."""
        if self.slice is not None:
            return 0
        return DEFAULT_MAX_RESTARTS[role] if self.max_restarts is None else self.max_restarts

    @model_validator(mode="after")
    def _check_slice(self) -> Self:
        if self.slice is None:
            return self
        if self.num_gpus:
            raise config_error("num_gpus", "be 0 when `slice` is set", self.num_gpus)
        if self.resources:
            raise config_error(
                "resources",
                "be empty when `slice` is set (the slice placement asks for each host's "
                "TPU chips and its slice's head resource itself)",
                self.resources,
            )
        if self.max_restarts not in (None, 0):
            raise config_error(
                "max_restarts",
                "be 0 or null when `slice` is set (a jax.distributed world does not survive "
                "one of its processes restarting; rerun the job to resume)",
                self.max_restarts,
            )
        return self

    @model_validator(mode="after")
    def _check_affinity(self) -> Self:
        if self.cpu_affinity is not None and (not self.cpu_affinity or min(self.cpu_affinity) < 0):
            raise config_error(
                "cpu_affinity", "list at least one core id >= 0", list(self.cpu_affinity)
            )
        return self


class ClusterConfig(ConfigModel):
    """The ``cluster:`` section of a job: where its actors go and how long anything may take.

    ``teacher`` / ``rollout`` / ``learner``: :class:`RoleConfig` per role (CPU by default:
    one teacher replica, two rollout workers, one learner). ``host``: the address services
    bind on (loopback by default; a multi-host cluster needs a reachable one plus a token
    in ``token_file``). ``start_timeout_s``: how long placing and starting the actors may
    take; ``step_timeout_s``: how long one step may wait for its rollouts;
    ``teacher_timeout_s`` and ``teacher_retry``: each teacher call's deadline and retries
    (within a time budget that covers a replica's restart). ``learner_retry``: how each
    rollout worker retries its calls to the learner (``AcquireWork``, ``PushTraces``) while
    the learner is briefly unreachable; a push the learner already took is refused, not
    counted twice, when retried.
    ``watchdog_s``: the job fails when no training step completes for this long, naming the
    stage that stalled (``rollout``, ``teacher`` or ``learner``); ``None`` turns it off.
    ``record_traces``: the learner keeps every trained rollout in ``RUN/opd/traces/``.
    Any role may be placed on multi-host slices: host 0 runs the role and checkpoints alone,
    the other hosts hold (:class:`services.cluster.actors._SliceHost`,
    docs/tpu-placement.md).
    """

    section: ClassVar[str] = "cluster"

    teacher: RoleConfig = Field(default_factory=RoleConfig)
    rollout: RoleConfig = Field(default_factory=lambda: RoleConfig(count=2))
    learner: RoleConfig = Field(default_factory=RoleConfig)
    host: str = "127.0.0.1"
    token_file: str | None = None
    start_timeout_s: float = Field(default=600.0, gt=0)
    step_timeout_s: float = Field(default=600.0, gt=0)
    teacher_timeout_s: float = Field(default=120.0, gt=0)
    teacher_retry: RetryPolicy = Field(default_factory=RetryPolicy)
    learner_retry: RetryPolicy = Field(default_factory=RetryPolicy)
    watchdog_s: float | None = Field(default=1800.0, gt=0)
    record_traces: bool = False

    @model_validator(mode="after")
    def _check_roles(self) -> Self:
        if self.learner.count != 1:
            raise config_error("learner.count", "be 1 (one learner per job)", self.learner.count)
        if self.learner.max_restarts not in (None, 0):
            raise config_error(
                "learner.max_restarts",
                "be 0 or null (the learner is not restarted in place; rerun the job to resume "
                "from its newest checkpoint)",
                self.learner.max_restarts,
            )
        if self.token_file is None and not is_loopback(self.host):
            raise config_error(
                "token_file",
                f"be set when `host` is not loopback ({self.host}): anyone who can reach the "
                "services could use them",
                None,
            )
        return self


class JobSpec(JobConfig):
    """A job as the services run it: the library's :class:`~distill.config.JobConfig` plus
    its ``cluster:`` section (which is not part of any run contract: a run may resume on
    another placement)."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
