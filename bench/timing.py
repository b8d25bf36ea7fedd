"""Shared timing helper for the benchmarks (each prints ratios measured in one run)."""

import time
from collections.abc import Callable

import jax


def time_calls(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call, averaged over ``calls`` back-to-back calls (results awaited)."""
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls
