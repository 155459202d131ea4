"""Calling experts on other machines: non-blocking ``forward_future``/``backward_future``, their per-server
batched forms ``forward_futures``/``backward_futures``, and ``RemoteExpert``.

Calls go through the sync gRPC stack's ``.future()``, so starting one costs a serialisation (and, on a channel
with no other call in flight, a thread to poll it: the channel pool keeps a call held open on each channel in use,
:class:`~dmoe.wire.channels.HeldCall`, so that the thread stays): the gating layer can start all of its calls at
once and wait for the first ones. Payloads larger than
one message are streamed in parts by a short-lived thread that ends with its call.
"""
from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Iterable, Iterator, Sequence

import grpc
import torch
from torch import nn

from dmoe.wire import MAX_BATCH_ITEMS, MAX_MESSAGE_BYTES, STREAM_PART_BYTES, ChannelPool, dmoe_pb2, status_code
from dmoe.wire.channels import MAX_STATUS_CHARS, described, truncated
from dmoe.wire.codec import (DTYPES, FLOAT16, NONE, UINT8, UINT8_BLOCK, InvalidTensor, TensorTooLarge, Compression,
                             cut_into_parts, deserialize, dtype_name, encoded_bytes, join_parts, pack,
                             parse_compression, serialize)
from dmoe.wire.zerocopy import MAX_FIELDS, OverBudget, batch_request_message, item_fields, request_message

logger = logging.getLogger(__name__)

#: Requests above this many tensor bytes are streamed (headroom for the message's own fields).
UNARY_LIMIT_BYTES = MAX_MESSAGE_BYTES - 1024 * 1024

#: dtypes :func:`all_finite` checks with numpy, without a copy
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no value of ``tensor`` is NaN or infinite: checked before gradients are sent, as servers refuse them.

    On the host with numpy, as the servers check (the smallest and the largest value: NaN makes both NaN; two
    passes, no copy, on the calling thread: a large torch op on a CPU tensor starts torch's OpenMP team, whose
    threads then spin). Elsewhere one reduction on the tensor's device.
    """
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    if tensor.device.type == "cpu" and tensor.dtype in _NUMPY_FLOATS:
        values = tensor.detach().numpy()
        return math.isfinite(values.min()) and math.isfinite(values.max())
    return bool(torch.isfinite(tensor).all())


def value_range(tensor: torch.Tensor) -> tuple[float, float]:
    """The smallest and the largest value of ``tensor`` (NaN if it holds any NaN; (0, 0) for an empty or integer
    tensor): on the host with numpy (two passes, no copy, as :func:`all_finite`), elsewhere one reduction on the
    tensor's device. Both finiteness and magnitude follow from them."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return 0.0, 0.0
    if tensor.device.type == "cpu" and tensor.dtype in _NUMPY_FLOATS:
        values = tensor.detach().numpy()
        return float(values.min()), float(values.max())
    low, high = torch.aminmax(tensor.detach().float())
    return float(low), float(high)


def loss_scale(scaler: Any) -> float:
    """The scale a ``torch.amp.GradScaler`` multiplies the loss by now (1.0 for None or a disabled one)."""
    if scaler is None or not scaler.is_enabled():
        return 1.0
    scale = float(scaler.get_scale())
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"the grad scaler's scale is {scale}: expected a positive finite number")
    return scale


#: what the warning of a backward whose gradients are not finite says, after where it happened
NON_FINITE_GRADIENTS = ("output gradients are non-finite (NaN or Inf: usually a mixed-precision overflow, whose "
                        "step torch.amp.GradScaler skips), so they were not sent and no expert steps on them; "
                        "the input gradients are NaN")


#: the longest hyper-parameters an ``info`` answer may carry: an expert's constructor keywords take a few hundred
#: characters; anything near this is a server making its callers parse junk
MAX_HPARAMS_CHARS = 64 * 1024
#: the most characters of a server's message that a client keeps (in its errors, and so in its log)
MAX_SERVER_MESSAGE_CHARS = MAX_STATUS_CHARS


class RemoteExpertError(RuntimeError):
    """A call to a remote expert failed: the server's status code and message (timeouts: DEADLINE_EXCEEDED).

    The message is cut to :data:`MAX_SERVER_MESSAGE_CHARS` (:func:`truncated`): it is the server's to choose."""

    def __init__(self, uid: str, endpoint: str, code: grpc.StatusCode, message: str):
        message = truncated(message)
        super().__init__(f"expert {uid} at {endpoint}: {code.name}: {message}")
        self.uid, self.endpoint, self.code, self.message = uid, endpoint, code, message

    def __reduce__(self):
        return type(self), (self.uid, self.endpoint, self.code, self.message)


class MalformedAnswer(RemoteExpertError):
    """An answer that is not what was asked (how many tensors, their shapes, dtypes, compression or size): refused
    before any of its tensors is decoded, and the expert's failure (a layer drops and bans it)."""

    def __init__(self, uid: str, endpoint: str, problem: str):
        super().__init__(uid, endpoint, grpc.StatusCode.INTERNAL, f"malformed answer: {problem}")
        self.problem = problem

    def __reduce__(self):
        return type(self), (self.uid, self.endpoint, self.problem)


#: What an answer must hold: a (shape, dtype) per tensor, in order (the shapes with their batch dimension).
Expected = Sequence[tuple[Sequence[int], torch.dtype]]

#: The most payload bytes of a streamed answer whose tensors the caller did not say (``expect=None``): as much as
#: servers accept of a streamed request by default.
MAX_UNKNOWN_ANSWER_BYTES = 1 << 30
#: Room beyond the largest encoding of the expected tensors in a streamed answer.
ANSWER_MARGIN_BYTES = 4096
#: The smallest average part (bytes of payload) a streamed answer may be cut into, as servers require of streamed
#: requests: each part costs memory beyond its bytes (its message), so a stream of empty parts is bounded too.
MIN_ANSWER_PART_BYTES = 64


def answer_compressions(asked: int) -> frozenset[int]:
    """The compressions an answer's tensors may come in: the one asked, or none (what compression does not apply
    to travels as it is); a request asking none may get the server's own (``dmoe-server --compression``), whose
    decoding the checked shapes and dtypes bound."""
    return frozenset((asked, NONE)) if asked != NONE else frozenset((NONE, FLOAT16, UINT8))


def expected_bytes(expect: Expected) -> int:
    """The most payload bytes ``expect``'s tensors take in any encoding, with a margin: what a streamed answer may
    carry (its parts are refused beyond it as they arrive)."""
    total = ANSWER_MARGIN_BYTES
    for shape, dtype in expect:
        numel = math.prod(shape)
        total += numel * max(dtype.itemsize, 2) + -(-numel // UINT8_BLOCK) * 8  # float16 or uint8's scales
    return total


def header_problem(tensor: Any, index: int, expect: Expected | None, compressions: frozenset[int]) -> str | None:
    """What is wrong with an answer's tensor ``index`` before decoding it (None: nothing): its compression, and its
    shape and dtype when ``expect`` says them. Reads the header only (a buffer read copies the bytes)."""
    if tensor.compression not in compressions:
        asked = ", ".join(sorted(Compression.Name(c) for c in compressions))
        return f"tensor {index} comes in compression {tensor.compression}, expected {asked}"
    if expect is None:
        return None
    shape, dtype = expect[index]
    if tensor.dtype != dtype_name(dtype) or list(tensor.shape) != list(shape):
        return f"tensor {index}: expected {list(shape)} {dtype_name(dtype)!r}, got {described(tensor)}"
    return None


def _decoded(tensors: Sequence[Any], uid: str, endpoint: str, expect: Expected | None,
             compressions: frozenset[int]) -> list[torch.Tensor]:
    """An answer's tensors decoded, after checking every header against what was asked (:class:`MalformedAnswer`
    otherwise): a hostile server's tensors of other shapes, dtypes or compressions would decode to any size."""
    if expect is not None and len(tensors) != len(expect):
        raise MalformedAnswer(uid, endpoint, f"{len(tensors)} tensors, expected {len(expect)}")
    for i, tensor in enumerate(tensors):
        problem = header_problem(tensor, i, expect, compressions)
        if problem is not None:
            raise MalformedAnswer(uid, endpoint, problem)
    try:
        return [deserialize(t) for t in tensors]
    except (InvalidTensor, TensorTooLarge) as error:
        raise MalformedAnswer(uid, endpoint, str(error)) from None


def _checked_parts(responses: Iterable[Any], uid: str, endpoint: str, expect: Expected | None,
                   compressions: frozenset[int], max_bytes: int) -> Iterator[Sequence[Any]]:
    """A streamed answer's groups of parts, each tensor's header checked as its first part arrives, and no more
    parts than ``max_bytes`` cut into parts of :data:`MIN_ANSWER_PART_BYTES` (bytes: ``join_parts``)."""
    max_parts = (len(expect) if expect is not None else 1) + max_bytes // MIN_ANSWER_PART_BYTES
    heads = parts = 0
    for response in responses:
        group = response.tensors
        parts += len(group)
        if parts > max_parts:
            raise MalformedAnswer(uid, endpoint, f"a streamed answer of more than {max_parts} parts")
        for part in group:
            if part.parts:  # a tensor's first part, with its header (join_parts refuses continuations with one)
                if expect is not None and heads >= len(expect):
                    raise MalformedAnswer(uid, endpoint, f"more than {len(expect)} tensors")
                problem = header_problem(part, heads, expect, compressions)
                if problem is not None:
                    raise MalformedAnswer(uid, endpoint, problem)
                heads += 1
        yield group


def _settle(future: Future, fn: Callable[[], Any]) -> None:
    """Resolves ``future`` with ``fn()`` or its exception, unless the caller cancelled it meanwhile."""
    try:
        result = fn()
    except BaseException as error:  # noqa: BLE001 - every failure belongs to the caller
        result, failure = None, error
    else:
        failure = None
    try:
        if failure is None:
            future.set_result(result)
        else:
            future.set_exception(failure)
    except InvalidStateError:
        pass


def _call(method: str, endpoint: str, uid: str, tensors: Sequence[torch.Tensor], *, timeout: float | None,
          compression: int | str, channels: ChannelPool | None, unary_limit: int,
          activation_id: bytes | None, expect: Expected | None = None) -> "Future[list[torch.Tensor]]":
    channels = channels or ChannelPool.default()
    compression = parse_compression(compression)
    compressions = answer_compressions(compression)
    future: Future[list[torch.Tensor]] = Future()

    def failure(error: grpc.RpcError) -> RemoteExpertError:
        return RemoteExpertError(uid, endpoint, error.code(), error.details() or "")

    if sum(encoded_bytes(t, compression) for t in tensors) <= unary_limit:
        request = request_message(uid, [pack(t, compression) for t in tensors], compression, activation_id)
        call = getattr(channels.calls(endpoint), method).future(request, timeout=timeout)

        def unpack() -> list[torch.Tensor]:
            try:
                response = call.result()
            except grpc.RpcError as error:
                raise failure(error) from None
            return _decoded(response.tensors, uid, endpoint, expect, compressions)

        call.add_done_callback(lambda _: _settle(future, unpack))
        future.add_done_callback(lambda f: call.cancel() if f.cancelled() else None)
        return future

    messages = [serialize(t, compression) for t in tensors]

    def requests():
        for i, group in enumerate(cut_into_parts(messages, STREAM_PART_BYTES)):
            first = i == 0
            yield dmoe_pb2.ExpertRequest(uid=uid if first else "", tensors=group, response_compression=compression,
                                         activation_id=(activation_id or b"") if first else b"")

    stream = getattr(channels.stub(endpoint), f"{method}_stream")(requests(), timeout=timeout)
    future.add_done_callback(lambda f: stream.cancel() if f.cancelled() else None)

    max_bytes = expected_bytes(expect) if expect is not None else MAX_UNKNOWN_ANSWER_BYTES

    def receive() -> list[torch.Tensor]:
        try:
            tensors = join_parts(_checked_parts(stream, uid, endpoint, expect, compressions, max_bytes), max_bytes)
        except grpc.RpcError as error:
            raise failure(error) from None
        except BaseException as error:
            stream.cancel()  # read no further: the server may go on sending
            if isinstance(error, (InvalidTensor, TensorTooLarge)):
                raise MalformedAnswer(uid, endpoint, str(error)) from None
            raise
        return _decoded(tensors, uid, endpoint, expect, compressions)

    # the thread lives exactly as long as the call: it ends when the stream does (or is cancelled / times out)
    threading.Thread(target=_settle, args=(future, receive), name=f"dmoe-stream-{uid}", daemon=True).start()
    return future


def new_activation_id() -> bytes:
    """A fresh id linking a forward to the backward that will follow it (random: it cannot collide or be guessed)."""
    return secrets.token_bytes(16)


def forward_future(endpoint: str, uid: str, inputs: Sequence[torch.Tensor], *, timeout: float | None = None,
                   compression: int | str = NONE, channels: ChannelPool | None = None,
                   unary_limit: int = UNARY_LIMIT_BYTES, activation_id: bytes | None = None,
                   expect: Expected | None = None) -> "Future[list[torch.Tensor]]":
    """Starts expert ``uid``'s forward on ``inputs`` (each with a batch dimension) and returns at once.

    The future resolves to the outputs as CPU tensors, or fails with :class:`RemoteExpertError`. The outputs may
    share memory with the received message: clone before writing into them. ``compression`` packs the
    request and is asked of the response; ``unary_limit``: requests with more tensor bytes are streamed.
    ``activation_id`` (from :func:`new_activation_id`): a backward with the same id and inputs will follow, so
    the server may keep this forward's activations and skip recomputing them then. Leave it out when no
    backward will follow (inference), or the server holds them for nothing until they expire.

    ``expect``: the outputs' shapes (with the batch dimension) and dtypes, when known (``RemoteExpert`` and the
    layer know them): an answer of other tensors fails with :class:`MalformedAnswer` before any is decoded, and a
    streamed one as soon as it exceeds what they take. Without it, any tensors are decoded, a streamed answer up to
    :data:`MAX_UNKNOWN_ANSWER_BYTES`. Either way only the compression asked for (or none) is accepted.
    """
    return _call("forward", endpoint, uid, inputs, timeout=timeout, compression=compression, channels=channels,
                 unary_limit=unary_limit, activation_id=activation_id, expect=expect)


def input_gradients(inputs: Sequence[torch.Tensor]) -> Expected:
    """What a backward answers: a gradient of each input's shape and dtype."""
    return [(tuple(x.shape), x.dtype) for x in inputs]


def backward_future(endpoint: str, uid: str, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                    *, timeout: float | None = None, compression: int | str = NONE,
                    channels: ChannelPool | None = None, unary_limit: int = UNARY_LIMIT_BYTES,
                    activation_id: bytes | None = None) -> "Future[list[torch.Tensor]]":
    """Starts expert ``uid``'s backward: resolves to the gradients of ``inputs``; the server applies its step.

    ``activation_id``: the one the forward of these ``inputs`` was sent with, if any. Then only the gradients
    are sent at first, as the server holds the inputs since that forward; if it no longer does
    (FAILED_PRECONDITION), the call is made again with the inputs, within the same ``timeout``. An answer that is
    not a gradient of each input's shape and dtype fails with :class:`MalformedAnswer`, undecoded.
    """
    expect = input_gradients(inputs)

    def send(tensors: Sequence[torch.Tensor], seconds: float | None) -> "Future[list[torch.Tensor]]":
        return _call("backward", endpoint, uid, tensors, timeout=seconds, compression=compression, channels=channels,
                     unary_limit=unary_limit, activation_id=activation_id, expect=expect)

    if not activation_id:
        return send([*inputs, *grad_outputs], timeout)
    deadline = time.monotonic() + timeout if timeout is not None else None
    return _resend_with_inputs(send(grad_outputs, timeout), lambda seconds: send([*inputs, *grad_outputs], seconds),
                               deadline)


def _resend_with_inputs(first: "Future[list[torch.Tensor]]",
                        resend: Callable[[float | None], "Future[list[torch.Tensor]]"],
                        deadline: float | None) -> "Future[list[torch.Tensor]]":
    """``first``'s outcome, unless the server held no inputs for it (FAILED_PRECONDITION): then ``resend``'s, a
    call with the inputs made within what is left until ``deadline``."""
    result: Future[list[torch.Tensor]] = Future()

    def retry_with_inputs(done: Future) -> None:
        error = None if done.cancelled() else done.exception()
        if not (isinstance(error, RemoteExpertError) and error.code == grpc.StatusCode.FAILED_PRECONDITION):
            _settle(result, done.result)
            return
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        second = resend(remaining)
        result.add_done_callback(lambda f: second.cancel() if f.cancelled() else None)
        second.add_done_callback(lambda again: _settle(result, again.result))

    first.add_done_callback(retry_with_inputs)
    result.add_done_callback(lambda f: first.cancel() if f.cancelled() else None)
    return result


#: one expert's part of a batched call: (uid, endpoint, tensors, activation_id)
Item = tuple[str, str, Sequence[torch.Tensor], "bytes | None"]


def _batch_call(method: str, endpoint: str, items: Sequence[tuple[str, Sequence[torch.Tensor], bytes | None]], *,
                timeout: float | None, compression: int, channels: ChannelPool,
                expect: Sequence[Expected | None]) -> "list[Future[list[torch.Tensor]]]":
    """One ``{method}_batch`` call carrying every item (uid, tensors, activation_id); a future each, its answer
    checked against the item's ``expect``. An answer over the reader's budget, of items one of which had no
    ``expect``, is asked again in two halves, within what is left of ``timeout``.

    The request is written by :mod:`dmoe.wire.zerocopy`: the tensors' memory is copied once, into the message (or
    into memory shared with a server on this host, :mod:`dmoe.wire.shared_memory`)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    request = batch_request_message([(uid, [pack(t, compression) for t in tensors], activation_id)
                                   for uid, tensors, activation_id in items], compression)
    call = getattr(channels.calls(endpoint), f"{method}_batch").future(request, timeout=timeout)
    futures: list[Future[list[torch.Tensor]]] = [Future() for _ in items]
    compressions = answer_compressions(compression)

    def fail(uid: str, code: grpc.StatusCode, message: str) -> Callable[[], Any]:
        def raise_error():
            raise RemoteExpertError(uid, endpoint, code, message)
        return raise_error

    def split(reason: str) -> None:
        # (review 113 D1) an item without ``expect`` was packed as if its answer were no larger than its request: an
        # expert answering more than it is sent can take a batch's answer past what a client reads in place. Its
        # halves go again (a batch of MAX_BATCH_ITEMS is split 10 times at most). With every answer expected, an
        # answer that large is not what was expected, and fails; a backward is never sent twice (its experts
        # stepped on it already).
        if method != "forward" or len(items) == 1 or all(expected is not None for expected in expect):
            for (uid, _, _), future in zip(items, futures):
                _settle(future, fail(uid, grpc.StatusCode.INTERNAL, f"the answer could not be read: {reason}"))
            return
        logger.debug("the answer of %d items from %s was over the reader's budget: sent again in halves",
                     len(items), endpoint)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        half = len(items) // 2
        for part in (slice(0, half), slice(half, None)):
            again = _batch_call(method, endpoint, items[part], timeout=remaining, compression=compression,
                                channels=channels, expect=expect[part])
            for future, resent in zip(futures[part], again):
                future.add_done_callback(lambda f, resent=resent: resent.cancel() if f.cancelled() else None)
                resent.add_done_callback(lambda done, future=future: _settle(future, done.result))

    def settle(_) -> None:
        try:
            answer = call.result()
        except grpc.RpcError as error:
            for (uid, _, _), future in zip(items, futures):
                _settle(future, fail(uid, error.code(), error.details() or ""))
            return
        except grpc.FutureCancelledError:
            return  # cancelled because every item was cancelled (or answered) already
        if type(answer) is OverBudget:
            split(answer.reason)
            return
        results = answer.results
        for i, ((uid, _, _), future) in enumerate(zip(items, futures)):
            if i >= len(results):
                _settle(future, fail(uid, grpc.StatusCode.UNKNOWN,
                                     f"the server answered {len(results)} results for {len(items)} items"))
            elif results[i].code == 0:
                _settle(future, lambda tensors=results[i].tensors, uid=uid, expected=expect[i]:
                        _decoded(tensors, uid, endpoint, expected, compressions))
            else:
                _settle(future, fail(uid, status_code(results[i].code) or grpc.StatusCode.UNKNOWN, results[i].message))

    def cancel_when_unwanted(future: Future) -> None:
        # the call is cancelled once every item was cancelled (or had its answer): nobody waits for it then
        if future.cancelled() and all(f.done() for f in futures):
            call.cancel()

    call.add_done_callback(settle)
    for future in futures:
        future.add_done_callback(cancel_when_unwanted)
    return futures


def _batched(method: str, items: Sequence[Item], *, timeout: float | None, compression: int | str,
             channels: ChannelPool | None, unary_limit: int,
             expect: Sequence[Expected | None]) -> "list[Future[list[torch.Tensor]]]":
    """Sends ``items`` with one batch call per server (more if they exceed one message, ``MAX_BATCH_ITEMS``, or
    the fields a message read in place may hold, :data:`dmoe.wire.zerocopy.MAX_FIELDS`, in the request or the
    answer expected); an item too large for one message goes alone, streamed. ``expect``: each item's answer (None:
    unknown, taken to be as large as its request; a batch whose answer is larger than that allows is sent again
    in halves, :func:`_batch_call`)."""
    channels = channels or ChannelPool.default()
    compression = parse_compression(compression)
    futures: list[Future | None] = [None] * len(items)
    by_endpoint: dict[str, list[int]] = {}
    for i, (_, endpoint, _, _) in enumerate(items):
        by_endpoint.setdefault(endpoint, []).append(i)
    for endpoint, indices in by_endpoint.items():
        packs: list[list[tuple[int, str, Sequence[torch.Tensor], bytes | None]]] = [[]]
        size = fields = 0
        for i in indices:
            uid, _, tensors, activation_id = items[i]
            nbytes = sum(encoded_bytes(t, compression) for t in tensors)
            if nbytes > unary_limit:
                futures[i] = _call(method, endpoint, uid, tensors, timeout=timeout, compression=compression,
                                   channels=channels, unary_limit=unary_limit, activation_id=activation_id,
                                   expect=expect[i])
                continue
            cost = max(item_fields([t.shape for t in tensors]), item_fields([shape for shape, _ in expect[i] or ()]))
            if packs[-1] and (size + nbytes > unary_limit or len(packs[-1]) >= MAX_BATCH_ITEMS
                              or fields + cost > MAX_FIELDS):
                packs.append([])
                size = fields = 0
            packs[-1].append((i, uid, tensors, activation_id))
            size += nbytes
            fields += cost
        for group in filter(None, packs):
            sent = _batch_call(method, endpoint, [(uid, tensors, activation_id)
                                                  for _, uid, tensors, activation_id in group],
                               timeout=timeout, compression=compression, channels=channels,
                               expect=[expect[i] for i, _, _, _ in group])
            for (i, _, _, _), future in zip(group, sent):
                futures[i] = future
    return futures  # type: ignore[return-value]


def forward_futures(items: Sequence[Item], *, timeout: float | None = None, compression: int | str = NONE,
                    channels: ChannelPool | None = None, unary_limit: int = UNARY_LIMIT_BYTES,
                    expect: Sequence[Expected | None] | None = None) -> "list[Future[list[torch.Tensor]]]":
    """Starts the forwards of many experts, ``(uid, endpoint, inputs, activation_id)`` each, with one call per
    server, and returns a future per item, as :func:`forward_future` would (one failing item fails alone).
    ``expect``: each item's outputs, as :func:`forward_future` takes them (None: unknown). Items of unknown
    outputs are packed as if each answer were no larger than its request; when an expert answers more tensors
    than it is sent and a batch's answer is more than the client reads in place
    (:data:`dmoe.wire.zerocopy.MAX_FIELDS`), the server has computed the batch for nothing and its halves are sent
    again, each computed again, within the same ``timeout``: pass ``expect`` to have batches sized right at once.

    One call per server instead of one per expert: gRPC costs a fixed amount of CPU per call on each side, which
    a layer calling 16 experts per step otherwise pays 16 times over.
    """
    if expect is not None and len(expect) != len(items):
        raise ValueError(f"expect has {len(expect)} entries for {len(items)} items")
    return _batched("forward", items, timeout=timeout, compression=compression, channels=channels,
                    unary_limit=unary_limit, expect=expect if expect is not None else [None] * len(items))


def backward_futures(items: Sequence[tuple[str, str, Sequence[torch.Tensor], Sequence[torch.Tensor], bytes | None]],
                     *, timeout: float | None = None, compression: int | str = NONE,
                     channels: ChannelPool | None = None,
                     unary_limit: int = UNARY_LIMIT_BYTES) -> "list[Future[list[torch.Tensor]]]":
    """:func:`backward_future` for many experts, ``(uid, endpoint, inputs, grad_outputs, activation_id)`` each,
    with one call per server. Items with an activation id send their gradients alone; those whose server no
    longer holds the inputs are sent again, each with its inputs, within the same ``timeout``."""
    deadline = time.monotonic() + timeout if timeout is not None else None
    expect = [input_gradients(inputs) for _, _, inputs, _, _ in items]
    first = _batched("backward", [(uid, endpoint, grads if activation_id else [*inputs, *grads], activation_id)
                                  for uid, endpoint, inputs, grads, activation_id in items],
                     timeout=timeout, compression=compression, channels=channels, unary_limit=unary_limit,
                     expect=expect)
    futures = []
    for (uid, endpoint, inputs, grads, activation_id), sent, expected in zip(items, first, expect):
        if not activation_id:
            futures.append(sent)
            continue

        def resend(seconds: float | None, uid=uid, endpoint=endpoint, tensors=[*inputs, *grads],
                   activation_id=activation_id, expected=expected):
            return _call("backward", endpoint, uid, tensors, timeout=seconds, compression=compression,
                         channels=channels, unary_limit=unary_limit, activation_id=activation_id, expect=expected)

        futures.append(_resend_with_inputs(sent, resend, deadline))
    return futures


def expert_info(endpoint: str, uid: str, *, timeout: float | None = None,
                channels: ChannelPool | None = None) -> dict[str, Any]:
    """The expert's schema, class, hyper-parameters, call counters and update count (optimizer steps applied),
    fetched now."""
    stub = (channels or ChannelPool.default()).stub(endpoint)
    try:
        info = stub.info(dmoe_pb2.ExpertUID(uid=uid), timeout=timeout)
    except grpc.RpcError as error:
        raise RemoteExpertError(uid, endpoint, error.code(), error.details() or "") from None
    if len(info.hparams_json) > MAX_HPARAMS_CHARS:  # parsed after the deadline: 60 MiB of it took seconds (review 79)
        raise MalformedAnswer(uid, endpoint, f"info's hparams_json is {len(info.hparams_json)} characters, more than "
                                             f"{MAX_HPARAMS_CHARS}")
    try:  # the server's to write: what cannot be read is its failure, not the caller's crash (review 71)
        hparams = json.loads(info.hparams_json or "{}")
    except (ValueError, RecursionError) as error:
        raise MalformedAnswer(uid, endpoint, f"info's hparams_json is not JSON: {error}") from None
    return {
        "uid": info.uid,
        "expert_cls": info.expert_cls,
        "inputs": [(tuple(s.shape), s.dtype) for s in info.inputs],
        "outputs": [(tuple(s.shape), s.dtype) for s in info.outputs],
        "max_batch_size": info.max_batch_size,
        "device": info.device,
        "hparams": hparams,
        "forward_calls": info.forward_calls,
        "backward_calls": info.backward_calls,
        "updates": info.updates,
    }


class _RemoteCall(torch.autograd.Function):
    """Forward sends the inputs; backward sends inputs + output gradients and receives input gradients."""

    @staticmethod
    def forward(ctx, expert: "RemoteExpert", activation_id: bytes | None, dummy: torch.Tensor,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.expert, ctx.activation_id = expert, activation_id
        ctx.save_for_backward(*inputs)
        outputs = expert._call_forward(inputs, activation_id).result()
        # copy: received tensors are read-only views of the message, and autograd or the user may write into them
        return tuple(y.to(inputs[0].device, copy=True) for y in outputs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = ctx.saved_tensors
        expert: RemoteExpert = ctx.expert
        if not all(map(all_finite, grad_outputs)):
            # the server would refuse them (and must never step on them); NaN input gradients make a GradScaler
            # skip the step, as it would for a local module
            logger.warning("expert %s at %s: %s", expert.uid, expert.endpoint, NON_FINITE_GRADIENTS)
            return (None, None, None, *(torch.full_like(x, float("nan")) if needed else None
                                        for x, needed in zip(inputs, ctx.needs_input_grad[3:])))
        scale = loss_scale(expert.grad_scaler)
        if scale != 1.0:  # the server steps on them at once: unscaled; the input gradients are scaled again
            grad_outputs = tuple(g / scale for g in grad_outputs)
        grads = expert._call_backward(inputs, grad_outputs, ctx.activation_id).result()
        return (None, None, None,
                *((g.to(x.device, copy=True) * scale if scale != 1.0 else g.to(x.device, copy=True))
                  if needed else None for x, g, needed in zip(inputs, grads, ctx.needs_input_grad[3:])))


class RemoteExpert(nn.Module):
    """An expert on another machine used like a local module: differentiable, trains the remote weights.

    Args:
        uid: the expert's uid, e.g. ``'ffn0.3.17'``.
        endpoint: ``'host:port'`` of the server hosting it.
        timeout: seconds for each forward/backward call (None: no deadline).
        compression: how tensors travel both ways: ``'none'``, ``'float16'`` or ``'uint8'``.
        channels: the channel pool to use; :meth:`ChannelPool.default` if None.

    Its first forward fetches the expert's schema (:attr:`info`), against which every answer is checked before it
    is decoded: a server can then make the client decode no more than the outputs it asked for.
        grad_scaler: the ``torch.amp.GradScaler`` of the loss (also settable later): the server steps on the
            gradients at once, so they are sent unscaled (see :class:`dmoe.RemoteMixtureOfExperts`).
    """

    def __init__(self, uid: str, endpoint: str, *, timeout: float | None = None, compression: int | str = NONE,
                 channels: ChannelPool | None = None, grad_scaler: Any = None):
        super().__init__()
        self.uid, self.endpoint, self.timeout = uid, endpoint, timeout
        self._dummy = torch.empty(0, requires_grad=True)  # see forward
        self.grad_scaler = grad_scaler
        self.compression = parse_compression(compression)
        self.channels = channels
        self._info: dict[str, Any] | None = None

    @property
    def info(self) -> dict[str, Any]:
        """The expert's schema and hyper-parameters (fetched once; counters are as of that fetch)."""
        if self._info is None:
            self._info = expert_info(self.endpoint, self.uid, timeout=self.timeout, channels=self.channels)
        return self._info

    def expected_outputs(self, rows: int) -> Expected:
        """The outputs of a forward of ``rows`` rows, as the expert's schema says (its ``info``, fetched once):
        answers of other tensors fail undecoded (:class:`MalformedAnswer`)."""
        expected = []
        for shape, name in self.info["outputs"]:
            if name not in DTYPES:
                raise MalformedAnswer(self.uid, self.endpoint, f"the expert's schema names an unknown dtype "
                                      f"{truncated(str(name), 24)!r}")
            expected.append(((rows, *shape), DTYPES[name]))
        return expected

    def _call_forward(self, inputs: Sequence[torch.Tensor],
                      activation_id: bytes | None) -> "Future[list[torch.Tensor]]":
        return forward_future(self.endpoint, self.uid, inputs, timeout=self.timeout, compression=self.compression,
                              channels=self.channels, activation_id=activation_id,
                              expect=self.expected_outputs(len(inputs[0])))

    def _call_backward(self, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                       activation_id: bytes | None) -> "Future[list[torch.Tensor]]":
        return backward_future(self.endpoint, self.uid, inputs, grad_outputs, timeout=self.timeout,
                               compression=self.compression, channels=self.channels, activation_id=activation_id)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # a backward can only follow when autograd records this call: only then ask the server to keep activations.
        # The dummy requires grad, so autograd records it whenever grad is on, also where no input requires grad
        # (the first module, on data): the remote weights train as a local module's would (review 46).
        will_backward = torch.is_grad_enabled()
        outputs = _RemoteCall.apply(self, new_activation_id() if will_backward else None, self._dummy, *inputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def extra_repr(self) -> str:
        return f"uid={self.uid!r}, endpoint={self.endpoint!r}"
