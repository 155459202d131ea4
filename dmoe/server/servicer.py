"""The gRPC face of a server: validates each request against the expert's schema, then queues it for the runtime.

Handlers run on the server's asyncio loop and only await futures, so one thread serves any number of concurrent
calls while the runtime workers compute. Every rejection happens before tensors are allocated.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
import torch

from dmoe.server.activations import MAX_ACTIVATION_ID_BYTES
from dmoe.server.backend import ExpertBackend, TensorSchema
from dmoe.server.faults import Faults, InjectedFailure
from dmoe.server.task_pool import TaskPool
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from dmoe.wire.channels import MAX_BATCH_ITEMS, STREAM_PART_BYTES
from dmoe.wire.codec import (
    NONE,
    Compression,
    InvalidTensor,
    TensorTooLarge,
    cut_into_parts,
    deserialize,
    join_parts,
    message_bytes,
    serialize,
)

FORWARD, BACKWARD = "forward", "backward"


class RequestRejected(Exception):
    """A request refused before any compute, with the status code to answer it with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


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

    def held_inputs(self, activation_id: bytes) -> tuple[torch.Tensor, ...] | None:
        cache = self.backend.activations
        return cache.inputs(self.backend.name, activation_id) if cache is not None else None

    def max_payload_bytes(self, kind: str, max_batch_size: int) -> int:
        """The most tensor bytes a valid request can carry: uncompressed is the largest encoding."""
        row_bytes = sum(s.numel * s.torch_dtype.itemsize for _, s in self.schemas(kind))
        return max_batch_size * row_bytes


def _describe(message: dmoe_pb2.Tensor) -> str:
    return f"[{', '.join(map(str, message.shape))}] {message.dtype or '<no dtype>'}"


def validate(tensors: Sequence[dmoe_pb2.Tensor], schemas: Sequence[tuple[str, TensorSchema]],
             max_batch_size: int) -> list[torch.Tensor]:
    """Checks count, shapes, dtypes, batch sizes and buffer lengths (metadata only), then decodes the tensors."""
    if len(tensors) != len(schemas):
        names = ", ".join(label for label, _ in schemas)
        raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT,
                              f"expected {len(schemas)} tensors ({names}), got {len(tensors)}")
    batch_sizes = []
    for (label, schema), message in zip(schemas, tensors):
        shape = list(message.shape)
        if message.dtype != schema.dtype or len(shape) != len(schema.shape) + 1 or tuple(shape[1:]) != schema.shape:
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"{label}: expected shape {schema.describe()}, got {_describe(message)}")
        if shape[0] < 1:
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"{label}: batch size must be positive, got shape {shape}")
        batch_sizes.append((label, shape[0]))
    if len({rows for _, rows in batch_sizes}) > 1:
        sizes = ", ".join(f"{label} has {rows}" for label, rows in batch_sizes)
        raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, f"batch sizes disagree: {sizes} rows")
    rows = batch_sizes[0][1] if batch_sizes else 0
    if rows > max_batch_size:
        raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"batch of {rows} rows exceeds this server's max_batch_size {max_batch_size}")
    decoded = []
    for (label, schema), message in zip(schemas, tensors):
        try:
            decoded.append(deserialize(message, max_numel=max_batch_size * schema.numel))
        except InvalidTensor as error:
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, f"{label}: {error}") from None
        except TensorTooLarge as error:
            raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{label}: {error}") from None
    return decoded


#: dtypes numpy checks without a copy
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def first_bad_values(tensors: Sequence[torch.Tensor], schemas: Sequence[tuple[str, TensorSchema]], *,
                     reject_nonfinite: bool = True, max_abs_value: float | None = None) -> str | None:
    """Why the first floating-point tensor with values this server refuses is refused, or None if there is none.

    Refused: NaN or Inf (with ``reject_nonfinite``), and finite magnitudes above ``max_abs_value``. A
    finite but huge gradient is as bad as an infinite one: one element with a flipped exponent bit makes an SGD
    step that leaves an expert's weights huge and its outputs non-finite from then on, for every client.
    Checked with numpy where it can be (the smallest and largest value: two passes, no copy): on this (gRPC)
    thread a large torch op starts an OpenMP team of its own, whose threads then spin after every request and take
    cores from the compute workers. numpy runs on the calling thread alone.
    """
    for tensor, (label, _) in zip(tensors, schemas):
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        if tensor.dtype in _NUMPY_FLOATS and tensor.device.type == "cpu":
            values = tensor.numpy()
            low, high = float(values.min()), float(values.max())
        else:
            low, high = (float(v) for v in torch.aminmax(tensor.float()))
        largest = max(-low, high)
        if not math.isfinite(low) or not math.isfinite(high):
            if reject_nonfinite:
                return f"{label} holds NaN or Inf values (this server rejects non-finite inputs and gradients)"
            finite = tensor[torch.isfinite(tensor)]  # let them through; the limit is for the finite ones
            largest = float(finite.abs().max()) if finite.numel() else 0.0
        if max_abs_value is not None and largest > max_abs_value:
            return (f"{label} holds a value of magnitude {largest:.3g}, above this server's limit {max_abs_value:g} "
                    "(--max-abs-value)")
    return None


class ExpertServicer(dmoe_pb2_grpc.ExpertServiceServicer):
    """Implements ``ExpertService`` of proto/dmoe.proto for a set of hosted experts.

    Args:
        experts: uid -> hosted expert.
        max_batch_size: requests with more rows are refused (RESOURCE_EXHAUSTED).
        device: reported by ``info``.
        default_compression: applied to responses when a request asks for none.
        max_stream_bytes: the most bytes a streamed request may carry in total.
        faults: injected latency and failures for experiments (:mod:`dmoe.server.faults`); None: none.
        reject_nonfinite: answer INVALID_ARGUMENT to requests whose floating-point tensors hold NaN or Inf.
        max_abs_value: answer INVALID_ARGUMENT to requests holding finite values of a larger magnitude (None: no limit).
        max_batch_items: batch calls with more items are refused (RESOURCE_EXHAUSTED).
    """

    def __init__(self, experts: dict[str, HostedExpert], *, max_batch_size: int, device: str,
                 default_compression: int = NONE, max_stream_bytes: int = 1 << 30,
                 stream_part_bytes: int = STREAM_PART_BYTES, faults: Faults | None = None,
                 reject_nonfinite: bool = True, max_abs_value: float | None = None,
                 max_batch_items: int = MAX_BATCH_ITEMS):
        self.experts = experts
        self.max_batch_size, self.device = max_batch_size, device
        self.default_compression = default_compression
        self.max_stream_bytes, self.stream_part_bytes = max_stream_bytes, stream_part_bytes
        self.faults = faults
        self.reject_nonfinite, self.max_abs_value = reject_nonfinite, max_abs_value
        self.max_batch_items = max_batch_items

    def _lookup(self, uid: str) -> HostedExpert:
        expert = self.experts.get(uid)
        if expert is None:
            raise RequestRejected(grpc.StatusCode.NOT_FOUND, f"expert {uid!r} is not hosted on this server")
        return expert

    async def _expert(self, uid: str, context: grpc.aio.ServicerContext) -> HostedExpert:
        try:
            return self._lookup(uid)
        except RequestRejected as rejected:
            await context.abort(rejected.code, rejected.message)

    async def info(self, request: dmoe_pb2.ExpertUID, context: grpc.aio.ServicerContext) -> dmoe_pb2.ExpertInfo:
        backend = (await self._expert(request.uid, context)).backend
        return dmoe_pb2.ExpertInfo(
            uid=request.uid, expert_cls=backend.expert_cls,
            inputs=[dmoe_pb2.TensorSchema(shape=s.shape, dtype=s.dtype) for s in backend.inputs_schema],
            outputs=[dmoe_pb2.TensorSchema(shape=s.shape, dtype=s.dtype) for s in backend.outputs_schema],
            max_batch_size=self.max_batch_size, device=self.device, hparams_json=backend.hparams_json(),
            forward_calls=backend.forward_calls, backward_calls=backend.backward_calls,
        )

    async def _call(self, kind: str, uid: str, tensors: Sequence[dmoe_pb2.Tensor], compression: int,
                    context: grpc.aio.ServicerContext, activation_id: bytes = b"") -> list[dmoe_pb2.Tensor]:
        try:
            return await self._compute(kind, uid, tensors, compression, activation_id)
        except RequestRejected as rejected:
            await context.abort(rejected.code, rejected.message)

    async def _compute(self, kind: str, uid: str, tensors: Sequence[dmoe_pb2.Tensor], compression: int,
                       activation_id: bytes = b"", delay: bool = True) -> list[dmoe_pb2.Tensor]:
        """Validates one expert's request, runs it on the runtime and encodes the answer.

        Raises :class:`RequestRejected` with the status to answer (a call of its own, or one item of a batch).
        ``delay``: injected faults include the round trip's delay (a batch pays it once for all of its items).
        """
        expert = self._lookup(uid)
        if compression not in Compression.values():
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, f"unknown response_compression {compression}")
        if len(activation_id) > MAX_ACTIVATION_ID_BYTES:
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, f"activation_id has {len(activation_id)} "
                                  f"bytes, at most {MAX_ACTIVATION_ID_BYTES} are allowed")
        schemas, held = expert.schemas(kind), None
        if kind == BACKWARD and activation_id and len(tensors) == len(expert.grad_schemas()):
            # the gradients alone: the inputs are those the server held since the forward with this id
            schemas, held = expert.grad_schemas(), expert.held_inputs(activation_id)
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
        if self.faults is not None:
            try:
                await self.faults.apply(delay=delay)  # the round trip's delay, then maybe a failure instead
            except InjectedFailure as failure:
                raise RequestRejected(failure.code, f"{kind} of {uid}: {failure}") from None
        if kind == FORWARD:
            expert.backend.forward_calls += 1
            future = expert.forward_pool.submit(*inputs, key=activation_id or None)
        else:
            expert.backend.backward_calls += 1
            future = expert.backward_pool.submit(*inputs, key=activation_id or None)
        try:
            outputs = await asyncio.wrap_future(future)
        except Exception as exc:
            raise RequestRejected(grpc.StatusCode.INTERNAL,
                                  f"{kind} of {uid} failed on the server: {type(exc).__name__}: {exc}") from None
        compression = compression or self.default_compression
        return [serialize(y, compression) for y in outputs]

    async def _batch(self, kind: str, request: dmoe_pb2.BatchRequest, context) -> dmoe_pb2.BatchResponse:
        """Runs every item as its own call would run (concurrently, each on its own expert's task pool) and
        answers each item's outcome: one bad or failing item never fails the others."""
        items = request.items
        if not items:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{kind}_batch: the request has no items")
        if len(items) > self.max_batch_items:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{kind}_batch: {len(items)} items, at most "
                                f"{self.max_batch_items} per call are allowed")
        if self.faults is not None:
            await self.faults.wait()  # one round trip for the whole call
        results = await asyncio.gather(*(self._item(kind, item) for item in items))
        return dmoe_pb2.BatchResponse(results=results)

    async def _item(self, kind: str, item: dmoe_pb2.ExpertRequest) -> dmoe_pb2.ExpertResult:
        try:
            tensors = await self._compute(kind, item.uid, item.tensors, item.response_compression,
                                          item.activation_id, delay=False)
        except RequestRejected as rejected:
            return dmoe_pb2.ExpertResult(code=rejected.code.value[0], message=rejected.message)
        return dmoe_pb2.ExpertResult(tensors=tensors)

    async def forward(self, request: dmoe_pb2.ExpertRequest, context) -> dmoe_pb2.ExpertResponse:
        tensors = await self._call(FORWARD, request.uid, request.tensors, request.response_compression, context,
                                   request.activation_id)
        return dmoe_pb2.ExpertResponse(tensors=tensors)

    async def backward(self, request: dmoe_pb2.ExpertRequest, context) -> dmoe_pb2.ExpertResponse:
        tensors = await self._call(BACKWARD, request.uid, request.tensors, request.response_compression, context,
                                   request.activation_id)
        return dmoe_pb2.ExpertResponse(tensors=tensors)

    async def forward_batch(self, request: dmoe_pb2.BatchRequest, context) -> dmoe_pb2.BatchResponse:
        return await self._batch(FORWARD, request, context)

    async def backward_batch(self, request: dmoe_pb2.BatchRequest, context) -> dmoe_pb2.BatchResponse:
        return await self._batch(BACKWARD, request, context)

    async def _stream(self, kind: str, requests: AsyncIterator[dmoe_pb2.ExpertRequest],
                      context) -> AsyncIterator[dmoe_pb2.ExpertResponse]:
        uid, compression, groups, total, limit = None, NONE, [], 0, self.max_stream_bytes
        activation_id = b""
        async for message in requests:
            if uid is None:
                uid, compression, activation_id = message.uid, message.response_compression, message.activation_id
                # refuse an unknown expert, or more bytes than a valid request can have, before buffering them
                expert = await self._expert(uid, context)
                limit = min(limit, expert.max_payload_bytes(kind, self.max_batch_size))
            # each part costs memory beyond its bytes: count it, so streams of empty parts are bounded too
            total += message_bytes(message.tensors) + 64 * len(message.tensors)
            if total > limit:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"streamed request exceeds {limit} bytes, more than a valid {kind} of {uid} "
                                    f"(max_batch_size {self.max_batch_size}) can carry")
            groups.append(message.tensors)
        if uid is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty stream")
        try:
            tensors = join_parts(groups, limit)
            rejection = None
        except (InvalidTensor, TensorTooLarge) as error:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, TensorTooLarge)
                    else grpc.StatusCode.INVALID_ARGUMENT)
            rejection = (code, str(error))
        if rejection is not None:
            await context.abort(*rejection)
        outputs = await self._call(kind, uid, tensors, compression, context, activation_id)
        for group in cut_into_parts(outputs, self.stream_part_bytes):
            yield dmoe_pb2.ExpertResponse(tensors=group)

    async def forward_stream(self, request_iterator, context) -> AsyncIterator[dmoe_pb2.ExpertResponse]:
        async for response in self._stream(FORWARD, request_iterator, context):
            yield response

    async def backward_stream(self, request_iterator, context) -> AsyncIterator[dmoe_pb2.ExpertResponse]:
        async for response in self._stream(BACKWARD, request_iterator, context):
            yield response
