"""Shared test set-up: CPU only, float32 matmuls, deterministic XLA; an embedded Ray."""

import os
import shutil
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# Imported before any test module imports grpc or ray (they sort above `services`), for the
# gRPC setting the package makes on import (services/__init__.py).
import services  # noqa: E402, F401

jax.config.update("jax_default_matmul_precision", "float32")


@pytest.fixture(scope="module")
def ray_session():
    """One embedded Ray on loopback for the requesting module, in its own temp dir (the
    ``ray`` module)."""
    import ray

    from services.cluster.placement import start_ray
    from tests.support.running_job import job_with

    temp = Path("/tmp") / f"distill-ray-{os.getpid()}"
    start_ray(None, job_with().cluster, temp)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
