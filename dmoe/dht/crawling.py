"""Iterative lookups that merge what the closest nodes hold instead of stopping at the first value.

Stock ``ValueSpiderCrawl`` returns the first value any node sends back (possibly a stale copy far from the key),
picks the "most common" of several (which crashes on dict values), and advances in lock-step rounds so one dead
peer stalls a round for a whole RPC timeout. This crawl keeps asking the closest not-yet-asked contacts as soon as
any reply or timeout arrives, until the ``width`` closest *responding* nodes have all answered, and merges every
record it received per subkey (the newest entry wins, see :func:`~dmoe.dht.storage.supersedes`; an owned subkey
that replicas disagree on goes to the owner held by the most homes, as counted below: one vote per machine). Entries
not validly signed for the key are dropped as replies are parsed.

Every crawl is bounded, whatever its peers answer. Node ids cost nothing, so one hostile socket answering each
request with ever closer made-up contacts (at its own address, or at one that never answers) kept the frontier from
ever being fully answered: reads ended only at ``call_timeout``, joins never, and an announcer's refresh hung until
its experts expired. So a crawl

- counts contacts per *home*: an address (ip:port: one socket is one node, however many ids it claims) on this
  host, a machine (:func:`dmoe.endpoints.machine_of`) elsewhere. Its frontier holds at most one id per address and
  :data:`FRONTIER_PER_MACHINE` per machine, it asks at most one id per address and :data:`ASKS_PER_MACHINE` per
  machine, and the replies of one home bring it at most ``width`` new contacts in all (an honest node answers once
  per crawl);
- keeps only the :data:`CANDIDATES_PER_WIDTH` x ``max(ksize, width)`` closest contacts it has not asked, and asks
  at most :data:`ASKS_PER_WIDTH` x ``max(ksize, width)`` nodes;
- takes the contacts of a reply only within :data:`MAX_ROUNDS` hops of its starting contacts, and when the reply
  brings nothing closer than every node that had answered, only within :data:`ROUNDS_WITHOUT_PROGRESS` rounds of
  the last round that did (Kademlia stops after one last round once a round brings nothing closer);
- ends :data:`DEADLINE_TIMEOUTS` x ``rpc_timeout`` after it started, with the nodes that answered by then.

A contact is a node id *at an address*: nothing binds an id to an address, so a reply may name a live node's id at
an address that never answers. A crawl that kept the first address it heard for an id dropped the right one an honest
peer named next: one hostile socket naming a key's replicas at silent addresses hid the whole record, and the
silences then marked the replicas dead (review 89). So a crawl keeps up to :data:`ADDRESSES_PER_ID` addresses per id
(at most one per home that named it, and the routing table's besides), asks each of them when the id is among the
closest, and the id stands in its frontier and result at the first address that answered under it (the routing
table's, once it answered). Records from every address that answered are merged, one vote per home as ever, and a
read that found nothing yet waits for the id's other addresses too (the one that answered first may be anyone's).

An honest lookup reaches none of these: it follows a few hops, each of its nodes answers once, and its frontier
settles on the closest nodes long before the deadline. (In simulated swarms of up to 400 nodes, with buckets of 3
to 20, bounded crawls ended on the same nodes as unbounded ones.)
"""
from __future__ import annotations

import asyncio
import heapq
import logging
from typing import Any

from kademlia.node import Node

from dmoe.dht.messages import MalformedRequest, as_seen_from, parse_nodes
from dmoe.dht.peers import Peer, peer_key
from dmoe.dht.protocol import DHTProtocol
from dmoe.dht.routing import contact_machine
from dmoe.dht.storage import Entry, Record, Subkey, merge_records

logger = logging.getLogger(__name__)

#: ids of one machine (not this host) in a crawl's frontier, and so among the closest nodes it returns
FRONTIER_PER_MACHINE = 2
#: ids of one machine (not this host) a crawl asks: a machine's nodes that answered late or not at all are replaced
#: by at most this many in all
ASKS_PER_MACHINE = 4
#: contacts not yet asked that a crawl keeps, times ``max(ksize, width)``: the closest ones
CANDIDATES_PER_WIDTH = 3
#: nodes a crawl asks at most, times ``max(ksize, width)``
ASKS_PER_WIDTH = 8
#: hops from its starting contacts beyond which a crawl takes no more contacts (an honest lookup needs a few)
MAX_ROUNDS = 8
#: rounds after the last one that brought a contact closer than every node that had answered, in which a reply
#: that brings nothing closer still adds contacts (one more than Kademlia's last round: with one, simulated honest
#: swarms sometimes ended on other nodes than an unbounded crawl)
ROUNDS_WITHOUT_PROGRESS = 2
#: a crawl ends this many ``rpc_timeout`` after it started, with the nodes that answered by then
DEADLINE_TIMEOUTS = 5
#: addresses a crawl keeps for one node id, besides the one its routing table holds: each home that answered may
#: name one (the first it names), and a crawl asks them all once the id is among the closest
ADDRESSES_PER_ID = 3

#: who votes for what this node holds itself (see merge_records)
LOCAL_VOTER = "this node"

Address = tuple[str, int]
Home = str  # where a contact lives, as crawls count contacts: its machine (see contact_machine)


class RecordCrawl:
    """One lookup of the ``width`` closest responding nodes to ``target`` (and, optionally, their records).

    protocol: the local node's protocol.
    target: the key (as a Node) whose neighbourhood is searched.
    peers: contacts to start from (usually the routing table's closest).
    width: how many closest responding nodes end the search (``read_width`` for records, ``ksize`` for
        bootstrap).
    fetch_records: ask ``find_value`` (records + contacts) instead of ``find_node`` (contacts only).
    hedge: let nodes slower than ``config.hedge_after`` stop holding the search up (for latency-bound reads; a
        store must find the true closest nodes, where reads will look, however slow they are). In a hedged search,
        nodes that recently timed out or answered late hold nothing up either: they are asked, and used if they
        answer in time.

    Its tables name a contact as the peer book does (:func:`~dmoe.dht.peers.peer_key`: id, ip, port), but for
    ``held``, by id for the nodes :meth:`run` returns.
    """

    def __init__(self, protocol: DHTProtocol, target: Node, peers: list[Node], width: int,
                 fetch_records: bool = True, hedge: bool = False):
        self.protocol = protocol
        self.target = target
        self.width = width
        self.fetch_records = fetch_records
        self.hedge = hedge
        self.self_id = protocol.source_node.id
        self.candidates: dict[Peer, Node] = {}
        self.contacted: set[Peer] = set()
        self.dead: set[Peer] = set()
        self.responded: dict[Peer, Node] = {}
        self.sent: dict[Peer, float] = {}  # contact -> loop time its request left (after waiting for a slot)
        self.records: list[Record] = []
        self.held_at: dict[Peer, Record] = {}  # what each responding contact holds: the vote (see run)
        # owned subkeys that run read as absent because owners tied, and the tied owners' entries (merge_records)
        self.ties: dict[Subkey, list[Entry]] = {}
        # node id -> what it holds at the address that stands for it (see answered_as), for read repair
        self.held: dict[bytes, Record] = {}
        # nodes that recently failed to answer or answered late: still asked (a busy machine makes live nodes
        # late too), but they do not hold a hedged search up
        self.suspects: set[Peer] = set()
        self.dead_suspects: set[Peer] = set()  # the suspects that timed out (not merely answered late)
        self.distance: dict[Peer, int] = {}  # candidate -> XOR distance of its id to the target
        self.addresses: dict[bytes, list[Peer]] = {}  # node id -> its candidates (one, unless several were named)
        self.named_by: dict[Peer, Home | None] = {}  # candidate -> home whose reply named it (None: a starting one)
        # node id -> the contact that stands for it in the frontier and the result: the first that answered under
        # it, or the routing table's once that answered
        self.answered_as: dict[bytes, Peer] = {}
        self._inbox: list[tuple[Node, tuple[bool, Any]]] = []  # outcomes of queries not yet accepted
        self._wake: asyncio.Future | None = None  # resolved when an outcome lands in the inbox
        # while asleep: the frontier's edge and the frontier nodes yet to answer (see _must_wake)
        self._horizon: int | None = None
        self._awaiting: set[bytes] | None = None
        # the bounds (see the module's docstring)
        scale = max(protocol.config.ksize, width)
        self.max_candidates = CANDIDATES_PER_WIDTH * scale
        self.max_asks = ASKS_PER_WIDTH * scale
        self.home: dict[Peer, tuple[Address, Home]] = {}  # candidate -> (its address, its home), once needed
        self.round: dict[Peer, int] = {}  # candidate -> hops from the starting contacts
        self._order: list[tuple[int, Peer]] = []  # (distance, contact) of every candidate; sorted unless _unsorted
        self._unsorted = False
        self._asked_at: set[Address] = set()  # addresses asked (one id each)
        self._asked_in: dict[Home, int] = {}  # home -> ids asked there
        self._brought: dict[Home, int] = {}  # home -> new contacts its replies brought
        self._best: int | None = None  # distance of the closest node that answered
        self._progress_round = -1  # latest round a reply of which named a contact closer than any that had answered
        self._add(peers, 0, None)

    def _add(self, nodes: list[Node], round_: int, named_by: Home | None) -> None:
        """Adds the contacts ``named_by``'s reply named (None: the starting contacts) that the crawl has not."""
        candidates, distance, target, self_id = self.candidates, self.distance, self.target.long_id, self.self_id
        peers, order, rounds, addresses, namers = self.protocol.peers, self._order, self.round, self.addresses, \
            self.named_by
        # (every reply brings a list of contacts, mostly known already: this loop is the crawl's hottest)
        for node in nodes:
            node_id = node.id
            known = addresses.get(node_id)
            if known is None:
                if node_id == self_id:
                    continue
                key = (node_id, node.ip, node.port)
                addresses[node_id] = [key]
            else:
                first = known[0]
                if first[2] == node.port and first[1] == node.ip:
                    continue  # (the usual case: the id at the one address known for it)
                key = (node_id, node.ip, node.port)
                if key in candidates or not self._admits(node, known, named_by):
                    continue
                known.append(key)
            candidates[key] = node
            namers[key] = named_by
            distance[key] = node_distance = target ^ node.long_id
            order.append((node_distance, key))
            self._unsorted = True
            rounds[key] = round_
            if not peers.may_be_suspect(key):
                continue
            # Nodes that recently timed out are asked (a busy machine makes live nodes time out, and skipping
            # them put whole stores where no reader looked), but no search waits for them: a store
            # search that did waited one RPC timeout per dead node met, round after round, until storing
            # took longer than the entries live. Stores that miss a busy node are caught by
            # :meth:`DHTNode.make_readable`. A hedged read does not wait for recently slow nodes either.
            if peers.recently_dead(key):
                self.suspects.add(key)
                self.dead_suspects.add(key)
            elif self.hedge and peers.recently_slow(key):
                self.suspects.add(key)
        if len(candidates) - len(self.contacted) > 2 * self.max_candidates:
            self._prune()

    def _admits(self, node: Node, known: list[Peer], named_by: Home | None) -> bool:
        """Whether ``node`` is kept as well as the candidates ``known`` at other addresses under its id: always at the
        address the routing table holds for the id; else only if ``named_by`` named none of ``known`` (one home names
        one address per id: a made-up one cannot push out the one another home named) and fewer than
        :data:`ADDRESSES_PER_ID` of them are elsewhere than the table's."""
        held = self.protocol.router.holding(node)
        table = peer_key(held) if held is not None else None
        if table == (node.id, node.ip, node.port):
            return True
        if named_by is not None and any(self.named_by.get(key) == named_by for key in known):
            return False
        return sum(key != table for key in known) < ADDRESSES_PER_ID

    def _prune(self) -> None:
        """Forgets all but the ``max_candidates`` closest contacts not asked yet (asked ones are kept: their replies
        and the result need them)."""
        self._sort()
        kept, unasked = [], 0
        for item in self._order:
            key = item[1]
            if key in self.contacted or unasked < self.max_candidates:
                unasked += key not in self.contacted
                kept.append(item)
                continue
            for table in (self.candidates, self.distance, self.round, self.named_by):
                del table[key]
            self.home.pop(key, None)
            self.suspects.discard(key)
            self.dead_suspects.discard(key)
            known = self.addresses[key[0]]
            known.remove(key)
            if not known:
                del self.addresses[key[0]]
        self._order = kept

    def _sort(self) -> list[tuple[int, bytes]]:
        if self._unsorted:
            self._order.sort()
            self._unsorted = False
        return self._order

    def _home(self, key: Peer) -> tuple[Address, Home]:
        """A candidate's address and home (worked out when first needed: most candidates never are)."""
        found = self.home.get(key)
        if found is None:
            address = key[1:]
            found = self.home[key] = (address, contact_machine(*address))
        return found

    def _closest(self, order: list[tuple[int, Peer]], skip: set[Peer] | frozenset = frozenset(),
                 askable: bool = False) -> list[Node]:
        """The first ``width`` candidates of ``order`` ((distance, contact), closest first) not in ``skip``, at most
        one per id (the one that stands for it, once one answered: see ``answered_as``), one per address and
        :data:`FRONTIER_PER_MACHINE` per machine; with ``askable``, only those asked already or that the crawl may
        still ask (each counted as asked)."""
        picked: list[Node] = []
        picked_ids: set[bytes] = set()
        answered_as = self.answered_as
        at_address: set[Address] = set()
        in_machine: dict[Home, int] = {}  # picked per machine (homes that are not an address)
        room = self.max_asks - len(self.contacted)  # requests the crawl may still make
        asked_at, asked_in, also_in = self._asked_at, self._asked_in, {}
        homes, contacted, candidates, width = self.home, self.contacted, self.candidates, self.width
        for _, key in order:
            if key in skip:
                continue
            node_id = key[0]
            if node_id in picked_ids or answered_as.get(node_id, key) != key:
                continue  # another address of a node picked, or of one that answered at another address
            found = homes.get(key)
            if found is None:  # (as _home, inline: the frontier is worked out after every reply)
                address = key[1:]
                found = homes[key] = (address, contact_machine(*address))
            address, home = found
            if address in at_address:
                continue
            # as run asks: counting those picked before as asked
            if home is address:  # on this host: each address is a home of its own
                if askable and key not in contacted:
                    if room <= 0 or address in asked_at:
                        continue
                    room -= 1
            else:
                if in_machine.get(home, 0) >= FRONTIER_PER_MACHINE:
                    continue
                if askable and key not in contacted:
                    if room <= 0 or address in asked_at or (
                            asked_in.get(home, 0) + also_in.get(home, 0) >= ASKS_PER_MACHINE):
                        continue
                    room -= 1
                    also_in[home] = also_in.get(home, 0) + 1
                in_machine[home] = in_machine.get(home, 0) + 1
            at_address.add(address)
            picked_ids.add(node_id)
            picked.append(candidates[key])
            if len(picked) >= width:
                break
        return picked

    def _frontier(self, slow: set[Peer]) -> list[Node]:
        """The ``width`` closest candidates neither dead nor slow that were asked or may be (see :meth:`_closest`)."""
        return self._closest(self._sort(), self.dead | slow if slow else self.dead, askable=True)

    def _take(self, responder: Node, nodes: list[Node]) -> None:
        """Adds the contacts a reply named, within the crawl's bounds on rounds and on what one home may bring."""
        target, self_id = self.target.long_id, self.self_id
        responder_key = peer_key(responder)
        distance = self.distance[responder_key]
        self._best = best = distance if self._best is None else min(self._best, distance)
        round_ = self.round[responder_key]
        if round_ >= MAX_ROUNDS:
            return  # too far from where the crawl started
        addresses = self.addresses
        new = [node for node in nodes if _is_new(addresses, node) and node.id != self_id]
        if not new:
            return
        home = self._home(responder_key)[1]
        left = self.width - self._brought.get(home, 0)
        if left <= 0:
            return
        if len(new) > left:
            new = heapq.nsmallest(left, new, key=lambda node: target ^ node.long_id)
        if any(target ^ node.long_id < best for node in new):
            self._progress_round = max(self._progress_round, round_)
        elif round_ > self._progress_round + ROUNDS_WITHOUT_PROGRESS:
            return  # a round after one that brought nothing closer, and this reply brings nothing closer either
        self._brought[home] = self._brought.get(home, 0) + len(new)
        self._add(new, round_ + 1, home)

    def _ask(self, node: Node) -> None:
        """Sends the query; its outcome lands in ``self._inbox`` (from a callback: a lookup that waits on many
        replies costs no task per reply)."""
        if not self.fetch_records:
            task = asyncio.ensure_future(self.protocol.call_find_node(node, self.target))
            task.add_done_callback(lambda done: done.cancelled() or self._deliver(node, done.result()))
            self.protocol.adopt(task)
            return
        future = self.protocol.find_value_soon(node, self.target, on_sent=self._mark_sent)
        future.add_done_callback(lambda done: done.cancelled() or self._on_value(node, done.result()))

    def _on_value(self, node: Node, result: tuple[bool, Any]) -> None:
        ok, data = self.protocol.handle_call_response(result, node)
        if not ok:
            self._deliver(node, (False, None))
            return
        self.sent.pop(peer_key(node), None)  # it answered: verifying its entries is our time, not its lateness
        try:
            known = self.protocol.replies.parse_known(data, self.target.id)
        except Exception as error:  # noqa: BLE001 - a reply must reach the crawl, or the crawl waits for it for ever
            self._deliver(node, (True, malformed(error)))
            return
        if known is not None:
            self._deliver(node, (True, known))
            return

        async def verify() -> None:  # entries not seen before: checked on the protocol's verification thread
            try:
                self._deliver(node, (True, await self.protocol.replies.parse(data, self.target.id)))
            except Exception as error:  # noqa: BLE001 - as above
                self._deliver(node, (True, malformed(error)))
        self.protocol.spawn(verify())

    def _deliver(self, node: Node, reply: tuple[bool, Any]) -> None:
        self._inbox.append((node, reply))
        if self._wake is not None and not self._wake.done() and self._must_wake(node, reply):
            self._wake.set_result(None)

    def _must_wake(self, node: Node, reply: tuple[bool, Any]) -> bool:
        """False when the sleeping loop would only go back to sleep: the reply is a record from a frontier node, other
        frontier nodes have yet to answer, and it names no new contact closer than the frontier's edge (so the
        frontier, and what to ask, stay the same). A look-up then wakes about once instead of once per reply; the
        replies wait in the inbox."""
        awaiting, horizon, key = self._awaiting, self._horizon, peer_key(node)
        ok, data = reply
        if (awaiting is None or horizon is None or key not in awaiting or not ok or not self.fetch_records
                or isinstance(data, MalformedRequest)):
            return True
        awaiting.discard(key)
        if not awaiting:
            return True
        target, addresses, self_id = self.target.long_id, self.addresses, self.self_id
        return any(target ^ contact.long_id < horizon and contact.id != self_id and _is_new(addresses, contact)
                   for contact in data[1])

    def _mark_sent(self, node: Node) -> None:
        self.sent[peer_key(node)] = asyncio.get_running_loop().time()

    async def _sleep(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        """Until a reply is delivered or ``timeout`` seconds pass."""
        self._wake = wake = loop.create_future()
        timer = loop.call_later(timeout, _resolve, wake) if timeout is not None else None
        try:
            await wake
        finally:
            self._wake = None
            if timer is not None:
                timer.cancel()

    def _accept(self, node: Node, reply: tuple[bool, Any]) -> None:
        ok, data = reply
        key = peer_key(node)
        if not ok:
            self.dead.add(key)
            return
        record = None
        if self.fetch_records:
            if isinstance(data, MalformedRequest):
                logger.warning("malformed find_value reply from %s: %s", node, data)
                self.dead.add(key)
                return
            record, nodes = data
            if not any(record is known for known in self.records):  # identical replicas are merged once
                self.records.append(record)
            self.held_at[key] = record
        else:
            nodes = parse_nodes(data)
        self.responded[key] = node
        self._stand_for(node, key, record)
        self._take(node, as_seen_from(node, nodes))

    def _stand_for(self, node: Node, key: Peer, record: Record | None) -> None:
        """``node`` answered: it stands for its id if it is the first address to answer under it, or the one the
        routing table holds for it (another address that answered first may be anyone's)."""
        stands = self.answered_as.get(node.id)
        if stands is not None:
            held = self.protocol.router.holding(node)
            if held is None or not held.same_home_as(node):
                return
        self.answered_as[node.id] = key
        if record is not None:
            self.held[node.id] = record

    async def run(self, local: Record | None = None) -> tuple[list[Node], Record]:
        """The closest responding nodes (closest first) and the merged record they (and ``local``, what this node
        holds) hold, empty if none."""
        loop = asyncio.get_running_loop()
        hedge_after = self.protocol.config.hedge_after if self.hedge else float("inf")
        contacted, asked_at, asked_in, answered_as = self.contacted, self._asked_at, self._asked_in, self.answered_as
        pending: set[Peer] = set()  # contacts asked that have neither answered nor timed out
        deadline = loop.time() + DEADLINE_TIMEOUTS * self.protocol.config.rpc_timeout
        nearest: list[Node] | None = None
        while True:
            now = loop.time()
            if now >= deadline:
                logger.debug("lookup of %s ended at its deadline: %d nodes asked, %d answered",
                             self.target.id.hex()[:16], len(contacted), len(self.responded))
                break
            sent = [(key, self.sent[key]) for key in pending if key in self.sent]
            late = {key for key, at in sent if now - at >= hedge_after}
            if late and self.protocol.drain() and self._inbox:
                continue  # replies were waiting unread: they are not late (see DHTProtocol.drain)
            for key in late - self.suspects:
                self.protocol.peers.mark_slow(key)  # concurrent and later lookups will not wait for it
            slow = late | (self.suspects - self.responded.keys())
            frontier = self._frontier(slow)
            horizon = self.distance[peer_key(frontier[-1])] if len(frontier) >= self.width else None
            # Late nodes closer than the frontier's edge are asked anyway. In a hedged read, nodes that timed out
            # are asked only when nothing was found yet or the live ones do not fill the frontier (each pending
            # request to a dead node holds a slot until its timeout); a store search asks them all.
            found = not self.fetch_records or any(self.records)
            to_ask = frontier + [self.candidates[key] for key in self.suspects if horizon is None or (
                (key not in self.dead_suspects or not found or not self.hedge)
                and self.distance[key] < horizon)]
            # the other addresses named for a frontier node's id are asked too (those not suspect: see above), each
            # within the bounds below: the first to answer stands for the id (see _stand_for)
            for node in frontier:
                known = self.addresses[node.id]
                if len(known) > 1:
                    to_ask += [self.candidates[key] for key in known if key not in self.suspects]
            for node in to_ask:
                key = peer_key(node)
                if key in contacted or key in self.dead:
                    continue
                # at most max_asks requests, one id per address, ASKS_PER_MACHINE per machine
                address, home = self._home(key)
                per_machine = home is not address
                if len(contacted) >= self.max_asks or address in asked_at or per_machine and (
                        asked_in.get(home, 0) >= ASKS_PER_MACHINE):
                    continue
                asked_at.add(address)
                if per_machine:
                    asked_in[home] = asked_in.get(home, 0) + 1
                contacted.add(key)
                pending.add(key)
                self._ask(node)
            if not self._inbox:
                # An empty answer waits for every live node still asked (a busy replica must not make a live record
                # look dead), though not for nodes that timed out before once the frontier is full (else every
                # look-up of an absent key waited an RPC timeout after churn); otherwise nobody late or suspect
                # holds the search up, nor, once something was found, an address of a node that answered at
                # another (until then it is waited for: the one that answered may be anyone's, holding nothing).
                must_wait = [key for key in pending if not frontier or (
                    (key not in self.dead_suspects or horizon is None) if not found else
                    key not in self.suspects and key not in slow and answered_as.get(key[0], key) == key)]
                if all(peer_key(node) in self.responded for node in frontier) and (horizon is not None and found
                                                                                   or not must_wait):
                    nearest = frontier  # the closest that answered: none closer is dead or slow any more
                    break
                waits = [at + hedge_after - now for key, at in sent if key not in slow and self.hedge]
                if self.hedge and len(sent) < len(pending):
                    waits.append(hedge_after)  # a queued request gets sent meanwhile: look again then
                # Requests still pending when the lookup ends are left to finish on their own: a timeout still
                # marks its node dead (and evicts it), which keeps the next lookups from waiting on that node.
                self._horizon = horizon
                self._awaiting = {key for key in map(peer_key, frontier) if key not in self.responded
                                  and key not in self.suspects}
                timeout = deadline - now
                if waits:
                    timeout = min(timeout, min(waits))
                await self._sleep(loop, max(0.0, timeout))
                self._awaiting = None
            inbox, self._inbox = self._inbox, []
            for node, reply in inbox:
                pending.discard(peer_key(node))
                self._accept(node, reply)
        if nearest is None:
            nearest = self._closest(sorted((self.distance[key], key) for key in self.responded))
        # one vote per home (a machine, an address on this host) however many of its ids answered (or addresses under
        # one id), this node's own record one of its own
        held, voters = list(self.held_at.values()), [self._home(key)[1] for key in self.held_at]
        if local:
            held.append(local)
            voters.append(LOCAL_VOTER)
        disputes: dict = {}
        merged = merge_records(held, voters=voters, disputes=disputes, ties=self.ties)
        for subkey, how in disputes.items():  # a hijack (or the rare overlap of an expired owner and its successor)
            self.protocol.refusals.warn("contested", self.target.id.hex(), "replicas of record %s disagree on the "
                                        "owner of subkey %s (%s)%s", self.target.id.hex()[:16], subkey, how,
                                        "" if subkey in merged else "; a tie: read as absent")
        return nearest, merged


def _is_new(addresses: dict[bytes, list[Peer]], node: Node) -> bool:
    """Whether ``node`` is not among a crawl's candidates (``addresses``: RecordCrawl.addresses)."""
    known = addresses.get(node.id)
    if known is None:
        return True
    ip, port = node.ip, node.port
    for key in known:
        if key[2] == port and key[1] == ip:
            return False
    return True


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def malformed(error: Exception) -> MalformedRequest:
    """``error`` as the malformed reply it means; a parser's unforeseen exception is one too."""
    return error if isinstance(error, MalformedRequest) else MalformedRequest(f"unparsable reply: {error!r}"[:200])
