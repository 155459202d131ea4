"""A Kademlia DHT of signed, expiring records (subclasses of the ``kademlia`` package).

``DHT`` is the synchronous node (its asyncio loop lives in a thread it owns): ``store``/``store_many`` write signed
entries ``record[key][subkey] = value`` until an absolute expiration, ``get``/``get_many`` read the live ones.
``Identity`` is the key pair that signs them; ``DHTConfig`` holds the knobs. What the records mean is up to the
rooms above (:mod:`dmoe.directory`, for one).
"""
from dmoe.dht.config import DHTConfig
from dmoe.dht.dht import DHT
from dmoe.dht.node import DHTNode, parse_endpoint
from dmoe.dht.transport import MessageTooLarge
from dmoe.dht.signing import Identity
from dmoe.dht.storage import Entry, Record, RecordFull, Subkey

__all__ = ["DHT", "DHTConfig", "DHTNode", "Entry", "Identity", "MessageTooLarge", "Record", "RecordFull", "Subkey",
           "parse_endpoint"]
