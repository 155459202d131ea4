"""The pushing end: snapshots of a server's experts go, every interval and on a clean stop, to the ``R`` servers
that receive replicas of their layer and whose ids are closest to each expert's key.

Hosts are read from the DHT (``{layer}/replica-hosts``, see :mod:`dmoe.replicas.records`): every server with a
replica directory announces itself there. Each expert's hosts are ranked by :func:`~dmoe.replicas.records.distance`,
so pushes of one expert land on the same few servers each time (their replica is replaced, not duplicated) and
different experts spread over different servers. Of an expert's replicas, each endpoint and each machine (its IPv4
address or IPv6 /64, or its hosts' shared machine token) holds at most one, however many keys announce it: keys
cost nothing to make (:class:`_Whereabouts`). A host that refuses or cannot be reached is skipped for the next
closest; a snapshot is pushed again only when the expert trained since, or after ``repush_every`` intervals
(a host may have restarted with an empty directory).

Anyone can announce hosts, closer to an expert's key than the honest ones, that take a push and never answer: a
push that makes no progress for :data:`STALL_TIMEOUT` (no message taken, or no answer once all were) is abandoned,
a host that failed is left out of the next 1, 2, 4, ... rounds (:data:`MAX_BACKOFF_ROUNDS` at most) and then tried
only after the hosts that did not fail, and a round ends by its deadline (the longer of the interval and the push
timeout; the last one, on a clean stop, within the push timeout of the stop): what a SIGKILL loses stays about one
interval.

Experts that no checkpoint of the server's saves and that it was not built with (adopted ones) have nothing else
on this server that keeps their training, so each round also keeps their snapshot, signed as pushed, in the
server's own replica store whenever they trained since: a restarted adopter finds its own training there, where it
held the old owner's replica before, and adopts it again from that (even when it had no other host to push it to).
That includes a standby's own cell adopted back after it was dropped, when the standby has no checkpoint: the uid
was one it was built with, and its training since the adoption was lost even on a clean stop (review 78).

The fetching end (adoption's) is here too: :func:`fetch_snapshot` gives up on a holder that sends no header
within :data:`HEADER_TIMEOUT` or no later message within :data:`STALL_TIMEOUT`, not only at its whole timeout, and
:func:`fetch_headers` asks every holder of a record for its replica's header at once, so that endpoints that never
answer (anyone may announce any) cost one timeout in all. No replica channel takes a message larger than a chunk of
bytes and a header (:data:`~dmoe.replicas.snapshots.MESSAGE_BYTES`), and no header probe one larger than a header
(:data:`PROBE_MESSAGE_BYTES`).
"""
from __future__ import annotations

import ipaddress
import logging
import math
import threading
import time
import weakref
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, Iterator, Sequence

import grpc

from dmoe.dht import DHT, Identity
from dmoe.endpoints import is_host_port, join_host_port
from dmoe.replicas.metrics import ReplicaMetrics
from dmoe.replicas.records import (SIGNER_HEX, Host, counted_machine, distance, endpoint_host, hosts_key, own_subkey,
                                   parse_host, resolve_host)
from dmoe.replicas.snapshots import (
    CHUNK_BYTES,
    MESSAGE_BYTES,
    SignedSnapshot,
    SnapshotRefused,
    check_body,
    check_header,
    max_snapshot_bytes,
    sign,
    take,
)
from dmoe.replicas.service import LINEAGE_SECONDS
from dmoe.replicas.store import HeldReplica, ReplicaStore
from dmoe.uid import split_uid
from dmoe.wire import NONE, ChannelPool, dmoe_pb2, dmoe_pb2_grpc

if TYPE_CHECKING:
    from dmoe.server import ExpertServer

logger = logging.getLogger(__name__)

#: seconds from the start of the pusher to its first round
FIRST_ROUND_AFTER = 1.0
#: seconds a push may go without progress, separate from its whole transfer's timeout: the host taking none of its
#: messages (not connected, not reading), or not answering once it has them all (plus ANSWER_SECONDS_PER_MIB: it
#: checks and writes them first). A host that takes a push and never answers costs this long, not the timeout
STALL_TIMEOUT = 10.0
ANSWER_SECONDS_PER_MIB = 0.05
#: a host that failed a push (unreachable, stalled, timed out) is left out of the next 1, 2, 4, ... rounds, and one
#: that refused an expert's snapshot is for that expert; afterwards it is tried after the hosts that did not fail
#: (so only when they are too few), until a push to it succeeds again
MAX_BACKOFF_ROUNDS = 32
#: seconds within which a fetch or a header probe of adoption's is cancelled once the server stops
STOP_POLL = 0.1
#: seconds to ask a host for the header of the replica it was pushed last (does it still hold it?)
PROBE_TIMEOUT = 2.0
#: seconds a fetch waits for the replica's header, its first message (a holder sends it at once, from its disk)
HEADER_TIMEOUT = 5.0
#: the largest message a header probe takes: a holder sends the header alone first (uid, counts, hashes, signature: a
#: few hundred bytes). gRPC reads a whole message before anyone can look at it: with its 64 MiB limit each probe held
#: ~75 MiB, and one machine announcing many ports OOM-killed an adopting or starting server (review 105 D1)
PROBE_MESSAGE_BYTES = 16 << 10
#: replica headers asked for at once (:func:`fetch_headers`): a record holds at most 256 entries, the DHT's
#: ``max_record_subkeys``, so all of them, within one ``timeout``. Asked 32 at a time, 255 throwaway entries at
#: addresses that never answer cost 8 timeouts (24 s) per uid, per look, one uid after another (review 114 D1)
PROBES_AT_ONCE = 256
#: seconds a push needs at least: a round's deadline closer than this starts no more pushes
MIN_PUSH_SECONDS = 0.5
#: the status codes of a push that did not reach a working replica service (the host's fault, for every expert)
HOST_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                           grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED})
#: seconds a host name's address is remembered once resolved (:class:`_Whereabouts`), and once it did not resolve
NAME_TTL, UNRESOLVED_TTL = 300.0, 60.0
#: seconds a push round waits for its host names to resolve, all looked up at once at its start (within its
#: deadline): a name that takes longer (anyone may announce one whose DNS never answers) counts as unresolved, and
#: its host is skipped, until it resolves. Each name used to be waited for in turn as its host came up, before the
#: round's deadline or a stop was looked at: 30 such names held a round, and a clean stop, for a minute (review
#: 105 D3)
RESOLVE_TIMEOUT = 2.0
#: host names looked up at once, and at most queued for a look-up: a look-up whose DNS never answers holds a thread
#: until the system resolver gives up; the names beyond these wait for a later round
RESOLVERS, MAX_PENDING_NAMES = 8, 64
#: seconds :meth:`ReplicaPusher.close` waits for a round under way to end (its pushes are abandoned at once, a host
#: probe or a DHT read may take a few seconds more) before it makes the last push anyway (review 105 D3)
CLOSE_TIMEOUT = 5.0


class ReplicaError(RuntimeError):
    """A push or fetch that failed: the other server's status code and message."""

    def __init__(self, endpoint: str, code: grpc.StatusCode, message: str):
        super().__init__(f"replica service at {endpoint}: {code.name}: {message}")
        self.endpoint, self.code, self.message = endpoint, code, message


class ReplicaChannels:
    """One gRPC channel per endpoint to other servers' ``ReplicaService``, those nobody used for ``idle_seconds``
    let go (a :class:`~dmoe.wire.ChannelPool`'s); ``close()`` closes them all. Each channel used to be kept until
    the server stopped, and hosts and holders come and go, or are announced afresh at new endpoints every round by
    anyone: every endpoint ever asked held a connection for good (review 59)."""

    def __init__(self, idle_seconds: float = 600.0) -> None:
        # no message larger than a replica stream's (review 105 D1): gRPC reads a whole message before anyone can
        # look at it, and a header probe's first message was read up to 64 MiB
        self.pool = ChannelPool(max_message_bytes=MESSAGE_BYTES, shared_memory=False, hold_calls=False,
                                idle_seconds=idle_seconds)
        # header probes take nothing larger than a header, so that asking every holder at once costs little
        self.probes = ChannelPool(max_message_bytes=PROBE_MESSAGE_BYTES, shared_memory=False, hold_calls=False,
                                  idle_seconds=idle_seconds)

    def stub(self, endpoint: str) -> dmoe_pb2_grpc.ReplicaServiceStub:
        return dmoe_pb2_grpc.ReplicaServiceStub(self.pool.channel(endpoint))

    def probe_stub(self, endpoint: str) -> dmoe_pb2_grpc.ReplicaServiceStub:
        """A stub for header probes (:func:`fetch_header`, :func:`fetch_headers`): no message over
        :data:`PROBE_MESSAGE_BYTES`."""
        return dmoe_pb2_grpc.ReplicaServiceStub(self.probes.channel(endpoint))

    def close(self) -> None:
        self.pool.close()
        self.probes.close()


class _Progress:
    """The messages of a push, noting when the host last took one: gRPC asks for the next once the last is out."""

    def __init__(self, chunks: Iterator[dmoe_pb2.ReplicaChunk]):
        self._chunks, self.last, self.done = chunks, time.monotonic(), False

    def __iter__(self) -> "_Progress":
        return self

    def __next__(self) -> dmoe_pb2.ReplicaChunk:
        self.last = time.monotonic()
        try:
            return next(self._chunks)
        except StopIteration:
            self.done = True
            raise


def push_snapshot(stub: dmoe_pb2_grpc.ReplicaServiceStub, endpoint: str, signed: SignedSnapshot, *,
                  chunk_bytes: int = CHUNK_BYTES, timeout: float | None = 60.0,
                  stall_timeout: float | None = None, abandon: threading.Event | None = None) -> int:
    """Streams ``signed`` to the server at ``endpoint``; returns the update count it holds of that expert now.
    Raises :class:`ReplicaError` with the receiver's status when it refuses or cannot be reached.

    ``timeout`` bounds the whole push; ``stall_timeout`` (None: no bound) the time the host may take no message,
    or give no answer once it has them all (plus :data:`ANSWER_SECONDS_PER_MIB` per MiB), before the push is
    cancelled as DEADLINE_EXCEEDED; ``abandon`` set cancels it as CANCELLED."""
    if stall_timeout is None and abandon is None:
        try:
            return stub.push(signed.chunks(chunk_bytes), timeout=timeout).updates
        except grpc.RpcError as error:
            raise ReplicaError(endpoint, error.code(), error.details() or "") from None
    progress = _Progress(signed.chunks(chunk_bytes))
    call = stub.push.future(progress, timeout=timeout)
    if stall_timeout is None:
        stall_timeout = float("inf")
    answer_within = stall_timeout + ANSWER_SECONDS_PER_MIB * len(signed.body) / 2**20
    try:
        while True:
            try:
                return call.result(timeout=min(0.25, stall_timeout)).updates
            except grpc.FutureTimeoutError:
                if abandon is not None and abandon.is_set():
                    call.cancel()
                    raise ReplicaError(endpoint, grpc.StatusCode.CANCELLED, "push abandoned") from None
                waited = time.monotonic() - progress.last
                if waited > (answer_within if progress.done else stall_timeout):
                    call.cancel()
                    what = "no answer after the whole snapshot" if progress.done else "no progress"
                    raise ReplicaError(endpoint, grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"{what} for {waited:.1f} s: push abandoned") from None
    except grpc.RpcError as error:
        raise ReplicaError(endpoint, error.code(), error.details() or "") from None


class _Watchdog:
    """Cancels a gRPC call whose deadline passed (:meth:`arm` sets it, again after each message): a holder that
    sends nothing costs a fetch that long, not its whole timeout; and, within :data:`STOP_POLL` seconds, one whose
    ``stop`` is set (the server stopping: a holder that trickles its bytes kept a clean stop waiting up to the
    fetch's whole timeout, and a supervisor's SIGKILL then lost the server's last push, review 88). One thread,
    until the ``with`` block ends."""

    def __init__(self, call: grpc.Call, stop: threading.Event | None = None):
        self._call, self._deadline, self._why = call, math.inf, ""
        self._stop = stop
        self.fired: str | None = None  # why it cancelled the call
        self.stopped = False  # it cancelled the call because ``stop`` was set
        self._done = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dmoe-replica-fetch-watchdog", daemon=True)

    def __enter__(self) -> "_Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        with self._changed:
            self._done = True
            self._changed.notify()
        self._thread.join()

    def arm(self, seconds: float, why: str) -> None:
        """Cancels the call in ``seconds`` unless armed again before (``why``: what the holder failed to do)."""
        with self._changed:
            self._deadline, self._why = time.monotonic() + seconds, why
            self._changed.notify()

    def _run(self) -> None:
        with self._changed:
            while not self._done:
                if self._stop is not None and self._stop.is_set():
                    self.fired, self.stopped = "stopping", True
                    self._call.cancel()
                    return
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self.fired = self._why
                    self._call.cancel()
                    return
                if self._stop is not None:  # (an Event cannot wake a Condition: looked at every STOP_POLL s)
                    left = min(left, STOP_POLL)
                self._changed.wait(None if left == math.inf else left)


def fetch_snapshot(stub: dmoe_pb2_grpc.ReplicaServiceStub, endpoint: str, uid: str, *, max_bytes: int,
                   timeout: float | None = 60.0, signers: Collection[str] | None = None,
                   newer_than: int | None = None, header_timeout: float = HEADER_TIMEOUT,
                   stall_timeout: float = STALL_TIMEOUT, stop: threading.Event | None = None) -> SignedSnapshot:
    """The replica of ``uid`` the server at ``endpoint`` holds, with its signature and bytes verified (its state is
    the caller's to check). Raises :class:`ReplicaError` (NOT_FOUND: none held) or :class:`SnapshotRefused`.

    The header comes first, and the stream is cancelled as soon as it fails: its size beyond ``max_bytes``, its
    signer (the first :data:`~dmoe.replicas.records.SIGNER_HEX` hex digits of its key) not among ``signers``
    (None: any), or its update count not above ``newer_than`` (None: any); the rest of the bytes never come.
    ``timeout`` bounds the whole transfer, ``header_timeout`` the wait for the header and ``stall_timeout`` the
    wait for each later message (DEADLINE_EXCEEDED): a holder that takes the call and sends nothing, which any
    key may announce, used to cost the whole timeout. ``stop`` set (the server stopping) cancels the fetch within
    :data:`STOP_POLL` seconds, as CANCELLED, or before it starts."""
    if stop is not None and stop.is_set():
        raise ReplicaError(endpoint, grpc.StatusCode.CANCELLED, f"stopping: fetch of {uid} not started")
    header, pieces, total = None, [], 0
    call = stub.fetch(dmoe_pb2.ReplicaQuery(uid=uid), timeout=timeout)
    with _Watchdog(call, stop) as watchdog:
        watchdog.arm(header_timeout, f"sent no header within {header_timeout:g} s")
        try:
            for chunk in call:
                watchdog.arm(stall_timeout, f"sent nothing for {stall_timeout:g} s")
                if header is None:
                    if not chunk.HasField("header") or chunk.header.uid != uid:
                        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                              f"{endpoint} answered a fetch of {uid} without its header")
                    header = chunk.header
                    check_header(header, max_bytes)
                    check_wanted(header, endpoint, signers, newer_than)
                elif chunk.HasField("header"):
                    raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                          f"{endpoint} sent a second header in its replica of {uid}")
                total += len(chunk.data)
                if total > header.size:
                    raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                          f"{endpoint} sent more bytes of {uid} than its header says")
                pieces.append(chunk.data)
        except grpc.RpcError as error:
            if watchdog.stopped:
                raise ReplicaError(endpoint, grpc.StatusCode.CANCELLED, f"stopping: fetch of {uid} given up") from None
            if watchdog.fired is not None:
                raise ReplicaError(endpoint, grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"{watchdog.fired}: fetch of {uid} given up") from None
            raise ReplicaError(endpoint, error.code(), error.details() or "") from None
        finally:
            call.cancel()  # (a no-op once the stream ended; otherwise the holder stops sending)
    if header is None:
        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"{endpoint} sent nothing for {uid}")
    signed = SignedSnapshot(header, b"".join(pieces))
    check_body(signed)  # (parsed by the caller, who knows how many tensors a snapshot may have)
    return signed


def check_wanted(header: dmoe_pb2.ReplicaHeader, endpoint: str, signers: Collection[str] | None,
                 newer_than: int | None) -> None:
    """Raises SnapshotRefused unless ``header`` is signed by one of ``signers`` (None: any) and counts more updates
    than ``newer_than`` (None: any): what a fetch's header must show before any more of it is read."""
    signer = header.signer.hex()[:SIGNER_HEX]
    if signers is not None and signer not in signers:
        raise SnapshotRefused(grpc.StatusCode.PERMISSION_DENIED, "not_owner",
                              f"{endpoint} holds a replica of {header.uid} signed by {signer}, not "
                              f"{' or '.join(sorted(signers))}")
    if newer_than is not None and header.updates <= newer_than:
        raise SnapshotRefused(grpc.StatusCode.FAILED_PRECONDITION, "older",
                              f"{endpoint} holds a replica of {header.uid} with {header.updates} updates, no more "
                              f"than the {newer_than} of one found already")


def fetch_header(stub: dmoe_pb2_grpc.ReplicaServiceStub, endpoint: str, uid: str, *, max_bytes: int,
                 timeout: float | None = HEADER_TIMEOUT) -> dmoe_pb2.ReplicaHeader:
    """The header of the replica of ``uid`` the server at ``endpoint`` holds, its signature verified; the stream is
    cancelled after its first message, so the rest of the bytes never come. Raises :class:`ReplicaError`
    (NOT_FOUND: none held) or :class:`SnapshotRefused`."""
    call = stub.fetch(dmoe_pb2.ReplicaQuery(uid=uid), timeout=timeout)
    try:
        return _first_header(call, endpoint, uid, max_bytes)
    finally:
        call.cancel()


def fetch_headers(channels: ReplicaChannels, uid: str, endpoints: Collection[str], *, max_bytes: int,
                  timeout: float = HEADER_TIMEOUT,
                  stop: threading.Event | None = None) -> dict[str, dmoe_pb2.ReplicaHeader | Exception]:
    """endpoint -> the header of the replica of ``uid`` it holds (:func:`fetch_header`), or why there is none
    (:class:`ReplicaError`, :class:`SnapshotRefused`). All are asked at once (a record's 256 entries at most,
    :data:`PROBES_AT_ONCE`), so endpoints that never answer (any key may announce any) cost ``timeout`` in all, not
    each its own; each probe takes no message over :data:`PROBE_MESSAGE_BYTES` (review 105 D1: up to 64 MiB each made
    a server hold gigabytes). (A thread each: a call's message is only received while someone waits for it, so one
    thread reading the calls in turn lost the headers that came meanwhile.)
    ``stop`` set (the server stopping) cancels the calls still open within :data:`STOP_POLL` seconds (their
    answers: CANCELLED), rather than the stop waiting ``timeout`` for endpoints that never answer (review 88)."""
    endpoints = list(endpoints)
    if not endpoints:
        return {}
    calls: list[grpc.Call] = []
    calls_lock = threading.Lock()

    def ask(endpoint: str) -> dmoe_pb2.ReplicaHeader | Exception:
        try:
            if stop is not None and stop.is_set():
                raise ReplicaError(endpoint, grpc.StatusCode.CANCELLED, f"stopping: header of {uid} not asked for")
            call = channels.probe_stub(endpoint).fetch(dmoe_pb2.ReplicaQuery(uid=uid), timeout=timeout)
            with calls_lock:
                calls.append(call)
            if stop is not None and stop.is_set():  # (set after the look above: the calls noted may be cancelled)
                call.cancel()
            try:
                return _first_header(call, endpoint, uid, max_bytes)
            finally:
                call.cancel()  # (after the header: the rest of the bytes never come)
        except (ReplicaError, SnapshotRefused, ValueError) as error:
            return error

    with ThreadPoolExecutor(min(len(endpoints), PROBES_AT_ONCE), thread_name_prefix="dmoe-replica-probe") as pool:
        asked = [pool.submit(ask, endpoint) for endpoint in endpoints]
        if stop is not None:
            while wait(asked, timeout=STOP_POLL).not_done:
                if stop.is_set():
                    with calls_lock:
                        for call in calls:
                            call.cancel()
                    break
        return dict(zip(endpoints, (answer.result() for answer in asked)))


def _first_header(call, endpoint: str, uid: str, max_bytes: int) -> dmoe_pb2.ReplicaHeader:
    try:
        first = next(call, None)
    except grpc.RpcError as error:
        raise ReplicaError(endpoint, error.code(), error.details() or "") from None
    header = None
    if first is not None and first.HasField("header"):
        header = dmoe_pb2.ReplicaHeader()
        header.CopyFrom(first.header)  # (a part of a message keeps all of it alive, its bytes too)
    # nor does a refusal keep it: its traceback holds this frame for as long as the caller keeps the answer, and
    # all the probes' answers are kept together (review 105 D1)
    del first
    if header is None or header.uid != uid:
        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                              f"{endpoint} answered a fetch of {uid} without its header")
    check_header(header, max_bytes)
    return header


@dataclass
class _Pushed:
    updates: int
    at: float


@dataclass
class _Failing:
    failures: int    # in a row
    until: int       # the first round it may be tried again in


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class _Whereabouts:
    """Where a host's endpoint is, as a round counts an expert's replicas (:meth:`of`): each *place* (the endpoint's
    address and port) holds at most one, however many keys announce it or however its host is written, and so does
    each *machine*, its IPv4 address or IPv6 /64 (:func:`~dmoe.endpoints.machine_of`, as the DHT and the adopters'
    votes count machines): keys cost nothing to make, machines do, and a machine leaving takes all its endpoints
    with it (review 88: one endpoint announced under the keys closest to an expert's took all its R replicas).

    A loopback endpoint reaches only this machine's processes, never the announcer's if that is elsewhere. Where
    this server's DHT peers are all on this machine (``local``: a local swarm, as in the demo and every test, all
    of whose servers announce 127.0.0.1), each loopback endpoint is a machine of its own, as the DHT counts its
    contacts there (:func:`~dmoe.dht.routing.contact_machine`); otherwise loopback is one machine, this one.

    A host name is resolved, each at most once per :data:`NAME_TTL` (:data:`UNRESOLVED_TTL` when it pointed
    nowhere), waiting at most :data:`RESOLVE_TIMEOUT`: one that does not resolve (in time) has no place.
    :meth:`resolve` looks up many names at once, under one bound, and :meth:`of` then waits for none."""

    def __init__(self) -> None:
        self._names: dict[str, tuple[Address | None, float]] = {}  # name -> (its address, monotonic expiry)
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._resolver = ThreadPoolExecutor(RESOLVERS, thread_name_prefix="dmoe-replica-resolve")

    def of(self, endpoint: str, local: bool = True, wait: float = RESOLVE_TIMEOUT) -> tuple[str, str] | None:
        """(place, machine) of ``endpoint``; None when its host names no address (a name resolving to none, or
        not within ``wait`` seconds)."""
        port = endpoint.rpartition(":")[2]
        address = self._address(endpoint_host(endpoint), wait)
        if address is None:
            return None
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        place = join_host_port(str(address), int(port) if port.isdigit() else port)
        return place, counted_machine(address, place, local)

    def resolve(self, endpoints: Collection[str], until: float, stop: threading.Event | None = None) -> None:
        """Looks up the host names of ``endpoints`` not known yet, all at once, and waits for them until ``until``
        (a ``time.monotonic()`` time) or ``stop`` is set, whichever comes first: names whose DNS never answers cost
        a round this long in all, not each :data:`RESOLVE_TIMEOUT` (review 105 D3)."""
        pending: dict[str, Future] = {}
        for endpoint in endpoints:
            name = endpoint_host(endpoint).lower()
            if name not in pending and not _is_address(name):
                found = self._lookup_of(name)
                if isinstance(found, Future):
                    pending[name] = found
        waiting = set(pending.values())
        while waiting:
            left = until - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                break
            waiting = wait(waiting, timeout=min(left, STOP_POLL)).not_done
        for name, future in pending.items():
            if not future.done():
                self._unresolved(name)

    def _address(self, host: str, wait: float) -> Address | None:
        try:
            return ipaddress.ip_address(host)
        except ValueError:
            pass
        name = host.lower()
        found = self._lookup_of(name)
        if not isinstance(found, Future):
            return found
        try:
            return found.result(timeout=wait)
        except (FutureTimeout, CancelledError):
            self._unresolved(name)
            return None

    def _lookup_of(self, name: str) -> Address | None | Future:
        """The address of ``name`` when known, else its look-up (started now if none is under way); None when it is
        neither (too many look-ups under way, or this is closed)."""
        now = time.monotonic()
        with self._lock:
            known = self._names.get(name)
            if known is not None and known[1] > now:
                return known[0]
            pending = self._pending.get(name)
            if pending is None:
                if len(self._pending) >= MAX_PENDING_NAMES:  # (look-ups that hang pile up: names are anyone's)
                    return None
                if len(self._names) >= 4096:  # (names are anyone's to announce: the expired ones go)
                    self._names = {key: value for key, value in self._names.items() if value[1] > now}
                try:
                    pending = self._pending[name] = self._resolver.submit(self._lookup, name)
                except RuntimeError:  # (closed)
                    return None
            return pending

    def _unresolved(self, name: str) -> None:
        """Notes a name that did not resolve in time (its look-up, when it ends, notes what it found)."""
        now = time.monotonic()
        with self._lock:
            known = self._names.get(name)
            if known is None or known[1] <= now:
                self._names[name] = (None, now + UNRESOLVED_TTL)

    def _lookup(self, name: str) -> Address | None:
        address = resolve_host(name)
        with self._lock:
            self._names[name] = (address, time.monotonic() + (NAME_TTL if address is not None else UNRESOLVED_TTL))
            self._pending.pop(name, None)
        return address

    def close(self) -> None:
        self._resolver.shutdown(wait=False, cancel_futures=True)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class ReplicaPusher:
    """Pushes snapshots of ``server``'s experts to ``replicas`` hosts each, every ``interval`` seconds, from a
    thread it owns; :meth:`close` stops it and (by default) pushes once more.

    Args:
        server: whose experts (its ``backends``, snapshotted under its runtime's pause).
        dht: reads the hosts; ``identity`` (the owner of the experts' declarations) signs the snapshots.
        replicas: hosts per expert (R).
        interval: seconds between rounds.
        compression: wire compression of the snapshots' weights (``dmoe.wire.NONE``: exact; the optimizer's state
            always goes exact, see :data:`~dmoe.replicas.snapshots.COMPRESSED_PARTS`).
        repush_every: an unchanged snapshot goes again after this many intervals.
        timeout: seconds one push may take in all, and the last round (on a clean stop) too; a periodic round
            takes at most the longer of this and ``interval``.
        stall_timeout: seconds a push may make no progress (see :func:`push_snapshot`); a host that failed is left
            out of the next rounds (see :data:`MAX_BACKOFF_ROUNDS`).
        workers: experts pushed at once.
        machine: this server's machine token (see :class:`~dmoe.replicas.ReplicaConfig`): no replica goes to a host
            of the same machine, and at most one replica of an expert to each machine, whether hosts tell it by
            their token or by their endpoint's address (see :class:`_Whereabouts`).
        store: the server's own replica store, where the experts that ``server`` serves with another backend than
            the one it was built with (adopted), and that its checkpoint does not save, are kept too (see the module
            doc); None: nowhere.
    """

    def __init__(self, server: "ExpertServer", dht: DHT, identity: Identity, *, replicas: int = 2,
                 interval: float = 60.0, compression: int = 0, metrics: ReplicaMetrics | None = None,
                 channels: ReplicaChannels | None = None, chunk_bytes: int = CHUNK_BYTES, repush_every: int = 5,
                 timeout: float = 60.0, stall_timeout: float = STALL_TIMEOUT, workers: int = 4,
                 machine: str | None = None, store: ReplicaStore | None = None):
        if replicas < 0 or interval <= 0:
            raise ValueError(f"replicas must be >= 0 and interval positive, got {replicas} and {interval}")
        if not 0 < chunk_bytes <= CHUNK_BYTES:  # (holders take no larger message: review 105 D1)
            raise ValueError(f"chunk_bytes must be in 1..{CHUNK_BYTES}, got {chunk_bytes}")
        self.server, self.dht, self.identity = server, dht, identity
        self.replicas, self.interval, self.compression = replicas, interval, compression
        self.metrics, self.chunk_bytes, self.repush_every, self.timeout = metrics, chunk_bytes, repush_every, timeout
        self.stall_timeout = stall_timeout
        self.channels = channels or ReplicaChannels()
        self.machine, self.store = machine, store
        # the backends the server was built with (weakly: a standby's dropped copies must be freed); of those, a
        # server restarted with the same flags finds the training again, in its checkpoint or its replicas' holders
        self._built = {uid: weakref.ref(backend) for uid, backend in server.backends.items()}
        self._unkept: dict[str, int] = {}  # uid -> the updates of an adopted expert whose snapshot the store refused
        self.rounds = 0
        self._pushed: dict[tuple[str, str], _Pushed] = {}  # (uid, host endpoint) -> what it got last
        # host endpoint (failed: every expert) or (uid, endpoint) (refused that expert) -> its failures in a row
        self._failing: dict[str | tuple[str, str], _Failing] = {}
        self._failing_lock = threading.Lock()
        self._placed_at: dict[str, float] = {}  # uid -> when a round last placed it (the longest ago go first)
        self._where = _Whereabouts()  # where hosts' endpoints are: one replica of an expert per place and machine
        self._stop = threading.Event()
        self._round_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # experts are pushed side by side: a busy server's round (and so each snapshot's way to its hosts) stays
        # short, and one slow host does not hold up the others' experts
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="dmoe-replica-push")

    def hosts(self, layers: Sequence[str]) -> dict[str, list[Host]]:
        """layer -> every other server announcing it receives the layer's replicas, but those of this machine, and
        those announced at no ``HOST:PORT`` (a ``unix:/...`` target is a socket of this machine: review 99 D3)."""
        records = self.dht.get_many([hosts_key(layer) for layer in layers])
        found: dict[str, list[Host]] = {}
        for layer in layers:
            hosts = [Host(entry.owner, *parse_host(entry.value)) for subkey, entry in records[hosts_key(layer)].items()
                     if own_subkey(subkey, entry.owner)]
            hosts = [host for host in hosts if is_host_port(host.endpoint)]
            found[layer] = [host for host in hosts if host.key != self.identity.public_key
                            and (host.machine is None or host.machine != self.machine)]
        return found

    def push_all(self, *, force: bool = False, deadline: float | None = None, interruptible: bool = False,
                 last: bool = False) -> dict[str, list[str]]:
        """One round: every expert that trained since its last push (all with ``force``) goes to its R closest
        hosts that take it, and an adopted one into this server's own store; returns uid -> the endpoints that hold
        it now. No push starts after ``deadline`` (a ``time.monotonic()`` time; None: none), and none runs past
        it; the experts placed longest ago go first. ``interruptible``: :meth:`close` abandons the round's pushes;
        ``last`` (the round of a clean stop): no host that failed lately is tried. A round still under way (its
        thread not stopped in time, see :meth:`close`) holds this one back until ``deadline`` at most."""
        if deadline is None:
            deadline = float("inf")
        wait_for = -1 if deadline == float("inf") else max(0.0, deadline - time.monotonic())
        if not self._round_lock.acquire(timeout=wait_for):
            logger.warning("a round of replica pushes was still under way at the next one's deadline: none made")
            return {}
        try:
            return self._round(force, deadline, interruptible, last)
        finally:
            self._round_lock.release()

    def _round(self, force: bool, deadline: float, interruptible: bool, last: bool) -> dict[str, list[str]]:
        backends = dict(self.server.backends)
        if not backends:
            return {}
        try:
            hosts = self.hosts(sorted({split_uid(uid)[0] for uid in backends})) if self.replicas else {}
        except Exception as error:  # noqa: BLE001 - a DHT hiccup: the next round tries again
            logger.warning("could not read the replica hosts from the DHT: %s", error)
            hosts = {}  # adopted experts are still kept here
        else:
            announced = {host.endpoint for found in hosts.values() for host in found}
            self._forget_failures(announced)
            # and what hosts that announce themselves no more were pushed: anyone may announce new endpoints
            # every round, and each one pushed to was remembered for good
            self._pushed = {key: pushed for key, pushed in self._pushed.items()
                            if key[1] in announced and key[0] in backends}
        # every host name of the round (and this server's own) looked up at once, under one bound (review 105 D3)
        own = self._own_endpoints()
        self._where.resolve([host.endpoint for found in hosts.values() for host in found] + own,
                            until=min(deadline, time.monotonic() + RESOLVE_TIMEOUT),
                            stop=self._stop if interruptible else None)
        mine = self._places_of(own)
        order = sorted(backends, key=lambda uid: self._placed_at.get(uid, float("-inf")))
        pushes = {uid: self._pool.submit(self._push_one, uid, backends[uid], hosts.get(split_uid(uid)[0], []),
                                         force, deadline, interruptible, last, mine)
                  for uid in order}
        placed = {uid: push.result() for uid, push in pushes.items()}
        self.rounds += 1
        return placed

    def _own_endpoints(self) -> list[str]:
        """Where this server is reached: its own endpoint and the one it announces (none before it started)."""
        endpoints = []
        try:
            endpoints.append(self.server.endpoint)
        except (AttributeError, RuntimeError):  # (not started: no port yet)
            pass
        announcer = getattr(self.server, "announcer", None)
        if announcer is not None and getattr(announcer, "endpoint", None):
            endpoints.append(announcer.endpoint)
        return endpoints

    def _places_of(self, own: list[str]) -> tuple[set[str], set[str]]:
        """The places and machines (see :class:`_Whereabouts`) of this server's ``own`` endpoints, and of this
        machine: each expert's replicas count them as taken before any host (review 105 D2). Anyone may announce
        this server's own endpoint as a host, under a key closer to an expert's than the honest hosts': the
        server pushed its replicas to itself, where they die with it (its own service now refuses them too)."""
        local = self._local()
        places, machines = set(), set()
        for endpoint in own:
            where = self._where.of(endpoint, local, wait=0)
            if where is not None:
                places.add(where[0])
                machines.add(where[1])
        if not local:  # (a loopback endpoint is this machine then)
            machines.add(counted_machine(ipaddress.IPv4Address("127.0.0.1"), "127.0.0.1:0", local))
        return places, machines

    def _local(self) -> bool:
        """Whether every DHT peer of this server is on this machine (a local swarm: see :class:`_Whereabouts`)."""
        return getattr(self.dht, "outbound_host", None) is None

    def _push_one(self, uid: str, backend, hosts: list[Host], force: bool, deadline: float,
                  interruptible: bool, last: bool, mine: tuple[set[str], set[str]]) -> list[str]:
        now = time.monotonic()
        # closest first; hosts that failed lately left out, those that failed before tried after the others
        leave_out = self._failed_before if last else self._backing_off
        ranked = sorted((host for host in hosts if not leave_out(uid, host.endpoint)),
                        key=lambda host: (self._failed_before(uid, host.endpoint), distance(uid, host.key)))
        signed = self._keep(uid, backend) if not self._saved_otherwise(uid, backend) else None
        placed: list[str] = []
        # of the hosts placed, their places, machines (see _Whereabouts) and machine tokens: at most one replica
        # in each, since a machine may leave whole, and keys (so host entries) cost nothing to make
        # (this server's own places and machine count as taken: review 105 D2)
        places: set[str] = set(mine[0])
        machines: set[str] = set(mine[1])
        tokens: set[str] = {self.machine} if self.machine is not None else set()

        def place_on(endpoint: str, place: str, machine: str, token: str | None) -> None:
            placed.append(endpoint)
            places.add(place)
            machines.add(machine)
            if token is not None:
                tokens.add(token)

        local = self._local()
        for _, endpoint, token in ranked:
            if len(placed) == self.replicas:
                break
            if time.monotonic() >= deadline or (interruptible and self._stop.is_set()):
                logger.info("the round's time is up: %s placed on %d of %d hosts", uid, len(placed), self.replicas)
                break
            if token is not None and token in tokens:
                continue
            where = self._where.of(endpoint, local, wait=0)  # (looked up at the round's start: see _round)
            if where is None:
                logger.debug("%s not pushed to %s: its host resolves to no address (in time)", uid, endpoint)
                continue
            place, machine = where
            if place in places or machine in machines:
                continue
            held = self._pushed.get((uid, endpoint))
            if not force and held is not None and held.updates == backend.updates \
                    and now - held.at < self.repush_every * self.interval:
                if self._still_holds(uid, endpoint, held, backend):
                    place_on(endpoint, place, machine, token)  # it holds this state already
                    continue
                self._pushed.pop((uid, endpoint), None)
            remaining = deadline - time.monotonic()
            if remaining < MIN_PUSH_SECONDS or (interruptible and self._stop.is_set()):
                logger.info("the round's time is up: %s not pushed to %s", uid, endpoint)
                break
            if signed is None:
                signed = sign(take(backend, self.server.runtime.paused, self.compression), self.identity)
            try:
                push_snapshot(self.channels.stub(endpoint), endpoint, signed, chunk_bytes=self.chunk_bytes,
                              timeout=min(self.timeout, remaining), stall_timeout=self.stall_timeout,
                              abandon=self._stop if interruptible else None)
            except ReplicaError as error:
                if interruptible and self._stop.is_set():
                    break  # (not the host's fault: the last round pushes this expert's state anyway)
                if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy with other pushes: not a failure
                    self._count("refused")
                    logger.info("pushing %s to %s: %s (tried again next round)", uid, endpoint, error)
                    if held is not None:  # it holds this expert's last push: its place (and machine) stays taken,
                        # or the next host, a process beside it on its machine, got a second replica there
                        place_on(endpoint, place, machine, token)
                    continue
                failed = error.code in HOST_FAILURES
                self._count("failed" if failed else "refused")
                skipped = self._failed(endpoint if failed else (uid, endpoint))
                log = logger.debug if error.code == grpc.StatusCode.FAILED_PRECONDITION else logger.info
                log("pushing %s to %s: %s (left out of the next %d rounds%s)", uid, endpoint, error, skipped,
                    "" if failed else " for this expert")
                self._pushed.pop((uid, endpoint), None)
                continue
            self._count("ok")
            self._succeeded(uid, endpoint)
            self._pushed[(uid, endpoint)] = _Pushed(signed.updates, now)
            place_on(endpoint, place, machine, token)
        if placed:
            self._placed_at[uid] = now
        if len(placed) < self.replicas and ranked:
            logger.debug("%s has %d of %d replicas (%d hosts known)", uid, len(placed), self.replicas, len(ranked))
        return placed

    def _still_holds(self, uid: str, endpoint: str, held: _Pushed, backend) -> bool:
        """Whether the host still holds what this pusher pushed it last: a holder whose budget is full evicts
        replicas (of the machine that holds the most first), and one that restarted may hold none. Costs one
        message, the replica's header; a host that does not answer it is taken at its word (a push would fail
        too, and its next rounds find out)."""
        try:
            header = fetch_header(self.channels.probe_stub(endpoint), endpoint, uid,
                                  max_bytes=max_snapshot_bytes(backend),
                                  timeout=PROBE_TIMEOUT)
        except ReplicaError as error:
            return error.code != grpc.StatusCode.NOT_FOUND
        except SnapshotRefused:
            return False
        if header.signer == self.identity.public_key and header.updates == held.updates:
            return True
        logger.info("%s no longer holds the replica of %s pushed to it: pushing it again", endpoint, uid)
        return False

    def _backing_off(self, uid: str, endpoint: str) -> bool:
        with self._failing_lock:
            return any(entry is not None and entry.until > self.rounds
                       for entry in (self._failing.get(endpoint), self._failing.get((uid, endpoint))))

    def _failed_before(self, uid: str, endpoint: str) -> bool:
        with self._failing_lock:
            return endpoint in self._failing or (uid, endpoint) in self._failing

    def _failed(self, key: str | tuple[str, str]) -> int:
        """Notes a failure of ``key`` (a host, or a host for one expert); returns the rounds it is left out of."""
        with self._failing_lock:
            entry = self._failing.get(key)
            failures = entry.failures + 1 if entry is not None else 1
            skipped = min(2 ** (failures - 1), MAX_BACKOFF_ROUNDS)
            self._failing[key] = _Failing(failures, self.rounds + 1 + skipped)
            return skipped

    def _succeeded(self, uid: str, endpoint: str) -> None:
        with self._failing_lock:
            self._failing.pop(endpoint, None)
            self._failing.pop((uid, endpoint), None)

    def _forget_failures(self, announced: set[str]) -> None:
        """Drops what is noted of hosts that announce themselves no more."""
        with self._failing_lock:
            for key in [key for key in self._failing if (key if isinstance(key, str) else key[1]) not in announced]:
                del self._failing[key]

    def _saved_otherwise(self, uid: str, backend) -> bool:
        """Whether something other than this server's own replica store keeps ``backend``'s training here: the
        server's checkpoint, which saves the backend serving each of its uids now, or, for a backend the server was
        built with, the replicas it pushes, which its restart restores. Deciding by the uids it was built with lost
        a standby's training: a cell it chose and dropped, then adopted back, is a new backend (review 78)."""
        checkpoints = getattr(self.server, "checkpoints", None)
        if checkpoints is not None and uid in checkpoints.backends:
            return True
        built = self._built.get(uid)
        return built is not None and built() is backend

    def _keep(self, uid: str, backend) -> SignedSnapshot | None:
        """Writes the snapshot of an adopted expert into this server's own store when it trained since the one kept
        there (or that one is another owner's, with no more updates: see :meth:`_newer_held`); returns it for the
        pushes (None when nothing was written, or the pushes are compressed: the copy kept here is exact, as a
        checkpoint is)."""
        if self.store is None:
            return None
        held = self.store.held().get(uid)
        if held is not None and held.signer == self.identity.public_key and held.updates == backend.updates:
            return None
        if self._unkept.get(uid) == backend.updates:  # refused at these updates already: not again every round
            return None
        if self._newer_held(uid, backend.updates, held) is not None:
            self._unkept[uid] = backend.updates
            return None
        signed = sign(take(backend, self.server.runtime.paused), self.identity)
        try:
            self.store.put(signed, check=lambda now_held: self._newer_held(uid, signed.updates, now_held))
            self._unkept.pop(uid, None)
        except (OSError, SnapshotRefused) as error:  # a full disk, or a budget too small: the pushes still go
            self._unkept[uid] = backend.updates
            log = logger.info if getattr(error, "reason", None) == "older" else logger.warning
            log("could not keep the snapshot of adopted %s in %s: %s", uid, self.store.directory, error)
        return signed if self.compression == NONE else None

    def _newer_held(self, uid: str, updates: int, held: HeldReplica | None) -> SnapshotRefused | None:
        """Why this server's snapshot of ``uid`` with ``updates`` may not replace ``held`` in its own store: that
        is another signer's with more updates, pushed within :data:`~dmoe.replicas.service.LINEAGE_SECONDS` (the
        rule a push must pass, see :func:`~dmoe.replicas.service._older`). A stale adopted copy, still served for a
        look or two after another server adopted the cell, replaced the new owner's newer replica, and was then
        announced and adopted again as this server's own (review 105 D5)."""
        if held is None or held.signer == self.identity.public_key or held.updates <= updates \
                or time.time() - held.received_at >= LINEAGE_SECONDS:
            return None
        return SnapshotRefused(grpc.StatusCode.FAILED_PRECONDITION, "older",
                               f"the replica of {uid} held here has {held.updates} updates, signed by "
                               f"{held.signer.hex()[:SIGNER_HEX]}: more than this server's {updates}")

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.pushed.labels(result).inc()

    def start(self) -> "ReplicaPusher":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dmoe-replica-pusher", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        # the first round comes soon: until then a server killed would lose its experts' state (restored from a
        # checkpoint or a replica: maybe much training), not one interval of it
        started = time.monotonic() - self.interval + min(self.interval, FIRST_ROUND_AFTER)
        while not self._stop.wait(max(0.0, self.interval - (time.monotonic() - started))):
            started = time.monotonic()  # rounds start every interval, however long one takes: the lag it bounds
            try:
                self.push_all(deadline=started + max(self.interval, self.timeout), interruptible=True)
            except Exception:  # noqa: BLE001 - the pusher outlives one bad round
                logger.exception("a round of replica pushes failed")

    def stop(self) -> None:
        """Starts no more periodic rounds and abandons the pushes of the one under way; :meth:`close` then joins the
        thread and makes the last round. Set together with the adopter's stop, before either thread is joined: the
        pusher used to go on with its rounds (DHT reads, probes of its hosts) for as long as the adopter took to
        stop (review 88)."""
        self._stop.set()

    def close(self, push: bool = True, timeout: float = CLOSE_TIMEOUT) -> None:
        """Stops the thread, then (``push``) pushes every expert's last state, in at most ``self.timeout`` seconds:
        a clean stop loses no update unless its hosts are too slow for that. A round under way is abandoned, and no
        host that failed lately is tried. The thread is waited for ``timeout`` seconds at most (logged when it takes
        longer; the last round then waits for it within its own deadline): it was waited for without a bound, and
        a round held by host names that never resolve kept a clean stop for a minute, until a supervisor's SIGKILL
        lost the last push (review 105 D3)."""
        stopping = time.monotonic()
        self.stop()
        stuck = False
        if self._thread is not None:
            self._thread.join(timeout)
            stuck = self._thread.is_alive()
            if stuck:
                logger.warning("the replica pusher's round did not end within %.0f s of the stop: not waiting for "
                               "it", timeout)
            self._thread = None
        if push:
            try:
                placed = self.push_all(deadline=stopping + self.timeout, last=True)
                logger.info("last replicas pushed: %d experts to %d hosts",
                            sum(1 for endpoints in placed.values() if endpoints),
                            len({endpoint for endpoints in placed.values() for endpoint in endpoints}))
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.exception("the last replica push failed")
        self._pool.shutdown(wait=not stuck, cancel_futures=stuck)  # (a stuck round's pushes end with the channels)
        self._where.close()
        self.channels.close()
