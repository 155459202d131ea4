"""Fault injection for experiments: added round-trip latency and failing expert calls, applied by the servicer.

The delay is paid by the server's handler before it answers (``await asyncio.sleep``, so the event loop keeps
serving other calls and the runtime keeps computing): one delay per call models the whole client -> server ->
client round trip, so a batch call (many experts' requests) waits one delay, and each of its items fails or not
on its own. Jitter follows the paper's setup: an exponential distribution with the configured mean.
A failed call is answered with ``fail_code`` and the details ``"injected failure"`` after the delay, the way a
request lost on a slow link costs its round trip too. The default code is ABORTED: the call failed, the server
did not, so clients ban the expert rather than the whole server (UNAVAILABLE would say the server is down).
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading
from dataclasses import dataclass

import grpc

logger = logging.getLogger(__name__)

JITTERS = ("none", "exponential")
INJECTED_FAILURE = "injected failure"


class InjectedFailure(Exception):
    """Raised by :meth:`Faults.apply` for a call that is to fail; carries the status code to answer with."""

    def __init__(self, code: grpc.StatusCode):
        super().__init__(INJECTED_FAILURE)
        self.code = code


@dataclass
class FaultConfig:
    """What to inject into every forward and backward call of a server.

    Attributes:
        latency_ms: mean added round-trip latency in milliseconds (0: none).
        jitter: ``'none'`` (every call waits ``latency_ms``) or ``'exponential'`` (an exponential with that mean).
        fail_rate: share of calls, in [0, 1], that fail with ``fail_code`` instead of being computed.
        fail_code: the gRPC status name of an injected failure.
        seed: seeds the random delays and failures (None: fresh randomness every run).
    """

    latency_ms: float = 0.0
    jitter: str = "none"
    fail_rate: float = 0.0
    fail_code: str = "ABORTED"
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.latency_ms >= 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")
        if self.jitter not in JITTERS:
            raise ValueError(f"jitter must be one of {', '.join(JITTERS)}, got {self.jitter!r}")
        if not 0 <= self.fail_rate <= 1:
            raise ValueError(f"fail_rate must be in [0, 1], got {self.fail_rate}")
        if self.fail_code not in grpc.StatusCode.__members__ or self.fail_code == "OK":
            raise ValueError(f"fail_code must name a gRPC error status, got {self.fail_code!r}")

    @property
    def active(self) -> bool:
        return self.latency_ms > 0 or self.fail_rate > 0


class Faults:
    """Draws each call's delay and fate from a :class:`FaultConfig`; ``await faults.apply()`` in a handler."""

    def __init__(self, config: FaultConfig):
        self.config = config
        self._random = random.Random(config.seed)
        self._lock = threading.Lock()
        self.calls = self.failures = 0
        if config.active:
            logger.warning("injecting faults: %.1f ms mean latency (%s jitter), %.1f%% of calls fail with %s",
                           config.latency_ms, config.jitter, 100 * config.fail_rate, config.fail_code)

    def _delay(self) -> float:
        mean = self.config.latency_ms / 1000
        return self._random.expovariate(1 / mean) if self.config.jitter == "exponential" and mean > 0 else mean

    def draw(self) -> tuple[float, bool]:
        """(seconds to wait, whether the call fails) for one call."""
        cfg = self.config
        with self._lock:
            delay = self._delay()
            fail = cfg.fail_rate > 0 and self._random.random() < cfg.fail_rate
            self.calls += 1
            self.failures += fail
        return delay, fail

    async def apply(self, delay: bool = True) -> None:
        """Waits the drawn delay without blocking the loop; raises :class:`InjectedFailure` for a failing call.

        ``delay=False``: only the failure is drawn, for an item of a batch call that paid its delay once
        (:meth:`wait`).
        """
        seconds, fail = self.draw()
        if delay and seconds > 0:
            await asyncio.sleep(seconds)
        if fail:
            raise InjectedFailure(grpc.StatusCode[self.config.fail_code])

    async def wait(self) -> None:
        """Waits one call's delay (a batch call: one round trip for all of its items, which then :meth:`apply`
        their failures with ``delay=False``)."""
        with self._lock:
            seconds = self._delay()
        if seconds > 0:
            await asyncio.sleep(seconds)
