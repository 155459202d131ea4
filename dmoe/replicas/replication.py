"""``Replication``: the one owner of everything that keeps a server's experts alive beyond the server, and the
settings of it."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from dmoe.dht import DHT
from dmoe.replicas.adoption import Adopter, drop_unowned, note_adoptions, restore_newest
from dmoe.replicas.records import Adoption
from dmoe.replicas.metrics import ReplicaMetrics
from dmoe.replicas.pusher import ReplicaChannels, ReplicaPusher
from dmoe.replicas.records import owner_of
from dmoe.replicas.service import ReplicaServicer
from dmoe.replicas.store import ReplicaStore
from dmoe.uid import split_uid
from dmoe.wire import parse_compression

if TYPE_CHECKING:
    from dmoe.server import ExpertServer

logger = logging.getLogger(__name__)

#: the uid a server's template expert is built under (any uid would do: it is never served)
TEMPLATE_UID = "template.0"


@dataclass
class ReplicaConfig:
    """How a server keeps replicas (``dmoe-server --replica-dir DIR --replicas R ...``).

    Attributes:
        directory: where this server keeps the replicas other servers push to it (created if missing).
        replicas: servers each of this server's experts is pushed to (R); 0 pushes nothing (still receives and
            adopts).
        interval: seconds between pushes of the experts that trained since their last one (and one on a clean
            stop). An expert adopted after a SIGKILL lacks at most the updates of about one interval.
        budget_mb: MiB of replicas kept on disk; beyond it the replicas received longest ago are removed.
        compression: ``'none'`` (exact), ``'float16'`` or ``'uint8'`` for the snapshots' weights (the optimizer's
            state always goes exact).
        check_period: seconds between looks for empty cells and announcements of what is held; None: the
            announcer's refresh period.
        stagger: seconds a holder of a replica waits, per holder ranked before it, before adopting an empty cell.
        layers: layers whose replicas this server receives besides those of the experts it serves (a server that
            ends up serving none of its ``--num-experts`` cells still holds and adopts the layers' experts).
        machine: a token this server shares with the other processes of its ``dmoe-server --processes``
            (announced with its host entry): none of its replicas go to a host of its own machine, which would leave
            with it, and at most one replica of an expert goes to each machine. None: a machine of its own.
    """

    directory: str
    replicas: int = 2
    interval: float = 60.0
    budget_mb: float = 1024.0
    compression: str = "none"
    check_period: float | None = None
    stagger: float = 2.0
    layers: Sequence[str] = field(default_factory=tuple)
    machine: str | None = None

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.interval <= 0 or self.budget_mb <= 0 or self.stagger < 0:
            raise ValueError("replicas and stagger must be >= 0; interval and budget_mb positive")
        parse_compression(self.compression)


class Replication:
    """Replicas for one :class:`~dmoe.server.ExpertServer`: it receives and holds other servers' replicas (a
    ``ReplicaService`` on the server's gRPC port), pushes its own experts' snapshots, and adopts the experts of
    servers that left.

    Build it after the server and before :meth:`ExpertServer.start` (it sets ``server.replication``; the server
    then starts and closes it). The server must have a backend factory (:meth:`ExpertServer.create` gives one):
    replicas are checked against, and adopted into, experts it builds.

    Args:
        server: the server (not started yet).
        config: see :class:`ReplicaConfig`.
        dht: the DHT node whose identity owns the server's declarations; default: its announcer's.
    """

    def __init__(self, server: "ExpertServer", config: ReplicaConfig, dht: DHT | None = None):
        if server.backend_factory is None:
            raise ValueError("replication needs a server that can build experts (built by ExpertServer.create)")
        if dht is None:
            if server.announcer is None:
                raise ValueError("replication needs a DHT: give one or build the server with an announcer")
            dht = server.announcer.dht
        self.server, self.config, self.dht = server, config, dht
        self.max_bytes = int(config.budget_mb * 2**20)
        self.store = ReplicaStore(config.directory, self.max_bytes)
        self.metrics = ReplicaMetrics(server.metrics.registry, self.store)
        self.template = server.backend_factory(TEMPLATE_UID)
        self.channels = ReplicaChannels()
        # the layers this server announces itself a host of, and the only ones whose replicas it takes
        self.layers = sorted({split_uid(uid)[0] for uid in server.backends} | set(config.layers))
        self.servicer = ReplicaServicer(self.store, self.template, lambda uid: owner_of(dht, uid), self.metrics,
                                        layers=self.layers, own_key=dht.identity.public_key)
        self.pusher = ReplicaPusher(server, dht, dht.identity, replicas=config.replicas, interval=config.interval,
                                    compression=parse_compression(config.compression), metrics=self.metrics,
                                    channels=self.channels, machine=config.machine, store=self.store)
        self.adopter: Adopter | None = None
        self.restored: dict[str, Adoption] = {}
        server.replication = self

    def restore(self) -> dict[str, int]:
        """Before the server starts: each of its experts takes the newest replica anyone holds of it, if that has
        trained more (see :func:`~dmoe.replicas.adoption.restore_newest`); returns uid -> updates loaded."""
        self.restored = restore_newest(self.server, self.dht, list(self.server.backends), self.channels,
                                       max_bytes=self.max_bytes, store=self.store, metrics=self.metrics)
        return {uid: adoption.updates for uid, adoption in self.restored.items()}

    def start(self, server: "ExpertServer") -> None:
        """Called by the server once it serves and has declared its experts: stops serving the ones another
        server owns, announces this server as a host, starts pushing and watching."""
        announcer = server.announcer
        refresh = announcer.refresh_period if announcer is not None else 10.0
        expiration = announcer.expiration if announcer is not None else 3 * refresh
        layers = self.layers
        drop_unowned(server, self.dht)
        adopted = [adoption for uid, adoption in self.restored.items() if uid in server.backends]
        if adopted:  # started from another server's replica, and owned now: an adoption like the adopter's
            self.metrics.adopted.inc(len(adopted))
            note_adoptions(self.dht, adopted)
        self.adopter = Adopter(server, self.dht, self.store, layers, check_period=self.config.check_period or refresh,
                               stagger=self.config.stagger, channels=self.channels, metrics=self.metrics,
                               max_bytes=self.max_bytes, expiration=expiration, machine=self.config.machine)
        self.adopter.announce()  # at once: the others' next push round finds this server
        self.pusher.start()
        self.adopter.start()
        logger.info("replicas: pushing %d experts to %d servers each every %.0f s; holding %d replicas in %s "
                    "(layers %s)", len(server.backends), self.config.replicas, self.config.interval, len(self.store),
                    self.config.directory, ", ".join(layers))

    def close(self, push: bool = True) -> None:
        """Stops watching and pushing, then (``push``) pushes every expert's last state. Both threads are told to
        stop before either is waited for, and the adopter's probes and fetches end at once (its wait is bounded,
        :data:`~dmoe.replicas.adoption.CLOSE_TIMEOUT`): the adopter used to be joined first, for as long as a fetch
        from a holder that trickled its bytes took (up to a minute each), while the pusher went on with its
        rounds, and a supervisor's SIGKILL then lost the last push (review 88)."""
        if self.adopter is not None:
            self.adopter.stop()
        self.pusher.stop()
        if self.adopter is not None:
            self.adopter.close()
        self.pusher.close(push=push and self.adopter is not None)
        self.channels.close()
        self.store.close()  # (the directory's lock: the last push above may still write an adopted expert in it)
