"""The wire codec: exact round trips, bounded compression error, validation before allocation."""
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmoe.wire import FLOAT16, NONE, UINT8, InvalidTensor, TensorTooLarge, cut_into_parts, deserialize, join_parts, serialize
from dmoe.wire import dmoe_pb2
from dmoe.collab.state_sync import StateDownloadError, decode_state
from dmoe.wire.codec import DTYPES, encoded_bytes, pack


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_uncompressed_round_trip_is_exact_for_every_dtype(dtype):
    x = (torch.randn(3, 5, 2) * 100).to(dtype)
    y = deserialize(serialize(x))
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)


def test_float16_and_uint8_compression_errors_are_bounded():
    x = torch.randn(64, 300)
    half = deserialize(serialize(x, FLOAT16))
    assert half.dtype == torch.float32 and (half - x).abs().max() < 1e-2
    quant = deserialize(serialize(x, UINT8))
    assert quant.dtype == torch.float32 and quant.shape == x.shape
    # one 8-bit step of a block's range, plus float rounding
    assert (quant - x).abs().max() <= (x.max() - x.min()) / 255
    assert len(serialize(x, UINT8).buffer) == x.numel()


@pytest.mark.parametrize("compression", [NONE, FLOAT16, UINT8])
def test_serialize_into_a_field_of_a_larger_message_gives_the_same_tensor(compression):
    x = torch.randn(3, 700)
    part = dmoe_pb2.AveragingPart(group_id="g")
    part.values.shape.append(99)  # whatever the field held before is replaced
    serialize(x, compression, out=part.values)
    assert part.values == serialize(x, compression)
    assert torch.equal(deserialize(part.values), deserialize(serialize(x, compression)))


def test_compression_leaves_integer_tensors_exact():
    x = torch.arange(1000)
    assert torch.equal(deserialize(serialize(x, UINT8)), x)


@settings(max_examples=50, deadline=None)
@given(shape=st.lists(st.integers(0, 40), min_size=0, max_size=3), part=st.integers(1, 700))
def test_streamed_parts_reassemble_to_the_same_tensors(shape, part):
    tensors = [serialize(torch.randn(shape)), serialize(torch.randn(shape), UINT8), serialize(torch.arange(7))]
    joined = join_parts(cut_into_parts(tensors, part), max_bytes=1 << 20)
    assert [deserialize(t).tolist() for t in joined] == [deserialize(t).tolist() for t in tensors]


def test_streamed_parts_are_joined_once_into_a_buffer_the_decoder_reads_in_place():
    """Each join and decode step once copied the whole stream (a 64 MiB request: +268 MiB in a server, review 84):
    the parts are copied into one buffer, decoded without a copy; a packed tensor is cut from its own memory."""
    x = torch.randn(64, 33)
    parts = list(cut_into_parts([pack(x), pack(x, UINT8)], 1000))
    assert [[p.SerializeToString() for p in group] for group in parts] == [
        [p.SerializeToString() for p in group] for group in cut_into_parts([serialize(x), serialize(x, UINT8)], 1000)]
    joined = join_parts(parts, max_bytes=1 << 20)
    decoded = deserialize(joined[0])
    assert torch.equal(decoded, x) and torch.equal(deserialize(joined[1]), deserialize(serialize(x, UINT8)))
    memory = torch.frombuffer(joined[0].buffer, dtype=torch.uint8)
    assert decoded.data_ptr() == memory.data_ptr()  # the decoded tensor is the joined buffer
    head = dmoe_pb2.Tensor(buffer=b"\0" * 8, shape=[4], dtype="float32", parts=2)
    with pytest.raises(InvalidTensor, match="not match shape"):  # more bytes than the header declares
        join_parts([[head, dmoe_pb2.Tensor(buffer=b"\0" * 12)]], max_bytes=1 << 20)
    with pytest.raises(InvalidTensor, match="not match shape"):  # fewer
        join_parts([[head, dmoe_pb2.Tensor(buffer=b"\0" * 4)]], max_bytes=1 << 20)
    with pytest.raises(TensorTooLarge):  # a header declaring more than the limit: refused before its buffer exists
        join_parts([[dmoe_pb2.Tensor(buffer=b"\0" * 8, shape=[1 << 40], dtype="float32", parts=2)]], max_bytes=1 << 20)


def test_lying_buffer_lengths_and_shapes_are_rejected_before_allocation():
    good = serialize(torch.randn(4, 4))
    with pytest.raises(InvalidTensor, match="does not match shape"):
        deserialize(dmoe_pb2.Tensor(buffer=good.buffer[:-1], shape=[4, 4], dtype="float32"))
    with pytest.raises(InvalidTensor, match="negative"):
        deserialize(dmoe_pb2.Tensor(buffer=good.buffer, shape=[-4, -4], dtype="float32"))
    with pytest.raises(InvalidTensor, match="unknown dtype"):
        deserialize(dmoe_pb2.Tensor(buffer=good.buffer, shape=[4, 4], dtype="complex4096"))
    with pytest.raises(TensorTooLarge):  # 2**62 elements: refused by arithmetic, nothing allocated
        deserialize(dmoe_pb2.Tensor(buffer=good.buffer, shape=[2**31, 2**31], dtype="float32"))
    with pytest.raises(TensorTooLarge):
        join_parts(cut_into_parts([good], 16), max_bytes=32)


def test_generated_stubs_are_current():
    from dmoe.wire.generate import GENERATED, ROOT, generate

    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            committed = ROOT / "dmoe" / "wire" / path.name
            assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run python -m dmoe.wire.generate"
    assert len(GENERATED) == 3


@pytest.mark.parametrize("compression", [NONE, FLOAT16, UINT8])
def test_encoded_bytes_counts_what_serialize_makes_without_making_it(compression):
    for tensor in (torch.randn(5, 7), torch.randn(3).half(), torch.randn(600).bfloat16(), torch.arange(6),
                   torch.zeros(0, 3), torch.ones(2, dtype=torch.bool)):
        message = serialize(tensor, compression)
        assert encoded_bytes(tensor, compression) == len(message.buffer) + len(message.aux), (tensor.dtype, compression)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_float16_saturates_finite_values_beyond_its_range_and_keeps_inf_and_nan(dtype):
    x = torch.tensor([1e6, -7e4, 65504.0, float("inf"), float("-inf"), float("nan"), 1.5], dtype=dtype)
    half = deserialize(serialize(x, FLOAT16))  # back in its dtype: 65504 is 65536 as a bfloat16
    big = torch.tensor([65504.0, -65504.0, 65504.0], dtype=dtype)
    assert half[:5].tolist() == [*big.tolist(), float("inf"), float("-inf")]
    assert half[5].isnan() and half[6].item() == 1.5
    assert deserialize(serialize(x[:3], FLOAT16)).float().isfinite().all()


def test_uint8_saturates_finite_values_further_apart_than_float32_reaches_and_keeps_inf_and_nan():
    """Review 71: a block holding -3e38 and 3e38 (both finite) had an infinite scale and arrived as 256 NaN."""
    x = torch.tensor([-3e38, 3e38] + [1.0] * 254)
    y = deserialize(serialize(x, UINT8))
    limit = torch.finfo(torch.float32).max / 2
    assert y.isfinite().all() and y[0].item() == -limit and y[1].item() == limit
    assert deserialize(serialize(x.double(), UINT8)).isfinite().all()
    wide = torch.tensor([1e39, -1e39] + [1.0] * 254, dtype=torch.float64)  # finite only in float64 (review 76)
    assert deserialize(serialize(wide, UINT8)).isfinite().all()
    with_inf = x.clone()
    with_inf[5] = float("inf")
    assert not deserialize(serialize(with_inf, UINT8)).isfinite().all()  # sent non-finite, arrives non-finite


def test_a_shape_torch_cannot_build_is_refused_even_with_no_elements():
    """A zero makes the element count 0 whatever the other dimensions are; torch then fails to build the shape
    (RuntimeError, which a state download did not expect), where the codec refuses it as too large."""
    message = dmoe_pb2.Tensor(shape=[0, 2**63 - 1, 2**63 - 1], dtype="float32")
    with pytest.raises(TensorTooLarge, match="dimension above the limit"):
        deserialize(message)
    with pytest.raises(StateDownloadError, match="malformed state"):
        decode_state([dmoe_pb2.StatePart(name="param.w", tensor=message, tensors=1, optimizer_json="{}")], 1 << 20)
