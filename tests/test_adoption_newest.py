"""Which replica adoption and a new server's restore take: the one whose signed header counts the most updates,
whatever holders announce in ``{uid}/replicas`` (any key can write an entry there), and never one older than the
replica held here; and which signer a server that holds none trusts. Holders are in-process gRPC servers on loopback
addresses (127.0.0.2, 127.0.0.3, ... play distinct machines) serving genuinely signed replicas; the DHT is in-process
nodes."""
from __future__ import annotations

import hashlib
import time
from concurrent import futures
from contextlib import ExitStack
from typing import Iterator

import grpc
import pytest
import torch

from dmoe.dht import DHT, Identity
from dmoe.directory import declare_experts
from dmoe.replicas import (
    ReplicaChannels,
    ReplicaError,
    ReplicaStore,
    fetch_snapshot,
    newest_replica,
    restore_newest,
    sign,
    take,
)
from dmoe.replicas.adoption import MAX_FETCHES, PROBE_TIMEOUT, Adopter, expected_signers, most_vouched, read_holders
from dmoe.replicas.records import SIGNER_HEX, Holder, replicas_key, server_subkey
from dmoe.client import expert_info
from dmoe.replicas.snapshots import SignedSnapshot, max_snapshot_bytes, signed_fields
from dmoe.server import ExpertServer, ServerConfig
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from tests.procs import Proc, processes

UID = "ffn0.1.2"
HIDDEN = 8
MAX_BYTES = 1 << 30


def expert_server(uids: str = UID) -> ExpertServer:
    """An unstarted server of adam-trained ffn experts (a template and a backend factory)."""
    return ExpertServer.create(uids, "ffn", HIDDEN, optimizer="adam", lr=0.01, config=ServerConfig(device="cpu"))


def train(backend, steps: int) -> None:
    for _ in range(steps):
        backend.backward(torch.randn(4, HIDDEN), torch.randn(4, HIDDEN))
        backend.backward_calls += 1


class Holding(dmoe_pb2_grpc.ReplicaServiceServicer):
    """A holder's replica service serving one replica as it is (an honest holder, or one that lies about it in
    the DHT); counts the fetches it answered."""

    def __init__(self, signed: SignedSnapshot | None):
        self.signed, self.fetches = signed, 0

    def fetch(self, request: dmoe_pb2.ReplicaQuery, context) -> Iterator[dmoe_pb2.ReplicaChunk]:
        self.fetches += 1
        if self.signed is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no replica of {request.uid}")
        yield from self.signed.chunks()


class Stalling(dmoe_pb2_grpc.ReplicaServiceServicer):
    """A holder that sends a replica's first message (its header), then the rest only after ``STALL`` seconds, and
    only to a fetch still open: a fetch that reads on although the header tells it the replica is of no use takes
    that long, and gets the rest."""

    STALL = 5.0

    def __init__(self, header: dmoe_pb2.ReplicaHeader, body: bytes):
        self.header, self.body, self.fetches, self.rest_sent = header, body, 0, 0

    def fetch(self, request: dmoe_pb2.ReplicaQuery, context) -> Iterator[dmoe_pb2.ReplicaChunk]:
        self.fetches += 1
        yield dmoe_pb2.ReplicaChunk(header=self.header, data=self.body[:1024])
        deadline = time.monotonic() + self.STALL
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        if context.is_active():
            self.rest_sent += 1
            yield dmoe_pb2.ReplicaChunk(data=self.body[1024:])


class Silent(dmoe_pb2_grpc.ReplicaServiceServicer):
    """A holder that takes a fetch and sends nothing, not even the header, for as long as the fetch stays open (up
    to ``HOLD`` seconds), then answers NOT_FOUND. Any key may announce such an endpoint, under any count."""

    HOLD = 8.0

    def __init__(self):
        self.fetches = 0

    def fetch(self, request: dmoe_pb2.ReplicaQuery, context) -> Iterator[dmoe_pb2.ReplicaChunk]:
        self.fetches += 1
        deadline = time.monotonic() + self.HOLD
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        context.abort(grpc.StatusCode.NOT_FOUND, f"no replica of {request.uid}")
        yield  # (a stream handler)


class Swarm:
    """A DHT of in-process nodes and replica holders on 127.0.0.1, each announcing what it likes."""

    def __init__(self, stack: ExitStack):
        self.stack = stack
        self.first = stack.enter_context(DHT())
        self.holdings: dict[str, Holding] = {}

    def node(self, identity: Identity | None = None) -> DHT:
        return self.stack.enter_context(DHT([self.first.endpoint], identity=identity))

    def holder(self, signed: SignedSnapshot | None, announced: int, signer: Identity,
               host: str = "127.0.0.1", holding: dmoe_pb2_grpc.ReplicaServiceServicer | None = None) -> Holding:
        """Serves ``signed`` at ``host`` (or what ``holding`` serves) and announces, from its own key, a replica
        signed by ``signer`` with ``announced`` updates."""
        server = grpc.server(futures.ThreadPoolExecutor(2))
        holding = holding if holding is not None else Holding(signed)
        dmoe_pb2_grpc.add_ReplicaServiceServicer_to_server(holding, server)
        holding.endpoint = f"{host}:{server.add_insecure_port(f'{host}:0')}"
        server.start()
        self.stack.callback(server.stop, None)
        self.announce(holding.endpoint, announced, signer)
        self.holdings[holding.endpoint] = holding
        return holding

    def announce(self, endpoint: str, announced: int, signer: Identity) -> None:
        """An entry of ``{UID}/replicas`` from a key of its own (keys are free): ``endpoint`` holds a replica
        signed by ``signer`` with ``announced`` updates."""
        dht = self.node()
        value = Holder(endpoint, announced, signer.public_key.hex()[:SIGNER_HEX], b"").value()
        assert dht.store(replicas_key(UID), server_subkey(dht.identity.public_key), value, time.time() + 120)


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    with ExitStack() as stack:
        yield Swarm(stack)


@pytest.fixture
def lineage() -> tuple[Identity, list[SignedSnapshot]]:
    """The owner and its replicas of UID after 3, 5 and 8 updates, all genuinely signed by it."""
    owner, backend, taken = Identity(), expert_server().backends[UID], []
    for steps in (3, 2, 3):
        train(backend, steps)
        taken.append(sign(take(backend), owner))
    return owner, taken


def test_a_holder_announcing_a_huge_count_cannot_roll_a_new_server_back_to_its_old_replica(swarm, lineage, tmp_path):
    owner, (old, _, newest) = lineage
    liar = swarm.holder(old, 10**9, owner)  # an old snapshot of the owner's, announced as the newest by far
    honest = swarm.holder(newest, 8, owner)
    server, channels = expert_server(), ReplicaChannels()
    try:
        restored = restore_newest(server, swarm.node(), [UID], channels, max_bytes=MAX_BYTES,
                                  store=ReplicaStore(tmp_path, MAX_BYTES))
    finally:
        channels.close()
    assert restored[UID].updates == server.backends[UID].updates == 8
    assert (liar.fetches, honest.fetches) == (1, 2)  # each asked for its header; the newest one's replica fetched


def test_a_held_replica_is_adopted_rather_than_an_older_one_announced_as_far_newer(swarm, lineage, tmp_path):
    owner, (old, middle, newest) = lineage
    store = ReplicaStore(tmp_path, MAX_BYTES)
    store.put(newest)
    swarm.holder(old, 10**9, owner)
    swarm.holder(middle, 10**6, owner)
    channels = ReplicaChannels()
    with expert_server("ffn0.0.0") as server:
        adopter = Adopter(server, swarm.node(), store, ["ffn0"], check_period=1.0, stagger=1.0, channels=channels,
                          max_bytes=MAX_BYTES, expiration=30.0)
        try:
            assert adopter.adopt([UID]) == [UID]
            assert server.backends[UID].updates == 8
            assert [adoption.updates for adoption in adopter.adopted] == [8]
        finally:
            channels.close()


def test_the_newest_verified_replica_wins_among_holders_that_all_announce_more_than_they_hold(swarm, lineage):
    owner, (old, middle, newest) = lineage
    swarm.holder(old, 10**9, owner)
    swarm.holder(newest, 10**8, owner)
    swarm.holder(middle, 10**7, owner)
    channels = ReplicaChannels()
    try:
        found = newest_replica(swarm.node(), UID, expert_server().backends[UID], channels, max_bytes=MAX_BYTES)
    finally:
        channels.close()
    assert found.snapshot.updates == found.signed.header.updates == 8


def test_fetches_stop_after_the_few_best_announced_holders_but_quick_refusals_do_not_count(swarm, lineage):
    owner, (old, middle, newest) = lineage
    empty = [swarm.holder(None, 10**9 - i, owner) for i in range(MAX_FETCHES + 2)]  # announce, hold nothing
    swarm.holder(old, 10**6, owner)
    swarm.holder(middle, 10**5, owner)
    swarm.holder(newest, 10**4, owner)
    for updates in (100, 99, 98):
        swarm.holder(old, updates, owner)
    channels = ReplicaChannels()
    try:
        found = newest_replica(swarm.node(), UID, expert_server().backends[UID], channels, max_bytes=MAX_BYTES)
    finally:
        channels.close()
    assert found.snapshot.updates == 8
    assert all(holding.fetches == 1 for holding in empty)
    # every holder asked for its header once (side by side), and only the replica its header shows newest fetched
    assert sum(holding.fetches for holding in swarm.holdings.values()) == len(swarm.holdings) + 1


def signed_header(uid: str, updates: int, body: bytes, signer: Identity, size: int | None = None):
    """A header genuinely signed by ``signer`` for ``body`` (announcing ``size`` bytes, if given)."""
    header = dmoe_pb2.ReplicaHeader(uid=uid, updates=updates, size=len(body) if size is None else size,
                                    sha256=hashlib.sha256(body).digest(), taken_at=time.time(),
                                    signer=signer.public_key)
    header.signature = signer.sign(*signed_fields(header))
    return header


def test_a_fetch_is_cancelled_at_the_header_when_it_shows_the_replica_is_of_no_use(swarm, lineage):
    """Entries of {uid}/replicas name the signer they like: holders naming the owner serve replicas signed by
    another key, one larger than any snapshot of these experts (signed by the owner), and one no newer than a
    replica already fetched. Each used to be downloaded whole (up to the replica budget, 1 GiB) and refused only
    then; its header, the first message, says all of it. None of them counts as a fetch either."""
    owner, (old, _, newest) = lineage
    attacker, poisoned = Identity(), expert_server().backends[UID]
    train(poisoned, 20)
    foreign = sign(take(poisoned), attacker)
    rogues = [Stalling(foreign.header, foreign.body) for _ in range(MAX_FETCHES + 1)]
    for rank, rogue in enumerate(rogues):
        swarm.holder(None, 10**9 - rank, owner, holding=rogue)  # named as the owner's replica, announced newest
    huge = bytes(1 << 20)
    oversized = Stalling(signed_header(UID, 10**7, huge, owner, size=max_snapshot_bytes(expert_server().backends[UID])
                                       + 1), huge)
    swarm.holder(None, 10**7, owner, holding=oversized)
    honest = swarm.holder(newest, 10**6, owner)
    stale = Stalling(old.header, old.body)  # the owner's own old replica, announced as newer than the honest one
    swarm.holder(None, 10**5, owner, holding=stale)
    channels = ReplicaChannels()
    started = time.monotonic()
    try:
        found = newest_replica(swarm.node(), UID, expert_server().backends[UID], channels, max_bytes=MAX_BYTES)
    finally:
        channels.close()
    assert found.snapshot.updates == 8 and honest.fetches == 2  # its header, then its replica
    assert time.monotonic() - started < Stalling.STALL
    time.sleep(0.5)  # (a cancelled stream's last check)
    for rogue in (*rogues, oversized, stale):
        assert (rogue.fetches, rogue.rest_sent) == (1, 0)


def test_fetches_that_downloaded_a_replica_count_however_fast_they_failed(swarm, lineage):
    """Holders announcing the newest replica serve the owner's header with bytes that do not match it: each costs a
    whole download, refused only at the end (a fast link: well under a second), and used not to count. (The honest
    holder holds an older replica: the liars' headers, the owner's genuine newest, go first.)"""
    owner, (_, middle, newest) = lineage
    corrupt = SignedSnapshot(newest.header, bytes(len(newest.body)))
    liars = [swarm.holder(corrupt, 10**9 - i, owner) for i in range(MAX_FETCHES + 2)]
    honest = swarm.holder(middle, 5, owner)
    channels = ReplicaChannels()
    try:
        found = newest_replica(swarm.node(), UID, expert_server().backends[UID], channels, max_bytes=MAX_BYTES)
    finally:
        channels.close()
    assert found is None and honest.fetches == 1  # asked for its header only
    assert sum(liar.fetches for liar in liars) == len(liars) + MAX_FETCHES  # every header, then 3 downloads


def test_an_adopter_that_restarts_while_it_owns_the_cell_takes_its_own_newer_replicas_not_the_old_owners(swarm,
                                                                                                        tmp_path):
    """B adopted UID from A's replica (3 updates), trained it and pushed replicas signed by itself (8 updates) to
    another holder, then restarted: its store still holds A's replica, and the directory still names B. It used to
    accept only A's signature (the held replica's) and rolled UID back to 3 updates."""
    a, b = Identity(), Identity()
    backend = expert_server().backends[UID]
    train(backend, 3)
    a_replica = sign(take(backend), a)
    train(backend, 5)
    b_replica = sign(take(backend), b)
    store = ReplicaStore(tmp_path, MAX_BYTES)
    store.put(a_replica)
    holder = swarm.holder(b_replica, 8, b)
    swarm.holder(a_replica, 3, a)
    node = swarm.node(identity=b)
    channels = ReplicaChannels()
    with expert_server("ffn0.0.0") as server:
        assert declare_experts(node, [UID], "127.0.0.1:9", 10) == [True]  # B's claim, still alive
        adopter = Adopter(server, node, store, ["ffn0"], check_period=1.0, stagger=1.0, channels=channels,
                          max_bytes=MAX_BYTES, expiration=30.0)
        try:
            assert adopter.adopt([UID]) == [UID]
            assert server.backends[UID].updates == 8 and holder.fetches == 2  # its header, then its replica
        finally:
            channels.close()
    # a server that does not own the cell still takes only the held replica's signer
    channels = ReplicaChannels()
    try:
        found = newest_replica(swarm.node(), UID, expert_server().backends[UID], channels, max_bytes=MAX_BYTES,
                               store=store)
    finally:
        channels.close()
    assert found.signed.header.signer == a.public_key and found.snapshot.updates == 3


def test_a_signer_is_vouched_for_by_the_machines_serving_its_replicas_however_many_ports_or_keys_they_have():
    owner, attacker = "0" * SIGNER_HEX, "f" * SIGNER_HEX
    six_ports = {f"127.0.0.4:{5000 + i}": attacker for i in range(6)}
    assert most_vouched({"127.0.0.2:5000": owner, "127.0.0.3:5000": owner, **six_ports}) == owner
    one_64 = {f"[2001:db8::{i}]:5000": attacker for i in range(1, 7)}  # a machine is commonly given a whole /64
    assert most_vouched({"[2001:db8:0:1::1]:5000": owner, "[2001:db8:0:2::1]:5000": owner, **one_64}) == owner
    assert most_vouched({"[::ffff:10.0.0.1]:5000": owner, "10.0.0.1:6000": attacker}) is None  # one machine, a tie
    assert most_vouched({"localhost:5000": owner, "127.0.0.1:6000": attacker, "10.0.0.2:1": owner}) == owner
    assert most_vouched({"127.0.0.2:5000": owner, "127.0.0.4:5000": attacker}) is None  # nothing tells who lies
    assert most_vouched({}) is None


def test_votes_decide_only_when_neither_the_directory_nor_a_held_replica_names_the_signer():
    me, owner, held, vouched = Identity(), Identity(), Identity(), "f" * SIGNER_HEX
    prefix = lambda identity: identity.public_key.hex()[:SIGNER_HEX]  # noqa: E731
    header = dmoe_pb2.ReplicaHeader(signer=held.public_key)
    assert expected_signers(None, None, me.public_key, vouched) == {prefix(me), vouched}
    assert expected_signers(None, owner.public_key, me.public_key, vouched) == {prefix(me), prefix(owner)}
    assert expected_signers(header, None, me.public_key, vouched) == {prefix(me), prefix(held)}
    assert expected_signers(None, None, me.public_key) == {prefix(me)}  # a tie: only its own replicas


def test_throwaway_keys_naming_another_signer_do_not_outvote_the_holders_on_two_machines(swarm, lineage, tmp_path):
    """A new server takes a cell nobody serves and whose replica it does not hold. The owner's two holders, on two
    machines, name the owner; seven entries from throwaway keys name an attacker's key: three point at its one
    machine (a port each, serving its own snapshot, genuinely trained 20 steps and signed), three at machines
    where nothing listens, one at an honest holder. Trusting the signer that the most entries named, the server
    restored the attacker's snapshot."""
    owner, (_, _, newest) = lineage
    attacker, poisoned = Identity(), expert_server().backends[UID]
    train(poisoned, 20)
    forged = sign(take(poisoned), attacker)
    honest = [swarm.holder(newest, 8, owner, host=f"127.0.0.{i}") for i in (2, 3)]
    for _ in range(3):
        swarm.holder(forged, 20, attacker, host="127.0.0.4")
    for i in (5, 6, 7):
        swarm.announce(f"127.0.0.{i}:1", 20, attacker)
    swarm.announce(honest[0].endpoint, 20, attacker)
    with processes() as procs:
        procs.append(server := Proc(["-m", "dmoe.cli.server", "--experts", UID, "--hidden-dim", str(HIDDEN),
                                     "--optimizer", "adam", "--lr", "0.01", "--torch-threads", "1",
                                     "--initial-peers", swarm.first.endpoint, "--replica-dir", str(tmp_path),
                                     "--log-level", "WARNING"]))
        assert expert_info(server.endpoint(), UID, timeout=10)["updates"] == 8  # restored before it serves
        assert server.stop() == 0


def test_holders_that_never_send_a_header_cost_a_new_server_one_probe_timeout_and_hide_no_honest_holder(
        swarm, lineage, tmp_path):
    """Throwaway keys announce the owner's replica with huge counts at endpoints that take a fetch and send nothing.
    Fetched one after another, each waited out and counted as one of the three fetches (review 59): a new server
    never reached the honest holder and started the cell fresh. All are asked for their header at once now, and a
    holder that shows none is never fetched."""
    owner, (_, _, newest) = lineage
    silent = [swarm.holder(None, 10**9 - i, owner, holding=Silent()) for i in range(MAX_FETCHES + 1)]
    honest = swarm.holder(newest, 8, owner)
    server, channels, node = expert_server(), ReplicaChannels(), swarm.node()
    started = time.monotonic()
    try:
        restored = restore_newest(server, node, [UID], channels, max_bytes=MAX_BYTES,
                                  store=ReplicaStore(tmp_path, MAX_BYTES))
    finally:
        channels.close()
    assert restored[UID].updates == server.backends[UID].updates == 8
    assert time.monotonic() - started < min(Silent.HOLD, PROBE_TIMEOUT + 2)
    assert all(holding.fetches == 1 for holding in silent) and honest.fetches == 2  # its header, then its replica


def test_a_fetch_gives_up_on_a_holder_that_sends_no_header_or_stops_sending(swarm, lineage):
    """A fetch waited for each message up to its whole timeout (60 s): a holder that sends nothing, or stops after
    a genuine header (anyone may fetch one and serve it again), cost an adoption a minute a fetch."""
    owner, (_, _, newest) = lineage
    silent = swarm.holder(None, 8, owner, holding=Silent())
    stalling = swarm.holder(None, 8, owner, holding=Stalling(newest.header, newest.body))
    honest = swarm.holder(newest, 8, owner)
    channels = ReplicaChannels()
    try:
        for holding, words in ((silent, "sent no header within 1 s"), (stalling, "sent nothing for 1 s")):
            started = time.monotonic()
            with pytest.raises(ReplicaError) as failed:
                fetch_snapshot(channels.stub(holding.endpoint), holding.endpoint, UID, max_bytes=MAX_BYTES,
                               header_timeout=1, stall_timeout=1)
            assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and words in failed.value.message
            assert time.monotonic() - started < 3
        fetched = fetch_snapshot(channels.stub(honest.endpoint), honest.endpoint, UID, max_bytes=MAX_BYTES,
                                 header_timeout=1, stall_timeout=1)
        assert fetched.header.sha256 == newest.header.sha256
    finally:
        channels.close()


def test_at_equal_signed_counts_a_holder_that_announced_what_it_holds_is_fetched_before_those_that_overstated(
        swarm, lineage):
    """Holders that replay the owner's genuine newest header (anyone may fetch it) over bytes that do not match it,
    announced as far newer, used to be fetched first and take every fetch: the honest holder of that very replica
    was never reached."""
    owner, (_, _, newest) = lineage
    corrupt = SignedSnapshot(newest.header, bytes(len(newest.body)))
    liars = [swarm.holder(corrupt, 10**9 - i, owner) for i in range(MAX_FETCHES)]
    honest = swarm.holder(newest, 8, owner)
    channels = ReplicaChannels()
    try:
        found = newest_replica(swarm.node(), UID, expert_server().backends[UID], channels, max_bytes=MAX_BYTES)
    finally:
        channels.close()
    assert found.signed.header.sha256 == newest.header.sha256 and honest.fetches == 2
    assert all(liar.fetches == 1 for liar in liars)  # asked for the header only


def test_a_holders_rank_counts_only_the_machines_whose_signed_header_shows_a_newer_replica(swarm, lineage, tmp_path):
    """The holder of the owner's replica after 5 updates ranks itself among the holders of UID's replica: it waits
    ``stagger`` seconds per holder ranked before it. Every announced holder with a higher count was counted,
    answering or not: 200 throwaway entries at an endpoint nobody answers at made it wait 400 s (review 105 D6).
    Now only holders whose signed header shows a newer replica of a signer it trusts count, one per machine: the
    honest holder of the newest replica, and one machine that serves it (a genuine header, replayed) at three
    ports."""
    owner, (old, middle, newest) = lineage
    store = ReplicaStore(tmp_path, MAX_BYTES)
    store.put(middle)
    swarm.holder(newest, 8, owner, host="127.0.0.2")
    for _ in range(3):
        swarm.holder(newest, 8, owner, host="127.0.0.4")
    attacker, poisoned = Identity(), expert_server().backends[UID]
    train(poisoned, 20)
    swarm.holder(sign(take(poisoned), attacker), 20, attacker, host="127.0.0.3")  # a signer it does not trust
    swarm.holder(old, 10**9, owner, host="127.0.0.5")  # holds fewer updates than announced, and than this one
    for i in range(6, 9):
        swarm.announce(f"127.0.0.{i}:1", 10**9, owner)  # nobody answers there
    node, channels = swarm.node(), ReplicaChannels()
    announced = read_holders(node, [UID])[UID]
    assert len(announced) == 9
    adopter = Adopter(expert_server("ffn0.0.0"), node, store, ["ffn0"], check_period=1.0, stagger=2.0,
                      channels=channels, max_bytes=MAX_BYTES, expiration=30.0)
    started = time.monotonic()
    try:
        assert adopter.rank(UID, announced) == 2
    finally:
        channels.close()
    assert time.monotonic() - started < PROBE_TIMEOUT + 1
