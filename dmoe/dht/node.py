"""The asyncio DHT node: kademlia's ``Server`` with record storage, merging lookups and replica-aware stores."""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
from typing import Iterable, Sequence

from kademlia.network import Server
from kademlia.node import Node
from kademlia.utils import digest

from dmoe.dht.config import DHTConfig
from dmoe.dht.crawling import RecordCrawl
from dmoe.dht.messages import canonical_host, valid_address
from dmoe.dht.peers import peer_key
from dmoe.dht.protocol import DHTProtocol
from dmoe.dht.signing import Identity
from dmoe.dht.storage import (
    Entry,
    NotOwner,
    Record,
    RecordFull,
    RecordStorage,
    Subkey,
    check_expiration,
    missing_entries,
)

logger = logging.getLogger(__name__)

#: seconds between attempts to join the swarm again while the routing table holds fewer than ``alpha`` contacts
#: (review 97 D1: see :meth:`DHTNode.rejoin_if_lonely`)
REJOIN_PERIOD = 5.0
#: while no contact answers, the first attempt comes this many seconds after the last, each next one twice as late,
#: up to REJOIN_PERIOD: most outages are short, and a node cut off reads nothing until it is back
REJOIN_FIRST = 0.5


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``'127.0.0.1:8000'`` -> ``('127.0.0.1', 8000)``, ``'[0:0:0:0:0:0:0:1]:8000'`` -> ``('::1', 8000)`` (an IP
    in its canonical spelling, which replies come from: see :func:`~dmoe.dht.messages.canonical_ip`; a host name
    as it is); raises ValueError with the expected form."""
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid peer address {endpoint!r}: expected HOST:PORT, e.g. 127.0.0.1:31337")
    return canonical_host(host.strip("[]")), int(port)


def listen_host(addresses: Sequence[tuple[str, int]], client_mode: bool = False) -> str:
    """Where a node that was given no host listens, from its initial peers: on loopback when they are all on this
    host (a local swarm, the tests: nothing exposed), on every interface otherwise. A socket bound to 127.0.0.1
    cannot send to another machine (EINVAL), so a trainer joining a remote swarm must not bind there. A node in
    client mode answers nobody, so it always listens on every interface: its local bootstrap peer may hand it
    contacts on other machines. The family follows the peers' (IPv4 where a name has both: the README's nodes
    listen on 0.0.0.0)."""
    ips = []
    for host, port in addresses:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except OSError:
            continue  # bootstrap says it cannot resolve it
        found = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        if found:
            ips.append(next((ip for ip in found if ip.version == 4), found[0]))
    version = ips[0].version if ips else 4
    if not client_mode and all(ip.is_loopback for ip in ips):
        return "::1" if version == 6 else "127.0.0.1"
    return "::" if version == 6 else "0.0.0.0"


class DHTNode(Server):
    """A Kademlia node whose values are subkey records (see :mod:`dmoe.dht.storage`).

    Nothing is republished by the nodes that merely hold a record (stock kademlia re-stores everything hourly,
    which resets ages and revives stale copies); owners refresh their entries instead.

    client_mode: overrides ``config.client_mode`` when True (see :class:`DHTConfig`).
    """

    protocol_class = DHTProtocol

    def __init__(self, config: DHTConfig | None = None, node_id: bytes | None = None,
                 identity: Identity | None = None, client_mode: bool = False):
        config = config or DHTConfig()
        self.config = dataclasses.replace(config, client_mode=True) if client_mode else config
        super().__init__(ksize=self.config.ksize, alpha=self.config.alpha, node_id=node_id)
        self.identity = identity or Identity()  # signs what this node stores
        self.storage: RecordStorage = RecordStorage(self.config.max_record_subkeys, self.config.max_expiration,
                                                    max_records=self.config.max_records,
                                                    max_entries=self.config.max_entries,
                                                    sender_share=self.config.sender_share)
        self.protocol: DHTProtocol | None = None
        #: where :meth:`bootstrap` joined, as given: a node whose contacts all fell silent joins again through them
        #: (a client-mode node is nobody's contact, so nothing else could ever refill its table: review 97 D1)
        self.initial_peers: list[tuple[str, int]] = []
        self.rejoin_loop: asyncio.TimerHandle | None = None
        self._rejoining: asyncio.Task | None = None
        self._last_rejoin = float("-inf")  # (protocol clock) when the last attempt started
        self._failed_rejoins = 0  # attempts since the node was cut off that nobody answered
        self._cut_off = False  # warned that no contact answers, and not yet that one does again

    def _create_protocol(self) -> DHTProtocol:
        return DHTProtocol(self.node, self.storage, self.config)

    async def listen(self, port: int, interface: str = "127.0.0.1") -> tuple[str, int]:
        """Binds the UDP socket; returns the bound (host, port), useful with ``port=0``."""
        loop = asyncio.get_running_loop()
        self.transport, self.protocol = await loop.create_datagram_endpoint(
            self._create_protocol, local_addr=(interface, port))
        host, bound_port = self.transport.get_extra_info("sockname")[:2]
        sock = self.transport.get_extra_info("socket")
        try:  # replies to a burst of look-ups arrive together; a small buffer would drop them
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.config.socket_buffer_bytes)
        except OSError:
            logger.debug("could not enlarge the UDP receive buffer", exc_info=True)
        logger.info("DHT node %s bound to UDP %s:%d", self.node.id.hex()[:8], host, bound_port)
        self.refresh_table()
        self._watch_contacts()
        return host, bound_port

    def refresh_table(self, interval: float | None = None) -> None:
        interval = self.config.routing_refresh_period if interval is None else interval
        assert self.protocol is not None
        self.protocol.spawn(self._refresh_table())
        self.refresh_loop = asyncio.get_running_loop().call_later(interval, self.refresh_table)

    async def _refresh_table(self) -> None:
        """Refreshes lonely buckets only: records are refreshed by their owners, never republished here."""
        assert self.protocol is not None
        await asyncio.gather(*(self.find_nodes(node_id, self.config.ksize)
                               for node_id in self.protocol.get_refresh_ids()))

    async def bootstrap(self, addrs: Iterable[tuple[str, int]]) -> list[Node]:
        """Pings the given peers and crawls towards our own id to fill the routing table; returns who answered. The
        peers are kept: the node joins through them again whenever its contacts run low (:meth:`rejoin_if_lonely`)."""
        addrs = list(addrs)
        self.initial_peers = list(dict.fromkeys([*self.initial_peers, *addrs]))
        return await self._join(addrs)

    async def _join(self, addrs: Sequence[tuple[str, int]], attempts: int = 3) -> list[Node]:
        """Pings ``addrs`` and crawls towards our own id from those that answered; returns them. A contact of the
        table at an address asked counts as silent if it did not answer, and goes if it answered under another id
        (a node restarted at its address: the old id is gone for good)."""
        assert self.protocol is not None
        found = await asyncio.gather(*(self._ping(addr, attempts) for addr in addrs))
        # an address that answers under this node's own id is itself (one list of peers handed to every node of a
        # swarm, the bootstrap node included): no peer to join through, which it warned of every 0.5 s (review 101)
        itself = [addr for addr, node in zip(addrs, found) if node is not None and node.id == self.node.id]
        self.initial_peers = [addr for addr in self.initial_peers if addr not in itself]
        peers = [node for node in found if node is not None and node.id != self.node.id]
        answered = {(peer.ip, peer.port): peer for peer in peers}
        asked = set(addrs)
        for contact in self.protocol.router.contacts():
            peer = answered.get((contact.ip, contact.port))
            if peer is None and (contact.ip, contact.port) in asked:
                self.protocol.handle_call_response((False, None), contact)
            elif peer is not None and peer.id != contact.id:
                self.protocol.router.remove_contact(contact)
                self.protocol.welcome_if_new(peer, answered=True)  # (if the old id left it no room)
        if peers:
            await RecordCrawl(self.protocol, self.node, peers, self.config.ksize, fetch_records=False).run()
        return peers

    def _watch_contacts(self) -> None:
        """Re-joins (in the background) when the routing table runs low (:meth:`rejoin_if_lonely`). Buckets are
        refreshed only every ``routing_refresh_period``, and only from contacts the table still holds."""
        self.rejoin_if_lonely()
        self.rejoin_loop = asyncio.get_running_loop().call_later(REJOIN_FIRST, self._watch_contacts)

    def rejoin_if_lonely(self, reading: bool = False) -> None:
        """With fewer than ``alpha`` contacts, pings the initial peers and the table's silent contacts again and
        crawls from those that answer, in the background: once per :data:`REJOIN_PERIOD`, and while no contact
        answers from :data:`REJOIN_FIRST` on, backing off to that period; or, for a look-up (``reading``) while no
        contact answers, :data:`REJOIN_FIRST` after the last attempt: backed off, reads found nothing for up to 5 s
        after the peer was back (review 101). Logs a warning when no contact answers any more, and when one does
        again."""
        assert self.protocol is not None
        router = self.protocol.router
        size = router.size()
        if size >= self.config.alpha or not self.initial_peers:  # (a swarm's first node is joined, not joining)
            self._report_cut_off(False, size)
            return
        self._report_cut_off(all(self.protocol.peers.recently_dead(peer_key(contact)) for contact in router.contacts()),
                             size)
        wait = REJOIN_PERIOD
        if self._cut_off:
            wait = REJOIN_FIRST if reading else min(REJOIN_PERIOD, REJOIN_FIRST * 2 ** self._failed_rejoins)
        now = self.protocol.clock()
        if self._rejoining is None and now - self._last_rejoin >= wait:
            self._last_rejoin = now
            self._rejoining = task = asyncio.ensure_future(self._rejoin())
            self.protocol.adopt(task)

    async def _rejoin(self) -> None:
        assert self.protocol is not None
        try:
            silent = [(contact.ip, contact.port) for contact in self.protocol.router.contacts()
                      if self.protocol.peers.recently_dead(peer_key(contact))]
            # one ping each: another attempt follows soon enough
            if await self._join(list(dict.fromkeys([*self.initial_peers, *silent])), attempts=1):
                self._report_cut_off(False, self.protocol.router.size())
            else:
                self._failed_rejoins += 1
        finally:
            self._rejoining = None

    def _report_cut_off(self, cut_off: bool, size: int) -> None:
        if cut_off and not self._cut_off:
            logger.warning("DHT node %s: none of its %d contacts answers; until one does, reads find nothing and "
                           "stores reach no other node (joining again through its initial peers %s)",
                           self.node.id.hex()[:8], size, self.initial_peers)
            self._failed_rejoins = 0
        elif self._cut_off and not cut_off:
            logger.info("DHT node %s is back in the swarm: %d contacts", self.node.id.hex()[:8], size)
        self._cut_off = cut_off

    def _joined(self) -> bool:
        """Before a look-up or store: re-joins if contacts are few (:meth:`rejoin_if_lonely`); False when no contact
        answers. A look-up then has nobody to ask: asking its silent contacts cost it an RPC timeout and found
        nothing."""
        self.rejoin_if_lonely(reading=True)
        return not self._cut_off

    async def _ping(self, address: tuple[str, int], attempts: int = 3) -> Node | None:
        """Pings an initial peer, resolving a host name first (contacts learnt from peers must be IP literals), at
        its IP's canonical spelling (the contact it becomes is named so to others)."""
        assert self.protocol is not None
        host, port = address
        if not valid_address(host, port):
            try:
                family = self.transport.get_extra_info("socket").family  # what our socket can send to
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=family,
                                                                     type=socket.SOCK_DGRAM)
            except OSError as error:
                logger.warning("cannot resolve initial peer %s:%s: %s", host, port, error)
                return None
            host, port = infos[0][4][:2]
        return await self.protocol.ping_address((canonical_host(host), port), attempts)

    async def find_nodes(self, key_id: bytes, width: int) -> list[Node]:
        """The ``width`` closest responding nodes to a 20-byte id."""
        assert self.protocol is not None
        if not self._joined():
            return []
        target = Node(key_id)
        peers = self.protocol.router.find_neighbors(target, k=max(width, self.config.alpha))
        nodes, _ = await RecordCrawl(self.protocol, target, peers, width, fetch_records=False).run()
        return nodes

    async def find_replicas(self, key_id: bytes) -> list[Node]:
        """The ``num_replicas`` nodes closest to a key, found by a crawl over the ``ksize`` closest.

        A crawl that only tracks ``num_replicas`` candidates can settle on a local minimum that differs from
        the reader's, and a record stored there is invisible to reads; tracking k candidates (as Kademlia does)
        makes stores land where every reader's search converges.
        """
        return (await self.find_nodes(key_id, self.config.ksize))[:self.config.num_replicas]

    def _starting_peers(self, target: Node) -> list[Node]:
        """Where a record lookup starts: more contacts than it reads from, closest first.

        A lookup asks the ``read_width`` closest; the others are asked only when some of those fail to answer in
        time. Started from exactly ``read_width`` contacts, a lookup whose contacts had all just died (a few keys
        in every swarm that just lost half its nodes) had nobody else to ask: it waited an RPC timeout and found nothing,
        and a reader took a live record for an absent one.
        """
        return self.protocol.router.find_neighbors(target, k=max(self.config.ksize, 2 * self.config.read_width))

    async def get_record(self, key: str, ties: dict[Subkey, list[Entry]] | None = None) -> Record:
        """Merges what the ``read_width`` closest responding nodes (and this node) hold for ``key``. ``ties``:
        filled with the owned subkeys read as absent because the replicas' owners tied (see
        :func:`~dmoe.dht.storage.merge_records`)."""
        assert self.protocol is not None
        target = Node(digest(key))
        local = self.storage.get(target.id) or {}
        peers = self._starting_peers(target) if self._joined() else []
        if not peers:
            return local
        crawl = RecordCrawl(self.protocol, target, peers, self.config.read_width, hedge=True)
        nearest, record = await crawl.run(local)
        if ties is not None:
            ties.update(crawl.ties)
        if record and self.config.read_repair:
            # a replica that died was replaced by a node that holds nothing yet: give it what the others hold
            for node in nearest:
                missing = missing_entries(crawl.held.get(node.id, {}), record)
                if missing:
                    self.protocol.spawn(self.protocol.call_store(node, target.id, missing))
        return record

    async def get_records(self, keys: Sequence[str],
                          ties: dict[str, dict[Subkey, list[Entry]]] | None = None) -> dict[str, Record]:
        """Concurrent :meth:`get_record` for distinct keys; ``ties``: filled with key -> its ties, for those with
        any."""
        unique = list(dict.fromkeys(keys))
        found: dict[str, dict[Subkey, list[Entry]]] = {key: {} for key in unique}
        records = await asyncio.gather(*(self.get_record(key, found[key] if ties is not None else None)
                                         for key in unique))
        if ties is not None:
            ties.update({key: tied for key, tied in found.items() if tied})
        return dict(zip(unique, records))

    async def store_record(self, key: str, record: Record, nodes: list[Node] | None = None) -> list[bool | str]:
        """Stores ``record`` on the ``num_replicas`` closest nodes (this one too if it is among them).

        ``nodes``: the replicas, when the caller already found them (see :meth:`find_nodes`).
        Returns, per entry in order, True when at least one replica accepted it, else False (unreachable or
        already superseded) or the error string a replica gave (e.g. a full record). Raises ValueError for an entry
        expiring more than ``max_expiration`` seconds ahead, which every node would refuse. An owned entry counted as
        stored that other replicas refused as another key's is logged (once a minute per record): readers that ask
        those replicas may find the other key's entry, or none.
        """
        assert self.protocol is not None
        for entry in record.values():
            check_expiration(entry.expiration, self.config.max_expiration)
        key_id = digest(key)
        target = Node(key_id)
        if nodes is None:
            nodes = await self.find_replicas(key_id)
        results: list[bool | str] = [False] * len(record)
        store_here = not self.config.client_mode and (len(nodes) < self.config.num_replicas or (
            self.node.distance_to(target) < max(node.distance_to(target) for node in nodes)))
        if store_here:
            for index, (subkey, entry) in enumerate(record.items()):
                try:
                    results[index] = self.storage.store(key_id, subkey, *entry)
                except RecordFull as error:
                    results[index] = f"record full: {error}"
                except NotOwner as error:
                    results[index] = f"refused: {error}"
        replies = await asyncio.gather(*(self.protocol.call_store(node, key_id, record) for node in nodes))
        refused: dict[int, list[str]] = {}  # index -> refusals of an owned entry as another key's
        if store_here:
            refused.update({i: [r] for i, r in enumerate(results) if isinstance(r, str) and "owned by" in r})
        for reply in replies:
            for index, result in enumerate(reply):
                if result is True:
                    results[index] = True
                elif isinstance(result, str):
                    if results[index] is False:
                        results[index] = result
                    if "owned by" in result:
                        refused.setdefault(index, []).append(result)
        subkeys = list(record)
        for index, reasons in refused.items():
            if results[index] is True:  # counted as stored, yet some replicas hold another key's entry there
                self.protocol.refusals.warn(
                    "contested store", key,
                    "%s[%s]: stored, but %d replica(s) refused it: %s; readers may find that key's entry instead",
                    key, subkeys[index], len(reasons), reasons[0])
        return results

    async def store_records(self, records: dict[str, Record], replicas: Sequence[list[Node]] | None = None
                            ) -> dict[str, list[bool | str]]:
        """Stores several records concurrently (see :meth:`store_record`), then makes each readable where readers
        look (:meth:`make_readable`); returns, per key, the result of each entry in order.

        ``replicas``: the replicas of each key in ``records``' order, when the caller already found them.
        Raises ValueError, before anything is stored, for an entry no node would accept (see :meth:`store_record`).
        """
        for record in records.values():
            for entry in record.values():
                check_expiration(entry.expiration, self.config.max_expiration)
        keys = list(records)
        if replicas is None:
            replicas = await asyncio.gather(*(self.find_replicas(digest(key)) for key in keys))
        replies = await asyncio.gather(*(self.store_record(key, records[key], nodes)
                                         for key, nodes in zip(keys, replicas)))
        # entries a replica refused (a full record, another owner) would be refused again
        readable = {key: {subkey: entry for (subkey, entry), result in zip(records[key].items(), reply)
                          if not isinstance(result, str)} for key, reply in zip(keys, replies)}
        repaired = await asyncio.gather(*(self.make_readable(key, readable[key]) for key in keys if readable[key]))
        if any(repaired):
            logger.info("%d of %d stored records had not reached some of the nodes readers ask; stored there now",
                        sum(map(bool, repaired)), len(keys))
        return dict(zip(keys, replies))

    async def make_readable(self, key: str, record: Record) -> int:
        """Stores ``record``'s entries on those of the ``read_width`` closest responding nodes (the nodes a reader
        merges) that lack them at this expiration; returns how many nodes lacked some.

        A store goes to the replicas its own search found. While nodes are busy (a storm of stores on a loaded
        machine) a close node can time out in that search or in the store itself, and entries that missed every
        node readers ask stayed invisible until the owner's next refresh. Reading the record back the way a reader
        does closes that gap.
        """
        assert self.protocol is not None
        target = Node(digest(key))
        peers = self._starting_peers(target) if self._joined() else []
        if not peers:
            return 0
        # not hedged: a busy close node is exactly the one that may lack the entries
        crawl = RecordCrawl(self.protocol, target, peers, self.config.read_width)
        nearest, _ = await crawl.run()
        stores = []
        for node in nearest:
            missing = missing_entries(crawl.held.get(node.id, {}), record, older_too=True)
            if missing:
                stores.append(self.protocol.call_store(node, target.id, missing))
        await asyncio.gather(*stores)
        return len(stores)

    async def get(self, key: str) -> Record:  # type: ignore[override]
        return await self.get_record(key)

    async def set(self, key: str, record: Record) -> bool:  # type: ignore[override]
        return all(result is True for result in await self.store_record(key, record))

    def stop(self) -> None:
        super().stop()
        if self.rejoin_loop is not None:
            self.rejoin_loop.cancel()
        if self.protocol is not None:
            self.protocol.close_tasks()
