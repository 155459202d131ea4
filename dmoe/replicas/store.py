"""The replicas a server holds for others, on its disk: one file per expert, written atomically, within a budget.

``DIR/<uid>.replica`` holds a magic string, the length of the header, the serialized
:class:`~dmoe.wire.dmoe_pb2.ReplicaHeader` and the snapshot's bytes exactly as they arrived (so the signature and
digest still vouch for them, and :meth:`ReplicaStore.open_replica` can serve them to an adopter unchanged, read a
chunk at a time). A pushed replica is streamed into a temporary file beside it as it arrives, hashed on the way
(:meth:`ReplicaStore.receive`), and renamed over the held one once every check passed; this server's own go through
:func:`dmoe.server.checkpoints.write_atomically`. Either way a crash leaves the old replica or the new one, never
half of one (and temporary files are removed as stale when the store opens).

The newest replica of each expert is kept (the receiver refuses older ones before they get here). The budget is
shared: when it is full, room is made in the share holding the most bytes (the new replica counted in its own),
so that nobody evicts anyone else's replicas by pushing many of its own (any key may declare unused uids and push
valid snapshots of them). A share is the machine that pushed the replicas (an IPv4 address or an IPv6 /64, as
:func:`dmoe.endpoints.machine_of` counts them: keys cost nothing to make, machines do), or, where that is not
known (written by this server itself, or received before a restart), their signer; within the share, the signer
holding the most gives way, and of its replicas the one received longest ago: its owner has stopped pushing it
(moved its replicas to closer servers, or left and was adopted elsewhere) while the newest arrivals are of experts
that are alive.

One server at a time: a store holds an exclusive lock on ``DIR/.replicas.lock`` (:func:`dmoe.locking.lock_file`)
until :meth:`ReplicaStore.close` or its process ends. Two servers on one directory would read each other's files,
evict (delete) replicas the other still announces and serves, and delete each other's writes in progress as stale.
The lock file is not the checkpoint directory's (``.lock``): one directory may serve a server as both.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, Callable

import grpc
from google.protobuf.message import DecodeError

from dmoe.locking import InUse, lock_file
from dmoe.replicas.snapshots import SignedSnapshot, SnapshotRefused
from dmoe.server.checkpoints import TMP_SUFFIX, _fsync_directory, write_atomically
from dmoe.uid import is_valid_uid
from dmoe.wire import dmoe_pb2

logger = logging.getLogger(__name__)

MAGIC = b"dmoe-replica-v1\n"
SUFFIX = ".replica"
_LENGTH_BYTES = 4
#: the lock file a store holds in its directory
LOCK_FILENAME = ".replicas.lock"


class ReplicaDirectoryInUse(InUse, OSError):
    """Another live process (a server) holds the replica directory. An OSError too: like a directory that cannot
    be created, one this server cannot use (``dmoe-server`` reports both as errors of ``--replica-dir``)."""


@dataclass(frozen=True)
class HeldReplica:
    """What the store knows of a replica without reading its bytes."""

    header: dmoe_pb2.ReplicaHeader
    nbytes: int           # on disk
    received_at: float    # time.time() it was written (the file's mtime after a restart)
    source: str | None = None  # the machine that pushed it; None: written here, or received before a restart

    @property
    def updates(self) -> int:
        return self.header.updates

    @property
    def signer(self) -> bytes:
        return self.header.signer


class ReplicaStore:
    """Replicas in ``directory`` (created if missing), at most ``budget_bytes`` of them in all. Thread-safe.

    Files that cannot be read (not written by dmoe, damaged) are removed when the store opens, with a warning, and
    so are temporary files of writes a crash interrupted. The store locks the directory until :meth:`close` (or
    the process ends): raises :class:`ReplicaDirectoryInUse` naming the pid of another process that holds it.
    """

    def __init__(self, directory: str | os.PathLike, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"the replica budget must be positive, got {budget_bytes} bytes")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self._held: dict[str, HeldReplica] = {}
        self._lock = threading.Lock()
        self.evicted = 0
        # before anything in it is read or deleted: another server's files and writes in progress are its own
        self._lock_file = lock_file(self.directory / LOCK_FILENAME, str(self.directory), "server",
                                    "give each server its own directory", ReplicaDirectoryInUse)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Releases the directory's lock (the files stay); the store must not be used afterwards."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> "ReplicaStore":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _open(self) -> None:
        for stale in self.directory.glob(f"*{SUFFIX}.*{TMP_SUFFIX}"):
            logger.info("removing %s, left by a write that did not finish", stale)
            stale.unlink(missing_ok=True)
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                header = _read_header(path)
                if header.uid + SUFFIX != path.name:
                    raise ValueError(f"it holds a replica of {header.uid}")
            except (OSError, ValueError, DecodeError) as error:
                logger.warning("removing replica file %s, which cannot be read: %s", path, error)
                path.unlink(missing_ok=True)
                continue
            stat = path.stat()
            self._held[header.uid] = HeldReplica(header, stat.st_size, stat.st_mtime)
        over = self._to_evict("", None)  # a budget lowered since they were written
        if over:
            logger.info("removing %d replicas received longest ago, beyond the budget of %d bytes: %s", len(over),
                        self.budget_bytes, ", ".join(over))
            self._remove(over)
            self.evicted += len(over)
        if self._held:
            logger.info("holding %d replicas (%.1f MiB) in %s", len(self._held), self.nbytes / 2**20, self.directory)

    def _path(self, uid: str) -> Path:
        if not is_valid_uid(uid):
            raise ValueError(f"invalid expert uid {uid!r}")
        return self.directory / f"{uid}{SUFFIX}"

    @property
    def nbytes(self) -> int:
        return sum(held.nbytes for held in list(self._held.values()))

    def held(self) -> dict[str, HeldReplica]:
        """uid -> what is held of it, now."""
        with self._lock:
            return dict(self._held)

    def header(self, uid: str) -> dmoe_pb2.ReplicaHeader | None:
        held = self._held.get(uid)
        return held.header if held is not None else None

    def get(self, uid: str) -> SignedSnapshot | None:
        """The replica of ``uid`` as it was received, or None when none is held."""
        with self._lock:
            if uid not in self._held:
                return None
            return read_replica(self._path(uid))

    def open_replica(self, uid: str) -> tuple[dmoe_pb2.ReplicaHeader, BinaryIO] | None:
        """The header of the replica of ``uid`` and its file, positioned at the snapshot's first byte (the caller
        reads ``header.size`` bytes and closes it; what it reads stays that replica even if a newer one replaces it
        or it is evicted meanwhile); None when none is held. Raises OSError or ValueError for a damaged file."""
        with self._lock:
            if uid not in self._held:
                return None
            file = open(self._path(uid), "rb")
        try:
            head = file.read(len(MAGIC) + _LENGTH_BYTES)
            length = _header_length(head)
            header = dmoe_pb2.ReplicaHeader()
            header.ParseFromString(file.read(length))
            if header.uid != uid or os.fstat(file.fileno()).st_size != len(head) + length + header.size:
                raise ValueError(f"the file does not match its header ({header.uid}, {header.size} bytes)")
        except BaseException:
            file.close()
            raise
        return header, file

    def receive(self, header: dmoe_pb2.ReplicaHeader) -> "Incoming":
        """A temporary file for the replica ``header`` announces, to write its bytes into as they arrive (see
        :class:`Incoming`)."""
        return Incoming(self, header)

    def _commit(self, incoming: "Incoming", source: str | None,
                check: Callable[[HeldReplica | None], SnapshotRefused | None] | None = None) -> list[str]:
        header = incoming.header
        nbytes = os.stat(incoming.path).st_size
        if nbytes > self.budget_bytes:
            raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large",
                                  f"replica of {header.uid} has {nbytes} bytes, more than this server's replica "
                                  f"budget of {self.budget_bytes}")
        with self._lock:
            refused = check(self._held.get(header.uid)) if check is not None else None
            if refused is not None:  # (against what is held now: see Incoming.commit)
                raise refused
            arrived = HeldReplica(header, nbytes, time.time(), source)
            evicted = self._to_evict(header.uid, arrived)
            os.replace(incoming.path, self._path(header.uid))  # written and synced: evicting now costs nothing more
            _fsync_directory(self.directory)
            self._remove(evicted)
            self._held[header.uid] = arrived
        self._evicted(evicted, header.uid)
        return evicted

    def put(self, signed: SignedSnapshot, source: str | None = None,
            check: Callable[[HeldReplica | None], SnapshotRefused | None] | None = None) -> list[str]:
        """Writes ``signed`` (already checked) over whatever was held of its expert; returns the uids whose
        replicas were removed to make room (see the module doc: ``source`` is the machine that pushed it, None
        for a replica of this server's own). Raises SnapshotRefused when it alone exceeds the budget, or when
        ``check``, given what is held of its expert under the store's lock, says why it may not replace that."""
        header_bytes = signed.header.SerializeToString()
        data = b"".join((MAGIC, len(header_bytes).to_bytes(_LENGTH_BYTES, "big"), header_bytes, signed.body))
        if len(data) > self.budget_bytes:
            raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large",
                                  f"replica of {signed.uid} has {len(data)} bytes, more than this server's replica "
                                  f"budget of {self.budget_bytes}")
        with self._lock:
            refused = check(self._held.get(signed.uid)) if check is not None else None
            if refused is not None:
                raise refused
            incoming = HeldReplica(signed.header, len(data), time.time(), source)
            evicted = self._to_evict(signed.uid, incoming)
            # written first: a write that fails (a full disk) must not cost the replicas it would evict; the budget
            # is what bounds the directory, so the disk must have room for it
            write_atomically(self._path(signed.uid), data)
            self._remove(evicted)
            self._held[signed.uid] = incoming
        self._evicted(evicted, signed.uid)
        return evicted

    def _evicted(self, evicted: list[str], uid: str) -> None:
        self.evicted += len(evicted)
        if evicted:
            logger.info("replica budget full: removed %s, of the share of the budget holding the most, for %s",
                        ", ".join(evicted), uid)

    def _to_evict(self, uid: str, incoming: HeldReplica | None) -> list[str]:
        """The replicas that must go for ``incoming`` (of ``uid``, replacing what is held of it) to fit the
        budget, in the order :func:`_victim` picks them."""
        others = {other: held for other, held in self._held.items() if other != uid}
        nbytes = incoming.nbytes if incoming is not None else 0
        used = sum(held.nbytes for held in others.values())
        evicted = []
        while others and used + nbytes > self.budget_bytes:
            victim = _victim(others, incoming)
            used -= others.pop(victim).nbytes
            evicted.append(victim)
        return evicted

    def _remove(self, uids: list[str]) -> None:
        for uid in uids:
            if self._held.pop(uid, None) is not None:
                self._path(uid).unlink(missing_ok=True)

    def touch(self, uid: str) -> None:
        """Counts the replica as just received (the same one was pushed again): it is the last to be evicted."""
        with self._lock:
            held = self._held.get(uid)
            if held is not None:
                now = time.time()
                os.utime(self._path(uid), (now, now))
                self._held[uid] = replace(held, received_at=now)

    def remove(self, uid: str) -> None:
        with self._lock:
            if self._held.pop(uid, None) is not None:
                self._path(uid).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._held)


class Incoming:
    """A replica arriving (:meth:`ReplicaStore.receive`): the file it will be, under a temporary name in the store's
    directory. :meth:`write` its bytes as they come (hashed on the way: memory holds one message, not the replica),
    :meth:`check` them against the header, :meth:`finish` (synced to disk), :meth:`commit` to hold it (over the
    replica held of its expert, evicting what must go), or :meth:`discard` (also after a commit: then it does
    nothing)."""

    def __init__(self, store: ReplicaStore, header: dmoe_pb2.ReplicaHeader):
        self.store, self.header = store, header
        final = store._path(header.uid)
        self.path = final.with_name(f"{final.name}.{os.getpid()}.{secrets.token_hex(6)}{TMP_SUFFIX}")
        header_bytes = header.SerializeToString()
        self._start = len(MAGIC) + _LENGTH_BYTES + len(header_bytes)
        self._file: BinaryIO | None = open(self.path, "wb")
        self._sha = hashlib.sha256()
        self.received = 0
        try:
            self._file.write(b"".join((MAGIC, len(header_bytes).to_bytes(_LENGTH_BYTES, "big"), header_bytes)))
        except BaseException:
            self.discard()
            raise

    def write(self, data: bytes) -> None:
        assert self._file is not None, "finished or discarded"
        self._file.write(data)
        self._sha.update(data)
        self.received += len(data)

    def check(self) -> None:
        """Raises SnapshotRefused unless every byte the header announced arrived, and they match its SHA-256."""
        header = self.header
        if self.received != header.size:
            raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "truncated",
                                  f"the replica of {header.uid} is truncated: the stream ended after {self.received} "
                                  f"of {header.size} bytes")
        if self._sha.digest() != header.sha256:
            raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "digest",
                                  f"the bytes of the replica of {header.uid} do not match the SHA-256 of its header")

    def finish(self) -> None:
        """Every byte arrived: the file is synced to disk and closed (it is renamed as it is by :meth:`commit`)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def signed(self) -> SignedSnapshot:
        """The replica as received (read back from the file: the whole snapshot in memory)."""
        self.finish()
        with open(self.path, "rb") as file:
            file.seek(self._start)
            return SignedSnapshot(self.header, file.read())

    def commit(self, source: str | None = None,
               check: Callable[[HeldReplica | None], SnapshotRefused | None] | None = None) -> list[str]:
        """Holds the replica (``source``: the machine that pushed it); returns the uids evicted to make room.
        ``check`` is given the replica held of its expert at the moment it would be replaced, under the store's
        lock, and refuses the commit by returning why (raised): checked only when the push began, an older replica
        begun before a newer one and finished after it replaced it (review 78)."""
        self.finish()
        try:
            return self.store._commit(self, source, check)
        finally:
            self.discard()  # (renamed already, unless the commit failed)

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)


def share(held: HeldReplica) -> tuple[str, str]:
    """Whose share of the budget a replica counts in: the machine that pushed it, or where that is not known (this
    server's own replicas, and those received before a restart) its signer."""
    return ("machine", held.source) if held.source is not None else ("signer", held.signer.hex())


def _signer(held: HeldReplica) -> bytes:
    return held.signer


def _victim(held: dict[str, HeldReplica], incoming: HeldReplica | None) -> str:
    """The uid of the replica in ``held`` to evict first: of the share holding the most bytes (``incoming``, which
    is never evicted, counted in its own), of its signer holding the most, the replica received longest ago. Equal
    holdings: the one whose oldest replica is older gives way."""
    counted = [*held.values(), *([incoming] if incoming is not None else [])]
    candidates = dict(held)
    for level in (share, _signer):
        totals: Counter = Counter()
        for replica in counted:
            totals[level(replica)] += replica.nbytes
        oldest: dict = {}
        for replica in candidates.values():
            oldest[level(replica)] = min(oldest.get(level(replica), math.inf), replica.received_at)
        chosen = max(oldest, key=lambda key: (totals[key], -oldest[key]))
        candidates = {uid: replica for uid, replica in candidates.items() if level(replica) == chosen}
        counted = [replica for replica in counted if level(replica) == chosen]
    return min(candidates, key=lambda uid: candidates[uid].received_at)


def read_replica(path: str | os.PathLike) -> SignedSnapshot:
    """The replica in a file a store wrote (raises ValueError when it is not one)."""
    data = Path(path).read_bytes()
    header = _parse_header(data)
    return SignedSnapshot(header, data[len(MAGIC) + _LENGTH_BYTES + _header_length(data):])


def _header_length(data: bytes) -> int:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH_BYTES:
        raise ValueError("not a dmoe replica file")
    return int.from_bytes(data[len(MAGIC):len(MAGIC) + _LENGTH_BYTES], "big")


def _parse_header(data: bytes) -> dmoe_pb2.ReplicaHeader:
    start = len(MAGIC) + _LENGTH_BYTES
    length = _header_length(data)
    if len(data) < start + length:
        raise ValueError("replica file ends inside its header")
    header = dmoe_pb2.ReplicaHeader()
    header.ParseFromString(data[start:start + length])
    if len(data) != start + length + header.size:
        raise ValueError(f"replica file holds {len(data) - start - length} bytes of snapshot, its header says "
                         f"{header.size}")
    return header


def _read_header(path: Path) -> dmoe_pb2.ReplicaHeader:
    with open(path, "rb") as file:
        head = file.read(len(MAGIC) + _LENGTH_BYTES)
        length = _header_length(head)
        header = dmoe_pb2.ReplicaHeader()
        header.ParseFromString(file.read(length))
    if path.stat().st_size != len(head) + length + header.size:
        raise ValueError(f"the file's size does not match its header ({header.size} bytes of snapshot)")
    return header
