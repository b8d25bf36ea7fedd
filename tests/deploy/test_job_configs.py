"""The cluster job configs in ``deploy/jobs/``: each loads as the services load it
(:func:`load_config` into :class:`JobSpec`), is the ``agree`` job of ``deploy/configs/``
with only a ``cluster:`` section added, and places its roles as documented."""

from __future__ import annotations

import pytest
import yaml

from distill.config import ConfigError, load_config
from services.common.config import JobSpec, is_loopback
from tests.deploy.support import (
    ROOT,
    distill_run_commands,
    parse_run,
    repo_paths,
    slice_demand,
)

JOBS = sorted((ROOT / "deploy" / "jobs").glob("*.yaml"))


def test_the_documented_job_configs_exist():
    assert {path.name for path in JOBS} >= {"agree-cpu.yaml", "agree-tpu.yaml"}


@pytest.mark.parametrize("path", JOBS, ids=lambda path: path.name)
def test_every_job_config_loads_as_a_job_spec(path):
    job = load_config(path, JobSpec)
    cluster = job.cluster
    assert cluster.learner.count == 1
    # Not loopback: actors on several nodes, so every service needs the bearer token, at an
    # absolute path that is the same on every node.
    if not is_loopback(cluster.host):
        assert cluster.token_file is not None and cluster.token_file.startswith("/")


@pytest.mark.parametrize("path", JOBS, ids=lambda path: path.name)
def test_a_cluster_job_is_its_base_job_plus_a_cluster_section(path):
    """agree-*.yaml repeat deploy/configs/agree.yaml (YAML has no include); only `cluster:`
    may differ, so the cluster runs exactly the job that the laptop runs."""
    base = ROOT / "deploy" / "configs" / (path.stem.split("-")[0] + ".yaml")
    assert base.is_file(), f"{path.name} names no base job in deploy/configs/"
    ours = yaml.safe_load(path.read_text())
    theirs = yaml.safe_load(base.read_text())
    assert "cluster" in ours
    ours.pop("cluster")
    theirs.pop("cluster", None)
    assert ours == theirs


def test_agree_cpu_places_two_teachers_four_rollout_workers_and_a_learner_on_cpus():
    cluster = load_config(ROOT / "deploy/jobs/agree-cpu.yaml", JobSpec).cluster
    assert (cluster.teacher.count, cluster.rollout.count, cluster.learner.count) == (2, 4, 1)
    for role in (cluster.teacher, cluster.rollout, cluster.learner):
        assert role.num_gpus == 0 and not role.resources
        assert role.cpu_threads == 1


def test_agree_tpu_puts_every_role_on_its_own_single_host_slice():
    cluster = load_config(ROOT / "deploy/jobs/agree-tpu.yaml", JobSpec).cluster
    assert (cluster.teacher.count, cluster.rollout.count, cluster.learner.count) == (2, 4, 1)
    for role in (cluster.teacher, cluster.rollout, cluster.learner):
        # A whole v6e 2x2 slice (pod type v6e-4): one host, one JAX process owning 4 chips,
        # reserved by its head resource; the placement asks for the chips itself.
        assert role.slice is not None and role.slice.pod_type == "v6e-4"
        assert (role.slice.hosts, role.slice.chips_per_host) == (1, 4)
        assert not role.resources and role.num_gpus == 0 and not role.max_restarts
    assert slice_demand(cluster) == {("v6e", "2x2"): 7}
    assert cluster.host == "0.0.0.0"
    assert cluster.token_file == "/etc/distill/token"


def test_the_one_node_override_in_the_comments_loads():
    """The comments promise `--set cluster.host=127.0.0.1 --set cluster.token_file=null`
    for a one-node run of the same file."""
    job = load_config(
        ROOT / "deploy/jobs/agree-cpu.yaml",
        JobSpec,
        ["cluster.host=127.0.0.1", "cluster.token_file=null"],
    )
    assert job.cluster.host == "127.0.0.1" and job.cluster.token_file is None


def test_a_non_loopback_host_without_a_token_is_refused():
    with pytest.raises(ConfigError, match="token_file"):
        load_config(ROOT / "deploy/jobs/agree-tpu.yaml", JobSpec, ["cluster.token_file=null"])


@pytest.mark.parametrize("path", JOBS, ids=lambda path: path.name)
def test_commands_and_paths_in_the_comments_exist(path):
    text = path.read_text()
    for name in repo_paths(text):
        assert (ROOT / name).exists(), f"{path.name} names {name}, which is not in the repo"
    for argv in distill_run_commands(text):
        args = parse_run(argv)
        load_config(ROOT / args.config, JobSpec, args.set)
        assert args.run_dir.startswith("/shared/"), "the run directory must be shared storage"
