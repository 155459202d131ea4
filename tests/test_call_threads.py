"""The expert calls' futures run as blocking calls on kept threads (dmoe.wire.call_threads): no thread started per
call against a real server, deadlines counted from the call's start, cancels, errors, and the threads' end."""
from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch

from dmoe.client import RemoteExpertError, forward_future, forward_futures
from dmoe.wire import ChannelPool
from dmoe.wire.call_threads import CallThreads, ThreadedCall
from tests.procs import running

HIDDEN = 16


@pytest.fixture(scope="module")
def server():
    with running("-m", "dmoe.cli.server", "--experts", "ffn.[0:4]", "--expert-cls", "ffn", "--hidden-dim",
                 str(HIDDEN), "--optimizer", "sgd", "--torch-threads", "1") as proc:
        yield proc.endpoint()


@pytest.fixture
def started_threads(monkeypatch):
    """Counts the threads started in this process from now on (gRPC's own polling threads included)."""
    started = []
    start = threading.Thread.start

    def counting_start(thread, *args, **kwargs):
        started.append(thread.name)
        return start(thread, *args, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    return started


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shared-memory"])
def test_calls_one_after_another_start_no_thread_each(server, started_threads, shared_memory):
    x = torch.randn(300, HIDDEN)  # 19 KiB: through shared memory when it is on (min_bytes 0 below)
    with ChannelPool(shared_memory=shared_memory, shared_memory_min_bytes=0) as channels:
        forward_future(server, "ffn.0", [x], timeout=30, channels=channels).result()  # opens the channel
        started_threads.clear()
        for i in range(20):
            forward_future(server, f"ffn.{i % 4}", [x], timeout=30, channels=channels).result()
            futures = forward_futures([(f"ffn.{j}", server, [x], None) for j in range(4)], timeout=30,
                                      channels=channels)
            assert all(len(f.result()) == 1 for f in futures)
    # gRPC's .future() started a polling thread for nearly every one of these 40 calls
    assert len(started_threads) <= 2, started_threads


def test_a_call_waiting_for_a_thread_keeps_its_deadline_and_a_cancelled_one_never_runs():
    threads = CallThreads(max_threads=1)
    release = threading.Event()
    given: list[float | None] = []

    def fake_call(request, timeout=None):  # stands for a blocking gRPC call: records the timeout it was given
        given.append(timeout)
        return request

    try:
        blocker = threads.submit(release.wait, 30)
        call = ThreadedCall(fake_call, threads)
        started = time.monotonic()
        waiting = call.future("a", timeout=5.0)
        cancelled = call.future("b", timeout=5.0)
        assert cancelled.cancel() and cancelled.cancelled()
        queued_for = time.monotonic() - started
        release.set()
        assert blocker.result(timeout=30) is True
        assert waiting.result(timeout=30) == "a"
        assert given == [pytest.approx(given[0])] and given[0] <= 5.0 - queued_for
        with pytest.raises(grpc.FutureCancelledError):
            cancelled.result()
        assert call("c", timeout=1.0) == "c" and given[-1] == 1.0  # a direct call runs on the caller's thread
    finally:
        threads.close()
    with pytest.raises(RuntimeError, match="closed"):
        threads.submit(print)


def test_a_failing_call_raises_its_rpc_error_through_the_future_and_closing_ends_the_threads(server):
    channels = ChannelPool(shared_memory=False)
    try:
        future = forward_future(nobody_listens(), "ffn.0", [torch.randn(2, HIDDEN)], timeout=10, channels=channels)
        with pytest.raises(RemoteExpertError) as failure:
            future.result(timeout=30)
        assert failure.value.code == grpc.StatusCode.UNAVAILABLE
        assert len(forward_future(server, "ffn.1", [torch.randn(2, HIDDEN)], timeout=30,
                                  channels=channels).result()) == 1
        workers = [t for t in threading.enumerate() if t.name.startswith(channels.threads.name + ".")]
        assert workers
    finally:
        channels.close()
    for worker in workers:
        worker.join(timeout=30)
        assert not worker.is_alive()


def nobody_listens() -> str:
    """An endpoint on 127.0.0.1 whose port was bound and released: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"
