"""Tensors <-> ``dmoe.Tensor`` messages: raw bytes + shape + dtype, optional compression, streaming parts.

Decoding validates a message completely (dtype known, shape sane, buffer length equal to what shape and dtype
imply) *before* allocating anything, so a lying peer cannot make us allocate a huge tensor. Uncompressed
tensors are decoded without a copy: the tensor is a read-only view of the message's bytes.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from dmoe.wire import dmoe_pb2

Compression = dmoe_pb2.Compression
NONE, FLOAT16, UINT8 = dmoe_pb2.NONE, dmoe_pb2.FLOAT16, dmoe_pb2.UINT8

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_NDIM = 8
#: Values per block of 8-bit quantisation: small enough that one outlier costs little precision elsewhere.
UINT8_BLOCK = 256
COMPRESSIONS = {"none": NONE, "float16": FLOAT16, "uint8": UINT8}


class InvalidTensor(ValueError):
    """A message that does not describe a tensor (unknown dtype, bad shape, wrong buffer length)."""


class TensorTooLarge(ValueError):
    """A well-formed tensor over the receiver's size limits."""


@dataclass(eq=False)
class TensorView:
    """A ``dmoe.Tensor``'s fields held outside a message: read in place from received bytes
    (:mod:`dmoe.wire.zerocopy`), or joined from streamed parts (:func:`join_parts`). ``buffer`` is read without a
    copy, unlike a message's bytes field."""

    buffer: memoryview | bytes | bytearray = b""
    shape: list[int] = field(default_factory=list)
    dtype: str = ""
    compression: int = 0
    aux: bytes = b""
    parts: int = 0


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidTensor(f"dtype {dtype} cannot be sent; supported: {', '.join(DTYPES)}") from None


def parse_compression(name: str | int) -> int:
    """``'float16'`` -> ``FLOAT16``; also accepts the enum value itself."""
    if isinstance(name, int) and name in COMPRESSIONS.values():
        return name
    try:
        return COMPRESSIONS[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(COMPRESSIONS)}") from None


class GatheredRows:
    """Rows ``index`` of a 2-D host array, sent as a tensor of ``dtype`` without first being gathered into one.

    ``source`` holds the elements as same-width integers (numpy lacks bfloat16; see ``dmoe.client.moe``). A layer
    sends each expert its rows of the batch: gathered into a tensor of their own and then copied into the message,
    every row was copied twice. :mod:`dmoe.wire.zerocopy`'s writers gather these straight into the message's
    memory (with shared memory, into the segment the server reads), one copy. Anything else that takes a tensor
    here (:func:`pack` with compression, :func:`serialize` for a streamed call) gathers them first, as before.
    Keep ``source`` unchanged until the message is written.
    """

    __slots__ = ("source", "index", "dtype", "shape", "nbytes")

    def __init__(self, source: np.ndarray, index: np.ndarray, dtype: torch.dtype):
        if source.ndim != 2 or not source.flags.c_contiguous or source.itemsize != dtype.itemsize:
            raise ValueError(f"rows are gathered from a C-contiguous 2-D array of {dtype}'s width, got "
                             f"{source.shape} {source.dtype}")
        self.source, self.index, self.dtype = source, np.asarray(index, dtype=np.intp), dtype
        self.shape: tuple[int, ...] = (len(self.index), source.shape[1])
        self.nbytes = len(self.index) * source.shape[1] * source.itemsize

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __len__(self) -> int:
        """Its bytes, as a chunk of a message."""
        return self.nbytes

    def write_into(self, target: memoryview) -> None:
        """Gathers the rows into ``target``, a writable view of exactly :attr:`nbytes` bytes."""
        out = np.frombuffer(target, dtype=self.source.dtype).reshape(self.shape)
        # mode="clip": with "raise" numpy gathers into a buffer of its own and copies that (the rows are valid)
        np.take(self.source, self.index, axis=0, out=out, mode="clip")

    def array(self) -> np.ndarray:
        """The rows gathered into a new array (of ``source``'s integer type)."""
        return np.take(self.source, self.index, axis=0)

    def tensor(self) -> torch.Tensor:
        """The rows gathered into a new tensor of ``dtype``."""
        return torch.from_numpy(self.array()).view(self.dtype)

    def __bytes__(self) -> bytes:
        return self.array().tobytes()


@dataclass(eq=False)
class OutgoingTensor:
    """A tensor packed as a ``dmoe.Tensor`` carries it, its buffer still the tensor's memory (or that of its
    compressed copy): :func:`serialize` copies it into a message, :mod:`dmoe.wire.zerocopy`'s writers straight into
    the bytes they send. Keep the tensor unchanged until then."""

    buffer: memoryview | bytes | GatheredRows
    shape: tuple[int, ...]
    dtype: str
    compression: int = NONE
    aux: bytes = b""


def _memory(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1).contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.view(torch.uint8).numpy())


#: the largest finite float16: what float16 compression saturates larger finite magnitudes to
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def _to_float16(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float16, with finite values beyond its range saturated to +-65504 instead of cast to inf: as inf
    they would arrive as garbage (a server with ``--reject-nonfinite`` refuses the request, an averaging peer bans
    the sender) though they were finite when sent; the lossy compression was opted into. NaN and inf stay as they
    are. Costs one pass over the float16 copy, and a second cast only when something overflowed."""
    half = tensor.detach().to(torch.float16)
    if half.device.type == "cpu":  # numpy's pass: no torch thread team (an averaging peer encodes on its loop)
        # +-inf by their bits (exponent all ones, mantissa zero): numpy's float16 isinf is ~15x slower than the cast
        overflowed = bool(((half.reshape(-1).view(torch.int16).numpy() & 0x7FFF) == 0x7C00).any())
    else:
        overflowed = bool(half.isinf().any())
    if overflowed:
        source = tensor.detach()
        if source.dtype == torch.bfloat16:  # 65504 is not a bfloat16 (it rounds to 65536, an inf in float16)
            source = source.float()
        half = torch.where(source.isinf(), source, source.clamp(-FLOAT16_MAX, FLOAT16_MAX)).to(torch.float16)
    return half


def pack(tensor: torch.Tensor | GatheredRows, compression: int = NONE) -> OutgoingTensor:
    """What is sent of ``tensor`` (any device), not yet copied into bytes; compression applies to floating-point
    tensors only. :class:`GatheredRows` sent as they are stay ungathered until written."""
    name = dtype_name(tensor.dtype)
    if not tensor.is_floating_point() or tensor.numel() == 0:
        compression = NONE
    if isinstance(tensor, GatheredRows):
        if compression == NONE:
            return OutgoingTensor(tensor, tensor.shape, name)
        tensor = tensor.tensor()  # compressed from a tensor of their own, as any other
    if compression == FLOAT16 and tensor.dtype != torch.float16:
        return OutgoingTensor(_memory(_to_float16(tensor)), tuple(tensor.shape), name, FLOAT16)
    if compression == UINT8:
        buffer, aux = _quantize_uint8(tensor)
        return OutgoingTensor(buffer, tuple(tensor.shape), name, UINT8, aux)
    return OutgoingTensor(_memory(tensor), tuple(tensor.shape), name)


def to_message(packed: OutgoingTensor, out: dmoe_pb2.Tensor | None = None) -> dmoe_pb2.Tensor:
    """``packed`` as a message (its bytes copied once); ``out``: a Tensor field of a larger message to fill in place
    (returned). Passing a finished Tensor to the larger message's constructor instead copies every byte once more."""
    if out is None:
        return dmoe_pb2.Tensor(buffer=bytes(packed.buffer), shape=packed.shape, dtype=packed.dtype,
                               compression=packed.compression, aux=packed.aux)
    out.Clear()
    out.buffer, out.dtype = bytes(packed.buffer), packed.dtype
    out.compression, out.aux = packed.compression, packed.aux
    out.shape.extend(packed.shape)
    return out


def serialize(tensor: torch.Tensor, compression: int = NONE, out: dmoe_pb2.Tensor | None = None) -> dmoe_pb2.Tensor:
    """Packs ``tensor`` (any device) into a message (:func:`pack`, then :func:`to_message`)."""
    return to_message(pack(tensor, compression), out)


def _quantize_uint8(tensor: torch.Tensor) -> tuple[bytes, bytes]:
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.float64:  # finite beyond float32's range: saturated, not cast to inf (and NaN, below)
        limit = torch.finfo(torch.float32).max / 2
        flat = torch.where(flat.isfinite(), flat.clamp(-limit, limit), flat)
    flat = flat.float()
    numel = flat.numel()
    blocks = math.ceil(numel / UINT8_BLOCK)
    padded = torch.nn.functional.pad(flat, (0, blocks * UINT8_BLOCK - numel)).view(blocks, UINT8_BLOCK)
    low, high = padded.min(dim=1).values, padded.max(dim=1).values
    if bool((high - low).isinf().any()):
        # finite values further apart than float32 reaches (or a non-finite one): the scale would be inf and the
        # whole block arrive as NaN though sent finite (review 71). Finite ones are saturated to half float32's
        # range, as _to_float16 saturates; NaN and inf stay as they are
        limit = torch.finfo(torch.float32).max / 2
        padded = torch.where(padded.isfinite(), padded.clamp(-limit, limit), padded)
        low, high = padded.min(dim=1).values, padded.max(dim=1).values
    scale = ((high - low) / 255).clamp_min(1e-12)
    codes = ((padded - low[:, None]) / scale[:, None]).round_().clamp_(0, 255).to(torch.uint8)
    aux = torch.stack([scale, low], dim=1).cpu().numpy().astype(np.float32).tobytes()
    return codes.reshape(-1)[:numel].cpu().numpy().tobytes(), aux


def expected_numel(message: dmoe_pb2.Tensor, max_numel: int) -> int:
    """Validates dtype, shape and buffer length; returns the element count. Allocates nothing of the declared size
    (reading the buffer to measure it copies the bytes received)."""
    return _validated(message, len(message.buffer), len(message.aux), max_numel)


def _validated(message: dmoe_pb2.Tensor, buffer_bytes: int, aux_bytes: int, max_numel: int) -> int:
    """:func:`expected_numel` for buffers already read: each read of a bytes field copies it (upb's Python
    messages return a new ``bytes`` every time), so a decoder reads the buffer once and checks its length."""
    numel, want, want_aux = _declared(message, max_numel)
    if buffer_bytes != want or aux_bytes != want_aux:
        raise InvalidTensor(
            f"buffer of {buffer_bytes} bytes (+{aux_bytes} aux) does not match shape {list(message.shape)} "
            f"of {message.dtype} with compression {Compression.Name(message.compression)}: expected {want} "
            f"(+{want_aux})"
        )
    return numel


def _declared(message: dmoe_pb2.Tensor, max_numel: int) -> tuple[int, int, int]:
    """(elements, buffer bytes, aux bytes) that a tensor's header declares, checked for sense and size."""
    if message.dtype not in DTYPES:
        raise InvalidTensor(f"unknown dtype {message.dtype!r}; supported: {', '.join(DTYPES)}")
    shape = list(message.shape)
    if len(shape) > MAX_NDIM:
        raise InvalidTensor(f"tensor has {len(shape)} dimensions, at most {MAX_NDIM} are accepted")
    if any(dim < 0 for dim in shape):
        raise InvalidTensor(f"negative dimension in shape {shape}")
    if any(dim > max_numel for dim in shape):  # a zero elsewhere makes numel 0, but torch cannot build the shape
        raise TensorTooLarge(f"tensor of shape {shape} has a dimension above the limit of {max_numel} elements")
    numel = math.prod(shape)
    if numel > max_numel:
        raise TensorTooLarge(f"tensor of shape {shape} has {numel} elements, the limit is {max_numel}")
    compression = message.compression
    if compression not in (NONE, FLOAT16, UINT8):
        raise InvalidTensor(f"unknown compression {compression}")
    if compression != NONE and not DTYPES[message.dtype].is_floating_point:
        raise InvalidTensor(f"compression {Compression.Name(compression)} is only for floating-point tensors")
    return (numel, *_payload_bytes(numel, DTYPES[message.dtype], compression))


def _payload_bytes(numel: int, dtype: torch.dtype, compression: int) -> tuple[int, int]:
    """The buffer and aux bytes of ``numel`` elements of ``dtype`` sent with ``compression``."""
    if compression == FLOAT16:
        return numel * 2, 0
    if compression == UINT8:
        return numel, math.ceil(numel / UINT8_BLOCK) * 8
    return numel * dtype.itemsize, 0


def encoded_bytes(tensor: torch.Tensor | GatheredRows, compression: int = NONE) -> int:
    """The buffer bytes (and aux) that :func:`serialize` would make of ``tensor``, without making them."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        compression = NONE  # as serialize sends them
    return sum(_payload_bytes(tensor.numel(), tensor.dtype, compression))


def deserialize(message: dmoe_pb2.Tensor, max_numel: int = 2**31) -> torch.Tensor:
    """Unpacks a message into a CPU tensor of its declared dtype and shape (validated first)."""
    buffer, aux = message.buffer, message.aux  # read once: every read copies the bytes (aux is small)
    numel = _validated(message, len(buffer), len(aux), max_numel)
    dtype = DTYPES[message.dtype]
    shape = tuple(message.shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if message.compression == FLOAT16:
        return _frombuffer(buffer, torch.float16).to(dtype).view(shape)
    if message.compression == UINT8:
        codes = _frombuffer(buffer, torch.uint8)
        blocks = math.ceil(numel / UINT8_BLOCK)
        scale_low = _frombuffer(aux, torch.float32).view(blocks, 2)
        padded = torch.nn.functional.pad(codes.float(), (0, blocks * UINT8_BLOCK - numel)).view(blocks, UINT8_BLOCK)
        values = padded * scale_low[:, :1] + scale_low[:, 1:]
        return values.reshape(-1)[:numel].to(dtype).view(shape)
    return _frombuffer(buffer, dtype).view(shape)


# Decoded tensors share memory with the immutable message bytes (zero copy); callers that write into them
# clone first. torch warns about the non-writable buffer on every call, which is noise here. The filter is
# installed once, for that message only: ``warnings.catch_warnings`` per call would not be thread-safe.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def _frombuffer(buffer: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.frombuffer(buffer, dtype=dtype)
    if tensor.data_ptr() % tensor.element_size():
        # a view into a message that did not align it (dmoe.wire.zerocopy's writers do): numpy and some kernels
        # run slower, or refuse, on misaligned values
        tensor = tensor.clone()
    return tensor


def message_bytes(tensors: Iterable[dmoe_pb2.Tensor]) -> int:
    return sum(len(t.buffer) + len(t.aux) for t in tensors)


def cut_into_parts(tensors: Sequence[dmoe_pb2.Tensor | OutgoingTensor],
                   part_bytes: int) -> Iterator[list[dmoe_pb2.Tensor]]:
    """Cuts tensors into parts of at most ``part_bytes`` of buffer each and groups them into messages.

    Each yielded list fits in one streamed message of about ``part_bytes``; :func:`join_parts` inverts this. Packed
    tensors (:func:`pack`) are cut straight from their memory: only the parts are copied, a message at a time, where
    a whole message per tensor held a second copy of it while its stream lasted.
    """
    group: list[dmoe_pb2.Tensor] = []
    group_bytes = 0
    for tensor in tensors:
        buffer = tensor.buffer  # read once: every read of a message's bytes copies them all
        if isinstance(buffer, GatheredRows):
            buffer = bytes(buffer)
        view = memoryview(buffer).cast("B")
        n_parts = max(1, math.ceil(len(view) / part_bytes))
        for i in range(n_parts):
            piece = buffer if n_parts == 1 and isinstance(buffer, bytes) else bytes(view[i * part_bytes:
                                                                                            (i + 1) * part_bytes])
            aux = tensor.aux if i == 0 else b""
            if i == 0:
                part = dmoe_pb2.Tensor(buffer=piece, shape=tensor.shape, dtype=tensor.dtype,
                                       compression=tensor.compression, aux=aux, parts=n_parts)
            else:
                part = dmoe_pb2.Tensor(buffer=piece)
            if group and group_bytes + len(piece) + len(aux) > part_bytes:
                yield group
                group, group_bytes = [], 0
            group.append(part)
            group_bytes += len(piece) + len(aux)
    if group:
        yield group


def join_parts(groups: Iterable[Sequence[dmoe_pb2.Tensor]], max_bytes: int) -> list[TensorView]:
    """Reassembles tensors from streamed parts, refusing more than ``max_bytes`` in total.

    Each tensor's parts are copied into one buffer of the size its header declares (checked against ``max_bytes``
    first), which :func:`deserialize` decodes without a copy: a stream costs its bytes about once more while it is
    joined, not once per join and decode step (a 64 MiB request had raised a server's peak memory by 268 MiB,
    review 84). A caller that drops each group once it is yielded holds little more than the tensors."""
    tensors: list[TensorView] = []
    head: dmoe_pb2.Tensor | None = None
    head_aux = b""
    joined: bytearray | bytes = b""
    filled = total = count = 0
    for group in groups:
        for part in group:
            piece = part.buffer  # read once: every read copies the bytes out of the message
            aux = part.aux
            total += len(piece) + len(aux)
            if total > max_bytes:
                raise TensorTooLarge(f"streamed tensors exceed {max_bytes} bytes")
            if head is None:
                if part.parts < 1:
                    raise InvalidTensor("streamed tensor part without a header (parts must be >= 1)")
                head, head_aux, count = part, aux, 0
                if part.parts == 1:
                    joined = piece  # one part: its bytes as read (deserialize checks their length)
                else:
                    # each element takes at least a byte: the declared size is checked before it is allocated
                    _, want, want_aux = _declared(part, max_numel=max_bytes)
                    if total - len(piece) + want + want_aux - len(aux) > max_bytes:
                        raise TensorTooLarge(f"streamed tensors exceed {max_bytes} bytes")
                    joined, filled = bytearray(want), 0
            elif part.dtype or part.shape or part.parts or aux:
                raise InvalidTensor("a tensor's continuation part must carry bytes only")
            count += 1
            if head.parts > 1:
                if filled + len(piece) > len(joined):
                    raise InvalidTensor(f"streamed tensor parts of more than {len(joined)} bytes do not match "
                                        f"shape {list(head.shape)} of {head.dtype}: expected {len(joined)}")
                joined[filled:filled + len(piece)] = piece
                filled += len(piece)
            del piece
            if count == head.parts:
                if head.parts > 1 and filled != len(joined):
                    raise InvalidTensor(f"streamed tensor parts of {filled} bytes do not match shape "
                                        f"{list(head.shape)} of {head.dtype}: expected {len(joined)}")
                tensors.append(TensorView(buffer=joined, shape=list(head.shape), dtype=head.dtype,
                                          compression=head.compression, aux=head_aux))
                head, joined = None, b""
    if head is not None:
        raise InvalidTensor(f"stream ended inside a tensor: got {count} of {head.parts} parts")
    return tensors