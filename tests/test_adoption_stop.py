"""An adoption under way when its server stops, and a claim race that ties (review 88): a clean stop ends the
adoption's probes and fetches at once, claims nothing, and still makes its last push; two holders whose claims
split a uid's entry evenly (which readers see as nobody's) let their entries expire instead of refreshing them,
so the cell is adopted soon after. Holders, hosts and DHT nodes are in-process (gRPC servers and DHT nodes on
loopback)."""
from __future__ import annotations

import hashlib
import tempfile
import threading
import time
from concurrent import futures
from contextlib import ExitStack
from typing import Iterator

import grpc
from kademlia.node import Node
from kademlia.utils import digest

from dmoe.dht import DHT, Identity
from dmoe.directory import get_experts
from dmoe.replicas import ReplicaChannels, ReplicaConfig, Replication, ReplicaStore, sign, take
from dmoe.replicas.adoption import PROBE_TIMEOUT, Adopter
from dmoe.replicas.records import SIGNER_HEX, Holder, hosts_key, replicas_key, server_subkey
from dmoe.replicas.snapshots import signed_fields
from dmoe.uid import strict_prefixes
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from tests.test_adoption_newest import expert_server, train
from tests.test_replicas import wait_until

UID = "ffn0.1.2"
OWN = "ffn0.0.0"  # what the holder serves itself
MAX_BYTES = 1 << 30




def replica_of(owner: Identity, steps: int):
    backend = expert_server().backends[UID]
    train(backend, steps)
    return sign(take(backend), owner)


def newer_header(owner: Identity, updates: int) -> dmoe_pb2.ReplicaHeader:
    """A header signed by ``owner`` (its genuine newest, which anyone holding it may replay) over bytes never sent."""
    header = dmoe_pb2.ReplicaHeader(uid=UID, updates=updates, size=1000, sha256=hashlib.sha256(b"?").digest(),
                                    taken_at=time.time(), signer=owner.public_key)
    header.signature = owner.sign(*signed_fields(header))
    return header


class Trickling(dmoe_pb2_grpc.ReplicaServiceServicer):
    """A holder that sends a newer header at once, then a byte a second (never stalling the fetch) for ``SECONDS``,
    for as long as the fetch stays open; notes when each fetch began and when it found the fetch cancelled."""

    SECONDS = 30.0

    def __init__(self, header: dmoe_pb2.ReplicaHeader):
        self.header, self.fetches, self.cancelled = header, [], []
        self.released = threading.Event()

    def fetch(self, request: dmoe_pb2.ReplicaQuery, context) -> Iterator[dmoe_pb2.ReplicaChunk]:
        self.fetches.append(time.monotonic())
        yield dmoe_pb2.ReplicaChunk(header=self.header)
        deadline = time.monotonic() + self.SECONDS
        next_byte = time.monotonic() + 1.0
        while time.monotonic() < deadline and not self.released.is_set():
            if not context.is_active():
                self.cancelled.append(time.monotonic())
                return
            time.sleep(0.05)
            if time.monotonic() >= next_byte:
                next_byte += 1.0
                yield dmoe_pb2.ReplicaChunk(data=b"x")


class Silent(dmoe_pb2_grpc.ReplicaServiceServicer):
    """A holder that takes a fetch and sends nothing, not even the header, for as long as it stays open."""

    def __init__(self):
        self.fetches: list[float] = []
        self.released = threading.Event()

    def fetch(self, request: dmoe_pb2.ReplicaQuery, context) -> Iterator[dmoe_pb2.ReplicaChunk]:
        self.fetches.append(time.monotonic())
        while context.is_active() and not self.released.is_set():
            time.sleep(0.05)
        context.abort(grpc.StatusCode.NOT_FOUND, f"no replica of {request.uid}")
        yield  # (a stream handler)


def serve(stack: ExitStack, servicer) -> str:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    dmoe_pb2_grpc.add_ReplicaServiceServicer_to_server(servicer, server)
    endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    stack.callback(server.stop, None)
    if hasattr(servicer, "released"):
        stack.callback(servicer.released.set)
    return endpoint


class PushHost(dmoe_pb2_grpc.ReplicaServiceServicer):
    """A replica host that takes every push and notes (uid, updates, when) of each; holds nothing it is asked for
    (so the pusher does not take its word that it holds what it got last)."""

    def __init__(self):
        self.pushes: list[tuple[str, int, float]] = []

    def push(self, chunks, context) -> dmoe_pb2.ReplicaAck:
        chunks = list(chunks)
        self.pushes.append((chunks[0].header.uid, chunks[0].header.updates, time.monotonic()))
        return dmoe_pb2.ReplicaAck(updates=chunks[0].header.updates)

    def fetch(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, "none held")
        yield  # (a stream handler)


def announce_holder(dht: DHT, endpoint: str, updates: int, signer: Identity) -> None:
    """An entry of ``{UID}/replicas`` from a key of its own (keys are free)."""
    with DHT([dht.endpoint]) as throwaway:
        value = Holder(endpoint, updates, signer.public_key.hex()[:SIGNER_HEX], b"").value()
        assert throwaway.store(replicas_key(UID), server_subkey(throwaway.identity.public_key), value,
                               time.time() + 120)


def test_a_clean_stop_during_an_adoptions_fetch_ends_it_at_once_claims_nothing_and_still_makes_the_last_push(
        tmp_path):
    """The holder adopts UID (its owner left); a holder announcing a newer replica sends the owner's genuine newer
    header, then its bytes one a second, never stalling the fetch. The holder is stopped during that fetch. Its
    stop waited for the fetch (up to its 60 s timeout, three fetches at most), then claimed UID, while a
    supervisor's SIGKILL after 10 s lost the server's last push of its own expert (review 88)."""
    owner = Identity()
    with ExitStack() as stack:
        trickling = Trickling(newer_header(owner, 100))
        trickling_endpoint = serve(stack, trickling)
        host = PushHost()
        host_endpoint = serve(stack, host)
        node = stack.enter_context(DHT())
        own = stack.enter_context(DHT([node.endpoint]))
        announce_holder(node, trickling_endpoint, 100, owner)
        with DHT([node.endpoint]) as host_node:  # the host of layer ffn0's replicas
            assert host_node.store(hosts_key("ffn0"), server_subkey(host_node.identity.public_key), host_endpoint,
                                   time.time() + 120)
        server = expert_server(OWN)
        replication = Replication(server, ReplicaConfig(str(tmp_path), replicas=1, interval=600, check_period=0.5,
                                                        stagger=0), dht=own)
        replication.store.put(replica_of(owner, 3))  # UID's replica, held here: its owner left
        server.start()
        try:
            wait_until(lambda: len(trickling.fetches) >= 2, 30, "the adoption fetching from the trickling holder "
                                                                "(after asking for its header)")
            wait_until(lambda: any(uid == OWN for uid, _, _ in host.pushes), 30, "the pusher's first round")
            train(server.backends[OWN], 2)  # pushed by the last round alone (the next periodic one is 10 min away)
            time.sleep(0.5)
        finally:
            stopping = time.monotonic()
            server.close()
            took = time.monotonic() - stopping
        assert took < 4.0, f"the stop took {took:.1f} s"
        wait_until(lambda: trickling.cancelled, 2, "the trickling holder seeing its fetch cancelled")
        assert trickling.cancelled[0] - stopping < 2.0
        last = [(updates, at) for uid, updates, at in host.pushes if uid == OWN][-1]
        assert last[0] == 2 and last[1] > stopping  # the last push of the clean stop
        assert UID not in server.backends  # not adopted: the stop came first
        with DHT([node.endpoint], client_mode=True) as reader:
            assert get_experts(reader, [UID]) == [None]  # nor claimed


def test_a_stop_during_an_adoptions_header_probe_ends_it_at_once_and_claims_nothing(tmp_path):
    """Holders announced with huge counts at endpoints that take a fetch and send nothing: the adopter asks each
    for its header within PROBE_TIMEOUT. Stopped meanwhile, it waited the probe out, then adopted from its own
    replica and claimed UID although its server was stopping."""
    owner = Identity()
    with ExitStack() as stack:
        silent = [Silent() for _ in range(3)]
        node = stack.enter_context(DHT())
        for i, holding in enumerate(silent):
            announce_holder(node, serve(stack, holding), 10**9 - i, owner)
        own = stack.enter_context(DHT([node.endpoint]))
        store = ReplicaStore(tmp_path, MAX_BYTES)
        store.put(replica_of(owner, 3))
        server = stack.enter_context(expert_server(OWN))
        channels = ReplicaChannels()
        stack.callback(channels.close)
        adopter = Adopter(server, own, store, ["ffn0"], check_period=0.5, stagger=0.0, channels=channels,
                          max_bytes=MAX_BYTES, expiration=30.0).start()
        wait_until(lambda: all(holding.fetches for holding in silent), 30, "the adopter asking every holder")
        stopping = time.monotonic()
        adopter.close()
        took = time.monotonic() - stopping
        assert took < min(1.5, PROBE_TIMEOUT), f"the adopter took {took:.1f} s to stop"
        assert UID not in server.backends and not adopter.adopted
        time.sleep(0.5)  # (a thread left running would claim now)
        with DHT([node.endpoint], client_mode=True) as reader:
            assert get_experts(reader, [UID]) == [None]


class Holding:
    """What an Adopter uses of its server, around an unstarted one: serves nothing over the network, and keeps no
    declaration alive (the claim's entries live their ``expiration``)."""

    def __init__(self, endpoint: str):
        self.real = expert_server(OWN)
        self.endpoint, self.announcer = endpoint, None
        self.backend_factory = self.real.backend_factory

    @property
    def backends(self):
        return self.real.backends

    def add_expert(self, uid, backend, announce=True):
        self.real.add_expert(uid, backend, announce=False)

    def remove_expert(self, uid):
        return self.real.remove_expert(uid)


def test_claims_that_tie_are_not_refreshed_by_their_losers_so_the_cell_is_adopted_once_they_expire(tmp_path):
    """Two holders' claims of an emptied cell reached two of the DHT's four nodes each: readers find no owner (a tie
    reads as nobody), both lose. Each claimed again at its next look, which refreshed its own half: the cell stayed
    unserved for as long as both ran, although each claim's entries live only EXPIRATION seconds (review 88)."""
    expiration = 4.0
    owner = Identity()
    replica = replica_of(owner, 3)
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        a, b = Identity(), Identity()
        node_a = stack.enter_context(DHT([first.endpoint], identity=a))
        node_b = stack.enter_context(DHT([first.endpoint], identity=b))
        fourth = stack.enter_context(DHT([first.endpoint]))
        reader = stack.enter_context(DHT([first.endpoint], client_mode=True))
        endpoints = {a: "127.0.0.1:1111", b: "127.0.0.1:2222"}
        prefix, coordinate = strict_prefixes(UID)[-1]

        def node_of(dht: DHT) -> Node:
            host, port = dht.endpoint.rsplit(":", 1)
            return Node(dht.node.node.id, host, int(port))
        # the race's outcome: A's claim reached two of the four nodes first, B's the other two
        expires = round(time.time() + expiration, 3)
        for identity, dht, targets in ((a, node_a, (first, node_a)), (b, node_b, (node_b, fourth))):
            entry = identity.entry(digest(prefix), coordinate, endpoints[identity], expires)
            for target in targets:
                assert dht.run_coroutine(dht.node.protocol.call_store(node_of(target), digest(prefix),
                                                                      {coordinate: entry})) == [True]
        assert get_experts(reader, [UID]) == [None]  # a tie: nobody's
        holders = {}
        channels = ReplicaChannels()
        stack.callback(channels.close)
        for identity, dht in ((a, node_a), (b, node_b)):
            store = ReplicaStore(tempfile.mkdtemp(dir=tmp_path), MAX_BYTES)
            store.put(replica)
            server = Holding(endpoints[identity])
            adopter = Adopter(server, dht, store, ["ffn0"], check_period=1.0, stagger=0.5,
                              channels=channels, max_bytes=MAX_BYTES,
                              expiration=expiration)
            stack.callback(adopter.close)
            holders[endpoints[identity]] = (server, adopter.start())
        # (a loser's stray half, alone once the other half expired, names it for a while: not served there)
        served = wait_until(lambda: (found := get_experts(reader, [UID])[0]) in holders
                            and holders[found][1].adopted and found, 4 * expiration + 4,
                            "one of the holders adopting the cell")
        wait_until(lambda: [UID in server.backends for server, _ in holders.values()]
                   == [endpoint == served for endpoint in holders], 5, f"{served} alone serving {UID}")
        assert [len(adopter.adopted) for _, adopter in holders.values()] == [endpoint == served for endpoint in holders]

