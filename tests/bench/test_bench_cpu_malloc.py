"""``bench/bench_cpu_malloc.py``: both settings train, their losses agree bitwise, the
tuned processes fault far less. Nothing here asserts a time."""

import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_the_malloc_bench_measures_both_settings_on_the_same_losses():
    done = subprocess.run(
        [sys.executable, "bench/bench_cpu_malloc.py", "--phase", "teacher"]
        + ["--rounds", "1", "--steps", "2", "--warmup", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training losses of all 2 processes: equal, bitwise" in done.stdout
    faults = {
        name: float(count)
        for name, count in re.findall(
            r"^\s+(default|tuned):.*?(\d+) faults/step", done.stdout, re.M
        )
    }
    assert faults["tuned"] < faults["default"] / 2, done.stdout
