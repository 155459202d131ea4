"""The UDP protocol: records stored one chunk of subkeys per request, bounded replies, hardened parsing.

Stock ``KademliaProtocol`` stores one opaque value per request (refused above ~8 KB), lets a reply grow past a
datagram (it is then dropped silently and the asker evicts the peer), waits 5 s for every dead peer, and dies on
a malformed datagram with an exception in a task. Here requests carry a list of ``(subkey, value, expiration)``
entries chunked under the request limit, records are capped so every reply fits in one datagram, the RPC timeout
is short, dead contacts are evicted, and anything malformed or oversized is logged and dropped.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from hashlib import sha1
from typing import Any, Callable, Sequence

import msgpack
from kademlia.node import Node
from kademlia.protocol import KademliaProtocol

from dmoe.dht.config import DHTConfig
from dmoe.dht.routing import DHTRoutingTable
from dmoe.dht.signing import AUTH_BYTES, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Verifier
from dmoe.dht.storage import Entry, NotOwner, Record, RecordFull, RecordStorage

log = logging.getLogger(__name__)

REQUEST, RESPONSE = b"\x00", b"\x01"
HEADER_BYTES = 21  # kind byte + 20-byte message id, as in rpcudp
#: Requests above this are refused by stock rpcudp peers too; ours are chunked below it.
MAX_REQUEST_BYTES = 8192
#: Largest UDP payload over IPv4; a reply must fit in it or it is never delivered.
MAX_DATAGRAM_BYTES = 65507
ID_BYTES = 20
RPC_NAMES = frozenset({"ping", "store", "find_node", "find_value", "find_values"})
#: Keys per find_values request (22 bytes each, well under the request limit).
MAX_KEYS_PER_REQUEST = 128
#: find_values replies stop adding records past this many bytes; the asker re-asks for the rest one by one.
REPLY_BUDGET_BYTES = MAX_DATAGRAM_BYTES - 8192
#: find_value replies remembered parsed and verified (each at most a datagram: a few tens of MB at worst)
PARSED_REPLIES = 512
#: consecutive unanswered requests after which a contact is evicted from the routing table
EVICT_AFTER_FAILURES = 3
#: encoded records a node keeps for its replies (re-encoded when the record changes)
ENCODED_RECORDS = 1024
#: contact lists of find_value replies remembered parsed (a few KB each)
PARSED_CONTACTS = 4096
#: contact lists a node keeps encoded for its replies (re-encoded when its routing table changes; ~1 KB each)
ENCODED_CONTACTS = 4096
#: a find_values reply is one binary string: per key, these three lengths, then the record's JSON text, its owners
#: and signatures, and the contacts' JSON text (one string decodes in one step; a list of maps took ~43
#: pure-Python reads per reply)
VALUES_HEADER = struct.Struct(">III")


class MessageTooLarge(ValueError):
    """A message that cannot be sent in one datagram."""


class MalformedRequest(ValueError):
    """A request whose arguments are not what the RPC expects."""


def _check_id(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != ID_BYTES:
        raise MalformedRequest(f"{what} must be {ID_BYTES} bytes")
    return value


def record_to_wire(record: Record) -> list[list[Any]]:
    """Store-request entries ``[subkey, value, expiration, owner, signature]``, sorted by subkey."""
    return [[subkey, *entry] for subkey, entry in sorted(record.items(), key=_order)]


def _order(item: tuple[Any, Any]) -> tuple[bool, Any]:
    return (isinstance(item[0], str), item[0])


#: Values are endpoints: printable ASCII that JSON does not escape, so a reply's size is what the caps say.
VALUE_PATTERN = re.compile(r"[!#-\[\]-~]*")
#: Longest str subkey (a shared prefix claim: a coordinate in decimal).
MAX_STR_SUBKEY = 10


def check_entry(subkey: Any, value: Any, expiration: Any, max_value_bytes: int) -> None:
    if isinstance(subkey, bool) or not isinstance(subkey, (int, str)):
        raise MalformedRequest("a subkey must be an int or a str")
    if isinstance(subkey, int) and not 0 <= subkey < 2**31 or isinstance(subkey, str) and (
            len(subkey) > MAX_STR_SUBKEY or VALUE_PATTERN.fullmatch(subkey) is None):
        raise MalformedRequest("subkey out of range")
    if not isinstance(value, str) or len(value) > max_value_bytes or VALUE_PATTERN.fullmatch(value) is None:
        raise MalformedRequest(f"a value must be printable ASCII (no quotes, backslashes or spaces) of at most "
                               f"{max_value_bytes} bytes")
    if isinstance(expiration, bool) or not isinstance(expiration, (int, float)) or not math.isfinite(expiration):
        raise MalformedRequest("an expiration must be a finite number")


def record_from_wire(entries: Any, max_value_bytes: int = 1 << 16) -> Record:
    """Parses ``[[subkey, value, expiration, owner, signature], ...]``; raises :class:`MalformedRequest` on
    anything else (signatures are checked by the caller)."""
    if not isinstance(entries, (list, tuple)):
        raise MalformedRequest("record entries must be a list")
    record: Record = {}
    for entry in entries:
        if not isinstance(entry, (list, tuple)) or len(entry) != 5:
            raise MalformedRequest("a record entry must be [subkey, value, expiration, owner, signature]")
        subkey, value, expiration, owner, signature = entry
        check_entry(subkey, value, expiration, max_value_bytes)
        if not isinstance(owner, bytes) or not isinstance(signature, bytes) or len(owner) > PUBLIC_KEY_BYTES \
                or len(signature) > SIGNATURE_BYTES:
            raise MalformedRequest("owner and signature must be bytes (32 and 64)")
        record[subkey] = Entry(value, float(expiration), owner, signature)
    return record


def find_value_reply(record: Record, nodes: Sequence[Node] | str,
                     encoded: tuple[str, bytes] | None = None) -> dict[str, Any]:
    """A find_value reply: the record and the contacts as JSON text, which Python decodes in one C call (the
    pure-Python msgpack decoder this was designed against took milliseconds for a 256-subkey record), and the
    entries' owners and signatures as one binary string, 96 bytes per entry in the same order (as base64 in JSON
    they would not fit a datagram next to 256 entries). ``nodes``: the contacts, or :func:`encode_contacts` of
    them. ``encoded``: :func:`encode_record` of ``record``, when the caller kept it from an earlier reply."""
    text, auth = encoded if encoded is not None else encode_record(record)
    return {"record": text, "auth": auth, "nodes": nodes if isinstance(nodes, str) else encode_contacts(nodes)}


def encode_contacts(nodes: Sequence[Node]) -> str:
    """The contacts part of a find_value reply."""
    return json.dumps([[node.id.hex(), node.ip, node.port] for node in nodes], separators=(",", ":"))


def encode_record(record: Record) -> tuple[str, bytes]:
    """The record part of a find_value reply: entries as JSON text, owners and signatures as bytes."""
    entries = sorted(record.items(), key=_order)
    auth = b"".join(entry.owner.ljust(PUBLIC_KEY_BYTES, b"\0") + entry.signature.ljust(SIGNATURE_BYTES, b"\0")
                    for _, entry in entries)
    return json.dumps([[subkey, entry.value, entry.expiration] for subkey, entry in entries],
                      separators=(",", ":")), auth


def parse_find_value_reply(data: Any, key: bytes, verifier: Callable[..., bool],
                           seen: dict[tuple[str, bytes], Record] | None = None,
                           max_value_bytes: int = 1 << 16,
                           contacts: dict[str, list[Node]] | None = None) -> tuple[Record, list[Node]]:
    """The inverse of :func:`find_value_reply`, keeping only entries validly signed for ``key``; raises
    :class:`MalformedRequest` on anything malformed.

    ``seen`` maps replies already parsed in this lookup: an identical replica gets the same record object back
    instead of being parsed and verified again. ``contacts`` maps contact lists (as JSON text) already parsed to
    their nodes, which the caller must not modify: a node answers the same key with the same contacts until its
    routing table changes, and building Node objects was the largest cost of a reply whose record was known.
    """
    if not isinstance(data, dict) or not isinstance(data.get("record"), str) or not isinstance(data.get("nodes"), str) \
            or not isinstance(data.get("auth"), bytes):
        raise MalformedRequest("a find_value reply must hold 'record' and 'nodes' as JSON text and 'auth' as bytes")
    text, auth, nodes_text = data["record"], data["auth"], data["nodes"]
    try:
        record = seen.get((text, auth)) if seen is not None else None
        if record is None:
            record = _verified_record(json.loads(text), auth, key, verifier, max_value_bytes)
        nodes = contacts.get(nodes_text) if contacts is not None else None
        if nodes is None:
            nodes = _parse_contacts(json.loads(nodes_text))
            if contacts is not None:
                if len(contacts) >= PARSED_CONTACTS:
                    del contacts[next(iter(contacts))]  # the oldest parsed
                contacts[nodes_text] = nodes
    except ValueError as error:
        raise MalformedRequest(f"undecodable find_value reply: {error}") from None
    if seen is not None:
        seen[text, auth] = record
    return record, nodes


def valid_port(port: Any) -> bool:
    """A port a datagram can go to: any other made ``sendto`` raise, and asyncio then closed the sender's socket."""
    return isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536


def valid_address(ip: Any, port: Any) -> bool:
    """An IP literal and a valid port. A contact's address comes from peers: a port past 65535 closed the asker's
    socket (one hostile reply killed the node), and a host name would be resolved, blocking the loop."""
    if not isinstance(ip, str) or not valid_port(port):
        return False
    # inet_pton: ~15x cheaper than ipaddress.ip_address and the same verdicts, but for scoped IPv6 (fe80::1%eth0),
    # which means nothing in a contact passed between machines
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, ip)
            return True
        except (OSError, ValueError):
            continue
    return False


def _parse_contacts(raw_nodes: Any) -> list[Node]:
    """Contacts ``[[id hex, ip, port], ...]``; malformed items are skipped."""
    nodes = []
    for item in raw_nodes if isinstance(raw_nodes, list) else []:
        if (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and len(item[0]) == 2 * ID_BYTES
                and valid_address(item[1], item[2])):
            try:
                nodes.append(Node(bytes.fromhex(item[0]), item[1], item[2]))
            except ValueError:
                continue
    return nodes


def split_values_reply(blob: Any) -> list[dict[str, Any]] | None:
    """The find_value replies packed in a find_values reply (see :data:`VALUES_HEADER`), or None if it is
    malformed."""
    if not isinstance(blob, bytes):
        return None
    replies, offset, header = [], 0, VALUES_HEADER.size
    view = memoryview(blob)
    while offset < len(blob):
        if offset + header > len(blob):
            return None
        record_bytes, auth_bytes, nodes_bytes = VALUES_HEADER.unpack_from(blob, offset)
        offset += header
        end = offset + record_bytes + auth_bytes + nodes_bytes
        if end > len(blob):
            return None
        try:
            record = str(view[offset:offset + record_bytes], "ascii")
            nodes = str(view[end - nodes_bytes:end], "ascii")
        except UnicodeDecodeError:
            return None
        replies.append({"record": record, "auth": bytes(view[offset + record_bytes:end - nodes_bytes]),
                        "nodes": nodes})
        offset = end
    return replies


def _verified_record(entries: Any, auth: bytes, key: bytes, verifier: Callable[..., bool],
                     max_value_bytes: int) -> Record:
    if not isinstance(entries, list) or len(auth) != AUTH_BYTES * len(entries):
        raise MalformedRequest("record entries must be a list with 96 bytes of owner and signature each")
    record: Record = {}
    rejected = 0
    for index, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != 3:
            raise MalformedRequest("a record entry must be [subkey, value, expiration]")
        subkey, value, expiration = entry
        check_entry(subkey, value, expiration, max_value_bytes)
        offset = index * AUTH_BYTES
        owner, signature = auth[offset:offset + PUBLIC_KEY_BYTES], auth[offset + PUBLIC_KEY_BYTES:offset + AUTH_BYTES]
        if verifier(key, subkey, value, float(expiration), owner, signature):
            record[subkey] = Entry(value, float(expiration), owner, signature)
        else:
            rejected += 1
    if rejected:
        log.warning("ignoring %d unsigned or forged entries of record %s", rejected, key.hex()[:16])
    return record


def chunk_entries(entries: list[list[Any]], budget: int = MAX_REQUEST_BYTES - 200) -> list[list[list[Any]]]:
    """Splits entries into lists whose packed size stays under ``budget`` bytes (one request each)."""
    chunks: list[list[list[Any]]] = [[]]
    size = 0
    for entry in entries:
        entry_size = len(msgpack.packb(entry))
        if entry_size > budget:
            raise MessageTooLarge(f"record entry of {entry_size} bytes cannot fit in one request")
        if size + entry_size > budget and chunks[-1]:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += entry_size
    return chunks if chunks[-1] else []


class DHTProtocol(KademliaProtocol):
    def __init__(self, source_node: Node, storage: RecordStorage, config: DHTConfig):
        super().__init__(source_node, storage, config.ksize)
        self._wait_timeout = config.rpc_timeout
        self.config = config
        self.router = DHTRoutingTable(self, config.ksize, source_node)
        self._tasks: set[asyncio.Task] = set()  # strong references to fire-and-forget stores
        self._slots = asyncio.Semaphore(config.max_concurrent_rpcs)
        self._value_batches: dict[tuple[str, int], list[tuple[bytes, asyncio.Future, Any]]] = {}
        self._parsed_replies: dict[tuple[bytes, str, bytes], Record] = {}  # see parse_value_reply
        self._parsed_contacts: dict[str, list[Node]] = {}  # see parse_find_value_reply
        self._encoded: dict[bytes, tuple[int | None, str, bytes]] = {}  # key -> (version, record text, auth)
        # (key, k, asker's address) -> (routing table version, contacts text): see _contacts_for
        self._contacts_text: dict[tuple[bytes, int, str, int], tuple[int, str]] = {}
        self._slow_until: dict[bytes, float] = {}  # node id -> monotonic time until which lookups do not wait for it
        self._dead_until: dict[bytes, float] = {}  # node id -> monotonic time until which lookups skip it
        self._failures: dict[bytes, int] = {}  # node id -> consecutive unanswered requests
        self.verifier = Verifier()
        self._drain_socket: socket.socket | None = None  # see drain()
        self._verify_thread: ThreadPoolExecutor | None = None

    # ---- receiving ----------------------------------------------------------------------------------------
    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        kind = data[:1]
        if len(data) < HEADER_BYTES + 1 or kind not in (REQUEST, RESPONSE):
            log.warning("dropping malformed datagram of %d bytes from %s", len(data), addr)
            return
        if kind == REQUEST and len(data) > HEADER_BYTES + MAX_REQUEST_BYTES:
            log.warning("dropping oversized request of %d bytes from %s", len(data), addr)
            return
        msg_id = data[1:HEADER_BYTES]
        try:
            payload = msgpack.unpackb(data[HEADER_BYTES:])
        except Exception as error:  # msgpack raises many types on garbage; none may kill the node
            log.warning("dropping undecodable datagram from %s: %r", addr, error)
            return
        if kind == REQUEST:
            self._handle_request(msg_id, payload, addr)
        else:
            self._accept_response(msg_id, payload, addr)

    def _accept_response(self, msg_id: bytes, data: Any, address: tuple[str, int]) -> None:
        pending = self._outstanding.get(msg_id)
        if pending is None:
            log.debug("ignoring late or unknown response from %s", address)
            return
        future, timeout, expected = pending
        if tuple(address[:2]) != expected:
            log.warning("ignoring response from %s to a request sent to %s", address, expected)
            return
        timeout.cancel()
        del self._outstanding[msg_id]
        if not future.done():
            future.set_result((True, data))

    def _handle_request(self, msg_id: bytes, data: Any, address: tuple[str, int]) -> None:
        if not (isinstance(data, (list, tuple)) and len(data) == 2 and data[0] in RPC_NAMES
                and isinstance(data[1], (list, tuple))):
            log.warning("dropping malformed request from %s", address)
            return
        name, args = data
        try:
            response = getattr(self, f"rpc_{name}")(address, *args)
        except (MalformedRequest, TypeError, ValueError) as error:
            log.warning("dropping malformed %s request from %s: %s", name, address, error)
            return
        except Exception:  # a bug serving one request must not take the node down
            log.exception("failed to serve %s request from %s", name, address)
            return
        payload = msgpack.packb(response)
        if len(payload) + HEADER_BYTES > MAX_DATAGRAM_BYTES:  # records are capped, so this is a bug, not a peer
            log.error("reply to %s from %s would be %d bytes, over one datagram", name, address, len(payload))
            payload = msgpack.packb({"error": "reply too large"})
        if self.transport is not None:
            self.transport.sendto(RESPONSE + msg_id + payload, address)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # asyncio hands out a socket wrapper without recvfrom; a duplicate descriptor reads the same socket
        sock = transport.get_extra_info("socket")
        self._drain_socket = socket.socket(sock.family, sock.type, fileno=os.dup(sock.fileno()))
        self._drain_socket.setblocking(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._close_drain_socket()
        super().connection_lost(exc)

    def _close_drain_socket(self) -> None:
        if self._drain_socket is not None:
            self._drain_socket.close()
            self._drain_socket = None

    def drain(self) -> int:
        """Reads every datagram already waiting in the socket; returns how many.

        asyncio reads one datagram per loop iteration but fires every due timer in that iteration, so when the loop
        lags (a process whose other threads hold the GIL) replies that arrived in time sat unread while their
        timeouts fired: every replica of a record looked dead and a read came back empty. Timeouts and lateness
        are judged after draining."""
        sock = self._drain_socket
        count = 0
        while sock is not None and count < 4096:
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM_BYTES + 64)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as error:  # e.g. an ICMP error queued on the socket; asyncio would report the same
                self.error_received(error)
                break
            count += 1
            self.datagram_received(data, addr)
        return count

    def _timeout(self, msg_id: bytes) -> None:
        if msg_id in self._outstanding:
            self.drain()  # its reply may be waiting unread
        pending = self._outstanding.pop(msg_id, None)
        if pending is not None and not pending[0].done():
            pending[0].set_result((False, None))

    # ---- sending ------------------------------------------------------------------------------------------
    def _call(self, address: tuple[str, int], name: str, *args: Any) -> "asyncio.Future[tuple[bool, Any]]":
        """Sends one request; the future resolves to ``(True, reply)`` or ``(False, None)`` after the timeout."""
        payload = msgpack.packb([name, list(args)])
        if len(payload) > MAX_REQUEST_BYTES:
            raise MessageTooLarge(f"{name} request of {len(payload)} bytes exceeds {MAX_REQUEST_BYTES}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        msg_id = sha1(os.urandom(32)).digest()
        timeout = loop.call_later(self._wait_timeout, self._timeout, msg_id)
        self._outstanding[msg_id] = (future, timeout, (address[0], address[1]))
        # only the port, which would close the socket: addresses from peers were checked whole when parsed
        if self.transport is None or not valid_port(address[1]):
            timeout.cancel()
            del self._outstanding[msg_id]
            future.set_result((False, None))
        else:
            self.transport.sendto(REQUEST + msg_id + payload, address)
        return future

    async def request(self, address: tuple[str, int], name: str, *args: Any,
                      on_sent: Callable[[], None] | None = None) -> tuple[bool, Any]:
        """One request, waiting for a free slot first (at most ``max_concurrent_rpcs`` in flight)."""
        async with self._slots:
            if on_sent is not None:
                on_sent()
            return await self._call(address, name, *args)

    async def call_ping(self, node_to_ask: Node) -> tuple[bool, Any]:
        result = await self.request((node_to_ask.ip, node_to_ask.port), "ping", self.source_node.id)
        return self.handle_call_response(result, node_to_ask)

    async def ping_address(self, address: tuple[str, int], attempts: int = 3) -> Node | None:
        """The node answering at ``address`` (for bootstrap), or None after ``attempts`` unanswered pings (a live
        peer busy verifying a burst of signed stores may answer late; joining should not fail for that)."""
        for _ in range(attempts):
            ok, node_id = await self.request(address, "ping", self.source_node.id)
            if ok:
                break
        if not ok or not isinstance(node_id, bytes) or len(node_id) != ID_BYTES:
            return None
        node = Node(node_id, address[0], address[1])
        self.welcome_if_new(node)
        return node

    async def call_find_node(self, node_to_ask: Node, node_to_find: Node) -> tuple[bool, Any]:
        result = await self.request((node_to_ask.ip, node_to_ask.port), "find_node", self.source_node.id,
                                    node_to_find.id)
        return self.handle_call_response(result, node_to_ask)

    async def call_find_value(self, node_to_ask: Node, node_to_find: Node,
                              on_sent: Callable[[Node], None] | None = None) -> tuple[bool, Any]:
        """Asks one node for one key's record and contacts.

        Requests for different keys to the same node made in the same loop iteration (a batch of look-ups, as
        beam search makes) are coalesced into one ``find_values`` datagram: on a busy machine the cost of a
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
        batch.append((node_to_find.id, future, on_sent))
        return future

    def _flush_values(self, node: Node) -> None:
        batch = self._value_batches.pop((node.ip, node.port), [])
        for start in range(0, len(batch), MAX_KEYS_PER_REQUEST):
            self.spawn(self._send_find_values(node, batch[start:start + MAX_KEYS_PER_REQUEST]))

    async def _send_find_values(self, node: Node, batch: list[tuple[bytes, asyncio.Future, Any]]) -> None:
        address = (node.ip, node.port)

        def sent() -> None:
            for _, _, on_sent in batch:
                if on_sent is not None:
                    on_sent(node)

        try:
            if len(batch) == 1:
                key, future, _ = batch[0]
                result = await self.request(address, "find_value", self.source_node.id, key, on_sent=sent)
                if not future.done():
                    future.set_result(result)
                return
            ok, blob = await self.request(address, "find_values", self.source_node.id,
                                          [key for key, _, _ in batch], on_sent=sent)
            replies = split_values_reply(blob) if ok else []
            if replies is None:
                log.warning("malformed find_values reply from %s", node)
                ok, replies = False, []
            answered = min(len(replies), len(batch))
            for (_, future, _), reply in zip(batch, replies[:answered]):
                if not future.done():
                    future.set_result((True, reply))
            rest = batch[answered:]
            if ok and rest:
                # the reply was full: ask for the rest at once, in requests as large as the one that fitted
                size = max(1, answered)
                await asyncio.gather(*(self._send_find_values(node, [(key, future, None) for key, future, _ in
                                                                    rest[start:start + size]])
                                       for start in range(0, len(rest), size)))
        finally:
            for _, future, _ in batch:
                if not future.done():
                    future.set_result((False, None))

    async def call_store(self, node_to_ask: Node, key: bytes, record: Record) -> list[bool | str]:
        """Stores ``record`` on one node in as many requests as needed; per entry True, False or an error."""
        entries = record_to_wire(record)
        chunks = chunk_entries(entries)
        replies = await asyncio.gather(*(
            self.request((node_to_ask.ip, node_to_ask.port), "store", self.source_node.id, key, chunk)
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

        Evicting on the first timeout emptied routing tables during bursts of declarations, when live nodes are
        merely busy, and later stores then settled on nodes far from their keys, where no reader looks."""
        if not result[0]:
            self._dead_until[node.id] = time.monotonic() + self.config.dead_node_ttl
            if len(self._failures) >= 1 << 16:
                self._failures.clear()  # bounded: hostile peers cannot grow it without limit
            failures = self._failures[node.id] = self._failures.get(node.id, 0) + 1
            if failures >= EVICT_AFTER_FAILURES:
                log.debug("no response from %s %d times, evicting it", node, failures)
                self.router.remove_contact(node)
                del self._failures[node.id]
            return result
        self._failures.pop(node.id, None)
        self.welcome_if_new(node)
        return result

    def mark_slow(self, node_id: bytes) -> None:
        """A node that let a lookup wait past ``hedge_after``: later lookups ask it without waiting for it."""
        self._slow_until.setdefault(node_id, time.monotonic() + self.config.dead_node_ttl)

    def may_be_suspect(self, node_id: bytes) -> bool:
        """False for a node neither :meth:`recently_dead` nor :meth:`recently_slow` (cheaply: no clock read)."""
        return node_id in self._dead_until or node_id in self._slow_until

    def recently_slow(self, node_id: bytes) -> bool:
        until = self._slow_until.get(node_id)
        if until is not None and until <= time.monotonic():
            del self._slow_until[node_id]
            return False
        return until is not None

    def recently_dead(self, node_id: bytes) -> bool:
        """True for a node that failed to answer within ``dead_node_ttl`` and has not been heard from since."""
        until = self._dead_until.get(node_id)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._dead_until[node_id]
            return False
        return True

    # ---- serving ------------------------------------------------------------------------------------------
    def _sender(self, address: tuple[str, int], nodeid: Any) -> Node:
        source = Node(_check_id(nodeid, "node id"), address[0], address[1])
        self.welcome_if_new(source)
        return source

    def rpc_ping(self, sender: tuple[str, int], nodeid: Any) -> bytes:
        self._sender(sender, nodeid)
        return self.source_node.id

    def rpc_store(self, sender: tuple[str, int], nodeid: Any, key: Any, entries: Any) -> list[bool | str]:
        key = _check_id(key, "key")
        record = record_from_wire(entries, self.config.max_value_bytes)
        self._sender(sender, nodeid)
        results: list[bool | str] = []
        for subkey, entry in record.items():
            current = self.storage.entry(key, subkey)
            if entry.owner and current is not None and isinstance(subkey, int) and (
                    current.owner != entry.owner or current.expiration >= entry.expiration):
                # refused or stale whether or not the signature holds: a flood of hijacks or replays costs no
                # verification (~100 us each)
                if current.owner == entry.owner:
                    results.append(False)
                    continue
                log.warning("refusing store from %s: subkey %s of %s is owned by another key", sender, subkey,
                            key.hex()[:16])
                results.append(f"refused: subkey {subkey} is owned by {current.owner.hex()[:16]}")
                continue
            if not self.verifier(key, subkey, *entry):
                log.warning("refusing unsigned or forged entry %s of %s from %s", subkey, key.hex()[:16], sender)
                results.append("refused: unsigned or bad signature")
                continue
            try:
                results.append(self.storage.store(key, subkey, *entry))
            except RecordFull as error:
                log.warning("refusing store from %s: %s", sender, error)
                results.append(f"record full: {error}")
            except NotOwner as error:
                log.warning("refusing store from %s: %s", sender, error)
                results.append(f"refused: {error}")
        return results

    def rpc_find_node(self, sender: tuple[str, int], nodeid: Any, key: Any) -> list[tuple[bytes, str, int]]:
        key = _check_id(key, "key")
        source = self._sender(sender, nodeid)
        neighbors = self.router.find_neighbors(Node(key), exclude=source)
        return [tuple(node) for node in neighbors]

    def rpc_find_value(self, sender: tuple[str, int], nodeid: Any, key: Any) -> dict[str, Any]:
        """The local record (possibly empty) *and* the closest contacts, so lookups can keep merging."""
        key = _check_id(key, "key")
        source = self._sender(sender, nodeid)
        return self._value_reply(key, self._contacts_for(key, self.router.ksize, source))

    def rpc_find_values(self, sender: tuple[str, int], nodeid: Any, keys: Any) -> bytes:
        """:meth:`rpc_find_value` for several keys, in order, stopping before the reply would outgrow a datagram; as
        one binary string (see :data:`VALUES_HEADER` and :func:`split_values_reply`)."""
        if not isinstance(keys, (list, tuple)) or not 0 < len(keys) <= MAX_KEYS_PER_REQUEST:
            raise MalformedRequest(f"find_values takes a list of 1 to {MAX_KEYS_PER_REQUEST} keys")
        keys = [_check_id(key, "key") for key in keys]
        source = self._sender(sender, nodeid)
        parts, size = [], 0
        for key in keys:
            reply = self._value_reply(key, self._contacts_for(key, 2 * self.config.read_width, source))
            record, auth, contacts = reply["record"].encode(), reply["auth"], reply["nodes"].encode()
            size += VALUES_HEADER.size + len(record) + len(auth) + len(contacts)
            if parts and size > REPLY_BUDGET_BYTES:
                break
            parts += [VALUES_HEADER.pack(len(record), len(auth), len(contacts)), record, auth, contacts]
        return b"".join(parts)

    def _contacts_for(self, key: bytes, k: int, asker: Node) -> str:
        """:func:`encode_contacts` of the ``k`` contacts closest to ``key`` other than ``asker``, encoded again only
        after the routing table changed: readers ask the same keys every few seconds."""
        memo = (key, k, asker.ip, asker.port)
        cached = self._contacts_text.get(memo)
        if cached is not None and cached[0] == self.router.version:
            return cached[1]
        text = encode_contacts(self.router.find_neighbors(Node(key), k=k, exclude=asker))
        if len(self._contacts_text) >= ENCODED_CONTACTS and memo not in self._contacts_text:
            del self._contacts_text[next(iter(self._contacts_text))]  # the oldest
        self._contacts_text[memo] = (self.router.version, text)
        return text

    def _value_reply(self, key: bytes, nodes: Sequence[Node] | str) -> dict[str, Any]:
        """:func:`find_value_reply` for what this node holds, re-encoding the record only after it changed:
        readers ask for the same records every few seconds, while declarers change them far less often."""
        record = self.storage.live(key) or {}  # drops expired entries first, which changes the version
        version = self.storage.versions.get(key)
        cached = self._encoded.get(key)
        if cached is None or cached[0] != version or version is None:
            if len(self._encoded) >= ENCODED_RECORDS:
                del self._encoded[next(iter(self._encoded))]
            cached = self._encoded[key] = (version, *encode_record(record))
        return find_value_reply(record, nodes, cached[1:])

    # ---- replication to newcomers -------------------------------------------------------------------------
    def welcome_if_new(self, node: Node) -> None:
        """Adds a new contact and hands it the records it is now among the closest replicas of.

        Stock kademlia hashes the (already hashed) storage keys a second time here, so it hands records to the
        wrong nodes.
        """
        self._dead_until.pop(node.id, None)  # it just spoke to us (or answered)
        self._slow_until.pop(node.id, None)
        if not self.router.is_new_node(node):
            return
        for key, record in self.storage:
            keynode = Node(key)
            neighbors = self.router.find_neighbors(keynode, k=self.config.num_replicas)
            if neighbors:
                new_node_close = node.distance_to(keynode) < neighbors[-1].distance_to(keynode)
                this_closest = self.source_node.distance_to(keynode) < neighbors[0].distance_to(keynode)
            if not neighbors or (new_node_close and this_closest):
                self.spawn(self.call_store(node, key, record))
        self.router.add_contact(node)

    def spawn(self, coro: Any) -> None:
        """Runs ``coro`` in the background, owned by this protocol (cancelled by :meth:`close_tasks`)."""
        self.adopt(asyncio.ensure_future(coro))

    def adopt(self, task: "asyncio.Future[Any]") -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def parse_nodes(self, data: Any) -> list[Node]:
        """Contacts from a find_node / find_value reply; malformed entries are skipped."""
        nodes = []
        for item in data if isinstance(data, (list, tuple)) else []:
            if (isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[0], bytes)
                    and len(item[0]) == ID_BYTES and valid_address(item[1], item[2])):
                nodes.append(Node(item[0], item[1], item[2]))
        return nodes

    def parse_known_value_reply(self, data: Any, key: bytes) -> tuple[Record, list[Node]] | None:
        """:meth:`parse_value_reply` at once, for a reply whose record bytes were parsed and verified before; None
        for any other (raises :class:`MalformedRequest` on a malformed one)."""
        if isinstance(data, dict) and isinstance(data.get("record"), str) and isinstance(data.get("auth"), bytes):
            memo = (key, data["record"], data["auth"])
            if (record := self._parsed_replies.get(memo)) is not None:
                return parse_find_value_reply(data, key, self.verifier, {memo[1:]: record},
                                              self.config.max_value_bytes, self._parsed_contacts)
        return None

    async def parse_value_reply(self, data: Any, key: bytes) -> tuple[Record, list[Node]]:
        """:func:`parse_find_value_reply`, for a record this node has not parsed in these exact bytes before, on
        this node's verification thread: checking a burst of fresh entries takes ~100 us each, and doing it on the
        loop would hold up every other reply until their peers looked dead (the thread gives the loop the GIL every
        few milliseconds).

        Replies repeat: every replica of a record sends the same bytes, and a record changes only when a declarer
        refreshes it, while clients look it up every few seconds. A reply whose (key, record, signatures) bytes
        were parsed before gets that record object back at once, on the loop (identical replicas are then merged
        once, as :func:`merge_records` counts them by identity), and so do its contacts when a reply brought the
        same ones before.
        """
        known = self.parse_known_value_reply(data, key)
        if known is not None:
            return known
        parsed = self._parsed_replies
        if self._verify_thread is None:
            self._verify_thread = ThreadPoolExecutor(1, thread_name_prefix="dmoe-dht-verify")
        record, nodes = await asyncio.get_running_loop().run_in_executor(
            self._verify_thread, parse_find_value_reply, data, key, self.verifier, None, self.config.max_value_bytes)
        if len(parsed) >= PARSED_REPLIES:
            del parsed[next(iter(parsed))]  # the oldest parsed
        parsed[key, data["record"], data["auth"]] = record
        return record, nodes

    def close_tasks(self) -> None:
        self._close_drain_socket()  # also here: the loop may stop before the transport reports its loss
        if self._verify_thread is not None:
            self._verify_thread.shutdown(wait=False, cancel_futures=True)
        for task in list(self._tasks):
            task.cancel()
        for future, timeout, _ in list(self._outstanding.values()):
            timeout.cancel()
            if not future.done():
                future.set_result((False, None))
        self._outstanding.clear()

