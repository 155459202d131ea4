"""A node cut off from the swarm joins it again (review 97 D1): a few seconds of silence from its contacts (a network
blip, a paused or restarted bootstrap node) evicted every one of them, and a node with no contact never rejoined: a
client-mode node (a trainer, a monitor) is nobody's contact, so nothing could refill its table, and every read came
back empty for good; a full node's stores landed on itself alone.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Iterator

import pytest
from kademlia.utils import digest

from dmoe.dht import DHT, DHTConfig, parse_endpoint
from dmoe.dht import node as node_module
from dmoe.dht.node import DHTNode
from dmoe.dht.peers import EVICT_AFTER_FAILURES, peer_key
from tests.dht_nodes import in_process_swarm
from tests.procs import processes
from tests.test_dht import dht_proc, wait_until

FAST = DHTConfig(rpc_timeout=0.3)
REJOIN_PERIOD = 1.0
#: how long a node cut off from live peers may take to read again: a few attempts to join
REJOINED_WITHIN = 5 * REJOIN_PERIOD


@pytest.fixture(autouse=True)
def fast_rejoin(monkeypatch) -> Iterator[None]:
    monkeypatch.setattr(node_module, "REJOIN_PERIOD", REJOIN_PERIOD, raising=False)
    yield


def read_through_an_outage(dht: DHT, key: str) -> None:
    """Reads ``key`` every 50 ms (as a trainer's beam search does) for long enough that a silent contact would be
    evicted."""
    outage_ends = time.monotonic() + (EVICT_AFTER_FAILURES + 1) * FAST.rpc_timeout
    while time.monotonic() < outage_ends:
        dht.get(key)
        time.sleep(0.05)


def address(node: DHTNode) -> tuple[str, int]:
    return node.protocol.transport.get_extra_info("sockname")[:2]


def hold(node: DHTNode, key: str) -> None:
    """Stores ``key``'s entry 1 ("hello") on ``node`` alone."""
    key_id = digest(key)
    node.storage.store(key_id, 1, "hello", *node.identity.entry(key_id, 1, "hello", time.time() + 60)[1:])


async def read_within(reader: DHTNode, seconds: float, failure: str) -> None:
    """Reads ``ffn0`` every 50 ms until it holds entry 1 (see :func:`hold`), for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while 1 not in await reader.get_record("ffn0"):
        assert time.monotonic() < deadline, failure
        await asyncio.sleep(0.05)


def test_a_client_mode_node_reads_again_once_its_only_peer_paused_through_several_reads_is_back(caplog):
    with processes() as procs, caplog.at_level(logging.INFO, logger="dmoe.dht.node"):
        boot = dht_proc(procs)
        with DHT([boot.endpoint()], config=FAST, client_mode=True) as trainer:
            assert trainer.store("ffn0", 1, "hello", time.time() + 60)  # held by the paused node alone
            os.kill(boot.popen.pid, signal.SIGSTOP)
            try:
                read_through_an_outage(trainer, "ffn0")
            finally:
                os.kill(boot.popen.pid, signal.SIGCONT)
            wait_until(lambda: 1 in trainer.get("ffn0"), REJOINED_WITHIN,
                       "the trainer did not read the record again after its peer came back")
            assert logged(caplog, logging.WARNING, "none of its 1 contacts answers") == 1  # once, not per read
            assert logged(caplog, logging.INFO, "back in the swarm") == 1


def logged(caplog, level: int, text: str) -> int:
    return sum(record.levelno == level and text in record.getMessage() for record in caplog.records)


def test_a_server_node_whose_bootstrap_node_restarted_at_its_address_is_found_again():
    with processes() as procs:
        boot = dht_proc(procs)
        peer = boot.endpoint()
        with DHT([peer], config=FAST) as server:
            boot.kill()
            read_through_an_outage(server, "ffn0")  # (an announcer's refreshes look keys up meanwhile)
            dht_proc(procs, "--port", str(parse_endpoint(peer)[1])).endpoint()
            assert server.store("ffn0.3", 17, "10.0.0.5:5000", time.time() + 60)
            with DHT([peer], config=FAST, client_mode=True) as trainer:
                wait_until(lambda: 17 in trainer.get("ffn0.3"), REJOINED_WITHIN,
                           "a trainer joining through the restarted node never found the server's entry")


def test_a_node_whose_last_contact_is_gone_joins_again_through_its_initial_peer():
    """Its one contact left is not its initial peer (that one was evicted while unreachable) and is gone for good:
    only joining through its initial peer again gets the node back."""

    async def scenario() -> None:
        async with in_process_swarm(2, FAST) as (first, gone):
            reader = DHTNode(FAST, client_mode=True)
            try:
                await reader.listen(0)
                await reader.bootstrap([address(first)])
                hold(first, "ffn0")
                router = reader.protocol.router
                router.remove_contact(next(contact for contact in router.contacts() if contact.id == first.node.id))
                gone.stop()
                await read_within(reader, REJOINED_WITHIN, "the node never joined its initial peer again")
            finally:
                reader.stop()

    asyncio.run(scenario())


def test_a_node_cut_off_from_a_dead_initial_peer_reads_at_once_and_pings_it_a_few_times_a_period(caplog):
    """Only the first read, before the node knew its contacts silent, waits for them; the initial peer is pinged
    in the background, at most once per REJOIN_FIRST however often the node reads."""

    async def scenario() -> None:
        async with in_process_swarm(2, FAST) as (first, other):
            reader = DHTNode(FAST, client_mode=True)
            try:
                await reader.listen(0)
                await reader.bootstrap([address(first)])
                initial_peer = address(first)
                first.stop()
                other.stop()
                attempts = []  # pings of the initial peer
                request = reader.protocol.request

                async def counted(to, name, *args, **kwargs):
                    if to == initial_peer and name == "ping":
                        attempts.append(time.monotonic())
                    return await request(to, name, *args, **kwargs)

                reader.protocol.request = counted
                waited, started = 0, time.monotonic()
                for _ in range(60):  # a trainer reading every 50 ms
                    before = time.monotonic()
                    assert await reader.get_record("ffn0") == {}
                    waited += time.monotonic() - before > FAST.rpc_timeout / 2
                    await asyncio.sleep(0.05)
                elapsed = time.monotonic() - started
                assert waited <= 1
                # (a read REJOIN_FIRST after the last attempt at most: review 101)
                assert 2 <= len(attempts) <= 2 + elapsed / node_module.REJOIN_FIRST, (len(attempts), elapsed)
                assert logged(caplog, logging.WARNING, "none of its") == 1
            finally:
                reader.stop()

    asyncio.run(scenario())


def test_a_read_of_a_node_cut_off_for_long_tries_to_join_again_at_once_not_after_its_backoff(monkeypatch):
    """Backed off to REJOIN_PERIOD (5 s) after a long outage, a cut-off node's reads found nothing for up to that
    long after its peer was back, and said so to nobody (review 101): a read tries again REJOIN_FIRST after the last
    attempt."""
    async def scenario() -> None:
        monkeypatch.setattr(node_module, "REJOIN_PERIOD", 5.0)  # (the default: the fixture's would hide the wait)
        async with in_process_swarm(1, FAST) as (first,):
            reader = DHTNode(FAST, client_mode=True)
            try:
                await reader.listen(0)
                await reader.bootstrap([address(first)])
                hold(first, "ffn0")
                # as after a long outage: every contact silent, many attempts failed, the last one a second ago
                for contact in reader.protocol.router.contacts():
                    for _ in range(EVICT_AFTER_FAILURES - 1):
                        reader.protocol.peers.failed(peer_key(contact))
                reader._cut_off, reader._failed_rejoins = True, 10
                reader._last_rejoin = reader.protocol.clock() - 1.0
                await read_within(reader, 2.0, "the read waited out the backoff")
            finally:
                reader.stop()

    asyncio.run(scenario())


def test_a_node_given_its_own_address_among_its_initial_peers_is_not_its_own_contact(caplog):
    """Counted as a contact, a node itself hid the loss of its last real one: that one was evicted as not the last,
    no cut-off was noticed, and the node's look-ups asked only itself from then on; and a node whose only initial
    peer was itself (one list handed to every node, the bootstrap node included) warned it was cut off every 0.5 s
    (review 101)."""
    async def scenario() -> None:
        async with in_process_swarm(1, FAST) as (first,):
            node = DHTNode(FAST)
            try:
                await node.listen(0)
                await node.bootstrap([address(first), address(node)])
                assert [contact.id for contact in node.protocol.router.contacts()] == [first.node.id]
            finally:
                node.stop()
        alone = DHTNode(FAST)
        try:
            await alone.listen(0)
            await alone.bootstrap([address(alone)])
            await asyncio.sleep(4 * node_module.REJOIN_FIRST)
            assert alone.initial_peers == [] and alone.protocol.router.contacts() == []
        finally:
            alone.stop()

    with caplog.at_level(logging.INFO, logger="dmoe.dht.node"):
        asyncio.run(scenario())
    assert logged(caplog, logging.WARNING, "none of its") == 0
