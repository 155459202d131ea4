"""In-process DHT nodes for tests of the node's own logic: several nodes on the test's event loop."""
from __future__ import annotations

from dmoe.dht.config import DHTConfig
from dmoe.dht.node import DHTNode


async def in_process_swarm(count: int, config: DHTConfig) -> list[DHTNode]:
    """``count`` nodes listening on 127.0.0.1, all joined through the first; the caller stops them."""
    nodes = [DHTNode(config) for _ in range(count)]
    addresses = [await node.listen(0) for node in nodes]
    for node in nodes[1:]:
        await node.bootstrap([addresses[0]])
    return nodes
