"""The protocol's handlers: a newcomer closest to a key is handed its record."""
from __future__ import annotations

import asyncio
import time

from kademlia.utils import digest

from dmoe.dht.config import DHTConfig
from dmoe.dht.node import DHTNode


def test_a_newcomer_closest_to_a_key_is_handed_its_record():
    """Stock ``welcome_if_new`` hashes stored (already hashed) keys again and so hands records to the wrong nodes."""

    async def scenario() -> None:
        config = DHTConfig(num_replicas=2)
        nodes = [DHTNode(config) for _ in range(12)]
        addresses = [await node.listen(0) for node in nodes]
        try:
            for node in nodes[1:]:
                await node.bootstrap([addresses[0]])
            keys = [f"ffn{i}" for i in range(4)]
            for key in keys:
                entry = nodes[3].identity.entry(digest(key), 5, f"{key}:1", time.time() + 60)
                assert await nodes[3].set(key, {5: entry})
            newcomers = []
            for key in keys:
                closest_id = (int.from_bytes(digest(key), "big") ^ 1).to_bytes(20, "big")
                newcomers.append(DHTNode(config, node_id=closest_id))
                nodes.append(newcomers[-1])
                await newcomers[-1].listen(0)
                await newcomers[-1].bootstrap([addresses[5]])
            deadline = time.monotonic() + 5
            for key, newcomer in zip(keys, newcomers):
                while newcomer.storage.get(digest(key)) is None:
                    assert time.monotonic() < deadline, f"{key} never reached the node closest to it"
                    await asyncio.sleep(0.05)
                assert newcomer.storage.get(digest(key))[5][0] == f"{key}:1"
        finally:
            for node in nodes:
                node.stop()

    asyncio.run(scenario())
