"""A routing table whose neighbour queries return the k closest contacts it knows, not an early subset.

Stock ``RoutingTable.find_neighbors`` walks buckets outward from the key's bucket and stops as soon as it has
collected k contacts, so it returns contacts that are not the closest and, when buckets run out on one side,
fewer than k; and ``get_bucket_for`` misplaces an id equal to a bucket's (inclusive) upper bound.
"""
from __future__ import annotations

import heapq

from kademlia.node import Node
from kademlia.routing import RoutingTable

#: (key, count) neighbour lists a table remembers until its contacts change
NEAREST_CACHED = 4096


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
        super().remove_contact(node)  # (a replacement may take its place: the set changes either way)
        self._changed()

    def add_contact(self, node: Node) -> None:
        super().add_contact(node)
        if not self.is_new_node(node):  # it is in the table now, not merely among a full bucket's replacements
            self._changed()

    def get_bucket_for(self, node: Node) -> int:
        for index, bucket in enumerate(self.buckets):
            if node.long_id <= bucket.range[1]:
                return index
        return len(self.buckets) - 1

    def contacts(self) -> list[Node]:
        """Every live contact in the table."""
        return [node for bucket in self.buckets for node in bucket.get_nodes()]

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
        node_id, target = node.id, node.long_id
        candidates = [contact for bucket in self.buckets for contact in bucket.nodes.values()
                      if contact.id != node_id and (exclude is None or not contact.same_home_as(exclude))]
        return heapq.nsmallest(k, candidates, key=lambda contact: contact.long_id ^ target)
