"""What an expert server really did, read from its metrics (``dmoe-server --metrics-port``), for the benchmarks that
start one: whether its CUDA graphs replayed, and how many of its tensor calls came through shared memory.

A benchmark's header used to repeat its flags ("server on CUDA graphs", "payload through shared memory") whether or
not that happened: a server whose every training-step capture failed trained eagerly, requests under
``dmoe.wire.shared_memory.MIN_BYTES`` go through gRPC, and shared memory drops out where the platform lacks it.
These helpers read the server's counters (summed over its processes), so the benchmarks print what happened:

* ``dmoe_cuda_graph_captures_total{expert}``, ``dmoe_cuda_graph_replays_total{expert, kind=forward|train}`` and
  ``dmoe_cuda_graphs_off{expert}`` (present for the experts that use graphs only);
* ``dmoe_grpc_calls_total{rpc}``: the forward/backward calls received, those through shared memory as
  ``{rpc}_shared`` (the ``call_shared`` RPC). A shared call the server refused is counted there and again as the
  plain call the client then makes, which makes the share a little low, never high.
"""
from __future__ import annotations

from typing import Iterable, Sequence

#: the counters :func:`read_counts` returns; the first two are levels (gauges), the others counts
GAUGES = ("graph_experts", "graphs_off")
COUNTS = ("graph_captures", "graph_forward_replays", "graph_train_replays", "calls", "shared_calls")


def count_samples(samples: Iterable) -> dict[str, float]:
    """The counters of :data:`GAUGES` and :data:`COUNTS` from a metrics page's samples (of one or more processes)."""
    counts = dict.fromkeys(GAUGES + COUNTS, 0.0)
    for sample in samples:
        if sample.name == "dmoe_cuda_graph_captures_total":
            counts["graph_captures"] += sample.value
        elif sample.name == "dmoe_cuda_graph_replays_total" and sample.labels.get("kind") in ("forward", "train"):
            counts[f"graph_{sample.labels['kind']}_replays"] += sample.value
        elif sample.name == "dmoe_cuda_graphs_off":
            counts["graph_experts"] += 1
            counts["graphs_off"] += sample.value > 0
        elif sample.name == "dmoe_grpc_calls_total":
            counts["calls"] += sample.value
            counts["shared_calls"] += sample.labels.get("rpc", "").endswith("_shared") * sample.value
    return counts


def read_counts(metrics_endpoints: Sequence[str], timeout: float = 30.0) -> dict[str, float]:
    """:func:`count_samples` of every process of a server, ``HOST:PORT`` of each one's metrics."""
    from dmoe.server.metrics import read_metrics

    return count_samples(sample for endpoint in metrics_endpoints for sample in read_metrics(endpoint, timeout))


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What happened between two reads: the counts' differences, the gauges as ``after`` read them."""
    return {key: after[key] if key in GAUGES else after[key] - before.get(key, 0.0) for key in after}


def add(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Two windows' differences together (the gauges: the later window's)."""
    return {key: part[key] if key in GAUGES else total.get(key, 0.0) + part[key] for key in part}


def shared_share(counts: dict[str, float]) -> float | None:
    """The share of the server's forward/backward calls that came through shared memory; None if it got none."""
    return counts["shared_calls"] / counts["calls"] if counts["calls"] else None


def format_share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def shared_memory_warning(shares: dict, asked: bool) -> str | None:
    """A warning when shared memory was asked for and none of the calls of some case (a key of ``shares``: a batch
    size, a case's name) went through it."""
    none = [str(case) for case, share in shares.items() if share == 0]
    if not asked or not none:
        return None
    return (f"WARNING: shared memory was asked for, but no call went through it at {', '.join(none)} (requests "
            f"under {min_bytes_note()} go through gRPC, and the path drops out where the platform lacks it): the "
            "payload of those went through gRPC")


def min_bytes_note() -> str:
    from dmoe.wire.shared_memory import MIN_BYTES

    return f"{MIN_BYTES // 1024} KiB" if MIN_BYTES % 1024 == 0 else f"{MIN_BYTES} bytes"


def graphs_summary(counts: dict[str, float]) -> str:
    """``3 captured, 40 forward and 20 training-step replays, turned off on 0 of 16 experts``."""
    return (f"{counts['graph_captures']:.0f} captured, {counts['graph_forward_replays']:.0f} forward and "
            f"{counts['graph_train_replays']:.0f} training-step replays, turned off on {counts['graphs_off']:.0f} of "
            f"{counts['graph_experts']:.0f} experts")


def graphs_warning(counts: dict[str, float], asked: bool, trained: bool = True) -> str | None:
    """A warning when CUDA graphs were asked for and did not all happen: no expert used graphs, some turned them off,
    or (``trained``: the window had backward calls) no training step replayed: then the server trained eagerly."""
    if not asked:
        return None
    problems = []
    if not counts["graph_experts"]:
        problems.append("no expert of the server uses CUDA graphs")
    elif counts["graphs_off"]:
        problems.append(f"graphs were turned off on {counts['graphs_off']:.0f} of {counts['graph_experts']:.0f} "
                        "experts (a capture failed: they compute eagerly)")
    if trained and not counts["graph_train_replays"]:
        problems.append("no training step replayed as a CUDA graph: the server trained eagerly")
    if not problems:
        return None
    return "WARNING: --cuda-graphs was asked for, but " + "; ".join(problems) + f" ({graphs_summary(counts)})"
