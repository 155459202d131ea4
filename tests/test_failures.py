"""CallPolicy.learn_batch_limit: which refusals teach the layer a server's max_batch_size (and are then not the
expert's failure), and which claims it does not believe. Plain futures: the rule is the transport's message."""
from __future__ import annotations

import time
from concurrent.futures import Future

import grpc
import pytest

from dmoe.client import failures
from dmoe.client.failures import MAX_CHUNKS, CallPolicy
from dmoe.client.remote_expert import RemoteExpertError

ENDPOINT = "127.0.0.1:1"


def failed(code: grpc.StatusCode, message: str) -> Future:
    future = Future()
    future.set_exception(RemoteExpertError("ffn0.0.0", ENDPOINT, code, message))
    return future


@pytest.mark.parametrize("message", [
    "batch of 200 rows exceeds this server's max_batch_size 64",
    "streamed request exceeds 51200 bytes, more than a valid forward of ffn0.0.0 (max_batch_size 64) can carry"])
def test_a_refusal_naming_the_servers_max_batch_size_teaches_it_for_the_endpoint(message):
    policy = CallPolicy()
    refusal = failed(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    assert policy.learn_batch_limit("ffn0.0.0", ENDPOINT, refusal, 200, time_left=5.0) == 64
    assert policy.known_batch_limits() == {ENDPOINT: 64}


def test_a_refusal_without_the_number_asks_the_server_its_info(monkeypatch):
    asked = []

    def info(endpoint, uid, **kwargs):
        asked.append((endpoint, uid, kwargs["timeout"]))
        return {"max_batch_size": 50}

    monkeypatch.setattr(failures, "expert_info", info)
    policy = CallPolicy()
    refusal = failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many rows for max_batch_size")
    assert policy.learn_batch_limit("ffn0.0.0", ENDPOINT, refusal, 200, time_left=1.0) == 50
    assert [(endpoint, uid) for endpoint, uid, _ in asked] == [(ENDPOINT, "ffn0.0.0")]
    assert 0 < asked[0][2] <= 1.0 and policy.known_batch_limits() == {ENDPOINT: 50}  # within the time left


@pytest.mark.parametrize("code, message, rows", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "batch of 200 rows exceeds this server's max_batch_size 500", 200),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "batch of 200 rows exceeds this server's max_batch_size 0", 200),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, f"max_batch_size 1 (rows {MAX_CHUNKS + 1})", MAX_CHUNKS + 1),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "this server keeps at most 100 calls", 200),
    (grpc.StatusCode.INTERNAL, "batch of 200 rows exceeds this server's max_batch_size 64", 200)])
def test_other_refusals_and_limits_that_make_no_sense_teach_nothing(code, message, rows):
    """A limit the rows do not exceed, or one that would cut them into more than MAX_CHUNKS requests, is not
    believed: the refusal stays the expert's failure."""
    policy = CallPolicy()
    assert policy.learn_batch_limit("ffn0.0.0", ENDPOINT, failed(code, message), rows, time_left=5.0) is None
    assert policy.batch_limits == {}


def test_a_cancelled_or_answered_call_teaches_nothing():
    policy = CallPolicy()
    cancelled, answered = Future(), Future()
    cancelled.cancel()
    answered.set_result(["rows"])
    for future in (cancelled, answered):
        assert policy.learn_batch_limit("ffn0.0.0", ENDPOINT, future, 200, time_left=5.0) is None


def test_servers_asked_their_info_all_answer_within_the_time_left_however_many(monkeypatch):
    """Review 76: 16 threads asked in turn, each with the whole time left: 40 servers that never answered took a
    forward with 1 s left 3 s."""
    def info(endpoint, uid, **kwargs):
        time.sleep(kwargs["timeout"])  # a server that never answers: its call times out
        raise RemoteExpertError(uid, endpoint, grpc.StatusCode.DEADLINE_EXCEEDED, "")

    monkeypatch.setattr(failures, "expert_info", info)
    refusals = [("ffn0.0.%d" % i, f"127.0.0.1:{1000 + i}", failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_batch_size"),
                 200) for i in range(100)]
    started = time.monotonic()
    assert CallPolicy().learn_batch_limits(refusals, time_left=0.5) == [None] * 100
    assert time.monotonic() - started < 1.0
