"""Expert discovery over a Kademlia DHT (subclasses of the ``kademlia`` package).

``DHT`` is the synchronous node (its asyncio loop lives in a thread it owns); ``ExpertAnnouncer`` keeps a
server's experts declared, signed with its ``Identity``; ``DHTConfig`` holds the knobs.
"""
from dmoe.dht.config import DHTConfig
from dmoe.dht.dht import DHT, ExpertAnnouncer
from dmoe.dht.node import DHTNode, parse_endpoint
from dmoe.dht.protocol import MessageTooLarge
from dmoe.dht.signing import Identity
from dmoe.dht.storage import RecordFull

__all__ = ["DHT", "DHTConfig", "DHTNode", "ExpertAnnouncer", "Identity", "MessageTooLarge", "RecordFull",
           "parse_endpoint"]
