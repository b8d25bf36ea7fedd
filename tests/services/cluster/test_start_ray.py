"""The embedded Ray start retries once after Ray's raylet-registration timeout, stopping what
the failed attempt left running; any other failure (or a second timeout) is raised as is. It
gives its GCS 120 s (not Ray's 30) to bind unless the operator set that wait.

Ray's own timeout (a fixed 30 s for a new raylet to register, hit on an overloaded machine)
cannot be provoked on demand, so ``ray.init`` is replaced here by one that starts a process
the way a failed start leaves its GCS and raylet behind, then raises Ray's message."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import ray

from services.cluster import placement
from services.common.config import ClusterConfig

GCS = placement.GCS_PORT_WAIT_VARIABLE
TIMEOUT_MESSAGE = (
    "The current node timed out during startup. This could happen because some of the "
    "raylet failed to startup or the GCS has become overloaded."
)


class FlakyInit:
    """``ray.init`` whose first ``failures`` calls leave a child process and raise ``error``."""

    def __init__(self, failures: int, error: str = TIMEOUT_MESSAGE):
        self.failures, self.error = failures, error
        self.calls: list[dict] = []
        self.left_behind: list[subprocess.Popen] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            self.left_behind.append(child)
            raise Exception(self.error)


@pytest.fixture
def flaky(monkeypatch):
    def make(failures: int, error: str = TIMEOUT_MESSAGE) -> FlakyInit:
        init = FlakyInit(failures, error)
        monkeypatch.setattr(ray, "init", init)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        return init

    yield make


def test_a_start_that_times_out_once_is_retried_and_the_failed_attempts_processes_stopped(
    flaky, tmp_path
):
    init = flaky(failures=1)
    assert placement.start_ray(None, ClusterConfig(), tmp_path / "ray") is True
    assert len(init.calls) == 2 and init.calls[0] == init.calls[1]
    assert init.calls[0]["address"] == "local" and init.calls[0]["_node_ip_address"] == "127.0.0.1"
    (child,) = init.left_behind
    assert child.wait(timeout=30) is not None  # stopped, not left running
    assert not psutil.pid_exists(child.pid) or psutil.Process(child.pid).status() == "zombie"


def test_a_second_timeout_is_raised_with_rays_message(flaky, tmp_path):
    init = flaky(failures=placement.EMBEDDED_START_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"):
        placement.start_ray(None, ClusterConfig(), tmp_path / "ray")
    assert len(init.calls) == placement.EMBEDDED_START_ATTEMPTS
    assert init.left_behind[0].wait(timeout=30) is not None  # the retried attempt's were stopped
    init.left_behind[-1].kill()
    init.left_behind[-1].wait(timeout=30)


def test_any_other_start_failure_is_not_retried(flaky, tmp_path):
    init = flaky(failures=1, error="port 6379 is in use")
    with pytest.raises(Exception, match="port 6379 is in use"):
        placement.start_ray(None, ClusterConfig(), tmp_path / "ray")
    assert len(init.calls) == 1
    init.left_behind[0].kill()
    init.left_behind[0].wait(timeout=30)


def test_an_embedded_start_gives_its_gcs_longer_to_bind_unless_the_operator_set_it(
    flaky, tmp_path, monkeypatch
):
    seen = []
    init = flaky(failures=0)
    monkeypatch.setattr(
        ray, "init", lambda **kwargs: seen.append(placement.os.environ.get(GCS)) or init(**kwargs)
    )
    monkeypatch.delenv(GCS, raising=False)
    placement.start_ray(None, ClusterConfig(), tmp_path / "ray")
    monkeypatch.setenv(GCS, "45")
    placement.start_ray(None, ClusterConfig(), tmp_path / "ray")
    assert seen == [str(placement.EMBEDDED_GCS_PORT_WAIT_S), "45"]
