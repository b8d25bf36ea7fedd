"""The client side of every service: a channel to one or several replicas, and calls that
retry a server that is briefly ``UNAVAILABLE``.

:func:`channel_target` turns replica addresses into one gRPC target; :func:`open_channel`
opens it (plaintext, or TLS with given roots) with the message-size options the servers use
and, when asked, a load-balancing policy: with ``round_robin`` one channel keeps a
connection to every replica and sends consecutive calls to the next ready one.
:func:`call_with_retry` makes one unary call with a deadline per attempt and retries
``UNAVAILABLE`` per a :class:`~services.common.config.RetryPolicy`; any other status (or
``UNAVAILABLE`` past the retries) becomes the caller's own error type.
"""

from __future__ import annotations

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
) -> grpc.Channel:
    """A channel to ``target`` (see :func:`channel_target`): plaintext without
    ``tls_root_cert_file`` (loopback or a trusted network), else TLS verified against those
    PEM roots, checking ``tls_server_name`` (when given) instead of the target's host.
    ``lb_policy``: ``grpc.lb_policy_name``, e.g. ``"round_robin"`` (None: gRPC's default,
    ``pick_first``). Raises ``ValueError`` naming the field for a name override without roots
    and ``ConfigError`` for an unreadable roots file."""
    if tls_server_name is not None and tls_root_cert_file is None:
        raise ValueError(
            "`tls_root_cert_file` must be given with tls_server_name (a name override "
            "on a plaintext channel would verify nothing); received None"
        )
    options: list[tuple[str, int | str]] = [*message_size_options(max_message_bytes)]
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


def call_with_retry(
    method: Callable[..., _T],
    request: object,
    *,
    timeout_s: float,
    metadata: Sequence[tuple[str, str]],
    policy: RetryPolicy,
    describe: Callable[[grpc.StatusCode, str, int], BaseException],
) -> _T:
    """``method(request)`` (a stub's unary method) with a ``timeout_s`` deadline per
    attempt. ``UNAVAILABLE`` is retried ``policy.retries`` times, waiting
    ``policy.delay_s(n)`` times a random factor in ``[0.5, 1]`` before retry ``n``; other
    statuses are not retried (they would fail the same way). A final failure raises
    ``describe(code, details, attempts)``, the caller's error type."""
    attempt = 0
    while True:
        try:
            return method(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as error:
            code = error.code()
            if code == grpc.StatusCode.UNAVAILABLE and attempt < policy.retries:
                time.sleep(policy.delay_s(attempt) * random.uniform(0.5, 1.0))
                attempt += 1
                continue
            raise describe(code, error.details() or "", attempt + 1) from None
