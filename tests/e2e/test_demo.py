"""`make demo` runs end to end (the same entry point, in a subprocess)."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end_and_reports_tokens_per_forward():
    result = subprocess.run(
        [sys.executable, "-m", "distill.demo", "--completion-length", "8"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("tokens per forward") == 3
    assert "teacher (causal, KV cache)" in result.stdout
