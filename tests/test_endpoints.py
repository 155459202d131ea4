"""Addresses: IPv6 hosts in brackets for gRPC, and where a DHT node listens when it is given no host."""
from __future__ import annotations

import socket
import time
import urllib.request

import pytest
import torch

from dmoe.client import forward_future
from dmoe.collab.state_sync import StateServer, StateServicer, TrainingState, download_state, encode_state
from dmoe.dht import DHT
from dmoe.dht.node import listen_host
from dmoe.endpoints import (
    announced_endpoint,
    bare_host,
    is_host_port,
    is_loopback_ip,
    join_host_port,
    machine_address,
    outbound_host,
    peer_host,
    peer_machine,
    reachable_endpoint,
)
from dmoe.monitor import MonitorServer
from dmoe.server import ExpertServer, ServerConfig
from dmoe.wire.shared_memory import is_local_endpoint


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
    assert bare_host("[::1]") == "::1" and bare_host("::1") == "::1" and bare_host("10.0.0.5") == "10.0.0.5"


def test_a_grpc_peer_names_its_host_in_every_form_grpc_writes():
    assert peer_host("ipv4:10.0.0.1:5000") == "10.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == peer_host("ipv6:%5B::1%5D:5000") == "::1"
    assert peer_host("ipv6:[2001:DB8::7]:1") == "2001:db8::7"
    assert peer_host("unix:/tmp/socket") == "unix"


def test_per_client_limits_count_a_machine_not_an_address():
    """Review 55: an expert server's per-host limits went by address, so any addresses of one IPv6 /64 counted as
    that many machines (four of them took every streamed-call slot of a server)."""
    assert peer_machine("ipv6:[2001:db8::7]:1") == peer_machine("ipv6:%5B2001:db8::ffff:1%5D:9") == "2001:db8::/64"
    assert peer_machine("ipv6:[2001:db8:0:1::7]:1") == "2001:db8:0:1::/64"
    assert peer_machine("ipv4:10.0.0.1:5000") == peer_machine("ipv6:[::ffff:10.0.0.1]:7") == "10.0.0.1"
    assert peer_machine("ipv4:10.0.0.2:5000") == "10.0.0.2"
    assert peer_machine("unix:/tmp/socket") == "unix"


def test_a_loopback_address_is_parsed_in_any_spelling_and_a_name_is_no_loopback_address():
    """Review 99 D4: host *names* starting with 127. were taken for loopback (a remote server so named was offered
    the shared-memory path), and spellings of ::1 were not."""
    for host in ("127.0.0.1", "127.3.2.1", "::1", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1", "::ffff:7f00:1", "localhost"):
        assert is_loopback_ip(host) and is_local_endpoint(join_host_port(host, 5000)), host
    for host in ("127.evil.example", "127.0.0.1.nip.io", "10.0.0.1", "::2", "::ffff:10.0.0.1", "evil.localhost", ""):
        assert not is_loopback_ip(host) and not is_local_endpoint(join_host_port(host, 5000)), host


def test_only_host_port_is_an_endpoint_and_no_other_grpc_target():
    """Review 99 D3: what peers write into the DHT is dialed as a gRPC target, which unix:/path (and unix:1234, a
    socket in the current directory) is too."""
    for endpoint in ("127.0.0.1:1234", "[::1]:1234", "[2001:db8::7]:1", "localhost:1234", "node-1.example.org:65535",
                     "my_service:80"):
        assert is_host_port(endpoint), endpoint
    for endpoint in ("unix:/run/x.sock", "unix:1234", "UNIX:1234", "unix-abstract:name", "vsock:1:2",
                     "dns://8.8.8.8/h:1", "ipv4:127.0.0.1:1", "::1:1234", "[::1:1234", "[127.0.0.1]:1",
                     "[fe80::1%eth0]:1", "-h:1", "a..b:1", "h:0", "h:65536", "h:١٢", "h:", ":1", "h"):
        assert not is_host_port(endpoint), endpoint


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
    with DHT(host="[::1]") as first, DHT([first.endpoint]) as second:  # a host in brackets, as gRPC's
        assert first.endpoint.startswith("[::1]:")
        assert second.node.transport.get_extra_info("sockname")[0] == "::1"
        assert second.store("k", "s", "v", expiration_time=time.time() + 60)
        assert first.get("k")["s"].value == "v"
    server = ExpertServer.create("nop.[0:1]", "nop", 4, config=ServerConfig(device="cpu", host="::1",
                                                                           metrics_port=0))
    with server:
        assert server.endpoint.startswith("[::1]:") and server.metrics.endpoint.startswith("[::1]:")
        x = torch.randn(3, 4)
        torch.testing.assert_close(forward_future(server.endpoint, "nop.0", [x]).result(30)[0], x)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    messages = encode_state(TrainingState.capture(3, "0123abcd", 1, list(model.parameters()), opt), "run")
    with StateServer(StateServicer("run", lambda: messages), host="::1") as state_server:
        assert state_server.endpoint.startswith("[::1]:")
        assert download_state(state_server.endpoint, "run", timeout=10, max_bytes=1 << 20).step == 3


def test_a_node_told_to_listen_on_loopback_says_why_it_cannot_reach_a_remote_peer():
    if outbound_host([("10.1.2.3", 9)]) is None:
        pytest.skip("this host has no route to other machines")
    with pytest.raises(ConnectionError, match=r"listens on 127\.0\.0\.1, from where no other machine can be reached"):
        DHT(["10.1.2.3:9"], host="127.0.0.1")


def test_a_node_in_client_mode_listens_everywhere_and_a_name_with_both_families_is_reached_over_ipv4(monkeypatch):
    """A client-mode node answers nobody, and its local bootstrap peer may hand it contacts on other machines. A
    bootstrap name with AAAA and A records: the README's nodes listen on 0.0.0.0, so IPv4."""
    assert listen_host([("127.0.0.1", 1)], client_mode=True) == "0.0.0.0"
    assert listen_host([("::1", 1)], client_mode=True) == "::"
    both = [(socket.AF_INET6, socket.SOCK_DGRAM, 0, "", ("2001:db8::1", 1, 0, 0)),
            (socket.AF_INET, socket.SOCK_DGRAM, 0, "", ("198.51.100.7", 1))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: both)
    assert listen_host([("boot.example.org", 1)]) == "0.0.0.0"


def test_a_server_bound_everywhere_is_announced_at_this_machines_address_toward_its_peers():
    assert announced_endpoint("127.0.0.1:5000", "198.51.100.7") == "198.51.100.7:5000"
    assert announced_endpoint("[::1]:5000", "2001:db8::5") == "[2001:db8::5]:5000"
    assert announced_endpoint("127.0.0.1:5000", None) == "127.0.0.1:5000"  # the peers are here: so is everyone
    assert announced_endpoint("10.0.0.5:5000", "198.51.100.7") == "10.0.0.5:5000"  # a host given: as it is
    machine = machine_address()
    if machine is None:
        pytest.skip("this host has no default route, so no address toward other machines")
    with DHT(host="0.0.0.0") as boot:
        assert boot.endpoint.startswith("127.0.0.1:")  # where this machine reaches it, not 0.0.0.0
        port = boot.endpoint.rsplit(":", 1)[1]
        with DHT([f"{machine}:{port}"], host="0.0.0.0") as server_node:
            assert server_node.outbound_host == machine
            assert server_node.announced("127.0.0.1:5999") == f"{machine}:5999"


def test_a_node_that_joined_through_loopback_is_reached_from_other_machines_at_its_machines_address():
    """B joins A through 127.0.0.1, so A knows B at 127.0.0.1 and names it so to everyone; C, on "another machine"
    (bound to this host's non-loopback address only), must reach B at A's address instead."""
    machine = machine_address()
    if machine is None:
        pytest.skip("this host has no non-loopback address")
    with DHT(host="0.0.0.0") as a:
        port_a = a.endpoint.rsplit(":", 1)[1]
        with DHT([f"127.0.0.1:{port_a}"], host="0.0.0.0") as b:
            port_b = int(b.endpoint.rsplit(":", 1)[1])
            assert ("127.0.0.1", port_b) in [(c.ip, c.port) for c in a.node.protocol.router.contacts()]
            with DHT([f"{machine}:{port_a}"], host=machine) as c:
                known = {(node.ip, node.port) for node in c.node.protocol.router.contacts()}
                assert (machine, port_b) in known and ("127.0.0.1", port_b) not in known, known


@needs_ipv6
def test_the_swarm_page_is_served_on_ipv6():
    server = MonitorServer(None, host="::1").start()  # the page itself needs no monitor
    try:
        assert server.endpoint.startswith("[::1]:")
        with urllib.request.urlopen(f"http://{server.endpoint}/", timeout=10) as answer:
            assert answer.status == 200 and b"<html" in answer.read().lower()
    finally:
        server.close()


def ipv6_route() -> str | None:
    """This machine's source address toward a global IPv6 address (None without a route there); nothing is sent."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.connect(("2001:db8::1", 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def test_a_node_bound_to_every_ipv6_interface_is_shared_at_this_machines_ipv6_address():
    """``dmoe-dht --host ::`` printed an IPv4 address to pass as --initial-peers, which an IPv6-only peer cannot
    reach (review 112 D6)."""
    import asyncio
    import ipaddress

    from dmoe.cli import dht as dht_program
    from dmoe.dht.config import DHTConfig

    route = ipv6_route()
    if route is None or ipaddress.ip_address(route.partition("%")[0]).is_link_local:
        pytest.skip("this host has no route to global IPv6 addresses")
    args = dht_program.parse_args(["--host", "::", "--port", "0"])
    nodes: list = []

    async def bring_up() -> list[str]:
        try:
            return await dht_program.bring_up(args, DHTConfig(), None, nodes)
        finally:
            for node in nodes:
                node.stop()
    [address] = asyncio.run(bring_up())
    assert address.startswith(f"[{route}]:"), address
    assert machine_address(ipv6=True) == route
    ipv4 = machine_address()
    assert ipv4 is None or ipaddress.ip_address(ipv4).version == 4


def test_a_machine_with_only_a_link_local_ipv6_address_is_shared_at_its_ipv4_one(monkeypatch):
    import dmoe.endpoints

    routes = {"2001:db8::1": "fe80::1", "192.0.2.1": "198.51.100.7"}
    monkeypatch.setattr(dmoe.endpoints, "outbound_host", lambda peers: routes[peers[0][0]])
    assert machine_address(ipv6=True) == "198.51.100.7"
    routes["2001:db8::1"] = "2001:db8:5::2"
    assert machine_address(ipv6=True) == "2001:db8:5::2" and machine_address() == "198.51.100.7"
