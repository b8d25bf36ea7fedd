"""Shared helpers of the deployment tests: the repository root, TPU slice shapes, and the
``distill run`` commands that manifests and comments name.

TPU shapes, and the pod-type naming trap: a pod type (``v6e-16``, ``v4-16``) is a generation
and a count, but the count means chips for v5e (``v5litepod``) and v6e and TensorCores for
v4 and v5p (two per chip). GKE's node selectors use the generation (``tpu-v6e-slice``) and
the topology in chips (``4x4``); ``google.com/tpu`` is chips per host. Hosts per slice =
chips / chips per host: 4 chips per host, except that v5e/v6e slices of at most 8 chips in a
single-host topology (1x1, 2x2, 2x4) are one host holding all of them.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: TensorCores per chip, which the count in a pod type is made of.
CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5litepod": 1, "v6e": 1}
#: GKE's ``cloud.google.com/gke-tpu-accelerator`` values and their generation.
GKE_ACCELERATORS = {
    "tpu-v4-podslice": "v4",
    "tpu-v5p-slice": "v5p",
    "tpu-v5-lite-podslice": "v5litepod",
    "tpu-v6e-slice": "v6e",
}
#: The Cloud TPU VM software version for each generation (``runtimeVersion``).
RUNTIME_VERSIONS = {
    "v4": "tpu-ubuntu2204-base",
    "v5p": "v2-alpha-tpuv5",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v6e": "v2-alpha-tpuv6e",
}
_SINGLE_HOST_TOPOLOGIES = ("1x1", "2x2", "2x4")
_EIGHT_CHIP_HOSTS = ("v5litepod", "v6e")


def topology_chips(topology: str) -> int:
    """Chips in a topology (``"4x4"`` -> 16, ``"2x2x2"`` -> 8)."""
    if not re.fullmatch(r"\d+x\d+(x\d+)?", topology):
        raise ValueError(f"topology must be AxB or AxBxC; received {topology!r}")
    return math.prod(int(dim) for dim in topology.split("x"))


def chips_per_host(generation: str, topology: str) -> int:
    chips = topology_chips(topology)
    if generation in _EIGHT_CHIP_HOSTS and topology in _SINGLE_HOST_TOPOLOGIES:
        return chips
    return 4


def hosts(generation: str, topology: str) -> int:
    """Hosts (VMs, Kubernetes pods) in one slice of ``topology``."""
    chips, per_host = topology_chips(topology), chips_per_host(generation, topology)
    if chips % per_host:
        raise ValueError(f"{generation} {topology}: {chips} chips do not fill hosts of {per_host}")
    return chips // per_host


def pod_type(generation: str, topology: str) -> str:
    """The Cloud TPU pod type of a slice: chips (v5e/v6e) or TensorCores (v4/v5p)."""
    return f"{generation}-{topology_chips(topology) * CORES_PER_CHIP[generation]}"


def parse_pod_type(accelerator_type: str) -> tuple[str, int, int, int]:
    """``(generation, chips, chips per host, hosts)`` of a pod type such as ``v6e-16``."""
    match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type)
    if match is None or match[1] not in CORES_PER_CHIP:
        raise ValueError(
            f"acceleratorType must be one of {sorted(CORES_PER_CHIP)} and a count (e.g. "
            f"v6e-16, v5litepod-16; not v5e-16); received {accelerator_type!r}"
        )
    generation, count = match[1], int(match[2])
    if count % CORES_PER_CHIP[generation]:
        raise ValueError(f"{accelerator_type}: {generation} counts TensorCores, two per chip")
    chips = count // CORES_PER_CHIP[generation]
    per_host = chips if generation in _EIGHT_CHIP_HOSTS and chips <= 8 else min(chips, 4)
    return generation, chips, per_host, max(chips // per_host, 1)


def slice_demand(cluster: Any) -> dict[tuple[str, str], int]:
    """Whole slices a job's ``cluster:`` asks for, by ``(pod-type generation, topology)``
    (``("v6e", "2x2")``): ``count`` per role with ``slice`` (one per teacher replica, rollout
    worker group, learner)."""
    demand: dict[tuple[str, str], int] = {}
    for role in (cluster.teacher, cluster.rollout, cluster.learner):
        if role.slice is not None:
            shape = (role.slice.generation, role.slice.topology)
            demand[shape] = demand.get(shape, 0) + role.count
    return demand


def repo_paths(text: str) -> set[str]:
    """Repository-relative paths (``deploy/...``, ``docs/...``, ``tests/...``) a text names."""
    found = re.findall(r"(?<![\w/.~-])((?:deploy|docs|tests)/[\w./-]*[\w])", text)
    return set(found)


def distill_run_commands(text: str) -> list[list[str]]:
    """Every ``distill run ...`` command in a text (comments included), as argv after
    ``distill``: one line each, up to a shell continuation, a backquote or the end of the
    line, and only where a YAML config follows (not prose such as "`distill run` resumes")."""
    commands = []
    for match in re.finditer(r"\bdistill run (?=\S+\.ya?ml\b)[^\n\\`]*", text):
        commands.append(shlex.split(match[0])[1:])
    return commands


def parse_run(argv: list[str]) -> Any:
    """``argv`` (after ``distill``) parsed by the real command line; must be ``run``."""
    from services.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.command == "run", argv
    return args
