"""In-process DHT nodes for tests of the node's own logic: several nodes on the test's event loop."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from dmoe.dht.config import DHTConfig
from dmoe.dht.node import DHTNode


@contextlib.asynccontextmanager
async def in_process_swarm(count: int, config: DHTConfig) -> AsyncIterator[list[DHTNode]]:
    """``count`` nodes listening on 127.0.0.1, all joined through the first, each in the tables of the nodes it asked
    (which add it once it answered their ping back); stopped on exit."""
    nodes = [DHTNode(config) for _ in range(count)]
    try:
        addresses = [await node.listen(0) for node in nodes]
        for node in nodes[1:]:
            await node.bootstrap([addresses[0]])
        deadline = time.monotonic() + 10
        while not tables_agree(nodes):
            assert time.monotonic() < deadline, "the nodes' pings back were never answered"
            await asyncio.sleep(0.01)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def tables_agree(nodes: list[DHTNode]) -> bool:
    """Whether each node holds every node that holds it: a node holds another only after a request between them,
    and the other pings back an asker it does not hold yet (pings back keep no state to wait on: review 101 D2)."""
    held = {node.node.id: {contact.id for contact in node.protocol.router.contacts()} for node in nodes}
    return all(asker in held[node_id] for asker, contacts in held.items() for node_id in contacts if node_id in held)
