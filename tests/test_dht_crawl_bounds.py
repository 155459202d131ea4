"""Look-ups against a hostile peer (tests/hostile_dht_peer.py, raw datagrams from a thread) among honest in-process
nodes: every crawl ends, soon, whatever its peers answer."""
from __future__ import annotations

import asyncio
import time

from kademlia.node import Node
from kademlia.utils import digest

from dmoe.dht import crawling
from dmoe.dht.config import DHTConfig
from dmoe.dht.crawling import RecordCrawl
from dmoe.dht.node import DHTNode
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
                assert replicas
                assert (await asyncio.wait_for(reader.get_record(KEY), 10))[3] == entry
                newcomer = DHTNode(config)
                try:
                    await newcomer.listen(0)
                    assert await asyncio.wait_for(newcomer.bootstrap([address(nodes[0])]), 10)
                    await asyncio.wait_for(newcomer.get_record(KEY), 10)
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
                assert replicas and all(node.id in crawl.responded for node in replicas)
                assert len(crawl.contacted) > len(crawl.responded), "the search ended on its own"

    asyncio.run(scenario())

