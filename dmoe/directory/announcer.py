"""Announcing: keeping a server's experts declared in the DHT for as long as it serves them."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

from dmoe.dht import DHT, DHTConfig, DHTNode, Identity
from dmoe.directory.declarations import declare, taken_by_others
from dmoe.endpoints import check_host

logger = logging.getLogger(__name__)


async def announce_forever(node: DHTNode, uids: Sequence[str], endpoint: str, refresh_period: float,
                           expiration: float, *, declared: bool = False,
                           reported: dict[str, bytes] | None = None) -> None:
    """Declares ``uids`` every ``refresh_period`` seconds until cancelled; failures are retried sooner.

    declared: the caller has just declared them, every one reaching the DHT, so the first declaration here waits a
    refresh period (pass False after one that failed: it is then made again at once, and retried as any here).
    reported: what the caller's read-back reported as taken by other keys (see :func:`report_taken`), which is
    read back after every declaration.
    ``uids`` is read again before every declaration: a list the caller changes (:meth:`Announcer.add`) is followed.

    A declaration still running when its entries would have expired (after ``expiration`` seconds, or a refresh
    period if that is longer) is abandoned and the next one starts at once: one declaration that never finished
    stopped every later refresh, and the server's experts vanished from the directory while it kept serving them.
    """
    if declared:
        await asyncio.sleep(refresh_period)
    timeout = max(refresh_period, expiration)
    reported = dict(reported or {})  # uid -> the other key readers found, as last reported
    while True:
        started = time.monotonic()
        try:
            results = await asyncio.wait_for(declare(node, list(uids), endpoint, expiration), timeout) if uids else []
            failed = len(results) - sum(results)
            if failed:
                logger.warning("%d of %d experts could not be declared; retrying soon", failed, len(results))
            reported = await report_taken(node, list(uids), endpoint, reported, timeout)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            logger.warning("declaring %d experts did not finish in %.1fs; abandoned it, declaring them again",
                           len(uids), timeout)
            failed = 1
        except Exception:
            logger.exception("declaring experts failed; retrying soon")
            failed = 1
        period = refresh_period / 4 if failed else refresh_period
        await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))


async def report_taken(node: DHTNode, uids: Sequence[str], endpoint: str, reported: dict[str, bytes],
                       timeout: float) -> dict[str, bytes]:
    """Reads ``uids`` back as clients would and warns of each that readers find declared by another key (once,
    until that changes); returns what it reported (uid -> that key). A read that fails is skipped."""
    if not uids:
        return {}
    try:
        taken = await asyncio.wait_for(taken_by_others(node, uids), timeout)
    except (asyncio.TimeoutError, OSError) as error:
        logger.debug("reading back %d declared experts failed: %s", len(uids), error)
        return reported
    for uid, entry in taken.items():
        if reported.get(uid) != entry.owner:
            logger.warning("%s: readers find it declared by another key (%s) at %s, not at %s: clients are sent "
                           "there until that key lets go of it", uid, entry.owner.hex()[:16], entry.value, endpoint)
    for uid in set(reported).intersection(uids) - set(taken):  # (not one the server stopped serving meanwhile)
        logger.info("%s: readers find this server's declaration again", uid)
    return {uid: entry.owner for uid, entry in taken.items()}


class Announcer:
    """Keeps a server's experts declared: :meth:`start` declares them once, then every ``refresh_period`` seconds;
    each declaration expires ``expiration`` seconds (default 3 refresh periods) after it was made, so the experts of
    a server that died or closed its announcer vanish on their own.

    dht: the node to declare through; :meth:`join` makes one of its own, which :meth:`close` then closes.
    announce_host: replaces the host of the endpoint others are told (a public address behind NAT).

    The refreshing runs as a task on the DHT's loop (no thread of its own); :meth:`close` cancels it. This is what
    an :class:`~dmoe.server.ExpertServer` calls ``start(uids, endpoint)`` on once it listens, ``stop_refreshing()``
    on once it no longer answers, and ``close()`` on before it stops.
    """

    def __init__(self, dht: DHT, *, refresh_period: float = 10.0, expiration: float | None = None,
                 announce_host: str | None = None, owns_dht: bool = False):
        if refresh_period <= 0:
            raise ValueError("refresh_period must be positive")
        if announce_host:  # (review 99 D5: HOST:PORT was announced as [HOST:PORT]:PORT, for nobody to reach)
            try:
                check_host(announce_host)
            except ValueError as error:
                raise ValueError(f"announce_host: {error}") from None
        self.dht, self.owns_dht = dht, owns_dht
        self.refresh_period, self.announce_host = refresh_period, announce_host
        self.expiration = 3 * refresh_period if expiration is None else expiration
        if self.expiration > dht.config.max_expiration:  # every declaration would be refused: say so now
            raise ValueError(f"expiration {self.expiration:g} s (by default 3 refresh periods) is beyond the DHT's "
                             f"max_expiration ({dht.config.max_expiration:g} s): no node would keep the experts")
        if self.expiration <= refresh_period:
            logger.warning("expiration %.1fs <= refresh period %.1fs: experts will blink out between refreshes",
                           self.expiration, refresh_period)
        self.first_results: list[bool] = []
        #: what the read-back after the first declaration found declared by other keys (uid -> that key); a
        #: server that chose its cells itself (--num-experts) trades these for free ones (review 92 D1)
        self.first_taken: dict[str, bytes] = {}
        self.uids: list[str] = []  # what is declared every refresh period (changed by add and remove)
        self.endpoint: str | None = None
        self._future: "asyncio.Future[None] | None" = None

    @classmethod
    def join(cls, initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0, *,
             config: DHTConfig | None = None, identity: Identity | None = None, **options) -> "Announcer":
        """An announcer with a DHT node of its own, joined through ``initial_peers`` (see :class:`~dmoe.dht.DHT`).

        ``identity`` signs the declarations; the first key to declare a uid owns it until its declaration expires,
        so a restarted server must keep its key (:meth:`Identity.load_or_create`) to take its uids back at once.
        Default: an ephemeral key (a restart then waits for its old declarations to expire, and a warning says so).
        ``options``: those of the constructor.
        """
        if identity is None:
            logger.warning("no DHT identity given: signing declarations with an ephemeral key, so after a restart "
                           "this server's uids stay owned by the old key until its declarations expire")
        dht = DHT(initial_peers=initial_peers, host=host, port=port, config=config, identity=identity)
        try:
            return cls(dht, owns_dht=True, **options)
        except BaseException:  # (options refused: the node is nobody's to close)
            dht.close()
            raise

    def start(self, uids: Sequence[str], endpoint: str) -> list[bool]:
        """Declares ``uids`` at ``endpoint`` now and keeps them declared until :meth:`close`; returns, per uid,
        whether the first declaration fully reached the DHT (if any did not, all are declared again at once, and
        then every quarter of a refresh period until they do, not after a whole one)."""
        if self._future is not None:
            raise RuntimeError("this announcer has already started")
        # --announce-host, or for a server bound to every interface this machine's address toward its peers
        endpoint = self.dht.announced(endpoint, self.announce_host)
        self.endpoint = endpoint
        self.uids.extend(uid for uid in uids if uid not in self.uids)
        self.first_results = self.dht.run_coroutine(declare(self.dht.node, list(self.uids), endpoint,
                                                            self.expiration))
        logger.info("declared %d of %d experts at %s in the DHT (node %s)", sum(self.first_results), len(self.uids),
                    endpoint, self.dht.endpoint)
        reported = self.dht.run_coroutine(report_taken(self.dht.node, list(self.uids), endpoint, {}, self.expiration))
        self.first_taken = dict(reported)
        # a first declaration that failed is made again at once (then retried as announce_forever retries its own
        # failures): declared=True waited a whole refresh period, clients finding none of its experts (review 85)
        self._future = asyncio.run_coroutine_threadsafe(
            announce_forever(self.dht.node, self.uids, endpoint, self.refresh_period, self.expiration,
                             declared=all(self.first_results), reported=reported),
            self.dht.loop)
        return self.first_results

    def add(self, uids: Sequence[str]) -> list[bool]:
        """Declares ``uids`` too, from now on (at once if started: per uid, whether that reached the DHT)."""
        new = [uid for uid in uids if uid not in self.uids]
        self.uids.extend(new)
        if self._future is None or not new:  # not started: start() declares them with the others
            return []
        return self.dht.run_coroutine(declare(self.dht.node, new, self.endpoint, self.expiration))

    def taken(self, uids: Sequence[str]) -> dict[str, bytes]:
        """Reads ``uids`` back as clients would: uid -> the other key readers find declaring it (as
        :func:`report_taken`, which warns of each; a read that fails finds none)."""
        return self.dht.run_coroutine(report_taken(self.dht.node, list(uids), self.endpoint or "", {},
                                                   self.expiration)) if uids else {}

    def remove(self, uids: Sequence[str]) -> None:
        """Stops declaring ``uids``; their declarations expire on their own."""
        self.uids[:] = [uid for uid in self.uids if uid not in set(uids)]

    def stop_refreshing(self) -> None:
        """Stops refreshing (the declarations then expire on their own), leaving the DHT node running: a closing
        server stops as soon as it no longer answers, while its last checkpoint and replica pushes still use the
        node (review 99 D2)."""
        if self._future is not None:
            self._future.cancel()  # thread-safe: cancels the task on the DHT's loop

    def close(self) -> None:
        """Stops refreshing (the declarations then expire on their own), and closes the DHT node if it owns it."""
        self.stop_refreshing()
        if self.owns_dht:
            self.dht.close()

    def __enter__(self) -> "Announcer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
