"""What DHT messages carry, and how it is encoded and parsed: record entries, contacts, and find_value(s) replies.

Everything that comes from a peer is checked here before anything else sees it: malformed input raises
:class:`MalformedRequest` (the transport drops the request) or is skipped (contacts), entries not validly signed for
their record are dropped, and contacts must be IP literals with a valid port, kept in their canonical spelling
(:func:`canonical_ip`: replies come from it). Replies repeat (every replica sends the same bytes, readers ask again
every few seconds), so both ends keep what they encoded or parsed: :class:`EncodedReplies` on the serving side,
:class:`ReplyParser` on the asking side.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import socket
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Sequence

from kademlia.node import Node

from dmoe.dht.routing import DHTRoutingTable
from dmoe.dht.signing import AUTH_BYTES, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, valid_issue_time
from dmoe.dht.storage import Entry, Record, RecordStorage
from dmoe.endpoints import is_loopback_ip

logger = logging.getLogger(__name__)

ID_BYTES = 20
#: find_value replies remembered parsed and verified (each at most a datagram: a few tens of MB at worst)
PARSED_REPLIES = 512
#: encoded records a node keeps for its replies (re-encoded when the record changes)
ENCODED_RECORDS = 1024
#: contact lists of find_value replies remembered parsed (a few KB each, ~25 KB at most: see MAX_CONTACTS)
PARSED_CONTACTS = 4096
#: contacts taken from one reply (a node names its ``ksize`` closest, 20 by default); a hostile reply may carry a
#: datagram's worth, ~1,000, and the parsed lists above would then hold a GiB and more
MAX_CONTACTS = 64
#: contact lists a node keeps encoded for its replies (re-encoded when its routing table changes; ~1 KB each)
ENCODED_CONTACTS = 4096
#: a find_values reply is one binary string: per key, these three lengths, then the record's JSON text, its owners
#: and signatures, and the contacts' JSON text (one string decodes in one step; a list of maps took many
#: pure-Python reads per reply)
VALUES_HEADER = struct.Struct(">III")


class MalformedRequest(ValueError):
    """A request whose arguments are not what the RPC expects."""


def check_id(value: Any, what: str) -> bytes:
    """``value`` when it is a node id or key (20 bytes); raises :class:`MalformedRequest` naming ``what``."""
    if not isinstance(value, bytes) or len(value) != ID_BYTES:
        raise MalformedRequest(f"{what} must be {ID_BYTES} bytes")
    return value


def record_to_wire(record: Record) -> list[list[Any]]:
    """Store-request entries ``[subkey, value, expiration, owner, signature, issued_us]``, sorted by subkey."""
    return [[subkey, *entry] for subkey, entry in sorted(record.items(), key=_order)]


def _order(item: tuple[Any, Any]) -> tuple[bool, Any]:
    return (isinstance(item[0], str), item[0])


#: Values are printable ASCII that JSON does not escape (endpoints, say), so a reply's size is what the caps say.
VALUE_PATTERN = re.compile(r"[!#-\[\]-~]*")
#: Longest str (shared) subkey.
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


def check_issued(issued_us: Any, expiration: float) -> None:
    """An entry's issue time: integer microseconds, not negative and not after its expiration (an entry of the
    signing format before the issue time, v1, has none, and is refused here as malformed)."""
    if not valid_issue_time(issued_us) or issued_us > expiration * 1_000_000:
        raise MalformedRequest("an issue time must be an int of microseconds, at most the expiration's")


def record_from_wire(entries: Any, max_value_bytes: int = 1 << 16) -> Record:
    """Parses ``[[subkey, value, expiration, owner, signature, issued_us], ...]``; raises :class:`MalformedRequest`
    on anything else (signatures are checked by the caller)."""
    if not isinstance(entries, (list, tuple)):
        raise MalformedRequest("record entries must be a list")
    record: Record = {}
    for entry in entries:
        if not isinstance(entry, (list, tuple)) or len(entry) != 6:
            raise MalformedRequest("a record entry must be [subkey, value, expiration, owner, signature, issued_us]")
        subkey, value, expiration, owner, signature, issued_us = entry
        check_entry(subkey, value, expiration, max_value_bytes)
        check_issued(issued_us, expiration)
        if not isinstance(owner, bytes) or not isinstance(signature, bytes) or len(owner) > PUBLIC_KEY_BYTES \
                or len(signature) > SIGNATURE_BYTES:
            raise MalformedRequest("owner and signature must be bytes (32 and 64)")
        record[subkey] = Entry(value, float(expiration), owner, signature, issued_us)
    return record


def find_value_reply(record: Record, nodes: Sequence[Node] | str,
                     encoded: tuple[str, bytes] | None = None) -> dict[str, Any]:
    """A find_value reply: the record and the contacts as JSON text, which Python decodes in one C call (the
    pure-Python msgpack decoder this was designed against was slow for a record of hundreds of subkeys), and the
    entries' owners and signatures as one binary string, 96 bytes per entry in the same order (as base64 in JSON
    they would not fit a datagram next to 256 entries). ``nodes``: the contacts, or :func:`encode_contacts` of
    them. ``encoded``: :func:`encode_record` of ``record``, when the caller kept it from an earlier reply."""
    text, auth = encoded if encoded is not None else encode_record(record)
    return {"record": text, "auth": auth, "nodes": nodes if isinstance(nodes, str) else encode_contacts(nodes)}


def encode_contacts(nodes: Sequence[Node]) -> str:
    """The contacts part of a find_value reply."""
    return json.dumps([[node.id.hex(), node.ip, node.port] for node in nodes], separators=(",", ":"))


def encode_record(record: Record) -> tuple[str, bytes]:
    """The record part of a find_value reply: entries ``[subkey, value, expiration, issued_us]`` as JSON text,
    owners and signatures as bytes."""
    entries = sorted(record.items(), key=_order)
    auth = b"".join(entry.owner.ljust(PUBLIC_KEY_BYTES, b"\0") + entry.signature.ljust(SIGNATURE_BYTES, b"\0")
                    for _, entry in entries)
    return json.dumps([[subkey, entry.value, entry.expiration, entry.issued_us] for subkey, entry in entries],
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
            nodes = parse_contacts(json.loads(nodes_text))
            if contacts is not None:
                if len(contacts) >= PARSED_CONTACTS:
                    del contacts[next(iter(contacts))]  # the oldest parsed
                contacts[nodes_text] = nodes
    except (ValueError, RecursionError) as error:  # JSON nested deeper than the parser recurses: RecursionError
        raise MalformedRequest(f"undecodable find_value reply: {error!r}"[:200]) from None
    if seen is not None:
        seen[text, auth] = record
    return record, nodes


def valid_port(port: Any) -> bool:
    """A port a datagram can go to: any other made ``sendto`` raise, and asyncio then closed the sender's socket."""
    return isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536


@functools.lru_cache(maxsize=1 << 14)  # (every contact of every reply is parsed through it)
def canonical_ip(ip: str) -> str | None:
    """The one spelling of an IP literal (``socket.inet_ntop`` of its bytes: ``0:0:0:0:0:0:0:1``, ``::0001`` and
    ``::1`` are all ``::1``, ``2001:DB8::1`` is ``2001:db8::1``, ``::ffff:7f00:1`` is ``::ffff:127.0.0.1``), or
    None for anything else: a host name, or a scoped IPv6 address (``fe80::1%eth0``, which means nothing in a
    contact passed between machines). Replies come from the kernel's spelling of their sender, so every address a
    request may go to is kept in this one: a valid other spelling made every request to that node time out, and
    its node id look dead."""
    # inet_pton: far cheaper than ipaddress.ip_address and the same verdicts
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.inet_ntop(family, socket.inet_pton(family, ip))
        except (OSError, ValueError):
            continue
    return None


def canonical_host(host: str) -> str:
    """``host`` with an IP literal in its :func:`canonical_ip` spelling (a scoped IPv6 address keeps its scope, a
    host name is left as it is): how an initial peer typed by a user is kept."""
    address, percent, scope = host.partition("%")
    ip = canonical_ip(address)
    return host if ip is None else ip + percent + scope


def valid_address(ip: Any, port: Any) -> bool:
    """An IP literal (in any spelling: see :func:`canonical_ip`) and a valid port. A contact's address comes from
    peers: a port past 65535 closed the asker's socket (one hostile reply killed the node), and a host name would
    be resolved, blocking the loop."""
    return isinstance(ip, str) and valid_port(port) and canonical_ip(ip) is not None


def contact(node_id: bytes, ip: Any, port: Any) -> Node | None:
    """A contact from a peer's reply at its canonical address (:func:`canonical_ip`), or None if the address is no
    IP literal with a valid port."""
    if not isinstance(ip, str) or not valid_port(port):
        return None
    ip = canonical_ip(ip)
    return None if ip is None else Node(node_id, ip, port)


def parse_contacts(raw_nodes: Any) -> list[Node]:
    """Contacts ``[[id hex, ip, port], ...]``, the first :data:`MAX_CONTACTS`, at their canonical addresses;
    malformed items are skipped."""
    nodes = []
    for item in raw_nodes[:MAX_CONTACTS] if isinstance(raw_nodes, list) else []:
        if isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and len(item[0]) == 2 * ID_BYTES:
            try:
                node = contact(bytes.fromhex(item[0]), item[1], item[2])
            except ValueError:
                continue
            if node is not None:
                nodes.append(node)
    return nodes


def as_seen_from(responder: Node, nodes: list[Node]) -> list[Node]:
    """A reply's contacts as this node can reach them. A loopback address from a peer on another machine names a
    node of that machine which joined its peer through loopback (a server's processes join their parent's node so):
    it is reached at the peer's own address and the same port. ``nodes`` is not modified (parsed lists are shared)."""
    if is_loopback_ip(responder.ip) or not any(is_loopback_ip(node.ip) for node in nodes):
        return nodes
    return [Node(node.id, responder.ip, node.port) if is_loopback_ip(node.ip) else node for node in nodes]


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
        if not isinstance(entry, list) or len(entry) != 4:
            raise MalformedRequest("a record entry must be [subkey, value, expiration, issued_us]")
        subkey, value, expiration, issued_us = entry
        check_entry(subkey, value, expiration, max_value_bytes)
        check_issued(issued_us, expiration)
        offset = index * AUTH_BYTES
        owner, signature = auth[offset:offset + PUBLIC_KEY_BYTES], auth[offset + PUBLIC_KEY_BYTES:offset + AUTH_BYTES]
        if verifier(key, subkey, value, float(expiration), owner, signature, issued_us):
            record[subkey] = Entry(value, float(expiration), owner, signature, issued_us)
        else:
            rejected += 1
    if rejected:
        logger.warning("ignoring %d unsigned or forged entries of record %s", rejected, key.hex()[:16])
    return record



def parse_nodes(data: Any) -> list[Node]:
    """Contacts from a find_node reply (``[(id, ip, port), ...]``), the first :data:`MAX_CONTACTS`, at their
    canonical addresses; malformed entries are skipped."""
    nodes = []
    for item in data[:MAX_CONTACTS] if isinstance(data, (list, tuple)) else []:
        if (isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[0], bytes)
                and len(item[0]) == ID_BYTES and (node := contact(*item)) is not None):
            nodes.append(node)
    return nodes


class ReplyParser:
    """Parses and verifies find_value replies, remembering what it parsed: every replica of a record sends the same
    bytes, and a record changes only when its owner refreshes it, while readers look it up every few seconds.

    A reply whose (key, record, signatures) bytes were parsed before gets that record object back at once (identical
    replicas are then merged once, as :func:`~dmoe.dht.storage.merge_records` counts them by identity), and so do
    its contacts when a reply brought the same ones before. Other replies are verified on a thread of this parser's
    own (see :meth:`parse`), which :meth:`close` stops.
    """

    def __init__(self, verifier: Callable[..., bool], max_value_bytes: int):
        self.verifier, self.max_value_bytes = verifier, max_value_bytes
        self._parsed_replies: dict[tuple[bytes, str, bytes], Record] = {}
        self._parsed_contacts: dict[str, list[Node]] = {}  # see parse_find_value_reply
        self._verify_thread: ThreadPoolExecutor | None = None

    def parse_known(self, data: Any, key: bytes) -> tuple[Record, list[Node]] | None:
        """:meth:`parse` at once, for a reply whose record bytes were parsed and verified before; None for any other
        (raises :class:`MalformedRequest` on a malformed one)."""
        if isinstance(data, dict) and isinstance(data.get("record"), str) and isinstance(data.get("auth"), bytes):
            memo = (key, data["record"], data["auth"])
            if (record := self._parsed_replies.get(memo)) is not None:
                return parse_find_value_reply(data, key, self.verifier, {memo[1:]: record},
                                              self.max_value_bytes, self._parsed_contacts)
        return None

    async def parse(self, data: Any, key: bytes) -> tuple[Record, list[Node]]:
        """:func:`parse_find_value_reply`, for a record not parsed in these exact bytes before, on the verification
        thread: checking a burst of fresh entries is slow, and doing it on the loop would hold up every other reply
        until their peers looked dead (the thread gives the loop the GIL every few milliseconds)."""
        known = self.parse_known(data, key)
        if known is not None:
            return known
        parsed = self._parsed_replies
        if self._verify_thread is None:
            self._verify_thread = ThreadPoolExecutor(1, thread_name_prefix="dmoe-dht-verify")
        record, nodes = await asyncio.get_running_loop().run_in_executor(
            self._verify_thread, parse_find_value_reply, data, key, self.verifier, None, self.max_value_bytes)
        if len(parsed) >= PARSED_REPLIES:
            del parsed[next(iter(parsed))]  # the oldest parsed
        parsed[key, data["record"], data["auth"]] = record
        return record, nodes

    def close(self) -> None:
        """Stops the verification thread: queued replies are dropped, and the one being verified (milliseconds of
        pure CPU, which never waits on the loop) is waited for, so no thread outlives its node's close."""
        if self._verify_thread is not None:
            self._verify_thread.shutdown(wait=True, cancel_futures=True)


class EncodedRecord(NamedTuple):
    """A record as a find_value reply carries it (see :func:`encode_record`), and the storage version it encodes."""
    version: int | None
    text: str
    auth: bytes


#: :func:`encode_record` of no entries
_EMPTY_RECORD = encode_record({})


class EncodedReplies:
    """What a node sends in its find_value replies, encoded again only after it changed: readers ask for the same
    records every few seconds, while their owners change them far less often."""

    def __init__(self) -> None:
        self._records: dict[bytes, EncodedRecord] = {}
        # (key, k, asker's address) -> (routing table version, contacts text)
        self._contacts: dict[tuple[bytes, int, str, int], tuple[int, str]] = {}

    def contacts(self, router: DHTRoutingTable, key: bytes, k: int, asker: Node | None,
                 allowed: Callable[[], bool] | None = None) -> str:
        """:func:`encode_contacts` of the ``k`` contacts closest to ``key`` other than ``asker`` (None: a client-mode
        node, which is no contact), encoded again only after the routing table changed. ``allowed``: asked before a
        search that is not remembered (the asker's budget, see ``DHTProtocol.lookups``); if it says no, no contacts.
        Readers ask the same keys again and again: only keys asked afresh (a flood of random ones) cost a search."""
        memo = (key, k, asker.ip, asker.port) if asker is not None else (key, k, "", 0)
        cached = self._contacts.get(memo)
        if cached is not None and cached[0] == router.version:
            return cached[1]
        if allowed is not None and not allowed():
            return encode_contacts(())
        text = encode_contacts(router.find_neighbors(Node(key), k=k, exclude=asker))
        if len(self._contacts) >= ENCODED_CONTACTS and memo not in self._contacts:
            del self._contacts[next(iter(self._contacts))]  # the oldest
        self._contacts[memo] = (router.version, text)
        return text

    def value_reply(self, storage: RecordStorage, key: bytes, nodes: Sequence[Node] | str) -> dict[str, Any]:
        """:func:`find_value_reply` for what ``storage`` holds, re-encoding the record only after it changed."""
        record = storage.live(key) or {}  # drops expired entries first, which changes the version
        if not record:  # (not cached: a flood of keys held nowhere would evict the records readers ask for)
            return find_value_reply(record, nodes, _EMPTY_RECORD)
        version = storage.versions.get(key)
        cached = self._records.get(key)
        if cached is None or cached.version != version or version is None:
            if len(self._records) >= ENCODED_RECORDS:
                del self._records[next(iter(self._records))]
            cached = self._records[key] = EncodedRecord(version, *encode_record(record))
        return find_value_reply(record, nodes, (cached.text, cached.auth))
