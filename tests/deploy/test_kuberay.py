"""The KubeRay manifests in ``deploy/kuberay/`` against KubeRay's documented structure
(``ray.io/v1`` RayCluster and RayJob, as in ``ray-operator/apis/ray/v1/*_types.go`` and the
KubeRay TPU guide), encoded below as a nested schema: every key at every level must be one
the CRD documents, with the documented type (``rayStartParams`` is strings to strings), and
the required ones present. Then what the schema cannot say: TPU requests equal limits and
``numOfHosts`` matches the slice topology; the RayJobs embed their RayCluster's spec; and
every entrypoint, config and path the manifests name exists in this repository and runs
``distill run`` with a job that fits the cluster."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from distill.config import load_config
from services.common.config import JobSpec
from tests.deploy.support import (
    GKE_ACCELERATORS,
    ROOT,
    chips_per_host,
    distill_run_commands,
    hosts,
    parse_run,
    repo_paths,
    slice_demand,
)

KUBERAY = ROOT / "deploy" / "kuberay"
MANIFESTS = sorted(KUBERAY.glob("*.yaml"))
TPU = "google.com/tpu"
ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY = "cloud.google.com/gke-tpu-topology"

# -- a small nested schema ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Obj:
    """A mapping with only these keys (each a schema), ``required`` of them present."""

    fields: dict[str, Any]
    required: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class ListOf:
    item: Any
    min_items: int = 0


@dataclasses.dataclass(frozen=True)
class MapOf:
    """A mapping of strings to ``value``: free keys (labels, rayStartParams, quantities)."""

    value: Any


@dataclasses.dataclass(frozen=True)
class OneOf:
    values: tuple[Any, ...]


def obj(required: str = "", **fields: Any) -> Obj:
    return Obj(fields, frozenset(required.split()))


def check(value: Any, schema: Any, path: str = "") -> list[str]:
    """Every way ``value`` departs from ``schema``, one line each with its path."""
    where = path or "<root>"
    if isinstance(schema, Obj):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {type(value).__name__}"]
        errors = [
            f"{where}.{key}: not a field KubeRay documents here (known: {sorted(schema.fields)})"
            for key in value
            if key not in schema.fields
        ]
        errors += [f"{where}.{key}: required" for key in sorted(schema.required - set(value))]
        for key, item in value.items():
            if key in schema.fields:
                errors += check(item, schema.fields[key], f"{path}.{key}" if path else key)
        return errors
    if isinstance(schema, ListOf):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        errors = [f"{where}: at least {schema.min_items} item(s)"] * (len(value) < schema.min_items)
        for index, item in enumerate(value):
            errors += check(item, schema.item, f"{path}[{index}]")
        return errors
    if isinstance(schema, MapOf):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {type(value).__name__}"]
        errors = [
            f"{where}: key {key!r} is not a string" for key in value if not isinstance(key, str)
        ]
        for key, item in value.items():
            errors += check(item, schema.value, f"{path}[{key}]")
        return errors
    if isinstance(schema, OneOf):
        return [] if value in schema.values else [f"{where}: {value!r} not one of {schema.values}"]
    # A plain type; bool is an int in Python, and neither may stand for the other here.
    if isinstance(value, bool) != (schema is bool) or not isinstance(value, schema):
        return [f"{where}: expected {schema.__name__}, got {type(value).__name__} {value!r}"]
    return []


# Kubernetes core/v1 pieces the manifests use (PodTemplateSpec and below).
QUANTITIES = MapOf(str)  # written as strings ("4", "32Gi"): no YAML int/float ambiguity
CONTAINER = obj(
    "name image",
    name=str,
    image=str,
    imagePullPolicy=OneOf(("Always", "IfNotPresent", "Never")),
    resources=obj(requests=QUANTITIES, limits=QUANTITIES),
    env=ListOf(obj("name", name=str, value=str)),
    ports=ListOf(obj("containerPort", containerPort=int, name=str, protocol=OneOf(("TCP", "UDP")))),
    command=ListOf(str),
    args=ListOf(str),
    volumeMounts=ListOf(obj("name mountPath", name=str, mountPath=str, readOnly=bool, subPath=str)),
)
VOLUME = obj(
    "name",
    name=str,
    persistentVolumeClaim=obj("claimName", claimName=str, readOnly=bool),
    secret=obj("secretName", secretName=str, defaultMode=int),
    hostPath=obj(
        "path",
        path=str,
        type=OneOf(("", "Directory", "DirectoryOrCreate", "File", "FileOrCreate")),
    ),
    emptyDir=obj(medium=str, sizeLimit=str),
)
TOLERATION = obj(
    key=str,
    operator=OneOf(("Exists", "Equal")),
    value=str,
    effect=OneOf(("NoSchedule", "PreferNoSchedule", "NoExecute")),
)
POD_TEMPLATE = obj(
    "spec",
    metadata=obj(labels=MapOf(str), annotations=MapOf(str)),
    spec=obj(
        "containers",
        containers=ListOf(CONTAINER, min_items=1),
        nodeSelector=MapOf(str),
        volumes=ListOf(VOLUME),
        tolerations=ListOf(TOLERATION),
        serviceAccountName=str,
    ),
)
METADATA = obj("name", name=str, namespace=str, labels=MapOf(str), annotations=MapOf(str))

# KubeRay ray.io/v1 (raycluster_types.go, rayjob_types.go). rayStartParams is required in
# KubeRay 1.1 (json tag without omitempty), so every group carries one, `{}` if empty.
HEAD_GROUP = obj(
    "rayStartParams template",
    rayStartParams=MapOf(str),
    serviceType=OneOf(("ClusterIP", "NodePort", "LoadBalancer")),
    template=POD_TEMPLATE,
)
WORKER_GROUP = obj(
    "groupName minReplicas maxReplicas rayStartParams template",
    groupName=str,
    replicas=int,
    minReplicas=int,
    maxReplicas=int,
    numOfHosts=int,
    rayStartParams=MapOf(str),
    template=POD_TEMPLATE,
)
RAY_CLUSTER_SPEC = obj(
    "headGroupSpec",
    rayVersion=str,
    enableInTreeAutoscaling=bool,
    headGroupSpec=HEAD_GROUP,
    workerGroupSpecs=ListOf(WORKER_GROUP),
)
RAY_CLUSTER = obj(
    "apiVersion kind metadata spec",
    apiVersion=OneOf(("ray.io/v1",)),
    kind=OneOf(("RayCluster",)),
    metadata=METADATA,
    spec=RAY_CLUSTER_SPEC,
)
RAY_JOB = obj(
    "apiVersion kind metadata spec",
    apiVersion=OneOf(("ray.io/v1",)),
    kind=OneOf(("RayJob",)),
    metadata=METADATA,
    spec=obj(
        "entrypoint",
        entrypoint=str,
        runtimeEnvYAML=str,
        rayClusterSpec=RAY_CLUSTER_SPEC,
        clusterSelector=MapOf(str),
        shutdownAfterJobFinishes=bool,
        ttlSecondsAfterFinished=int,
        submitterPodTemplate=POD_TEMPLATE,
        activeDeadlineSeconds=int,
        backoffLimit=int,
        submissionMode=OneOf(("K8sJobMode", "HTTPMode", "InteractiveMode")),
        jobId=str,
        metadata=MapOf(str),
    ),
)
SCHEMAS = {"RayCluster": RAY_CLUSTER, "RayJob": RAY_JOB}


def _load(path: Path) -> dict:
    documents = list(yaml.safe_load_all(path.read_text()))
    assert len(documents) == 1, f"{path.name}: one object per file"
    return documents[0]


def _cluster_spec(manifest: dict) -> dict:
    spec = manifest["spec"]
    return spec if manifest["kind"] == "RayCluster" else spec["rayClusterSpec"]


def _groups(spec: dict) -> list[tuple[str, dict]]:
    """``(name, group)`` for the head and every worker group."""
    return [("head", spec["headGroupSpec"])] + [
        (group["groupName"], group) for group in spec.get("workerGroupSpecs", [])
    ]


def _tpu_chips(group: dict) -> int:
    """google.com/tpu per pod (0 without TPUs)."""
    containers = group["template"]["spec"]["containers"]
    return sum(int(c.get("resources", {}).get("limits", {}).get(TPU, 0)) for c in containers)


# -- the tests ------------------------------------------------------------------------------


def test_the_documented_manifests_exist():
    names = {path.name for path in MANIFESTS}
    assert names == {
        "raycluster-tpu.yaml",
        "rayjob-tpu.yaml",
        "raycluster-cpu.yaml",
        "rayjob-cpu.yaml",
    }


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_every_field_is_one_kuberay_documents(path):
    manifest = _load(path)
    assert manifest.get("kind") in SCHEMAS, f"{path.name}: kind {manifest.get('kind')!r}"
    assert check(manifest, SCHEMAS[manifest["kind"]]) == []


@pytest.mark.parametrize(
    "break_it, complaint",
    [
        (lambda m: m["spec"]["workerGroupSpecs"][0].update(numHosts=4), "numHosts"),
        (
            lambda m: m["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 4}),
            "num-cpus",
        ),
        (lambda m: m["spec"].update(workerGroupSpec=[]), "workerGroupSpec"),
        (lambda m: m["spec"]["headGroupSpec"].pop("template"), "template: required"),
        (lambda m: m["spec"].update(enableInTreeAutoscaling="false"), "expected bool"),
        (lambda m: m["spec"]["workerGroupSpecs"][0].update(replicas=True), "expected int"),
        (lambda m: m.update(apiVersion="ray.io/v1alpha1"), "apiVersion"),
    ],
    ids=[
        "typo",
        "int-start-param",
        "singular-groups",
        "no-template",
        "string-bool",
        "bool-int",
        "old-api",
    ],
)
def test_the_structural_check_refuses_a_broken_copy(break_it, complaint):
    manifest = _load(KUBERAY / "raycluster-tpu.yaml")
    break_it(manifest)
    errors = check(manifest, RAY_CLUSTER)
    assert any(complaint in error for error in errors), errors


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_groups_are_consistent(path):
    manifest = _load(path)
    spec = _cluster_spec(manifest)
    name_pattern = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # DNS-1123 labels
    assert name_pattern.fullmatch(manifest["metadata"]["name"])
    workers = spec.get("workerGroupSpecs", [])
    assert len({group["groupName"] for group in workers}) == len(workers)
    for group in workers:
        assert name_pattern.fullmatch(group["groupName"])
        assert group.get("numOfHosts", 1) >= 1
        assert group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]
    for name, group in _groups(spec):
        pod = group["template"]["spec"]
        volumes = {volume["name"] for volume in pod.get("volumes", [])}
        for volume in pod.get("volumes", []):
            sources = set(volume) - {"name"}
            assert len(sources) == 1, f"{name}: volume {volume['name']} needs one source"
        for container in pod["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: mounts unknown volume {mount['name']}"
            # Kubernetes requires extended resources (google.com/tpu) in limits, and equal
            # requests when given; every quantity here is requested as limited.
            resources = container.get("resources", {})
            for key, amount in resources.get("requests", {}).items():
                if key not in ("cpu", "memory"):
                    assert resources.get("limits", {}).get(key) == amount, f"{name}: {key}"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_the_head_is_cpu_only_and_serves_the_cluster_ports(path):
    spec = _cluster_spec(_load(path))
    head = spec["headGroupSpec"]
    assert _tpu_chips(head) == 0
    assert not {ACCELERATOR, TOPOLOGY} & set(head["template"]["spec"].get("nodeSelector", {}))
    # Reached in the cluster through the head Service (kubectl port-forward from outside),
    # never a public load balancer: the Jobs API runs arbitrary code.
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert head["rayStartParams"].get("dashboard-host") == "0.0.0.0"  # the Service reaches it
    (container,) = head["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"gcs": 6379, "dashboard": 8265, "client": 10001}
    assert {"name": "JAX_PLATFORMS", "value": "cpu"} in container["env"]


@pytest.mark.parametrize(
    "path", [p for p in MANIFESTS if "tpu" in p.name], ids=lambda path: path.name
)
def test_tpu_groups_request_whole_hosts_of_their_slice(path):
    """google.com/tpu requests == limits == chips per host of the selected topology, and
    numOfHosts == hosts per slice (v6e 4x4: 16 chips / 4 per host = 4 hosts)."""
    spec = _cluster_spec(_load(path))
    shapes = {}
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        selector = pod.get("nodeSelector", {})
        assert ACCELERATOR in selector and TOPOLOGY in selector, group["groupName"]
        generation = GKE_ACCELERATORS[selector[ACCELERATOR]]
        topology = selector[TOPOLOGY]
        for container in pod["containers"]:
            resources = container["resources"]
            assert resources["requests"][TPU] == resources["limits"][TPU]
            assert int(resources["limits"][TPU]) == chips_per_host(generation, topology)
        assert group.get("numOfHosts", 1) == hosts(generation, topology), group["groupName"]
        assert {"key": TPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        shapes[group["groupName"]] = (generation, topology, group.get("numOfHosts", 1))
    assert shapes == {"tpu-v6e-4": ("v6e", "2x2", 1), "tpu-v6e-16": ("v6e", "4x4", 4)}


@pytest.mark.parametrize(
    "path", [p for p in MANIFESTS if "cpu" in p.name], ids=lambda path: path.name
)
def test_the_cpu_variant_has_no_tpus(path):
    for _, group in _groups(_cluster_spec(_load(path))):
        assert _tpu_chips(group) == 0
        assert not {ACCELERATOR, TOPOLOGY} & set(group["template"]["spec"].get("nodeSelector", {}))


@pytest.mark.parametrize("variant", ["tpu", "cpu"])
def test_the_rayjob_embeds_its_rayclusters_spec(variant):
    job = _load(KUBERAY / f"rayjob-{variant}.yaml")
    cluster = _load(KUBERAY / f"raycluster-{variant}.yaml")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    assert "clusterSelector" not in job["spec"]


def _dockerfile() -> str:
    return (KUBERAY / "Dockerfile").read_text()


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_versions_match_the_package(path):
    """rayVersion and the image's Ray are the pinned Ray; every group runs the one image
    (Ray needs the same Ray and Python everywhere), tagged with the package version."""
    import ray

    pyproject = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M)[1]
    ray_pin = re.search(r'"ray\[default\]==([^"]+)"', pyproject)[1]
    assert ray.__version__ == ray_pin
    spec = _cluster_spec(_load(path))
    assert spec["rayVersion"] == ray_pin
    assert f"rayproject/ray:{ray_pin}-py311" in _dockerfile()
    images = {
        container["image"]
        for _, group in _groups(spec)
        for container in group["template"]["spec"]["containers"]
    }
    assert len(images) == 1
    assert images.pop().endswith(f":{version}")


@pytest.mark.parametrize(
    "path", [p for p in MANIFESTS if p.name.startswith("rayjob")], ids=lambda path: path.name
)
def test_the_entrypoint_is_distill_run_of_a_job_that_fits_the_cluster(path):
    manifest = _load(path)
    spec = manifest["spec"]
    words = shlex.split(spec["entrypoint"])
    assert words[:2] == ["distill", "run"]
    args = parse_run(words[1:])
    # The entrypoint runs in the runtime env's working_dir: the image's copy of the repo,
    # where the config path resolves as it does here.
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    workdir = re.search(r"^WORKDIR (\S+)", _dockerfile(), re.M)[1]
    assert runtime_env == {"working_dir": workdir}
    assert spec.get("submissionMode") == "K8sJobMode", "the submitter pod uploads working_dir"
    config = ROOT / args.config
    assert config.is_file() and config.is_relative_to(ROOT / "deploy" / "jobs")
    cluster = load_config(config, JobSpec, args.set).cluster
    _check_job_fits(cluster, _cluster_spec(manifest), args.run_dir)


def _check_job_fits(cluster, spec: dict, run_dir: str) -> None:
    groups = _groups(spec)
    for name, group in groups:
        pod = group["template"]["spec"]
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            # The run directory is on one shared volume in every pod (resume, teacher load).
            shared = [p for p in mounts if Path(run_dir).is_relative_to(p)]
            assert shared, f"{name}: {run_dir} is on no mounted volume"
            volume = next(v for v in pod["volumes"] if v["name"] == mounts[shared[0]])
            assert "emptyDir" not in volume, f"{name}: {run_dir} must outlive the pod"
            # Every actor and the driver read the bearer token from the same path.
            if cluster.token_file is not None:
                token_dir = str(Path(cluster.token_file).parent)
                assert token_dir in mounts, f"{name}: no {token_dir} for the token"
                token_volume = next(v for v in pod["volumes"] if v["name"] == mounts[token_dir])
                assert "secret" in token_volume
    # Roles on slices: one replica of a worker group with that GKE accelerator and topology
    # is one whole slice (numOfHosts pods), and the group has replicas for every slice asked.
    roles = (cluster.teacher, cluster.rollout, cluster.learner)
    tpu_roles = [role for role in roles if role.slice is not None]
    for role in roles:
        assert not role.resources, f"TPU roles ask for slices, not resources: {role.resources}"
    for (generation, topology), count in slice_demand(cluster).items():
        selectors = [
            (group, group["template"]["spec"].get("nodeSelector", {})) for _, group in groups[1:]
        ]
        matching = [
            group
            for group, selector in selectors
            if GKE_ACCELERATORS.get(selector.get(ACCELERATOR)) == generation
            and selector.get(TOPOLOGY) == topology
        ]
        assert matching, f"no worker group has {generation} {topology} slices"
        assert all(group.get("numOfHosts", 1) == hosts(generation, topology) for group in matching)
        assert count <= sum(group["replicas"] for group in matching)
    if not tpu_roles:  # CPU: the logical CPUs of the workers hold every actor.
        workers = sum(
            float(group["rayStartParams"]["num-cpus"]) * group["replicas"]
            for _, group in groups[1:]
        )
        assert sum(role.count * role.num_cpus for role in roles) <= workers


@pytest.mark.parametrize("path", [*MANIFESTS, KUBERAY / "Dockerfile"], ids=lambda p: p.name)
def test_paths_and_commands_the_files_name_exist(path):
    text = path.read_text()
    for name in repo_paths(text):
        assert (ROOT / name).exists(), f"{path.name} names {name}, which is not in the repo"
    for argv in distill_run_commands(text):
        args = parse_run(argv)
        load_config(ROOT / args.config, JobSpec, args.set)
        assert args.run_dir.startswith("/shared/")
    # What the image copies is in the repository.
    if path.name == "Dockerfile":
        for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M):
            for name in source.split():
                assert (ROOT / name).exists(), name
