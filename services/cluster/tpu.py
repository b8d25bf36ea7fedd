"""TPU-slice placement: one role, one whole slice, one long-lived JAX process per host.

On TPU every role of a job (the teacher, each student rollout slice, the learner) is its
own ``jax.distributed`` world on its own slice: a multi-host slice is usable only as a
whole, and each of its hosts runs exactly one JAX process that owns all the host's chips.
:func:`place_slice` does that with the head-resource pattern of Ray's TPU support:

1. **Reserve a slice.** Worker 0 of every slice advertises ``TPU-<pod type>-head: 1`` (Ray
   adds it on TPU VMs and GKE TPU pods). A placement group holding that one unit claims the
   slice for as long as the :class:`SliceGroup` lives, so two roles asking for the same pod
   type get two different slices, and a third waits (then fails, naming what it looked for).
2. **Find its hosts.** The head's node carries ``ray.io/tpu-slice-name``; the slice's hosts
   are the alive nodes with that label, each with its ``ray.io/tpu-worker-id``
   (``ray.util.tpu`` reads both).
3. **One actor per host.** A ``STRICT_SPREAD`` placement group with one bundle per host,
   bundle *i* pinned by label selector to the host whose worker id is *i*, asks for the
   host's ``TPU`` chips (and ``num_cpus``); actor *i* runs in bundle *i*.
4. **Its JAX identity.** Actor *i* gets ``process_id = i`` (the host's ``TPU_WORKER_ID``),
   ``num_processes = hosts`` and ``coordinator_address = <worker 0's IP>:<port>`` as
   environment variables; inside the actor :func:`jax_distributed_kwargs` turns them into
   the keywords of ``jax.distributed.initialize`` and :func:`join_world` joins the world.

Ray's own ``ray.util.tpu.SlicePlacementGroup`` reserves a slice the same way, but learns the
slice name by running a task on worker 0 that reads ``TPU_NAME`` (or the GCE metadata
server) and does not tie bundle *i* to worker id *i*; reading the node labels needs no
extra process and gives each host its process id directly.

The driver never touches a TPU: it runs with ``JAX_PLATFORMS=cpu`` and only places actors.
Worlds never share a mesh: weights go from one role to another through the Ray object
store or the network (gRPC), never by ``jax.device_put`` across meshes.

Pod-type naming trap: v4 and v5p pod types count TensorCores (two per chip), v5e and v6e
count chips. A v4 ``2x2x2`` is 8 chips on 2 hosts and is called ``v4-16``; a v6e ``4x4`` is
16 chips on 4 hosts and is called ``v6e-16``. v5e pod types are spelled ``v5litepod-N``
(what GCE, GKE and Ray's resources and labels use). Hosts have 4 chips, except single-host
v5e/v6e slices (``1x1``, ``2x2``, ``2x4``), whose one host has all of them.

This module imports neither Ray nor JAX at import time.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from distill.config import ConfigModel

#: The labels Ray puts on TPU nodes (``ray._raylet.RAY_NODE_TPU_*_KEY``).
SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
NODE_ID_LABEL = "ray.io/node-id"

#: The port the coordinator (worker 0) of each world listens on; JAX's own default on TPU.
DEFAULT_COORDINATOR_PORT = 8476

#: Environment variables that carry a host actor's identity into its process.
ENV_COORDINATOR_ADDRESS = "DISTILL_JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "DISTILL_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "DISTILL_JAX_PROCESS_ID"
ENV_SLICE_NAME = "DISTILL_TPU_SLICE_NAME"
ENV_POD_TYPE = "DISTILL_TPU_POD_TYPE"
ENV_ROLE = "DISTILL_TPU_ROLE"

# Per generation: pod-type prefix, TensorCores per chip (what the pod type counts), and
# whether a slice of at most 8 chips is a single host with all of them.
_GENERATIONS: dict[str, tuple[str, int, bool]] = {
    "v4": ("v4", 2, False),
    "v5p": ("v5p", 2, False),
    "v5e": ("v5litepod", 1, True),
    "v6e": ("v6e", 1, True),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}
_CHIPS_PER_HOST = 4
_SINGLE_HOST_MAX_CHIPS = 8
# The 2-D slice shapes of v5e and v6e (the same list Ray's TPU support accepts).
_TOPOLOGIES_2D = ("1x1", "2x2", "2x4", "2x8", "4x4", "4x8", "8x8", "8x16", "16x16")
# The 3-D slice shapes of v4 and v5p smaller than one 4x4x4 cube; bigger ones are
# multiples of 4 on every axis.
_SMALL_TOPOLOGIES_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
_TOPOLOGY_SYNTAX = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def _must(field: str, requirement: str, received: object) -> ValueError:
    return ValueError(f"`{field}` must {requirement}; received {received!r}")


class SliceRequest(ConfigModel):
    """One whole TPU slice for a role: ``accelerator_type`` (``v4``, ``v5p``, ``v5e``,
    ``v6e``; case-insensitive, ``TPU-`` prefix and ``v5litepod`` accepted) and ``topology``
    (chips along each axis: ``AxB`` for v5e/v6e, ``AxBxC`` for v4/v5p).
    ``coordinator_port``: the port worker 0 of the role's ``jax.distributed`` world serves
    the coordination service on (JAX's TPU default, 8476; only roles whose slices share a
    machine, as in tests, need different ones).

    Derived: :attr:`chips`, :attr:`chips_per_host`, :attr:`hosts`, :attr:`pod_type`
    (the name in ``TPU-<pod type>-head``) and :attr:`head_resource`."""

    accelerator_type: str
    topology: str
    coordinator_port: int = Field(default=DEFAULT_COORDINATOR_PORT, ge=1, le=65535, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        accelerator = data.get("accelerator_type")
        if isinstance(accelerator, str):
            name = accelerator.strip().lower().removeprefix("tpu-")
            name = _ALIASES.get(name, name)
            if name not in _GENERATIONS:
                raise _must(
                    "accelerator_type", f"be one of {', '.join(sorted(_GENERATIONS))}", accelerator
                )
            data["accelerator_type"] = name
        elif accelerator is not None:
            raise _must("accelerator_type", "be a string such as 'v6e'", accelerator)
        topology = data.get("topology")
        if isinstance(topology, str):
            data["topology"] = topology.strip().lower()
            if isinstance(accelerator, str):
                _check_topology(data["accelerator_type"], data["topology"], topology)
        elif topology is not None:
            raise _must("topology", "be a string such as '4x4' or '2x2x2'", topology)
        return data

    @property
    def generation(self) -> str:
        """The generation as GCE, GKE and Ray spell it in pod types (``v5litepod`` for v5e)."""
        return _GENERATIONS[self.accelerator_type][0]

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.topology.split("x"))

    @property
    def chips(self) -> int:
        total = 1
        for dim in self.dims:
            total *= dim
        return total

    @property
    def cores_per_chip(self) -> int:
        """TensorCores per chip: what the pod type's number counts, per chip."""
        return _GENERATIONS[self.accelerator_type][1]

    @property
    def chips_per_host(self) -> int:
        single_host_capable = _GENERATIONS[self.accelerator_type][2]
        if single_host_capable and self.chips <= _SINGLE_HOST_MAX_CHIPS:
            return self.chips
        return min(self.chips, _CHIPS_PER_HOST)

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def pod_type(self) -> str:
        """``v6e-16`` for v6e 4x4, ``v4-16`` for v4 2x2x2 (cores), ``v5litepod-8`` for v5e 2x4."""
        return f"{self.generation}-{self.chips * self.cores_per_chip}"

    @property
    def head_resource(self) -> str:
        """The custom resource only worker 0 of such a slice advertises."""
        return f"TPU-{self.pod_type}-head"

    def describe(self) -> str:
        return f"{self.accelerator_type} {self.topology} (pod type {self.pod_type})"


def _check_topology(accelerator: str, topology: str, received: object) -> None:
    if not _TOPOLOGY_SYNTAX.match(topology):
        raise _must("topology", "be chips per axis such as '4x4' or '2x2x2'", received)
    dims = [int(part) for part in topology.split("x")]
    if accelerator in ("v5e", "v6e"):
        if topology not in _TOPOLOGIES_2D:
            raise _must(
                "topology", f"be one of {', '.join(_TOPOLOGIES_2D)} for {accelerator}", received
            )
        return
    if len(dims) != 3 or not (
        topology in _SMALL_TOPOLOGIES_3D or all(dim % _CHIPS_PER_HOST == 0 for dim in dims)
    ):
        raise _must(
            "topology",
            f"be AxBxC for {accelerator}: one of {', '.join(_SMALL_TOPOLOGIES_3D)}, or "
            "multiples of 4 on every axis (e.g. 4x4x8)",
            received,
        )


@dataclass(frozen=True)
class SliceMember:
    """Where one host actor runs and who it is in its role's ``jax.distributed`` world."""

    process_id: int
    num_processes: int
    coordinator_address: str
    slice_name: str
    pod_type: str
    role: str
    node_id: str
    node_ip: str

    def env(self) -> dict[str, str]:
        """The environment variables the actor's process starts with."""
        return {
            ENV_COORDINATOR_ADDRESS: self.coordinator_address,
            ENV_NUM_PROCESSES: str(self.num_processes),
            ENV_PROCESS_ID: str(self.process_id),
            ENV_SLICE_NAME: self.slice_name,
            ENV_POD_TYPE: self.pod_type,
            ENV_ROLE: self.role,
        }

    def jax_distributed_kwargs(self) -> dict[str, Any]:
        return {
            "coordinator_address": self.coordinator_address,
            "num_processes": self.num_processes,
            "process_id": self.process_id,
        }


def jax_distributed_kwargs(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Inside a host actor started by :func:`place_slice`: the keywords for
    ``jax.distributed.initialize(**jax_distributed_kwargs())`` (``coordinator_address``,
    ``num_processes``, ``process_id``), read from the actor's environment (or ``environ``).

    Call it (and ``initialize``) before anything else touches JAX in that process. The
    driver never calls it: it runs with ``JAX_PLATFORMS=cpu`` and is in no world."""
    environ = os.environ if environ is None else environ
    missing = [
        name
        for name in (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        if not environ.get(name)
    ]
    if missing:
        raise RuntimeError(
            f"this process was not started by place_slice: {', '.join(missing)} not set"
        )
    return {
        "coordinator_address": environ[ENV_COORDINATOR_ADDRESS],
        "num_processes": int(environ[ENV_NUM_PROCESSES]),
        "process_id": int(environ[ENV_PROCESS_ID]),
    }


def join_world(
    timeout_s: float = 300.0, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Inside a host actor started by :func:`place_slice`: join the role's
    ``jax.distributed`` world and bring its backend up; returns who this process is
    (``process_id``, ``num_processes``, ``coordinator_address``, ``slice_name``, ``role``,
    ``process_index`` / ``process_count`` as JAX sees them, ``local_devices``,
    ``global_devices``, ``platform``).

    Worker 0 binds the coordination service on its own address (never every interface);
    every host waits at most ``timeout_s`` for the others. Bringing the backend up
    (``jax.devices()``) is itself a step every process of the world must take, so each host
    takes it here, in its constructor, and :func:`place_slice` returns only once all have."""
    environ = os.environ if environ is None else environ
    kwargs = jax_distributed_kwargs(environ)
    import jax

    if kwargs["process_id"] == 0:
        kwargs["coordinator_bind_address"] = kwargs["coordinator_address"]
    jax.distributed.initialize(**kwargs, initialization_timeout=max(1, int(timeout_s)))
    devices = jax.devices()
    return {
        "process_id": kwargs["process_id"],
        "num_processes": kwargs["num_processes"],
        "coordinator_address": kwargs["coordinator_address"],
        "slice_name": environ.get(ENV_SLICE_NAME, ""),
        "role": environ.get(ENV_ROLE, ""),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": len(jax.local_devices()),
        "global_devices": len(devices),
        "platform": devices[0].platform,
    }


class SlicePlacementError(RuntimeError):
    """A slice was found but cannot host the role as asked (labels or shape do not match)."""


class SliceTimeoutError(SlicePlacementError, TimeoutError):
    """No slice of the requested kind was reserved and started within the timeout."""


class SliceGroup:
    """A role's slice while it holds it: :attr:`actors` (one per host, ordered by process
    id), :attr:`members` (their :class:`SliceMember`), :attr:`slice_name`. :meth:`release`
    (or leaving a ``with`` block) kills the actors and frees the slice."""

    def __init__(
        self,
        *,
        request: SliceRequest,
        role: str,
        slice_name: str,
        head_group: Any,
        host_group: Any,
        members: Sequence[SliceMember],
        actors: Sequence[Any],
    ):
        self.request = request
        self.role = role
        self.slice_name = slice_name
        self.members = list(members)
        self.actors = list(actors)
        self._head_group = head_group
        self._host_group = host_group

    @property
    def coordinator_address(self) -> str:
        return self.members[0].coordinator_address

    @property
    def node_ids(self) -> list[str]:
        return [member.node_id for member in self.members]

    def release(self) -> None:
        """Kill the host actors and remove both placement groups; idempotent."""
        actors, self.actors = self.actors, []
        groups = [group for group in (self._host_group, self._head_group) if group is not None]
        self._host_group = self._head_group = None
        _kill_and_remove(actors, groups)

    def __enter__(self) -> SliceGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"SliceGroup(role={self.role!r}, slice={self.slice_name!r}, "
            f"{self.request.describe()}, actors={len(self.actors)})"
        )


def _kill_and_remove(actors: Sequence[Any], groups: Sequence[Any]) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    # Best effort: an actor may be dead already, a group removed, the cluster gone.
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    for group in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(group)


def place_slice(
    actor_class: Any,
    request: SliceRequest,
    *,
    role: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 600.0,
    num_cpus: float = 1.0,
    coordinator_port: int | None = None,
    jax_platforms: str | None = "tpu",
    options: Mapping[str, Any] | None = None,
) -> SliceGroup:
    """Reserve one whole slice of ``request`` for ``role`` and start one ``actor_class``
    (a plain class or a ``ray.remote`` one) per host, constructed with ``*args, **kwargs``;
    see the module docstring. Each actor asks for the host's chips (``TPU``) and
    ``num_cpus``; ``options`` are further ``.options(...)`` keywords (e.g. ``max_concurrency``,
    ``runtime_env``: its ``env_vars`` are kept, the identity variables added; ``name``: host
    0's Ray name, the other hosts get ``<name>-host-<i>``).
    ``coordinator_port``: worker 0's coordination port (``None``: the request's).
    ``jax_platforms``: the actors' ``JAX_PLATFORMS`` (``tpu`` unless ``options`` set one;
    ``None``: leave it alone), so a ``JAX_PLATFORMS=cpu`` the driver or the job's runtime
    environment runs with never silently puts a slice's JAX on its CPUs.

    Returns once every actor's constructor has finished. Raises :class:`SliceTimeoutError`
    (naming the accelerator type, topology and pod type) when that does not happen within
    ``timeout_s``, and :class:`SlicePlacementError` when the reserved slice's hosts do not
    match the request; either way nothing stays reserved."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if coordinator_port is None:
        coordinator_port = request.coordinator_port
    if not 0 < coordinator_port < 65536:
        raise ValueError(f"`coordinator_port` must be in [1, 65535]; received {coordinator_port}")
    if not timeout_s > 0:
        raise ValueError(f"`timeout_s` must be > 0; received {timeout_s}")
    deadline = time.monotonic() + timeout_s
    tag = f"distill-{role}-{request.pod_type}-{uuid.uuid4().hex[:8]}"
    actors: list[Any] = []
    groups: list[Any] = []
    try:
        head_group = placement_group([{request.head_resource: 1}], name=f"{tag}-head")
        groups.append(head_group)
        if not _ready(head_group, deadline):
            raise SliceTimeoutError(_no_slice_message(request, role, timeout_s))
        head_node = placement_group_table(head_group)["bundles_to_node_id"][0]
        slice_name, selectors = _check_slice(request, role, head_node)

        bundle: dict[str, float] = {"TPU": float(request.chips_per_host)}
        if num_cpus:
            bundle["CPU"] = float(num_cpus)
        host_group = placement_group(
            [dict(bundle) for _ in range(request.hosts)],
            strategy="STRICT_SPREAD",
            name=f"{tag}-hosts",
            bundle_label_selector=selectors,
        )
        groups.append(host_group)
        if not _ready(host_group, deadline):
            raise SliceTimeoutError(
                f"role {role!r} reserved {request.describe()} slice {slice_name!r} but its "
                f"{request.hosts} hosts' chips ({request.chips_per_host} TPU each) were not "
                f"all free within {timeout_s:g}s"
            )
        placed = placement_group_table(host_group)["bundles_to_node_id"]
        nodes = {node["NodeID"]: node for node in ray.nodes()}
        hosts = [nodes[placed[worker]] for worker in range(request.hosts)]
        coordinator = f"{_host(hosts[0]['NodeManagerAddress'])}:{coordinator_port}"
        members = [
            SliceMember(
                process_id=worker,
                num_processes=request.hosts,
                coordinator_address=coordinator,
                slice_name=slice_name,
                pod_type=request.pod_type,
                role=role,
                node_id=node["NodeID"],
                node_ip=node["NodeManagerAddress"],
            )
            for worker, node in enumerate(hosts)
        ]
        remote_class = actor_class if hasattr(actor_class, "options") else ray.remote(actor_class)
        for worker, member in enumerate(members):
            actor_options = dict(options or {})
            name = actor_options.pop("name", None)
            if name is not None:
                # Host 0 is the role (it answers to the role's name); the others its hosts.
                actor_options["name"] = name if worker == 0 else f"{name}-host-{worker}"
            runtime_env = dict(actor_options.pop("runtime_env", None) or {})
            platforms = {} if jax_platforms is None else {"JAX_PLATFORMS": jax_platforms}
            runtime_env["env_vars"] = {
                **platforms,
                **(runtime_env.get("env_vars") or {}),
                **member.env(),
            }
            actor_options.update(
                num_cpus=num_cpus,
                resources={"TPU": float(request.chips_per_host)},
                runtime_env=runtime_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=host_group,
                    placement_group_bundle_index=worker,
                    placement_group_capture_child_tasks=False,
                ),
            )
            actors.append(remote_class.options(**actor_options).remote(*args, **dict(kwargs or {})))
        started = [actor.__ray_ready__.remote() for actor in actors]
        ready, _ = ray.wait(started, num_returns=len(started), timeout=_left(deadline))
        if len(ready) < len(started):
            raise SliceTimeoutError(
                f"role {role!r}: {len(ready)} of {request.hosts} host actors on "
                f"{request.describe()} slice {slice_name!r} started within {timeout_s:g}s"
            )
        ray.get(ready)  # a constructor that raised raises here
        return SliceGroup(
            request=request,
            role=role,
            slice_name=slice_name,
            head_group=head_group,
            host_group=host_group,
            members=members,
            actors=actors,
        )
    except BaseException:
        _kill_and_remove(actors, list(reversed(groups)))
        raise


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _ready(group: Any, deadline: float) -> bool:
    import ray

    ready, _ = ray.wait([group.ready()], timeout=_left(deadline))
    return bool(ready)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _no_slice_message(request: SliceRequest, role: str, timeout_s: float) -> str:
    import ray

    total = ray.cluster_resources().get(request.head_resource, 0)
    if total:
        why = f"all {int(total)} such slice(s) in the cluster are held by other roles or jobs"
    else:
        why = "no node in the cluster advertises it"
    return (
        f"role {role!r} found no free TPU slice of accelerator type {request.accelerator_type} "
        f"and topology {request.topology} (pod type {request.pod_type}, resource "
        f"{request.head_resource}) within {timeout_s:g}s: {why}"
    )


def _check_slice(
    request: SliceRequest, role: str, head_node: str
) -> tuple[str, list[dict[str, str]]]:
    """The name of the slice whose head ``head_node`` is and the label selector of each
    host's bundle (in worker-id order), after checking the slice's alive hosts against the
    request (hosts not alive yet are left for the host group to wait for). A single-host
    slice without a slice-name label is named, and pinned, by its node id."""
    import ray
    from ray.util.tpu import get_tpu_nodes_for_slice, get_tpu_slice_name_from_node

    nodes = ray.nodes()
    head = next((node for node in nodes if node["NodeID"] == head_node), None)
    slice_name = None if head is None else get_tpu_slice_name_from_node(head)
    if not slice_name:
        if request.hosts == 1:
            return head_node, [{NODE_ID_LABEL: head_node}]
        raise SlicePlacementError(
            f"role {role!r}: node {head_node} holds {request.head_resource} but has no "
            f"{SLICE_NAME_LABEL!r} label (Ray sets it on TPU nodes from TPU_NAME or the GCE "
            "metadata), so its slice's hosts cannot be found"
        )
    seen: set[int] = set()
    for node in get_tpu_nodes_for_slice(slice_name, nodes):
        labels = node.get("Labels") or {}
        worker = labels.get(WORKER_ID_LABEL, "")
        chips = (node.get("Resources") or {}).get("TPU", 0)
        if not worker.isdigit() or int(worker) >= request.hosts or int(worker) in seen:
            raise SlicePlacementError(
                f"role {role!r}: slice {slice_name!r} does not look like {request.describe()} "
                f"with {request.hosts} host(s): node {node['NodeID']} has "
                f"{WORKER_ID_LABEL}={worker!r}"
            )
        if chips != request.chips_per_host:
            raise SlicePlacementError(
                f"role {role!r}: slice {slice_name!r} host {worker} has {chips:g} TPU chips; "
                f"{request.describe()} has {request.chips_per_host} per host"
            )
        pod_type = labels.get(POD_TYPE_LABEL)
        if pod_type is not None and pod_type != request.pod_type:
            raise SlicePlacementError(
                f"role {role!r}: slice {slice_name!r} host {worker} is labelled "
                f"{POD_TYPE_LABEL}={pod_type!r}, not {request.pod_type!r}"
            )
        seen.add(int(worker))
    selectors = [
        {SLICE_NAME_LABEL: slice_name, WORKER_ID_LABEL: str(worker)}
        for worker in range(request.hosts)
    ]
    return slice_name, selectors
