"""``bench/bench_teacher_real.py --quick``: the real-teacher benchmark runs end to end.

It needs the SmolLM2 GGUF file (98 MB) already in the cache (``make teacher-gguf``); without
it the test skips rather than downloading. Nothing here asserts a time: only that both paths
scored the same real text, that every cell and the concurrent case were measured, and that
the closed shape set compiled once, before timing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distill.models import gguf

ROOT = Path(__file__).resolve().parents[2]


def cached_smollm2() -> Path | None:
    """The cached file where :func:`distill.models.gguf.fetch` keeps it, or None (no fetch
    here; the bench checks its SHA-256 when it resolves ``smollm2``)."""
    source = gguf.SMOLLM2
    path = gguf.cache_dir() / "gguf" / f"{source.package}-{source.version}" / source.file_name
    return path if path.is_file() and path.stat().st_size == source.size else None


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    if cached_smollm2() is None:
        pytest.skip(
            "the SmolLM2 GGUF file is not cached under "
            f"{gguf.cache_dir() / 'gguf'} (run `make teacher-gguf`)"
        )
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_teacher_real.py"), "--quick", "--json", out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.mark.slow
def test_quick_run_scores_real_text_served_and_in_process_alike(quick_run):
    results, stdout = quick_run
    check = results["check"]
    assert check["max_abs_diff"] <= 1e-4
    # Real text tokenized by the model's own tokenizer: far likelier than its ids shuffled.
    assert check["real_nats"] > check["shuffled_nats"] + 1.0
    assert "served log-probs equal in-process on cells" in stdout


@pytest.mark.slow
def test_quick_run_measures_every_cell_and_the_concurrent_clients(quick_run):
    results, stdout = quick_run
    reps = results["args"]["reps"]
    cells = [(row["batch"], row["length"]) for row in results["grid"]]
    assert cells == [(1, 32), (2, 32)]
    for row in results["grid"]:
        for path in ("in-process", "served"):
            assert len(row["seconds_per_call"][path]) == reps
            assert all(seconds > 0 for seconds in row["seconds_per_call"][path])
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
        assert f"{row['batch']:>5} {row['length']:>6}" in stdout
    concurrent = results["concurrent"]
    assert all(len(seconds) == reps for seconds in concurrent["seconds_per_round"].values())
    # Two one-row clients: the batcher puts one or two rows in a teacher call.
    assert 1.0 <= concurrent["rows_per_call"] <= 2.0


@pytest.mark.slow
def test_quick_run_compiles_its_closed_shape_set_before_timing(quick_run):
    results, _ = quick_run
    assert results["warm_up"]["compiles"] == 2  # rows {1, 2} x length {32}, log-probs only
    assert results["compiles_during_timing"] == 0
