"""Expert replicas: no expert's training is lost when its volunteer leaves, and the grid heals itself.

Each server pushes snapshots of its experts (weights, optimizer state, update count; signed by its DHT identity)
to the few servers closest to each expert's key (:mod:`~dmoe.replicas.pusher`), which keep them on disk
(:mod:`~dmoe.replicas.store`) after checking them (:mod:`~dmoe.replicas.service`,
:mod:`~dmoe.replicas.snapshots`) and announce them in the DHT as replicas (:mod:`~dmoe.replicas.records`). When an
expert's declaration expires, a holder adopts it: the newest replica, served under the same uid, claimed through
the directory's owned entries so that exactly one server wins (:mod:`~dmoe.replicas.adoption`).
:class:`Replication` owns all of it for one :class:`~dmoe.server.ExpertServer`.
"""
from dmoe.replicas.adoption import Adopter, claim, drop_unowned, newest_replica, restore_newest
from dmoe.replicas.pusher import ReplicaChannels, ReplicaError, ReplicaPusher, fetch_snapshot, push_snapshot
from dmoe.replicas.records import Adoption, Holder, adoptions, holders, owner_of
from dmoe.replicas.replication import ReplicaConfig, Replication
from dmoe.replicas.service import ReplicaServicer
from dmoe.replicas.snapshots import SignedSnapshot, SnapshotRefused, check_state, load_into, open_body, sign, take
from dmoe.replicas.store import ReplicaStore

__all__ = [
    "Adopter", "Adoption", "Holder", "ReplicaChannels", "ReplicaConfig", "ReplicaError", "ReplicaPusher",
    "ReplicaServicer", "ReplicaStore", "Replication", "SignedSnapshot", "SnapshotRefused", "adoptions", "check_state",
    "claim", "drop_unowned", "fetch_snapshot", "holders", "load_into", "newest_replica", "open_body", "owner_of",
    "push_snapshot", "restore_newest", "sign", "take",
]
