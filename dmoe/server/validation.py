"""Checks of one expert request before any compute: tensor count, shapes, dtypes, batch sizes, buffer lengths,
values, and the request's options. Each failure is a :class:`RequestRejected` naming what is wrong, with the gRPC
status to answer; the checks read metadata before they allocate anything.
"""
from __future__ import annotations

import math
from typing import Sequence

import grpc
import torch

from dmoe.server.activations import MAX_ACTIVATION_ID_BYTES
from dmoe.server.backend import TensorSchema
from dmoe.wire import dmoe_pb2
from dmoe.wire.channels import described, truncated
from dmoe.wire.codec import Compression, InvalidTensor, TensorTooLarge, deserialize


class RequestRejected(Exception):
    """A request refused before any compute, with the status code to answer it with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        message = truncated(message)  # (whatever it quotes of the request: gRPC cannot send a status of 16 KiB)
        super().__init__(message)
        self.code, self.message = code, message


def check_options(response_compression: int, activation_id: bytes) -> None:
    """The request's fields besides its tensors."""
    if response_compression not in Compression.values():
        raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, f"unknown response_compression {response_compression}")
    if len(activation_id) > MAX_ACTIVATION_ID_BYTES:
        raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, f"activation_id has {len(activation_id)} "
                              f"bytes, at most {MAX_ACTIVATION_ID_BYTES} are allowed")


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
                                  f"{label}: expected shape {schema.describe()}, got {described(message, quoted=False)}")
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
