"""Stage clocks: where a server's or a client's time goes, stage by stage (``dmoe-server --profile`` and the
remote layer's ``profile``; issue #24).

A GPU runs kernels and copies asynchronously: to give each stage its own time, :class:`Laps` synchronises the
device at every stage boundary, which costs the overlap the code otherwise gets. So profile to see the shares,
and time speed with the profile off.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import torch

Snapshot = dict[str, tuple[float, int]]


class StageClock:
    """Seconds and counts per stage, added from any thread and read by metrics, benchmarks or tests."""

    def __init__(self, stages: Sequence[str]) -> None:
        self.stages = tuple(stages)
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(self.stages, 0.0)
        self._counts = dict.fromkeys(self.stages, 0)

    def add(self, stage: str, seconds: float, count: int = 1) -> None:
        if stage not in self._seconds:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(self.stages)}")
        with self._lock:
            self._seconds[stage] += seconds
            self._counts[stage] += count

    def snapshot(self) -> Snapshot:
        """stage -> (total seconds, times counted), consistent across stages, in the clock's order of stages."""
        with self._lock:
            return {stage: (self._seconds[stage], self._counts[stage]) for stage in self.stages}

    def laps(self, device: torch.device) -> "Laps":
        """A timer for one stretch of stages on ``device``, used by one thread."""
        return Laps(self, device)


class Laps:
    """Laps of one stretch of work (a batch, a forward): each :meth:`lap` charges the time since the previous one
    to a stage. On a GPU each lap first waits for the device, so that a stage holds its own kernels and copies
    instead of the work queued before it."""

    def __init__(self, clock: StageClock, device: torch.device):
        self.clock = clock
        self._sync: Callable[[], None] = (
            (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None))
        self._sync()
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        self._sync()
        now = time.perf_counter()
        self.clock.add(stage, now - self._last)
        self._last = now


class NoLaps:
    """What code times its stages with while profiling is off: nothing, at the cost of a method call."""

    clock = None

    def lap(self, stage: str) -> None:
        pass


NO_LAPS = NoLaps()


def stage_difference(after: Snapshot, before: Snapshot) -> Snapshot:
    """What a stretch of work added: ``after`` minus ``before`` (two snapshots of one clock)."""
    return {stage: (after[stage][0] - before[stage][0], after[stage][1] - before[stage][1]) for stage in after}


def format_stages(snapshot: Snapshot, per: int = 0, unit: str = "step") -> str:
    """A table of ``snapshot``: per stage its total, its count and its mean per event; with ``per`` > 0 also
    milliseconds per ``unit`` (e.g. per training step: the total divided by ``per``)."""
    lines = [f"{'stage':>13} {'total s':>9} {'events':>8} {'ms/event':>9}" + (f" {'ms/' + unit:>10}" if per else "")]
    for stage, (total, count) in snapshot.items():
        line = f"{stage:>13} {total:>9.3f} {count:>8d} {1e3 * total / count if count else 0.0:>9.3f}"
        lines.append(line + (f" {1e3 * total / per:>10.3f}" if per else ""))
    return "\n".join(lines)
