"""Where a pusher puts an expert's R replicas (review 88 D1): each endpoint and each machine (an IPv4 address, an
IPv6 /64, or a shared machine token) holds at most one, however many keys announce it, since keys cost nothing
to make. Hosts are given to the pusher directly (no DHT); pushes go to in-process gRPC fake hosts on 127.0.0.1,
or, for addresses no test can listen on, to a stand-in for ``push_snapshot``."""
from __future__ import annotations

import ipaddress
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from dmoe.dht import Identity
from dmoe.replicas import ReplicaPusher, ReplicaStore, sign, take
from dmoe.replicas import pusher as pusher_module
from dmoe.replicas.records import Host, distance
from dmoe.wire import dmoe_pb2
from tests.test_replicas import UID, expert_server, fake_host, train

LOCAL = SimpleNamespace(outbound_host=None)  # a DHT whose peers are all on this machine (a local swarm)
PUBLIC = SimpleNamespace(outbound_host="198.51.100.1")  # one whose peers are on other machines


def keys_closest_first(count: int) -> list[Identity]:
    """``count`` fresh keys, the closest to UID's key first: where hosts rank for its replicas."""
    return sorted((Identity() for _ in range(count)), key=lambda key: distance(UID, key.public_key))


def announced(*endpoints: str, tokens: tuple[str | None, ...] = ()) -> list[Host]:
    """A host entry per endpoint, the first the closest to UID's key (keys are free: anyone grinds close ones)."""
    tokens = tokens or (None,) * len(endpoints)
    return [Host(key.public_key, endpoint, token)
            for key, endpoint, token in zip(keys_closest_first(len(endpoints)), endpoints, tokens)]


def pusher_of(hosts: list[Host], replicas: int, dht=LOCAL) -> ReplicaPusher:
    server = expert_server(UID)
    train(server.backends[UID], 2)
    pusher = ReplicaPusher(server, dht, Identity(), replicas=replicas, interval=600)
    pusher.hosts = lambda layers: {layer: list(hosts) for layer in layers}
    return pusher


@pytest.fixture
def pushed(monkeypatch) -> list[str]:
    """The endpoints pushed to, in order, by a stand-in for push_snapshot that every host takes."""
    endpoints: list[str] = []

    def push(stub, endpoint, signed, **kwargs) -> int:
        endpoints.append(endpoint)
        return signed.updates
    monkeypatch.setattr(pusher_module, "push_snapshot", push)
    return endpoints


def test_one_endpoint_announced_under_the_closest_keys_takes_one_replica_and_the_honest_host_the_other():
    """The review's repro: a host that keeps only the pushed headers (enough to answer "do you still hold it?")
    announced its endpoint under the keys closest to the expert's, also spelled as a name and as an IPv4-mapped
    IPv6 address; it took both of R=2 replicas, in every round, and the honest host farther away got none."""
    got = {"hostile": 0, "honest": 0}

    def handlers(name: str):
        kept: list = []

        def push(chunks, context):
            first = next(chunks)
            for _ in chunks:
                pass  # (the bytes: thrown away)
            got[name] += 1
            kept[:] = [first.header]
            return dmoe_pb2.ReplicaAck(updates=first.header.updates)

        def fetch(query, context):
            if not kept:
                context.abort(grpc.StatusCode.NOT_FOUND, "none held")
            yield dmoe_pb2.ReplicaChunk(header=kept[0])
        return push, fetch

    hostile, hostile_endpoint = fake_host(*handlers("hostile"))
    honest, honest_endpoint = fake_host(*handlers("honest"))
    port = hostile_endpoint.rpartition(":")[2]
    hosts = announced(hostile_endpoint, hostile_endpoint, f"localhost:{port}", f"[::ffff:127.0.0.1]:{port}",
                      honest_endpoint)
    pusher = pusher_of(hosts, replicas=2)
    try:
        assert pusher.push_all() == {UID: [hostile_endpoint, honest_endpoint]}
        train(pusher.server.backends[UID], 1)
        assert pusher.push_all() == {UID: [hostile_endpoint, honest_endpoint]}
        assert got == {"hostile": 2, "honest": 2}
    finally:
        pusher.close(push=False)
        hostile.stop(0)
        honest.stop(0)


def test_hosts_on_one_machine_by_their_address_take_one_replica_of_an_expert(pushed, monkeypatch):
    """Several ports of one IPv4 address (one also written IPv4-mapped), two addresses of one IPv6 /64, and two
    host names pointing to one address (a wildcard DNS record makes any number) are one machine each: the closest
    of each is placed, then the next machine's; a name that resolves to nothing (or not in time) is no host."""
    names = {"a.example": "203.0.113.9", "b.example": "203.0.113.9", "slow.example": None}

    def resolve(name: str):
        if name == "slow.example":
            time.sleep(1.0)
        return ipaddress.ip_address(names[name]) if names.get(name) else None
    monkeypatch.setattr(pusher_module, "resolve_host", resolve)
    monkeypatch.setattr(pusher_module, "RESOLVE_TIMEOUT", 0.2)
    hosts = announced("203.0.113.5:1000", "203.0.113.5:2000", "[::ffff:203.0.113.5]:3000",
                      "[2001:db8::1]:1000", "[2001:db8::2]:1000",
                      "a.example:1000", "b.example:2000", "203.0.113.9:3000", "nowhere.example:1", "slow.example:1",
                      "198.51.100.7:1000")
    pusher = pusher_of(hosts, replicas=4)
    try:
        assert pusher.push_all() == {UID: ["203.0.113.5:1000", "[2001:db8::1]:1000", "a.example:1000",
                                           "198.51.100.7:1000"]}
        assert pushed == pusher.push_all()[UID] == ["203.0.113.5:1000", "[2001:db8::1]:1000", "a.example:1000",
                                                    "198.51.100.7:1000"]
    finally:
        pusher.close(push=False)


@pytest.mark.parametrize("dht, placed", [(LOCAL, ["127.0.0.1:1000", "localhost:2000", "127.0.0.2:1000"]),
                                         (PUBLIC, ["203.0.113.5:1000"])])
def test_loopback_endpoints_are_machines_of_their_own_in_a_local_swarm_and_this_machine_otherwise(
        pushed, dht, placed):
    """A local swarm (the demo, the tests) runs every server on 127.0.0.1, and a push to a loopback endpoint reaches
    only this machine: there each endpoint counts as a machine, as the DHT counts contacts. A server whose peers
    are on other machines pushes to loopback endpoints only into its own machine, which holds none of its replicas
    (they would leave with it): it took one (review 105 D2)."""
    hosts = announced("127.0.0.1:1000", "127.0.0.1:1000", "localhost:2000", "127.0.0.2:1000", "[::1]:3000",
                      "203.0.113.5:1000")
    pusher = pusher_of(hosts, replicas=3, dht=dht)
    try:
        assert pusher.push_all(force=True) == {UID: placed}
    finally:
        pusher.close(push=False)


def test_hosts_sharing_a_machine_token_still_take_one_replica(pushed):
    """The processes of one ``dmoe-server --processes`` announce a token they share, at several addresses too."""
    hosts = announced("127.0.0.1:1000", "127.0.0.1:2000", "203.0.113.5:1000", "203.0.113.6:1000",
                      tokens=("m1", "m1", "m2", "m3"))
    pusher = pusher_of(hosts, replicas=3)
    try:
        assert pusher.push_all() == {UID: ["127.0.0.1:1000", "203.0.113.5:1000", "203.0.113.6:1000"]}
    finally:
        pusher.close(push=False)


@pytest.mark.parametrize("dht", [LOCAL, PUBLIC])
def test_hosts_announced_at_the_pushers_own_endpoint_take_none_of_its_replicas(pushed, dht):
    """Review 105 D2: anyone may announce a server's own endpoint as a host of its layer, under a key closer to an
    expert's than the honest hosts': the server pushed its replicas to itself (R=1: every one), where they die
    with it. Its own endpoint, however written, and its machine count as taken before any host."""
    pusher = pusher_of([], replicas=1, dht=dht)
    pusher.server.start()
    try:
        own = pusher.server.endpoint
        hosts = announced(own, f"localhost:{own.rpartition(':')[2]}", "203.0.113.5:1000")
        pusher.hosts = lambda layers: {layer: list(hosts) for layer in layers}
        assert pusher.push_all() == {UID: ["203.0.113.5:1000"]} and pushed == ["203.0.113.5:1000"]
    finally:
        pusher.close(push=False)
        pusher.server.close()


def test_host_names_that_never_resolve_cost_a_round_one_bound_and_hold_no_stop(monkeypatch):
    """Review 105 D3: each host name was resolved in turn (RESOLVE_TIMEOUT each) before the round's deadline or the
    stop was looked at: names whose DNS never answers, ranked before the honest host, held a round past its
    deadline, left the honest host without a push, and held a clean stop (close() joined the round) as long. They
    are looked up at once now, under one bound, and a stop ends the wait; the last push still goes."""
    released, rounds = threading.Event(), threading.Event()

    def black_hole(name: str):  # an attacker's domain whose name server never answers
        released.wait(30)
        return None
    monkeypatch.setattr(pusher_module, "resolve_host", black_hole)
    monkeypatch.setattr(pusher_module, "RESOLVE_TIMEOUT", 0.5)
    got: list[int] = []

    def push(chunks, context):
        first = next(chunks)
        for _ in chunks:
            pass
        got.append(first.header.updates)
        return dmoe_pb2.ReplicaAck(updates=first.header.updates)

    def fetch(query, context):
        context.abort(grpc.StatusCode.NOT_FOUND, "none held")
        yield  # (a generator: grpc's unary-stream handler)

    honest, endpoint = fake_host(push, fetch)
    hosts = announced(*(f"h{i}.attacker.example:4000" for i in range(10)), endpoint)
    pusher = pusher_of(hosts, replicas=1)
    try:
        started = time.monotonic()
        assert pusher.push_all(deadline=started + 2.0, interruptible=True) == {UID: [endpoint]}
        assert time.monotonic() - started < 1.5 and got == [2]
        # new names, and a wait far longer than a stop may take: a periodic round under way when the server stops
        hosts[:0] = announced(*(f"g{i}.attacker.example:4000" for i in range(10)))
        monkeypatch.setattr(pusher_module, "RESOLVE_TIMEOUT", 30.0)

        def reading(layers):
            rounds.set()
            return {layer: list(hosts) for layer in layers}
        pusher.hosts = reading
        pusher.interval = 0.1
        train(pusher.server.backends[UID], 1)
        pusher.start()
        assert rounds.wait(10)
        stopping = time.monotonic()
        pusher.close()
        assert time.monotonic() - stopping < 3 and got[-1] == 3  # the last push, to the honest host
    finally:
        released.set()
        pusher.close(push=False)
        honest.stop(0)


def test_a_stale_adopted_copy_does_not_replace_the_new_owners_newer_replica_in_the_servers_own_store(tmp_path):
    """Review 105 D5: each round wrote an adopted expert's snapshot into the server's own store over whatever was
    held of it. A server still serving a stale copy of a cell another server adopted and trained since replaced
    the new owner's newer replica, pushed to it, with its own, and announced and adopted that again."""
    me, new_owner = Identity(), Identity()
    with ReplicaStore(tmp_path, 1 << 30) as store:
        server = expert_server("ffn0.0.0")
        pusher = ReplicaPusher(server, LOCAL, me, replicas=0, interval=600, store=store)  # (built before adopting)
        try:
            stale = server.backend_factory(UID)
            train(stale, 3)
            server.add_expert(UID, stale, announce=False)
            newer = expert_server(UID).backends[UID]
            train(newer, 10)
            store.put(sign(take(newer), new_owner))  # the new owner's push
            pusher.push_all()
            assert store.header(UID).signer == new_owner.public_key and store.header(UID).updates == 10
            train(stale, 8)  # more than the replica held: its own training is kept, as before
            pusher.push_all()
            assert store.header(UID).signer == me.public_key and store.header(UID).updates == 11
        finally:
            pusher.close(push=False)
