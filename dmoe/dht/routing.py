"""A routing table whose neighbour queries return the k closest contacts it knows, not an early subset, and
whose buckets hold few contacts of any one machine.

Stock ``RoutingTable.find_neighbors`` walks buckets outward from the key's bucket and stops as soon as it has
collected k contacts, so it returns contacts that are not the closest and, when buckets run out on one side,
fewer than k; and ``get_bucket_for`` misplaces an id equal to a bucket's (inclusive) upper bound.

Node ids cost nothing and nothing binds them to an address: stock tables took any number of ids at one socket, so
one process that pinged a node under ids near a key filled the bucket of that key's neighbourhood, was named as
all of the key's closest nodes to every asker, and became the key's replica "majority".
"""
from __future__ import annotations

import bisect
import functools
import heapq
import ipaddress
from itertools import chain

from kademlia.node import Node
from kademlia.routing import KBucket, RoutingTable

from dmoe.endpoints import machine_of

#: (key, count) neighbour lists a table remembers until its contacts change
NEAREST_CACHED = 4096
#: bits of a node id (kademlia's are 20-byte digests)
ID_BITS = 160
#: contacts of one machine (:func:`contact_machine`) that a bucket holds at most, its replacements included
MAX_PER_MACHINE = 2


@functools.lru_cache(maxsize=4096)
@functools.lru_cache(maxsize=1 << 14)  # (a crawl asks for every contact it hears of)
def contact_machine(ip: str, port: int) -> str:
    """The machine a contact at ``ip:port`` stands for, where contacts and votes are counted per machine (node ids
    are free to make, machines are not): its IPv4 address or its IPv6 /64 (:func:`~dmoe.endpoints.machine_of`).
    On loopback, where a local swarm (and every test) runs all its nodes, each ``ip:port`` counts as a machine
    of its own: one process, however many ids it claims. An unparsable host counts per ``ip:port`` too."""
    try:
        address = ipaddress.ip_address(str(ip).split("%", 1)[0])
    except ValueError:
        return f"{ip}:{port}"
    if (getattr(address, "ipv4_mapped", None) or address).is_loopback:
        return f"{ip}:{port}"
    return machine_of(address)


class DHTRoutingTable(RoutingTable):
    """Also remembers each key's closest contacts until the set of contacts changes: a node answers every look-up
    with the contacts closest to each key asked, readers ask the same keys every few seconds, and sorting all
    contacts by distance was the largest cost of serving a look-up."""

    def flush(self) -> None:
        super().flush()
        self._changed()

    def _changed(self) -> None:
        #: bumped whenever the set of contacts may have changed, so that what is derived from it can be reused
        self.version = getattr(self, "version", 0) + 1
        self._nearest: dict[tuple[bytes, int], list[Node]] = {}

    def split_bucket(self, index: int) -> None:
        super().split_bucket(index)
        self._changed()

    def remove_contact(self, node: Node) -> None:
        """Removes ``node``'s id if this table holds it at ``node``'s address (live or as a replacement; a replacement
        may take a live contact's place). Stock kademlia removed the id wherever it lived, so the silence of any
        address a reply named under a live contact's id evicted that contact (review 89)."""
        held = self.holding(node)
        if held is None or not held.same_home_as(node):
            return
        super().remove_contact(node)  # (the set changes either way)
        self._changed()

    def holding(self, node: Node) -> Node | None:
        """The contact (live, else a replacement) this table holds under ``node``'s id, wherever it is."""
        bucket = self.buckets[self.get_bucket_for(node)]
        return bucket.nodes.get(node.id) or bucket.replacement_nodes.get(node.id)

    def add_contact(self, node: Node) -> None:
        """Adds ``node`` (or moves its id to its new address), unless its bucket already holds
        :data:`MAX_PER_MACHINE` other contacts of its machine, live or replacements: then it is left out."""
        if self.crowded(self.buckets[self.get_bucket_for(node)], node):
            return
        super().add_contact(node)
        if not self.is_new_node(node):  # it is in the table now, not merely among a full bucket's replacements
            self._changed()

    @staticmethod
    def crowded(bucket: KBucket, node: Node) -> bool:
        """True when ``bucket`` holds :data:`MAX_PER_MACHINE` contacts (other than ``node``'s id) of ``node``'s
        machine. Replacements count too: they take a live contact's place when it is evicted, and a split hands
        them to the new buckets, so no bucket can get more than its share of one machine that way either."""
        machine, same = contact_machine(node.ip, node.port), 0
        for contact in chain(bucket.nodes.values(), bucket.replacement_nodes.values()):
            if contact.id != node.id and contact_machine(contact.ip, contact.port) == machine:
                same += 1
                if same >= MAX_PER_MACHINE:
                    return True
        return False

    def get_bucket_for(self, node: Node) -> int:
        for index, bucket in enumerate(self.buckets):
            if node.long_id <= bucket.range[1]:
                return index
        return len(self.buckets) - 1

    def contacts(self) -> list[Node]:
        """Every live contact in the table."""
        return [node for bucket in self.buckets for node in bucket.get_nodes()]

    def size(self) -> int:
        """How many live contacts the table holds (without listing them: asked before every look-up)."""
        return len(self._by_id()[1])

    def find_neighbors(self, node: Node, k: int | None = None, exclude: Node | None = None) -> list[Node]:
        """The min(k, known) contacts closest to ``node`` by XOR distance, closest first, other than ``node`` and
        those at ``exclude``'s address."""
        k = k or self.ksize
        self.buckets[self.get_bucket_for(node)].touch_last_updated()  # a looked-up region is not lonely
        nearest = self._nearest.get((node.id, k))
        if nearest is None:
            # one more than asked, so that excluding the asker (the usual case) still leaves k
            nearest = self._nearest_uncached(node, k + 1)
            if len(self._nearest) >= NEAREST_CACHED:
                del self._nearest[next(iter(self._nearest))]  # the oldest
            self._nearest[node.id, k] = nearest
        if exclude is None:
            return nearest[:k]
        kept = [contact for contact in nearest if not contact.same_home_as(exclude)]
        if len(kept) < k < len(nearest):  # several contacts at the excluded address: look further
            return self._nearest_uncached(node, k, exclude)
        return kept[:k]

    def _nearest_uncached(self, node: Node, k: int, exclude: Node | None = None) -> list[Node]:
        """The k closest, searched among the contacts of the smallest aligned block of ids around ``node``'s that
        holds enough of them: every id sharing the first p bits with the target is closer to it than any id that
        does not, so the k closest are all in that block. Sorting every contact by distance cost a node 0.2 ms of
        its only loop per key asked with 400 contacts, which any peer could ask 90 of in one datagram (review 70)."""
        ids, contacts = self._by_id()
        node_id, target = node.id, node.long_id

        def block(prefix: int) -> tuple[int, int]:
            shift = ID_BITS - prefix
            low = (target >> shift) << shift
            return bisect.bisect_left(ids, low), bisect.bisect_left(ids, low + (1 << shift))

        shortest, longest = 0, ID_BITS  # the longest prefix whose block holds k + 1 contacts (node's id may be one)
        while shortest < longest:
            middle = (shortest + longest + 1) // 2
            start, end = block(middle)
            shortest, longest = (middle, longest) if end - start > k else (shortest, middle - 1)
        prefix = shortest
        while True:
            start, end = block(prefix)
            candidates = [contact for contact in contacts[start:end]
                          if contact.id != node_id and (exclude is None or not contact.same_home_as(exclude))]
            if len(candidates) >= k or prefix == 0:
                return heapq.nsmallest(k, candidates, key=lambda contact: contact.long_id ^ target)
            prefix -= 1  # excluded contacts left too few: a block twice as large

    def _by_id(self) -> tuple[list[int], list[Node]]:
        """Every live contact's id, ascending, and the contacts in that order, until the contacts change."""
        cached = getattr(self, "_sorted", None)
        if cached is None or cached[0] != self.version:
            contacts = sorted((contact for bucket in self.buckets for contact in bucket.nodes.values()),
                              key=lambda contact: contact.long_id)
            cached = self._sorted = (self.version, [contact.long_id for contact in contacts], contacts)
        return cached[1], cached[2]
