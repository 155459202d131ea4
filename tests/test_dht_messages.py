"""Message encoding and parsing: replies fit a datagram, find_values replies split back, bad contacts are dropped,
and both ends reuse what they encoded or parsed."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import umsgpack
from kademlia.node import Node

from dmoe.dht.config import DHTConfig
from dmoe.dht import DHT
from dmoe.dht.messages import (MAX_CONTACTS, VALUES_HEADER, EncodedReplies, MalformedRequest, ReplyParser,
                               as_seen_from, find_value_reply, parse_contacts, parse_find_value_reply, parse_nodes,
                               split_values_reply)
from dmoe.dht.node import parse_endpoint
from dmoe.dht.routing import DHTRoutingTable
from dmoe.dht.signing import Identity, Verifier
from dmoe.dht.storage import Entry, RecordStorage
from dmoe.dht.transport import MAX_DATAGRAM_BYTES

KEY = b"k" * 20


def test_a_full_record_with_the_longest_endpoints_fits_in_one_reply_datagram():
    config = DHTConfig()
    endpoint = "h" * config.max_value_bytes
    record = {coord: Entry(endpoint, 1e10 + coord + 0.123, bytes(32), bytes(64), 10**16 + coord)
              for coord in range(2**31 - 256, 2**31)}  # (issue times later than any a node holds: 16 digits)
    nodes = [Node(bytes(20), "255.255.255.255", 65535)] * config.ksize
    reply = umsgpack.packb(find_value_reply(record, nodes))
    assert len(reply) + 21 < MAX_DATAGRAM_BYTES


def test_replies_reuse_the_encoded_record_until_it_changes_and_readers_parse_identical_bytes_once():
    identity = Identity()
    storage, encoded = RecordStorage(), EncodedReplies()
    expiration = time.time() + 60
    storage.store(KEY, 1, *identity.entry(KEY, 1, "a:1", expiration))
    first = encoded.value_reply(storage, KEY, [])
    assert encoded.value_reply(storage, KEY, [])["record"] is first["record"]  # not encoded again
    storage.store(KEY, 2, *identity.entry(KEY, 2, "b:2", expiration))
    second = encoded.value_reply(storage, KEY, [])
    assert second["record"] != first["record"] and second == find_value_reply(storage.get(KEY), [])

    calls = []
    verifier = Verifier()
    parser = ReplyParser(lambda *entry: calls.append(entry) or verifier(*entry), DHTConfig().max_value_bytes)

    async def parse_twice():
        one, _ = await parser.parse(dict(second), KEY)
        two, _ = await parser.parse(dict(second), KEY)
        three, _ = await parser.parse(dict(second), b"x" * 20)  # same bytes, other key: checked
        parser.close()
        return one, two, three

    one, two, three = asyncio.run(parse_twice())
    assert one is two and set(one) == {1, 2}
    assert three == {}  # signed for KEY, not for the other key
    assert len(calls) == 4  # two entries for KEY once, then both again for the other key


def test_contact_lists_are_encoded_again_only_after_the_routing_table_changed():
    me, asker = Node(b"m" * 20, "127.0.0.1", 1), Node(b"a" * 20, "127.0.0.1", 2)
    table, encoded = DHTRoutingTable(None, 20, me), EncodedReplies()
    table.add_contact(Node(b"c" * 20, "127.0.0.1", 3))
    first = encoded.contacts(table, KEY, 5, asker)
    assert encoded.contacts(table, KEY, 5, asker) is first
    table.add_contact(Node(b"d" * 20, "127.0.0.1", 4))
    assert [contact[2] for contact in json.loads(encoded.contacts(table, KEY, 5, asker))] == [3, 4]


def test_a_find_values_reply_is_split_back_into_replies_and_a_truncated_one_is_refused():

    parts = [(b'[[1,"a:1",5.0]]', b"x" * 96, b'[]'), (b"[]", b"", b'[["' + b"ab" * 20 + b'","127.0.0.1",9]]')]
    blob = b"".join(VALUES_HEADER.pack(len(r), len(a), len(n)) + r + a + n for r, a, n in parts)
    assert split_values_reply(blob) == [{"record": r.decode(), "auth": a, "nodes": n.decode()} for r, a, n in parts]
    for broken in (blob[:-1], blob[:5], blob + b"\x00", "text", None):
        assert split_values_reply(broken) is None
    assert split_values_reply(blob.replace(b"a:1", b"\xff:1")) is None  # not ASCII


def test_contacts_with_addresses_no_datagram_can_reach_are_dropped():
    """A hostile reply listing a contact at port 70000 made ``sendto`` raise, and asyncio then closed the asker's
    socket: one reply silenced the node. Host names would be resolved on the loop. Both are dropped."""
    good = ["ab" * 20, "127.0.0.1", 9]
    hostile = [["cd" * 20, "127.0.0.1", 70000], ["cd" * 20, "127.0.0.1", 0], ["cd" * 20, "peer.example", 9],
               ["cd" * 20, "127.0.0.1", True], ["cd" * 20, "::1", 9]]
    assert [(n.ip, n.port) for n in parse_contacts([good, *hostile])] == [("127.0.0.1", 9), ("::1", 9)]
    assert parse_nodes([[b"x" * 20, "127.0.0.1", 70000], [b"y" * 20, "localhost", 9]]) == []
    assert [(n.ip, n.port) for n in parse_nodes([[b"x" * 20, "127.0.0.1", 9]])] == [("127.0.0.1", 9)]


def test_contacts_from_replies_and_initial_peers_are_kept_at_the_canonical_spelling_of_their_ip():
    """Review 70, finding 3: replies come from the kernel's spelling of their sender's address, so a contact named
    at another valid spelling of a live node's IPv6 address (uncompressed, zero-padded, uppercase) never answered,
    and any peer could get honest contacts marked dead and evicted by naming them so."""
    spellings = {"0:0:0:0:0:0:0:1": "::1", "::0001": "::1", "2001:DB8::0001": "2001:db8::1",
                 "2001:0db8:0000:0000:0000:0000:0000:0001": "2001:db8::1", "::FFFF:7f00:1": "::ffff:127.0.0.1",
                 "::ffff:127.0.0.1": "::ffff:127.0.0.1", "127.0.0.1": "127.0.0.1", "::1": "::1"}
    raw = [[f"{i:040x}", spelling, 9] for i, spelling in enumerate(spellings)]
    assert [node.ip for node in parse_contacts(raw)] == list(spellings.values())
    assert [node.ip for node in parse_nodes([(bytes.fromhex(i), ip, port) for i, ip, port in raw])] == \
        list(spellings.values())
    assert as_seen_from(Node(b"r" * 20, "10.0.0.7", 1), parse_contacts([["ab" * 20, "0:0:0:0:0:0:0:1", 9]]))[0].ip \
        == "10.0.0.7", "a loopback contact of a remote peer, spelled otherwise, was not taken to be on that peer"
    assert parse_contacts([["ab" * 20, "fe80::1%eth0", 9]]) == []  # scoped: meaningless between machines
    for endpoint, address in [("[0:0:0:0:0:0:0:1]:5", ("::1", 5)), ("[2001:DB8::1]:5", ("2001:db8::1", 5)),
                              ("127.0.0.1:5", ("127.0.0.1", 5)), ("localhost:5", ("localhost", 5)),
                              ("[FE80::0001%eth0]:5", ("fe80::1%eth0", 5))]:
        assert parse_endpoint(endpoint) == address


def test_a_reply_nested_too_deep_to_parse_is_malformed_and_a_lookup_does_not_wait_for_it():
    """json.loads raises RecursionError (not ValueError) on deep nesting: the reply never reached the crawl, which
    waited for it until the call timed out (a server's declarations, which have no timeout, for ever)."""
    deep = "[" * 30000
    for reply in ({"record": "[]", "auth": b"", "nodes": deep}, {"record": deep, "auth": b"", "nodes": "[]"}):
        with pytest.raises(MalformedRequest):
            parse_find_value_reply(reply, KEY, lambda *args: True)

    def hostile_value(sender, nodeid, key):
        return {"record": "[]", "auth": b"", "nodes": deep}

    with DHT() as hostile:
        hostile.node.protocol.rpc_find_value = hostile_value
        with DHT([hostile.endpoint], config=DHTConfig(call_timeout=20.0)) as victim:
            started = time.monotonic()
            assert victim.get("ffn0") == {}
            assert time.monotonic() - started < 10, "the lookup waited for a reply it had dropped"


def test_a_reply_names_at_most_max_contacts():
    many = [[(i.to_bytes(2, "big") * 10).hex(), "10.0.0.1", 1000 + i] for i in range(3 * MAX_CONTACTS)]
    assert len(parse_contacts(many)) == MAX_CONTACTS
    assert len(parse_nodes([(bytes.fromhex(item[0]), item[1], item[2]) for item in many])) == MAX_CONTACTS
