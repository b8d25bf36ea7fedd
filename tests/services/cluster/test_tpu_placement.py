"""TPU-slice placement without a TPU.

Fast tests: :class:`SliceRequest` derivations (the pod-type naming trap: v4/v5p count
cores, v5e/v6e count chips), refused inputs, agreement with the pinned Ray's own TPU
tables, and the ``jax.distributed`` keywords a host actor reads from its environment.

Slow tests: a fake multi-node Ray cluster (``ray.cluster_utils.Cluster``: a CPU head plus,
for two v6e-16 slices ``slice-a`` and ``slice-b``, four worker nodes each) whose nodes
advertise what Ray gives real TPU hosts: ``TPU: 4``, the slice-name resource,
``TPU-v6e-16-head`` on worker 0 only, ``accelerator_type:TPU-V6E``, and the
``ray.io/tpu-slice-name`` / ``ray.io/tpu-worker-id`` / ``ray.io/tpu-pod-type`` labels. Each
node is also started with the GKE variables (``TPU_NAME``, ``TPU_WORKER_ID``, ...) so Ray's
own TPU detection agrees with those resources instead of asking the GCE metadata server,
and its worker processes see them as on GKE. On it: single roles placed by ``place_slice``
and the driver's ``place_role``, and a whole tiny job (``run_job``) with its teacher on one
slice and its learner on the other, each a 4-process ``jax.distributed`` world on the CPU
backend whose host 0 runs the role and checkpoints alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from distill.config import ConfigError, load_config
from services.cluster.tpu import (
    ENV_COORDINATOR_ADDRESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    SliceRequest,
    SliceTimeoutError,
    jax_distributed_kwargs,
    place_slice,
)
from services.common.config import JobSpec
from tests.support.fakes import TINY_MODELS, TINY_PHASES
from tests.support.network import free_port
from tests.support.running_job import RunningJob

# --- SliceRequest -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accelerator", "topology", "pod_type", "chips", "hosts", "chips_per_host"),
    [
        ("v4", "2x2x1", "v4-8", 4, 1, 4),
        ("v4", "2x2x2", "v4-16", 8, 2, 4),  # the trap: 8 chips, named by its 16 cores
        ("v4", "4x4x4", "v4-128", 64, 16, 4),
        ("v5p", "2x2x4", "v5p-32", 16, 4, 4),
        ("v6e", "1x1", "v6e-1", 1, 1, 1),
        ("v6e", "2x2", "v6e-4", 4, 1, 4),
        ("v6e", "2x4", "v6e-8", 8, 1, 8),
        ("v6e", "4x4", "v6e-16", 16, 4, 4),  # named by its 16 chips
        ("v6e", "16x16", "v6e-256", 256, 64, 4),
        ("v5e", "2x4", "v5litepod-8", 8, 1, 8),  # single host with all 8 chips
        ("v5e", "4x4", "v5litepod-16", 16, 4, 4),
    ],
)
def test_a_request_derives_its_pod_type_and_hosts(
    accelerator, topology, pod_type, chips, hosts, chips_per_host
):
    request = SliceRequest(accelerator_type=accelerator, topology=topology)
    assert request.pod_type == pod_type
    assert request.chips == chips
    assert request.hosts == hosts
    assert request.chips_per_host == chips_per_host
    assert request.head_resource == f"TPU-{pod_type}-head"


def test_spellings_of_the_accelerator_type_are_normalised():
    for spelling in ("V6E", " tpu-v6e ", "TPU-V6E"):
        assert SliceRequest(accelerator_type=spelling, topology="4X4").accelerator_type == "v6e"
    assert SliceRequest(accelerator_type="v5litepod", topology="2x4").accelerator_type == "v5e"
    assert SliceRequest(accelerator_type="v6e", topology=" 4X4 ").topology == "4x4"


@pytest.mark.parametrize(
    ("data", "field", "received"),
    [
        ({"accelerator_type": "v3", "topology": "4x4"}, "accelerator_type", "'v3'"),
        ({"accelerator_type": "gpu", "topology": "4x4"}, "accelerator_type", "'gpu'"),
        ({"accelerator_type": 6, "topology": "4x4"}, "accelerator_type", "6"),
        ({"accelerator_type": "v6e", "topology": "3x3"}, "topology", "'3x3'"),
        ({"accelerator_type": "v6e", "topology": "2x2x2"}, "topology", "'2x2x2'"),
        ({"accelerator_type": "v4", "topology": "4x4"}, "topology", "'4x4'"),
        ({"accelerator_type": "v4", "topology": "2x3x4"}, "topology", "'2x3x4'"),
        ({"accelerator_type": "v5p", "topology": "0x2x2"}, "topology", "'0x2x2'"),
        ({"accelerator_type": "v6e", "topology": "four"}, "topology", "'four'"),
        ({"accelerator_type": "v6e", "topology": 16}, "topology", "16"),
    ],
)
def test_refused_requests_name_the_field_and_the_value(data, field, received):
    with pytest.raises(ConfigError) as error:
        SliceRequest(**data)
    message = str(error.value)
    assert message.startswith(f"`{field}` must ")
    assert f"; received {received}" in message


def test_missing_and_unknown_fields_are_refused():
    with pytest.raises(ConfigError, match="`topology` must be given"):
        SliceRequest(accelerator_type="v6e")
    with pytest.raises(ConfigError, match="`hosts` is not a known field"):
        SliceRequest(accelerator_type="v6e", topology="4x4", hosts=4)


def test_derivations_agree_with_the_pinned_rays_tpu_tables():
    from ray._private.accelerators import tpu as ray_tpu

    checked = 0
    for ours, theirs in (("v4", "v4"), ("v5p", "v5p"), ("v5e", "v5litepod"), ("v6e", "v6e")):
        for topology in sorted(ray_tpu.VALID_TPU_TOPOLOGY[theirs]):
            request = SliceRequest(accelerator_type=ours, topology=topology)
            assert request.pod_type == ray_tpu.infer_tpu_pod_type_from_topology(
                topology, f"TPU-{theirs.upper()}"
            ), topology
            assert request.chips_per_host == ray_tpu.get_chips_per_host(topology, theirs)
            assert request.chips == ray_tpu.get_num_chips_from_topology(topology)
            checked += 1
    assert checked > 50


def test_jax_distributed_kwargs_come_from_the_actors_environment():
    environ = {
        ENV_COORDINATOR_ADDRESS: "10.0.0.2:8476",
        ENV_NUM_PROCESSES: "4",
        ENV_PROCESS_ID: "3",
    }
    assert jax_distributed_kwargs(environ) == {
        "coordinator_address": "10.0.0.2:8476",
        "num_processes": 4,
        "process_id": 3,
    }
    with pytest.raises(RuntimeError, match="not started by place_slice"):
        jax_distributed_kwargs({})


def test_importing_the_module_imports_neither_ray_nor_jax():
    import subprocess

    code = (
        "import sys; import services.cluster.tpu; "
        "print(sorted(m for m in ('ray', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- a fake multi-node cluster with two v6e-16 slices ------------------------------------

SLICES = ("slice-a", "slice-b")
HOSTS_PER_SLICE = 4
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 75 * 1024 * 1024}
V6E_4X4 = SliceRequest(accelerator_type="v6e", topology="4x4")


class HostProbe:
    """A stand-in for a per-host JAX actor: reports where it runs and who it is."""

    def __init__(self, role: str):
        self.role = role

    def report(self) -> dict:
        import ray

        from services.cluster.tpu import jax_distributed_kwargs

        context = ray.get_runtime_context()
        labels = context.get_node_labels()
        return {
            "role": self.role,
            "node_id": context.get_node_id(),
            "slice": labels.get("ray.io/tpu-slice-name"),
            "worker_id": labels.get("ray.io/tpu-worker-id"),
            "tpu_worker_id_env": os.environ.get("TPU_WORKER_ID"),
            "tpu_chips": context.get_accelerator_ids()["TPU"],
            "jax_platforms": os.environ.get("JAX_PLATFORMS"),
            "jax": jax_distributed_kwargs(),
        }


@pytest.fixture(scope="module")
def fake_tpu_cluster():
    import ray
    from ray.cluster_utils import Cluster

    root = tempfile.mkdtemp(prefix="rtpu", dir="/tmp")
    temp_dir = os.path.join(root, "ray")
    os.mkdir(temp_dir)
    patch = pytest.MonkeyPatch()
    # Ray's default temp dir, where Cluster writes its "current cluster" address file, too:
    # nothing of this cluster lands in the shared /tmp/ray.
    patch.setenv("RAY_TMPDIR", root)
    cluster = None
    try:
        # Cluster(initialize_head=True, head_node_args=...) in two steps, so that a head
        # that fails half-way is still shut down below.
        cluster = Cluster()
        cluster.add_node(
            **NODE_ARGS,
            temp_dir=temp_dir,
            include_dashboard=False,
            dashboard_agent_listen_port=None,  # any free port: other Rays may run here
        )
        nodes: dict[tuple[str, int], str] = {}
        for slice_name in SLICES:
            for worker in range(HOSTS_PER_SLICE):
                resources = {"TPU": 4, slice_name: 1, "accelerator_type:TPU-V6E": 1}
                if worker == 0:
                    resources["TPU-v6e-16-head"] = 1
                labels = {
                    "ray.io/tpu-slice-name": slice_name,
                    "ray.io/tpu-worker-id": str(worker),
                    "ray.io/tpu-pod-type": "v6e-16",
                }
                gke = {
                    "TPU_NAME": slice_name,
                    "TPU_WORKER_ID": str(worker),
                    "TPU_ACCELERATOR_TYPE": "v6e-16",
                    "TPU_TOPOLOGY": "4x4",
                }
                with pytest.MonkeyPatch.context() as node_env:
                    for name, value in gke.items():
                        node_env.setenv(name, value)
                    node = cluster.add_node(
                        wait=False,
                        temp_dir=temp_dir,
                        resources=resources,
                        labels=labels,
                        **NODE_ARGS,
                    )
                nodes[slice_name, worker] = node.node_id
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        # The probe class travels by value: workers cannot import the tests package.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        yield nodes
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        patch.undo()
        shutil.rmtree(root, ignore_errors=True)


def _reports(group) -> list[dict]:
    import ray

    return ray.get([actor.report.remote() for actor in group.actors], timeout=60)


def _assert_one_whole_slice(group, reports, nodes, role):
    assert group.slice_name in SLICES
    assert len(group.actors) == HOSTS_PER_SLICE
    expected_nodes = [nodes[group.slice_name, worker] for worker in range(HOSTS_PER_SLICE)]
    # Exactly the four hosts of one slice, one actor each, in process-id order.
    assert [report["node_id"] for report in reports] == expected_nodes
    assert group.node_ids == expected_nodes
    coordinator = group.coordinator_address
    assert coordinator.endswith(":8476")
    for process_id, report in enumerate(reports):
        assert report["role"] == role
        assert report["slice"] == group.slice_name
        assert report["worker_id"] == report["tpu_worker_id_env"] == str(process_id)
        assert len(report["tpu_chips"]) == 4  # the whole host
        assert report["jax_platforms"] == "tpu"  # whatever the driver runs with
        assert report["jax"] == {
            "coordinator_address": coordinator,
            "num_processes": HOSTS_PER_SLICE,
            "process_id": process_id,
        }
    assert [member.process_id for member in group.members] == list(range(HOSTS_PER_SLICE))


@pytest.mark.slow
def test_a_role_gets_the_four_hosts_of_one_slice(fake_tpu_cluster):
    assert os.environ["JAX_PLATFORMS"] == "cpu"  # the driver; its host actors get "tpu"
    group = place_slice(HostProbe, V6E_4X4, role="teacher", args=("teacher",), timeout_s=120)
    try:
        _assert_one_whole_slice(group, _reports(group), fake_tpu_cluster, "teacher")
    finally:
        group.release()


@pytest.mark.slow
def test_two_roles_get_two_slices_and_a_third_fails_naming_what_it_asked_for(fake_tpu_cluster):
    groups = []
    try:
        for role in ("teacher", "student"):
            group = place_slice(HostProbe, V6E_4X4, role=role, args=(role,), timeout_s=120)
            groups.append(group)
            _assert_one_whole_slice(group, _reports(group), fake_tpu_cluster, role)
        assert {group.slice_name for group in groups} == set(SLICES)

        started = time.monotonic()
        with pytest.raises(SliceTimeoutError) as error:
            place_slice(HostProbe, V6E_4X4, role="learner", args=("learner",), timeout_s=3)
        waited = time.monotonic() - started
        assert 3 <= waited < 30
        message = str(error.value)
        for part in ("'learner'", "v6e", "4x4", "v6e-16", "TPU-v6e-16-head", "held"):
            assert part in message, message

        # Releasing a role's slice frees it for the next one.
        freed = groups.pop(0)
        freed.release()
        again = place_slice(HostProbe, V6E_4X4, role="learner", args=("learner",), timeout_s=120)
        groups.append(again)
        assert again.slice_name == freed.slice_name
        _assert_one_whole_slice(again, _reports(again), fake_tpu_cluster, "learner")
    finally:
        for group in groups:
            group.release()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("accelerator", "topology", "pod_type"), [("v6e", "8x8", "v6e-64"), ("v4", "2x2x2", "v4-16")]
)
def test_a_slice_that_does_not_exist_fails_after_a_bounded_wait(
    fake_tpu_cluster, accelerator, topology, pod_type
):
    import ray

    request = SliceRequest(accelerator_type=accelerator, topology=topology)
    started = time.monotonic()
    with pytest.raises(SliceTimeoutError) as error:
        place_slice(HostProbe, request, role="teacher", args=("teacher",), timeout_s=2)
    assert 2 <= time.monotonic() - started < 20
    message = str(error.value)
    for part in (accelerator, topology, pod_type, "no node in the cluster advertises it"):
        assert part in message, message
    # Nothing stays reserved: both slices' heads are free again.
    deadline = time.monotonic() + 10
    while ray.available_resources().get("TPU-v6e-16-head", 0) < 2:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


# --- the job's roles on slices (cluster.<role>.slice) ------------------------------------

ROOT = Path(__file__).resolve().parents[3]


def _job(cluster: dict) -> JobSpec:
    """The tiny job with ``cluster``: its YAML, as a user writes it."""
    job = load_config(ROOT / "deploy/configs/tiny.yaml", JobSpec)
    return JobSpec(**{**job.model_dump(mode="json"), "cluster": cluster})


def test_a_role_slice_is_validated_with_the_role():
    job = _job({"rollout": {"count": 2, "slice": {"accelerator_type": "V6E", "topology": "4x4"}}})
    assert job.cluster.rollout.slice.pod_type == "v6e-16"
    assert job.cluster.rollout.slice.coordinator_port == 8476
    assert job.cluster.rollout.restarts("rollout") == 0  # a world does not survive a restart
    assert job.cluster.teacher.slice is None and job.cluster.teacher.restarts("teacher") == 3
    v6e = {"accelerator_type": "v6e", "topology": "4x4"}
    for role, message in (
        (
            {"slice": {"accelerator_type": "v6e", "topology": "3x3"}},
            "`cluster.rollout.slice.topology`",
        ),
        ({"slice": {"accelerator_type": "v3", "topology": "4x4"}}, "`cluster.rollout.slice.accel"),
        ({"slice": v6e, "resources": {"TPU": 4}}, "`cluster.rollout.resources` must be empty"),
        ({"slice": v6e, "num_gpus": 1}, "`cluster.rollout.num_gpus` must be 0"),
        ({"slice": v6e, "max_restarts": 2}, "`cluster.rollout.max_restarts` must be 0 or null"),
        ({"slice": {**v6e, "coordinator_port": 0}}, "`cluster.rollout.slice.coordinator_port`"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            _job({"rollout": role})
    # The teacher and the learner take single-host and multi-host slices alike (on a
    # multi-host one host 0 runs the role and checkpoints alone; the other hosts hold).
    assert _job({"learner": {"slice": {**v6e, "topology": "2x4"}}}).cluster.learner.slice.hosts == 1
    for role in ("teacher", "learner"):
        config = getattr(_job({role: {"slice": v6e}}).cluster, role)
        assert config.slice.hosts == 4 and config.restarts(role) == 0


def _world(placed) -> list[dict]:
    import ray

    hosts = [placed.endpoint, *placed.hosts]
    return ray.get([host.world_info.remote() for host in hosts], timeout=120)


@pytest.mark.slow
def test_two_student_slices_each_get_one_whole_slice_as_one_jax_world(fake_tpu_cluster, tmp_path):
    import ray

    from services.jobs.driver import _holds, place_role

    job = _job(
        {
            "start_timeout_s": 180,
            "rollout": {"count": 2, "slice": {"accelerator_type": "v6e", "topology": "4x4"}},
        }
    )
    payload = job.model_dump(mode="json")
    placed = []
    try:
        for index in range(job.cluster.rollout.count):
            # As run_job places them, with the hosts' JAX on CPU (the fake hosts have no
            # TPU) and, since both fake slices share this machine, a coordinator port each.
            request = job.cluster.rollout.slice.model_copy(update={"coordinator_port": free_port()})
            config = job.cluster.rollout.model_copy(update={"slice": request})
            placed.append(
                place_role(
                    "rollout",
                    config,
                    f"rollout-{index}",
                    tmp_path,
                    (payload,),
                    {
                        "worker_id": f"rollout-{index}",
                        "learner_address": "127.0.0.1:1",
                        "learner": None,
                    },
                    max_concurrency=2,
                    start_timeout_s=job.cluster.start_timeout_s,
                    jax_platforms="cpu",
                )
            )
            world = _world(placed[-1])
            slice_name = placed[-1].group.slice_name
            # Exactly the four hosts of one slice, one process each, in worker-id order.
            assert [host["node_id"] for host in world] == [
                fake_tpu_cluster[slice_name, worker] for worker in range(HOSTS_PER_SLICE)
            ]
            coordinator = world[0]["coordinator_address"]
            assert coordinator.endswith(f":{request.coordinator_port}")
            for process_id, host in enumerate(world):
                assert host["role"] == f"rollout-{index}"
                assert host["node_slice_name"] == slice_name
                assert host["node_worker_id"] == host["tpu_worker_id_env"] == str(process_id)
                # One jax.distributed world per slice: JAX itself agrees on who is who.
                assert host["process_id"] == host["process_index"] == process_id
                assert host["num_processes"] == host["process_count"] == HOSTS_PER_SLICE
                assert host["coordinator_address"] == coordinator
                assert host["jax_platforms"] == "cpu" and host["platform"] == "cpu"
                assert host["endpoint"] == (process_id == 0)
        # Two student slices, two different slices.
        assert sorted(group.group.slice_name for group in placed) == sorted(SLICES)
        # Host 0 is the rollout worker (stop() uses the state only it built).
        ray.get([group.endpoint.stop.remote() for group in placed], timeout=60)

        # The driver watches the other hosts: one that dies is named.
        watched = _holds(placed[1], "rollout worker 1")
        assert sorted(watched.values()) == [f"rollout worker 1 host {i}" for i in (1, 2, 3)]
        ray.kill(placed[1].hosts[1])  # host 2
        ready, _ = ray.wait(list(watched), num_returns=1, timeout=60)
        assert [watched[reference] for reference in ready] == ["rollout worker 1 host 2"]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(ready[0], timeout=10)
    finally:
        for group in placed:
            group.release()


@pytest.mark.slow
def test_a_job_role_asking_for_a_missing_slice_fails_naming_it(fake_tpu_cluster, tmp_path):
    from services.jobs.driver import JobFailed, place_role

    job = _job(
        {
            "start_timeout_s": 3,
            "rollout": {"count": 1, "slice": {"accelerator_type": "v6e", "topology": "8x8"}},
        }
    )
    started = time.monotonic()
    with pytest.raises(JobFailed) as error:
        place_role(
            "rollout",
            job.cluster.rollout,
            "rollout-0",
            tmp_path,
            (job.model_dump(mode="json"),),
            {"worker_id": "rollout-0", "learner_address": "127.0.0.1:1", "learner": None},
            max_concurrency=2,
            start_timeout_s=job.cluster.start_timeout_s,
            jax_platforms="cpu",
        )
    assert 3 <= time.monotonic() - started < 30
    message = str(error.value)
    for part in ("rollout-0", "v6e", "8x8", "v6e-64", "no node in the cluster advertises it"):
        assert part in message, message


# --- a whole job with its teacher and its learner on four-host slices --------------------

STEPS = 2
BATCH = 4
WAIT_S = 300.0


def _job_on_four_host_slices() -> JobSpec:
    """The tiny job (tiny models, two-step phases, two OPD steps, a checkpoint after each)
    with its teacher replica on one v6e 4x4 slice and its learner on the other (each world's
    coordinator on its own port: both slices share this machine) and one rollout worker,
    off slices, on the CPU head."""
    job = load_config(
        ROOT / "deploy/configs/tiny.yaml",
        JobSpec,
        [
            *TINY_MODELS,
            *TINY_PHASES,
            f"data.batch_size={BATCH}",
            f"opd.steps={STEPS}",
            "opd.checkpoint_every=1",
        ],
    )
    teacher_port = free_port()
    learner_port = free_port()
    while learner_port == teacher_port:
        learner_port = free_port()
    v6e = {"accelerator_type": "v6e", "topology": "4x4"}
    cluster = {
        "start_timeout_s": WAIT_S,
        "step_timeout_s": WAIT_S,
        "teacher": {"count": 1, "slice": {**v6e, "coordinator_port": teacher_port}},
        "learner": {"slice": {**v6e, "coordinator_port": learner_port}},
        "rollout": {"count": 1},
    }
    return JobSpec(**{**job.model_dump(mode="json"), "cluster": cluster})


def _slice_world(running: RunningJob, label: str) -> list[dict]:
    """``world_info`` of the host actors of the job's ``label`` (``teacher-0``, ``learner``),
    in host order (host i > 0 is named ``<label>-host-<i>``)."""
    names = [label, *(f"{label}-host-{host}" for host in range(1, HOSTS_PER_SLICE))]
    return [running.call(name, "world_info", f"{name}'s world") for name in names]


def _checkpoints(run: Path) -> dict[int, dict]:
    """The OPD checkpoints' progress records by step."""
    root = run / "opd" / "checkpoints"
    return {
        int(step.name): json.loads((step / "progress" / "metadata").read_text())
        for step in root.iterdir()
        if step.name.isdigit()
    }


@pytest.mark.slow
def test_a_job_with_its_teacher_and_learner_on_four_host_slices_trains_and_checkpoints(
    fake_tpu_cluster, tmp_path
):
    job = _job_on_four_host_slices()
    run = tmp_path / "run"
    # The fake hosts have no TPU: their JAX runs on CPU.
    running = RunningJob(job, run, jax_platforms="cpu")
    worlds = {label: _slice_world(running, label) for label in ("teacher-0", "learner")}
    result, error = running.finish()
    assert error is None, error

    for label, world in worlds.items():
        slice_name = world[0]["node_slice_name"]
        # The four hosts of one slice, one 4-process jax.distributed world, in worker order:
        # JAX's process index of each host actor is its host's TPU worker id.
        assert [host["node_id"] for host in world] == [
            fake_tpu_cluster[slice_name, worker] for worker in range(HOSTS_PER_SLICE)
        ], label
        for process_id, host in enumerate(world):
            assert host["node_slice_name"] == slice_name, label
            assert host["process_id"] == host["process_index"] == process_id, label
            assert host["node_worker_id"] == host["tpu_worker_id_env"] == str(process_id)
            assert host["num_processes"] == host["process_count"] == HOSTS_PER_SLICE
            assert host["endpoint"] == (process_id == 0)
            assert host["platform"] == "cpu"
    assert {world[0]["node_slice_name"] for world in worlds.values()} == set(SLICES)

    # Host 0 trained to the end and wrote every checkpoint alone (the other processes of
    # its world only held), each with the data ledger: every sample trained once.
    rows = job.data.batch_size * job.loss.group_size
    assert result.status["step"] == STEPS and result.status["error"] == ""
    assert result.status["accepted_rows"] == STEPS * rows
    saved = _checkpoints(run)
    assert sorted(saved) == list(range(1, STEPS + 1))
    assert saved[STEPS]["ledger"] == [[0, STEPS * BATCH]]
    contract = json.loads((run / "opd" / "contract.json").read_text())
    assert contract["topology"]["process_count"] == HOSTS_PER_SLICE  # opened in the world
    shards = {path.name for path in (run / "opd" / "checkpoints").glob("*/state/ocdbt.*")}
    assert shards == {"ocdbt.process_0"}  # Orbax's per-process shard files: process 0's only
