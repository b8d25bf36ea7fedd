"""`distill run` with a teacher of another tokenizer: the teacher replica serves a byte-level
BPE teacher (trained here), the learner scores the character-tokenizer student's rows as text
through the replica's ``ScoreText`` and trains; every sample is trained exactly once.
"""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from services.jobs.driver import run_job
from tests.support.fakes import TINY_PHASES
from tests.test_cross_tokenizer import bpe, bpe_path, cross_job  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow
STEPS = 2


def test_a_distributed_job_trains_a_char_student_from_a_bpe_teacher(bpe_path, bpe, tmp_path):  # noqa: F811
    job = cross_job(
        bpe_path,
        bpe,
        *TINY_PHASES,
        f"opd.steps={STEPS}",
        "loss.advantage=mean_to_go",
        "cluster.rollout.count=1",
        "cluster.step_timeout_s=300",
    )
    temp = Path("/tmp") / f"distill-ray-cross-{os.getpid()}"
    try:
        result = run_job(
            job, tmp_path / "run", ray_temp_dir=temp, progress=False, log=lambda _: None
        )
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert len(result.history) == STEPS
    for metrics in result.history:
        assert np.isfinite(metrics["loss"])
        assert metrics["refused_rows"] <= metrics["invalid_rows"] <= job.data.batch_size
    assert result.status["accepted_rows"] == STEPS * job.data.batch_size
