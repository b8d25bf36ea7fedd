"""A TPU slice preempted under a running job: a fake two-slice Ray cluster
(``ray.cluster_utils.Cluster``: a CPU head for the teacher and the learner, and one node per
single-host v6e-8 slice advertising what Ray gives such a host: the ``TPU-v6e-8-head``
resource, the slice-name resource and the ``ray.io/tpu-*`` labels). The job's student
rollout role runs one worker on each slice (``cluster.rollout.resources`` names the slice
head), not restartable (``max_restarts: 0``, as a rollout worker group on a whole slice is).

Removing one slice's node while its worker holds a shard must not end the job: the driver
sees that worker gone for good, has the learner hand its shard out again at once, names it
in the result, and the job finishes on the surviving slice with every sample trained
exactly once. Slow: a cluster of three nodes and a whole job.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import pytest

from services.common.config import JobSpec
from tests.e2e.test_faults import (
    BATCH,
    STEPS,
    WAIT_S,
    RunningJob,
    fresh_run,
    job_with,
    ledger,
    rows_per_step,
    signal_pid,
    train_phases,
)

SLICES = ("slice-a", "slice-b")
HEAD = "TPU-v6e-8-head"  # one per single-host v6e-8 slice
NODE_ARGS = {"object_store_memory": 100 * 1024 * 1024}


@pytest.fixture(scope="module")
def two_slice_cluster():
    """``{slice name: node}`` of a running fake cluster this process is connected to."""
    import ray
    from ray.cluster_utils import Cluster

    root = tempfile.mkdtemp(prefix="rpre", dir="/tmp")
    temp_dir = os.path.join(root, "ray")
    os.mkdir(temp_dir)
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_TMPDIR", root)  # Cluster's address file stays out of the shared /tmp/ray
    cluster = None
    try:
        cluster = Cluster()
        # The head: the teacher replica, the learner and the phase task (one CPU each).
        cluster.add_node(
            num_cpus=3,
            temp_dir=temp_dir,
            include_dashboard=False,
            dashboard_agent_listen_port=None,
            **NODE_ARGS,
        )
        nodes = {}
        for slice_name in SLICES:
            nodes[slice_name] = cluster.add_node(
                wait=False,
                num_cpus=0,  # nothing but a rollout worker lands here
                temp_dir=temp_dir,
                resources={HEAD: 1, slice_name: 1},
                labels={
                    "ray.io/tpu-slice-name": slice_name,
                    "ray.io/tpu-worker-id": "0",
                    "ray.io/tpu-pod-type": "v6e-8",
                },
                **NODE_ARGS,
            )
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        yield cluster, nodes
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        patch.undo()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    return train_phases(tmp_path_factory.mktemp("phases"))


def job_on_two_slices() -> JobSpec:
    job = job_with("cluster.step_timeout_s=300")
    cluster = job.cluster.model_dump(mode="json")
    cluster["rollout"] = {"count": 2, "num_cpus": 0, "resources": {HEAD: 1}, "max_restarts": 0}
    return JobSpec(**{**job.model_dump(mode="json"), "cluster": cluster})


@pytest.mark.slow
def test_a_preempted_rollout_slice_leaves_the_job_finishing_on_the_other_with_each_sample_once(
    phases, two_slice_cluster, tmp_path
):
    cluster, nodes = two_slice_cluster
    job = job_on_two_slices()
    running = RunningJob(job, fresh_run(phases, tmp_path / "run"))
    slice_of = {node.node_id: name for name, node in nodes.items()}
    placed = {
        role: slice_of[running.call(role, "node_id", f"{role}'s node")]
        for role in ("rollout-0", "rollout-1")
    }
    assert sorted(placed.values()) == sorted(SLICES)  # one worker per slice
    pid = running.call("rollout-1", "pid", "rollout-1's pid")
    running.wait_status(lambda s: s["step"] >= 2, "step 2 to train")
    # Freeze rollout-1 once it holds a shard, then take its slice away.
    deadline = time.monotonic() + WAIT_S
    while True:
        signal_pid(pid, signal.SIGSTOP)
        if "rollout-1" in running.status()["assigned"]:
            break
        signal_pid(pid, signal.SIGCONT)
        assert time.monotonic() < deadline, "timed out waiting for rollout-1 to hold a shard"
        time.sleep(0.05)
    cluster.remove_node(nodes[placed["rollout-1"]])
    result, error = running.finish()
    assert error is None, error
    assert len(result.lost) == 1 and result.lost[0].startswith("rollout worker 1: "), result.lost
    assert any("rollout worker 1 is gone" in line for line in running.lines), running.lines
    status = result.status
    assert status["step"] == STEPS and status["error"] == ""
    assert status["released_shards"] >= 1  # its shard was handed out again at once
    assert status["accepted_rows"] == STEPS * rows_per_step(job)  # none accepted twice
    assert ledger(running.run) == [[0, STEPS * BATCH]]
