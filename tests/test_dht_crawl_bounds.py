"""Look-ups against a hostile peer (tests/hostile_dht_peer.py, raw datagrams from a thread) among honest in-process
nodes: every crawl ends, soon, whatever its peers answer, and one socket or machine holds few places in it."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest
from kademlia.node import Node
from kademlia.utils import digest

from dmoe.dht import crawling
from dmoe.dht.config import DHTConfig
from dmoe.dht.crawling import RecordCrawl
from dmoe.dht.node import DHTNode
from dmoe.dht.peers import peer_key
from dmoe.dht.signing import Identity
from tests.dht_nodes import in_process_swarm
from tests.hostile_dht_peer import HostilePeer

KEY = "ffn0.3"


def near_key(count: int) -> list[bytes]:
    """Node ids closer to KEY than any honest node's (an id costs nothing)."""
    key = int.from_bytes(digest(KEY), "big")
    return [(key ^ index).to_bytes(20, "big") for index in range(1, count + 1)]


def address(node: DHTNode) -> tuple[str, int]:
    return node.transport.get_extra_info("sockname")[:2]


async def introduce(hostile: HostilePeer, nodes: list[DHTNode], count: int | None = None) -> None:
    """Pings every node under the hostile peer's ids (the first ``count``), and waits until every node answered and
    holds one of them as a contact (routing buckets take few contacts of one machine: the peer's replies name the
    others)."""
    hostile.ping([address(node) for node in nodes], count)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if hostile.replies >= len(nodes) * len(hostile.ids[:count]) and all(
                any(not node.protocol.router.is_new_node(Node(node_id)) for node_id in hostile.ids[:count])
                for node in nodes):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the hostile ids did not enter the routing tables")


async def declare_on(writer: DHTNode, subkey: int = 3):
    entry = writer.identity.entry(digest(KEY), subkey, "127.0.0.1:7000", round(time.time() + 60, 3))
    assert await writer.store_record(KEY, {subkey: entry}) == [True]
    return entry


def read_crawl(node: DHTNode) -> RecordCrawl:
    target = Node(digest(KEY))
    return RecordCrawl(node.protocol, target, node._starting_peers(target), node.config.read_width, hedge=True)


def store_crawl(node: DHTNode) -> RecordCrawl:
    target = Node(digest(KEY))
    peers = node.protocol.router.find_neighbors(target, k=node.config.ksize)
    return RecordCrawl(node.protocol, target, peers, node.config.ksize, fetch_records=False)


def test_a_peer_naming_ever_closer_made_up_contacts_cannot_keep_a_lookup_running():
    """It answered every request with 20 new ids, each closer than the last: the frontier was never all answered,
    so reads ran until call_timeout (growing to 46k candidates), nodes could not join and an announcer's refresh
    hung until the server's experts expired."""

    async def scenario() -> None:
        config = DHTConfig()
        async with in_process_swarm(6, config) as nodes:
            entry = await declare_on(nodes[1])
            with HostilePeer("chain", ids=near_key(1)) as hostile:
                await introduce(hostile, nodes)
                reader = nodes[2]
                started = time.monotonic()
                crawl = read_crawl(reader)
                _, record = await asyncio.wait_for(crawl.run(), 10)
                assert record[3] == entry
                assert len(crawl.candidates) <= crawling.CANDIDATES_PER_WIDTH * 2 * config.ksize
                crawl = store_crawl(reader)
                replicas, _ = await asyncio.wait_for(crawl.run(), 10)
                assert {node.node.id for node in nodes} - {reader.node.id} <= {node.id for node in replicas}
                assert (await asyncio.wait_for(reader.get_record(KEY), 10))[3] == entry
                newcomer = DHTNode(config)
                try:
                    await newcomer.listen(0)
                    assert await asyncio.wait_for(newcomer.bootstrap([address(nodes[0])]), 10)
                    assert (await asyncio.wait_for(newcomer.get_record(KEY), 10))[3] == entry
                finally:
                    newcomer.stop()
                assert hostile.answered >= 5, "the hostile peer was not asked: the scenario is wrong"
                assert time.monotonic() - started < 5 * config.rpc_timeout

    asyncio.run(scenario())


def test_a_lookup_ends_at_its_deadline_whatever_its_peers_answer(monkeypatch):
    """Slow hostile peers on many sockets, each naming ever closer contacts at the next one, just before a request
    would time out: even with no bound on rounds, a store search ends DEADLINE_TIMEOUTS rpc_timeouts after it
    started (not one round per socket later), with the nodes that answered by then."""
    monkeypatch.setattr(crawling, "MAX_ROUNDS", 10 ** 6, raising=False)
    monkeypatch.setattr(crawling, "DEADLINE_TIMEOUTS", 1, raising=False)

    async def scenario() -> None:
        config = DHTConfig(rpc_timeout=1.0)
        async with in_process_swarm(4, config) as nodes:
            with HostilePeer("relay", sockets=8, delay=0.9 * config.rpc_timeout) as hostile:
                await introduce(hostile, nodes, count=1)
                crawl = store_crawl(nodes[1])
                started = time.monotonic()
                replicas, _ = await asyncio.wait_for(crawl.run(), 10)
                elapsed = time.monotonic() - started
                assert elapsed < 2.2 * config.rpc_timeout, f"the search took {elapsed:.1f}s"
                assert replicas and all(peer_key(node) in crawl.responded for node in replicas)
                assert len(crawl.contacted) > len(crawl.responded), "the search ended on its own"

    asyncio.run(scenario())


def at(hostile: HostilePeer, nodes) -> list[Node]:
    """Those of ``nodes`` at the hostile peer's sockets."""
    return [node for node in nodes if (node.ip, node.port) in hostile.addresses]


def asked(crawl: RecordCrawl) -> list[Node]:
    return [crawl.candidates[key] for key in crawl.contacted]


@pytest.mark.parametrize("hijack", [False, True], ids=["hides", "hijacks"])
def test_one_socket_under_many_ids_is_one_node_of_a_lookup(hijack):
    """Eight ids closer to a key than any honest node, all at one socket, were the whole frontier of every lookup of
    the key: readers merged only what that socket served, so it hid the key's entries, or won the vote for an
    owned subkey with its own signed entry, even right after the owner's refresh."""

    async def scenario() -> None:
        async with in_process_swarm(8, DHTConfig()) as nodes:
            entry = await declare_on(nodes[1])
            record = {3: Identity().entry(digest(KEY), 3, "10.66.6.6:666", round(time.time() + 600, 3))} \
                if hijack else {}
            with HostilePeer("sybil", ids=near_key(8), key=digest(KEY), record=record) as hostile:
                await introduce(hostile, nodes)
                for reader in nodes[2:5]:
                    crawl = read_crawl(reader)
                    nearest, got = await asyncio.wait_for(crawl.run(), 10)
                    assert got[3] == entry
                    assert len(at(hostile, nearest)) == len(at(hostile, asked(crawl))) == 1
                    crawl = store_crawl(reader)
                    replicas, _ = await asyncio.wait_for(crawl.run(), 10)
                    assert len(at(hostile, replicas)) == len(at(hostile, asked(crawl))) == 1
                    assert (await reader.get_record(KEY))[3] == entry
                assert hostile.answered, "the hostile peer was not asked: the scenario is wrong"

    asyncio.run(scenario())


def local_ipv4() -> str | None:
    """An IPv4 address of this machine other than loopback, if it has one."""
    for probe_address in ("192.0.2.1", "10.255.255.255", "8.8.8.8"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((probe_address, 9))  # picks a route and a source address; sends nothing
            except OSError:
                continue
            host = probe.getsockname()[0]
            if not host.startswith("127."):
                return host
    return None


def test_one_machine_holds_at_most_two_places_in_a_lookup():
    """Ids on several sockets of one machine (one address that is not this host's loopback, as a remote attacker
    would have) are counted per machine: at most FRONTIER_PER_MACHINE of them among the closest a lookup returns,
    so the honest replicas still outvote them."""
    host = local_ipv4()
    if host is None:
        pytest.skip("this machine has no IPv4 address but loopback")

    async def scenario() -> None:
        async with in_process_swarm(8, DHTConfig()) as nodes:
            entry = await declare_on(nodes[1])
            record = {3: Identity().entry(digest(KEY), 3, "10.66.6.6:666", round(time.time() + 600, 3))}
            with HostilePeer("sybil", host=host, sockets=6, ids=near_key(6), key=digest(KEY),
                             record=record) as hostile:
                await introduce(hostile, nodes)
                reader = nodes[2]
                crawl = read_crawl(reader)
                nearest, got = await asyncio.wait_for(crawl.run(), 10)
                assert got[3] == entry
                assert len(at(hostile, nearest)) == crawling.FRONTIER_PER_MACHINE
                assert len(at(hostile, asked(crawl))) <= crawling.ASKS_PER_MACHINE
                crawl = store_crawl(reader)
                replicas, _ = await asyncio.wait_for(crawl.run(), 10)
                assert len(at(hostile, replicas)) == crawling.FRONTIER_PER_MACHINE
                assert len(replicas) == len(nodes) - 1 + crawling.FRONTIER_PER_MACHINE

    asyncio.run(scenario())


def test_made_up_contacts_at_one_address_that_never_answers_cost_a_lookup_one_request():
    """A peer naming 20 fresh ids at a socket that never answers, in every reply: a lookup asks one of them (the
    address is one node, and it is silent), not all 20."""

    async def scenario() -> None:
        config = DHTConfig(rpc_timeout=0.5)
        async with in_process_swarm(6, config) as nodes:
            entry = await declare_on(nodes[1])
            with HostilePeer("dead", ids=near_key(1)) as hostile:
                await introduce(hostile, nodes)
                silent = hostile.silent.getsockname()[:2]
                reader = nodes[2]
                for crawl in (store_crawl(reader), read_crawl(reader)):
                    started = time.monotonic()
                    _, got = await asyncio.wait_for(crawl.run(), 10)
                    assert sum((node.ip, node.port) == silent for node in asked(crawl)) == 1
                    assert time.monotonic() - started < 2 * config.rpc_timeout
                assert got[3] == entry
                assert hostile.answered >= 2, "the hostile peer was not asked: the scenario is wrong"

    asyncio.run(scenario())


def test_the_owner_vote_of_a_read_counts_machines_not_replies():
    """Two ids of one machine among the four closest nodes a read merges, each serving that machine's own signed
    entry for an owned subkey, against two honest replicas: counted per reply the vote was a tie, which the later
    expiration (the hijacker's) won; counted per machine the honest owner wins two to one."""
    host = local_ipv4()
    if host is None:
        pytest.skip("this machine has no IPv4 address but loopback")

    async def scenario() -> None:
        async with in_process_swarm(8, DHTConfig(read_width=4)) as nodes:
            entry = await declare_on(nodes[1])
            record = {3: Identity().entry(digest(KEY), 3, "10.66.6.6:666", round(time.time() + 600, 3))}
            with HostilePeer("sybil", host=host, sockets=6, ids=near_key(6), key=digest(KEY),
                             record=record) as hostile:
                await introduce(hostile, nodes)
                for reader in nodes[2:5]:
                    crawl = read_crawl(reader)
                    nearest, got = await asyncio.wait_for(crawl.run(), 10)  # (without this node's own record)
                    assert len(at(hostile, nearest)) == crawling.FRONTIER_PER_MACHINE == 2
                    assert len(nearest) == 4 and got[3] == entry

    asyncio.run(scenario())
