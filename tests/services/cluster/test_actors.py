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
