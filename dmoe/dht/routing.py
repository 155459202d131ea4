"""A routing table whose neighbour queries return the k closest contacts it knows, not an early subset.

Stock ``RoutingTable.find_neighbors`` walks buckets outward from the key's bucket and stops as soon as it has
collected k contacts, so it returns contacts that are not the closest and, when buckets run out on one side,
fewer than k; and ``get_bucket_for`` misplaces an id equal to a bucket's (inclusive) upper bound.
"""
from __future__ import annotations

import heapq

from kademlia.node import Node
from kademlia.routing import RoutingTable


class DHTRoutingTable(RoutingTable):
    def get_bucket_for(self, node: Node) -> int:
        for index, bucket in enumerate(self.buckets):
            if node.long_id <= bucket.range[1]:
                return index
        return len(self.buckets) - 1

    def contacts(self) -> list[Node]:
        """Every live contact in the table."""
        return [node for bucket in self.buckets for node in bucket.get_nodes()]

    def find_neighbors(self, node: Node, k: int | None = None, exclude: Node | None = None) -> list[Node]:
        """The min(k, known) contacts closest to ``node`` by XOR distance, closest first."""
        k = k or self.ksize
        self.buckets[self.get_bucket_for(node)].touch_last_updated()  # a looked-up region is not lonely
        node_id, target = node.id, node.long_id  # (every look-up calls this, on every node it asks: kept lean)
        candidates = [contact for bucket in self.buckets for contact in bucket.nodes.values()
                      if contact.id != node_id and (exclude is None or not contact.same_home_as(exclude))]
        return heapq.nsmallest(k, candidates, key=lambda contact: contact.long_id ^ target)
