"""``ReplicaService``, the receiving end: keeps the replicas other servers push, serves them to adopters.

A push is refused, with a status naming what is wrong, unless its expert is of a layer this server receives
replicas of (``layers``: those it announced itself a host of), unless it is signed by the key that owns the expert
in the directory now (or, while nobody does, by the key that signed the replica held here: the owner's last pushes can
outlive its declaration), unless its bytes are all there and are what the header says, and unless its state fits
this server's own experts (``template``) with an update count its optimizer state agrees with. A refused push never
touches what was held: the new replica is written (atomically) only after every check passed. Accepted replicas
count in the share of the budget of the machine that pushed them (see :mod:`dmoe.replicas.store`).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import AsyncIterator, Callable, Collection

import grpc

from dmoe.endpoints import machine_of, peer_host
from dmoe.replicas.metrics import ReplicaMetrics
from dmoe.replicas.records import SIGNER_HEX
from dmoe.replicas.snapshots import (
    CHUNK_BYTES,
    SignedSnapshot,
    SnapshotRefused,
    check_header,
    check_state,
    open_body,
)
from dmoe.replicas.store import ReplicaStore
from dmoe.server.backend import ExpertBackend
from dmoe.uid import split_uid
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc

logger = logging.getLogger(__name__)

#: reads the directory: the public key that owns a uid now, None when nobody declares it (blocking; run in a thread)
OwnerLookup = Callable[[str], "bytes | None"]


class ReplicaServicer(dmoe_pb2_grpc.ReplicaServiceServicer):
    """Implements ``ReplicaService`` of proto/dmoe.proto over a :class:`ReplicaStore`.

    Args:
        store: where accepted replicas go.
        template: one expert as this server builds them; replicas must fit it (class, hyperparameters, shapes).
        owner_of: the directory's owner of a uid (see :func:`dmoe.replicas.records.owner_of`).
        metrics: counts refusals by reason.
        chunk_bytes: bytes per message of a fetched replica.
        layers: the layers whose replicas this server receives (announced as their host); None: any.
    """

    def __init__(self, store: ReplicaStore, template: ExpertBackend, owner_of: OwnerLookup,
                 metrics: ReplicaMetrics | None = None, chunk_bytes: int = CHUNK_BYTES,
                 layers: Collection[str] | None = None):
        self.store, self.template, self.owner_of = store, template, owner_of
        self.metrics, self.chunk_bytes = metrics, chunk_bytes
        self.layers = frozenset(layers) if layers is not None else None
        self.accepted = 0

    async def push(self, request_iterator: AsyncIterator[dmoe_pb2.ReplicaChunk], context) -> dmoe_pb2.ReplicaAck:
        try:
            updates = await self._receive(request_iterator, peer_machine(context.peer()))
        except SnapshotRefused as refused:
            if self.metrics is not None:
                self.metrics.refused.labels(refused.reason).inc()
            logger.info("refused a replica: %s", refused.message)
            await context.abort(refused.code, refused.message)
        return dmoe_pb2.ReplicaAck(updates=updates)

    async def _receive(self, chunks: AsyncIterator[dmoe_pb2.ReplicaChunk], source: str) -> int:
        first = await anext(chunks, None)
        if first is None or not first.HasField("header"):
            raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                  "a replica stream must start with its header")
        header = first.header
        check_header(header, self.store.budget_bytes)
        self._check_layer(header.uid)
        await self._check_signer(header)
        received, total = [first.data], len(first.data)
        async for chunk in chunks:
            if chunk.HasField("header"):
                raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                      f"the replica stream of {header.uid} carries a second header")
            total += len(chunk.data)
            if total > header.size:
                raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                      f"the replica stream of {header.uid} carries more than the {header.size} bytes "
                                      "its header announced")
            received.append(chunk.data)
        signed = SignedSnapshot(header, b"".join(received))
        held = self.store.header(header.uid)
        if held is not None and held.sha256 == header.sha256 and held.signer == header.signer:
            await asyncio.to_thread(self.store.touch, header.uid)  # the same replica again: nothing to write
            return held.updates
        await asyncio.to_thread(self._check_and_store, signed, source)
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

    async def _check_signer(self, header: dmoe_pb2.ReplicaHeader) -> None:
        """The signer must own the uid now, or, while nobody does, have signed the replica held here; a replica
        older than the one held from the same owner is refused too (the newest is kept)."""
        owner = await asyncio.to_thread(self.owner_of, header.uid)
        held = self.store.header(header.uid)
        signer = header.signer
        if owner != signer and not (owner is None and held is not None and held.signer == signer):
            named = f"the directory names {owner.hex()[:SIGNER_HEX]}" if owner else "nobody declares it now"
            if owner is None:
                named += (f" and the replica held here is {held.signer.hex()[:SIGNER_HEX]}'s" if held is not None
                          else " and this server holds no replica of it")
            raise SnapshotRefused(grpc.StatusCode.PERMISSION_DENIED, "not_owner",
                                  f"the replica of {header.uid} is signed by {signer.hex()[:SIGNER_HEX]}, which does "
                                  f"not own it ({named})")
        if held is not None and held.signer == signer and header.updates < held.updates:
            raise SnapshotRefused(grpc.StatusCode.FAILED_PRECONDITION, "older",
                                  f"this server holds a newer replica of {header.uid} ({held.updates} updates) "
                                  f"from the same owner than this one ({header.updates})")

    def _check_and_store(self, signed: SignedSnapshot, source: str) -> None:
        check_state(open_body(signed), self.template)
        self.store.put(signed, source)

    async def fetch(self, request: dmoe_pb2.ReplicaQuery, context) -> AsyncIterator[dmoe_pb2.ReplicaChunk]:
        try:
            signed = await asyncio.to_thread(self.store.get, request.uid)
        except (OSError, ValueError) as error:
            await context.abort(grpc.StatusCode.INTERNAL, f"the replica of {request.uid} cannot be read: {error}")
        if signed is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this server holds no replica of {request.uid!r}")
        for chunk in signed.chunks(self.chunk_bytes):
            yield chunk


def peer_machine(peer: str) -> str:
    """The machine a gRPC peer string is on, as :func:`dmoe.endpoints.machine_of` counts machines (an IPv4 address,
    an IPv6 /64); a peer that is no IP address (a unix socket) as its host."""
    host = peer_host(peer)
    try:
        return machine_of(ipaddress.ip_address(host.split("%", 1)[0]))
    except ValueError:
        return host
