"""The DHT protocol: the ``rpc_*`` handlers a node serves and the ``call_*`` wrappers that ask them.

The RPCs are stock Kademlia's (ping, store, find_node, find_value) plus ``find_values``, several keys' find_value in
one datagram. Stock ``KademliaProtocol`` stores one opaque value per request (refused above ~8 KB); here a store
carries ``(subkey, value, expiration, owner, signature, issued_us)`` entries, chunked to fit requests, and signed
entries are verified before they are stored. Underneath: :mod:`~dmoe.dht.transport` (datagrams, timeouts, budgets), :mod:`~dmoe.dht.messages` (what
the messages carry), :mod:`~dmoe.dht.peers` (who failed to answer).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from hashlib import blake2b
from typing import Any, Callable, NamedTuple

from kademlia.node import Node
from kademlia.protocol import KademliaProtocol

from dmoe.dht.config import DHTConfig
from dmoe.dht.messages import (ID_BYTES, VALUES_HEADER, EncodedReplies, MalformedRequest, ReplyParser, check_id,
                               encode_contacts, record_from_wire, record_to_wire, split_values_reply)
from dmoe.dht.peers import EVICT_AFTER_FAILURES, PeerBook, peer_key
from dmoe.dht.routing import DHTRoutingTable, contact_machine
from dmoe.dht.signing import Verifier
from dmoe.dht.storage import (MAX_CLOCK_SKEW, Entry, NotOwner, Record, RecordFull, RecordStorage, sender_group,
                              supersedes)
from dmoe.dht.throttle import MachineBudgets, ThrottledWarnings
from dmoe.dht.transport import (HEADER_BYTES, MAX_DATAGRAM_BYTES, REPLY_BUDGET_BYTES, UDPTransport, chunk_entries,
                                peer_address)

logger = logging.getLogger(__name__)

#: the most bytes of a reply's record, signatures and contacts that leave room for its framing in one datagram
REPLY_ROOM = MAX_DATAGRAM_BYTES - HEADER_BYTES - 64

#: Keys per find_values request (22 bytes each, well under the request limit).
MAX_KEYS_PER_REQUEST = 128
#: The node id in the requests of a client-mode node: the receiver does not take it as a contact.
CLIENT_ID = b""


#: hand-overs of records to newcomers of one machine (:meth:`DHTProtocol.welcome_if_new`): a burst of this many,
HANDOVER_BURST = 4
#: then one per this many seconds
HANDOVER_PERIOD = 2.0
#: machines whose hand-over budget is remembered at most (the longest idle are forgotten first)
HANDOVER_MACHINES = 4096
#: ping-backs to the askers of one machine (:meth:`DHTProtocol.welcome_if_new`), and askers of one machine added on
#: their answers: a burst of this many,
PING_BACK_BURST = 4
#: then one per this many seconds
PING_BACK_PERIOD = 1.0
#: a ping back's message id is a token of the address pinged and the window of this many seconds it was sent in: its
#: answer is taken for one to two windows (:meth:`DHTProtocol.ping_back_token`)
PING_BACK_WINDOW = 10.0
#: the most bytes of a ping's reply (its 20-byte node id, framed): a larger reply under a ping back's token is dropped
#: before it is decoded
PING_REPLY_BYTES = HEADER_BYTES + 32
#: keys a machine's look-ups (find_value, find_values, find_node) may cost a neighbour search per second, after a
#: burst of KEYS_BURST: a search and its encoding cost ~50 us of the node's only loop, and one datagram may ask 128
#: (review 70: 1.8 Mbit/s of random keys from one peer took a node off the DHT). Keys whose contacts are remembered
#: (readers ask the same keys every few seconds) cost nothing; beyond the budget, the others are answered with the
#: record this node holds and no contacts (~20 us), so readers still find values
KEYS_PER_SECOND = 2000.0
KEYS_BURST = 4000
#: forged signatures a machine's stores may cost this node per second, after a burst of STORE_CHECKS_BURST: an
#: Ed25519 verification costs 60-240 us of the node's only loop, a datagram carries ~66 entries, and forged signatures
#: cost their sender nothing (review 110: ~200 forged 8 KB stores a second from one peer took a node's loop). Each
#: verification takes one from the budget and a valid entry stored gives it back (its writer paid a signature for
#: it), so honest writers, however many entries they refresh (a big announcer, servers behind one NAT, a hand-over),
#: never spend it (review 116); valid entries the storage drops do not (a set of expired ones replayed past the
#: verifier's memory was checked for free, review 117). Entries whose verdict is remembered, and those the storage
#: would not take, found before any check (stale, another owner's subkey, a shared claim held living as long, no room
#: for the sender: review 118; expired, or dated too far ahead: review 119), cost none; with the budget spent, the
#: others are answered :data:`STORE_BUSY`, unverified
STORE_CHECKS_PER_SECOND = 500.0
STORE_CHECKS_BURST = 5000
#: what a store's entry beyond its machine's budget gets (the writer counts it stored if another replica took it)
STORE_BUSY = "busy: stores from this machine spent their signature checks on this node for now"


#: seconds beyond which an entry arriving expired (or expiring beyond ``max_expiration``) is logged as a likely
#: clock skew between writer and node; below it, a store can simply have been slow (or written at the edge)
CLOCK_SKEW_WARNING = 10.0


class ValueAsk(NamedTuple):
    """One key's find_value waiting to go out in a find_values request to its node."""
    key: bytes
    future: "asyncio.Future[tuple[bool, Any]]"
    on_sent: Callable[[Node], None] | None


class DHTProtocol(UDPTransport):
    """A node's protocol: its routing table (``router``), its records (``storage``), its peer book (``peers``)."""

    rpc_names = frozenset({"ping", "store", "find_node", "find_value", "find_values"})
    #: ids of the routing table's lonely buckets, to refresh (stock Kademlia's)
    get_refresh_ids = KademliaProtocol.get_refresh_ids

    def __init__(self, source_node: Node, storage: RecordStorage, config: DHTConfig):
        super().__init__(config)
        self.source_node, self.storage, self.config = source_node, storage, config
        # what this node sends as its id in its requests: none from a client-mode node, which answers nothing and so
        # must never become anyone's contact
        self.own_id = CLIENT_ID if config.client_mode else source_node.id
        self.router = DHTRoutingTable(self, config.ksize, source_node)
        self.peers = PeerBook(config.dead_node_ttl)
        self.verifier = Verifier()
        self.replies = ReplyParser(self.verifier, config.max_value_bytes)  # what this node is sent
        self.encoded = EncodedReplies()  # what this node sends
        self.refusals = ThrottledWarnings(logger)  # stores refused, per sender: a flood must not flood the log
        self._value_batches: dict[tuple[str, int], list[ValueAsk]] = {}
        self.clock: Callable[[], float] = time.monotonic
        #: per machine: hand-overs it may still get (see welcome_if_new), keys of its look-ups answered in full
        self.handovers = MachineBudgets(1.0 / HANDOVER_PERIOD, HANDOVER_BURST, HANDOVER_MACHINES,
                                        clock=lambda: self.clock())
        self.lookups = MachineBudgets(KEYS_PER_SECOND, KEYS_BURST, clock=lambda: self.clock())
        #: per machine: signatures of its stores this node may still verify (see STORE_CHECKS_PER_SECOND)
        self.store_checks = MachineBudgets(STORE_CHECKS_PER_SECOND, STORE_CHECKS_BURST, clock=lambda: self.clock())
        #: per machine: ping-backs to its askers, and askers added on their answers (see welcome_if_new)
        self.ping_backs = MachineBudgets(1.0 / PING_BACK_PERIOD, PING_BACK_BURST, clock=lambda: self.clock())
        self.admissions = MachineBudgets(1.0 / PING_BACK_PERIOD, PING_BACK_BURST, clock=lambda: self.clock())
        self._token_key = os.urandom(32)  # keys the ping backs' tokens (see ping_back_token)

    # ---- asking -------------------------------------------------------------------------------------------
    async def call_ping(self, node_to_ask: Node) -> tuple[bool, Any]:
        result = await self.request((node_to_ask.ip, node_to_ask.port), "ping", self.own_id)
        return self.handle_call_response(result, node_to_ask)

    async def ping_address(self, address: tuple[str, int], attempts: int = 3) -> Node | None:
        """The node answering at ``address`` (for bootstrap), or None after ``attempts`` unanswered pings (a live
        peer busy verifying a burst of signed stores may answer late; joining should not fail for that)."""
        for _ in range(attempts):
            ok, node_id = await self.request(address, "ping", self.own_id)
            if ok:
                break
        if not ok or not isinstance(node_id, bytes) or len(node_id) != ID_BYTES:
            return None
        node = Node(node_id, address[0], address[1])
        self.peers.answered(peer_key(node))
        self.welcome_if_new(node, answered=True)
        return node

    async def call_find_node(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        result = await self.request((node_to_ask.ip, node_to_ask.port), "find_node", self.own_id,
                                    node_to_find.id)
        return self.handle_call_response(result, node_to_ask)

    async def call_find_value(self, node_to_ask: Node, node_to_find: Node,
                              on_sent: Callable[[Node], None] | None = None) -> tuple[bool, Any]:
        """Asks one node for one key's record and contacts.

        Requests for different keys to the same node made in the same loop iteration (a batch of look-ups, as
        a reader of many keys makes) are coalesced into one ``find_values`` datagram: on a busy machine the cost of a
        look-up is mostly per datagram, not per byte.
        """
        return self.handle_call_response(await self.find_value_soon(node_to_ask, node_to_find, on_sent), node_to_ask)

    def find_value_soon(self, node_to_ask: Node, node_to_find: Node,
                        on_sent: Callable[[Node], None] | None = None) -> "asyncio.Future[tuple[bool, Any]]":
        """:meth:`call_find_value` as a bare future of the raw ``(ok, reply)``, for callers that handle the result in
        a callback (the caller must pass it to :meth:`handle_call_response`): a lookup batch then costs no task per
        (node, key)."""
        address = (node_to_ask.ip, node_to_ask.port)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        batch = self._value_batches.setdefault(address, [])
        if not batch:
            loop.call_soon(self._flush_values, node_to_ask)
        batch.append(ValueAsk(node_to_find.id, future, on_sent))
        return future

    def _flush_values(self, node: Node) -> None:
        batch = self._value_batches.pop((node.ip, node.port), [])
        for start in range(0, len(batch), MAX_KEYS_PER_REQUEST):
            self.spawn(self._send_find_values(node, batch[start:start + MAX_KEYS_PER_REQUEST]))

    async def _send_find_values(self, node: Node, batch: list[ValueAsk]) -> None:
        address = (node.ip, node.port)

        def sent() -> None:
            for ask in batch:
                if ask.on_sent is not None:
                    ask.on_sent(node)

        try:
            if len(batch) == 1:
                ask = batch[0]
                result = await self.request(address, "find_value", self.own_id, ask.key, on_sent=sent)
                if not ask.future.done():
                    ask.future.set_result(result)
                return
            ok, blob = await self.request(address, "find_values", self.own_id, [ask.key for ask in batch],
                                          on_sent=sent)
            replies = split_values_reply(blob) if ok else []
            if replies is None:
                logger.warning("malformed find_values reply from %s", node)
                ok, replies = False, []
            answered = min(len(replies), len(batch))
            for ask, reply in zip(batch, replies[:answered]):
                if not ask.future.done():
                    ask.future.set_result((True, reply))
            rest = batch[answered:]
            if ok and rest:
                # the reply was full: ask for the rest at once, in requests as large as the one that fitted
                size = max(1, answered)
                await asyncio.gather(*(self._send_find_values(node, [ValueAsk(ask.key, ask.future, None) for ask in
                                                                    rest[start:start + size]])
                                       for start in range(0, len(rest), size)))
        finally:
            for ask in batch:
                if not ask.future.done():
                    ask.future.set_result((False, None))

    async def call_store(self, node_to_ask: Node, key: bytes, record: Record) -> list[bool | str]:
        """Stores ``record`` on one node in as many requests as needed; per entry True, False or an error."""
        entries = record_to_wire(record)
        chunks = chunk_entries(entries)
        replies = await asyncio.gather(*(
            self.request((node_to_ask.ip, node_to_ask.port), "store", self.own_id, key, chunk)
            for chunk in chunks
        ))
        results: list[bool | str] = []
        for chunk, reply in zip(chunks, replies):
            self.handle_call_response(reply, node_to_ask)
            ok, data = reply
            if ok and isinstance(data, list) and len(data) == len(chunk):
                results.extend(data)
            else:
                results.extend([False] * len(chunk))
        return results

    def handle_call_response(self, result: tuple[bool, Any], node: Node) -> tuple[bool, Any]:
        """A node that stays silent ``EVICT_AFTER_FAILURES`` times in a row is evicted from the routing table (its
        replacement, if any, takes its place); after one silence, lookups already stop waiting for it.

        Evicting on the first timeout emptied routing tables during bursts of stores, when live nodes are
        merely busy, and later stores then settled on nodes far from their keys, where no reader looks.

        Silences count against the id *at the address asked* (:func:`~dmoe.dht.peers.peer_key`), and evict only a
        contact the table holds at that address: any reply may name a live node's id at an address that never
        answers, and counted by id its silence marked the live node dead, then evicted it (review 89).

        The table's last contact is kept (as Kademlia keeps a stale contact that has no replacement): a few seconds
        of silence (a network blip, a suspended laptop) evicted every contact, and a node with none never joined
        again; kept, it is pinged again while nothing else answers
        (:meth:`~dmoe.dht.node.DHTNode.rejoin_if_lonely`), and the node is back once it answers (review 97 D1)."""
        if not result[0]:
            if self.peers.failed(peer_key(node)):
                if self.router.size() > 1:
                    logger.debug("no response from %s %d times, evicting it", node, EVICT_AFTER_FAILURES)
                    self.router.remove_contact(node)  # (only if the table holds node.id at this address)
                else:
                    logger.debug("no response from %s %d times; kept: the table holds no other contact", node,
                                 EVICT_AFTER_FAILURES)
            return result
        self.peers.answered(peer_key(node))
        self.welcome_if_new(node, answered=True)
        return result

    # ---- serving ------------------------------------------------------------------------------------------
    def _sender(self, address: tuple[str, int], nodeid: Any) -> Node | None:
        """The asker as a contact, welcomed into the routing table; None for a client-mode node (:data:`CLIENT_ID`),
        which is neither added nor ever named in a reply."""
        if nodeid == CLIENT_ID:
            return None
        source = Node(check_id(nodeid, "node id"), address[0], address[1])
        self.welcome_if_new(source)
        return source

    def rpc_ping(self, sender: tuple[str, int], nodeid: Any) -> bytes:
        self._sender(sender, nodeid)
        return self.source_node.id

    def rpc_store(self, sender: tuple[str, int], nodeid: Any, key: Any, entries: Any) -> list[bool | str]:
        key = check_id(key, "key")
        record = record_from_wire(entries, self.config.max_value_bytes)
        self._sender(sender, nodeid)
        group, machine = sender_group(sender[0]), contact_machine(*sender[:2])
        results: list[bool | str] = []
        for subkey, entry in record.items():
            current = self.storage.entry(key, subkey)
            if entry.owner and current is not None and isinstance(subkey, int) and (
                    current.owner != entry.owner or not supersedes(subkey, entry, current)):
                # refused or stale (issued no later than the owner's entry held) whether or not the signature
                # holds: a flood of hijacks or replays costs no verification (the slow part of a store)
                if current.owner == entry.owner:
                    results.append(False)
                    continue
                self.refusals.warn("hijack", sender[0], "refusing store from %s: subkey %s of %s is owned by another "
                                   "key", sender, subkey, key.hex()[:16])
                results.append(f"refused: subkey {subkey} is owned by {current.owner.hex()[:16]}")
                continue
            if self.storage.out_of_time(entry.expiration, entry.issued_us):
                # dropped whatever its signature: said (the writer's clock may be off), not checked, review 119 (a
                # host with a fast clock spent the budget of its machine's other writers)
                self._check_clock(sender, entry)
                results.append(False)
                continue
            if current is not None and isinstance(subkey, str) and not supersedes(subkey, entry, current):
                # a shared claim held living at least as long: what the storage answers, without a verification
                # (valid replays of one were checked, and their checks given back, without limit: review 118)
                results.append(True)
                continue
            full = self.storage.room_for(key, subkey, group) if current is None else None
            if full is not None:  # (refused before the signature is checked, review 118)
                self.refusals.warn("full", sender[0], "refusing store from %s: %s", sender, full)
                results.append(f"record full: {full}")
                continue
            checked = self.verifier.known(key, subkey, *entry) is None
            if checked and not self.store_checks.take(machine):
                # a verification costs the loop 60-240 us, and forged signatures cost nothing to send: each machine
                # gets a budget of them (review 110 D1; see STORE_CHECKS_PER_SECOND)
                self.refusals.warn("busy", sender[0], "refusing stores from %s: its machine sent more than %g new "
                                   "signed entries a second (after a burst of %d)", sender, STORE_CHECKS_PER_SECOND,
                                   STORE_CHECKS_BURST)
                results.append(STORE_BUSY)
                continue
            if not self.verifier(key, subkey, *entry):
                self.refusals.warn("forged", sender[0], "refusing unsigned or forged entry %s of %s from %s", subkey,
                                   key.hex()[:16], sender)
                results.append("refused: unsigned or bad signature")
                continue
            self._check_clock(sender, entry)
            try:
                stored = self.storage.store(key, subkey, *entry, sender=group)
                if stored is True and checked:  # (see STORE_CHECKS_PER_SECOND)
                    self.store_checks.refund(machine)
                results.append(stored)
            except RecordFull as error:
                self.refusals.warn("full", sender[0], "refusing store from %s: %s", sender, error)
                results.append(f"record full: {error}")
            except NotOwner as error:
                self.refusals.warn("hijack", sender[0], "refusing store from %s: %s", sender, error)
                results.append(f"refused: {error}")
        return results

    def _check_clock(self, sender: tuple[str, int], entry: Entry) -> None:
        """Warns (once a minute per host) when a signed entry arrives expired, or expiring further ahead than
        ``max_expiration`` allows, by more than :data:`CLOCK_SKEW_WARNING` seconds, or issued more than
        :data:`~dmoe.dht.storage.MAX_CLOCK_SKEW` seconds ahead of this node's clock: the store is dropped either
        way, silently for the writer, and the usual cause is a clock off on one of the two machines."""
        now, expiration = time.time(), entry.expiration
        off = (now - expiration if expiration <= now
               else expiration - (now + self.config.max_expiration) if expiration > now + self.config.max_expiration
               else 0.0)
        what = "already expired" if expiration <= now else "expiring beyond max_expiration"
        if off <= CLOCK_SKEW_WARNING:
            off, what = entry.issued_us / 1_000_000 - now, "issued in the future"
            if off <= MAX_CLOCK_SKEW:
                return
        self.refusals.warn("clock", sender[0], "%s stored an entry %s by %.0f s, which this node drops: is one of the "
                           "two machines' clocks off? Records expire by wall-clock time (keep clocks synchronised, "
                           "e.g. with NTP)", sender[0], what, off)

    def rpc_find_node(self, sender: tuple[str, int], nodeid: Any, key: Any) -> list[tuple[bytes, str, int]]:
        """The closest contacts to ``key``; none once the asker's machine has spent its :data:`KEYS_PER_SECOND`."""
        key = check_id(key, "key")
        source = self._sender(sender, nodeid)
        if not self.lookups.take(contact_machine(*sender[:2])):
            return []
        neighbors = self.router.find_neighbors(Node(key), exclude=source)
        return [tuple(node) for node in neighbors]

    def rpc_find_value(self, sender: tuple[str, int], nodeid: Any, key: Any) -> dict[str, Any]:
        """The local record (possibly empty) *and* the closest contacts, so lookups can keep merging (no contacts
        once the asker's machine has spent its :data:`KEYS_PER_SECOND`)."""
        key = check_id(key, "key")
        source = self._sender(sender, nodeid)
        contacts = self.encoded.contacts(self.router, key, self.router.ksize, source, self._budget(sender))
        reply = self.encoded.value_reply(self.storage, key, contacts)
        if len(reply["record"]) + len(reply["auth"]) + len(reply["nodes"]) > REPLY_ROOM:
            # the record first: a full one beside a large --ksize's contacts outgrew the datagram, and the reply
            # became an error, honest entries lost with the rest (review 97); the asker has other nodes' contacts
            reply = self.encoded.value_reply(self.storage, key, encode_contacts(()))
        return reply

    def _budget(self, sender: tuple[str, int]) -> Callable[[], bool]:
        """Takes one key of the sender's machine's look-up budget (:data:`KEYS_PER_SECOND`), if it has one left."""
        machine = contact_machine(*sender[:2])
        return lambda: self.lookups.take(machine) == 1

    def rpc_find_values(self, sender: tuple[str, int], nodeid: Any, keys: Any) -> bytes:
        """:meth:`rpc_find_value` for several keys, in order, stopping before the reply would outgrow a datagram; as
        one binary string (see :data:`VALUES_HEADER` and :func:`split_values_reply`)."""
        if not isinstance(keys, (list, tuple)) or not 0 < len(keys) <= MAX_KEYS_PER_REQUEST:
            raise MalformedRequest(f"find_values takes a list of 1 to {MAX_KEYS_PER_REQUEST} keys")
        keys = [check_id(key, "key") for key in keys]
        source = self._sender(sender, nodeid)
        width = 2 * self.config.read_width
        budget = self._budget(sender)
        parts, size = [], 0
        for key in keys:
            reply = self.encoded.value_reply(self.storage, key, self.encoded.contacts(self.router, key, width, source,
                                                                                      budget))
            record, auth, contacts = reply["record"].encode(), reply["auth"], reply["nodes"].encode()
            if not parts and VALUES_HEADER.size + len(record) + len(auth) + len(contacts) > REPLY_ROOM:
                contacts = encode_contacts(()).encode()  # the first key's record, at least (see rpc_find_value)
            size += VALUES_HEADER.size + len(record) + len(auth) + len(contacts)
            if parts and size > REPLY_BUDGET_BYTES:
                break
            parts += [VALUES_HEADER.pack(len(record), len(auth), len(contacts)), record, auth, contacts]
        return b"".join(parts)

    # ---- replication to newcomers -------------------------------------------------------------------------
    def welcome_if_new(self, node: Node, answered: bool = False) -> None:
        """Adds a new contact once it answered a request of ours, and hands it the records it is now among the
        closest replicas of (Kademlia's hand-over: the closest holder of a record gives it to a newcomer closer still).

        answered: ``node`` has just answered a request of ours, so its address is real. Else it asked us something,
        from an address and under an id that nothing proves yet: it is pinged back first, and added once it answers
        under that id (:meth:`_ping_back`). A contact added on its request alone could be planted at any address by
        a request with a forged source; the node then named it to every asker, whose look-ups sent requests there
        (review 97 D2; BEP 5 likewise names only nodes that answered).

        Stock kademlia ran the hand-over for every request under an id it did not hold: it walked the whole storage
        with a neighbour search per key (1.3 s of the node's only loop at 20,000 records, for one 30-byte ping
        under a made-up id, which a full bucket keeps "new" as a replacement), and stored records on whatever
        address the request came from. Here a contact gets records only once it entered a bucket (not merely the
        replacements) and its machine has hand-overs left (:data:`HANDOVER_BURST`, then one per
        :data:`HANDOVER_PERIOD` s); the records are picked in one pass over the keys (:meth:`records_to_hand_over`).
        A newcomer denied them gets its records at their owners' next refresh or the next read's repair. (Stock
        kademlia also hashed the already hashed keys again here, handing records to the wrong nodes.)
        """
        if node.id == self.source_node.id:  # this node itself (its own address among its initial peers, a forged
            return  # request): counted as a contact, it hid the loss of the last real one (review 101)
        self.peers.heard_from(peer_key(node))  # it just spoke to us (or answered), from this address
        if not self.router.is_new_node(node):
            return
        if not answered:
            held = self.router.holding(node)  # (a replacement answered once already, at its address)
            if held is None or not held.same_home_as(node):
                self._ping_back(node)
                return
        self.router.add_contact(node)
        if self.router.is_new_node(node) or not self.storage.data or not self._may_hand_over(node):
            return  # among a full bucket's replacements, or left out (its machine's share of the bucket), or idle
        self._hand_over(node)

    def _ping_back(self, node: Node) -> None:
        """Pings an asker not yet in the table, unless its machine has no ping-backs left (:data:`PING_BACK_BURST`,
        then one per :data:`PING_BACK_PERIOD` s): one ping per forged request at most, a few per machine. An asker
        left out is pinged on a later request.

        The ping keeps no state here: its message id is a token of the address (:meth:`ping_back_token`), and an
        answer carrying it is recognised by the token alone (:meth:`unawaited_reply`). Each ping back used to be
        awaited, and at most 64 at once: forged requests from many addresses, whose pings nobody answers, held them
        all (~700 a second; 3 of 8 newcomers were added in 10 s), and honest askers meanwhile were not pinged at all
        (review 101 D2). Now a forged request costs one small datagram, sent to where the request claims to come
        from, beside the reply it gets anyway: no amplification, and no global cap, which a flood past it would
        fill as it filled the one in flight."""
        if not self.ping_backs.take(contact_machine(node.ip, node.port)):
            return
        address = peer_address((node.ip, node.port))
        self.send_unawaited((node.ip, node.port), self.ping_back_token(address, self._token_window()), "ping",
                            self.own_id)

    def _token_window(self) -> int:
        return int(self.clock() // PING_BACK_WINDOW)

    def ping_back_token(self, address: tuple[str, int], window: int) -> bytes:
        """A ping back's message id: the window of :data:`PING_BACK_WINDOW` s it went out in (its last byte), then a
        keyed hash (by a secret of this node) of that window and the address pinged
        (:func:`~dmoe.dht.transport.peer_address`). Only whoever receives the ping learns it; a forged reply cannot
        make one up for another address."""
        digest = blake2b(f"ping back {window} {address[0]} {address[1]}".encode(), key=self._token_key,
                         digest_size=ID_BYTES - 1).digest()
        return bytes([window & 0xFF]) + digest

    def unawaited_reply(self, msg_id: bytes, address: tuple[str, int], size: int) -> Callable[[Any], None] | None:
        """An answer to a ping back (:meth:`_ping_back`): a reply of a ping's size whose message id is the token of
        the address it comes from, of this window or the last (told by its first byte: one hash at most, and most
        stray replies need none)."""
        if size > PING_REPLY_BYTES:
            return None
        window = self._token_window()
        if msg_id[0] != window & 0xFF:
            window -= 1  # sent in the last window, or no token at all
        if msg_id[0] != window & 0xFF or not hmac.compare_digest(msg_id, self.ping_back_token(address, window)):
            return None
        return lambda node_id: self._ping_back_answered(address, node_id)

    def _ping_back_answered(self, address: tuple[str, int], node_id: Any) -> None:
        """Adds the node that answered a ping back at ``address``, as far as its machine may add new contacts
        (:data:`PING_BACK_BURST`, then one per :data:`PING_BACK_PERIOD` s): a token is good for any number of
        answers in its window, and one answer per id would add ids at that address as fast as it sends them.

        Whatever id answers at the address is the one its answer proves (not only the id the request claimed): a
        request forged from an honest node's address under made-up ids spent that machine's ping-backs, each answer
        was thrown away, and the honest node was never added (review 101)."""
        if not isinstance(node_id, bytes) or len(node_id) != ID_BYTES:
            return
        answered = Node(node_id, *address)
        self.peers.answered(peer_key(answered))
        if self.router.is_new_node(answered) and not self.admissions.take(contact_machine(*address)):
            return
        self.welcome_if_new(answered, answered=True)

    def _hand_over(self, node: Node) -> None:
        for key, record in self.records_to_hand_over(node):
            self.spawn(self.call_store(node, key, record))

    def _may_hand_over(self, node: Node) -> bool:
        """Takes one of the hand-overs left to ``node``'s machine, if any (a token bucket per machine)."""
        return self.handovers.take(contact_machine(node.ip, node.port)) == 1

    def records_to_hand_over(self, newcomer: Node) -> list[tuple[bytes, Record]]:
        """The records held here of which this node is the closest holder it knows of (no contact is closer to the
        key) and ``newcomer`` is now among the ``num_replicas`` closest nodes (this one included).

        One pass over the keys, without a neighbour search: for ids ``a`` and ``b`` that first differ at bit
        ``m``, ``a`` is closer to a key than ``b`` exactly when the key differs from ``b`` at bit ``m``. So this
        node is the closest to a key when the key agrees with its id at every bit where a contact's id first
        differs from it (one mask), and the nodes closer to a key than the newcomer are counted per bit where
        their id first differs from the newcomer's."""
        me, new = self.source_node.long_id, newcomer.long_id
        if me == new:
            return []
        mask = 0
        ahead_at: dict[int, int] = {(me ^ new).bit_length() - 1: 1}  # this node
        for contact in self.router.contacts():
            other = contact.long_id
            if other == new or other == me:
                continue
            mask |= 1 << ((other ^ me).bit_length() - 1)
            bit = (other ^ new).bit_length() - 1
            ahead_at[bit] = ahead_at.get(bit, 0) + 1
        bits = sorted(ahead_at.items(), reverse=True)
        limit = self.config.num_replicas
        chosen = []
        for key in list(self.storage.data):
            key_id = int.from_bytes(key, "big")
            if (key_id ^ me) & mask:
                continue  # a contact is closer: the hand-over is its to make
            towards_newcomer, ahead = key_id ^ new, 0
            for bit, count in bits:
                if towards_newcomer >> bit & 1:
                    ahead += count
                    if ahead >= limit:
                        break
            if ahead < limit:
                record = self.storage.get(key)
                if record:
                    chosen.append((key, record))
        return chosen

    def close_tasks(self) -> None:
        super().close_tasks()
        self.replies.close()
