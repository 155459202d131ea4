"""gRPC options shared by both ends, and a pool of client channels reused per endpoint."""
from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any, Collection, NamedTuple, Sequence

import grpc

from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from dmoe.wire.shared_memory import MIN_BYTES as SHARED_MEMORY_MIN_BYTES
from dmoe.wire.shared_memory import AVAILABLE, SegmentPool, SharedMemoryCalls, is_local_endpoint
from dmoe.wire.zerocopy import ANSWER_PARSERS, Message

#: Unary messages up to this size; larger payloads go through the streaming calls in parts.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Size of one streamed part: well under any limit, big enough that per-message overhead is negligible.
STREAM_PART_BYTES = 2 * 1024 * 1024


logger = logging.getLogger(__name__)

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode | None:
    """The gRPC status code with this number (batch calls carry each item's status as one), None if none has it."""
    return _STATUS_CODES.get(number)


#: the most characters of a peer's text a status message quotes, or a client keeps of a server's message: gRPC's
#: metadata holds 16 KiB at most (a longer status arrives as "Stream removed"), and errors end up in logs
MAX_STATUS_CHARS = 1024


def truncated(message: str, limit: int = MAX_STATUS_CHARS) -> str:
    """``message`` cut to at most ``limit`` characters, saying so and how long it was. Idempotent: a cut message is
    no longer than ``limit``, so it is never cut again."""
    if len(message) <= limit:
        return message
    note = f"... ({len(message)} characters)"
    return message[:max(0, limit - len(note))] + note


def described(tensor: Any, quoted: bool = True) -> str:
    """A tensor message's header in a few words: its shape (up to 8 dimensions) and dtype (up to 24 characters, in
    quotes unless not ``quoted``). The peer chose both: quoted whole, 100,000 dimensions made a status too long for
    gRPC to send (review 71)."""
    shape = list(tensor.shape)
    dims = str(shape) if len(shape) <= 8 else f"{len(shape)} dimensions"
    dtype = truncated(str(tensor.dtype), 24)
    return f"{dims} {dtype!r}" if quoted else f"{dims} {dtype or '<no dtype>'}"


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel/server options: raised message limits (gRPC's default is 4 MiB) and keepalive pings."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # Server side: accept the clients' keepalive pings above. gRPC's default (one ping per 5 minutes at
        # most, then GOAWAY "too_many_pings") would tear down idle channels and fail the next calls.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        # Server side: a port another process listens on is refused. gRPC binds with SO_REUSEPORT by default, and
        # two servers on one port would share its connections, each answering NOT_FOUND for the other's experts.
        ("grpc.so_reuseport", 0),
    ]


class TensorCalls(NamedTuple):
    """ExpertService's tensor-carrying unary calls on one channel: each takes a request (a
    :data:`dmoe.wire.zerocopy.Message`) and returns the answer read in place (views of the received bytes).
    :class:`~dmoe.wire.shared_memory.SharedMemoryCalls` has the same four, through shared memory."""

    forward: grpc.UnaryUnaryMultiCallable
    backward: grpc.UnaryUnaryMultiCallable
    forward_batch: grpc.UnaryUnaryMultiCallable
    backward_batch: grpc.UnaryUnaryMultiCallable

    @classmethod
    def on(cls, channel: grpc.Channel) -> "TensorCalls":
        def call(method: str) -> grpc.UnaryUnaryMultiCallable:
            return channel.unary_unary(f"/dmoe.ExpertService/{method}", request_serializer=Message.join,
                                       response_deserializer=ANSWER_PARSERS[method], _registered_method=True)
        return cls(call("forward"), call("backward"), call("forward_batch"), call("backward_batch"))


class HeldCall:
    """Keeps one ``hold`` call (proto/dmoe.proto) open on a channel while the channel is in use.

    gRPC's synchronous stack reads a channel's answers on a thread that it starts when the channel's first call
    begins and that ends with its last one, so a layer whose channels are idle between steps started a thread for
    nearly every call. With a call held open the thread stays; each hold lasts ``seconds`` and is opened again by
    the next use after it ended, so a channel left unused gives its thread back. A server that refuses holds (an
    older one: UNIMPLEMENTED) is not asked again; after any other failure, or a server that is stopping, the next
    try waits ``retry_seconds``.
    """

    def __init__(self, channel: grpc.Channel, endpoint: str, seconds: float = 30.0, retry_seconds: float = 5.0):
        self._method = channel.unary_unary("/dmoe.ExpertService/hold",
                                           request_serializer=dmoe_pb2.Hold.SerializeToString,
                                           response_deserializer=dmoe_pb2.HoldEnd.FromString,
                                           _registered_method=True)
        self.endpoint, self.seconds, self.retry_seconds = endpoint, seconds, retry_seconds
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self.open = False  # read without the lock on every use: a stale value costs one look under it
        self.opened = 0  # holds opened so far
        self.supported = True
        self._retry_at = 0.0
        self._closed = False
        #: how the last hold ended: "time" (its seconds passed), "stopping" (the server began to stop) or the
        #: name of the status it failed with; None while none has
        self.ended_by: str | None = None

    def ensure(self) -> None:
        """Opens a hold if none is open and none is due to wait (cheap when one is open)."""
        if self.open or not self.supported:
            return
        with self._lock:
            if self.open or self._closed or not self.supported or time.monotonic() < self._retry_at:
                return
            call = self._method.future(dmoe_pb2.Hold(seconds=self.seconds), timeout=self.seconds + 30.0)
            self.open = True  # (after the call began: a call that failed to begin left the channel never held)
            self.opened += 1
            self._call = call
        call.add_done_callback(self._ended)

    def _ended(self, call: grpc.Future) -> None:
        if call.cancelled():
            return  # closed by the pool
        try:
            stopping = call.result().stopping
            ended_by, pause = ("stopping", self.retry_seconds) if stopping else ("time", 0.0)
        except grpc.RpcError as error:
            ended_by, pause = error.code().name, self.retry_seconds
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                logger.debug("%s does not hold calls: its channel's thread comes and goes", self.endpoint)
        with self._lock:
            if self._call is call:
                self._retry_at = time.monotonic() + pause
                self.ended_by = ended_by
                self.open = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            call, self._call = self._call, None
        if call is not None:
            call.cancel()


class _Entry(NamedTuple):
    channel: grpc.Channel
    stub: dmoe_pb2_grpc.ExpertServiceStub
    calls: TensorCalls
    shared: SharedMemoryCalls | None
    hold: HeldCall | None
    used: list[float]  # [the monotonic time of its last use], updated in place under the pool's lock


class ChannelPool:
    """One gRPC channel (and stub) per endpoint, created on first use and shared by every caller.

    A gRPC channel multiplexes any number of concurrent calls over one HTTP/2 connection, so reusing it saves a
    TCP + HTTP/2 handshake per call. Thread-safe. ``close()`` closes every channel.

    ``shared_memory``: the tensor-carrying calls to a server at a loopback address pass their payload through
    memory shared with it (:mod:`dmoe.wire.shared_memory`), where the platform allows and the server agrees, for
    requests of ``shared_memory_min_bytes`` or more; False: always through gRPC.

    ``hold_calls``: keep a ``hold`` call open on each channel in use (:class:`HeldCall`: gRPC then keeps the
    channel's polling thread instead of starting one per call), each for ``hold_seconds`` (servers cap it at 60).
    A pool dropped without ``close()`` keeps its threads and the servers' holds until its holds end.

    ``idle_seconds``: a channel nobody asked for in that long is let go (None: kept until ``close()``). A trainer
    meets servers as volunteers come and go, and each channel kept to a live server held a connection (a file
    descriptor, ~170 KB) for good. A let-go channel is not closed: calls still in flight on it (a long snapshot
    push, say) finish, and it closes once they have and Python collects it (gRPC's objects refer to each other:
    it takes a full collection). The pool runs one once ``collect_after`` channels were let go since the last, so
    that at most that many connections linger; a full collection pauses every thread of a big process for a
    moment (~0.5 s measured), which one per let-go channel would cost far too often.

    ``options``: more gRPC channel arguments, after the usual ones (:func:`grpc_options`).
    """

    #: channels let go between two full collections the pool runs (see the class's doc)
    collect_after = 32

    _default: "ChannelPool | None" = None
    _default_lock = threading.Lock()

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES, shared_memory: bool = True,
                 shared_memory_min_bytes: int = SHARED_MEMORY_MIN_BYTES, hold_calls: bool = True,
                 hold_seconds: float = 30.0, idle_seconds: float | None = 600.0,
                 options: Sequence[tuple[str, int]] = ()):
        self.max_message_bytes, self.options = max_message_bytes, list(options)
        if not 0 < hold_seconds < float("inf"):
            raise ValueError(f"hold_seconds must be finite and > 0, got {hold_seconds}")
        if idle_seconds is not None and not 0 < idle_seconds < float("inf"):
            raise ValueError(f"idle_seconds must be finite and > 0 (or None), got {idle_seconds}")
        self.idle_seconds = idle_seconds
        self._next_sweep = time.monotonic() + (idle_seconds or 0.0)
        self.let_go = 0  # channels let go for being idle so far
        self._uncollected = 0  # of them, let go since the last collection the pool ran
        self.hold_calls, self.hold_seconds = hold_calls, hold_seconds
        self.shared_memory, self.shared_memory_min_bytes = shared_memory and AVAILABLE, shared_memory_min_bytes
        self.segments = SegmentPool()  # bounded over all endpoints; a segment is reused only for its own endpoint
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    @classmethod
    def default(cls) -> "ChannelPool":
        """The process-wide pool used when a caller brings none (channels are per-process resources anyway)."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = cls()
            return cls._default

    def _entry(self, endpoint: str) -> _Entry:
        now = time.monotonic()
        idle: list[tuple[str, _Entry]] = []
        with self._lock:
            if self.idle_seconds is not None and now >= self._next_sweep:
                # At most every idle_seconds / 4, so a let-go channel outlives its last use by 1.25 x at most.
                self._next_sweep = now + self.idle_seconds / 4
                idle = [(name, old) for name, old in self._entries.items() if now - old.used[0] > self.idle_seconds]
                for name, _ in idle:
                    del self._entries[name]
                self.let_go += len(idle)
            entry = self._entries.get(endpoint)
            if entry is None:
                channel = grpc.insecure_channel(endpoint, options=grpc_options(self.max_message_bytes) + self.options)
                calls = TensorCalls.on(channel)
                shared = (SharedMemoryCalls(channel, endpoint, calls, self.segments, self.shared_memory_min_bytes)
                          if self.shared_memory and is_local_endpoint(endpoint) else None)
                entry = self._entries[endpoint] = _Entry(channel, dmoe_pb2_grpc.ExpertServiceStub(channel), calls,
                                                         shared, HeldCall(channel, endpoint, self.hold_seconds)
                                                         if self.hold_calls else None, [now])
            else:
                entry.used[0] = now
        if idle:
            self._let_go(idle)
        if entry.hold is not None:
            entry.hold.ensure()
        return entry

    def _let_go(self, idle: list[tuple[str, _Entry]]) -> None:
        """Lets go of ``idle``'s channels (and empties it, so that no frame keeps them)."""
        names = [name for name, _ in idle]
        for name, entry in idle:
            if entry.hold is not None:
                entry.hold.close()
            self.segments.forget(name)
        idle.clear()
        del entry
        logger.debug("let go of %d idle channel(s): %s", len(names), ", ".join(names))
        with self._lock:
            self._uncollected += len(names)
            collect = self._uncollected >= self.collect_after
            if collect:
                self._uncollected = 0
        if collect:
            # A channel is closed when its last reference goes, but gRPC's objects refer to each other, so that is
            # at the next full collection, which a trainer may not reach for a long while: its connection with it.
            gc.collect()

    def retain(self, endpoints: Collection[str]) -> int:
        """Closes the channels to every endpoint not in ``endpoints`` (their calls in flight fail as cancelled);
        returns how many. For an owner that knows which endpoints it still needs (the monitor, after each poll):
        idle channels are otherwise kept ``idle_seconds``, and endpoints that anyone can make up (a cell declared
        at a new address each period) held a connection each meanwhile (review 79)."""
        keep = set(endpoints)
        with self._lock:
            gone = [(name, self._entries.pop(name)) for name in [name for name in self._entries if name not in keep]]
        for name, entry in gone:
            if entry.hold is not None:
                entry.hold.close()
            entry.channel.close()
            self.segments.forget(name)
        return len(gone)

    def endpoints(self) -> list[str]:
        """The endpoints this pool has a channel to now."""
        with self._lock:
            return list(self._entries)

    def held(self, endpoint: str) -> HeldCall | None:
        """The hold kept on ``endpoint``'s channel (None: no channel yet, or ``hold_calls`` is off)."""
        with self._lock:
            entry = self._entries.get(endpoint)
        return entry.hold if entry is not None else None

    def stub(self, endpoint: str) -> dmoe_pb2_grpc.ExpertServiceStub:
        """The generated stub: every call, with protobuf messages."""
        return self._entry(endpoint).stub

    def channel(self, endpoint: str) -> grpc.Channel:
        """The channel itself, for another service's stub on it (the replicas')."""
        return self._entry(endpoint).channel

    def calls(self, endpoint: str) -> TensorCalls | SharedMemoryCalls:
        """The tensor-carrying calls without copies (:class:`TensorCalls`), on the same channel as :meth:`stub`;
        for a server on this host, :class:`~dmoe.wire.shared_memory.SharedMemoryCalls` (see ``shared_memory``)."""
        entry = self._entry(endpoint)
        return entry.shared if entry.shared is not None else entry.calls

    def close(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            if entry.hold is not None:
                entry.hold.close()
            entry.channel.close()
        self.segments.close()

    def __enter__(self) -> "ChannelPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
