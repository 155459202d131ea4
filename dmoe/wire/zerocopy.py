"""The tensor-carrying messages of ExpertService, read and written without copying their tensors' bytes.

protobuf's Python messages copy a ``bytes`` field at every step: parsing copies it into the message, each read
copies it out again, and building a message copies what is assigned, then serialising copies it once more. For
a batch of 2048 rows of h=1024 that is ~8 MiB per copy, four times on each side of each call: host-side copies
were most of the server path's time next to a GPU's compute (benchmarks/README.md, "On a GPU"). Here:

- **Reading** (:func:`parse_request`, :func:`parse_batch_request`, :func:`parse_response`,
  :func:`parse_batch_response`): a message of at least :data:`ZERO_COPY_MIN_BYTES` is walked in Python and its
  tensors' buffers are ``memoryview`` slices of the received bytes; :func:`dmoe.wire.codec.deserialize` turns
  them into tensors without a copy. The views have the attribute names of the generated messages, so code reads
  either. Unknown fields are skipped, as protobuf skips them (a newer peer's additions), a few per message. A
  message is read within a budget of :data:`MAX_FIELDS` units (a field, a dimension: 1; a varint of 2 bytes or
  more: 1 a byte; a nested message: 8 more, its own objects), what an honest batch needs: the walk runs on the
  server's one event loop, with the garbage collector paused (:func:`_walk`), and no message holds it more than
  ~20-30 ms. Copies of a field beyond what writers
  write (a single field twice, a third pad) and a batch's item past :data:`MAX_BATCH_ITEMS` are refused where they
  start (review 106). What the walk cannot read (truncation, bad UTF-8, groups) or refuses is junk:
  ``DecodeError``. Smaller messages go to protobuf directly (their copies cost less than a walk in Python, and
  their size bounds what protobuf builds), as do small unusual ones, so protobuf decides exactly as before there.
- **Writing** (:func:`request_message`, :func:`batch_request_message`, :func:`response_message`,
  :func:`batch_response_message`, of tensors from :func:`dmoe.wire.codec.pack`): a :data:`Message`'s bytes are one
  ``b"".join`` of its small headers and its tensors' memory (or the same chunks written into shared memory), one
  copy in all. What protobuf would write, except that large
  buffers sit between two ``Tensor.pad`` fields that align them in the message (tests compare both ways).

Field numbers come from the generated descriptors, checked at import against the layout written here.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Sequence

from google.protobuf.message import DecodeError

from dmoe.wire import dmoe_pb2
from dmoe.wire.codec import MAX_NDIM, NONE, GatheredRows, OutgoingTensor, TensorView

#: Messages shorter than this are parsed by protobuf: below it, protobuf's copies cost less than walking the fields
#: in Python. Measured on a 16-item batch request: 1.4x slower in place at 64 KiB, even at 256 KiB, 26x faster at 4 MiB.
ZERO_COPY_MIN_BYTES = 256 * 1024

#: The budget of one message read in place, in units of about the same time whatever the message is made of: a
#: field or a dimension costs 1, a varint of 2 bytes or more 1 a byte, a nested message (an item, a tensor, a
#: result) :data:`_NESTED_COST` more. It bounds the objects a message makes (a 2-byte empty item became ~80 bytes of
#: them, review 93) and the time its walk holds the server's one event loop, ~0.2 us a unit: at 2**20, 2 MiB
#: requests of repeated fields held it 1-8 s each, and ~1.5 MiB/s of them made an honest forward wait 5 s (review
#: 106). This is what honest batches need: MAX_BATCH_ITEMS items of an ffn's forward (1 tensor) cost ~40k, of its
#: backward (2) ~64k; clients split a batch whose request or answer would cost more (:func:`item_fields`).
MAX_FIELDS = 1 << 17
#: Fields of numbers (or wire types) this version does not know that one message (a tensor, an item, a result, a
#: batch) may hold: a newer peer adds a few. A 1 MiB request of a million of them, or of dimensions, held the
#: server's loop 0.8 s (review 93); the fields this version knows may repeat no more than writers repeat them
#: (:class:`_Layout`): once, twice for ``Tensor.pad``, :data:`~dmoe.wire.codec.MAX_NDIM` dimensions (review 106).
MAX_UNKNOWN_FIELDS = 64
#: Tensors one request, answer or batch item may hold (an expert's schema has a few): 100k empty ones in a 1.3 MiB
#: request cost the loop 0.6 s within the field budget
MAX_TENSORS = 256
#: The most items (experts' requests) in one forward_batch/backward_batch call, and results in its answer; servers
#: refuse more. The reader refuses the first item past it, rather than read them all first (review 106).
MAX_BATCH_ITEMS = 1024
#: What a nested message costs beyond its field: an empty one took as long as ~9 plain fields.
_NESTED_COST = 8

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MAX_FIELD_NUMBER = (1 << 29) - 1  # protobuf's: a larger one is corrupt
_MASK64 = (1 << 64) - 1


def _check_layout() -> None:
    """Fails at import if proto/dmoe.proto renumbered or retyped a field this module writes by hand."""
    want = {
        "Tensor": {"buffer": 1, "shape": 2, "dtype": 3, "compression": 4, "aux": 5, "parts": 6, "pad": 7},
        "ExpertRequest": {"uid": 1, "tensors": 2, "response_compression": 3, "activation_id": 4},
        "ExpertResponse": {"tensors": 1},
        "BatchRequest": {"items": 1},
        "ExpertResult": {"tensors": 1, "code": 2, "message": 3},
        "BatchResponse": {"results": 1},
    }
    for message, fields in want.items():
        numbers = {f.name: f.number for f in dmoe_pb2.DESCRIPTOR.message_types_by_name[message].fields}
        if numbers != fields:
            raise ImportError(f"dmoe.{message}'s fields are {numbers}; dmoe/wire/zerocopy.py is written for {fields}")


_check_layout()


class _Unusual(Exception):
    """Something this reader cannot read: junk in a large message, left to protobuf's parser in a small one."""


class TooManyFields(DecodeError):
    """A message over the :data:`MAX_FIELDS` budget (tensors, dimensions or unknown fields by the ten thousand)."""


class _Budget:
    """The units of :data:`MAX_FIELDS` a message may still spend."""

    __slots__ = ("left",)

    def __init__(self, fields: int):
        self.left = fields

    def take(self, cost: int = 1) -> None:
        self.left -= cost
        if self.left < 0:
            raise self.spent()

    @staticmethod
    def spent() -> TooManyFields:
        return TooManyFields(f"a message over the budget of {MAX_FIELDS} fields (nested messages cost "
                             f"{1 + _NESTED_COST} each)")


class _Layout:
    """The fields of one message type that this version reads: by field number, the wire types it takes, and the
    most copies a writer (ours or protobuf's) puts in one message. protobuf keeps the last of repeated copies of a
    single field, so a message of a million copies of one is valid; read one at a time in Python, they held a
    server's event loop for seconds (review 106). A field of another number or wire type is unknown (a newer
    peer's): skipped, as protobuf skips it, at most :data:`MAX_UNKNOWN_FIELDS` of them."""

    __slots__ = ("message", "wire_types", "most", "names")

    def __init__(self, message: str, fields: dict[int, tuple[str, tuple[int, ...], int]]):
        size = max(fields) + 1
        self.message = message
        self.wire_types = [0] * size  # a bit per wire type taken
        self.most, self.names = [0] * size, [""] * size
        for number, (name, wire_types, most) in fields.items():
            self.wire_types[number] = sum(1 << wire_type for wire_type in wire_types)
            self.most[number], self.names[number] = most, name

    def too_many(self, number: int) -> _Unusual:
        most, name = self.most[number], self.names[number]
        if most == 1:
            return _Unusual(f"{self.message}.{name} twice")
        return _Unusual(f"more than {most} {name} in one {self.message}")


_TENSOR = _Layout("Tensor", {1: ("buffer", (_LEN,), 1), 2: ("shape fields", (_LEN, _VARINT), MAX_NDIM),
                             3: ("dtype", (_LEN,), 1), 4: ("compression", (_VARINT,), 1), 5: ("aux", (_LEN,), 1),
                             6: ("parts", (_VARINT,), 1), 7: ("pads", (_LEN,), 2)})  # (a pad each side of a buffer)
_REQUEST = _Layout("ExpertRequest", {1: ("uid", (_LEN,), 1), 2: ("tensors", (_LEN,), MAX_TENSORS),
                                     3: ("response_compression", (_VARINT,), 1), 4: ("activation_id", (_LEN,), 1)})
_RESPONSE = _Layout("ExpertResponse", {1: ("tensors", (_LEN,), MAX_TENSORS)})
_BATCH_REQUEST = _Layout("BatchRequest", {1: ("items", (_LEN,), MAX_BATCH_ITEMS)})
_RESULT = _Layout("ExpertResult", {1: ("tensors", (_LEN,), MAX_TENSORS), 2: ("code", (_VARINT,), 1),
                                   3: ("message", (_LEN,), 1)})
_BATCH_RESPONSE = _Layout("BatchResponse", {1: ("results", (_LEN,), MAX_BATCH_ITEMS)})


def item_fields(shapes: Sequence[Sequence[int]]) -> int:
    """At most what a batch item (or an answer's result) holding tensors of these shapes costs the reader's budget,
    every field written and every length in 5 bytes: a writer keeps a batch, and the answer it expects, within
    :data:`MAX_FIELDS` (review 106)."""
    nested = 1 + _NESTED_COST + 5  # its field, its objects, its length
    tensors = sum(nested + 7 + 10 + sum(1 if 0 <= dim < 0x80 else 1 + len(_encode_varint(dim)) for dim in shape)
                  for shape in shapes)  # 7 fields, 2 lengths (buffer, aux), packed dimensions
    return nested + 3 + 10 + tensors  # uid, compression and activation id (or code and message), 2 lengths


# ---------------------------------------------------------------------------------------------------- reading


@dataclass(eq=False)
class RequestView:
    """A ``dmoe.ExpertRequest`` read in place."""

    uid: str = ""
    tensors: list[TensorView] = field(default_factory=list)
    response_compression: int = 0
    activation_id: bytes = b""


@dataclass(eq=False)
class BatchRequestView:
    items: list[RequestView] = field(default_factory=list)


# The answers: read in place (their tensors are TensorViews), or built by a server to be written (OutgoingTensors).


@dataclass(eq=False)
class Response:
    """A ``dmoe.ExpertResponse``: one forward's or backward's outputs."""

    tensors: list = field(default_factory=list)


@dataclass(eq=False)
class Result:
    """A ``dmoe.ExpertResult``: one item's outcome in a batch answer, its tensors (code 0) or a gRPC status code
    and message."""

    tensors: list = field(default_factory=list)
    code: int = 0
    message: str = ""


@dataclass(eq=False)
class BatchResponse:
    """A ``dmoe.BatchResponse``: a result per item, in the items' order."""

    results: list[Result] = field(default_factory=list)


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end and shift < 70:  # at most 10 bytes
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
        shift += 7
    raise _Unusual("truncated or overlong varint")


def _long_varint(data: bytes, pos: int, end: int, budget: _Budget) -> tuple[int, int]:
    """:func:`_varint`, for one not read inline (two bytes or more), at a unit of the budget per byte: a field of a
    5-byte tag and a 10-byte value took 25 times as long as a one-byte field (review 106)."""
    value, stop = _varint(data, pos, end)
    budget.left -= stop - pos
    return value, stop


def _fields(data: bytes, pos: int, end: int, budget: _Budget, layout: _Layout):
    """(field number, wire type, value, value's end) of each field of ``layout`` in ``data[pos:end]``: a varint's
    value, or a length-delimited field's start (its bytes are ``data[value:value's end]``). Other fields are skipped
    here, at most :data:`MAX_UNKNOWN_FIELDS` of them; a copy of a field beyond what writers write is
    :class:`_Unusual`. (One-byte tags, varints and lengths, most of a message's, are read inline: 4 times faster.)"""
    wire_types, most = layout.wire_types, layout.most
    known = len(wire_types)
    copies = [0] * known
    unknown = 0
    while pos < end:
        budget.left -= 1
        if budget.left < 0:
            raise budget.spent()
        key = data[pos]
        if key < 0x80:
            pos += 1
        else:
            start = pos
            key, pos = _long_varint(data, pos, end, budget)
            if pos - start > 5:  # (protobuf reads a tag, and a length, in at most 5 bytes)
                raise _Unusual("overlong field tag")
        number, wire_type = key >> 3, key & 7
        if not 0 < number <= _MAX_FIELD_NUMBER:
            raise _Unusual(f"field number {number}")
        if wire_type == _VARINT:
            value = data[pos] if pos < end else 0x80
            if value < 0x80:
                pos += 1
            else:
                value, pos = _long_varint(data, pos, end, budget)
            stop = pos
        else:
            if wire_type == _LEN:
                length = data[pos] if pos < end else 0x80
                if length < 0x80:
                    pos += 1
                else:
                    start = pos
                    length, pos = _long_varint(data, pos, end, budget)
                    if pos - start > 5 or length >= 1 << 31:
                        raise _Unusual("overlong length")
            elif wire_type == _I64 or wire_type == _I32:
                length = 8 if wire_type == _I64 else 4
            else:
                raise _Unusual(f"wire type {wire_type}")
            if length > end - pos:
                raise _Unusual("length past the end")
            value = pos
            pos = stop = pos + length
        if number < known and wire_types[number] >> wire_type & 1:
            copies[number] += 1
            if copies[number] > most[number]:
                raise layout.too_many(number)
            yield number, wire_type, value, stop
        else:  # a field this version does not know: skipped, as protobuf skips it
            unknown += 1
            if unknown > MAX_UNKNOWN_FIELDS:
                raise _Unusual(f"more than {MAX_UNKNOWN_FIELDS} unknown fields in one {layout.message}")


def _int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(data: bytes, start: int, end: int) -> str:
    try:
        return data[start:end].decode("utf-8")
    except UnicodeDecodeError:
        raise _Unusual("invalid UTF-8") from None


def _tensor(data: bytes, view: memoryview, pos: int, end: int, budget: _Budget) -> TensorView:
    tensor = TensorView()
    for number, wire_type, value, stop in _fields(data, pos, end, budget, _TENSOR):
        if number == 1:
            tensor.buffer = view[value:stop]
        elif number == 2:
            if wire_type == _LEN:  # packed, as protobuf writes repeated int64
                while value < stop:
                    budget.take()
                    dim = data[value]
                    if dim < 0x80:
                        value += 1
                    else:
                        dim, value = _long_varint(data, value, stop, budget)
                    tensor.shape.append(_int64(dim))
                    if len(tensor.shape) > MAX_NDIM:
                        raise _Unusual(f"a tensor of more than {MAX_NDIM} dimensions")
            else:  # a dimension of its own: a unit as a packed one, and one for its field
                budget.take()
                tensor.shape.append(_int64(value))
                if len(tensor.shape) > MAX_NDIM:
                    raise _Unusual(f"a tensor of more than {MAX_NDIM} dimensions")
        elif number == 3:
            tensor.dtype = _text(data, value, stop)
        elif number == 4:
            tensor.compression = _int32(value)
        elif number == 5:
            tensor.aux = data[value:stop]
        elif number == 6:
            tensor.parts = value & 0xFFFFFFFF
        # else: padding (7), skipped
    return tensor


def _request(data: bytes, view: memoryview, pos: int, end: int, budget: _Budget) -> RequestView:
    request = RequestView()
    for number, wire_type, value, stop in _fields(data, pos, end, budget, _REQUEST):
        if number == 1:
            request.uid = _text(data, value, stop)
        elif number == 2:
            budget.take(_NESTED_COST)
            request.tensors.append(_tensor(data, view, value, stop, budget))
        elif number == 3:
            request.response_compression = _int32(value)
        else:
            request.activation_id = data[value:stop]
    return request


def _elements(data: bytes, view: memoryview, pos: int, end: int, budget: _Budget, read, layout: _Layout) -> list:
    """The elements of a message whose one field (number 1) is a repeated message, each read by ``read``; at most
    the layout's most of them (the first one past it is refused, not read)."""
    elements = []
    for _, _, value, stop in _fields(data, pos, end, budget, layout):
        budget.take(_NESTED_COST)
        elements.append(read(data, view, value, stop, budget))
    return elements


def _batch_request(data: bytes, view: memoryview, pos: int, end: int, budget: _Budget) -> BatchRequestView:
    return BatchRequestView(_elements(data, view, pos, end, budget, _request, _BATCH_REQUEST))


def _response(data: bytes, view: memoryview, pos: int, end: int, budget: _Budget) -> Response:
    return Response(_elements(data, view, pos, end, budget, _tensor, _RESPONSE))


def _result(data: bytes, view: memoryview, pos: int, end: int, budget: _Budget) -> Result:
    result = Result()
    for number, wire_type, value, stop in _fields(data, pos, end, budget, _RESULT):
        if number == 1:
            budget.take(_NESTED_COST)
            result.tensors.append(_tensor(data, view, value, stop, budget))
        elif number == 2:
            result.code = value & 0xFFFFFFFF
        else:
            result.message = _text(data, value, stop)
    return result


def _batch_response(data: bytes, view: memoryview, pos: int, end: int, budget: _Budget) -> BatchResponse:
    return BatchResponse(_elements(data, view, pos, end, budget, _result, _BATCH_RESPONSE))


def _walk(read, data: bytes) -> Any:
    """``read`` over the whole of ``data`` within :data:`MAX_FIELDS`, with the cyclic garbage collector paused.

    A walk makes an object or three per nested message, all alive until it ends, so with the collector on, a
    message of 14k empty tensors started ~40 collections of what a server holds, and with them a full one every
    message or two: 36-77 ms of the loop, 3-6 times the largest honest batch, where its units took ~20 ms (review
    113 D2). Paused, a refused message's objects are freed by their counts and leave nothing to collect, and an
    accepted one's are collected once, after it. gc.disable is the process's: other threads' collections wait for
    the walk too (~30 ms at most; reference counts still free their garbage). The collector is left off if it was;
    a walk that starts while another has it paused leaves it to that one, and one that ends turns it back on even
    if another thread turned it off meanwhile (nothing in dmoe does)."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return read(data, memoryview(data), 0, len(data), _Budget(MAX_FIELDS))
    except (_Unusual, DecodeError) as refused:  # its traceback holds the walk's frames and all they made: let go
        raise refused.with_traceback(None)      # of them before the collector is back on
    finally:
        if paused:
            gc.enable()


def _parser(read, message_cls, min_bytes: int | None = None):
    def parse(data: bytes) -> Any:
        if len(data) >= (ZERO_COPY_MIN_BYTES if min_bytes is None else min_bytes):
            data = bytes(data)  # (a no-op for the bytes gRPC hands over)
            try:
                return _walk(read, data)
            except _Unusual as unusual:
                if len(data) >= ZERO_COPY_MIN_BYTES:  # protobuf would build what it holds, whatever its count
                    raise DecodeError(f"not a valid {message_cls.__name__}: {unusual}") from None
        return message_cls.FromString(data)
    parse.__name__ = parse.__qualname__ = f"parse_{message_cls.__name__}"
    parse.__doc__ = (f"A ``dmoe.{message_cls.__name__}`` from its bytes: a view of them, or a protobuf message "
                     "(small or unusual ones); either way the same attributes. Junk raises protobuf's DecodeError.")
    return parse


parse_request = _parser(_request, dmoe_pb2.ExpertRequest)
parse_batch_request = _parser(_batch_request, dmoe_pb2.BatchRequest)
parse_response = _parser(_response, dmoe_pb2.ExpertResponse)
parse_batch_response = _parser(_batch_response, dmoe_pb2.BatchResponse)


@dataclass(eq=False)
class OverBudget:
    """A batch answer left unread for costing more than :data:`MAX_FIELDS` (``reason``): a client that did not know
    how large its items' answers would be sends them again in smaller batches (review 113 D1)."""

    reason: str


def parse_batch_answer(data: bytes) -> Any:
    """:func:`parse_batch_response`, for a client: an answer over the budget is an :class:`OverBudget`, not an
    error (gRPC turns its deserializer's errors into INTERNAL, and the client could not tell why)."""
    try:
        return parse_batch_response(data)
    except TooManyFields as error:
        return OverBudget(str(error))


#: how the answer of each tensor-carrying call is read, by method
ANSWER_PARSERS = {"forward": parse_response, "backward": parse_response, "forward_batch": parse_batch_answer,
                  "backward_batch": parse_batch_answer}


def read_in_place(message_cls, data: bytes) -> Any:
    """The zero-copy reader of ``message_cls`` at any size (tests compare it with protobuf's on small messages);
    raises ``DecodeError`` where protobuf does."""
    read = {dmoe_pb2.ExpertRequest: _request, dmoe_pb2.BatchRequest: _batch_request,
            dmoe_pb2.ExpertResponse: _response, dmoe_pb2.BatchResponse: _batch_response}[message_cls]
    return _parser(read, message_cls, min_bytes=0)(data)


# ---------------------------------------------------------------------------------------------------- writing


def _encode_varint(value: int) -> bytes:
    value &= _MASK64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS = [_encode_varint(i) for i in range(128)]


def _uvarint(value: int) -> bytes:
    return _SMALL_VARINTS[value] if 0 <= value < 128 else _encode_varint(value)


def _key(number: int, wire_type: int) -> bytes:
    return _uvarint(number << 3 | wire_type)


#: Buffers of at least this many bytes are written at a multiple of ALIGN bytes from the message's start (with
#: Tensor.pad): received bytes objects start aligned, so a tensor read in place is aligned for its dtype.
ALIGN, ALIGN_MIN_BYTES = 8, 4096


class _PadSlot:
    """Room for ``Tensor.pad`` before and after a buffer: 2 + p and 2 + (ALIGN - 1 - p) bytes, so a tensor's size
    does not depend on p, and p is chosen once the buffer's offset in the whole message is known."""

    __slots__ = ("header",)
    SIZE = 4 + ALIGN - 1  # both pads together

    def __init__(self, header: int):
        self.header = header  # bytes between the first pad and the buffer (the buffer's key and length)

    def fill(self, offset: int) -> tuple[bytes, bytes]:
        before = (-(offset + 2 + self.header)) % ALIGN
        after = ALIGN - 1 - before
        pad = _key(7, _LEN)
        return pad + _SMALL_VARINTS[before] + bytes(before), pad + _SMALL_VARINTS[after] + bytes(after)


class _Writer:
    """Chunks of a message in order, and their total length: a nested message's header needs its length."""

    __slots__ = ("chunks", "size")

    def __init__(self) -> None:
        self.chunks: list[Any] = []
        self.size = 0

    def raw(self, chunk) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)

    def varint(self, number: int, value: int) -> None:
        if value:  # proto3 leaves zeros out
            self.raw(_key(number, _VARINT) + _uvarint(value & _MASK64))

    def data(self, number: int, chunk) -> None:
        size = len(chunk)
        if size:
            self.raw(_key(number, _LEN) + _uvarint(size))
            self.raw(chunk)

    def text(self, number: int, value: str) -> None:
        self.data(number, value.encode("utf-8"))

    def nested(self, number: int, inner: "_Writer") -> None:
        self.raw(_key(number, _LEN) + _uvarint(inner.size))  # written even when empty: it is an element
        self.chunks.extend(inner.chunks)
        self.size += inner.size

    def aligned_data(self, number: int, chunk) -> None:
        """``data`` between two pads, for a buffer that a reader will use in place."""
        size = len(chunk)
        if size < ALIGN_MIN_BYTES:
            return self.data(number, chunk)
        header = _key(number, _LEN) + _uvarint(size)
        slot = _PadSlot(len(header))
        self.chunks += [slot, header, chunk, slot]
        self.size += _PadSlot.SIZE + len(header) + size

    def _resolved(self) -> list:
        """The chunks with every pad slot filled for its buffer's offset from the message's start."""
        chunks, offset, after = self.chunks, 0, None
        if any(type(chunk) is _PadSlot for chunk in chunks):
            chunks = list(chunks)
            for i, chunk in enumerate(chunks):
                if type(chunk) is _PadSlot:
                    if after is None:
                        chunks[i], after = chunk.fill(offset)
                    else:
                        chunks[i], after = after, None
                offset += len(chunks[i])
        return chunks

    def join(self) -> bytes:
        """The message's bytes (one copy of the tensors' memory; rows of :class:`GatheredRows` are gathered first)."""
        return b"".join([memoryview(chunk.array()).cast("B") if type(chunk) is GatheredRows else chunk
                         for chunk in self._resolved()])

    def write_into(self, target: memoryview) -> int:
        """Writes the message at the start of ``target`` (a writable byte view at least :attr:`size` long, starting
        at a multiple of :data:`ALIGN` of its memory for aligned buffers); returns the bytes written.
        :class:`GatheredRows` are gathered straight into it."""
        position = 0
        for chunk in self._resolved():
            end = position + len(chunk)
            if type(chunk) is GatheredRows:
                chunk.write_into(target[position:end])
            else:
                target[position:end] = chunk
            position = end
        return position


#: A message ready to send: ``size`` bytes, written by ``join()`` (as bytes) or ``write_into(view)`` (into memory
#: such as a shared segment, :mod:`dmoe.wire.shared_memory`).
Message = _Writer


def _tensor_writer(tensor: OutgoingTensor) -> _Writer:
    w = _Writer()
    w.aligned_data(1, tensor.buffer)
    if tensor.shape:
        w.data(2, b"".join(_uvarint(dim & _MASK64) for dim in tensor.shape))
    w.text(3, tensor.dtype)
    w.varint(4, tensor.compression)
    w.data(5, tensor.aux)
    return w


def _request_writer(uid: str, tensors: Sequence[OutgoingTensor], compression: int, activation_id: bytes) -> _Writer:
    w = _Writer()
    w.text(1, uid)
    for tensor in tensors:
        w.nested(2, _tensor_writer(tensor))
    w.varint(3, compression)
    w.data(4, activation_id or b"")
    return w


def request_message(uid: str, tensors: Sequence[OutgoingTensor], compression: int = NONE,
                    activation_id: bytes | None = None) -> Message:
    """A ``dmoe.ExpertRequest``; ``compression`` is what the answer is asked to use."""
    return _request_writer(uid, tensors, compression, activation_id or b"")


def batch_request_message(items: Sequence[tuple[str, Sequence[OutgoingTensor], bytes | None]],
                          compression: int = NONE) -> Message:
    """A ``dmoe.BatchRequest``: items of (uid, tensors, activation id), every answer asked ``compression``."""
    w = _Writer()
    for uid, tensors, activation_id in items:
        w.nested(1, _request_writer(uid, tensors, compression, activation_id or b""))
    return w


def response_message(answer: Response) -> Message:
    """A ``dmoe.ExpertResponse``."""
    w = _Writer()
    for tensor in answer.tensors:
        w.nested(1, _tensor_writer(tensor))
    return w


def batch_response_message(answer: BatchResponse) -> Message:
    """A ``dmoe.BatchResponse``."""
    w = _Writer()
    for result in answer.results:
        inner = _Writer()
        for tensor in result.tensors:
            inner.nested(1, _tensor_writer(tensor))
        inner.varint(2, result.code)
        inner.text(3, result.message)
        w.nested(1, inner)
    return w


def response_bytes(answer: Response) -> bytes:
    """A ``dmoe.ExpertResponse``'s bytes."""
    return response_message(answer).join()


def batch_response_bytes(answer: BatchResponse) -> bytes:
    """A ``dmoe.BatchResponse``'s bytes."""
    return batch_response_message(answer).join()
