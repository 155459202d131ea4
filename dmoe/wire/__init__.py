"""The wire: tensor codec, compression, generated gRPC stubs, channel options, the expert calls' messages
without copies (:mod:`dmoe.wire.zerocopy`), and their payload through shared memory between a client and a server
on one host (:mod:`dmoe.wire.shared_memory`)."""
from dmoe.wire.channels import (
    MAX_MESSAGE_BYTES,
    STREAM_PART_BYTES,
    ChannelPool,
    grpc_options,
    status_code,
)
from dmoe.wire.codec import (
    FLOAT16,
    NONE,
    UINT8,
    InvalidTensor,
    TensorTooLarge,
    cut_into_parts,
    deserialize,
    join_parts,
    parse_compression,
    serialize,
)
from dmoe.wire.zerocopy import MAX_BATCH_ITEMS

__all__ = [
    "FLOAT16", "NONE", "UINT8", "MAX_BATCH_ITEMS", "MAX_MESSAGE_BYTES", "STREAM_PART_BYTES", "ChannelPool",
    "InvalidTensor", "TensorTooLarge", "cut_into_parts", "deserialize", "grpc_options", "join_parts",
    "parse_compression", "serialize", "status_code",
]
