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

On a GPU a profiling worker synchronises the device at every stage boundary (:class:`dmoe.timing.Laps`), which
costs the overlap the server otherwise gets (copies beside compute). So profile to see the shares, and time
throughput with the profile off. Off by default; the runtime and servicer then do no timing at all.
"""
from __future__ import annotations

from typing import Sequence

from dmoe.timing import Snapshot, format_stages, stage_difference
from dmoe.timing import StageClock as _StageClock

__all__ = ["STAGES", "StageClock", "Snapshot", "format_stages", "stage_difference", "scrape_stages",
           "read_stages", "read_all_stages"]

STAGES = ("call", "decode", "queue", "batch", "to_device", "compute", "to_host", "encode")


class StageClock(_StageClock):
    """The server's stages (:data:`STAGES`), added from any thread and read by metrics or tests."""

    def __init__(self) -> None:
        super().__init__(STAGES)


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
