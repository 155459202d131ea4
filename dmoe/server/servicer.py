"""The gRPC face of a server: validates each request (:mod:`dmoe.server.validation`), then queues it for the runtime.

Handlers run on the server's asyncio loop and only await futures, so one thread serves any number of concurrent
calls while the runtime workers compute. Every rejection happens before tensors are allocated.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import grpc
import torch
from google.protobuf.message import DecodeError

from dmoe.endpoints import peer_machine
from dmoe.server.activations import ActivationKey, kept_key
from dmoe.server.backend import ExpertBackend, TensorSchema
from dmoe.server.faults import Faults, InjectedFailure
from dmoe.server.profile import StageClock
from dmoe.server.runtime import PoolRemoved, Runtime, is_out_of_memory
from dmoe.server.task_pool import TaskPool
from dmoe.server.validation import RequestRejected, check_options, first_bad_values, validate
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from dmoe.wire.channels import STREAM_PART_BYTES, truncated
from dmoe.wire.codec import (NONE, InvalidTensor, OutgoingTensor, TensorTooLarge, cut_into_parts, join_parts,
                             message_bytes, pack)
from dmoe.wire.shared_memory import BadCall, MappedSegment, Refused, SegmentMaps
from dmoe.wire.zerocopy import (MAX_BATCH_ITEMS, BatchResponse, Message, Response, Result, batch_response_bytes,
                                batch_response_message, parse_batch_request, parse_request, response_bytes,
                                response_message)

logger = logging.getLogger(__name__)

FORWARD, BACKWARD = "forward", "backward"


@dataclass(eq=False)
class SharedCall:
    """A ``call_shared`` request, and the request it carried once read from the segment (``parsed``: what the
    metrics count by expert)."""

    call: dmoe_pb2.SharedMemoryCall
    parsed: Any = None

    @classmethod
    def from_bytes(cls, data: bytes) -> "SharedCall":
        return cls(dmoe_pb2.SharedMemoryCall.FromString(data))


@dataclass(eq=False)
class SharedAnswer:
    """What ``call_shared`` answers: ``answer`` (a Response or BatchResponse) written into ``segment`` when it
    fits in ``capacity`` bytes at ``offset``, else inline; or ``refused`` (the client sends the call the plain way)."""

    answer: Any = None
    message: Message | None = None
    segment: MappedSegment | None = None
    offset: int = 0
    capacity: int = 0
    refused: str = ""

    def to_bytes(self) -> bytes:
        if self.refused or self.message is None:
            return dmoe_pb2.SharedMemoryAnswer(refused=self.refused).SerializeToString()
        if self.segment is not None and self.message.size <= self.capacity:
            written = self.segment.write(self.offset, self.message)
            return dmoe_pb2.SharedMemoryAnswer(answer_length=written).SerializeToString()
        return dmoe_pb2.SharedMemoryAnswer(inline_answer=self.message.join()).SerializeToString()


@dataclass
class HostedExpert:
    """A backend with its two task pools and the schemas its requests must match."""

    backend: ExpertBackend
    forward_pool: TaskPool
    backward_pool: TaskPool

    def schemas(self, kind: str) -> list[tuple[str, TensorSchema]]:
        inputs = [(f"input {i}", s) for i, s in enumerate(self.backend.inputs_schema)]
        if kind == FORWARD:
            return inputs
        return inputs + self.grad_schemas()

    def grad_schemas(self) -> list[tuple[str, TensorSchema]]:
        """What a backward that leaves its inputs out (held by the server since its forward) carries."""
        return [(f"grad_output {i}", s) for i, s in enumerate(self.backend.outputs_schema)]

    def held_inputs(self, key: ActivationKey) -> tuple[torch.Tensor, ...] | None:
        cache = self.backend.activations
        return cache.inputs(self.backend.name, key) if cache is not None else None

    def max_payload_bytes(self, kind: str, max_batch_size: int) -> int:
        """The most tensor bytes a valid request can carry: uncompressed is the largest encoding."""
        row_bytes = sum(s.numel * s.torch_dtype.itemsize for _, s in self.schemas(kind))
        return max_batch_size * row_bytes


#: the smallest average part (bytes of payload) a streamed request may be cut into
MIN_STREAM_PART_BYTES = 64


#: bytes a streamed request may hold beyond its tensors' buffers once (its uid, activation id, field headers)
STREAM_MESSAGE_SLACK_BYTES = 4096
#: and beyond that, per message and per tensor part (a part's shape, dtype and field headers take a few dozen):
#: with 4 KiB per message, a stream of payload-free messages could count 64 times the largest valid request
#: (review 48)
STREAM_PART_SLACK_BYTES = 64


def stream_parts_limit(payload_limit: int, n_tensors: int) -> int:
    """The most tensor parts a streamed request of at most ``payload_limit`` bytes and ``n_tensors`` tensors may have.

    Each part costs memory beyond its bytes (its message), so streams of empty parts must be bounded too; but not
    by charging parts against the payload limit, which refused valid requests of exactly the most rows. Any request
    cut into parts of at least :data:`MIN_STREAM_PART_BYTES` fits (clients cut into :data:`STREAM_PART_BYTES`).
    """
    return n_tensors + payload_limit // MIN_STREAM_PART_BYTES


#: the share of ``max_queued_bytes`` that streamed requests still arriving may count while anything else is queued or
#: arriving: streams that stall (or trickle) hold their bytes until their deadline, and must not refuse every other
#: call meanwhile
STREAMS_SHARE = 0.5
#: the share of ``max_queued_bytes`` the requests of one host may take while another host's are queued or arriving:
#: one client keeping enough requests in flight would otherwise have every other caller refused (review 48). A host
#: alone may take all of it; a newcomer then waits for one drain of its queue at most.
HOST_SHARE = 0.5
#: what an answer of a unary call holds in the server's memory, in multiples of its tensors' bytes, from its
#: computation until the call ends: the tensors, their serialized message and gRPC's copy of it (measured: a 16 MiB
#: answer nobody read held ~47 MiB, review 55)
UNARY_ANSWER_COPIES = 3
#: what a call whose answer waits holds in the server's memory at least, whatever its answer's size (measured: 20000
#: one-row calls nobody read took a server from 249 to 351 MiB, ~5 KiB each): counted for every answered call, so
#: that many small answers nobody reads are bounded too
ANSWERED_CALL_BYTES = 8 * 1024
#: what a call whose request waits for the experts holds in the server's memory at least, whatever its inputs' size
#: (its gRPC call and handler, the runtime's task and future, the decoded tensors: 15000 one-row calls queued took a
#: server ~26-37 KiB each, counted ~100 bytes each): counted for every queued call, so that many tiny requests are
#: bounded by --max-queued-mb too (review 95 D2)
QUEUED_CALL_BYTES = 32 * 1024
#: the same for each item of a batch call, whose items share the call (measured: ~5 KiB per one-row item queued, in
#: calls of 64 or 256 items); the call counts :data:`QUEUED_CALL_BYTES` at least in all
QUEUED_ITEM_BYTES = 4 * 1024


@dataclass(eq=False)
class Arrival:
    """The bytes of one streamed request counted as its messages arrived (:meth:`ExpertServicer._arrive`): counted
    as its inputs instead once it is queued, or released if it ends otherwise."""

    bytes: int = 0


#: bytes a message read in place may hold beyond its tensors' and still be kept whole by a view of them (headers,
#: alignment padding)
PIN_SLACK_BYTES = 4096


def _message_bytes(tensors: Sequence[Any]) -> int:
    """The size of the message that views of these tensors (read in place: :class:`dmoe.wire.zerocopy.TensorView`)
    keep alive, 0 if none is such a view."""
    for tensor in tensors:
        buffer = getattr(tensor, "buffer", None)
        if isinstance(buffer, memoryview) and buffer.obj is not None:
            return len(buffer.obj)
    return 0


def _answer_bytes(tensors: Sequence[OutgoingTensor]) -> int:
    return sum(len(t.buffer) if isinstance(t.buffer, bytes) else t.buffer.nbytes for t in tensors)


def _pins_more(tensors: Sequence[Any]) -> bool:
    """Whether views of these tensors (read in place: :class:`dmoe.wire.zerocopy.TensorView`) would keep a message
    more than :data:`PIN_SLACK_BYTES` larger than their bytes alive."""
    viewed = [t.buffer for t in tensors if isinstance(getattr(t, "buffer", None), memoryview)]
    return bool(viewed) and len(viewed[0].obj) > sum(b.nbytes for b in viewed) + PIN_SLACK_BYTES


async def _all_done(futures: Sequence["Future[Any]"]) -> None:
    """Waits on the loop until every runtime future is done, woken once (the last one's callback) instead of once
    per future as ``asyncio.wrap_future`` would. If the wait is cancelled (the call was), so are the futures that
    have not started: the runtime skips them."""
    if not futures:
        return
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:  # on a runtime worker, or here for a future already done
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the server stopped): nobody waits
            loop.call_soon_threadsafe(_settle, waiter)

    for future in futures:
        future.add_done_callback(one_done)
    try:
        await waiter
    except asyncio.CancelledError:
        for future in futures:
            future.cancel()
        raise


def _settle(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ExpertServicer(dmoe_pb2_grpc.ExpertServiceServicer):
    """Implements ``ExpertService`` of proto/dmoe.proto for a set of hosted experts.

    Args:
        experts: uid -> hosted expert (its pools belong to ``runtime``).
        runtime: runs the requests.
        max_batch_size: requests with more rows are refused (RESOURCE_EXHAUSTED).
        device: reported by ``info``.
        default_compression: applied to responses when a request asks for none.
        max_stream_bytes: the most bytes a streamed request may carry in total.
        faults: injected latency and failures for experiments (:mod:`dmoe.server.faults`); None: none.
        reject_nonfinite: answer INVALID_ARGUMENT to requests whose floating-point tensors hold NaN or Inf.
        max_abs_value: answer INVALID_ARGUMENT to requests holding finite values of a larger magnitude (None: no limit).
        max_batch_items: batch calls with more items are refused (RESOURCE_EXHAUSTED; a request read in place is
            refused at its 1025th item as it is read, INVALID_ARGUMENT).
        stages: where to add each request's ``decode`` and ``encode`` time (:mod:`dmoe.server.profile`); None: none.
        shared_memory: the clients' segments this server maps for ``call_shared`` (:mod:`dmoe.wire.shared_memory`);
            None: it refuses them, and clients on this host call the plain way.
        max_holds: ``hold`` calls open at once beyond this are refused (RESOURCE_EXHAUSTED): each is a coroutine
            and an HTTP/2 stream here, and a client opens one per channel.
        max_holds_per_host: the same, for the calls of one client machine, so that one cannot take them all (a
            client refused a hold calls on without one, a little slower).
        max_hold_seconds: no ``hold`` call is answered later than this.
        max_queued_bytes: requests whose inputs would take the bytes of the requests queued or computing beyond this
            are refused (RESOURCE_EXHAUSTED), so that clients sending faster than the experts compute (or on
            purpose) cannot queue up the server's memory; a request alone is never refused for its size here.
            Streamed requests count their messages as they arrive, and may count at most :data:`STREAMS_SHARE` of it
            while anything else is queued or arriving. A request read in place counts the whole message its inputs
            keep alive (padding a small request does not make it count less), every queued call counts at least
            :data:`QUEUED_CALL_BYTES` (each item of a batch :data:`QUEUED_ITEM_BYTES`), and answers count from their
            computation until their call ends (:data:`UNARY_ANSWER_COPIES`): a client that never reads its answers
            would otherwise hold them in memory uncounted; one host's answers not taken beyond
            :data:`HOST_SHARE` of this refuse that host's requests.
        max_streams: streamed calls open at once beyond this are refused (RESOURCE_EXHAUSTED).
        max_streams_per_host: the same, for the calls of one client machine.
        max_stream_seconds: a streamed request not received whole this long after its call began is refused
            (DEADLINE_EXCEEDED), so that a stalled stream does not hold its bytes (and its share of
            ``max_queued_bytes``) for ever.
    """

    def __init__(self, experts: dict[str, HostedExpert], runtime: Runtime, *, max_batch_size: int, device: str,
                 default_compression: int = NONE, max_stream_bytes: int = 1 << 30,
                 stream_part_bytes: int = STREAM_PART_BYTES, faults: Faults | None = None,
                 reject_nonfinite: bool = True, max_abs_value: float | None = None,
                 max_batch_items: int = MAX_BATCH_ITEMS, stages: StageClock | None = None,
                 shared_memory: SegmentMaps | None = None, max_holds: int = 4096,
                 max_holds_per_host: int = 256, max_hold_seconds: float = 60.0, max_queued_bytes: int = 1 << 30,
                 max_streams: int = 1024, max_streams_per_host: int = 256, max_stream_seconds: float = 120.0):
        self.experts, self.runtime = experts, runtime
        self.max_batch_size, self.device = max_batch_size, device
        self.default_compression = default_compression
        self.max_stream_bytes, self.stream_part_bytes = max_stream_bytes, stream_part_bytes
        self.faults = faults
        self.reject_nonfinite, self.max_abs_value = reject_nonfinite, max_abs_value
        self.max_batch_items = max_batch_items
        self.stages = stages
        self.shared_memory = shared_memory
        self.max_holds, self.max_hold_seconds = max_holds, max_hold_seconds
        self.max_holds_per_host = max_holds_per_host
        self.holds = 0  # hold calls open now
        self.holds_by_host: dict[str, int] = {}
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0  # inputs of the requests queued or computing now
        self.queued_by_host: dict[str, int] = {}  # the same, by the host they came from
        self.arriving_bytes = 0  # messages of the streamed requests still arriving
        self.answer_bytes = 0  # answers computed whose call has not ended (read whole, cancelled or past deadline)
        self.answers_by_host: dict[str, int] = {}  # the same, by the host they go to
        self.max_streams, self.max_streams_per_host = max_streams, max_streams_per_host
        self.max_stream_seconds = max_stream_seconds
        self.streams = 0  # streamed calls open now (until their request is answered or refused)
        self.streams_by_host: dict[str, int] = {}
        self._queued_lock = threading.Lock()  # (released by the runtime's workers)
        self._stopping = asyncio.Event()  # set on the server's loop by release_holds()

    def _lookup(self, uid: str) -> HostedExpert:
        expert = self.experts.get(uid)
        if expert is None:
            shown = repr(uid) if len(uid) <= 200 else f"{uid[:200]!r}... ({len(uid)} characters)"
            # (a long uid quoted whole made the status larger than gRPC's metadata limit: RESOURCE_EXHAUSTED)
            raise RequestRejected(grpc.StatusCode.NOT_FOUND, f"expert {shown} is not hosted on this server")
        return expert

    async def _expert(self, uid: str, context: grpc.aio.ServicerContext) -> HostedExpert:
        try:
            return self._lookup(uid)
        except RequestRejected as rejected:
            await context.abort(rejected.code, rejected.message)

    async def info(self, request: dmoe_pb2.ExpertUID, context: grpc.aio.ServicerContext) -> dmoe_pb2.ExpertInfo:
        """The expert's schema and counters. Its answer counts among the held ones as any other's
        (:meth:`_answer_held`), and it is refused as they are: uncounted, a client that never read its answers grew
        the server by ~25 MiB/s, never refused (review 84)."""
        backend = (await self._expert(request.uid, context)).backend
        answer = dmoe_pb2.ExpertInfo(
            uid=request.uid, expert_cls=backend.expert_cls,
            inputs=[dmoe_pb2.TensorSchema(shape=s.shape, dtype=s.dtype) for s in backend.inputs_schema],
            outputs=[dmoe_pb2.TensorSchema(shape=s.shape, dtype=s.dtype) for s in backend.outputs_schema],
            max_batch_size=self.max_batch_size, device=self.device, hparams_json=backend.hparams_json(),
            forward_calls=backend.forward_calls, backward_calls=backend.backward_calls, updates=backend.updates,
        )
        extra = UNARY_ANSWER_COPIES * answer.ByteSize()
        try:
            with self._queued_lock:
                self._check_room(max(extra, ANSWERED_CALL_BYTES), peer_machine(context.peer()))
        except RequestRejected as rejected:
            await context.abort(rejected.code, rejected.message)
        self._answer_held(context, (), 1, extra=extra)
        return answer

    async def hold(self, request: dmoe_pb2.Hold, context: grpc.aio.ServicerContext) -> dmoe_pb2.HoldEnd:
        """Answers after ``request.seconds`` (at most :attr:`max_hold_seconds`), or at once when the server begins
        to stop: a client keeps one such call open per channel, see ``Hold`` in proto/dmoe.proto."""
        if not 0.0 <= request.seconds < float("inf"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"hold seconds must be finite and >= 0, got {request.seconds}")
        if self.holds >= self.max_holds:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this server keeps at most {self.max_holds} hold calls open")
        host = peer_machine(context.peer())
        if self.holds_by_host.get(host, 0) >= self.max_holds_per_host:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this server keeps at most "
                                f"{self.max_holds_per_host} hold calls of one host open")
        self.holds += 1
        self.holds_by_host[host] = self.holds_by_host.get(host, 0) + 1
        try:
            try:
                await asyncio.wait_for(self._stopping.wait(), min(request.seconds, self.max_hold_seconds))
            except asyncio.TimeoutError:
                pass
            return dmoe_pb2.HoldEnd(stopping=self._stopping.is_set())
        finally:
            self.holds -= 1
            self.holds_by_host[host] -= 1
            if not self.holds_by_host[host]:
                del self.holds_by_host[host]

    def release_holds(self) -> None:
        """Answers every open ``hold`` call, and any later one at once (run on the server's event loop, before it
        stops: gRPC's graceful stop would otherwise wait out its grace period on them)."""
        self._stopping.set()

    async def _call(self, kind: str, uid: str, tensors: Sequence[Any], compression: int,
                    context: grpc.aio.ServicerContext, activation_id: bytes = b"") -> list[OutgoingTensor]:
        try:
            return await self._compute(kind, uid, tensors, compression, activation_id,
                                       host=peer_machine(context.peer()))
        except RequestRejected as rejected:
            await context.abort(rejected.code, rejected.message)

    async def _compute(self, kind: str, uid: str, tensors: Sequence[Any], compression: int,
                       activation_id: bytes = b"", delay: bool = True, shared: bool = False,
                       arrival: Arrival | None = None, host: str = "") -> list[OutgoingTensor]:
        """Validates one expert's request (``dmoe.Tensor`` messages or :mod:`dmoe.wire.zerocopy` views), runs it on
        the runtime and packs the answer (the tensors' memory, written into the response by gRPC's serializer).

        Raises :class:`RequestRejected` with the status to answer (a call of its own, or one item of a batch).
        ``delay``: injected faults include the round trip's delay (a batch pays it once for all of its items).
        ``shared``: see :meth:`_decode`. ``arrival``: a streamed request's bytes, counted as they arrived.
        ``host``: the caller's, whose queued bytes are counted apart (:data:`HOST_SHARE`).
        """
        expert, inputs = self._decode(kind, uid, tensors, compression, activation_id, shared, host)
        if self.faults is not None:
            try:
                await self.faults.apply(delay=delay)  # the round trip's delay, then maybe a failure instead
            except InjectedFailure as failure:
                raise RequestRejected(failure.code, f"{kind} of {uid}: {failure}") from None
        future = self._submit(kind, expert, inputs, kept_key(host, activation_id), arrival=arrival, host=host,
                              message_bytes=0 if shared or arrival is not None else _message_bytes(tensors))
        await _all_done([future])
        return self._answer(kind, uid, future, compression)

    def _decode(self, kind: str, uid: str, tensors: Sequence[Any], compression: int, activation_id: bytes,
                shared: bool, host: str = "") -> tuple[HostedExpert, list[torch.Tensor]]:
        """The expert and the inputs of one request, validated (raises :class:`RequestRejected`).

        ``shared``: the request's bytes hold other items too. Inputs kept for a backward are then copied on a CPU
        server: a view would hold the whole message in memory while the activation cache counts only its rows. So
        are the inputs of a request of its own read in place from a message much larger than they are (fields the
        reader skips, such as padding, would otherwise be kept for the activation's lifetime, uncounted).
        """
        expert = self._lookup(uid)
        started = time.perf_counter() if self.stages is not None else 0.0
        check_options(compression, activation_id)
        schemas, held = expert.schemas(kind), None
        if kind == BACKWARD and activation_id and len(tensors) == len(expert.grad_schemas()):
            # the gradients alone: the inputs are those the server held since the forward with this id
            schemas, held = expert.grad_schemas(), expert.held_inputs(kept_key(host, activation_id))
            if held is None:
                raise RequestRejected(grpc.StatusCode.FAILED_PRECONDITION,
                                      "this server holds no inputs for this activation_id (never sent, expired or "
                                      "evicted): send them with the gradients")
        inputs = validate(tensors, schemas, self.max_batch_size)
        problem = first_bad_values(inputs, schemas, reject_nonfinite=self.reject_nonfinite,
                                   max_abs_value=self.max_abs_value)
        if problem is not None:
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if held is not None:
            if held[0].shape[0] != inputs[0].shape[0]:
                raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"grad_output 0 has {inputs[0].shape[0]} rows, but the forward with this "
                                      f"activation_id had {held[0].shape[0]}")
            inputs = [*held, *inputs]
        elif kind == FORWARD and activation_id and self.device == "cpu" and (shared or _pins_more(tensors)):
            inputs = [x.clone() for x in inputs]
        if self.stages is not None:
            self.stages.add("decode", time.perf_counter() - started)
        return expert, inputs

    def _check_room(self, nbytes: int, host: str) -> tuple[int, int]:
        """Raises :class:`RequestRejected` when ``host``'s answers not yet taken exceed its :data:`HOST_SHARE` of
        :attr:`max_queued_bytes`, or when ``nbytes`` more would take what the server holds (requests queued or
        arriving, answers) past it (a call alone on an idle server is never refused for its size); else returns
        (bytes held, ``host``'s answers not yet taken). For every call that queues or answers (``info`` too); the
        caller holds ``_queued_lock``."""
        unread = self.answers_by_host.get(host, 0)
        if unread > self.max_queued_bytes * HOST_SHARE:
            raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"this server holds {unread / 2**20:.0f} MiB of answers to this host that it has "
                                  f"not taken, at most {HOST_SHARE:.0%} of {self.max_queued_bytes / 2**20:.0f} MiB "
                                  "(--max-queued-mb): read them first")
        held = self.queued_bytes + self.arriving_bytes + self.answer_bytes
        if held and held + nbytes > self.max_queued_bytes:
            raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"this server has {held / 2**20:.0f} MiB of requests waiting for its experts or "
                                  f"arriving and of answers not yet taken, at most "
                                  f"{self.max_queued_bytes / 2**20:.0f} MiB (--max-queued-mb): try again later, or "
                                  "another server")
        return held, unread

    def _reserve(self, nbytes: int, host: str = "") -> None:
        """Counts ``nbytes`` of inputs of ``host``'s as queued, or raises :class:`RequestRejected` as
        :meth:`_check_room` does, or when ``host``'s would take more than :data:`HOST_SHARE` of
        :attr:`max_queued_bytes` while another host's are queued or arriving."""
        with self._queued_lock:
            held, unread = self._check_room(nbytes, host)
            mine = self.queued_by_host.get(host, 0) + unread
            if held > mine and mine + nbytes > self.max_queued_bytes * HOST_SHARE:
                raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"this server has {mine / 2**20:.0f} MiB of requests of this host waiting for "
                                      f"its experts while other hosts' wait too, at most {HOST_SHARE:.0%} of "
                                      f"{self.max_queued_bytes / 2**20:.0f} MiB (--max-queued-mb): try again later")
            self.queued_bytes += nbytes
            self.queued_by_host[host] = self.queued_by_host.get(host, 0) + nbytes  # (mine counts answers too)

    def _arrive(self, arrival: Arrival, nbytes: int) -> None:
        """Counts one more message of ``nbytes`` of a streamed request still arriving, or raises
        :class:`RequestRejected` when it would take the bytes queued or arriving past :attr:`max_queued_bytes`, or
        those of the streams arriving past their share (:data:`STREAMS_SHARE`); a stream alone on an idle server is
        never refused for its size."""
        with self._queued_lock:
            held = self.queued_bytes + self.arriving_bytes + self.answer_bytes
            if held > arrival.bytes and (held + nbytes > self.max_queued_bytes or
                                         self.arriving_bytes + nbytes > self.max_queued_bytes * STREAMS_SHARE):
                raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"this server has {held / 2**20:.0f} MiB of requests waiting for its experts "
                                      f"or arriving ({self.arriving_bytes / 2**20:.0f} MiB of them streams still "
                                      f"arriving), at most {self.max_queued_bytes / 2**20:.0f} MiB (--max-queued-mb)"
                                      f", of which streams still arriving {STREAMS_SHARE:.0%}: try again later, or "
                                      "another server")
            self.arriving_bytes += nbytes
            arrival.bytes += nbytes

    def _left(self, arrival: Arrival) -> None:
        """Stops counting what a streamed request counted as it arrived (it ended without being queued)."""
        with self._queued_lock:
            self.arriving_bytes -= arrival.bytes
            arrival.bytes = 0

    def _submit(self, kind: str, expert: HostedExpert, inputs: Sequence[torch.Tensor], key: ActivationKey | None,
                reserved: bool = False, arrival: Arrival | None = None, host: str = "",
                message_bytes: int = 0, floor: int = QUEUED_CALL_BYTES) -> "Future[list[torch.Tensor]]":
        """Queues a decoded request on the expert's forward or backward pool: the runtime's future. Its inputs are
        counted as queued until it is done (:meth:`_reserve`, unless the caller ``reserved`` them; a streamed
        request's ``arrival``, admitted as it arrived, is counted as its inputs instead, whatever the budget), or
        ``message_bytes`` if more (the message its inputs are views of), or ``floor`` if more still (what waiting
        costs the server whatever the inputs' size)."""
        nbytes = max(sum(x.nbytes for x in inputs), message_bytes, floor)
        if arrival is not None:
            with self._queued_lock:
                self.arriving_bytes -= arrival.bytes
                arrival.bytes = 0
                self.queued_bytes += nbytes
                self.queued_by_host[host] = self.queued_by_host.get(host, 0) + nbytes
        elif not reserved:
            self._reserve(nbytes, host)
        if kind == FORWARD:
            expert.backend.forward_calls += 1
            future = self.runtime.submit(expert.forward_pool, *inputs, activation_id=key)
        else:
            expert.backend.backward_calls += 1
            future = self.runtime.submit(expert.backward_pool, *inputs, activation_id=key)
        future.add_done_callback(lambda _: self._dequeued(nbytes, host))
        return future

    def _dequeued(self, nbytes: int, host: str = "") -> None:
        with self._queued_lock:
            self.queued_bytes -= nbytes
            left = self.queued_by_host[host] = self.queued_by_host.get(host, 0) - nbytes
            if not left:
                del self.queued_by_host[host]

    def _answer(self, kind: str, uid: str, future: "Future[list[torch.Tensor]]",
                compression: int) -> list[OutgoingTensor]:
        """The packed outputs of a done runtime future (raises :class:`RequestRejected` for its failure)."""
        try:
            outputs = future.result(timeout=0)
        except PoolRemoved:  # the expert was removed between the call's look-up and its queueing
            raise RequestRejected(grpc.StatusCode.NOT_FOUND,
                                  f"expert {uid!r} is no longer hosted on this server") from None
        except Exception as exc:
            if is_out_of_memory(exc):  # even alone, and after the server freed what it could
                raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"{kind} of {uid}: the server's device ran out of memory ({exc}); send fewer "
                                      "rows or try another server") from None
            raise RequestRejected(grpc.StatusCode.INTERNAL,
                                  f"{kind} of {uid} failed on the server: {type(exc).__name__}: {exc}") from None
        compression = compression or self.default_compression
        started = time.perf_counter() if self.stages is not None else 0.0
        encoded = [pack(y, compression) for y in outputs]
        if self.stages is not None:
            self.stages.add("encode", time.perf_counter() - started)
        return encoded

    async def _batch(self, kind: str, request: dmoe_pb2.BatchRequest, context) -> BatchResponse:
        """Runs every item as its own call would run (concurrently, each on its own expert's task pool) and
        answers each item's outcome: one bad or failing item never fails the others.

        Without injected faults, the items are decoded and queued one after another and the handler wakes once,
        when all of them are done: a coroutine and a wake-up per item cost this loop, which decodes and encodes
        every request of the server, more than a small expert's compute (benchmarks/README.md, "On a GPU").
        """
        items = request.items
        if not items:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{kind}_batch: the request has no items")
        if len(items) > self.max_batch_items:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{kind}_batch: {len(items)} items, at most "
                                f"{self.max_batch_items} per call are allowed")
        shared, host = len(items) > 1, peer_machine(context.peer())
        if self.faults is not None:  # (an experiment's: each item counts its own inputs alone)
            await self.faults.wait()  # one round trip for the whole call
            return BatchResponse(list(await asyncio.gather(*(self._item(kind, item, shared, host)
                                                             for item in items))))
        decoded: list[Result | tuple[HostedExpert, list[torch.Tensor]]] = []
        for item in items:
            try:
                decoded.append(self._decode(kind, item.uid, item.tensors, item.response_compression,
                                            item.activation_id, shared, host))
            except RequestRejected as rejected:
                decoded.append(Result(code=rejected.code.value[0], message=rejected.message))
        inputs_bytes = sum(max(sum(x.nbytes for x in entry[1]), QUEUED_ITEM_BYTES)  # (as _submit counts each)
                           for entry in decoded if isinstance(entry, tuple))
        # the items' inputs are views of one message, which the call keeps alive: what it holds beyond their bytes
        # counts too, until they are all done (small inputs in a padded message count as the whole message), and
        # the call counts QUEUED_CALL_BYTES at least
        extra = max(0, _message_bytes([t for item in items for t in item.tensors]) - inputs_bytes,
                    QUEUED_CALL_BYTES - inputs_bytes)
        try:  # the call's items are queued together: one check of their bytes, as for a call of its own
            self._reserve(inputs_bytes + extra, host)
        except RequestRejected as rejected:
            refused = Result(code=rejected.code.value[0], message=rejected.message)
            return BatchResponse([entry if isinstance(entry, Result) else refused for entry in decoded])
        try:
            queued: list[Result | tuple[str, Future, int]] = [
                entry if isinstance(entry, Result) else
                (item.uid, self._submit(kind, *entry, kept_key(host, item.activation_id), reserved=True,
                                                 host=host, floor=QUEUED_ITEM_BYTES),
                 item.response_compression)
                for item, entry in zip(items, decoded)]
            await _all_done([entry[1] for entry in queued if isinstance(entry, tuple)])
        finally:
            self._dequeued(extra, host)
        results = []
        for entry in queued:
            if isinstance(entry, tuple):
                try:
                    entry = Result(self._answer(kind, *entry))
                except RequestRejected as rejected:
                    entry = Result(code=rejected.code.value[0], message=rejected.message)
            results.append(entry)
        return BatchResponse(results)  # in the items' order

    async def _item(self, kind: str, item: dmoe_pb2.ExpertRequest, shared: bool, host: str = "") -> Result:
        try:
            return Result(await self._compute(kind, item.uid, item.tensors, item.response_compression,
                                                  item.activation_id, delay=False, shared=shared, host=host))
        except RequestRejected as rejected:
            return Result(code=rejected.code.value[0], message=rejected.message)

    async def forward(self, request: dmoe_pb2.ExpertRequest, context) -> Response:
        outputs = await self._call(FORWARD, request.uid, request.tensors, request.response_compression, context,
                                   request.activation_id)
        self._answer_held(context, outputs, UNARY_ANSWER_COPIES)
        return Response(outputs)

    async def backward(self, request: dmoe_pb2.ExpertRequest, context) -> Response:
        outputs = await self._call(BACKWARD, request.uid, request.tensors, request.response_compression, context,
                                   request.activation_id)
        self._answer_held(context, outputs, UNARY_ANSWER_COPIES)
        return Response(outputs)

    async def forward_batch(self, request: dmoe_pb2.BatchRequest, context) -> BatchResponse:
        answer = await self._batch(FORWARD, request, context)
        self._answer_held(context, [t for result in answer.results for t in result.tensors], UNARY_ANSWER_COPIES)
        return answer

    async def backward_batch(self, request: dmoe_pb2.BatchRequest, context) -> BatchResponse:
        answer = await self._batch(BACKWARD, request, context)
        self._answer_held(context, [t for result in answer.results for t in result.tensors], UNARY_ANSWER_COPIES)
        return answer

    def _answer_held(self, context: grpc.aio.ServicerContext, outputs: Sequence[OutgoingTensor],
                     copies: int, extra: int = 0) -> None:
        """Counts an answer about to be sent (``copies`` times its tensors' bytes, plus ``extra`` bytes, at least
        :data:`ANSWERED_CALL_BYTES`) among the bytes this server holds (:meth:`_reserve`) until its call ends: read
        whole, cancelled or past its deadline. gRPC keeps an answer the client does not read (HTTP/2 flow control)
        until then, and nothing else counted it (review 55)."""
        nbytes = max(copies * _answer_bytes(outputs) + extra, ANSWERED_CALL_BYTES)
        host = peer_machine(context.peer())
        with self._queued_lock:
            self.answer_bytes += nbytes
            self.answers_by_host[host] = self.answers_by_host.get(host, 0) + nbytes
        context.add_done_callback(lambda _: self._answer_ended(nbytes, host))

    def _answer_ended(self, nbytes: int, host: str) -> None:
        with self._queued_lock:
            self.answer_bytes -= nbytes
            left = self.answers_by_host[host] = self.answers_by_host[host] - nbytes
            if not left:
                del self.answers_by_host[host]

    async def call_shared(self, request: SharedCall, context) -> SharedAnswer:
        """forward, backward or a batch of either, its request and answer in the client's segment."""
        call = request.call
        if self.shared_memory is None:
            return SharedAnswer(refused="this server does not map clients' memory (--no-shared-memory)")
        kind, _, batch = call.method.partition("_")
        if kind not in (FORWARD, BACKWARD) or batch not in ("", "batch"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"call_shared: unknown method {truncated(call.method, 40)!r} (forward, backward, "
                                "forward_batch or backward_batch)")
        try:
            segment = self.shared_memory.open(call, context.peer())
        except Refused as refused:
            return SharedAnswer(refused=str(refused))
        except BadCall as bad:
            await context.abort(bad.code, f"call_shared: {bad.message}")
        started = time.perf_counter()
        data = segment.read(call.request_offset, call.request_length)
        try:
            parsed = (parse_batch_request if batch else parse_request)(data)
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "call_shared: the request in the segment is not a "
                                f"valid {'BatchRequest' if batch else 'ExpertRequest'}")
        if self.stages is not None:  # part of the items' decode (for the plain calls, gRPC does this unprofiled)
            self.stages.add("decode", time.perf_counter() - started, count=0)
        request.parsed = parsed
        if batch:
            answer = await self._batch(kind, parsed, context)
            message = batch_response_message(answer)
        else:
            answer = Response(await self._call(kind, parsed.uid, parsed.tensors, parsed.response_compression,
                                               context, parsed.activation_id))
            message = response_message(answer)
        # an answer written into the client's segment: the call alone is counted. One the segment has no room for
        # (the client offers what room it likes, none included) goes inline in gRPC's answer, held until read as a
        # plain call's is: uncounted, a client that never read them took a server from 253 to 873 MiB (review 71)
        inline = message.size > call.answer_capacity
        self._answer_held(context, (), 1, extra=UNARY_ANSWER_COPIES * message.size if inline else 0)
        return SharedAnswer(answer, message, segment, call.answer_offset, call.answer_capacity)

    async def _stream(self, kind: str, requests: AsyncIterator[dmoe_pb2.ExpertRequest], context) -> None:
        """Receives a request streamed in parts (each message counted as it arrives, :meth:`_arrive`), runs it and
        streams the answer back in parts (``context.write``). The call counts among the open streams (and its
        host's) until it ends, not when its answer is computed: a client that never reads its answers holds them in
        the server's memory, so they are bounded as the requests' streams are (review 48). An answer not taken
        within ``max_stream_seconds`` ends this handler; gRPC lets the call go at the client's deadline or cancel."""
        host = peer_machine(context.peer())
        if self.streams >= self.max_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this server keeps at most {self.max_streams} streamed calls open")
        if self.streams_by_host.get(host, 0) >= self.max_streams_per_host:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this server keeps at most "
                                f"{self.max_streams_per_host} streamed calls of one host open")
        self.streams += 1
        self.streams_by_host[host] = self.streams_by_host.get(host, 0) + 1
        # counted until the call itself ends (read whole, cancelled, or past its deadline), not when this handler
        # returns: an answer nobody reads is held by gRPC until then
        context.add_done_callback(lambda _: self._stream_ended(host))
        arrival, rejection = Arrival(), None
        try:
            try:
                try:
                    uid, compression, activation_id, tensors = await asyncio.wait_for(
                        self._receive(kind, requests, arrival), self.max_stream_seconds)
                except asyncio.TimeoutError:
                    raise RequestRejected(grpc.StatusCode.DEADLINE_EXCEEDED, "the streamed request did not arrive "
                                          f"whole within {self.max_stream_seconds:g} s") from None
                outputs = await self._compute(kind, uid, tensors, compression, activation_id, arrival=arrival,
                                              host=host)
            except RequestRejected as rejected:
                rejection = (rejected.code, rejected.message)
            if rejection is not None:  # (out of the except clause, whose traceback holds the received messages)
                self._left(arrival)  # before the abort's wait: the next stream's message may count them
                await context.abort(*rejection)
            del tensors  # (its arrival's bytes count as its queued inputs now, until it is computed)
            self._answer_held(context, outputs, 1)  # (sent in parts: the tensors, and a part at a time besides)
            deadline = time.monotonic() + self.max_stream_seconds
            for group in cut_into_parts(outputs, self.stream_part_bytes):
                try:
                    await asyncio.wait_for(context.write(dmoe_pb2.ExpertResponse(tensors=group)),
                                           max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    # ended, not aborted: an abort's status would wait behind the unread answer. The call itself
                    # lasts until the client's deadline or cancel, and counts as an open stream until then
                    logger.info("a streamed answer to %s was not read whole within %g s: its handler ends",
                                host, self.max_stream_seconds)
                    raise asyncio.CancelledError from None
        finally:
            self._left(arrival)

    def _stream_ended(self, host: str) -> None:
        self.streams -= 1
        self.streams_by_host[host] -= 1
        if not self.streams_by_host[host]:
            del self.streams_by_host[host]

    async def _receive(self, kind: str, requests: AsyncIterator[dmoe_pb2.ExpertRequest],
                       arrival: Arrival) -> tuple[str, int, bytes, list[dmoe_pb2.Tensor]]:
        """(uid, response compression, activation id, the tensors joined from their parts) of a streamed request;
        raises :class:`RequestRejected`. Every message is kept until the stream ends, whatever it holds besides
        tensors (fields of no use, or none at all): its whole size counts (:meth:`_arrive`), and the count of
        messages is bounded too."""
        uid, compression, groups, limit = None, NONE, [], self.max_stream_bytes
        payload = parts = max_parts = received = messages = 0
        activation_id = b""
        async for message in requests:
            if uid is None:
                uid, compression, activation_id = message.uid, message.response_compression, message.activation_id
                # refuse an unknown expert, or more bytes than a valid request can have, before buffering them
                expert = self._lookup(uid)
                limit = min(limit, expert.max_payload_bytes(kind, self.max_batch_size))
                max_parts = stream_parts_limit(limit, len(expert.schemas(kind)))
            size = message.ByteSize()
            payload += message_bytes(message.tensors)
            parts += len(message.tensors)
            received += size
            messages += 1
            if payload > limit or received > (limit + STREAM_MESSAGE_SLACK_BYTES
                                               + (messages + parts) * STREAM_PART_SLACK_BYTES):
                why = ("the server's limit per streamed request (--max-stream-mb)" if limit == self.max_stream_bytes
                       else f"more than a valid {kind} of {uid} (max_batch_size {self.max_batch_size}) can carry")
                raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"streamed request exceeds {limit} bytes, {why}")
            if parts > max_parts or messages > max_parts:
                raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"streamed request has more than {max_parts} tensor parts or messages, more "
                                      f"than a valid {kind} of {uid} needs")
            self._arrive(arrival, size)
            groups.append(message.tensors)
        if uid is None:
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, "empty stream")
        started = time.perf_counter()
        try:
            tensors = join_parts(_forgotten_as_read(groups), limit)
        except (InvalidTensor, TensorTooLarge) as error:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, TensorTooLarge)
                    else grpc.StatusCode.INVALID_ARGUMENT)
            raise RequestRejected(code, str(error)) from None
        if self.stages is not None:  # part of this request's decode (counted once, with its validation)
            self.stages.add("decode", time.perf_counter() - started, count=0)
        return uid, compression, activation_id, tensors

    async def forward_stream(self, request_iterator, context) -> None:
        await self._stream(FORWARD, request_iterator, context)

    async def backward_stream(self, request_iterator, context) -> None:
        await self._stream(BACKWARD, request_iterator, context)


def _forgotten_as_read(groups: list[Any]) -> Iterator[Any]:
    """Yields the groups in order, dropping each from the list as it goes: a received message is freed once its
    parts are copied into the joined tensors, not held beside them to the end of the join."""
    groups.reverse()
    while groups:
        yield groups.pop()


def add_to_server(servicer: ExpertServicer, server: grpc.aio.Server) -> None:
    """Serves ``servicer`` as ``dmoe.ExpertService`` on ``server``: the generated registration, except that
    forward/backward and their batched forms read and write their messages with :mod:`dmoe.wire.zerocopy`."""
    stages = servicer.stages

    def timed(write: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
        if stages is None:
            return write

        def write_timed(answer: Any) -> bytes:
            started = time.perf_counter()
            data = write(answer)
            stages.add("encode", time.perf_counter() - started, count=0)  # part of the items' encode
            return data
        return write_timed

    def unary(behavior, read, write):
        return grpc.unary_unary_rpc_method_handler(behavior, request_deserializer=read,
                                                   response_serializer=timed(write))

    def streamed(behavior):
        return grpc.stream_stream_rpc_method_handler(behavior, request_deserializer=dmoe_pb2.ExpertRequest.FromString,
                                                     response_serializer=dmoe_pb2.ExpertResponse.SerializeToString)

    handlers = {
        "info": grpc.unary_unary_rpc_method_handler(servicer.info, request_deserializer=dmoe_pb2.ExpertUID.FromString,
                                                    response_serializer=dmoe_pb2.ExpertInfo.SerializeToString),
        "hold": grpc.unary_unary_rpc_method_handler(servicer.hold, request_deserializer=dmoe_pb2.Hold.FromString,
                                                    response_serializer=dmoe_pb2.HoldEnd.SerializeToString),
        "forward": unary(servicer.forward, parse_request, response_bytes),
        "backward": unary(servicer.backward, parse_request, response_bytes),
        "forward_stream": streamed(servicer.forward_stream),
        "backward_stream": streamed(servicer.backward_stream),
        "forward_batch": unary(servicer.forward_batch, parse_batch_request, batch_response_bytes),
        "backward_batch": unary(servicer.backward_batch, parse_batch_request, batch_response_bytes),
        "call_shared": unary(servicer.call_shared, SharedCall.from_bytes, SharedAnswer.to_bytes),
    }
    missing = set(dmoe_pb2.DESCRIPTOR.services_by_name["ExpertService"].methods_by_name) - set(handlers)
    if missing:  # a method added to proto/dmoe.proto must be served here too
        raise RuntimeError(f"ExpertService methods without a handler: {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("dmoe.ExpertService", handlers),))
    server.add_registered_method_handlers("dmoe.ExpertService", handlers)
