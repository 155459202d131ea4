"""Where a server's time goes, stage by stage (``dmoe-server --profile``; issue #24).

A request crosses these stages, each timed where it happens:

============  ==================  ==========================================================================
stage         counted per         what it holds
============  ==================  ==========================================================================
``call``      gRPC call           the whole handler: from the servicer receiving the parsed message to its answer
``decode``    request             wire tensors to torch tensors, with the shape, size and value checks
``queue``     request             waiting in the expert's task pool for a compute worker
``batch``     batch               joining the requests of a batch into one tensor per input (pinned on a GPU)
``to_device`` batch               the host-to-device copy (nothing on a CPU)
``compute``   batch               the expert's forward, or backward and optimizer step
``to_host``   batch               the device-to-host copy of the outputs (a detach on a CPU)
``encode``    request             torch tensors to wire tensors
============  ==================  ==========================================================================

What none of them holds is the Python between them (asyncio scheduling, futures), seen as ``call`` minus the
request's other stages, and gRPC's own work outside the handler (HTTP/2, parsing the message), seen from the
client as its call's time minus ``call``.

A GPU runs kernels and copies asynchronously: to give each stage its own time, a profiling worker synchronises the
device at every stage boundary, which costs the overlap the server otherwise gets (copies beside compute). So
profile to see the shares, and time throughput with the profile off. Off by default; the runtime and servicer then
do no timing at all.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import torch

STAGES = ("call", "decode", "queue", "batch", "to_device", "compute", "to_host", "encode")


class StageClock:
    """Seconds and counts per stage of one server, added from any thread and read by metrics or tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(STAGES, 0.0)
        self._counts = dict.fromkeys(STAGES, 0)

    def add(self, stage: str, seconds: float, count: int = 1) -> None:
        if stage not in self._seconds:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
        with self._lock:
            self._seconds[stage] += seconds
            self._counts[stage] += count

    def snapshot(self) -> dict[str, tuple[float, int]]:
        """stage -> (total seconds, times counted), consistent across stages."""
        with self._lock:
            return {stage: (self._seconds[stage], self._counts[stage]) for stage in STAGES}

    def batch_timer(self, device: torch.device) -> "BatchTimer":
        """A timer for one batch's stages on ``device`` (one per batch, used by one worker thread)."""
        return BatchTimer(self, device)


class BatchTimer:
    """Laps of one batch: each :meth:`lap` charges the time since the previous one to a stage.

    On a GPU each lap first waits for the device (see the module docstring), so that a stage holds its own kernels
    and copies instead of the work queued before it.
    """

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


Snapshot = dict[str, tuple[float, int]]


def stage_difference(after: Snapshot, before: Snapshot) -> Snapshot:
    """What a stretch of work added: ``after`` minus ``before`` (two snapshots of one clock)."""
    return {stage: (after[stage][0] - before[stage][0], after[stage][1] - before[stage][1]) for stage in after}


def format_stages(snapshot: Snapshot, per: int = 0, unit: str = "step") -> str:
    """A table of ``snapshot``: per stage its total, its count and its mean per event; with ``per`` > 0 also
    milliseconds per ``unit`` (e.g. per training step: the total divided by ``per``)."""
    lines = [f"{'stage':>10} {'total s':>9} {'events':>8} {'ms/event':>9}" + (f" {'ms/' + unit:>10}" if per else "")]
    for stage in STAGES:
        total, count = snapshot.get(stage, (0.0, 0))
        line = f"{stage:>10} {total:>9.3f} {count:>8d} {1e3 * total / count if count else 0.0:>9.3f}"
        lines.append(line + (f" {1e3 * total / per:>10.3f}" if per else ""))
    return "\n".join(lines)


def scrape_stages(metrics_text: str) -> Snapshot:
    """The stage clock of a server, from the text of its Prometheus ``/metrics`` page (benchmarks read remote
    servers this way)."""
    from prometheus_client.parser import text_string_to_metric_families

    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "dmoe_stage_seconds_total":
                seconds[sample.labels["stage"]] = sample.value
            elif sample.name == "dmoe_stage_events_total":
                counts[sample.labels["stage"]] = int(sample.value)
    if not seconds:
        raise ValueError("no dmoe_stage_seconds in these metrics: was the server started with --profile?")
    return {stage: (seconds.get(stage, 0.0), counts.get(stage, 0)) for stage in STAGES}


def read_stages(metrics_endpoint: str, timeout: float = 30.0) -> Snapshot:
    """The stage clock of the server whose metrics are served at ``HOST:PORT``."""
    import urllib.request

    with urllib.request.urlopen(f"http://{metrics_endpoint}/metrics", timeout=timeout) as response:
        return scrape_stages(response.read().decode())


def read_all_stages(metrics_endpoints: Sequence[str], timeout: float = 30.0) -> Snapshot:
    """The stage clocks of a server's processes (``dmoe-server --processes``), summed stage by stage."""
    snapshots = [read_stages(endpoint, timeout) for endpoint in metrics_endpoints]
    return {stage: (sum(s[stage][0] for s in snapshots), sum(s[stage][1] for s in snapshots)) for stage in STAGES}
