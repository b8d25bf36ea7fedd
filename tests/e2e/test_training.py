"""Slow: the tiny causal teacher of deploy/configs/tiny.yaml learns copy and agree.

Seeded (job seed 0); evaluated at temperature 1 on 200 held-out examples of the eval split.
"""

import pytest

from distill import pipeline
from distill.config import JobConfig, load_config


@pytest.fixture(scope="session")
def trained_teacher(tmp_path_factory):
    job = load_config("deploy/configs/tiny.yaml", JobConfig)
    run = tmp_path_factory.mktemp("teacher")
    model, report = pipeline.train_teacher(job, run, progress=False, log=lambda _: None)
    return job, run, model, report


@pytest.mark.slow
def test_tiny_teacher_learns_copy_and_agree_at_temperature_one(trained_teacher):
    _, run, _, report = trained_teacher
    assert report.count == 200
    assert report.accuracy["copy"] >= 0.99, report
    assert report.accuracy["agree"] >= 0.99, report
    # Sampling at temperature 1 keeps the free choice of `agree` diverse (8 symbols: 3 bits).
    assert report.agree_entropy_bits > 2.5
    assert (run / "eval.json").exists()
