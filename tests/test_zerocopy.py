"""dmoe.wire.zerocopy: its writers and protobuf read the same messages, its readers and protobuf agree on any bytes,
large tensors are read in place (aligned), and a server keeps no view of a shared message."""
from __future__ import annotations

import gc
import tracemalloc

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from dmoe.client import forward_future, forward_futures, new_activation_id
from dmoe.server import ExpertServer, ServerConfig
from dmoe.server.activations import kept_key
from dmoe.wire import FLOAT16, MAX_BATCH_ITEMS, NONE, UINT8, deserialize, dmoe_pb2, serialize
from dmoe.wire.codec import pack
from dmoe.wire import zerocopy as zc

MESSAGES = [dmoe_pb2.ExpertRequest, dmoe_pb2.BatchRequest, dmoe_pb2.ExpertResponse, dmoe_pb2.BatchResponse]


def fields(message) -> tuple:
    """A message's content, from a protobuf message or a view alike (padding and memoryviews left aside)."""
    def tensor(t):
        return bytes(t.buffer), tuple(t.shape), t.dtype, t.compression, bytes(t.aux), t.parts

    def request(r):
        return r.uid, tuple(map(tensor, r.tensors)), r.response_compression, bytes(r.activation_id)

    if hasattr(message, "items"):
        return tuple(map(request, message.items))
    if hasattr(message, "results"):
        return tuple((tuple(map(tensor, r.tensors)), r.code, r.message) for r in message.results)
    if hasattr(message, "uid"):
        return request(message)
    return tuple(map(tensor, message.tensors))


def tensors_of(shape, dtype):
    return (torch.randn(shape) * 10).to(dtype)


#: at most 7**3 elements of at most 8 bytes: every buffer stays under zc.ALIGN_MIN_BYTES, so none is padded (9**3
#: float64 elements were, and the writer's bytes then rightly differed from protobuf's)
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3)
assert 7 ** 3 * 8 < zc.ALIGN_MIN_BYTES
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8,
                          torch.bool])
compressions = st.sampled_from([NONE, FLOAT16, UINT8])
texts = st.text(max_size=12)


@st.composite
def items(draw):
    tensors = [tensors_of(draw(shapes), draw(dtypes)) for _ in range(draw(st.integers(0, 3)))]
    activation_id = draw(st.binary(max_size=20))
    return draw(texts), tensors, activation_id


@settings(max_examples=60, deadline=None)
@given(batch=st.lists(items(), min_size=0, max_size=4), compression=compressions, code=st.integers(0, 2**32 - 1),
       message=texts)
def test_the_writers_bytes_are_protobufs_for_small_tensors_and_both_readers_agree(batch, compression, code, message):
    # small tensors are not padded: the bytes are exactly protobuf's, so any reader reads them as before
    expected = dmoe_pb2.BatchRequest()
    for uid, tensors, activation_id in batch:
        item = expected.items.add(uid=uid, response_compression=compression, activation_id=activation_id)
        for t in tensors:
            serialize(t, compression, out=item.tensors.add())
    packed = [(uid, [pack(t, compression) for t in tensors], activation_id) for uid, tensors, activation_id in batch]
    written = zc.batch_request_message(packed, compression).join()
    assert written == expected.SerializeToString()
    assert fields(zc.read_in_place(dmoe_pb2.BatchRequest, written)) == fields(expected)

    answer = zc.BatchResponse([zc.Result(tensors) for _, tensors, _ in packed] + [zc.Result([], code, message)])
    response = dmoe_pb2.BatchResponse()
    for _, tensors, _ in batch:
        result = response.results.add()
        for t in tensors:
            serialize(t, compression, out=result.tensors.add())
    response.results.add(code=code, message=message)
    assert zc.batch_response_bytes(answer) == response.SerializeToString()
    for uid, tensors, activation_id in packed:
        single = zc.request_message(uid, tensors, compression, activation_id).join()
        assert fields(zc.read_in_place(dmoe_pb2.ExpertRequest, single)) == fields(
            dmoe_pb2.ExpertRequest.FromString(single))
        reply = zc.response_bytes(zc.Response(tensors))
        assert fields(zc.read_in_place(dmoe_pb2.ExpertResponse, reply)) == fields(
            dmoe_pb2.ExpertResponse.FromString(reply))


@pytest.mark.parametrize("rows", [1, 3, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_large_buffers_are_padded_to_an_aligned_offset_and_read_in_place(rows, dtype):
    tensors = [(torch.randn(rows, 1024) * 10).to(dtype), torch.randn(rows, 3), (torch.randn(rows, 513) * 10).to(dtype)]
    for uid in ("e", "ffn.10.31", "x" * 300):
        data = zc.batch_request_message([(uid, [pack(t) for t in tensors], new_activation_id()),
                                         ("other", [pack(tensors[0])], None)]).join()
        ours, theirs = zc.read_in_place(dmoe_pb2.BatchRequest, data), dmoe_pb2.BatchRequest.FromString(data)
        assert fields(ours) == fields(theirs)  # protobuf reads the padded message the same (Tensor.pad ignored)
        for item in ours.items:
            for message in item.tensors:
                if len(message.buffer) >= zc.ALIGN_MIN_BYTES:
                    assert isinstance(message.buffer, memoryview) and message.buffer.obj is data  # no copy
                    address = torch.frombuffer(message.buffer, dtype=torch.uint8).data_ptr()
                    assert address % zc.ALIGN == 0
        decoded = [deserialize(m) for m in ours.items[0].tensors]
        assert all(torch.equal(a, b) for a, b in zip(decoded, tensors))
        # parse_batch_request (what the server uses) leaves small messages to protobuf
        in_place = isinstance(zc.parse_batch_request(data), zc.BatchRequestView)
        assert in_place == (len(data) >= zc.ZERO_COPY_MIN_BYTES)


def test_a_misaligned_view_is_copied_by_deserialize():
    data = bytes(1) + torch.arange(100, dtype=torch.float32).numpy().tobytes()
    message = zc.TensorView(memoryview(data)[1:], [100], "float32")
    tensor = deserialize(message)
    assert tensor.data_ptr() % 4 == 0 and torch.equal(tensor, torch.arange(100, dtype=torch.float32))


def assert_reads_like_protobuf(message_cls, raw: bytes) -> None:
    """The same content as protobuf's parse, or DecodeError from both."""
    try:
        expected = fields(message_cls.FromString(raw))
    except DecodeError:
        with pytest.raises(DecodeError):
            zc.read_in_place(message_cls, raw)
        return
    assert fields(zc.read_in_place(message_cls, raw)) == expected


def valid_samples() -> list[bytes]:
    x, ids = torch.arange(10.0).view(2, 5) / 3, [torch.arange(6)]
    request = zc.request_message("ffn.0", [pack(x), pack(ids[0])], FLOAT16, b"id").join()
    batch = zc.batch_request_message([("a", [pack(x, UINT8)], b"i"), ("b", [pack(x)], None)]).join()
    response = zc.response_bytes(zc.Response([pack(x)]))
    results = zc.batch_response_bytes(zc.BatchResponse([zc.Result([pack(x)]), zc.Result([], 5, "no")]))
    big = zc.batch_request_message([("a", [pack(torch.arange(2048.0).view(1, 2048))], b"i")]).join()  # padded
    return [request, batch, response, results, big]


@settings(max_examples=300, deadline=None)
@given(sample=st.sampled_from(valid_samples()), message_cls=st.sampled_from(MESSAGES), data=st.data())
def test_on_any_bytes_the_reader_agrees_with_protobuf(sample, message_cls, data):
    """Truncated, flipped, spliced and random bytes: the same content, or DecodeError from both."""
    kind = data.draw(st.sampled_from(["cut", "flip", "splice", "random"]))
    raw = bytearray(sample)
    if kind == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    elif kind == "flip" and raw:
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    elif kind == "splice":
        at = data.draw(st.integers(0, len(raw)))
        raw[at:at] = data.draw(st.binary(max_size=12))
    else:
        raw = bytearray(data.draw(st.binary(max_size=64)))
    raw = bytes(raw)
    assert_reads_like_protobuf(message_cls, raw)


def _key(number: int, wire_type: int) -> bytes:
    return zc._encode_varint(number << 3 | wire_type)


#: where readers go wrong: the sign bits of 32 and 64 bits, values wider than the field
varints = st.one_of(st.sampled_from([0, 1, 2, 127, 128, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 2, 2**63 - 1, 2**63 + 4,
                                     2**64 - 1]), st.integers(0, 2**64 - 1))


@st.composite
def wire_message(draw, schema: dict) -> bytes:
    """Fields of the message's own numbers and kinds (``schema``: number -> "varint", "bytes", "packed", a tuple
    of those, or the strategy of a nested message), in some examples with others of any number and kind; values
    anywhere in range (64-bit varints, bad UTF-8): the encodings protobuf accepts, and many it does not."""
    noisy = draw(st.shared(st.booleans(), key="noisy"))  # one choice per example, for every level
    out = b""
    for _ in range(draw(st.integers(0, 5))):
        if schema and not (noisy and draw(st.integers(0, 7)) == 0):
            number = draw(st.sampled_from(sorted(schema)))
            kind = schema[number]
            if isinstance(kind, tuple):
                kind = draw(st.sampled_from(kind))
        else:
            number, kind = draw(st.integers(1, 8)), draw(st.sampled_from(["varint", "bytes", "packed", "fixed"]))
        if kind == "varint":
            out += _key(number, 0) + zc._encode_varint(draw(varints))
        elif kind == "fixed":
            out += _key(number, draw(st.sampled_from([1, 5]))) + bytes(draw(st.sampled_from([4, 8])))
        else:
            if kind == "packed":
                value = b"".join(zc._encode_varint(v) for v in draw(st.lists(varints, max_size=4)))
            elif kind == "bytes":
                value = draw(st.one_of(st.text(max_size=4).map(str.encode), st.text(max_size=4).map(str.encode),
                                       st.binary(max_size=8)))
            else:
                value = draw(kind)
            out += _key(number, 2) + zc._encode_varint(len(value)) + value
    return out


tensor_bytes = wire_message({1: "bytes", 2: ("packed", "varint"), 3: "bytes", 4: "varint", 5: "bytes", 6: "varint",
                             7: "bytes"})
request_bytes = wire_message({1: "bytes", 2: tensor_bytes, 3: "varint", 4: "bytes"})
result_bytes = wire_message({1: tensor_bytes, 2: "varint", 3: "bytes"})
STRUCTURED = {
    dmoe_pb2.ExpertRequest: request_bytes, dmoe_pb2.ExpertResponse: wire_message({1: tensor_bytes}),
    dmoe_pb2.BatchRequest: wire_message({1: request_bytes}), dmoe_pb2.BatchResponse: wire_message({1: result_bytes}),
}


def test_a_field_number_beyond_protobufs_largest_is_corrupt_for_both_readers():
    raw = b"\n\x10\t\x00\x00\x00\x00\n\x070\xc2\xa0\xf0\x90\x80\x80\n\x00"  # a 6-byte tag in the item: field > 2**29
    assert_reads_like_protobuf(dmoe_pb2.BatchRequest, raw)
    with pytest.raises(DecodeError):
        zc.read_in_place(dmoe_pb2.BatchRequest, raw)


@settings(max_examples=400, deadline=None)
@given(message_cls=st.sampled_from(MESSAGES), data=st.data())
def test_on_any_field_layout_the_reader_agrees_with_protobuf(message_cls, data):
    raw = data.draw(STRUCTURED[message_cls])
    assert_reads_like_protobuf(message_cls, raw)


def test_a_large_message_skips_unknown_fields_as_protobuf_does_and_junk_in_it_is_a_decode_error():
    x = torch.randn(128, 1024)
    request = dmoe_pb2.ExpertRequest(uid="ffn.0")
    serialize(x, out=request.tensors.add())
    data = request.SerializeToString()
    assert isinstance(zc.parse_request(data), zc.RequestView)
    for unknown in (b"\xa0\x06\x01", b"\xa1\x06" + bytes(8), b"\xa5\x06" + bytes(4), b"\xa2\x06\x02ab"):
        # field 100 as a varint, fixed64, fixed32, bytes: a newer peer's field, skipped by both readers
        parsed = zc.parse_request(data + unknown)
        assert isinstance(parsed, zc.RequestView) and fields(parsed) == fields(request)
        assert fields(dmoe_pb2.ExpertRequest.FromString(data + unknown)) == fields(request)
    for junk in (data[:-3], data + b"\xa3\x06", b"\x0a\x02\xff\xfe" + data):  # cut, a group, bad UTF-8 in uid
        with pytest.raises(DecodeError):
            zc.parse_request(junk)


@pytest.mark.parametrize("shapes", [
    [(1, 1024)], [(1, 1024)] * 2,             # a forward's and a backward's of an ffn expert (4 KiB buffers: padded)
    [(1, 32, 64)] * 3,                        # a transformer's backward of 2 inputs
    [(1,) * 7 + (1024,)] * 16,                # 16 tensors of 8 dimensions each
])
@pytest.mark.parametrize("compression", [NONE, UINT8])
def test_the_largest_batches_clients_send_and_their_answers_are_read_in_place(shapes, compression):
    """A client packs as many items in a batch as :func:`zc.item_fields` says fit the reader's budget (review 106):
    that many, every one at its largest, are read in place, requests and answers alike; an ffn's whole
    MAX_BATCH_ITEMS do."""
    count = min(MAX_BATCH_ITEMS, zc.MAX_FIELDS // zc.item_fields(shapes))
    tensors = [pack(torch.full(shape, 1e6), compression) for shape in shapes]
    data = zc.batch_request_message([("ffn.%d.%d" % (i, i) + "x" * 200, tensors, bytes(range(64)) * 2)
                                     for i in range(count)], compression).join()
    parsed = zc.parse_batch_request(data)
    assert isinstance(parsed, zc.BatchRequestView) and len(parsed.items) == count
    assert all(len(item.tensors) == len(shapes) for item in parsed.items)
    answer = zc.batch_response_bytes(zc.BatchResponse([zc.Result(tensors)] * count))
    assert len(zc.parse_batch_response(answer).results) == count
    if len(shapes) <= 2 and len(shapes[0]) <= 3:
        assert count == MAX_BATCH_ITEMS  # common experts' batches are not split


def test_a_client_splits_a_batch_that_its_answers_would_take_past_the_budget(monkeypatch):
    """Items of 1 input whose expected answers hold 16 tensors each: the answers, not the requests, decide."""
    from dmoe.client import remote_expert
    groups = []

    def batch_call(method, endpoint, items, **kwargs):
        groups.append(len(items))
        return [None] * len(items)

    monkeypatch.setattr(remote_expert, "_batch_call", batch_call)
    x, outputs = torch.randn(1, 8), [((1, 1024), torch.float32)] * 16
    remote_expert.forward_futures([(f"e.{i}", "127.0.0.1:1", [x], None) for i in range(MAX_BATCH_ITEMS)],
                                  expect=[outputs] * MAX_BATCH_ITEMS)
    per_call = zc.MAX_FIELDS // zc.item_fields([shape for shape, _ in outputs])
    assert sum(groups) == MAX_BATCH_ITEMS and max(groups) == per_call < MAX_BATCH_ITEMS
    answer = zc.batch_response_bytes(zc.BatchResponse([zc.Result([pack(torch.randn(1, 1024))] * 16)] * per_call))
    assert len(zc.parse_batch_response(answer).results) == per_call


@pytest.mark.parametrize("message_cls, element", [
    (dmoe_pb2.BatchRequest, b"\x0a\x00"),       # empty items
    (dmoe_pb2.ExpertRequest, b"\x12\x00"),      # empty tensors
    (dmoe_pb2.BatchResponse, b"\x0a\x00"),      # empty results, read by a client
    (dmoe_pb2.ExpertRequest, b"\x12" + zc._encode_varint(4 + (1 << 17)) + b"\x12" + zc._encode_varint(1 << 17)
     + bytes(1 << 17)),  # one tensor of 128k dimensions
])
def test_a_message_of_many_tiny_fields_is_refused_before_it_becomes_that_many_objects(message_cls, element):
    """Two bytes per empty item made ~80 bytes of Python objects each: 1M items in a 2 MiB request took 2.6 s of
    the server's loop and 168 MiB (a 64 MiB request, gigabytes), before any count was checked."""
    data = element * (max(1, (2 << 20) // len(element)))
    tracemalloc.start()
    try:
        # (refused by the field budget, or sooner by the limits on tensors, dimensions and items)
        with pytest.raises(DecodeError, match="over the budget|more than 256 tensors|more than 8 dimensions|"
                                              "more than 1024 (items|results)"):
            zc.read_in_place(message_cls, data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a bounded number of objects, not 1M (the time they took is the benchmarks' to measure: a loaded machine
    # made a bound on it fail)
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB while reading"


def test_a_cpu_server_keeps_no_view_of_a_message_shared_by_several_items():
    """Inputs kept for a backward must not pin a whole batch request: the activation cache counts only their rows
    (kept by the caller's machine and activation_id)."""
    with ExpertServer.create("ffn.[0:2]", "ffn", 1024, seed=1, config=ServerConfig(device="cpu")) as server:
        x = torch.randn(128, 1024)  # 512 KiB per item: read in place
        shared = [new_activation_id(), new_activation_id()]
        for future in forward_futures([(f"ffn.{i}", server.endpoint, [x], shared[i]) for i in range(2)]):
            future.result(30)
        alone = new_activation_id()
        forward_future(server.endpoint, "ffn.0", [x], activation_id=alone).result(30)
        for i in range(2):
            (kept,) = server.activations.inputs(f"ffn.{i}", kept_key("127.0.0.1", shared[i]))
            assert kept.untyped_storage().resizable()  # the server's own memory
            assert torch.equal(kept, x)
        (kept,) = server.activations.inputs("ffn.0", kept_key("127.0.0.1", alone))
        assert not kept.untyped_storage().resizable()  # a request of its own is used in place: zero copies
        assert torch.equal(kept, x)
        # ... unless its message is much larger than its tensors: 1 row padded to 8 MiB (a field the reader skips)
        padded = new_activation_id()
        tensor = serialize(x[:1]).SerializeToString() + dmoe_pb2.Tensor(pad=bytes(8 << 20)).SerializeToString()
        request = (dmoe_pb2.ExpertRequest(uid="ffn.0", activation_id=padded).SerializeToString()
                   + b"\x12" + zc._encode_varint(len(tensor)) + tensor)
        with grpc.insecure_channel(server.endpoint) as channel:
            channel.unary_unary("/dmoe.ExpertService/forward", request_serializer=bytes,
                                response_deserializer=bytes)(request, timeout=30)
        (kept,) = server.activations.inputs("ffn.0", kept_key("127.0.0.1", padded))
        assert kept.untyped_storage().resizable() and torch.equal(kept, x[:1])  # a copy of its row, not a view


@pytest.mark.parametrize("compression", [NONE, FLOAT16, UINT8])
@pytest.mark.parametrize("width", [3, 1024])  # rows of 12 bytes (written as they are) and of 4 KiB (padded)
def test_rows_gathered_into_a_message_are_written_as_the_gathered_tensor_would_be(compression, width):
    from dmoe.client.moe import _bits
    from dmoe.wire.codec import GatheredRows
    source = torch.randn(10, width)
    index = np.array([7, 0, 3, 3, 9])
    rows = GatheredRows(_bits(source), index, torch.float32)
    assert rows.shape == (5, width) and len(rows) == rows.nbytes == 5 * width * 4
    assert torch.equal(rows.tensor(), source[index])
    items = [("a", [pack(source[index], compression)], b"id"), ("b", [pack(source[:2], compression)], None)]
    expected = zc.batch_request_message(items, compression).join()
    message = zc.batch_request_message([("a", [pack(rows, compression)], b"id"), items[1]], compression)
    assert message.join() == expected
    target = bytearray(message.size + 8)
    assert message.write_into(memoryview(target)[:message.size]) == message.size
    assert bytes(target[:message.size]) == expected
    assert serialize(rows, compression) == serialize(source[index], compression)  # a streamed call's tensors


def test_a_large_message_of_absurd_dimensions_fields_or_tensors_is_refused_at_the_first_one_too_many():
    """Read a field at a time up to the budget of 2**20, a 1 MiB request of a million dimensions (or unknown
    fields) held the server's loop 0.8 s before it was refused (review 93): a tensor has at most MAX_NDIM
    dimensions, a message at most MAX_UNKNOWN_FIELDS fields of numbers this version does not know and MAX_TENSORS
    tensors; past them a large message is refused (a small one is left to protobuf, which takes it as it is)."""
    n = (1 << 20) - 100
    dims = b"\x12" + zc._encode_varint(n) + b"\x01" * n
    cases = {"dimensions": b"\x12" + zc._encode_varint(len(dims)) + dims,
             "unknown fields": b"\x78\x01" * n,
             "tensors": b"\x12\x09\x1a\x07float32" * 100_000 + b"\x7a\x80\x80\x10" + bytes(1 << 18)}
    for words, data in cases.items():
        with pytest.raises(DecodeError, match=f"more than .* {words}" if words != "dimensions" else "more than 8 dim"):
            zc.parse_request(data)
    # up to the limits, read as before
    within = dmoe_pb2.ExpertRequest(uid="a", tensors=[dmoe_pb2.Tensor(shape=[1] * 8, dtype="float32")] * 16)
    within = within.SerializeToString() + b"\x78\x01" * zc.MAX_UNKNOWN_FIELDS
    ours = zc.read_in_place(dmoe_pb2.ExpertRequest, within)
    assert len(ours.tensors) == 16 and ours.tensors[0].shape == [1] * 8


@pytest.mark.parametrize("data", [b"\x8a\x80\x80\x80\x80\x00\x01a",        # uid's tag in 6 bytes
                                  b"\x0a\x81\x80\x80\x80\x80\x00a"])       # its length in 6 bytes
def test_an_overlong_tag_or_length_is_junk_as_protobuf_says(data):
    """The reader took tags and lengths written in 6 bytes or more, which protobuf refuses (review 93)."""
    with pytest.raises(DecodeError):
        dmoe_pb2.ExpertRequest.FromString(data)
    with pytest.raises(DecodeError):
        zc.parse_request(data + b"\x7a" + zc._encode_varint(zc.ZERO_COPY_MIN_BYTES) + bytes(zc.ZERO_COPY_MIN_BYTES))
    well_formed = b"\x0a\x01a" + b"\x7a" + zc._encode_varint(zc.ZERO_COPY_MIN_BYTES) + bytes(zc.ZERO_COPY_MIN_BYTES)
    assert zc.parse_request(well_formed).uid == "a"  # read in place, past its unknown field


def _nested(number: int, body: bytes) -> bytes:
    return _key(number, 2) + zc._encode_varint(len(body)) + body


#: 256 KiB in a field no reader knows (15): a message read in place whatever else it holds
_LARGE = _nested(15, bytes(zc.ZERO_COPY_MIN_BYTES))


def _request_with(fields: bytes) -> bytes:
    return _LARGE + fields


def _tensor_with(fields: bytes) -> bytes:
    return _LARGE + _nested(2, fields)


def _result_with(fields: bytes) -> bytes:
    return _LARGE + _nested(1, fields)


@pytest.mark.parametrize("build, parse, field, most", [
    (_request_with, zc.parse_request, b"\x0a\x01a", 1),            # ExpertRequest.uid
    (_request_with, zc.parse_request, b"\x18\x01", 1),             # .response_compression
    (_request_with, zc.parse_request, b"\x22\x01a", 1),            # .activation_id
    (_tensor_with, zc.parse_request, b"\x0a\x01a", 1),             # Tensor.buffer
    (_tensor_with, zc.parse_request, b"\x1a\x01a", 1),             # .dtype
    (_tensor_with, zc.parse_request, b"\x20\x01", 1),              # .compression
    (_tensor_with, zc.parse_request, b"\x2a\x01a", 1),             # .aux
    (_tensor_with, zc.parse_request, b"\x30\x01", 1),              # .parts
    (_tensor_with, zc.parse_request, b"\x3a\x00", 2),              # .pad: one each side of a buffer
    (_tensor_with, zc.parse_request, b"\x12\x00", 8),              # .shape, packed fields holding no dimension
    (_result_with, zc.parse_batch_response, b"\x10\x01", 1),       # ExpertResult.code
    (_result_with, zc.parse_batch_response, b"\x1a\x01a", 1),      # .message
    (_request_with, zc.parse_request, b"\x08\x01", 63),            # uid as a varint: unknown, as _LARGE is
    (_tensor_with, zc.parse_request, b"\x18\x01", 64),             # dtype as a varint: unknown
])
def test_a_large_message_holding_more_copies_of_a_field_than_writers_write_is_refused(build, parse, field, most):
    """protobuf keeps the last copy of a repeated single field, so a million of them make a valid message: read one
    at a time, 2 MiB of them held a server's loop 1-8 s (review 106). Writers write each once (a pad each side of
    an aligned buffer, one packed shape): a copy more is refused, at once; a small message is protobuf's, as ever."""
    for copies in (most, most + 1):
        data = build(field * copies)
        protobuf_cls = dmoe_pb2.BatchResponse if parse is zc.parse_batch_response else dmoe_pb2.ExpertRequest
        protobuf_cls.FromString(data)  # valid protobuf either way
        if copies == most:
            assert not isinstance(parse(data), protobuf_cls)  # read in place
        else:
            with pytest.raises(DecodeError, match="twice|more than"):
                parse(data)
            small = data[len(_LARGE):]
            assert fields(zc.read_in_place(protobuf_cls, small)) == fields(protobuf_cls.FromString(small))


@pytest.mark.parametrize("parse, words", [(zc.parse_batch_request, "items"), (zc.parse_batch_response, "results")])
def test_a_large_batch_is_refused_at_its_first_item_past_max_batch_items(parse, words):
    """Its items were all read before any count was checked (review 106): here past the 1025th the message is
    cut, and the refusal says too many, not cut."""
    items = _LARGE + b"\x0a\x00" * MAX_BATCH_ITEMS
    assert len(getattr(parse(items), words)) == MAX_BATCH_ITEMS
    with pytest.raises(DecodeError, match=f"more than {MAX_BATCH_ITEMS} {words}"):
        parse(items + b"\x0a\x00" + b"\x0a\x05cut")


class _CountedBytes(bytes):
    """Bytes that count the reads of their items and slices (the reader's Python-level work on a message)."""

    reads = 0

    def __getitem__(self, key):
        _CountedBytes.reads += 1
        return bytes.__getitem__(self, key)


def test_the_readers_work_on_any_message_is_bounded_by_a_small_budget_not_by_its_size():
    """Read in Python at ~1 us a field on the server's one event loop, junk of 2 MiB held it for seconds at the
    budget of 2**20 (review 106): the budget is now what an honest batch needs, every field, dimension and varint
    byte costs a unit, and the reader reads at most 2 bytes per unit, whatever the message (counted reads, not a
    clock). Refusals of what no writer writes come within the first items."""
    slow = _key((1 << 29) - 1, 0) + zc._encode_varint((1 << 64) - 1)  # an unknown field: 5-byte tag, 10-byte value

    def batch(item: bytes, count: int) -> bytes:
        return _nested(1, item) * count

    worst = {  # reader, message, at most how many reads
        "repeated scalars": (zc._request, b"\x0a\x01x" + b"\x18\x01" * (1 << 20), 10),
        "pads": (zc._request, _nested(2, b"\x3a\x00" * (1 << 20)), 20),
        "empty items": (zc._batch_request, b"\x0a\x00" * (1 << 20), 2 * MAX_BATCH_ITEMS + 10),
        "empty results": (zc._batch_response, b"\x0a\x00" * (1 << 20), 2 * MAX_BATCH_ITEMS + 10),
        "unknown fields in items": (zc._batch_request, batch(b"\x78\x01" * 64, 1024), None),
        "slow unknown fields": (zc._batch_request, batch(slow * 64, 1024), None),
        "tensors of slow unknown fields": (zc._batch_request, batch(_nested(2, slow * 64) * 256, 3), None),
        "tensors of unpacked dimensions": (zc._batch_request, batch(_nested(2, b"\x10\x01" * 8) * 256, 1024), None),
        "tensors of 10-byte dimensions": (zc._batch_request, batch(_nested(
            2, _nested(2, zc._encode_varint(-1) * 8) + b"\x3a\x00" * 2) * 256, 8), None),
        "empty tensors": (zc._batch_request, batch(b"\x12\x00" * 256, 1024), None),
        "results of tensors": (zc._batch_response, batch(_nested(1, b"\x10\x01" * 8) * 256, 1024), None),
        "16 tensors of 8 dimensions": (zc._batch_request, zc.batch_request_message(
            [("e.0", [pack(torch.zeros((1,) * 8))] * 16, b"id")] * MAX_BATCH_ITEMS).join(), None),
    }
    for name, (read, raw, most) in worst.items():
        data = _CountedBytes(raw)
        _CountedBytes.reads = 0
        try:
            read(data, memoryview(data), 0, len(data), zc._Budget(zc.MAX_FIELDS))
        except (zc._Unusual, DecodeError):
            pass
        assert _CountedBytes.reads <= (most or 2 * zc.MAX_FIELDS + 16), (name, _CountedBytes.reads)
    assert zc.MAX_FIELDS <= 1 << 17  # ~20-30 ms of a server's CPU at most, refused or not


def test_a_message_is_read_with_the_garbage_collector_paused_and_leaves_it_nothing_to_collect():
    """The worst message within the budget is ~14k empty tensors (0.33 MiB): with the collector on, their objects
    started ~40 collections of everything a server holds during the walk, and a full one every message or two,
    36-77 ms where the units took ~20 (review 113 D2). No collection starts during a walk now (counted, not
    timed), a refused message leaves next to nothing for the next one, and the collector is left as it was."""
    hostile = _LARGE + _nested(1, _nested(2, b"") * zc.MAX_TENSORS) * 60
    honest = zc.batch_request_message([(f"ffn.{i}", [pack(torch.zeros(4, 1024))], b"id") for i in range(1024)],
                                      NONE).join()
    started = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    was_enabled = gc.isenabled()
    gc.enable()
    gc.collect()
    gc.callbacks.append(count)
    try:
        with pytest.raises(zc.TooManyFields):
            zc.parse_batch_request(hostile)
        assert started == [] and gc.isenabled()
        assert gc.get_count()[0] < gc.get_threshold()[0] // 2  # its ~40k objects are gone, not left to collect
        assert len(zc.parse_batch_request(honest).items) == 1024 and started == [] and gc.isenabled()
        gc.disable()
        with pytest.raises(zc.TooManyFields):
            zc.parse_batch_request(hostile)
        assert not gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        (gc.enable if was_enabled else gc.disable)()
