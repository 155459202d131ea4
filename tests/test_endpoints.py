"""Addresses: IPv6 hosts in brackets for gRPC, and where a DHT node listens when it is given no host."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from dmoe.client import forward_future
from dmoe.collab.state_sync import StateServer, StateServicer, TrainingState, download_state, encode_state
from dmoe.dht import DHT
from dmoe.dht.node import listen_host
from dmoe.endpoints import join_host_port, reachable_endpoint
from dmoe.server import ExpertServer, ServerConfig


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="this host has no IPv6 loopback")


def test_an_ipv6_host_is_put_in_brackets_once_and_a_wildcard_is_reached_on_loopback():
    assert join_host_port("10.0.0.5", 5000) == "10.0.0.5:5000"
    assert join_host_port("::1", 5000) == "[::1]:5000"
    assert join_host_port("[::1]", "5000") == "[::1]:5000"
    assert join_host_port("node.example.org", 1) == "node.example.org:1"
    for wildcard in ("0.0.0.0", "::", "[::]", ""):
        assert reachable_endpoint(wildcard, 7) == "127.0.0.1:7"
    assert reachable_endpoint("2001:db8::1", 7) == "[2001:db8::1]:7"


def test_a_node_given_no_host_listens_on_loopback_only_for_a_swarm_on_this_host():
    """A socket bound to 127.0.0.1 cannot send to another machine: a trainer joining a remote swarm (which passes
    no host) must listen on every interface."""
    assert listen_host([]) == "127.0.0.1"
    assert listen_host([("127.0.0.1", 1), ("localhost", 2)]) == "127.0.0.1"
    assert listen_host([("::1", 1)]) == "::1"
    assert listen_host([("10.1.2.3", 1)]) == "0.0.0.0"
    assert listen_host([("127.0.0.1", 1), ("10.1.2.3", 1)]) == "0.0.0.0"
    assert listen_host([("2001:db8::1", 1)]) == "::"
    assert listen_host([("no-such-host.invalid", 1)]) == "127.0.0.1"  # bootstrap says it cannot resolve it


@needs_ipv6
def test_a_swarm_on_ipv6_serves_experts_records_and_states():
    with DHT(host="::1") as first, DHT([first.endpoint]) as second:
        assert first.endpoint.startswith("[::1]:")
        assert second.node.transport.get_extra_info("sockname")[0] == "::1"
        assert second.store("k", "s", "v", expiration_time=time.time() + 60)
        assert first.get("k")["s"].value == "v"
    server = ExpertServer.create("nop.[0:1]", "nop", 4, config=ServerConfig(device="cpu", host="::1"))
    with server:
        assert server.endpoint.startswith("[::1]:")
        x = torch.randn(3, 4)
        torch.testing.assert_close(forward_future(server.endpoint, "nop.0", [x]).result(30)[0], x)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = encode_state(TrainingState.capture(3, "0123abcd", 1, list(model.parameters()), opt), "run")
    with StateServer(StateServicer("run", lambda: messages), host="::1") as state_server:
        assert state_server.endpoint.startswith("[::1]:")
        assert download_state(state_server.endpoint, "run", timeout=10, max_bytes=1 << 20).step == 3


def test_a_node_told_to_listen_on_loopback_says_why_it_cannot_reach_a_remote_peer():
    with pytest.raises(ConnectionError, match=r"listens on 127\.0\.0\.1, from where no other machine can be reached"):
        DHT(["10.1.2.3:9"], host="127.0.0.1")
