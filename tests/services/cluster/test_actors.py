"""Actor helpers: a server bound on every interface is advertised at the node's own IP
(other nodes cannot dial 0.0.0.0), a loopback or named bind is advertised as bound."""

import ray

from services.cluster.actors import _advertised


def test_a_wildcard_bind_is_advertised_at_the_node_ip(monkeypatch):
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    assert _advertised("0.0.0.0:4100") == "10.1.2.3:4100"
    assert _advertised("[::]:4100") == "10.1.2.3:4100"
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "fd00::7")
    assert _advertised("[::]:4100") == "[fd00::7]:4100"


def test_a_specific_bind_is_advertised_as_bound():
    assert _advertised("127.0.0.1:4100") == "127.0.0.1:4100"
    assert _advertised("10.0.0.5:4100") == "10.0.0.5:4100"


def test_role_limits_reach_the_actor_process_environment():
    from services.cluster.placement import actor_options
    from services.common.config import RoleConfig

    options = actor_options(RoleConfig(cpu_threads=1, cpu_affinity=[1]), max_concurrency=2)
    env = options["runtime_env"]["env_vars"]
    assert env["DISTILL_CPU_THREADS"] == "1" and env["DISTILL_CPU_AFFINITY"] == "1"
    assert env["RAY_USAGE_STATS_ENABLED"] == "0" and options["max_concurrency"] == 2


def test_every_actor_and_the_phase_task_start_with_the_training_malloc_settings(monkeypatch):
    from distill.allocator import GLIBC_TUNABLES
    from services.cluster.placement import actor_options, process_environment
    from services.common.config import RoleConfig

    monkeypatch.delenv(GLIBC_TUNABLES, raising=False)
    tunables = actor_options(RoleConfig())["runtime_env"]["env_vars"][GLIBC_TUNABLES]
    assert "glibc.malloc.arena_max=1" in tunables.split(":")
    assert process_environment()[GLIBC_TUNABLES] == tunables
    # A value the driver's environment sets for a tunable wins.
    monkeypatch.setenv(GLIBC_TUNABLES, "glibc.malloc.arena_max=8")
    tunables = actor_options(RoleConfig())["runtime_env"]["env_vars"][GLIBC_TUNABLES]
    assert "glibc.malloc.arena_max=8" in tunables.split(":")
    assert "glibc.malloc.mmap_max=0" in tunables.split(":")


def test_an_empty_or_negative_affinity_is_refused_by_name():
    import pytest

    from distill.config import ConfigError
    from services.common.config import RoleConfig

    for cores in ([], [-1]):
        with pytest.raises(ConfigError, match="`cpu_affinity` must list at least one core"):
            RoleConfig(cpu_affinity=cores)
