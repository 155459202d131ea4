"""The client's :class:`dmoe.wire.ChannelPool` lets go of channels nobody used for ``idle_seconds``: a trainer
meets servers as volunteers come and go, and every channel kept to a live server held a connection for good."""
from __future__ import annotations

import os
import time

import pytest
import torch

from dmoe.client import forward_future
from dmoe.wire import ChannelPool, dmoe_pb2
from tests.procs import running

HIDDEN = 8


@pytest.fixture(scope="module")
def port():
    """A server on every interface, so that 127.0.0.1 and 127.0.0.2 are two endpoints (two channels) to it."""
    with running("-m", "dmoe.cli.server", "--experts", "nop.[0:2]", "--expert-cls", "nop", "--host", "0.0.0.0",
                 "--hidden-dim", str(HIDDEN), "--torch-threads", "1") as proc:
        yield proc.endpoint().rsplit(":", 1)[1]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def call(endpoint: str, channels: ChannelPool, rows: int = 3) -> None:
    x = torch.randn(rows, HIDDEN)
    torch.testing.assert_close(forward_future(endpoint, "nop.0", [x], channels=channels, timeout=30).result()[0], x)


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's file descriptors in /proc")
def test_idle_channels_are_let_go_and_their_connections_closed(port):
    first, others = f"127.0.0.1:{port}", [f"127.0.0.{i}:{port}" for i in range(2, 22)]
    with ChannelPool() as warm_up:  # (the first call of a process takes a second: not within idle_seconds)
        call(f"127.0.0.22:{port}", warm_up)
    with ChannelPool(idle_seconds=2.0) as channels:
        channels.collect_after = 16  # (32 by default): 21 are let go at once below
        call(first, channels, rows=4096)  # 128 KiB: through shared memory, which leaves an idle segment kept
        for endpoint in others:
            call(endpoint, channels)
        assert sorted(channels.endpoints()) == sorted([first, *others])
        assert channels.segments.idle(first) == 1
        with_all = open_fds()  # (gRPC's own descriptors, opened with its first channel, stay)
        time.sleep(2.1)  # all idle past idle_seconds (what is tested is the passing of time itself)
        call(others[0], channels)  # the sweep lets all go, then a new channel to others[0] is opened
        assert channels.endpoints() == [others[0]]
        assert channels.let_go == 21
        assert channels.segments.idle(first) == 0
        # Closed with no collection by the caller (gRPC's objects form cycles, so that takes the pool's, once 16
        # or more were let go): 21 connections and the segment's memfd, less others[0]'s new connection.
        assert open_fds() <= with_all - 21
        call(first, channels)  # a let-go endpoint is served as before, on a new channel
        assert sorted(channels.endpoints()) == sorted([first, others[0]])


def test_a_call_in_flight_on_a_channel_let_go_finishes_and_one_channel_costs_no_collection(port, monkeypatch):
    """(A full collection paused every thread of a big process ~0.5 s, review 58: the pool runs one only after
    ``collect_after`` channels were let go.)"""
    from dmoe.wire import channels as channels_module
    collections = []
    monkeypatch.setattr(channels_module.gc, "collect", lambda *args: collections.append(args))
    endpoint = f"127.0.0.1:{port}"
    with ChannelPool(idle_seconds=0.5, hold_calls=False) as channels:
        long_call = channels.stub(endpoint).hold.future(dmoe_pb2.Hold(seconds=2.0), timeout=30)
        time.sleep(0.6)
        call(f"127.0.0.2:{port}", channels)
        assert channels.endpoints() == [f"127.0.0.2:{port}"]  # `endpoint`'s channel was let go mid-call
        assert not long_call.result(timeout=30).stopping  # ended by its time, not cancelled
        call(endpoint, channels)
        assert channels.let_go == 2 and collections == []  # (127.0.0.2 idle too by then)


def test_without_idle_seconds_channels_stay_and_bad_values_are_refused(port):
    with ChannelPool(idle_seconds=None) as channels:
        call(f"127.0.0.1:{port}", channels)
        time.sleep(0.2)
        call(f"127.0.0.2:{port}", channels)
        assert len(channels.endpoints()) == 2 and channels.let_go == 0
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="idle_seconds"):
            ChannelPool(idle_seconds=bad)


def test_replica_channels_let_go_of_endpoints_nobody_used_lately():
    """Review 59: a server kept a channel to every replica host and holder it ever asked, and anyone may announce
    new endpoints every round."""
    from dmoe.replicas import ReplicaChannels

    channels = ReplicaChannels(idle_seconds=1.0)  # (20 channels made within it, however loaded: 0.05 s was not)
    try:
        for port in range(1, 21):
            channels.stub(f"127.0.0.1:{port}")
        assert len(channels.pool.endpoints()) == 20
        time.sleep(1.2)  # (at least that long, however loaded)
        channels.stub("127.0.0.1:99")
        assert channels.pool.endpoints() == ["127.0.0.1:99"] and channels.pool.let_go == 20
    finally:
        channels.close()
