"""The synchronous face of a DHT node: its asyncio loop runs in a background thread owned by this object."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Coroutine, Mapping, Sequence, TypeVar

from kademlia.utils import digest

from dmoe.dht.config import DHTConfig
from dmoe.dht.node import DHTNode, listen_host, parse_endpoint
from dmoe.dht.messages import check_entry
from dmoe.dht.peers import peer_key
from dmoe.dht.signing import Identity
from dmoe.dht.storage import Entry, Record, Subkey, check_expiration, to_milliseconds
from dmoe.endpoints import (
    announced_endpoint,
    bare_host,
    is_loopback_ip,
    join_host_port,
    outbound_host,
    reachable_endpoint,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DHT:
    """A DHT node usable from ordinary (torch, server) code.

    initial_peers: ``HOST:PORT`` of nodes already in the swarm (any one suffices); empty starts a new swarm.
    host, port: where this node listens for UDP (port 0 picks a free one; see :attr:`endpoint`); by default on
        loopback when every initial peer is on this host, else on every interface (:func:`listen_host`).
    config: :class:`DHTConfig` (timeouts, replication, record limits).
    identity: the key pair that signs what this node stores and owns the int subkeys it stores first (see
        :meth:`Identity.load_or_create`); default: a fresh, ephemeral one.
    client_mode: ask but never answer (see :attr:`DHTConfig.client_mode`): for processes others cannot reach, or
        that should not hold the swarm's records (trainers, monitors). It stores and reads through the swarm as any
        node does, but nobody can join through it (its :attr:`endpoint` answers nothing).
    Raises ``ConnectionError`` when initial peers were given and none answered.
    """

    def __init__(self, initial_peers: Sequence[str] = (), host: str | None = None, port: int = 0,
                 config: DHTConfig | None = None, identity: Identity | None = None, client_mode: bool = False):
        addresses = [parse_endpoint(peer) for peer in initial_peers]
        host = listen_host(addresses, client_mode) if host is None else bare_host(host)
        #: this machine's address toward its first initial peer on another machine (None: all are here)
        self.outbound_host = outbound_host(addresses)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dmoe-dht-loop", daemon=True)
        self._thread.start()
        self._closed = False
        #: calls waiting for the loop (run_coroutine), cancelled by close: a call racing close waited out the whole
        #: call_timeout (60 s) on a loop that had stopped (review 70)
        self._pending: set[concurrent.futures.Future] = set()
        self._pending_lock = threading.Lock()
        self.node = DHTNode(config, identity=identity, client_mode=client_mode)
        self.config = self.node.config
        try:
            bound_host, bound_port = self.run_coroutine(self.node.listen(port, host))
            self.endpoint = reachable_endpoint(bound_host, bound_port)
            if addresses and not self.run_coroutine(self.node.bootstrap(addresses)):
                hint = ""
                if is_loopback_ip(host) and self.outbound_host is not None:
                    hint = f" (this node listens on {host}, from where no other machine can be reached: give it a " \
                           "public host, e.g. --host 0.0.0.0, and --announce-host ADDRESS behind NAT)"
                raise ConnectionError(f"none of the initial DHT peers {list(initial_peers)} answered{hint}")
        except BaseException:
            self.close()
            raise

    def announced(self, endpoint: str, announce_host: str | None = None) -> str:
        """What to tell the swarm of a server of this machine at ``endpoint``: its port at ``announce_host`` when
        one is given (behind NAT); else, for a wildcard bind's loopback form, this machine's address toward its
        peers when they are on other machines."""
        if announce_host:
            return join_host_port(announce_host, endpoint.rpartition(":")[2])
        return announced_endpoint(endpoint, self.outbound_host)

    def run_coroutine(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs ``coro`` on this node's loop and waits for it (at most ``config.call_timeout`` seconds). Raises
        RuntimeError if the DHT is closed, or closes before the call is done."""
        with self._pending_lock:
            if self._closed:
                coro.close()
                raise RuntimeError("this DHT is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._pending.add(future)
        try:
            return future.result(self.config.call_timeout if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError("DHT call timed out") from None
        except concurrent.futures.CancelledError:
            if self._closed:
                raise RuntimeError("this DHT was closed during the call") from None
            raise
        finally:
            with self._pending_lock:
                self._pending.discard(future)

    @property
    def identity(self) -> Identity:
        """The key pair that signs what this node stores and owns its int subkeys."""
        return self.node.identity

    def store(self, key: str, subkey: Subkey, value: str, expiration_time: float) -> bool:
        """Stores one signed entry ``record[key][subkey] = value`` until ``expiration_time`` (absolute,
        ``time.time()``); True when at least one of the key's replicas accepted it.

        An int subkey is owned: until it expires only this node's identity may replace it, and its entry issued
        last wins (each entry is signed with its issue time, so a shorter expiration than the one held still
        replaces it). A str subkey (at most 10 characters) is shared: anyone may extend it and the longest-living
        entry wins (see :mod:`dmoe.dht.storage`). Values are printable ASCII without spaces, quotes or
        backslashes, at most ``config.max_value_bytes`` bytes. Raises ValueError for a value, subkey or expiration
        no node would accept (an expiration more than ``config.max_expiration`` seconds ahead).
        """
        return self.store_many({key: {subkey: (value, expiration_time)}})[key][subkey] is True

    def store_many(self, records: Mapping[str, Mapping[Subkey, tuple[str, float]]]
                   ) -> dict[str, dict[Subkey, bool | str]]:
        """Stores several records' entries concurrently: ``{key: {subkey: (value, expiration_time)}}``.

        Returns per key and subkey True when at least one replica accepted the entry, False when none did
        (unreachable or already superseded) or the reason a replica refused it (a full record, another owner).
        Raises ValueError, before anything is sent, for an entry no node would accept (see :meth:`store`).
        """
        signed: dict[str, Record] = {}
        now = time.time()
        for key, entries in records.items():
            signed[key] = {}
            for subkey, (value, expiration_time) in entries.items():
                check_entry(subkey, value, expiration_time, self.config.max_value_bytes)
                check_expiration(expiration_time, self.config.max_expiration, now)
                expiration_time = to_milliseconds(expiration_time)  # signed exactly as sent
                signed[key][subkey] = self.node.identity.entry(digest(key), subkey, value, expiration_time)
        replies = self.run_coroutine(self.node.store_records(signed))
        return {key: dict(zip(signed[key], replies[key])) for key in signed}

    def get(self, key: str) -> Record:
        """The live entries of ``key``'s record, each validly signed by its owner: ``{subkey: Entry(value,
        expiration, owner, signature, issued_us)}``; empty when nothing is stored."""
        return self.get_many([key])[key]

    def get_many(self, keys: Sequence[str], ties: dict[str, dict[Subkey, list[Entry]]] | None = None
                 ) -> dict[str, Record]:
        """:meth:`get` for several keys, looked up concurrently; ``ties``: see :meth:`DHTNode.get_records`."""
        return self.run_coroutine(self.node.get_records(list(keys), ties))

    def contacts(self, timeout: float | None = None) -> tuple[int, int]:
        """(contacts in the routing table, those of them not silent since their last question): with none answering,
        reads find nothing, which looks like an empty swarm (review 112 D3)."""
        async def count() -> tuple[int, int]:  # (on the node's loop, which owns its routing table)
            protocol = self.node.protocol
            contacts = protocol.router.contacts()
            return len(contacts), sum(not protocol.peers.recently_dead(peer_key(c)) for c in contacts)
        return self.run_coroutine(count(), timeout)

    def close(self) -> None:
        """Stops the node and its loop thread; safe to call twice. Calls in flight end in RuntimeError."""
        with self._pending_lock:
            if self._closed:
                return
            self._closed = True
        if self.loop.is_running():
            async def shutdown() -> None:
                self.node.stop()
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            with_timeout = asyncio.run_coroutine_threadsafe(shutdown(), self.loop)
            try:
                with_timeout.result(5)
            except Exception:
                logger.warning("DHT shutdown did not finish cleanly", exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        with self._pending_lock:  # (before the loop closes: cancelling one schedules a callback on it)
            for future in self._pending:
                future.cancel()
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> "DHT":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
