"""Unary gRPC calls as futures, run as blocking calls on threads kept between calls.

Why not gRPC's own ``.future()``: the sync stack starts a thread to poll a channel whenever that channel has no
other call in flight, and the thread ends with the channel's last call. A layer calls each server once per forward
and once per backward, so nearly every call paid a thread's start (in a profile of the layer on the 2-core VM, 159
of 160 calls started one; a round of four concurrent calls to four servers took 5.2 ms that way and 3.6-3.9 ms as
blocking calls on kept threads). A blocking call polls its own completion queue on the thread that waits for it.

What is lost: a call already running cannot be cancelled (a blocking call has no handle); ``cancel()`` stops a call
not yet started, and a running one ends at its deadline or answer, as it would have without the cancel. Every
caller here gives its calls a timeout.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any, Callable

import grpc

#: the most threads one pool runs at once; calls beyond wait for a free thread (their deadline runs meanwhile)
MAX_THREADS = 256


class CallThreads:
    """Daemon threads running submitted functions, started as needed and kept idle for the next ones.

    Owned by a :class:`dmoe.wire.ChannelPool`, which closes it: its threads then end once their current call does
    (the pool closes its channels first, which ends the calls in flight).
    """

    def __init__(self, name: str | None = None, max_threads: int = MAX_THREADS):
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        #: the threads' names start with it (one per pool, so that a pool's threads can be told from another's)
        self.name = name or f"dmoe-call-{id(self):x}"
        self.max_threads = max_threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for work that no submitted function has been counted against yet
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("these call threads are closed")
            if self._idle:
                self._idle -= 1
            elif self._threads < self.max_threads:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self.name}.{self._threads}", daemon=True).start()
            self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as error:  # noqa: BLE001 - the caller's to see, through the future
                    future.set_exception(error)
                else:
                    future.set_result(result)
            del item, future, fn, args  # nothing of a finished call stays referenced by an idle thread
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """No more submissions; each thread ends after its current function (queued ones are cancelled)."""
        with self._lock:
            if self._closed:
                return
            self._closed, threads = True, self._threads
        while True:  # cancel what no thread has taken yet, then one stop sign per thread
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._queue.put(None)


class CallFuture:
    """A started call, as gRPC's ``.future()`` returns one: ``result`` raises the call's :class:`grpc.RpcError`,
    or :class:`grpc.FutureCancelledError` after a cancel; callbacks receive this object."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except concurrent.futures.CancelledError:
            raise grpc.FutureCancelledError() from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return self._future.exception(timeout)
        except concurrent.futures.CancelledError:
            raise grpc.FutureCancelledError() from None

    def done(self) -> bool:
        return self._future.done()

    def running(self) -> bool:
        return self._future.running()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def cancel(self) -> bool:
        """Cancels a call not started yet (see the module docstring)."""
        return self._future.cancel()

    def add_done_callback(self, fn: Callable[["CallFuture"], None]) -> None:
        self._future.add_done_callback(lambda _: fn(self))


class ThreadedCall:
    """A unary multi-callable whose ``future(request, timeout=)`` runs the blocking call on ``threads``; the
    timeout counts from ``future()``, so a call that waited for a free thread keeps its deadline."""

    def __init__(self, call: grpc.UnaryUnaryMultiCallable, threads: CallThreads):
        self._call, self._threads = call, threads

    def __call__(self, request: Any, timeout: float | None = None) -> Any:
        return self._call(request, timeout=timeout)

    def future(self, request: Any, timeout: float | None = None) -> CallFuture:
        deadline = None if timeout is None else time.monotonic() + timeout
        return CallFuture(self._threads.submit(self._run, request, deadline))

    def _run(self, request: Any, deadline: float | None) -> Any:
        return self._call(request, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
