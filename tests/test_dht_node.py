"""The node's look-ups and stores in a swarm of in-process nodes: stores readers can see, searches that do not wait
for the dead, and initial peers given by name."""
from __future__ import annotations

import asyncio
import time

import pytest
from kademlia.node import Node
from kademlia.utils import digest

from dmoe.dht import DHT
from dmoe.dht.config import DHTConfig
from tests.dht_nodes import in_process_swarm
from tests.test_endpoints import needs_ipv6


def test_a_declaration_that_missed_the_nodes_readers_ask_is_stored_there_when_read_back():
    """A store lands where its own search pointed; if busy nodes made that the wrong place, readers saw nothing
    until the next refresh. ``make_readable`` reads the record back as a reader would and fills the gap."""

    async def scenario() -> None:
        config = DHTConfig(num_replicas=2, read_width=3)
        async with in_process_swarm(12, config) as nodes:
            key = "ffn0.3"
            target = Node(digest(key))
            by_distance = sorted(nodes, key=lambda node: target.distance_to(node.node))
            reader, writer = by_distance[0], by_distance[-1]  # the writer keeps no copy: it is the farthest
            entry = writer.identity.entry(digest(key), 17, "127.0.0.1:1", time.time() + 60)
            far = [contact for contact in writer.protocol.router.contacts() if contact.id != reader.node.id]
            far.sort(key=target.distance_to)
            assert await writer.store_record(key, {17: entry}, nodes=far[-2:]) == [True]  # the far end
            holders = [node for node in nodes if node.storage.get(digest(key)) is not None]
            assert {node.node.id for node in holders} == {contact.id for contact in far[-2:]}
            assert await reader.get_record(key) == {}, "the misplaced store was visible: the scenario is wrong"
            assert await writer.make_readable(key, {17: entry}) >= 1
            assert (await reader.get_record(key))[17] == entry
            assert await writer.make_readable(key, {17: entry}) == 0  # nothing left to repair

    asyncio.run(scenario())


def test_searches_do_not_wait_again_for_nodes_that_already_timed_out():
    """Store searches used to wait one RPC timeout per dead node they met, round after round, so declarations
    after churn took longer than they live; and every look-up of an absent key waited for the dead too."""

    async def scenario() -> None:
        config = DHTConfig(rpc_timeout=3.0)
        async with in_process_swarm(16, config) as nodes:
            searcher = nodes[1]
            for node in nodes[8:]:
                node.stop()  # silent from now on, still in everyone's routing table
            keys = [digest(f"key{i}") for i in range(8)]
            await asyncio.gather(*(searcher.find_replicas(key) for key in keys))  # meets the dead: waits for them
            started = time.monotonic()
            replicas = await asyncio.gather(*(searcher.find_replicas(key) for key in keys))
            assert time.monotonic() - started < config.rpc_timeout / 2, "a store search waited for dead nodes"
            alive = {node.node.id for node in nodes[:8]}
            assert all(len(found) == 7 and {n.id for n in found} <= alive for found in replicas)  # all but itself
            started = time.monotonic()
            assert await searcher.get_records(["absent0", "absent1"]) == {"absent0": {}, "absent1": {}}
            assert time.monotonic() - started < config.rpc_timeout / 2, "a look-up of an absent key waited"

    asyncio.run(scenario())


def test_a_lookup_whose_closest_contacts_all_died_asks_the_next_ones_in_time():
    """Right after half of a swarm died, a few keys had lost every contact a reader would ask first. The
    lookup had nobody else to ask: it waited an RPC timeout and answered "no record", so beam search dropped a
    live prefix (the first search after a kill in the DHT benchmark). It now falls back to the next contacts."""

    async def scenario() -> None:
        config = DHTConfig(num_replicas=8, read_width=3, rpc_timeout=3.0)
        async with in_process_swarm(16, config) as nodes:
            key = "ffn0.5"
            target = Node(digest(key))
            by_distance = sorted(nodes, key=lambda node: target.distance_to(node.node))
            reader, writer = by_distance[-1], by_distance[-2]
            entry = writer.identity.entry(digest(key), 3, "127.0.0.1:1", time.time() + 60)
            assert await writer.store_record(key, {3: entry}) == [True]
            first_asked = reader.protocol.router.find_neighbors(target, k=config.read_width)
            assert len(first_asked) == config.read_width
            for node in nodes:
                if node.node.id in {contact.id for contact in first_asked}:
                    node.stop()  # silent from now on, still in the reader's routing table
            holders = [node for node in nodes if node.protocol.transport is not None
                       and not node.protocol.transport.is_closing() and node.storage.get(target.id)]
            assert holders, "no live replica is left: the scenario is wrong"
            started = time.monotonic()
            assert (await reader.get_record(key)).get(3) == entry
            assert time.monotonic() - started < config.rpc_timeout / 2, "the lookup waited for the dead"

    asyncio.run(scenario())


def test_initial_peers_may_be_host_names():

    with DHT() as first:
        with DHT([f"localhost:{first.endpoint.rsplit(':', 1)[1]}"]) as second:
            assert second.node.protocol.router.contacts()[0].ip == "127.0.0.1"
        with pytest.raises(ConnectionError, match="none of the initial DHT peers"):
            DHT(["no-such-host.invalid:9"])


def test_an_owned_entry_some_replicas_hold_for_another_key_is_logged_where_written_and_read(caplog):
    """A store counted as stored when any replica took it, and readers settled a contested subkey silently, a tie
    going to the later expiration (which a hijacker always signs far ahead): the owner of a uid redirected by a
    hostile node and the replicas it had poisoned saw nothing. Now both sides log it, and a tie reads as absent."""
    from dmoe.dht import Identity

    async def scenario() -> None:
        config = DHTConfig(num_replicas=4, read_width=4)
        async with in_process_swarm(4, config) as nodes:
            key = "ffn0.3"
            key_id = digest(key)
            owner, reader = nodes[0], nodes[3]
            hijacker = Identity()
            taken = hijacker.entry(key_id, 17, "10.6.6.6:666", round(time.time() + 3000, 3))
            for node in nodes[1:3]:  # two replicas hold the hijacker's entry first (a hand-over, say)
                node.storage.store(key_id, 17, *taken)
            entry = owner.identity.entry(key_id, 17, "127.0.0.1:1", round(time.time() + 60, 3))
            with caplog.at_level("WARNING", logger="dmoe.dht"):
                assert await owner.store_record(key, {17: entry}) == [True]  # the owner's own node and the reader
                assert "ffn0.3[17]: stored, but 2 replica(s) refused it" in caplog.text
                record = await reader.get_record(key)  # two machines for each owner: a tie
            assert 17 not in record, record
            assert "disagree on the owner of subkey 17 (2 votes to 2" in caplog.text and "a tie: read as absent" in \
                caplog.text

    asyncio.run(scenario())


def test_a_server_whose_uid_readers_find_under_another_key_says_so(caplog):
    """A declaration counts as stored when any replica takes it: a server whose uid most replicas held for another
    key (stored there first) went on announcing, and clients were sent to that key's endpoint unnoticed."""
    from dmoe.dht import Identity
    from dmoe.directory import announce_forever

    async def scenario() -> None:
        config = DHTConfig(num_replicas=4, read_width=4)
        async with in_process_swarm(4, config) as nodes:
            key_id = digest("ffn0.3")
            taken = Identity().entry(key_id, 17, "10.6.6.6:666", round(time.time() + 3000, 3))
            for node in nodes[1:4]:  # three of the four replicas: a majority of every read
                node.storage.store(key_id, 17, *taken)
            with caplog.at_level("INFO", logger="dmoe.directory"):
                announcing = asyncio.ensure_future(announce_forever(nodes[0], ["ffn0.3.17", "ffn0.3.16"],
                                                                    "127.0.0.1:1", refresh_period=0.2,
                                                                    expiration=5.0))
                try:
                    deadline = time.monotonic() + 10
                    while "readers find it declared by another key" not in caplog.text:
                        assert time.monotonic() < deadline, caplog.text
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.5)  # two refreshes more
                finally:
                    announcing.cancel()
            warnings = [r.getMessage() for r in caplog.records if "readers find it declared" in r.getMessage()]
            assert len(warnings) == 1 and warnings[0].startswith("ffn0.3.17: ") and "at 10.6.6.6:666" in warnings[0]

    asyncio.run(scenario())


def test_an_owner_restarted_with_a_shorter_expiration_replaces_its_entry_at_once_and_replays_of_the_old_one_fail():
    """Review 70, finding 2: one owner's entries were ordered by expiration, so a server restarted with its key, a
    new endpoint and a shorter expiration was refused everywhere as "already superseded", and readers went to its
    dead endpoint until the old entry expired (up to max_expiration). The latest issued entry wins now; a replica
    still serving (or a peer replaying) the older one, issued earlier but expiring later, changes no read."""
    from dmoe.dht import Identity

    async def scenario() -> None:
        config = DHTConfig(num_replicas=4, read_width=4)
        async with in_process_swarm(5, config) as nodes:
            key = "ffn0.3"
            key_id = digest(key)
            identity = Identity()  # what --identity keeps across restarts
            old = identity.entry(key_id, 17, "127.0.0.1:5001", round(time.time() + 900, 3))
            assert await nodes[0].store_record(key, {17: old}) == [True]
            reader = nodes[4]
            assert (await reader.get_record(key))[17].value == "127.0.0.1:5001"
            new = identity.entry(key_id, 17, "127.0.0.1:5002", round(time.time() + 30, 3))
            assert await nodes[1].store_record(key, {17: new}) == [True], "the restarted owner was refused"
            assert (await reader.get_record(key))[17] == new
            assert await nodes[2].store_record(key, {17: old}) == [False], "a replay of the old entry was stored"
            for node in nodes[:2]:  # replicas that serve the old entry anyway (stale, or hostile)
                node.storage.data.setdefault(key_id, {})[17] = old
            assert (await reader.get_record(key))[17] == new

    asyncio.run(scenario())


@needs_ipv6
def test_a_node_joins_through_an_initial_peer_written_in_any_spelling_of_its_ipv6_address():
    """Review 70, finding 3: an initial peer typed as ``[0:0:0:0:0:0:0:1]:PORT`` (or ``::0001``, or uppercase hex)
    answered every ping from ``::1``, and the replies were dropped as misdirected: ConnectionError, none of the
    initial DHT peers answered."""
    with DHT(host="::1") as first:
        port = first.endpoint.rpartition(":")[2]
        for spelling in ["0:0:0:0:0:0:0:1", "::0001", "0000:0000:0000:0000:0000:0000:0000:0001"]:
            with DHT([f"[{spelling}]:{port}"], host="::1") as joined:
                first.store("ffn9", 1, "127.0.0.1:1", time.time() + 60)
                assert joined.get("ffn9")[1].value == "127.0.0.1:1"
                contacts = joined.node.protocol.router.contacts()
                assert [(node.id, node.ip) for node in contacts] == [(first.node.node.id, "::1")]
