"""``ReplicaService``, the receiving end: keeps the replicas other servers push, serves them to adopters.

A push is refused, with a status naming what is wrong, unless its expert is of a layer this server receives
replicas of (``layers``: those it announced itself a host of), unless it is signed by the key that owns the expert
in the directory now (or, while nobody does, by the key that signed the replica held here: the owner's last pushes can
outlive its declaration), unless it has at least as many updates as the replica held here, whoever signed that
one, while that one's signer pushed it within ``lineage_seconds`` (a key that declares a cell that emptied must not
replace the previous owner's training with less before an adoption could take it; see :func:`_older`), unless its
bytes are all there and are what the header says, and unless its state fits this server's own experts
(``template``) with an update count its optimizer state agrees with. The owner and the replica held are checked
at the header and again at the commit, against the replica held then (a push may take minutes, and others finish
meanwhile). A refused push never
touches what was held: the new replica is written (atomically) only after every check passed. Accepted replicas
count in the share of the budget of the machine that pushed them (see :mod:`dmoe.replicas.store`).

What a call may cost the server is bounded. A push's message may carry no more than
:data:`~dmoe.replicas.snapshots.CHUNK_BYTES` of the replica, and one larger than an honest message is refused
unparsed (:meth:`ReplicaServicer.add_to_server`; gRPC still reads it whole, up to the server's message limit). A
push may announce no more bytes than a snapshot of this server's experts can take
(:func:`~dmoe.replicas.snapshots.max_snapshot_bytes`); its bytes go to a temporary file as they arrive, not to
memory, and the state is checked (the one step that holds a whole snapshot in memory) one push at a time. A fetch
reads the replica's file a message at a time, as the caller reads. Pushes and fetches open at once are capped, in
all and per calling machine, and so are the bytes that open pushes announce, in all and per machine (a share of the
budget: :data:`ANNOUNCED_SHARE_PER_MACHINE`) (RESOURCE_EXHAUSTED naming the cap); a call that sends or reads nothing
for ``stall_seconds`` is ended (DEADLINE_EXCEEDED), and so is a push that falls behind a minimum rate
(:data:`MIN_PUSH_BYTES_PER_SECOND` after :data:`PUSH_ALLOWANCE_SECONDS`), so that neither idle calls nor calls
trickling a byte at a time can hold the caps.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import AsyncIterator, Callable, Collection, Iterator

import grpc

from dmoe.endpoints import peer_machine
from dmoe.replicas.metrics import ReplicaMetrics
from dmoe.replicas.records import SIGNER_HEX
from dmoe.replicas.snapshots import (
    CHUNK_BYTES,
    MESSAGE_BYTES,
    SnapshotRefused,
    check_header,
    check_state,
    max_snapshot_bytes,
    max_tensors,
    open_body,
)
from dmoe.replicas.store import HeldReplica, Incoming, ReplicaStore
from dmoe.server.backend import ExpertBackend
from dmoe.uid import split_uid
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc

logger = logging.getLogger(__name__)

#: reads the directory: the public key that owns a uid now, None when nobody declares it (blocking; run in a thread)
OwnerLookup = Callable[[str], "bytes | None"]

#: pushes received at once, in all and from one machine (the pushers of a ``--processes`` server share one)
MAX_PUSHES, MAX_PUSHES_PER_MACHINE = 32, 8
#: fetches served at once, in all and to one machine
MAX_FETCHES, MAX_FETCHES_PER_MACHINE = 32, 8
#: seconds a push may send nothing, or a fetch read nothing, before the server ends it
STALL_SECONDS = 60.0
#: a push must also keep up an average rate: from its header it has PUSH_ALLOWANCE_SECONDS, plus one second per
#: MIN_PUSH_BYTES_PER_SECOND bytes it sent, so it takes at most PUSH_ALLOWANCE_SECONDS + its announced size / that
#: rate in all. With the stall limit alone, a push sending a byte a minute stayed open for ever while its announced
#: size counted against the budget of announced bytes: two machines' such pushes locked every holder of a layer
#: out of all honest replicas (review 78). 256 KiB/s (2 Mbit/s) is below a slow home uplink: an honest push of
#: the largest snapshot of a --hidden-dim 1024 ffn (129 MiB) passes at that rate in 9 minutes (its pusher gives up
#: long before: its own timeout of 60 s needs 2 MiB/s), one of 1 GiB (the default budget) in 70. The allowance
#: covers a slow start: the connection's ramp-up, the first message (1 MiB: 4 s at that rate), a busy holder
PUSH_ALLOWANCE_SECONDS = 60.0
MIN_PUSH_BYTES_PER_SECOND = 256 * 1024
#: the bytes the open pushes of one machine may announce, as a share of the replica budget (never less than one
#: snapshot of this server's experts): it takes four machines, not one or two, to hold the whole budget of
#: announced bytes (and so every honest push off), and each must keep sending at MIN_PUSH_BYTES_PER_SECOND to hold
#: its share for longer than PUSH_ALLOWANCE_SECONDS (review 78). A server of several processes on one machine still
#: pushes a few snapshots at once; the rest are "busy" and go to the next host
ANNOUNCED_SHARE_PER_MACHINE = 0.25
#: seconds a replica held here is kept from another signer's replica with fewer updates, since its own signer last
#: pushed it: the time for its expert to be adopted from it after its server left (see :func:`_older`)
LINEAGE_SECONDS = 600.0


class Oversized:
    """A push's message larger than :data:`~dmoe.replicas.snapshots.MESSAGE_BYTES`, left unparsed (see
    :meth:`ReplicaServicer.add_to_server`)."""

    def __init__(self, size: int):
        self.size = size


def parse_chunk(data: bytes) -> "dmoe_pb2.ReplicaChunk | Oversized":
    """A push's message, or :class:`Oversized` (no honest one is larger: its parse would copy it once more)."""
    return Oversized(len(data)) if len(data) > MESSAGE_BYTES else dmoe_pb2.ReplicaChunk.FromString(data)


class ReplicaServicer(dmoe_pb2_grpc.ReplicaServiceServicer):
    """Implements ``ReplicaService`` of proto/dmoe.proto over a :class:`ReplicaStore`.

    Args:
        store: where accepted replicas go.
        template: one expert as this server builds them; replicas must fit it (class, hyperparameters, shapes), and
            none may be larger than a snapshot of it can be (:func:`~dmoe.replicas.snapshots.max_snapshot_bytes`).
        owner_of: the directory's owner of a uid (see :func:`dmoe.replicas.records.owner_of`).
        metrics: counts refusals by reason.
        chunk_bytes: bytes per message of a fetched replica.
        layers: the layers whose replicas this server receives (announced as their host); None: any.
        max_pushes, max_fetches: calls open at once, in all and per calling machine (see the module doc).
        stall_seconds: how long a push may send nothing, or a fetch read nothing, before it is ended.
        push_allowance, min_push_rate: a push is ended once it has taken more than ``push_allowance`` seconds plus
            one second per ``min_push_rate`` bytes it sent (see :data:`MIN_PUSH_BYTES_PER_SECOND`).
        machine_share: the share of the budget that the open pushes of one machine may announce (see
            :data:`ANNOUNCED_SHARE_PER_MACHINE`).
        lineage_seconds: how long a replica held here is kept from another signer's with fewer updates, since its
            own signer last pushed it (see :func:`_older`).
        own_key: this server's public key: a replica it signed is refused, since it would die with this server.
    """

    def __init__(self, store: ReplicaStore, template: ExpertBackend, owner_of: OwnerLookup,
                 metrics: ReplicaMetrics | None = None, chunk_bytes: int = CHUNK_BYTES,
                 layers: Collection[str] | None = None, *,
                 max_pushes: tuple[int, int] = (MAX_PUSHES, MAX_PUSHES_PER_MACHINE),
                 max_fetches: tuple[int, int] = (MAX_FETCHES, MAX_FETCHES_PER_MACHINE),
                 stall_seconds: float = STALL_SECONDS, lineage_seconds: float = LINEAGE_SECONDS,
                 push_allowance: float = PUSH_ALLOWANCE_SECONDS, min_push_rate: float = MIN_PUSH_BYTES_PER_SECOND,
                 machine_share: float = ANNOUNCED_SHARE_PER_MACHINE, own_key: bytes | None = None):
        if not 0 < chunk_bytes <= CHUNK_BYTES:  # (the replica channels take no larger message: review 105 D1)
            raise ValueError(f"chunk_bytes must be in 1..{CHUNK_BYTES}, got {chunk_bytes}")
        self.store, self.template, self.owner_of = store, template, owner_of
        self.lineage_seconds, self.own_key = lineage_seconds, own_key
        self.metrics, self.chunk_bytes = metrics, chunk_bytes
        self.layers = frozenset(layers) if layers is not None else None
        self.max_bytes = min(max_snapshot_bytes(template), store.budget_bytes)
        self.stall_seconds = stall_seconds
        self.push_allowance, self.min_push_rate = push_allowance, min_push_rate
        self.max_announced_per_machine = max(self.max_bytes, int(store.budget_bytes * machine_share))
        self._limits = {"push": max_pushes, "fetch": max_fetches}
        self._open: dict[str, Counter] = {"push": Counter(), "fetch": Counter()}  # kind -> machine -> calls open
        self._announced = 0  # bytes the open pushes announced
        self._announced_by: Counter = Counter()  # machine -> bytes its open pushes announced
        self._checking = asyncio.Semaphore(1)  # (bound to the gRPC loop at its first use)
        self.accepted = 0

    def add_to_server(self, server) -> None:
        """Registers this service on ``server`` (a ``grpc.aio.Server``) as
        ``dmoe_pb2_grpc.add_ReplicaServiceServicer_to_server`` does, but with :func:`parse_chunk` for a push's
        messages. gRPC caps messages per server, not per method, and the server's cap is its experts' (64 MiB by
        default): a push is refused at its first message larger than an honest one, before that is parsed too
        (review 105 D1)."""
        handlers = {
            "push": grpc.stream_unary_rpc_method_handler(
                self.push, request_deserializer=parse_chunk,
                response_serializer=dmoe_pb2.ReplicaAck.SerializeToString),
            "fetch": grpc.unary_stream_rpc_method_handler(
                self.fetch, request_deserializer=dmoe_pb2.ReplicaQuery.FromString,
                response_serializer=dmoe_pb2.ReplicaChunk.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("dmoe.ReplicaService", handlers),))
        server.add_registered_method_handlers("dmoe.ReplicaService", handlers)

    @contextlib.contextmanager
    def _slot(self, kind: str, machine: str) -> Iterator[None]:
        """Counts a call open for as long as it runs; SnapshotRefused (RESOURCE_EXHAUSTED) when it would exceed
        its caps. (Every call runs on the server's one event loop: no lock needed.)"""
        most, per_machine = self._limits[kind]
        calls = self._open[kind]
        if sum(calls.values()) >= most:
            raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                                  f"this server serves at most {most} replica {kind}es at once; try again later")
        if calls[machine] >= per_machine:
            raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                                  f"this server serves at most {per_machine} replica {kind}es of one machine "
                                  f"({machine}) at once; try again later")
        calls[machine] += 1
        try:
            yield
        finally:
            calls[machine] -= 1
            if not calls[machine]:
                del calls[machine]

    def _refused(self, refused: SnapshotRefused, what: str, count: bool = True) -> None:
        if self.metrics is not None and count:
            self.metrics.refused.labels(refused.reason).inc()
        (logger.debug if refused.reason == "busy" else logger.info)("refused %s: %s", what, refused.message)

    async def push(self, request_iterator: AsyncIterator[dmoe_pb2.ReplicaChunk], context) -> dmoe_pb2.ReplicaAck:
        machine = peer_machine(context.peer())
        try:
            with self._slot("push", machine):
                updates = await self._receive(request_iterator, machine)
        except SnapshotRefused as refused:
            self._refused(refused, "a replica")
            await context.abort(refused.code, refused.message)
        return dmoe_pb2.ReplicaAck(updates=updates)

    async def _next(self, chunks: AsyncIterator[dmoe_pb2.ReplicaChunk], what: str,
                    due: float = float("inf"), slow: Callable[[], SnapshotRefused] | None = None
                    ) -> dmoe_pb2.ReplicaChunk | None:
        """The next message, within ``stall_seconds`` and before ``due`` (a ``time.monotonic()`` time; ``slow``
        says why a push that passed it is ended)."""
        left = due - time.monotonic()
        if left <= 0 and slow is not None:
            raise slow()
        try:
            chunk = await asyncio.wait_for(anext(chunks, None), min(self.stall_seconds, left))
        except asyncio.TimeoutError:
            if left < self.stall_seconds and slow is not None:
                raise slow() from None
            raise SnapshotRefused(grpc.StatusCode.DEADLINE_EXCEEDED, "stalled",
                                  f"the push of {what} sent nothing for {self.stall_seconds:g} s") from None
        # no honest pusher sends more than CHUNK_BYTES of bytes a message (review 105 D1); see add_to_server
        size = chunk.size if isinstance(chunk, Oversized) else len(chunk.data) if chunk is not None else 0
        if size > CHUNK_BYTES:
            raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "too_large",
                                  f"the push of {what} sent {size} bytes in one message: this server takes at most "
                                  f"{CHUNK_BYTES} bytes of a replica per message")
        return chunk

    async def _receive(self, chunks: AsyncIterator[dmoe_pb2.ReplicaChunk], source: str) -> int:
        first = await self._next(chunks, "a replica")
        if first is None or not first.HasField("header"):
            raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                  "a replica stream must start with its header")
        header = first.header
        check_header(header, self.store.budget_bytes)
        if header.size > self.max_bytes:
            raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large",
                                  f"replica of {header.uid} has {header.size} bytes, more than a snapshot of this "
                                  f"server's experts can take ({self.max_bytes})")
        self._check_layer(header.uid)
        owner = await self._check_signer(header)
        held = self.store.header(header.uid)
        if held is not None and held.sha256 == header.sha256 and held.signer == header.signer:
            # the same replica again (its signature vouches for the size and digest of the bytes held): nothing to
            # read or write
            await asyncio.to_thread(self.store.touch, header.uid)
            return held.updates
        if self._announced + header.size > self.store.budget_bytes:
            raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                                  f"the replicas this server receives now take its whole replica budget "
                                  f"({self.store.budget_bytes} bytes); try again later")
        if self._announced_by[source] + header.size > self.max_announced_per_machine:
            raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                                  f"the replicas this server receives from {source} now announce "
                                  f"{self._announced_by[source]} bytes, and it takes at most "
                                  f"{self.max_announced_per_machine} bytes of one machine's pushes at once (a share "
                                  f"of its replica budget); try again later")
        self._announced += header.size
        self._announced_by[source] += header.size
        started = time.monotonic()
        incoming: Incoming | None = None
        try:
            incoming = await asyncio.to_thread(self.store.receive, header)

            def slow() -> SnapshotRefused:
                return SnapshotRefused(grpc.StatusCode.DEADLINE_EXCEEDED, "slow",
                                       f"the push of {header.uid} is too slow: {incoming.received} of {header.size} "
                                       f"bytes in {time.monotonic() - started:.0f} s (this server takes pushes that "
                                       f"send {self.min_push_rate / 1024:g} KiB/s after their first "
                                       f"{self.push_allowance:g} s)")
            chunk: dmoe_pb2.ReplicaChunk | None = first
            while chunk is not None:
                if chunk.data:
                    if incoming.received + len(chunk.data) > header.size:
                        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                              f"the replica stream of {header.uid} carries more than the "
                                              f"{header.size} bytes its header announced")
                    await asyncio.to_thread(incoming.write, chunk.data)
                # every byte sent buys 1/min_push_rate s more: the whole push takes at most the allowance plus its
                # announced size at that rate, and one that falls behind is ended (review 78)
                due = started + self.push_allowance + incoming.received / self.min_push_rate
                chunk = await self._next(chunks, header.uid, due, slow)
                if chunk is not None and chunk.HasField("header"):
                    raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                          f"the replica stream of {header.uid} carries a second header")
            incoming.check()
            await asyncio.to_thread(incoming.finish)  # (synced before the queue: no push waits on another's disk)
            async with self._checking:  # one at a time: the check holds the whole snapshot in memory
                await asyncio.to_thread(self._check, incoming)
            await self._commit(incoming, source, owner)
        finally:
            self._announced -= header.size
            self._announced_by[source] -= header.size
            if not self._announced_by[source]:
                del self._announced_by[source]
            if incoming is not None:
                await asyncio.to_thread(incoming.discard)
        self.accepted += 1
        logger.debug("holding a replica of %s with %d updates", header.uid, header.updates)
        return header.updates

    def _check_layer(self, uid: str) -> None:
        """Only the layers this server announced itself a host of: any key may declare unused uids of any layer,
        and replicas of those would take the budget from the experts whose replicas belong here."""
        layer = split_uid(uid)[0]
        if self.layers is not None and layer not in self.layers:
            raise SnapshotRefused(grpc.StatusCode.PERMISSION_DENIED, "layer",
                                  f"this server holds replicas of layer{'s' * (len(self.layers) != 1)} "
                                  f"{', '.join(sorted(self.layers)) or '(none)'} only, not of {layer} ({uid})")

    async def _check_signer(self, header: dmoe_pb2.ReplicaHeader) -> bytes | None:
        """The signer must own the uid now, or, while nobody does, have signed the replica held here; a replica
        with fewer updates than the one held is refused too, whoever signed either (see :func:`_older`). Checked
        at the header, and again at the commit (see :meth:`_commit`). Returns the owner."""
        owner = await asyncio.to_thread(self.owner_of, header.uid)
        refused = self._refusal(header, owner, self.store.held().get(header.uid))
        if refused is not None:
            raise refused
        return owner

    def _refusal(self, header: dmoe_pb2.ReplicaHeader, owner: bytes | None,
                 held: HeldReplica | None) -> SnapshotRefused | None:
        """Why a replica signed as ``header`` may not replace ``held`` (None: nothing is held) while ``owner`` owns
        its uid (None: nobody), or None when it may."""
        signer = header.signer
        if self.own_key is not None and signer == self.own_key:
            # anyone may announce this server's own endpoint as a host of its layer: its pusher then sent its
            # replicas here, where they die with it, and nothing else held them (review 105 D2)
            return SnapshotRefused(grpc.StatusCode.PERMISSION_DENIED, "own",
                                   f"the replica of {header.uid} is signed by this server's own key: its replicas "
                                   f"belong on other servers")
        if owner != signer and not (owner is None and held is not None and held.signer == signer):
            named = f"the directory names {owner.hex()[:SIGNER_HEX]}" if owner else "nobody declares it now"
            if owner is None:
                named += (f" and the replica held here is {held.signer.hex()[:SIGNER_HEX]}'s" if held is not None
                          else " and this server holds no replica of it")
            return SnapshotRefused(grpc.StatusCode.PERMISSION_DENIED, "not_owner",
                                   f"the replica of {header.uid} is signed by {signer.hex()[:SIGNER_HEX]}, which "
                                   f"does not own it ({named})")
        if held is not None and header.updates < held.updates and (held.signer == signer or self._kept(held)):
            return _older(header, held.header, self.lineage_seconds)
        return None

    def _kept(self, held: HeldReplica) -> bool:
        """Whether ``held`` was pushed by its signer within ``lineage_seconds``."""
        return time.time() - held.received_at < self.lineage_seconds

    def _check(self, incoming: Incoming) -> None:
        """Checks the state of the replica received (the whole snapshot in memory, for as long as this runs)."""
        signed = incoming.signed()
        try:
            check_state(open_body(signed, max_tensors(self.template)), self.template)
        except SnapshotRefused:
            raise
        except Exception as error:  # noqa: BLE001 - untrusted bytes: whatever the checks did not foresee is a refusal
            # (an OverflowError from a +inf step count was answered UNKNOWN and counted as no refusal; review 78)
            raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                  f"the state in the replica of {signed.uid} cannot be checked: "
                                  f"{type(error).__name__}: {error}") from None

    async def _commit(self, incoming: Incoming, source: str, owner: bytes | None) -> None:
        """Holds the replica received, unless the owner (``owner``: at its header) or the replica held changed
        meanwhile so that it may not replace what is held now. Both were checked at the header only, and a replay of
        the owner's older replica, begun before its newer push and finished after it, rolled the holder back
        (review 78): the rules are applied again to the replica held at the commit, under the store's lock."""
        header = incoming.header
        try:
            owner = await asyncio.to_thread(self.owner_of, header.uid)
        except Exception as error:  # noqa: BLE001 - the directory as it was at the header, then
            logger.debug("could not read the owner of %s again at its commit: %s", header.uid, error)
        await asyncio.to_thread(incoming.commit, source, lambda held: self._refusal(header, owner, held))

    async def fetch(self, request: dmoe_pb2.ReplicaQuery, context) -> None:
        """Streams the replica of ``request.uid``: its header alone first (a caller that only wants the header,
        as adoption's votes do, cancels after it and costs no read of the bytes), then the bytes, read from the
        file a message at a time as the caller reads them."""
        try:
            with self._slot("fetch", peer_machine(context.peer())):
                await self._serve(request.uid, context)
        except SnapshotRefused as refused:
            self._refused(refused, f"a fetch of {request.uid}", count=False)
            await context.abort(refused.code, refused.message)

    async def _serve(self, uid: str, context) -> None:
        try:
            opened = await asyncio.to_thread(self.store.open_replica, uid)
        except (OSError, ValueError) as error:
            raise SnapshotRefused(grpc.StatusCode.INTERNAL, "unreadable",
                                  f"the replica of {uid} cannot be read: {error}") from None
        if opened is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this server holds no replica of {uid!r}")
        header, file = opened
        try:
            await self._write(context, dmoe_pb2.ReplicaChunk(header=header), uid)
            remaining = header.size
            while remaining:
                data = await asyncio.to_thread(file.read, min(self.chunk_bytes, remaining))
                if not data:
                    raise SnapshotRefused(grpc.StatusCode.INTERNAL, "unreadable",
                                          f"the replica file of {uid} ended {remaining} bytes early")
                remaining -= len(data)
                await self._write(context, dmoe_pb2.ReplicaChunk(data=data), uid)
        finally:
            file.close()

    async def _write(self, context, chunk: dmoe_pb2.ReplicaChunk, uid: str) -> None:
        try:
            await asyncio.wait_for(context.write(chunk), self.stall_seconds)
        except asyncio.TimeoutError:
            raise SnapshotRefused(grpc.StatusCode.DEADLINE_EXCEEDED, "stalled",
                                  f"the fetch of {uid} read nothing for {self.stall_seconds:g} s") from None


def _older(header: dmoe_pb2.ReplicaHeader, held: dmoe_pb2.ReplicaHeader,
           lineage_seconds: float) -> SnapshotRefused:
    """Why a replica with fewer updates than the one held is refused. From the same owner: the newest is kept. From
    another key, the uid's owner now, for :data:`LINEAGE_SECONDS` after the held replica's signer last pushed it:
    any key may declare a cell that emptied, first, and its untrained snapshot used to replace the trained replica
    of the previous owner on every holder (review 59). An honest new owner continues the lineage (adoption and a
    new server's restore start from the newest replica), so its replicas have at least as many updates, and are
    taken. Not for longer: update counts are the pusher's word, and a key that owned the cell once could claim
    2**36 updates and have every later owner's replicas refused for good (review 69)."""
    uid, signer = header.uid, header.signer.hex()[:SIGNER_HEX]
    if held.signer == header.signer:
        return SnapshotRefused(grpc.StatusCode.FAILED_PRECONDITION, "older",
                               f"this server holds a newer replica of {uid} ({held.updates} updates) from the same "
                               f"owner than this one ({header.updates})")
    return SnapshotRefused(grpc.StatusCode.FAILED_PRECONDITION, "older",
                           f"this server holds a replica of {uid} with {held.updates} updates signed by "
                           f"{held.signer.hex()[:SIGNER_HEX]}, more than this one of {signer} ({header.updates}): "
                           f"another key's replica replaces it once it has at least as many (or {lineage_seconds:g} s "
                           f"after its signer last pushed it), so that a new owner of the uid cannot discard the "
                           f"training held here")
