"""glibc malloc settings that keep XLA:CPU's per-step temporary buffer mapped.

XLA:CPU allocates each execution's temporary buffer (about 250 MB for a step of the `sort`
warm-up) with ``posix_memalign`` on the worker thread that runs it. That thread's glibc
arena is a heap of at most 64 MiB, so glibc serves the request with a fresh ``mmap`` and
unmaps it on free: every step faults the whole buffer in again, page by page (about 50,000
minor faults per step; 15-18 % of the training process's CPU time in the kernel). One
arena that grows with ``brk``, never maps large chunks separately and never trims its top
keeps the buffer mapped from one step to the next. The settings take effect only at process
start (glibc reads ``GLIBC_TUNABLES`` once), so they are set in the environment of a
process about to be started: Ray actors and the phase-training task get them through their
``runtime_env`` (``services.cluster.placement``); for an in-process run (the experiment
CLIs) set them in the shell first, ``export GLIBC_TUNABLES=$(python -m distill.allocator)``
(prints the value, keeping tunables the shell already sets). Other C libraries ignore it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

GLIBC_TUNABLES = "GLIBC_TUNABLES"

#: One arena (threads share the main, brk-grown heap), no mmap'd chunks, no trimming of
#: the heap's top below 16 GiB: a freed temporary buffer stays mapped for the next step.
TRAINING_TUNABLES: dict[str, str] = {
    "glibc.malloc.arena_max": "1",
    "glibc.malloc.mmap_max": "0",
    "glibc.malloc.trim_threshold": str(16 << 30),
}


def _parse(value: str) -> dict[str, str]:
    settings = {}
    for item in filter(None, value.split(":")):
        name, sep, setting = item.partition("=")
        if not sep or not name:
            raise ValueError(
                f"`{GLIBC_TUNABLES}` must be name=value items joined by ':'; received {value!r}"
            )
        settings[name] = setting
    return settings


def training_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` whose ``GLIBC_TUNABLES`` holds :data:`TRAINING_TUNABLES`;
    a tunable ``environ`` already sets keeps its value (the user's choice wins). Fails
    naming ``GLIBC_TUNABLES`` when its value is not ``name=value`` items joined by ':'."""
    settings = TRAINING_TUNABLES | _parse(environ.get(GLIBC_TUNABLES, ""))
    out = dict(environ)
    out[GLIBC_TUNABLES] = ":".join(f"{name}={value}" for name, value in settings.items())
    return out


if __name__ == "__main__":
    try:
        print(training_environment(os.environ)[GLIBC_TUNABLES])
    except ValueError as error:
        sys.exit(str(error))
