"""A clean, fast Ctrl-C for programs whose main thread waits while other threads (gRPC, torch, DHT) work, a stop
signal that waits for a training step to end, and a clean stop for programs whose launcher died."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

#: set by :class:`dmoe.launch.Proc` to the launcher's pid: a program whose launcher dies stops too
PARENT_ENV = "DMOE_PARENT_PID"
#: seconds between checks that the launcher is still alive
ORPHAN_CHECK_PERIOD = 1.0


def orphaned() -> bool:
    """True when this process was started by :class:`dmoe.launch.Proc` and that launcher has died (this process
    was handed to another parent). A launcher killed without cleanup (SIGKILL, a crash, a SIGTERM it does not
    handle) would otherwise leave its DHT nodes and servers running, with nobody reading their output."""
    parent = os.environ.get(PARENT_ENV)
    return parent is not None and parent.isdigit() and os.getppid() != int(parent)


def unignored_stop_signals() -> list[int]:
    """The stop signals (SIGINT, SIGTERM, SIGHUP) this process does not ignore, the ones a program handles: one
    ignored when it starts stays ignored (SIGHUP under ``nohup``, SIGINT in a job a script started in its
    background, which a Ctrl-C meant for the script's foreground must not stop)."""
    return [signum for signum in StopSignals.SIGNALS if signal.getsignal(signum) != signal.SIG_IGN]


class StopSignals:
    """Waits in the main thread for SIGINT, SIGTERM or SIGHUP (a closed terminal or SSH session), whichever thread
    of the process the kernel hands it to. A signal ignored when it enters is left ignored: SIGHUP under ``nohup``,
    SIGINT in the children of ``dmoe-server --processes``, which their parent stops.

    An Event set from a Python signal handler is not enough: when the signal lands on a gRPC or torch thread, the
    main thread blocked in ``Event.wait()`` is never interrupted, so the handler never runs. The C-level handler
    writes to the wakeup fd no matter which thread caught the signal, and reading that fd wakes the main thread.

    Use from the main thread::

        with StopSignals() as stop, server:
            signum = stop.wait()
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))

    def __enter__(self) -> "StopSignals":
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self.received: list[int] = []
        self._old_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._old_handlers = {s: signal.signal(s, lambda signum, _: self.received.append(signum))
                              for s in unignored_stop_signals()}
        return self

    def wait(self, timeout: float | None = None) -> int | None:
        """Blocks until a stop signal arrives and returns its number; None if ``timeout`` seconds pass first.

        A launcher's death (see :func:`orphaned`) counts as ``SIGHUP``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.received:
            if orphaned():
                return signal.SIGHUP
            left = ORPHAN_CHECK_PERIOD if deadline is None else min(ORPHAN_CHECK_PERIOD, deadline - time.monotonic())
            if left <= 0:
                return None
            self._reader.settimeout(left)
            try:
                self._reader.recv(64)  # the Python handler has run by the time the next line executes
            except TimeoutError:
                continue
        return self.received[0]

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self._old_fd)
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._reader.close()
        self._writer.close()


class DeferredInterrupt:
    """A first stop signal (SIGINT, SIGTERM, or SIGHUP unless ignored) becomes a request that the main thread reads
    where it can stop cleanly (``requested``, and ``signum``); a second one interrupts at once (KeyboardInterrupt).

    The training loop stops between steps with it: a KeyboardInterrupt raised anywhere in a step could leave the
    model, its optimizer and the step counter each at another step, and no checkpoint could be written then. A
    cluster's scheduler stops a job with SIGTERM, a closed terminal with SIGHUP: both save the last step too.
    Does nothing outside the main thread (Python runs signal handlers there only); a signal ignored or not handled
    from Python (SIG_IGN, or a handler installed from C) is left alone.

    ``notice`` is written to stderr at the first signal, after the signal's name, with ``os.write``: a handler that
    wrote through ``sys.stderr`` could run while the main thread is inside a write to it (a progress bar), which
    raises.
    """

    def __init__(self, notice: str = ""):
        self.notice = notice
        self.requested = False
        self.signum: int | None = None  # the first stop signal received
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "DeferredInterrupt":
        if threading.current_thread() is threading.main_thread():
            for signum in StopSignals.SIGNALS:
                if signal.getsignal(signum) not in (signal.SIG_IGN, None):
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        if self.notice:
            with contextlib.suppress(OSError):
                os.write(2, f"\n{signal.Signals(signum).name}: {self.notice}\n".encode())

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


class InterruptingSignals(DeferredInterrupt):
    """Every stop signal (SIGINT, SIGTERM, or SIGHUP unless ignored) raises KeyboardInterrupt at once in the main
    thread, as Ctrl-C does by default: SIGTERM and SIGHUP would otherwise kill the process where it stands. For work
    a stop may cut short, after which the caller still saves; a :class:`DeferredInterrupt` entered inside it defers
    them again (and gives these handlers back when it exits)."""

    def _handle(self, signum: int, frame: object) -> None:
        self.requested, self.signum = True, signum
        raise KeyboardInterrupt
