"""Expert calls between a client and a server on one host, with the payload in shared memory.

gRPC's transport copies every byte of a message several times on each side (into its slices, through HTTP/2
frames, through the loopback socket, out again): on one host an 8 MiB round trip through a bare gRPC echo took
~20x a memcpy of the same bytes (benchmarks/README.md, "Expert server throughput"). A client whose server runs on
the same host (a trainer beside the servers of its own GPUs, the benchmarks' loopback) can skip that:

- the client writes the request (an ``ExpertRequest`` or ``BatchRequest``, as :mod:`dmoe.wire.zerocopy` writes it)
  into a **segment**: an anonymous memory file (``memfd``) of its own, sealed against shrinking, whose header holds
  a random key;
- it sends ``call_shared`` (``SharedMemoryCall``: its pid, the segment's descriptor, the key, where the request is
  and where the answer may go), a message of a few dozen bytes, over the same gRPC channel;
- the server opens the segment through ``/proc/<pid>/fd/<fd>`` (:class:`SegmentMaps`), checks the key, copies the
  request out and answers it exactly as the plain call would; the answer goes into the segment when it fits,
  else inline in the reply.

Safety: only peers connected over loopback may ask; the server maps only sealed memfds (a segment that could
shrink under the mapping would kill the server with SIGBUS) whose header holds the key the caller sent (so the
caller can read the segment: it is its owner, or could be); it copies the request out before checking it, so the
client cannot change it after the checks; every offset is checked against the segment's size. A server that
cannot or will not use the segment (``--no-shared-memory``, another pid namespace, another user, not Linux)
answers ``refused``, and the client sends this and every later call to that server the plain way.

The client reuses a segment only after the call it carried succeeded, and only for calls to that same server: a
cancelled or failed call's segment is dropped, as the server may still write its answer there, and so is one the
server refused, as it may have mapped it all the same. A server on this host under the client's user can keep its
mapping of a segment and write into it whenever it likes; reused for another server, the segment would carry that
server's answers poisoned, and the honest server would take the blame.
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import hmac
import logging
import mmap
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

import grpc

from dmoe.endpoints import is_loopback_ip, peer_host
from dmoe.wire import dmoe_pb2
from dmoe.wire.zerocopy import ANSWER_PARSERS

logger = logging.getLogger(__name__)

MAGIC = b"dmoe-shm"
KEY_BYTES = 16
#: The segment's header (magic, key), padded so that the payload after it starts aligned.
HEADER_BYTES = 64
#: Where messages start in a segment: buffers that zerocopy's writers align stay aligned in memory.
ALIGN = 64
#: The smallest segment made; sizes above it are powers of two, so segments are reused across similar calls.
MIN_SEGMENT_BYTES = 1 << 20
#: Room for an answer beyond the request's size (an answer of an ffn expert is as large as its request or smaller).
ANSWER_SLACK_BYTES = 64 * 1024
#: The calls that may travel this way.
METHODS = ("forward", "backward", "forward_batch", "backward_batch")
#: Smaller requests go through gRPC even to a server on this host: the path's fixed cost (a segment, the call's
#: own message, the server's checks) outweighs the copies it saves below ~64 KiB; the two are even up to 256 KiB,
#: and at 1 MiB it carries 1.5-2x the calls (benchmarks/README.md, "Expert server throughput": --preset sizes).
MIN_BYTES = 64 * 1024

#: The most characters of a server's reason for refusing a segment that the client logs.
MAX_REASON_CHARS = 1024
#: seconds between a server's checks of which mapped segments their clients still hold (on calls and on a timer)
SWEEP_SECONDS = 5.0

#: Whether this platform has what the path needs (memfd with seals, /proc).
AVAILABLE = (hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and hasattr(os, "MFD_ALLOW_SEALING")
             and os.path.isdir("/proc/self/fd"))


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``) is on this host."""
    host = peer_host(peer)
    return host == "unix" or (peer.startswith(("ipv4:", "ipv6:")) and is_loopback_ip(host))


def is_local_endpoint(endpoint: str) -> bool:
    """Whether ``HOST:PORT`` names this host by a loopback address (the only servers a client tries it with)."""
    return is_loopback_ip(endpoint.rpartition(":")[0].strip("[]").lower())


# ------------------------------------------------------------------------------------------------ client side


class Segment:
    """A sealed memfd of this process, mapped: the header, then room for one call's request and answer."""

    def __init__(self, size: int):
        fd = os.memfd_create("dmoe-call", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size, self.key = fd, size, secrets.token_bytes(KEY_BYTES)
        self.map[:len(MAGIC) + KEY_BYTES] = MAGIC + self.key
        self.view = memoryview(self.map)

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # a view of it is still alive somewhere: the memory goes when that does
            pass
        os.close(self.fd)


class SegmentPool:
    """A client's segments: one per call in flight, reused once a call succeeded, and only for the server (the
    endpoint) that call went to, which had it mapped already: another server on this host could still hold a
    mapping of it and write into it. At most ``keep_bytes`` of idle segments are kept, over all servers (the least
    recently released closed first). Thread-safe; :meth:`close` closes the idle ones, and those in flight as they
    come back."""

    def __init__(self, keep_bytes: int = 256 << 20):
        self.keep_bytes = keep_bytes
        self._free: list[tuple[str, Segment]] = []  # (the endpoint it may go to again, the segment), oldest first
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, size: int, endpoint: str) -> Segment:
        """A segment of at least ``size`` bytes for a call to ``endpoint``: one that endpoint had, or a new one."""
        size = max(MIN_SEGMENT_BYTES, 1 << (size - 1).bit_length())
        with self._lock:
            for i, (owner, segment) in enumerate(self._free):
                if owner == endpoint and segment.size == size:
                    return self._free.pop(i)[1]
        return Segment(size)

    def release(self, segment: Segment, endpoint: str) -> None:
        """Back to the pool, for ``endpoint`` alone: only after the call it carried there succeeded (the server is
        done with it)."""
        with self._lock:
            if not self._closed:
                self._free.append((endpoint, segment))
                while sum(s.size for _, s in self._free) > self.keep_bytes:
                    self._free.pop(0)[1].close()
                return
        segment.close()

    def discard(self, segment: Segment) -> None:
        """Closes a segment the server may still write into (its call failed, was cancelled or was refused)."""
        segment.close()

    def forget(self, endpoint: str) -> None:
        """Closes the idle segments kept for ``endpoint`` (the pool let its channel go)."""
        with self._lock:
            gone = [segment for owner, segment in self._free if owner == endpoint]
            self._free = [(owner, segment) for owner, segment in self._free if owner != endpoint]
        for segment in gone:
            segment.close()

    def idle(self, endpoint: str | None = None) -> int:
        """The idle segments kept (for ``endpoint``; None: for any)."""
        with self._lock:
            return sum(1 for owner, _ in self._free if endpoint is None or owner == endpoint)

    def close(self) -> None:
        with self._lock:
            self._closed, free, self._free = True, self._free, []
        for _, segment in free:
            segment.close()


class SharedCallFuture:
    """What ``TensorCalls``' ``future()`` returns (``result``, ``add_done_callback``, ``cancel``), for a call
    through a segment or, after a refusal, the plain call it became."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls: list[Any] = []  # the gRPC calls made for it, cancelled with it
        self._lock = threading.Lock()

    def _track(self, call: Any) -> None:
        with self._lock:
            self._calls.append(call)
            cancelled = self._future.cancelled()
        if cancelled:
            call.cancel()

    def _settle(self, fn: Callable[[], Any]) -> None:
        try:
            value, error = fn(), None
        except BaseException as exc:  # noqa: BLE001 - the caller's to see
            value, error = None, exc
        try:
            if error is None:
                self._future.set_result(value)
            else:
                self._future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except concurrent.futures.CancelledError:
            raise grpc.FutureCancelledError() from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def done(self) -> bool:
        return self._future.done()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def cancel(self) -> bool:
        with self._lock:
            cancelled = self._future.cancel()
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        return cancelled

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self._future.add_done_callback(lambda _: fn(self))


class SharedMethod:
    """One of ``forward``, ``backward``, ``forward_batch``, ``backward_batch`` through a segment; ``future(message,
    timeout=)`` as gRPC's callables have it, for a :class:`dmoe.wire.zerocopy.Message`."""

    def __init__(self, calls: "SharedMemoryCalls", method: str, parse: Callable[[bytes], Any], plain: Any):
        self.calls, self.method, self.parse, self.plain = calls, method, parse, plain

    def future(self, message: Any, timeout: float | None = None) -> Any:
        calls = self.calls
        if not calls.enabled or message.size < calls.min_bytes:
            return self.plain.future(message, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        request_room = _round_up(message.size, ALIGN)
        segment = calls.segments.acquire(HEADER_BYTES + request_room + message.size + ANSWER_SLACK_BYTES,
                                         calls.endpoint)
        try:
            message.write_into(segment.view[HEADER_BYTES:HEADER_BYTES + message.size])
        except BaseException:
            calls.segments.discard(segment)
            raise
        answer_offset = HEADER_BYTES + request_room
        request = dmoe_pb2.SharedMemoryCall(
            method=self.method, pid=os.getpid(), fd=segment.fd, key=segment.key, request_offset=HEADER_BYTES,
            request_length=message.size, answer_offset=answer_offset, answer_capacity=segment.size - answer_offset)
        outer = SharedCallFuture()
        try:
            inner = calls.call_shared.future(request, timeout=timeout)
        except BaseException:  # (the channel closed meanwhile, say): the segment and its memfd are not kept
            calls.segments.discard(segment)
            raise
        outer._track(inner)

        def plain_instead() -> None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                second = self.plain.future(message, timeout=remaining)
            except BaseException as error:  # (the channel closed meanwhile, say): raised in gRPC's callback, this
                outer._settle(_raise(error))  # left the call unsettled, and a caller without a timeout waiting
                return
            outer._track(second)
            second.add_done_callback(lambda done: outer._settle(done.result))

        def finish(done: Any) -> None:
            if done.cancelled():
                calls.segments.discard(segment)
                outer.cancel()
                return
            error = done.exception()
            if error is not None:
                calls.segments.discard(segment)
                if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    calls.refuse(f"{calls.endpoint} does not know call_shared (an older server)")
                    plain_instead()
                else:
                    outer._settle(done.result)  # raises the call's RpcError
                return
            answer = done.result()
            if answer.refused:
                calls.segments.discard(segment)  # "not mapped" is the server's word: it may have kept a mapping
                calls.refuse(answer.refused)
                plain_instead()
                return
            if answer.answer_length:
                if answer.answer_length > segment.size - answer_offset:
                    calls.segments.discard(segment)
                    outer._settle(_raise(SharedCallError(f"{calls.endpoint} answered {answer.answer_length} "
                                                         f"bytes in a room of {segment.size - answer_offset}")))
                    return
                data = bytes(segment.view[answer_offset:answer_offset + answer.answer_length])
                calls.segments.release(segment, calls.endpoint)
            else:
                data = answer.inline_answer
                calls.segments.release(segment, calls.endpoint)
            outer._settle(_parsed(self.parse, data, calls.endpoint))

        inner.add_done_callback(finish)
        return outer


class SharedCallError(grpc.RpcError):
    """A call whose answer could not be read, raised as gRPC raises one whose answer it could not deserialize."""

    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INTERNAL

    def details(self) -> str:
        return self._details


def _parsed(parse: Callable[[bytes], Any], data: bytes, endpoint: str) -> Callable[[], Any]:
    def read() -> Any:
        try:
            return parse(data)
        except Exception as error:  # noqa: BLE001 - DecodeError, or worse: the caller sees an RpcError either way
            raise SharedCallError(f"the answer of {endpoint} could not be read: {error}") from None
    return read


def _raise(error: BaseException) -> Callable[[], Any]:
    def fail() -> Any:
        raise error
    return fail


class SharedMemoryCalls:
    """``TensorCalls``' four calls to one server on this host through segments of ``segments``, for requests of
    ``min_bytes`` or more (smaller ones, and every call after the server refused once or did not know the call, go
    the plain way: ``plain``, a ``TensorCalls``)."""

    def __init__(self, channel: grpc.Channel, endpoint: str, plain: Any, segments: SegmentPool,
                 min_bytes: int = MIN_BYTES):
        self.endpoint, self.segments, self.enabled, self.min_bytes = endpoint, segments, True, min_bytes
        self.call_shared = channel.unary_unary(
            "/dmoe.ExpertService/call_shared", request_serializer=dmoe_pb2.SharedMemoryCall.SerializeToString,
            response_deserializer=dmoe_pb2.SharedMemoryAnswer.FromString, _registered_method=True)
        self.forward, self.backward, self.forward_batch, self.backward_batch = (
            SharedMethod(self, method, ANSWER_PARSERS[method], getattr(plain, method)) for method in METHODS)

    def refuse(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            if len(why) > MAX_REASON_CHARS:  # the server's words, up to a message's 64 MiB
                why = f"{why[:MAX_REASON_CHARS]}... ({len(why)} characters)"
            logger.info("calls to %s go through gRPC, not shared memory: %s", self.endpoint, why)


# ------------------------------------------------------------------------------------------------ server side


class Refused(Exception):
    """The server will not use this segment (the client sends the call the plain way)."""


class BadCall(Exception):
    """A ``SharedMemoryCall`` that is wrong whatever the segment (offsets outside it, a request too large)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class MappedSegment:
    """A client's segment as the server maps it; ``identity``: the memfd's (st_dev, st_ino), to tell whether the
    client still holds it."""

    def __init__(self, mapping: mmap.mmap, identity: tuple[int, int] = (0, 0)):
        self.map, self.size, self.identity = mapping, len(mapping), identity

    def read(self, offset: int, length: int) -> bytes:
        """A private copy: the client cannot change what the server checked."""
        with memoryview(self.map) as view:
            return bytes(view[offset:offset + length])

    def write(self, offset: int, message: Any) -> int:
        with memoryview(self.map) as view:
            return message.write_into(view[offset:offset + message.size])


class SegmentMaps:
    """The server's mappings of its clients' segments, by (pid, fd, key), the least recently used dropped beyond
    ``max_segments`` or ``max_bytes``. Used from the server's event loop only.

    ``max_request_bytes``: the largest request accepted (the gRPC message limit of the plain calls)."""

    def __init__(self, max_request_bytes: int, max_segments: int = 64, max_bytes: int = 2 << 30,
                 clock: Callable[[], float] = time.monotonic):
        self.max_request_bytes, self.max_segments, self.max_bytes = max_request_bytes, max_segments, max_bytes
        self._maps: OrderedDict[tuple[int, int, bytes], MappedSegment] = OrderedDict()
        self.opened = 0
        self.clock, self._swept = clock, clock()

    def __len__(self) -> int:
        return len(self._maps)

    def check(self, call: dmoe_pb2.SharedMemoryCall, size: int) -> None:
        """Raises :class:`BadCall` unless the request and the answer's room lie inside a segment of ``size``."""
        if call.request_length > self.max_request_bytes:
            raise BadCall(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the request has {call.request_length} bytes, more "
                          f"than this server's limit of {self.max_request_bytes}")
        for name, offset, length in (("request", call.request_offset, call.request_length),
                                     ("answer", call.answer_offset, call.answer_capacity)):
            if offset < HEADER_BYTES or offset + length > size:
                raise BadCall(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the {name} at [{offset}, {offset + length}) is outside the segment's payload "
                              f"[{HEADER_BYTES}, {size})")

    def open(self, call: dmoe_pb2.SharedMemoryCall, peer: str) -> MappedSegment:
        """The segment ``call`` names, checked; raises :class:`Refused` or :class:`BadCall`."""
        if not AVAILABLE:
            raise Refused("this server's platform has no memfd with seals or no /proc")
        if not is_loopback_peer(peer):
            raise Refused(f"shared memory is for clients on this host; the call came from {peer}")
        if call.pid <= 0 or call.fd < 0 or len(call.key) != KEY_BYTES:
            raise BadCall(grpc.StatusCode.INVALID_ARGUMENT, f"pid {call.pid}, fd {call.fd} and a key of "
                          f"{len(call.key)} bytes do not name a segment (a key has {KEY_BYTES})")
        name = (call.pid, call.fd, bytes(call.key))
        if self.clock() - self._swept >= SWEEP_SECONDS:
            self.sweep()
        segment = self._maps.get(name)
        if segment is None:
            segment = self._map(call)
            self.sweep()
            self._maps[name] = segment
            self.opened += 1
            while len(self._maps) > self.max_segments or sum(s.size for s in self._maps.values()) > self.max_bytes:
                self._maps.popitem(last=False)  # unmapped once no handler uses it
        else:
            self._maps.move_to_end(name)
        self.check(call, segment.size)
        return segment

    def sweep(self) -> int:
        """Unmaps the segments their clients no longer hold (the process ended, or closed the descriptor or reused
        it for another file): their memory lives while the server maps it. Mapped until the least recently used
        were evicted, a client's closed segments stayed resident in the server after it exited (224 MiB of 16 MiB
        calls: review 71). The server runs this on a timer, and :meth:`open` on every new mapping and at least every
        :data:`SWEEP_SECONDS`."""
        self._swept = self.clock()
        gone = []
        for name, segment in self._maps.items():
            try:
                held = os.stat(f"/proc/{name[0]}/fd/{name[1]}")
            except OSError:
                gone.append(name)
                continue
            if (held.st_dev, held.st_ino) != segment.identity:
                gone.append(name)
        for name in gone:
            del self._maps[name]  # unmapped once no handler uses it
        return len(gone)

    def _map(self, call: dmoe_pb2.SharedMemoryCall) -> MappedSegment:
        """Maps the segment ``call`` names; raises :class:`Refused` for whatever this server cannot or will not map
        (a client's segment is the client's to make: write-sealed, larger than the address space...)."""
        path = f"/proc/{call.pid}/fd/{call.fd}"
        try:
            # only a memfd: never open a device or a pipe a client might name
            if not os.readlink(path).startswith("/memfd:") or not stat.S_ISREG(os.stat(path).st_mode):
                raise OSError(0, "not a memfd")
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as error:
            # One answer whatever the cause: which one it was would tell any client on this host which descriptors
            # exist in the processes this server's user may look into (review 55). The cause goes to the log.
            logger.debug("cannot open fd %d of process %d: %s", call.fd, call.pid,
                         error.strerror or os.strerror(error.errno or 0))
            raise Refused(f"fd {call.fd} of process {call.pid} is no memfd this server can open") from None
        try:
            if os.fstat(fd).st_blksize != mmap.PAGESIZE:
                # huge pages (MFD_HUGETLB): a page its owner punched out after the mapping faults a new one on read,
                # and with the pool empty that is SIGBUS, which would kill this server
                raise Refused("the segment is not of ordinary pages (huge pages are refused)")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise Refused("the segment is not a memfd with seals") from None
            if not seals & fcntl.F_SEAL_SHRINK:
                raise Refused("the segment is not sealed against shrinking")
            status = os.fstat(fd)
            size, identity = status.st_size, (status.st_dev, status.st_ino)
            if size < HEADER_BYTES:
                raise Refused(f"the segment has {size} bytes, less than its header")
            if size > self.max_bytes:  # it would evict every other mapping, or not fit in memory at all
                raise Refused(f"the segment has {size} bytes, more than this server maps ({self.max_bytes})")
            try:
                mapping = mmap.mmap(fd, size)
            except OSError as error:  # a write-sealed memfd (EPERM), no room in the address space (ENOMEM)...
                raise Refused(f"cannot map the segment: {os.strerror(error.errno or 0)}") from None
        finally:
            os.close(fd)
        header = mapping[:len(MAGIC) + KEY_BYTES]
        if not hmac.compare_digest(header, MAGIC + bytes(call.key)):
            mapping.close()
            raise Refused("the segment's header does not hold the key sent")
        return MappedSegment(mapping, identity)
