"""Settings of a DHT node, in one dataclass so programs can expose them as flags."""
from __future__ import annotations

from dataclasses import dataclass

#: the largest socket_buffer_bytes: the kernel takes it as a C int
MAX_SOCKET_BUFFER_BYTES = 2**31 - 1


#: bytes of a find_value reply of a full record besides its entries (measured: 27, with room to spare)
FULL_REPLY_BYTES = 64
#: bytes of one entry in a find_value reply besides its value: owner key, signature, subkey, expiration, JSON
#: (measured: 148 for an int subkey; a str one of 10 characters takes 2 more)
ENTRY_REPLY_BYTES = 152


@dataclass
class DHTConfig:
    """Knobs of a dmoe DHT node.

    ksize: routing-table bucket size (Kademlia's k for routing).
    num_replicas: how many of the nodes closest to a key store its record. A record survives as long as one
        replica does: when half of the nodes die at once, a given record is lost with probability 2**-num_replicas,
        and a swarm holds many records.
    read_width: lookups merge what this many of the closest *responding* nodes hold. After nodes die, the closest
        live nodes are still among the original replicas, so reads need not ask all of them.
    alpha: parallelism of the node-finding crawls used by bootstrap.
    rpc_timeout: seconds to wait for one UDP reply before the peer counts as dead (and is evicted). Stock's 5 s
        made every lookup touching a dead node wait 5 s; reads here do not wait for it at all (see hedge_after),
        so this only needs to be long enough that a live node on a busy machine is not declared dead: a false
        death makes a store skip a replica that reads will ask.
    default_expiration: lifetime (seconds) of an entry when the caller gives none.
    max_expiration: the furthest ahead (seconds) an entry may expire, so no record outlives its owner by long. Nodes
        refuse signed entries expiring later (re-dating one would break its signature; only unsigned ones, which
        nodes refuse anyway, could be capped), and :meth:`DHT.store_many` raises ValueError for them before sending.
    max_record_subkeys: a record keeps at most this many subkeys, which keeps its reply within one datagram; stores
        beyond it are refused with an error the writer sees.
    max_value_bytes: longest value a record entry may carry. With each entry's 96 bytes of owner key
        and signature, this is what keeps a 256-subkey record's reply within one datagram.
    max_records: most records (keys) a node stores; stores of new keys beyond it are refused, so a flood of stores
        cannot exhaust a node's memory.
    max_entries: most entries (subkeys) of all its records together a node stores; stores of new ones beyond it are
        refused. Records times subkeys alone let a flood fill ~7 GiB; 2**19 entries of at most 96 bytes of value
        and 96 of key and signature are about 300 MB of Python objects, and a swarm's directory needs about one
        entry per expert (shared out over the nodes). A flood of entries that expire at once and are stored again
        also fills the memory of expired entries (as many again, at most: ~450 MB with the live ones), and with its
        caches (signatures checked, replies) a node at every cap holds about 600 MB (measured, review 97): lower
        ``max_entries`` (``dmoe-dht --max-entries``) on a machine with less memory to spare.
    sender_share: once a node holds half of ``max_records`` or ``max_entries``, one sending machine (an IPv4
        address, an IPv6 /64; not this host) gets no new record or entry there beyond this share of the cap, so one
        flooding machine cannot lock honest writers out (:class:`dmoe.dht.storage.RecordStorage`).
    hedge_after: a lookup query unanswered for this long no longer holds the lookup up: the next closest node is
        asked too, and the lookup may finish without the slow one (its answer is still used if it comes in time).
    dead_node_ttl: a node that failed to answer is skipped by lookups for this long (unless it contacts us first),
        so nodes learnt from peers' stale routing tables do not cost a timeout in every lookup after churn.
    read_repair: a lookup stores what it found on those of the closest nodes that lacked it, so records whose
        replicas died are re-replicated by the first read instead of waiting for their owner's next refresh.
    max_concurrent_rpcs: requests a node keeps in flight at once; more wait their turn, so a burst of look-ups
        does not overflow the socket buffer with replies and mistake its own backlog for dead peers.
    socket_buffer_bytes: UDP receive buffer requested from the kernel (capped by net.core.rmem_max).
    routing_refresh_period: seconds between refreshes of lonely routing-table buckets.
    call_timeout: upper bound (seconds) on one synchronous facade call.
    client_mode: a node that asks but never answers (a trainer or a monitor behind NAT, which others could not
        reach): it serves no request and stores nothing, and its requests carry no node id, so other nodes never
        take it as a contact (never add it to their routing tables, never name it in their replies).
    """

    ksize: int = 20
    num_replicas: int = 10
    read_width: int = 5
    alpha: int = 3
    rpc_timeout: float = 1.0
    hedge_after: float = 0.1
    dead_node_ttl: float = 30.0
    read_repair: bool = True
    max_concurrent_rpcs: int = 256
    socket_buffer_bytes: int = 4 << 20
    default_expiration: float = 60.0
    max_expiration: float = 3600.0
    max_record_subkeys: int = 256
    max_value_bytes: int = 96
    max_records: int = 1 << 16
    max_entries: int = 1 << 19
    sender_share: float = 1 / 16
    routing_refresh_period: float = 600.0
    call_timeout: float = 60.0
    client_mode: bool = False

    def __post_init__(self) -> None:
        if self.ksize < 1 or self.num_replicas < 1 or self.read_width < 1 or self.alpha < 1:
            raise ValueError("ksize, num_replicas, read_width and alpha must be positive")
        # (not x > 0: NaN compares False both ways, and a node with NaN expirations started and stored nothing)
        bad = [name for name in ("rpc_timeout", "default_expiration", "max_expiration") if not getattr(self, name) > 0]
        if bad:
            raise ValueError(f"{', '.join(bad)} must be positive")
        finite = ("rpc_timeout", "hedge_after", "dead_node_ttl", "routing_refresh_period", "call_timeout",
                  "default_expiration", "max_expiration")
        bad = [name for name in finite if not 0 <= getattr(self, name) < float("inf")]
        if bad:
            raise ValueError(f"{', '.join(bad)} must be finite and >= 0")
        if self.routing_refresh_period <= 0 or self.call_timeout <= 0:
            raise ValueError("routing_refresh_period and call_timeout must be positive")
        at_least_one = ("max_concurrent_rpcs", "max_record_subkeys", "max_value_bytes", "max_records", "max_entries")
        if not 0 < self.sender_share <= 1:
            raise ValueError(f"sender_share must be in (0, 1], got {self.sender_share}")
        bad = [name for name in at_least_one if getattr(self, name) < 1]
        if bad or self.socket_buffer_bytes < 0:
            raise ValueError(f"{', '.join(bad) or 'socket_buffer_bytes'} must be at least {1 if bad else 0}")
        from dmoe.dht.transport import HEADER_BYTES, MAX_DATAGRAM_BYTES  # (it imports this module)
        full = FULL_REPLY_BYTES + self.max_record_subkeys * (self.max_value_bytes + ENTRY_REPLY_BYTES)
        if full > MAX_DATAGRAM_BYTES - HEADER_BYTES:
            # anyone may fill a record: its reply, over one datagram, was replaced by an error, and its honest entries
            # were lost with the others to every reader (review 97)
            raise ValueError(f"max_record_subkeys ({self.max_record_subkeys}) x max_value_bytes "
                             f"({self.max_value_bytes}): a full record's reply would take up to {full} bytes, over "
                             f"one datagram's {MAX_DATAGRAM_BYTES - HEADER_BYTES}")
        if self.socket_buffer_bytes > MAX_SOCKET_BUFFER_BYTES:  # setsockopt takes a C int (a bigger one: TypeError)
            raise ValueError(f"socket_buffer_bytes must be at most {MAX_SOCKET_BUFFER_BYTES}, got "
                             f"{self.socket_buffer_bytes}")
