"""``deploy/tpu/cluster.yaml`` (Ray cluster launcher, TPU VMs on GCP) passes Ray's own
cluster-config validation, offline: the installed Ray's JSON schema
(``ray/autoscaler/ray-schema.json``) on the file as written, then what ``ray up`` does
before it talks to the cloud (``prepare_config``: GCP defaults merged, setup commands
merged, min/max workers filled; then ``validate_config``). The TPU node types are checked
with the rules of Ray's GCP provider and Ray's TPU helpers (slice shapes, hosts per slice),
and the file is checked against the job it is for (``deploy/jobs/agree-tpu.yaml``)."""

from __future__ import annotations

import copy
import importlib
import json
import re
import shlex
import sys
import types
from pathlib import Path

import jsonschema
import pytest
import yaml

from distill.config import load_config
from services.common.config import JobSpec
from tests.deploy.support import (
    ROOT,
    RUNTIME_VERSIONS,
    chips_per_host,
    distill_run_commands,
    hosts,
    parse_pod_type,
    parse_run,
    pod_type,
    repo_paths,
    slice_demand,
)

CLUSTER = ROOT / "deploy" / "tpu" / "cluster.yaml"


def _config() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


def _ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def _ray_up_validation(config: dict) -> dict:
    """What `ray up` runs on the file before the provider's bootstrap (which needs GCP):
    ray.autoscaler._private.commands._bootstrap_config = prepare_config + validate_config."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _tpu_node_types(config: dict) -> dict[str, dict]:
    return {
        name: node
        for name, node in config["available_node_types"].items()
        if "acceleratorType" in node["node_config"] or "acceleratorConfig" in node["node_config"]
    }


def test_the_file_as_written_matches_rays_schema():
    jsonschema.validate(_config(), _ray_schema())


def test_ray_up_validation_passes():
    prepared = _ray_up_validation(_config())
    assert prepared["provider"]["type"] == "gcp"
    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert "machineType" in head["node_config"], "the head is a CPU VM, not a TPU"
    assert not _tpu_node_types({"available_node_types": {"head": head}})
    assert _tpu_node_types(prepared), "no TPU worker node type"
    # The merged commands are what every node runs: the package on all of them, libtpu JAX
    # on the TPU workers only.
    assert any("-e ~/distill" in command for command in prepared["head_setup_commands"])
    assert any("-e ~/distill" in command for command in prepared["worker_setup_commands"])
    assert not any("jax[tpu]" in command for command in prepared["head_setup_commands"])


@pytest.mark.parametrize(
    "break_it, error",
    [
        (lambda config: config.update(max_worker=3), jsonschema.ValidationError),
        (lambda config: config.update(head_node_type="nope"), ValueError),
        (
            lambda config: config["available_node_types"]["tpu_v6e_4"].pop("resources"),
            jsonschema.ValidationError,
        ),
        (
            lambda config: config["available_node_types"]["tpu_v6e_4"].update(min_workers=99),
            ValueError,
        ),
    ],
    ids=["unknown-key", "head-type-missing", "no-resources", "min-over-max"],
)
def test_rays_validation_refuses_a_broken_copy(break_it, error):
    """The check has teeth: the same validation refuses a copy broken in one place."""
    config = _config()
    break_it(config)
    with pytest.raises(error):
        _ray_up_validation(config)


def _check_tpu_node(node_config: dict) -> tuple[str, int, int, int]:
    """The GCP provider's TPU rules (ray.autoscaler._private.gcp.config._validate_tpu_config,
    which cannot be imported without Google's client libraries) with Ray's TPU helpers, plus
    the runtime version of the generation."""
    from ray._private.accelerators import TPUAcceleratorManager
    from ray._private.accelerators import tpu as ray_tpu

    assert "machineType" not in node_config
    assert ("acceleratorType" in node_config) != ("acceleratorConfig" in node_config)
    accelerator_type = node_config["acceleratorType"]
    assert TPUAcceleratorManager.is_valid_tpu_accelerator_type(accelerator_type)
    generation, chips, per_host, n_hosts = parse_pod_type(accelerator_type)
    assert chips == ray_tpu.get_total_chips_from_accelerator_type(accelerator_type)
    assert per_host == ray_tpu.get_num_tpu_visible_chips_per_host(accelerator_type)
    assert node_config["runtimeVersion"] == RUNTIME_VERSIONS[generation]
    return generation, chips, per_host, n_hosts


def test_tpu_node_types_are_valid_slices():
    shapes = {}
    for name, node in _tpu_node_types(_config()).items():
        generation, chips, per_host, n_hosts = _check_tpu_node(node["node_config"])
        # Each host advertises its own chips: the node type's TPU is chips per host.
        assert node["resources"]["TPU"] == per_host, name
        shapes[name] = (node["node_config"]["acceleratorType"], chips, n_hosts)
    assert shapes["tpu_v6e_4"] == ("v6e-4", 4, 1)
    assert shapes["tpu_v6e_16"] == ("v6e-16", 16, 4)


@pytest.fixture
def ray_gcp_config(monkeypatch):
    """Ray's GCP provider config module (``ray.autoscaler._private.gcp.config``), imported
    with Google's client libraries replaced by stubs that refuse every call: its pure
    checks run, nothing can reach GCP. sys.modules is restored afterwards."""

    def refuse(*args, **kwargs):
        raise AssertionError("the test must not contact GCP")

    stubs: dict[str, types.ModuleType] = {}

    def stub(name: str, **attributes) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        stubs[name] = module
        return module

    stub("httplib2", Http=refuse)
    stub("google_auth_httplib2", AuthorizedHttp=refuse)
    errors = stub("googleapiclient.errors", HttpError=type("HttpError", (Exception,), {}))
    discovery = stub("googleapiclient.discovery", Resource=object, build=refuse)
    stub("googleapiclient", discovery=discovery, errors=errors)
    service_account = stub("google.oauth2.service_account", Credentials=refuse)
    credentials = stub("google.oauth2.credentials", Credentials=refuse)
    stub("google.oauth2", service_account=service_account, credentials=credentials)
    for name, module in stubs.items():
        monkeypatch.setitem(sys.modules, name, module)
    import ray.autoscaler._private.gcp as package

    for name in ("config", "node"):
        # Recorded as absent (or as they were), so teardown removes what this import adds.
        monkeypatch.setitem(sys.modules, f"{package.__name__}.{name}", None)
        del sys.modules[f"{package.__name__}.{name}"]
        monkeypatch.setattr(package, name, None, raising=False)
        delattr(package, name)
    return importlib.import_module(f"{package.__name__}.config")


def test_the_gcp_providers_own_offline_checks_pass(ray_gcp_config):
    """What bootstrap_gcp checks before it builds API clients: no legacy fields, every
    node config is a valid Compute VM or TPU (_validate_tpu_config), the head is no TPU."""
    gcp = ray_gcp_config
    prepared = _ray_up_validation(_config())
    gcp.check_legacy_fields(prepared)
    kinds = {
        name: gcp.get_node_type(node["node_config"])
        for name, node in prepared["available_node_types"].items()
    }
    assert kinds == {
        "ray_head_cpu": gcp.GCPNodeType.COMPUTE,
        "tpu_v6e_4": gcp.GCPNodeType.TPU,
        "tpu_v6e_16": gcp.GCPNodeType.TPU,
    }
    assert gcp._has_tpus_in_node_configs(prepared)
    assert not gcp._is_head_node_a_tpu(prepared)
    assert gcp._is_single_host_tpu(prepared["available_node_types"]["tpu_v6e_4"]["node_config"])
    assert not gcp._is_single_host_tpu(
        prepared["available_node_types"]["tpu_v6e_16"]["node_config"]
    )
    with pytest.raises(ValueError, match="acceleratorType"):
        gcp.get_node_type({"acceleratorType": "v6e16"})


@pytest.mark.parametrize(
    "accelerator_type",
    ["v5e-16", "v6e16", "tpu-v6e-slice", "v4-7"],
)
def test_the_tpu_check_refuses_bad_accelerator_types(accelerator_type):
    """`v5e-16` is the trap: Cloud TPU calls v5e `v5litepod`; v4 counts cores (even)."""
    with pytest.raises((AssertionError, ValueError)):
        _check_tpu_node({"acceleratorType": accelerator_type, "runtimeVersion": "x"})


@pytest.mark.parametrize(
    "generation, topology, name, chips, n_hosts",
    [
        ("v6e", "2x2", "v6e-4", 4, 1),
        ("v6e", "2x4", "v6e-8", 8, 1),
        ("v6e", "4x4", "v6e-16", 16, 4),
        ("v5litepod", "4x4", "v5litepod-16", 16, 4),
        ("v4", "2x2x2", "v4-16", 8, 2),
        ("v5p", "2x2x2", "v5p-16", 8, 2),
    ],
)
def test_pod_type_naming_trap(generation, topology, name, chips, n_hosts):
    """v5e/v6e pod types count chips, v4/v5p count TensorCores: v6e-16 is 4 hosts of 4
    chips, v4-16 is 2. The same answers as Ray's TPU helpers."""
    from ray._private.accelerators import tpu as ray_tpu

    assert pod_type(generation, topology) == name
    assert ray_tpu.infer_tpu_pod_type_from_topology(topology, generation) == name
    assert parse_pod_type(name)[1] == chips == ray_tpu.get_num_chips_from_topology(topology)
    assert hosts(generation, topology) == n_hosts == parse_pod_type(name)[3]
    assert chips // ray_tpu.get_chips_per_host(topology, generation) == n_hosts


def test_the_jobs_slices_fit_the_tpu_node_types():
    """Each slice agree-tpu.yaml asks for (cluster.<role>.slice) is one node of the node type
    of that pod type (the launcher's TPU node is a whole slice), its chips per host equal the
    node's TPU resource, and the node type starts enough slices for the whole job."""
    config = _config()
    cluster = load_config(ROOT / "deploy/jobs/agree-tpu.yaml", JobSpec).cluster
    by_pod_type = {
        node["node_config"]["acceleratorType"]: node for node in _tpu_node_types(config).values()
    }
    demand = slice_demand(cluster)
    assert demand
    for (generation, topology), count in demand.items():
        node = by_pod_type[pod_type(generation, topology)]
        assert node["resources"]["TPU"] == chips_per_host(generation, topology)
        assert count <= node["min_workers"] <= node["max_workers"]


def _commands(key: str) -> str:
    return " ".join(_config()[key])


def test_head_ports_and_dashboard_binding():
    """GCS 6379, Ray Client 10001, dashboard + Jobs API 8265 on loopback (reached through
    `ray dashboard`'s SSH tunnel: the Jobs API runs arbitrary code)."""
    head = _commands("head_start_ray_commands")
    for flag in (
        "--head",
        "--port=6379",
        "--ray-client-server-port=10001",
        "--dashboard-port=8265",
        "--dashboard-host=127.0.0.1",
        "--autoscaling-config=~/ray_bootstrap_config.yaml",
    ):
        assert flag in shlex.split(head), flag
    assert "JAX_PLATFORMS=cpu" in head
    assert "--address=$RAY_HEAD_IP:6379" in _commands("worker_start_ray_commands")


def test_the_package_and_the_token_reach_every_node():
    config = _config()
    mounts = config["file_mounts"]
    # The checkout: `ray up` from the repository root syncs it to ~/distill.
    assert mounts["~/distill"] == "."
    assert (ROOT / mounts["~/distill"] / "pyproject.toml").is_file()
    assert ".gitignore" in config["rsync_filter"]
    ignored = (ROOT / ".gitignore").read_text().split()
    assert ".venv/" in ignored and "runs/" in ignored
    # The token the job names (cluster.token_file) is installed from the synced file.
    token_file = load_config(ROOT / "deploy/jobs/agree-tpu.yaml", JobSpec).cluster.token_file
    install = next(c for c in config["setup_commands"] if token_file in c)
    assert any(remote in install for remote in mounts if "token" in remote)
    # libtpu JAX pinned to the package's jax.
    pin = re.search(r'"jax==([\d.]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert f'"jax[tpu]=={pin}"' in _commands("worker_setup_commands")


def test_commands_and_paths_in_the_comments_exist():
    text = CLUSTER.read_text()
    for name in repo_paths(text):
        assert (ROOT / name).exists(), f"cluster.yaml names {name}, which is not in the repo"
    commands = distill_run_commands(text)
    assert commands
    for argv in commands:
        args = parse_run(argv)
        load_config(ROOT / args.config, JobSpec, args.set)
        assert args.run_dir.startswith("/shared/")
