"""distill.allocator: the glibc settings that keep XLA's per-step buffers mapped."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from distill.allocator import GLIBC_TUNABLES, TRAINING_TUNABLES, training_environment


def test_the_training_tunables_join_an_environment_without_them():
    env = training_environment({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    items = dict(item.split("=") for item in env[GLIBC_TUNABLES].split(":"))
    assert items == TRAINING_TUNABLES and items["glibc.malloc.arena_max"] == "1"


def test_a_tunable_the_environment_already_sets_keeps_its_value():
    env = training_environment(
        {GLIBC_TUNABLES: "glibc.malloc.arena_max=4:glibc.malloc.tcache_count=0"}
    )
    items = dict(item.split("=") for item in env[GLIBC_TUNABLES].split(":"))
    assert items["glibc.malloc.arena_max"] == "4"
    assert items["glibc.malloc.tcache_count"] == "0"
    assert items["glibc.malloc.mmap_max"] == "0"


@pytest.mark.parametrize("value", ["arena_max", "=1", "glibc.malloc.arena_max=1:junk"])
def test_a_malformed_glibc_tunables_is_refused_by_name(value):
    with pytest.raises(ValueError, match="`GLIBC_TUNABLES` must be name=value items"):
        training_environment({GLIBC_TUNABLES: value})


def test_the_module_prints_the_value_to_export():
    env = {**os.environ, GLIBC_TUNABLES: "glibc.malloc.arena_max=2"}
    done = subprocess.run(
        [sys.executable, "-m", "distill.allocator"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == training_environment(env)[GLIBC_TUNABLES]
    done = subprocess.run(
        [sys.executable, "-m", "distill.allocator"],
        env={**os.environ, GLIBC_TUNABLES: "junk"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "`GLIBC_TUNABLES` must be" in done.stderr


# A thread allocates a buffer larger than a thread arena's heap (64 MiB), touches every
# page, frees it, and does it again; it prints the minor faults of the second round.
_PROBE = textwrap.dedent(
    """
    import ctypes, resource, threading
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 128 << 20
    faults = []
    def rounds():
        for _ in range(2):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            buffer = libc.malloc(size)
            ctypes.memset(buffer, 1, size)
            libc.free(buffer)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
    print(faults[-1])
    """
)


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_a_freed_large_buffer_stays_mapped_only_under_the_training_tunables():
    def second_round_faults(env):
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip())

    plain = {name: value for name, value in os.environ.items() if name != GLIBC_TUNABLES}
    pages = (128 << 20) // os.sysconf("SC_PAGE_SIZE")
    # glibc's defaults map the buffer afresh and fault every page in again...
    assert second_round_faults(plain) > pages // 2
    # ...the training settings reuse the pages the first round faulted in.
    assert second_round_faults(training_environment(plain)) < pages // 20
