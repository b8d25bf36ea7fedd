"""Loopback helpers shared by the tests."""

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; tests bind loopback only)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
