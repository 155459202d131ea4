"""The seam between an expert server and the DHT: a node of its own that keeps the server's experts declared."""
from __future__ import annotations

import logging
from typing import Sequence

from dmoe.dht import DHT, DHTConfig, ExpertAnnouncer, Identity

logger = logging.getLogger(__name__)


class DHTAnnouncer:
    """Joins the DHT through ``initial_peers`` and, once the server listens, declares its experts every
    ``refresh_period`` seconds; declarations expire ``expiration`` seconds after the last refresh, so a dead
    server's experts vanish on their own. Implements :class:`dmoe.server.server.Announcer`.

    ``announce_host`` replaces the host of the endpoint others are told (a public address behind NAT).
    ``identity`` signs the declarations; the first key to declare a uid owns it until its declaration expires,
    so a restarted server must keep its key (:meth:`Identity.load_or_create`) to take its uids back at once.
    Default: an ephemeral key (a restart then waits for its old declarations to expire, and a warning says so).
    """

    def __init__(self, initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0, *,
                 refresh_period: float = 10.0, expiration: float | None = None,
                 announce_host: str | None = None, config: DHTConfig | None = None,
                 identity: Identity | None = None):
        if identity is None:
            logger.warning("no DHT identity given: signing declarations with an ephemeral key, so after a restart "
                           "this server's uids stay owned by the old key until its declarations expire")
        self.dht = DHT(initial_peers=initial_peers, host=host, port=port, config=config, identity=identity)
        self.refresh_period, self.expiration, self.announce_host = refresh_period, expiration, announce_host
        self._announcer: ExpertAnnouncer | None = None

    def start(self, uids: Sequence[str], endpoint: str) -> None:
        if self.announce_host:
            endpoint = f"{self.announce_host}:{endpoint.rsplit(':', 1)[1]}"
        self._announcer = ExpertAnnouncer(self.dht, uids, endpoint, self.refresh_period, self.expiration)
        declared = sum(self._announcer.first_results)
        logger.info("declared %d of %d experts at %s in the DHT (node %s)", declared, len(uids), endpoint,
                    self.dht.endpoint)

    def close(self) -> None:
        if self._announcer is not None:
            self._announcer.close()
        self.dht.close()
