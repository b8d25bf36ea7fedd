"""Where a job's actors go: Ray actor options from the job's ``cluster:`` roles, and the
embedded local Ray a job starts when it is given no cluster address.

The embedded Ray binds loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, node address
127.0.0.1, no dashboard), keeps usage stats off, and announces as many logical CPUs as the
job's actors ask for (a laptop oversubscribes its cores rather than refusing to place).
On a TPU cluster a role's ``resources`` names the slice resource (e.g.
``{"TPU-v5e-8-head": 1}``) so each actor lands on its own slice host; a role with
``slice`` set is placed on whole slices by :mod:`services.cluster.tpu` instead (the driver's
``place_role``), and these options then only carry its ``runtime_env``, ``max_concurrency``
and ``max_restarts``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from distill.allocator import GLIBC_TUNABLES, training_environment
from services.common.config import ClusterConfig, RoleConfig

RAY_ENVIRONMENT = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def actor_options(
    role: RoleConfig,
    *,
    max_concurrency: int = 1,
    max_restarts: int = 0,
    name: str | None = None,
) -> dict[str, Any]:
    """``ray.remote(...).options(...)`` keywords for one actor of ``role``.
    ``max_restarts``: Ray restarts the actor that often after its process dies, and a call
    in progress then (a worker's ``run``, a replica's ``serve``) is made again on the new
    process; past that, the call fails with the actor's death. ``name``: the actor's name
    in Ray (``ray list actors``; ``ray.get_actor`` from the job's driver)."""
    options: dict[str, Any] = {
        "num_cpus": role.num_cpus,
        "num_gpus": role.num_gpus,
        "max_concurrency": max_concurrency,
        "max_restarts": max_restarts,
        "max_task_retries": -1 if max_restarts else 0,
    }
    if name is not None:
        options["name"] = name
    if role.resources:
        options["resources"] = dict(role.resources)
    env = process_environment()
    if role.cpu_threads is not None:
        # A dedicated process whose XLA CPU backend uses that many threads (set before JAX
        # is imported there).
        env["DISTILL_CPU_THREADS"] = str(role.cpu_threads)
    if role.cpu_affinity is not None:
        env["DISTILL_CPU_AFFINITY"] = ",".join(str(core) for core in role.cpu_affinity)
    options["runtime_env"] = {"env_vars": env}
    return options


def process_environment() -> dict[str, str]:
    """Environment variables of every process a job starts on Ray (its actors, the task that
    trains the teacher and warms up the student): :data:`RAY_ENVIRONMENT` and the glibc
    settings of :mod:`distill.allocator` (read once, at the process's start; a value the
    driver's environment sets for a tunable wins)."""
    env = dict(RAY_ENVIRONMENT)
    env[GLIBC_TUNABLES] = training_environment(os.environ)[GLIBC_TUNABLES]
    return env


def logical_cpus(cluster: ClusterConfig) -> float:
    """CPUs the job's actors ask for in all (plus one for phase-training tasks)."""
    roles = (cluster.teacher, cluster.rollout, cluster.learner)
    return sum(role.count * role.num_cpus for role in roles) + 1


#: Attempts at starting an embedded Ray whose raylet timed out registering (Ray's message).
EMBEDDED_START_ATTEMPTS = 2
STARTUP_TIMEOUT = "timed out during startup"
#: How long an embedded start waits for its GCS to bind (Ray's setting; its default is 30 s).
GCS_PORT_WAIT_VARIABLE = "RAY_gcs_server_port_wait_time_s"
EMBEDDED_GCS_PORT_WAIT_S = 120


def start_ray(address: str | None, cluster: ClusterConfig, temp_dir: str | Path | None) -> bool:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start an embedded local
    Ray on loopback; returns whether this call started one (then the caller shuts it down).
    Every process that starts or joins Ray gets :data:`RAY_ENVIRONMENT`."""
    import ray

    for name, value in RAY_ENVIRONMENT.items():
        os.environ[name] = value
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        ray.init(address=address, logging_level="warning", log_to_driver=True)
        return False
    # Ray waits 30 s for a new GCS to write its port; on a loaded machine (CI's two cores
    # under a parallel test session) that passed and failed the start. An operator's own
    # setting is kept.
    os.environ.setdefault(GCS_PORT_WAIT_VARIABLE, str(EMBEDDED_GCS_PORT_WAIT_S))
    kwargs: dict[str, Any] = {}
    if temp_dir is not None:
        Path(temp_dir).mkdir(parents=True, exist_ok=True)
        kwargs["_temp_dir"] = str(Path(temp_dir).absolute())

    def start() -> bool:
        ray.init(
            # "local": a new embedded instance. Without it ray.init() joins the cluster last
            # started with `ray start` on this machine (/tmp/ray/ray_current_cluster), even one
            # stopped since, which took down a test process that ran after a Jobs API test.
            address="local",
            num_cpus=max(int(logical_cpus(cluster) + 0.999), os.cpu_count() or 1),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level="warning",
            log_to_driver=True,
            **kwargs,
        )
        return True

    for _ in range(EMBEDDED_START_ATTEMPTS - 1):
        before = _descendants()
        try:
            return start()
        except Exception as error:
            # Ray gives a new raylet a fixed 30 s to register with its GCS; on an overloaded
            # machine that can pass. The failed attempt's processes are not Ray's to clean up
            # any more (ray.shutdown does not know them), so they are stopped here first.
            if STARTUP_TIMEOUT not in str(error):
                raise
            _stop(_descendants() - before)
            ray.shutdown()
    return start()


def _descendants() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _stop(pids: set[int], wait_s: float = 10.0) -> None:
    """SIGTERM ``pids``, then SIGKILL what is left after ``wait_s``."""
    import psutil

    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            process.terminate()
            processes.append(process)
    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
