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
        while any(node.protocol._pinging_back for node in nodes):
            assert time.monotonic() < deadline, "the nodes' pings back were never answered"
            await asyncio.sleep(0.01)
        yield nodes
    finally:
        for node in nodes:
            node.stop()
