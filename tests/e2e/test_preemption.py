"""A multi-host TPU slice preempted under a running job.

A fake two-slice Ray cluster (``ray.cluster_utils.Cluster``): a CPU head for the teacher and
the learner, and two v4-16 slices (``2x2x2``: two hosts of 4 chips, the smallest multi-host
slice), each host a node advertising what Ray gives such a host (``TPU: 4``, the slice-name
resource, ``TPU-v4-16-head`` on worker 0 only, the ``ray.io/tpu-*`` labels; GKE's ``TPU_*``
variables so Ray's own detection agrees). Each slice's nodes have their own loopback address,
as each slice is its own machines, so both slices' ``jax.distributed`` coordinators use the
same port. The student rollout role is placed on the slices (``cluster.rollout.slice``): one
worker group per slice, both hosts one world, host 0 the worker, host 1 holding.

Removing the node of rollout worker 1's host 1 (not its endpoint: the worker goes on with a
broken world) while the worker holds a shard must not end the job: the driver drops the
slice (kills what is left of it, frees its reservation), has the learner hand its shard out
again at once, names the slice in the result, and the job finishes on the other slice with
every sample trained exactly once. Slow: a cluster of five nodes and a whole job. Also
(seconds, on the same cluster): a slice's worker that fails in its broken world before the
driver sees its dead host is lost as that host.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time

import pytest

from services.common.config import JobSpec
from services.jobs.driver import actor_name
from tests.support.network import free_port
from tests.support.running_job import (
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
HOSTS = 2  # v4 2x2x2 = v4-16: 8 chips on 2 hosts
POD_TYPE = "v4-16"
NODE_ARGS = {"object_store_memory": 100 * 1024 * 1024}


@pytest.fixture(scope="module")
def two_slice_cluster():
    """``(cluster, {(slice name, worker id): node})`` of a running fake cluster this process
    is connected to."""
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
        for number, slice_name in enumerate(SLICES):
            for worker in range(HOSTS):
                resources = {"TPU": 4, slice_name: 1, "accelerator_type:TPU-V4": 1}
                if worker == 0:
                    resources[f"TPU-{POD_TYPE}-head"] = 1
                gke = {
                    "TPU_NAME": slice_name,
                    "TPU_WORKER_ID": str(worker),
                    "TPU_ACCELERATOR_TYPE": POD_TYPE,
                    "TPU_TOPOLOGY": "2x2x2",
                }
                with pytest.MonkeyPatch.context() as node_env:
                    for name, value in gke.items():
                        node_env.setenv(name, value)
                    nodes[slice_name, worker] = cluster.add_node(
                        wait=False,
                        num_cpus=0,  # nothing but the slice's host actors lands here
                        node_ip_address=f"127.0.0.{2 + number}",
                        temp_dir=temp_dir,
                        resources=resources,
                        labels={
                            "ray.io/tpu-slice-name": slice_name,
                            "ray.io/tpu-worker-id": str(worker),
                            "ray.io/tpu-pod-type": POD_TYPE,
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
    request = {"accelerator_type": "v4", "topology": "2x2x2", "coordinator_port": free_port()}
    cluster["rollout"] = {"count": 2, "num_cpus": 0, "slice": request}
    return JobSpec(**{**job.model_dump(mode="json"), "cluster": cluster})


def slice_reservations(role: str) -> list[str]:
    """The states of the placement groups that reserve ``role``'s slice."""
    from ray.util import placement_group_table

    prefix = f"distill-{role}-{POD_TYPE}-"
    return [
        group["state"]
        for group in placement_group_table().values()
        if group["name"].startswith(prefix)
    ]


def wait_for(condition, what: str, running: RunningJob | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if running is not None:
            running.check_running(what)
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_preempted_host_of_a_rollout_slice_drops_that_slice_and_the_job_finishes_on_the_other(
    phases, two_slice_cluster, tmp_path
):
    import ray

    cluster, nodes = two_slice_cluster
    job = job_on_two_slices()
    # The fake hosts have no TPU: their JAX runs on CPU.
    running = RunningJob(job, fresh_run(phases, tmp_path / "run"), jax_platforms="cpu")
    world = {
        (index, host): running.call(
            f"rollout-{index}" + (f"-host-{host}" if host else ""), "world_info", "a host's world"
        )
        for index in range(2)
        for host in range(HOSTS)
    }
    slice_of = {index: world[index, 0]["node_slice_name"] for index in range(2)}
    assert sorted(slice_of.values()) == sorted(SLICES)  # one whole slice per worker group
    for (index, host), info in world.items():
        assert info["node_id"] == nodes[slice_of[index], host].node_id
        assert info["process_id"] == host and info["process_count"] == HOSTS
        assert info["endpoint"] == (host == 0)
    # The driver logs a group's line after the group's actors answer: wait for it.
    placed = f"== rollout-1 on TPU slice {slice_of[1]!r} (pod type {POD_TYPE}): 2 host(s)"
    wait_for(lambda: placed in running.lines, "the driver's rollout-1 placement line", running)
    endpoint = world[1, 0]["pid"]
    running.wait_status(lambda s: s["step"] >= 2, "step 2 to train")
    # Freeze rollout-1's worker once it holds a shard, then take its slice's host 1 away.
    deadline = time.monotonic() + WAIT_S
    while True:
        signal_pid(endpoint, signal.SIGSTOP)
        if "rollout-1" in running.status()["assigned"]:
            break
        signal_pid(endpoint, signal.SIGCONT)
        assert time.monotonic() < deadline, "timed out waiting for rollout-1 to hold a shard"
        time.sleep(0.05)
    cluster.remove_node(nodes[slice_of[1], 1])
    gone = "== rollout worker 1 is gone (host 1 of TPU slice"
    wait_for(lambda: any(line.startswith(gone) for line in running.lines), "the drop", running)
    # The worker goes on (with a broken world) until the driver's kill reaches it.
    signal_pid(endpoint, signal.SIGCONT)

    def released() -> bool:
        try:
            ray.get_actor(actor_name(running.run, "rollout-1"))
        except ValueError:  # its name is free: the actor is dead
            return set(slice_reservations("rollout-1")) == {"REMOVED"}
        return False

    wait_for(released, "rollout-1's actors and slice to be released", running)
    # Still running: what was freed was freed by the drop, not by the job's end.
    assert running.thread.is_alive()
    assert set(slice_reservations("rollout-0")) == {"CREATED"}

    result, error = running.finish()
    assert error is None, error
    assert len(result.lost) == 1, result.lost
    assert result.lost[0].startswith(
        f"rollout worker 1: host 1 of TPU slice {slice_of[1]!r} (pod type {POD_TYPE}) died: "
    ), result.lost
    status = result.status
    assert status["step"] == STEPS and status["error"] == ""
    assert status["released_shards"] >= 1  # its shard was handed out again at once
    assert status["reassigned_shards"] == 0  # none waited for reassign_after_s
    assert status["accepted_rows"] == STEPS * rows_per_step(job)  # none accepted twice
    assert ledger(running.run) == [[0, STEPS * BATCH]]


class Holder:
    """What the driver watches on a slice's other hosts: ``hold`` returns only when told."""

    def __init__(self):
        import threading

        self.released = threading.Event()

    def hold(self) -> None:
        self.released.wait()


@pytest.mark.slow
def test_a_slice_worker_failing_in_its_broken_world_is_lost_as_the_host_that_died(
    two_slice_cluster,
):
    # The endpoint's own failure may reach the driver before its dead host's does: the
    # driver then looks for that host among the slice's watched holds (_dead_host).
    import ray

    from services.jobs.driver import _dead_host

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    hosts = [ray.remote(num_cpus=0, max_concurrency=2)(Holder).remote() for _ in range(2)]
    ray.get([host.__ray_ready__.remote() for host in hosts], timeout=WAIT_S)
    pending = {
        host.hold.remote(): f"rollout worker 1 host {index}"
        for index, host in enumerate(hosts, start=1)
    }
    assert _dead_host("rollout worker 0", pending) is None  # no slice: nothing to wait for
    assert _dead_host("rollout worker 1", pending, wait_s=1.0) is None  # both hosts alive
    ray.kill(hosts[1])
    name, error = _dead_host("rollout worker 1", pending)
    assert name == "rollout worker 1 host 2"
    assert isinstance(error, ray.exceptions.RayActorError)
    assert list(pending.values()) == ["rollout worker 1 host 1"]  # the dead one taken out
    ray.kill(hosts[0])
