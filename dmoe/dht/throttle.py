"""What a node spends on any one peer: warnings about what peers send (at most one per peer and kind a minute, and
a bounded number in all), and budgets of work per machine (:class:`MachineBudgets`).

A node logs what it refuses (malformed datagrams, forged or hijacking stores, full records) so an operator can see
an attack or a misconfigured peer. Logged once per datagram, a flood of them (cheap to send, from spoofed
addresses too) would also flood the log, fill the disk and cost the node more CPU than refusing them. So each
(kind, peer host) warns at most once per ``period``, and all of them together at most ``max_per_period`` times;
the next warning logged says how many were left out meanwhile.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable


class ThrottledWarnings:
    """``warn(kind, host, message, *args)``: ``logger.warning`` unless the same kind from the same host was
    warned of less than ``period`` seconds ago, or ``max_per_period`` warnings were logged in this period (then
    counted, and mentioned by the next one that is logged)."""

    def __init__(self, logger: logging.Logger, period: float = 60.0, max_per_period: int = 100,
                 max_hosts: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.logger, self.period, self.clock = logger, period, clock
        self.max_per_period, self.max_hosts = max_per_period, max_hosts
        self._last: dict[tuple[str, str], float] = {}  # (kind, host) -> when it was last logged
        self._window, self._logged, self._left_out = float("-inf"), 0, 0

    def warn(self, kind: str, host: str, message: str, *args: Any, exc_info: bool = False) -> bool:
        """Logs (True) or counts (False) one warning; ``exc_info``: with the traceback of the exception being
        handled."""
        now, key = self.clock(), (kind, host)
        if now - self._window >= self.period:
            self._window, self._logged = now, 0
        last = self._last.get(key)
        if (last is not None and now - last < self.period) or self._logged >= self.max_per_period:
            self._left_out += 1
            return False
        if last is None and len(self._last) >= self.max_hosts:  # many hosts: forget the half logged longest ago
            for old in sorted(self._last, key=self._last.__getitem__)[:self.max_hosts // 2]:
                del self._last[old]
        self._last[key] = now
        self._logged += 1
        if self._left_out:
            message, args = message + " (%d more warnings about peers left out since the last one)", (
                *args, self._left_out)
            self._left_out = 0
        self.logger.warning(message, *args, **({"exc_info": True} if exc_info else {}))
        return True


class MachineBudgets:
    """A token bucket per machine: ``take(machine, n)`` grants up to ``n`` units of work, from a burst of ``burst``
    refilled at ``rate`` a second. Machines are remembered up to ``max_machines``, the longest unseen forgotten
    first (forgotten ones start again with a full burst: bounded memory, whatever the number of senders)."""

    def __init__(self, rate: float, burst: float, max_machines: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        if not rate > 0 or not burst >= 1 or max_machines < 1:
            raise ValueError(f"rate must be > 0, burst >= 1 and max_machines >= 1, got {rate}, {burst}, "
                             f"{max_machines}")
        self.rate, self.burst, self.max_machines, self.clock = rate, float(burst), max_machines, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # machine -> (tokens, when counted)

    def take(self, machine: str, n: int = 1) -> int:
        """How many of ``n`` units ``machine`` may have now (each taken from its budget)."""
        now = self.clock()
        tokens, since = self._buckets.pop(machine, (self.burst, now))
        tokens = min(self.burst, tokens + (now - since) * self.rate)
        if len(self._buckets) >= self.max_machines:  # dicts keep insertion order: the first is the longest unseen
            del self._buckets[next(iter(self._buckets))]
        granted = min(n, int(tokens))
        self._buckets[machine] = (tokens - granted, now)
        return granted

    def refund(self, machine: str, n: int = 1) -> None:
        """Gives back ``n`` units ``machine`` took for work that turned out to cost it nothing to pay for (up to its
        burst): its honest entries, of a budget that only forgeries should spend."""
        if machine in self._buckets:
            tokens, since = self._buckets[machine]
            self._buckets[machine] = (min(self.burst, tokens + n), since)
