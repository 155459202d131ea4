"""Client mode with real node processes on 127.0.0.1: a node that asks but never answers (a trainer or monitor
behind NAT) stores and reads through the swarm, is in no other node's routing table, is named in no reply, and
answers nothing: not a ping, not a store.

Seven nodes in three processes; the client-mode node and two ordinary ones (a witness that does what the client
does, and an inspector that asks every node for its contacts) run in the test process.
"""
from __future__ import annotations

import re
import time
from typing import Iterator

import pytest
from kademlia.utils import digest

from dmoe.dht import DHT, DHTConfig, parse_endpoint
from dmoe.dht.messages import record_to_wire
from tests.procs import Proc, processes
from tests.test_dht import start_nodes


def node_endpoints(proc: Proc) -> list[str]:
    """Every node of a ``dmoe-dht`` process, from its readiness line."""
    (line,) = [line for line in proc.output if "listening on" in line]
    return re.findall(r"\d+\.\d+\.\d+\.\d+:\d+", line)


@pytest.fixture(scope="module")
def swarm() -> Iterator[dict]:
    with processes() as procs:
        boot, members = start_nodes(procs, 2, 3)
        yield {"peer": boot.endpoint(),
               "endpoints": [boot.endpoint()] + [endpoint for member in members for endpoint in node_endpoints(member)]}


def contacts(inspector: DHT, endpoint: str, target: bytes) -> list[tuple[bytes, str, int]]:
    """The contacts the node at ``endpoint`` names in its find_node reply: its whole routing table (bar the asker) in
    this swarm, which is smaller than ``ksize``."""
    ok, reply = inspector.run_coroutine(inspector.node.protocol.request(
        parse_endpoint(endpoint), "find_node", inspector.node.node.id, target))
    assert ok, f"{endpoint} did not answer"
    return [(node_id, ip, port) for node_id, ip, port in reply]


def test_a_client_mode_node_stores_and_reads_through_the_swarm_but_is_nobodys_contact(swarm):
    peer = swarm["peer"]
    with DHT([peer], client_mode=True) as client, DHT([peer]) as witness, DHT([peer]) as inspector:
        assert client.config.client_mode and not witness.config.client_mode
        expires = time.time() + 60
        keys = [f"cm.{i}" for i in range(8)]
        for subkey, writer in [(1, client), (2, witness)]:  # the same traffic: every node hears from both
            results = writer.store_many({key: {subkey: (writer.endpoint, expires)} for key in keys})
            assert all(result is True for record in results.values() for result in record.values()), results
        for reader in (client, witness):
            for key, record in reader.get_many(keys).items():
                assert {subkey: (entry.value, entry.owner) for subkey, entry in record.items()} == {
                    1: (client.endpoint, client.identity.public_key),
                    2: (witness.endpoint, witness.identity.public_key)}, key
        assert len(client.node.storage) == 0, "a client-mode node stored records"

        client_id, client_address = client.node.node.id, parse_endpoint(client.endpoint)
        near_client = client_id[:-1] + bytes([client_id[-1] ^ 1])  # the client would be the closest contact named
        for endpoint in swarm["endpoints"]:
            named = contacts(inspector, endpoint, near_client)
            assert witness.node.node.id in {node_id for node_id, _, _ in named}, \
                f"{endpoint} does not name the witness: this check could not see the client either"
            assert client_id not in {node_id for node_id, _, _ in named}, f"{endpoint} has the client-mode node"
            assert client_address not in {(ip, port) for _, ip, port in named}, f"{endpoint} names its address"
        # and the client's own view of the swarm is whole: it learnt every node from their replies
        assert {f"{node.ip}:{node.port}" for node in client.node.protocol.router.contacts()} >= set(swarm["endpoints"])


def test_a_client_mode_node_answers_no_request_and_nobody_can_join_through_it(swarm):
    quick = DHTConfig(rpc_timeout=0.5)
    with DHT([swarm["peer"]], config=DHTConfig(client_mode=True)) as client, \
            DHT([swarm["peer"]], config=quick) as other:
        address, me = parse_endpoint(client.endpoint), other.node.node.id
        key = digest("cm.direct")
        entry = other.identity.entry(key, 1, "o:1", time.time() + 60)
        for name, args in [("ping", [me]), ("store", [me, key, record_to_wire({1: entry})]), ("find_node", [me, key]),
                           ("find_value", [me, key]), ("find_values", [me, [key]])]:
            assert other.run_coroutine(other.node.protocol.request(address, name, *args)) == (False, None), name
        assert len(client.node.storage) == 0
        with pytest.raises(ConnectionError, match="none of the initial DHT peers"):
            DHT([client.endpoint], config=quick)
