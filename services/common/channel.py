"""The client side of every service: a channel to one or several replicas, and calls that
retry a server that is briefly away.

:func:`channel_target` turns replica addresses into one gRPC target; :func:`open_channel`
opens it (plaintext, or TLS with given roots) with the message-size options the servers use,
a short reconnect backoff (so a restarted server is found again within about a second) and,
when asked, a load-balancing policy: with ``round_robin`` one channel keeps a connection to
every replica and sends consecutive calls to the next ready one.

:func:`call_with_retry` makes one unary call with a deadline per attempt and retries the
failures that may pass (:func:`is_transient`) per a
:class:`~services.common.config.RetryPolicy` (backoff with jitter, within a count and a
time budget); any other status, or a transient one past the policy, becomes the caller's
own error type, built from a :class:`CallFailure` (status, details, attempts, seconds).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from services.common.config import RetryPolicy, config_error, message_size_options

_T = TypeVar("_T")


def _ip_family(host: str) -> int | None:
    """4 or 6 for an IP literal (IPv6 in brackets or not), None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]")).version
    except ValueError:
        return None


def channel_target(addresses: Sequence[str]) -> str:
    """One gRPC target reaching every address in ``addresses``.

    One address is the target as given (``host:port``, resolved by DNS, which may itself
    list several replicas; or any gRPC target such as ``dns:///name:port``). Several must be
    ``host:port`` with IP literals of one family, and become ``ipv4:a:p,b:q`` or
    ``ipv6:[a]:p,[b]:q`` (gRPC resolves no list of names; give a DNS name that lists every
    replica instead). Raises :class:`~distill.config.ConfigError` naming `addresses`.
    """
    if isinstance(addresses, str) or len(addresses) == 0:
        raise config_error("addresses", "be a non-empty sequence of host:port", addresses)
    if len(addresses) == 1:
        return addresses[0]
    entries, families = [], set()
    for address in addresses:
        host, sep, port = address.rpartition(":")
        family = _ip_family(host) if sep and port.isdigit() else None
        if family is None:
            raise config_error(
                "addresses",
                "be host:port with IP literals to balance over several replicas (or one DNS "
                "name that lists them all)",
                list(addresses),
            )
        families.add(family)
        entries.append(f"[{host.strip('[]')}]:{port}" if family == 6 else f"{host}:{port}")
    if len(families) > 1:
        raise config_error(
            "addresses", "be all IPv4 or all IPv6 (one gRPC target)", list(addresses)
        )
    return f"ipv{families.pop()}:{','.join(entries)}"


def open_channel(
    target: str,
    *,
    max_message_bytes: int,
    tls_root_cert_file: str | os.PathLike[str] | None = None,
    tls_server_name: str | None = None,
    lb_policy: str | None = None,
    max_reconnect_backoff_s: float = 1.0,
) -> grpc.Channel:
    """A channel to ``target`` (see :func:`channel_target`): plaintext without
    ``tls_root_cert_file`` (loopback or a trusted network), else TLS verified against those
    PEM roots, checking ``tls_server_name`` (when given) instead of the target's host.
    ``lb_policy``: ``grpc.lb_policy_name``, e.g. ``"round_robin"`` (None: gRPC's default,
    ``pick_first``). ``max_reconnect_backoff_s``: the longest pause between attempts to
    reconnect to a server that went away (first pause 0.1 s; gRPC's own default grows to
    120 s, so a server back after a 30 s outage could stay unnoticed for tens of seconds).
    Raises ``ValueError`` naming the field for a name override without roots or a
    reconnect backoff <= 0, and ``ConfigError`` for an unreadable roots file."""
    if not max_reconnect_backoff_s > 0:
        raise ValueError(
            f"`max_reconnect_backoff_s` must be > 0; received {max_reconnect_backoff_s!r}"
        )
    if tls_server_name is not None and tls_root_cert_file is None:
        raise ValueError(
            "`tls_root_cert_file` must be given with tls_server_name (a name override "
            "on a plaintext channel would verify nothing); received None"
        )
    options: list[tuple[str, int | str]] = [*message_size_options(max_message_bytes)]
    max_backoff_ms = max(1, int(max_reconnect_backoff_s * 1000))
    options.append(("grpc.initial_reconnect_backoff_ms", min(100, max_backoff_ms)))
    options.append(("grpc.max_reconnect_backoff_ms", max_backoff_ms))
    if lb_policy is not None:
        options.append(("grpc.lb_policy_name", lb_policy))
    if tls_server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    if tls_root_cert_file is None:
        return grpc.insecure_channel(target, options=options)
    try:
        roots = Path(tls_root_cert_file).read_bytes()
    except OSError as error:
        raise config_error(
            "tls_root_cert_file",
            f"be a readable PEM file ({error.strerror})",
            os.fspath(tls_root_cert_file),
        ) from error
    credentials = grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.secure_channel(target, credentials, options=options)


#: Details gRPC's Python client gives a call that the calling side itself cancelled (the
#: application cancelled it, closed the channel, or dropped the call): never retried.
LOCAL_CANCEL_DETAILS = frozenset(
    {"Locally cancelled by application!", "Channel closed!", "Cancelled upon garbage collection!"}
)
#: How gRPC's server begins the details of a call refused for ``maximum_concurrent_rpcs``:
#: ``RESOURCE_EXHAUSTED`` that passes once calls finish (unlike a request over a limit).
OVERLOAD_DETAILS_PREFIX = "Concurrent RPC limit exceeded"


def is_transient(error: grpc.RpcError) -> bool:
    """Whether the same call may succeed if made again a little later:

    * ``UNAVAILABLE``: the server is not reachable, starting, stopping or restarting, the
      connection dropped, or its queue is full;
    * ``RESOURCE_EXHAUSTED`` only as gRPC's own overload refusal
      (:data:`OVERLOAD_DETAILS_PREFIX`); a request over a server limit would fail again;
    * ``CANCELLED`` only when the server ended the call (a graceful stop cancels calls
      still queued): a cancel from the calling side (:data:`LOCAL_CANCEL_DETAILS`, or a
      call whose ``cancelled()`` is true) means nobody wants the answer any more.
    """
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return details.startswith(OVERLOAD_DETAILS_PREFIX)
    if code == grpc.StatusCode.CANCELLED:
        cancelled = getattr(error, "cancelled", None)
        locally = bool(cancelled()) if callable(cancelled) else False
        return not locally and details not in LOCAL_CANCEL_DETAILS
    return False


@dataclasses.dataclass(frozen=True)
class CallFailure:
    """How a call ended for good: the last attempt's ``code`` and ``details``, how many
    ``attempts`` were made, ``elapsed_s`` since the first began, and whether the last
    status was ``transient`` (then retrying stopped because the policy's count or time
    budget ran out; otherwise the status would not pass by retrying)."""

    code: grpc.StatusCode
    details: str
    attempts: int
    elapsed_s: float
    transient: bool


def call_with_retry(
    method: Callable[..., _T],
    request: object,
    *,
    timeout_s: float,
    metadata: Sequence[tuple[str, str]],
    policy: RetryPolicy,
    describe: Callable[[CallFailure], BaseException],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> _T:
    """``method(request)`` (a stub's unary method; the call must be safe to repeat) with a
    ``timeout_s`` deadline per attempt.

    A failure :func:`is_transient` is retried: retry ``n`` after ``policy.delay_s(n)`` times
    a random factor in ``[0.5, 1]``, while ``policy.retries`` (if set) allows another
    attempt and less than ``policy.budget_s`` has passed since the call first failed (a
    long call cut by a restart still gets the whole budget); the wait is cut to the
    budget's end so the last attempt comes at it. Once failing, a call therefore ends
    within ``budget_s`` plus one attempt's ``timeout_s`` (an unreachable server fails each
    attempt at once). Other statuses are not retried: they would fail the same way. A final
    failure raises ``describe(CallFailure(...))``, the caller's error type. ``clock`` and
    ``sleep`` are injectable for tests."""
    started = clock()
    failing_since: float | None = None
    attempt = 0
    while True:
        try:
            return method(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as error:
            transient = is_transient(error)
            now = clock()
            failing_since = now if failing_since is None else failing_since
            elapsed = now - started
            left = policy.budget_s - (now - failing_since)
            if transient and left > 0 and (policy.retries is None or attempt < policy.retries):
                sleep(min(policy.delay_s(attempt) * random.uniform(0.5, 1.0), left))
                attempt += 1
                continue
            failure = CallFailure(
                error.code(), error.details() or "", attempt + 1, elapsed, transient
            )
            raise describe(failure) from None
