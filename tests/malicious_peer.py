"""A malicious DHT peer for tests: joins with its own key and tries every attack on signed records it knows.

    python -m tests.malicious_peer --initial-peers HOST:PORT --victims sig0.3.0 sig0.3.1 --owner HEX

Its node id is the closest to the record key of the victims' last prefix, so it is one of that record's replicas
and every client reads from it. Once the owner's entries have reached every other replica (ownership is first come,
first served at each replica), it sends hijacks, forgeries, re-dated, re-issued, moved, replayed, unsigned and
far-future entries, and attacks on the shared prefix claims, straight to every other replica with raw protocol
calls; then it poisons its own storage (a hijacking entry signed by its own key for the first victim, one forged in
the owner's name for the second), which it serves until killed, and floods one replica with stores and junk. It
prints ``attack results {json}``: per attack, what the replicas answered (True means a replica accepted it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

import umsgpack
from kademlia.node import Node
from kademlia.utils import digest

from dmoe.dht.config import DHTConfig
from dmoe.dht.messages import parse_find_value_reply, record_to_wire
from dmoe.dht.node import DHTNode, parse_endpoint
from dmoe.dht.signing import Identity
from dmoe.dht.storage import Entry, Record
from dmoe.dht.transport import HEADER_BYTES, REQUEST
from dmoe.uid import strict_prefixes

EVIL = "10.66.6.6:666"


async def read_raw(node: DHTNode, replica: Node, key: bytes) -> Record:
    """What ``replica`` holds for ``key``, signatures unchecked (the attacker wants honest entries to replay)."""
    ok, data = await node.protocol.call_find_value(replica, Node(key))
    if not ok:
        return {}
    record, _ = parse_find_value_reply(data, key, lambda *entry: True)
    return record


async def store(node: DHTNode, replicas: list[Node], key: bytes, record: Record) -> list[Any]:
    replies = await asyncio.gather(*(node.protocol.call_store(replica, key, record) for replica in replicas))
    return [result for reply in replies for result in reply]


async def attack(args: argparse.Namespace) -> dict[str, list[Any]]:
    prefix, first = strict_prefixes(args.victims[0])[-1]
    layer, shared = strict_prefixes(args.victims[0])[0]
    shared = str(shared)
    subkeys = [strict_prefixes(uid)[-1][1] for uid in args.victims]
    key, layer_key = digest(prefix), digest(layer)
    owner = bytes.fromhex(args.owner)
    me = Identity()
    node = DHTNode(DHTConfig(), node_id=(int.from_bytes(key, "big") ^ 1).to_bytes(20, "big"), identity=me)
    await node.listen(0)
    if not await node.bootstrap([parse_endpoint(peer) for peer in args.initial_peers]):
        raise ConnectionError("no initial peer answered")
    replicas = [n for n in await node.find_replicas(key) if n.id != node.node.id]
    layer_replicas = [n for n in await node.find_replicas(layer_key) if n.id != node.node.id]
    # Ownership is first come, first served at each replica, so a replica that joined after the owner's last
    # store (the test's own client, started just before this process) is not yet an honest replica; wait for the
    # owner's refresh to reach every replica, then attack. Capture an honest entry of the first victim on the way.
    deadline = time.monotonic() + 30
    while True:
        held = [await read_raw(node, replica, key) for replica in replicas]
        owned = [all(subkey in record and record[subkey].owner == owner for subkey in subkeys) for record in held]
        if all(owned) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    honest = next((record[first] for record, ok in zip(held, owned) if ok), None)
    if honest is None:
        raise RuntimeError("no replica holds the owner's entries: nothing honest to attack")
    later = time.time() + 60
    # issued a second ahead: newer than whatever the owner issued by now, so replicas must check the signature
    ahead_us = int(time.time() * 1_000_000) + 1_000_000
    results: dict[str, list[Any]] = {}
    results["hijack"] = await store(node, replicas, key, {
        subkey: me.entry(key, subkey, EVIL, later) for subkey in subkeys})
    results["forged"] = await store(node, replicas, key, {
        subkey: Entry(EVIL, later, owner, os.urandom(64), ahead_us) for subkey in subkeys})
    results["redated"] = await store(node, replicas, key, {first: honest._replace(expiration=later + 1000,
                                                                                   issued_us=ahead_us)})
    results["reissued"] = await store(node, replicas, key, {first: honest._replace(issued_us=ahead_us)})
    results["moved"] = await store(node, replicas, key, {first + 1000: honest})
    results["moved"] += await store(node, replicas, digest(prefix + ".0"), {first: honest})
    results["unsigned"] = await store(node, replicas, key, {subkey: Entry(EVIL, later) for subkey in subkeys})
    results["far_future"] = await store(node, replicas, key, {
        first + 2000: me.entry(key, first + 2000, EVIL, time.time() + 1e6)})
    results["prefix_unsigned"] = await store(node, layer_replicas, layer_key, {shared: Entry(EVIL, later)})
    results["prefix_forged"] = await store(node, layer_replicas, layer_key, {
        shared: Entry(EVIL, later, owner, os.urandom(64))})
    # a validly signed but short claim: accepted as "covered", and must not shorten the honest servers' claim
    results["prefix_short_claim"] = await store(node, layer_replicas, layer_key, {
        shared: me.entry(layer_key, shared, EVIL, time.time() + 0.5)})
    # replay: once the owner has refreshed, the captured (older) entry must not roll the refresh back
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = [(await read_raw(node, replica, key)).get(first) for replica in replicas]
        if any(entry is not None and entry.issued_us > honest.issued_us for entry in held):
            break
        await asyncio.sleep(0.2)
    results["replay"] = await store(node, replicas, key, {first: honest})
    # poison what this node serves: clients read it as one of the record's replicas
    node.storage.data.setdefault(key, {})[subkeys[0]] = me.entry(key, subkeys[0], EVIL, time.time() + 3000)
    if len(subkeys) > 1:
        node.storage.data[key][subkeys[1]] = Entry(EVIL, time.time() + 3000, owner, os.urandom(64))
    await flood(node, replicas[0], me)
    print(f"attack results {json.dumps(results)}", flush=True)
    return results


async def flood(node: DHTNode, target: Node, me: Identity, count: int = 2000) -> None:
    """Stores of junk records under random keys (validly signed) and junk datagrams, as fast as they go out."""
    assert node.protocol is not None and node.protocol.transport is not None
    address = (target.ip, target.port)
    for index in range(count):
        junk_key = os.urandom(20)
        entry = me.entry(junk_key, index, EVIL, time.time() + 600)
        payload = umsgpack.packb(["store", [node.node.id, junk_key, record_to_wire({index: entry})]])
        node.protocol.transport.sendto(REQUEST + os.urandom(HEADER_BYTES - 1) + payload, address)
        node.protocol.transport.sendto(os.urandom(index % 300), address)
        if index % 100 == 0:
            await asyncio.sleep(0)  # let the socket drain


async def main(args: argparse.Namespace) -> None:
    await attack(args)
    await asyncio.Event().wait()  # keep serving the poisoned record until killed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--victims", nargs="+", required=True, help="uids of one last prefix, first one replayed")
    parser.add_argument("--owner", required=True, help="the victims' owner's public key (hex)")
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    asyncio.run(main(parser.parse_args()))
