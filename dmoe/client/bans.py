"""Local bans of experts and servers that just failed, so the gate routes around them at once.

A DHT record outlives its server by up to its expiration time; without bans the gate would keep choosing a dead
server's experts (and losing those rows) until then. A failure bans the expert, or its whole server when the
server itself is unreachable or misses the forward's own deadline, for a backoff that doubles with every repeated
failure (a straggler cut by the ``timeout_after_k_min`` grace counts only when its server is cut so in three
forwards in a row: :data:`dmoe.client.failures.CUTS_TO_BAN`). When the ban
runs out the expert is tried again; one success clears its record. A request refused as invalid is neither a
failure nor a success here (:meth:`dmoe.client.failures.CallPolicy.outcome`): it is usually the caller's mistake.

Backward failures are recorded apart from forward ones: a server that answers forwards at once and never answers a
backward in time would otherwise have its record cleared by every forward, and cost the caller its backward
timeout every other step with a backoff that never grows (review 46). A forward's answer clears forward
failures only; a backward's answer clears both.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


#: records kept before those of long-expired bans are forgotten
MAX_RECORDS = 4096


@dataclass
class BanConfig:
    initial_backoff: float = 1.0
    max_backoff: float = 60.0


@dataclass
class _Ban:
    until: float = 0.0
    backoff: float = 0.0


@dataclass
class Bans:
    """Thread-safe ban book keyed by expert uid and by server endpoint."""

    config: BanConfig = field(default_factory=BanConfig)
    clock: "callable" = time.monotonic

    def __post_init__(self) -> None:
        self._bans: dict[str, _Ban] = {}
        self._lock = threading.Lock()

    def _key(self, uid: str | None, endpoint: str | None, backward: bool = False) -> str:
        return ("backward " if backward else "") + (f"endpoint:{endpoint}" if uid is None else f"uid:{uid}")

    def fail(self, *, uid: str | None = None, endpoint: str | None = None, backward: bool = False) -> float:
        """Records a failure of an expert (``uid``) or a server (``endpoint``); returns the ban's length.

        Failures while the ban runs belong to the same incident and change nothing: a server that dies fails every
        call in flight to it (all the experts a step chose there), which must cost one backoff, not double it once
        per expert. The backoff doubles when the first try after a ban fails again. ``backward``: the failure of a
        backward call, recorded apart (see the module's docstring).
        """
        now = self.clock()
        with self._lock:
            if len(self._bans) > MAX_RECORDS:
                self._forget(now)
            ban = self._bans.setdefault(self._key(uid, endpoint, backward), _Ban())
            if ban.until > now:
                return ban.backoff
            ban.backoff = min(self.config.max_backoff, ban.backoff * 2 if ban.backoff else self.config.initial_backoff)
            ban.until = now + ban.backoff
            return ban.backoff

    def succeed(self, uid: str, endpoint: str, backward: bool = False) -> None:
        """An answer re-admits the expert and its server: a forward's from their forward failures, a backward's
        from every failure."""
        with self._lock:
            for direction in (False, True) if backward else (False,):
                self._bans.pop(self._key(uid, None, direction), None)
                self._bans.pop(self._key(None, endpoint, direction), None)

    def is_banned(self, uid: str, endpoint: str | None = None) -> bool:
        now = self.clock()
        with self._lock:
            for backward in (False, True):
                for key in ((self._key(uid, None, backward), self._key(None, endpoint, backward)) if endpoint
                            else (self._key(uid, None, backward),)):
                    ban = self._bans.get(key)
                    if ban is not None and ban.until > now:
                        return True
            return False

    def _forget(self, now: float) -> None:
        """Drops the records of bans that ran out longer ago than the longest backoff: a trainer that outlives many
        servers would otherwise keep one record for every expert and server that ever failed."""
        horizon = now - self.config.max_backoff
        for key in [key for key, ban in self._bans.items() if ban.until < horizon]:
            del self._bans[key]

    def __len__(self) -> int:
        now = self.clock()
        with self._lock:
            return sum(ban.until > now for ban in self._bans.values())
