"""An adoption under way when its server stops, and claims or declarations that tie (reviews 88, 105): a clean stop
ends the adoption's probes and fetches at once, claims nothing, and still makes its last push; two holders whose
claims split a uid's entry evenly (which readers see as nobody's) let their entries expire instead of refreshing
them, so the cell is adopted soon after; of two servers whose own declarations split it so, one gives way. Holders,
hosts and DHT nodes are in-process (gRPC servers and DHT nodes on loopback)."""
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
from dmoe.directory import Announcer, get_experts
from dmoe.replicas import ReplicaChannels, ReplicaConfig, Replication, ReplicaStore, sign, take
from dmoe.replicas.adoption import PROBE_TIMEOUT, Adopter
from dmoe.replicas.records import SIGNER_HEX, Holder, distance, hosts_key, replicas_key, server_subkey
from dmoe.replicas.snapshots import signed_fields
from dmoe.server import ExpertServer, ServerConfig
from dmoe.uid import strict_prefixes
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from tests.test_adoption_newest import HIDDEN, expert_server, train
from tests.test_replicas import wait_until

UID = "ffn0.1.2"
OWN = "ffn0.0.0"  # what the holder serves itself
MAX_BYTES = 1 << 30
PREFIX, COORDINATE = strict_prefixes(UID)[-1]  # where UID's directory entry is: its owned subkey in this record


def node_of(dht: DHT) -> Node:
    host, port = dht.endpoint.rsplit(":", 1)
    return Node(dht.node.node.id, host, int(port))


def store_entry(by: DHT, on: DHT, identity: Identity, endpoint: str, expiration: float) -> None:
    """Stores ``identity``'s directory entry of UID (at ``endpoint``) on the node ``on`` alone, sent by ``by``."""
    entry = identity.entry(digest(PREFIX), COORDINATE, endpoint, round(time.time() + expiration, 3))
    assert by.run_coroutine(by.node.protocol.call_store(node_of(on), digest(PREFIX), {COORDINATE: entry})) == [True]


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


def four_nodes_and_a_reader(stack: ExitStack):
    """A DHT of four nodes, two of them A's and B's ((identity, node) each), and a client-mode reader: a record's
    replicas that two keys' stores can reach in opposite orders, two each (a tie)."""
    first = stack.enter_context(DHT())
    a, b = Identity(), Identity()
    node_a = stack.enter_context(DHT([first.endpoint], identity=a))
    node_b = stack.enter_context(DHT([first.endpoint], identity=b))
    fourth = stack.enter_context(DHT([first.endpoint]))
    reader = stack.enter_context(DHT([first.endpoint], client_mode=True))
    return first, (a, node_a), (b, node_b), fourth, reader


def test_claims_that_tie_are_not_refreshed_by_their_losers_so_the_cell_is_adopted_once_they_expire(tmp_path):
    """Two holders' claims of an emptied cell reached two of the DHT's four nodes each: readers find no owner (a tie
    reads as nobody), both lose. Each claimed again at its next look, which refreshed its own half: the cell stayed
    unserved for as long as both ran, although each claim's entries live only EXPIRATION seconds (review 88)."""
    expiration = 4.0
    owner = Identity()
    replica = replica_of(owner, 3)
    with ExitStack() as stack:
        first, (a, node_a), (b, node_b), fourth, reader = four_nodes_and_a_reader(stack)
        endpoints = {a: "127.0.0.1:1111", b: "127.0.0.1:2222"}
        # the race's outcome: A's claim reached two of the four nodes first, B's the other two
        for identity, dht, targets in ((a, node_a, (first, node_a)), (b, node_b, (node_b, fourth))):
            for target in targets:
                store_entry(dht, target, identity, endpoints[identity], expiration)
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



def test_of_two_servers_whose_first_declarations_tie_the_one_farther_from_the_uid_gives_way_keeping_its_training(
        tmp_path):
    """Two --replica-dir servers choose UID at the same moment; their first declarations reach the record's nodes
    in opposite orders, two each: readers find no owner (a tie reads as nobody's). Each kept serving UID and
    refreshing its own half, as long as both ran, and no client ever found it (review 105 D4). Now the server
    whose key is farther from UID's key gives way: it keeps what it trained as a replica held in its store, and
    the other's next refresh, once the half of the one that gave way expired, makes it UID's owner."""
    expiration = 3.0
    with ExitStack() as stack:
        first, (a, node_a), (b, node_b), fourth, reader = four_nodes_and_a_reader(stack)
        # the race's outcome: A's first declaration reached two of the four nodes first, B's the other two
        for identity, dht, targets in ((a, node_a, (first, node_a)), (b, node_b, (node_b, fourth))):
            for target in targets:
                store_entry(dht, target, identity, "127.0.0.1:1", expiration)
        assert get_experts(reader, [UID]) == [None]
        servers = {}
        for identity, dht, steps in ((a, node_a, 3), (b, node_b, 5)):
            server = ExpertServer.create(UID, "ffn", HIDDEN, optimizer="adam", lr=0.01,
                                         config=ServerConfig(device="cpu", host="127.0.0.1"),
                                         announcer=Announcer(dht, refresh_period=0.5, expiration=expiration))
            train(server.backends[UID], steps)
            Replication(server, ReplicaConfig(tempfile.mkdtemp(dir=tmp_path), replicas=0, check_period=0.5))
            servers[identity] = stack.enter_context(server)  # (started: declares UID, refused on the other half)
        keeps, gives = sorted(servers, key=lambda identity: distance(UID, identity.public_key))
        winner, loser = servers[keeps], servers[gives]
        wait_until(lambda: get_experts(reader, [UID]) == [winner.endpoint] and UID not in loser.backends,
                   5 * expiration, f"{winner.endpoint} alone serving {UID}, found by clients")
        assert UID in winner.backends
        held = loser.replication.store.header(UID)  # its training, held as a replica of UID (adopted if it empties)
        assert held.signer == gives.public_key and held.updates == (3 if gives is a else 5)
        assert not loser.replication.adopter.adopted


def hand_over(node: DHT, identity: Identity, expiration: float) -> None:
    """``node`` holds ``identity``'s entry of UID in place of the one it held (as a node of the record that lost
    its entries, or joined the record's replicas anew, and took another key's store first would)."""
    entry = identity.entry(digest(PREFIX), COORDINATE, "127.0.0.1:1", round(time.time() + expiration, 3))

    async def swap() -> None:
        node.node.storage.data[digest(PREFIX)].pop(COORDINATE, None)
        assert node.node.storage.store(digest(PREFIX), COORDINATE, *entry)
    node.run_coroutine(swap())


def test_a_tie_made_later_by_another_key_or_with_a_stale_entry_does_not_make_a_server_give_way(tmp_path):
    """A server's entry of UID is held by two of the four nodes, a key closer to UID's key holds the other two:
    readers find no owner. A server that owned UID (read itself its owner at two looks) never gives way then,
    since any key may store first on a node that lost the owner's entry (a hostile one): it would take a live
    server's cell. A server that never owned it does not give way to an entry that is not issued anew either (a
    stale one, which expires by itself), but only to a live rival closer to UID's key."""
    expiration = 60.0
    me = Identity()
    rival = Identity()
    while distance(UID, rival.public_key) >= distance(UID, me.public_key):
        rival = Identity()  # (closer: the rival a server that never owned UID gives way to)
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        own = stack.enter_context(DHT([first.endpoint], identity=me))
        third, fourth = (stack.enter_context(DHT([first.endpoint])) for _ in range(2))
        reader = stack.enter_context(DHT([first.endpoint], client_mode=True))
        server = ExpertServer.create(UID, "ffn", HIDDEN, optimizer="adam", lr=0.01,
                                     config=ServerConfig(device="cpu", host="127.0.0.1"),
                                     announcer=Announcer(own, refresh_period=30.0, expiration=expiration))
        train(server.backends[UID], 2)
        stack.enter_context(server)  # (declares UID on the four nodes)
        channels = ReplicaChannels()
        stack.callback(channels.close)

        def adopter() -> Adopter:
            return Adopter(server, own, ReplicaStore(tempfile.mkdtemp(dir=tmp_path), MAX_BYTES), ["ffn0"],
                           check_period=1.0, stagger=0.0, channels=channels, max_bytes=MAX_BYTES,
                           expiration=expiration)
        owner = adopter()
        assert owner.drop_taken() == owner.drop_taken() == []  # UID read as its own twice: it owns UID
        for node in (third, fourth):
            hand_over(node, rival, expiration)
        assert get_experts(reader, [UID]) == [None]  # a tie
        for _ in range(2):
            for node in (third, fourth):
                hand_over(node, rival, expiration)  # (issued anew: a live rival)
            assert owner.drop_taken() == [] and UID in server.backends
        newcomer = adopter()  # one that never read itself UID's owner (its first declaration tied)
        assert newcomer.drop_taken() == newcomer.drop_taken() == []  # the rival's entry not issued anew: stale
        for node in (third, fourth):
            hand_over(node, rival, expiration)
        assert newcomer.drop_taken() == [UID] and UID not in server.backends
        held = newcomer.store.header(UID)
        assert held.signer == me.public_key and held.updates == 2
