"""What a client does with a hostile (or broken) server's answers: nothing it did not ask for is decoded, nothing
unbounded is buffered, and the expert is dropped and banned. Each server here is a small in-process gRPC servicer
that answers whatever the test tells it to (raw bytes: no dmoe server would send these)."""
from __future__ import annotations

import contextlib
import logging
import pickle
from concurrent import futures
from typing import Callable, Iterator

import grpc
import pytest
import torch

from dmoe.client.failures import CallPolicy
from dmoe.client.remote_expert import (MAX_SERVER_MESSAGE_CHARS, RemoteExpertError, expert_info, forward_future,
                                       forward_futures)
from dmoe.wire import ChannelPool, grpc_options
from dmoe.wire.channels import TensorCalls
from dmoe.wire.shared_memory import MAX_REASON_CHARS, SegmentPool, SharedMemoryCalls
from dmoe.wire.zerocopy import BatchResponse, Result, batch_response_bytes

HIDDEN = 8
ROWS = 3


@contextlib.contextmanager
def hostile_server(**handlers: Callable) -> Iterator[str]:
    """A gRPC server on loopback answering ``dmoe.ExpertService``'s ``handlers`` (name -> fn(request bytes, context),
    unary; names ending in ``_stream``: fn(request iterator, context), yielding answers' bytes)."""
    methods = {}
    for name, fn in handlers.items():
        make = (grpc.stream_stream_rpc_method_handler if name.endswith("_stream")
                else grpc.unary_unary_rpc_method_handler)
        methods[name] = make(fn, request_deserializer=None, response_serializer=None)
    server = grpc.server(futures.ThreadPoolExecutor(4), options=grpc_options())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("dmoe.ExpertService", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture
def pool():
    with ChannelPool(shared_memory=False, hold_calls=False) as channels:
        yield channels


def batch_answer(*results: Result) -> Callable:
    data = batch_response_bytes(BatchResponse(list(results)))
    return lambda request, context: data


def test_a_servers_long_item_message_is_cut_short_in_the_error_the_log_and_the_layers_refusal(pool, caplog):
    """INVALID_ARGUMENT bans nothing, so a hostile server could send 8 MiB of it to every step's log."""
    caplog.set_level(logging.INFO)
    long = "x" * (8 << 20)
    refusal = Result(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=long)
    with hostile_server(forward_batch=batch_answer(refusal)) as endpoint:
        policy = CallPolicy(channels=pool)
        for _ in range(3):
            future, = forward_futures([("ffn0.1", endpoint, [torch.randn(ROWS, HIDDEN)], None)], channels=pool,
                                      timeout=60)
            futures.wait([future], timeout=60)
            assert policy.outcome("ffn0.1", endpoint, future, shape=(ROWS, HIDDEN), dtype=torch.float32) is None
    error = future.exception()
    assert isinstance(error, RemoteExpertError) and error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(error.message) <= MAX_SERVER_MESSAGE_CHARS and error.message.endswith(f"... ({8 << 20} characters)")
    assert error.message.startswith("x" * 900)
    assert len(str(error)) < MAX_SERVER_MESSAGE_CHARS + 100 and len(policy.refused) < MAX_SERVER_MESSAGE_CHARS + 100
    assert 0 < len(caplog.text) < 3 * (MAX_SERVER_MESSAGE_CHARS + 400)
    again = pickle.loads(pickle.dumps(error))  # (errors cross processes): cut once, never again
    assert again.message == error.message and str(again) == str(error)


def test_a_servers_long_status_details_are_cut_short(pool):
    def abort(request, context):
        context.abort(grpc.StatusCode.INTERNAL, "y" * 5000)

    with hostile_server(forward=abort, info=abort) as endpoint:
        with pytest.raises(RemoteExpertError) as error:
            forward_future(endpoint, "ffn.0", [torch.randn(ROWS, HIDDEN)], channels=pool, timeout=60).result(60)
        with pytest.raises(RemoteExpertError) as info_error:
            expert_info(endpoint, "ffn.0", channels=pool, timeout=60)
    for failure in (error.value, info_error.value):
        assert failure.code == grpc.StatusCode.INTERNAL
        assert len(failure.message) <= MAX_SERVER_MESSAGE_CHARS and failure.message.endswith("(5000 characters)")
    short = RemoteExpertError("ffn.0", endpoint, grpc.StatusCode.INTERNAL, "z" * MAX_SERVER_MESSAGE_CHARS)
    assert short.message == "z" * MAX_SERVER_MESSAGE_CHARS  # up to the limit, kept whole


def test_a_servers_long_reason_to_refuse_shared_memory_is_logged_cut_short(caplog):
    caplog.set_level(logging.INFO, logger="dmoe.wire.shared_memory")
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        calls = SharedMemoryCalls(channel, "127.0.0.1:1", plain=TensorCalls.on(channel), segments=SegmentPool())
        calls.refuse("r" * (1 << 20))
    assert not calls.enabled and f"... ({1 << 20} characters)" in caplog.text
    assert len(caplog.text) < MAX_REASON_CHARS + 300
