"""Fixtures of the end-to-end tests: the tiny job's trained phases and an embedded Ray."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.support.running_job import job_with, train_phases


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """Finished teacher and warm-up runs, shared by every job below (copied in)."""
    return train_phases(tmp_path_factory.mktemp("phases"))


@pytest.fixture(scope="module")
def ray_session():
    """One embedded Ray on loopback for this module, in its own temp dir."""
    import ray

    from services.cluster.placement import start_ray

    temp = Path("/tmp") / f"distill-faults-{os.getpid()}"
    start_ray(None, job_with().cluster, temp)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
