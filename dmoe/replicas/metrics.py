"""Prometheus metrics of replication, registered in the server's own registry (served with its other metrics).

Series:
    dmoe_replicas_held                      replicas of other servers' experts held now (read at scrape time)
    dmoe_replicas_held_bytes                their bytes on disk
    dmoe_replicas_pushed_total{result}      snapshots of this server's experts pushed to another server, by result:
                                            ok, refused (the receiver answered why) or failed (unreachable, timeout)
    dmoe_replicas_refused_total{reason}     replicas this server refused to keep, by reason (signature, not_owner,
                                            older, too_large, truncated, digest, malformed, mismatch, updates,
                                            layer: of a layer this server does not hold replicas of, busy: too
                                            many pushes at once, stalled: a push that sent nothing for a minute,
                                            slow: a push that fell behind the minimum rate, own: signed by this
                                            server's own key)
    dmoe_replicas_adopted_total             experts this server adopted from a replica
    dmoe_replicas_started_fresh_total       experts this server started from fresh weights although their cell may
                                            have trained before: no replica of them anywhere (lost training)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from dmoe.replicas.store import ReplicaStore


class _Held(Collector):
    def __init__(self, store: "ReplicaStore"):
        self._store = store

    def collect(self):
        yield GaugeMetricFamily("dmoe_replicas_held", "replicas of other servers' experts held now",
                                value=len(self._store))
        yield GaugeMetricFamily("dmoe_replicas_held_bytes", "bytes of the replicas held now", value=self._store.nbytes)


class ReplicaMetrics:
    """The replication series of one server, in ``registry`` (its :class:`~dmoe.server.metrics.ServerMetrics`')."""

    def __init__(self, registry: CollectorRegistry, store: "ReplicaStore"):
        self.pushed = Counter("dmoe_replicas_pushed", "snapshots pushed to another server, by result", ["result"],
                              registry=registry)
        self.refused = Counter("dmoe_replicas_refused", "replicas refused, by reason", ["reason"], registry=registry)
        self.adopted = Counter("dmoe_replicas_adopted", "experts adopted from a replica", registry=registry)
        self.started_fresh = Counter("dmoe_replicas_started_fresh",
                                     "experts started fresh with no replica anywhere (lost training)",
                                     registry=registry)
        registry.register(_Held(store))
