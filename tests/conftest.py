"""Shared test set-up: CPU only, float32 matmuls, deterministic XLA; an embedded Ray."""

import os
import shutil
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Before any test module imports grpc or ray (they sort above `services` imports): see
# services/__init__.py for why gRPC fork support is off.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

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
