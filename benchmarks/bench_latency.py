"""Latency tolerance: training throughput of DMoE vs a model-parallel pipeline as the round trip grows.

For every latency a fresh local swarm (DHT node + ``--servers`` expert servers) injects that mean round-trip
delay into every expert call (``dmoe-server --inject-latency-ms L --latency-jitter exponential``, see
dmoe/server/faults.py), and three ways of training the same experts run one after another on it:

* ``dmoe``: ``--trainers`` concurrent trainer threads, each with its own stack of ``--layers`` DMoE layers
  (``RemoteMixtureOfExperts``, top-``--k`` over the whole grid, experts spread over all servers). Trainers do not
  wait for each other, so many requests are in flight and the servers stay busy while answers travel.
* ``pipeline``: the same kind of experts chained as a model-parallel pipeline, one expert per (layer, server)
  stage, alternating servers; forward walks the stages, backward walks them back. Every hop pays the latency
  and one batch is in flight, as in the paper's baseline.
* ``pipeline-mb``: the same pipeline with as many micro-batches in flight as it has stages (a full GPipe-style
  pipeline without staleness), which is the fairest synchronous baseline.
* ``pipeline-async``: the same pipeline with as many micro-batches in flight as DMoE has trainers, each walking
  the stages on its own while the experts step asynchronously (as in PipeDream or SWARM parallelism): the same
  total in flight as DMoE, and the same staleness.
* ``shallow`` and ``shallow-async``: pipelines of the same depth as the DMoE model, one stage per layer (servers
  alternating), with 1 and with ``--trainers`` micro-batches in flight: a step then crosses the network 2 x
  ``--layers`` times, as a DMoE step does (whose hops call every server at once).

Throughput is samples per second of forward+backward (each backward makes the experts take an optimizer step)
counted over a window after a warm-up. Samples are not the same work in every mode: a DMoE sample is computed by
``--k`` experts per layer, a pipeline sample by one expert per stage, so ``expert rows/s`` (samples/s times
expert evaluations per sample) compares the work done (every mode's calls carry activation ids, so the servers
reuse each forward in its backward instead of recomputing it); ``client ms/sample`` is the CPU the client process spent
per sample (gating, beam search, serialisation, autograd). The headline is each mode's throughput at 200 ms as a
fraction of its own throughput at 0 ms, measured in the same run on the same machine.

    python benchmarks/bench_latency.py                    # 0 10 50 100 200 500 1000 ms, exponential jitter
    python benchmarks/bench_latency.py --quick            # tiny and fast (what the test suite runs)
"""
from __future__ import annotations

import argparse
import csv
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from dmoe.client.bans import Bans
from dmoe.client.moe import RemoteMixtureOfExperts
from dmoe.client.remote_expert import backward_future, forward_future, new_activation_id
from dmoe.dht import DHT
from dmoe.launch import LocalSwarm, SwarmConfig, split_grid
from dmoe.uid import expand_pattern
from options import RESULTS, parse_with_quick  # benchmarks/

MODES = ("dmoe", "pipeline", "pipeline-mb", "pipeline-async", "shallow", "shallow-async")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latencies", type=float, nargs="+", default=[0, 10, 50, 100, 200, 500, 1000],
                        help="mean round-trip latencies in ms")
    parser.add_argument("--jitter", choices=("none", "exponential"), default="exponential")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--grid", type=int, nargs="+", default=[4, 4])
    parser.add_argument("--layers", type=int, default=2, help="DMoE layers (and pipeline stages per server)")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="experts per sample in the DMoE layers")
    parser.add_argument("--batch", type=int, default=32, help="samples per trainer step / per micro-batch")
    parser.add_argument("--trainers", type=int, default=128, help="concurrent DMoE trainers")
    parser.add_argument("--window", type=float, default=15.0, help="seconds counted per point, at least ...")
    parser.add_argument("--min-steps", type=float, default=4.0,
                        help="... this many mean step times of the mode (a step pays 2 round trips per hop)")
    parser.add_argument("--warmup", type=float, default=3.0,
                        help="seconds before counting starts (at least one mean step time)")
    parser.add_argument("--server-threads", type=int, default=1, help="torch threads per server")
    parser.add_argument("--rounds", type=int, default=1,
                        help="sweeps, alternately ascending and descending, averaged (cancels the drift of a "
                             "shared machine's load)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="directory for the CSV and PNG (default: the checkout's results/)")
    parser.add_argument("--tag", default=None, help="file name stem (default: latency or latency_quick)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--quick", action="store_true",
                        help="0 and 20 ms, tiny model, half-second windows (flags given with it keep their values)")
    args = parse_with_quick(parser, argv, dict(hidden=32, grid=[2, 2], k=2, batch=8, servers=1, latencies=[0, 20],
                                               trainers=8, window=0.5, warmup=0.2, min_steps=1.0))
    if args.servers > args.grid[0]:
        parser.error(f"argument --servers: at most the first grid axis ({args.grid[0]})")
    args.modes = [m for m in MODES if m in args.modes]  # in table order
    if 0 not in args.latencies:
        parser.error("argument --latencies: must include 0 (ratios are relative to 0 ms)")
    return args


def measure(step: Callable[[], int], workers: int, warmup: float, window: float,
            patience: float = 120.0) -> tuple[float, float]:
    """Samples per second completed during the window by ``workers`` threads looping on ``step``, and this
    process's CPU seconds per sample meanwhile.

    The window opens ``warmup`` seconds after every thread finished its first step (a trainer's first step builds
    its layers and searches a cold directory), and closes ``window`` seconds later or, if no step completed by then,
    at the first that does. In a loaded test run --quick's 0.5 s window once opened before eight trainers' first
    steps ended, and later another point's window held no completed step (a one-in-flight pipeline's step at
    20 ms a hop takes ~0.3 s unloaded): rates of 0 that measured nothing. ``patience``: seconds to wait for either
    before giving up.
    """
    stop, changed = threading.Event(), threading.Condition()
    done, ready = [0], [0]  # samples completed; threads that completed a step
    errors: list[BaseException] = []

    def loop():
        first = True
        try:
            while not stop.is_set():
                samples = step()
                with changed:
                    done[0] += samples
                    ready[0] += first
                    first = False
                    changed.notify_all()
        except BaseException as error:  # noqa: BLE001 — reported in the main thread
            with changed:
                errors.append(error)
                changed.notify_all()

    def wait_for(predicate: Callable[[], bool], what: str) -> None:
        with changed:
            if not changed.wait_for(lambda: errors or predicate(), patience):
                errors.append(RuntimeError(f"{what} took over {patience:g} s"))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: ready[0] == workers, f"the {workers} workers' first steps")
        if not errors:
            stop.wait(warmup)
            with changed:
                start_count, start, cpu = done[0], time.perf_counter(), time.process_time()
            stop.wait(window)
            wait_for(lambda: done[0] > start_count, "a step in the window")
            with changed:
                end_count, end, cpu = done[0], time.perf_counter(), time.process_time() - cpu
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    samples = end_count - start_count
    return samples / (end - start), cpu / max(samples, 1)


def dmoe_step_fn(args, dht: DHT, bans: Bans, latency_s: float, layer_stats: list) -> Callable[[], int]:
    """One trainer: its own DMoE layers (gate weights), forward + backward on a fresh batch per step."""
    local = threading.local()

    def step() -> int:
        if not hasattr(local, "layers"):
            local.layers = [RemoteMixtureOfExperts(
                args.hidden, args.grid, f"ffn{i}", dht, k_best=args.k, bans=bans,
                forward_timeout=30 + 20 * latency_s, backward_timeout=30 + 20 * latency_s,
                timeout_after_k_min=1.0 + 2 * latency_s, allow_zero_outputs=True, backward_k_min=0)
                for i in range(args.layers)]
            layer_stats.extend(layer.stats for layer in local.layers)
        h = torch.randn(args.batch, args.hidden)
        for layer in local.layers:
            h = layer(h)
        h.pow(2).mean().backward()
        return args.batch

    return step


def pipeline_stages(args, swarm: LocalSwarm, shallow: bool = False) -> list[tuple[str, str]]:
    """(uid, endpoint) of one expert per (layer, server), alternating servers: every hop crosses the network.
    ``shallow``: one stage per layer only (servers still alternating), the depth of the DMoE model."""
    patterns = split_grid([f"ffn{i}" for i in range(args.layers)], args.grid, args.servers)
    stages = []
    for layer in range(args.layers):
        for server, pattern in enumerate(patterns):
            if shallow and server != layer % args.servers:
                continue
            uid = next(u for u in expand_pattern(pattern) if u.startswith(f"ffn{layer}."))
            stages.append((uid, swarm.server_endpoints[server]))
    return stages


def pipeline_step_fn(args, stages: list[tuple[str, str]], latency_s: float) -> Callable[[], int]:
    """One micro-batch through the stages and back. Each stage's forward carries an activation id that its backward
    names, as the DMoE layer's calls do (dmoe/client/moe.py): the server keeps the forward for the backward instead
    of recomputing it, so a pipeline's expert row costs the compute of a DMoE one."""
    timeout = 30 + 20 * latency_s

    def step() -> int:
        h = torch.randn(args.batch, args.hidden)
        inputs = []
        for uid, endpoint in stages:
            activation_id = new_activation_id()
            inputs.append((h, activation_id))
            h = forward_future(endpoint, uid, [h], timeout=timeout, activation_id=activation_id).result()[0]
        grad = 2 * h / h.numel()
        for (uid, endpoint), (x, activation_id) in zip(reversed(stages), reversed(inputs)):
            grad = backward_future(endpoint, uid, [x], [grad], timeout=timeout,
                                   activation_id=activation_id).result()[0]
        return args.batch

    return step


def run_latency(args, latency_ms: float) -> list[dict]:
    latency_s = latency_ms / 1000
    server_args = ["--seed", str(args.seed), "--torch-threads", str(args.server_threads), "--log-level", "WARNING"]
    if latency_ms > 0:
        server_args += ["--inject-latency-ms", str(latency_ms), "--latency-jitter", args.jitter,
                        "--fault-seed", str(args.seed)]
    config = SwarmConfig(layers=[f"ffn{i}" for i in range(args.layers)], grid=args.grid, n_servers=args.servers,
                         hidden_dim=args.hidden, threads_per_server=args.server_threads, server_args=server_args)
    rows = []
    with LocalSwarm(config) as swarm, DHT(initial_peers=[swarm.initial_peers]) as dht:
        swarm.wait_declared()  # the first steps must not run without experts
        deep, shallow = pipeline_stages(args, swarm), pipeline_stages(args, swarm, shallow=True)
        for mode in args.modes:
            stats: list = []
            if mode == "dmoe":
                step, workers = dmoe_step_fn(args, dht, Bans(), latency_s, stats), args.trainers
                hops, experts_per_sample = args.layers, args.layers * args.k
            else:
                stages = shallow if mode.startswith("shallow") else deep
                step = pipeline_step_fn(args, stages, latency_s)
                workers = {"pipeline": 1, "pipeline-mb": len(stages), "shallow": 1}.get(mode, args.trainers)
                hops, experts_per_sample = len(stages), len(stages)
            step_time = 2 * hops * latency_s  # the latency's share of one step, on average
            warmup, window = max(args.warmup, step_time), max(args.window, args.min_steps * step_time)
            samples_per_s, cpu_per_sample = measure(step, workers, warmup, window)
            chosen = sum(s.experts_chosen for s in stats)
            dropped = sum(s.experts_dropped for s in stats)
            rows.append({"latency_ms": latency_ms, "mode": mode, "in_flight": workers, "hops": 2 * hops,
                         "samples_per_s": round(samples_per_s, 3),
                         "expert_rows_per_s": round(samples_per_s * experts_per_sample, 1),
                         "client_ms_per_sample": round(1000 * cpu_per_sample, 3),
                         "dropped_share": round(dropped / chosen, 4) if chosen else ""})
            print(f"{latency_ms:7.0f} ms  {mode:14s} {workers:3d} in flight  {samples_per_s:9.1f} samples/s "
                  f"{samples_per_s * experts_per_sample:9.1f} expert rows/s  client {1000 * cpu_per_sample:.2f} "
                  "ms/sample" + (f"  ({dropped}/{chosen} expert calls dropped)" if chosen else ""), flush=True)
    return rows


def average(runs: list[dict], rounds: int) -> list[dict]:
    """One row per (latency, mode): mean samples/s over the rounds, with the lowest and highest round."""
    rows = []
    for key in sorted({(r["latency_ms"], MODES.index(r["mode"])) for r in runs}):
        same = [r for r in runs if (r["latency_ms"], MODES.index(r["mode"])) == key]
        speeds = [r["samples_per_s"] for r in same]
        dropped = [r["dropped_share"] for r in same if r["dropped_share"] != ""]
        rows.append({**same[0], "samples_per_s": round(sum(speeds) / len(speeds), 3), "rounds": rounds,
                     "expert_rows_per_s": round(sum(r["expert_rows_per_s"] for r in same) / len(same), 1),
                     "client_ms_per_sample": round(sum(r["client_ms_per_sample"] for r in same) / len(same), 3),
                     "min_samples_per_s": min(speeds), "max_samples_per_s": max(speeds),
                     "dropped_share": round(sum(dropped) / len(dropped), 4) if dropped else ""})
    return rows


def add_ratios(rows: list[dict]) -> None:
    base = {r["mode"]: r["samples_per_s"] for r in rows if r["latency_ms"] == 0}
    for r in rows:
        r["ratio_to_0ms"] = round(r["samples_per_s"] / base[r["mode"]], 4) if base.get(r["mode"]) else ""


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), tight_layout=True)
    FigureCanvasAgg(fig)
    absolute, relative = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        points = sorted((r["latency_ms"], r["samples_per_s"], r["ratio_to_0ms"]) for r in rows if r["mode"] == mode)
        xs = [max(x, 1) for x, _, _ in points]  # 0 ms drawn at 1 ms on the log axis
        absolute.plot(xs, [y for _, y, _ in points], "o-", label=mode)
        relative.plot(xs, [r for _, _, r in points], "o-", label=mode)
    for ax, ylabel in ((absolute, "samples / s"), (relative, "throughput / throughput at 0 ms")):
        ax.set_xscale("log")
        ax.set_xlabel("mean round-trip latency, ms (0 drawn at 1)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    relative.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    absolute.set_title(title, fontsize=9)
    fig.savefig(path, dpi=110)


def _ratio(value: float | str) -> str:
    """A ratio to the 0 ms point, or "-" where that point completed nothing (its ratio is "")."""
    return "-" if value == "" else f"{value:.3f}"


def summary(rows: list[dict], headline_ms: float = 200) -> str:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    lines = [f"{'latency ms':>10} {'mode':>14} {'in flight':>9} {'hops':>5} {'samples/s':>10} {'ratio':>6} "
             f"{'expert rows/s':>13} {'client ms/sample':>16}"]
    for latency in sorted({r["latency_ms"] for r in rows}):
        for mode in modes:
            r = next(r for r in rows if r["latency_ms"] == latency and r["mode"] == mode)
            lines.append(f"{latency:10.0f} {mode:>14} {r['in_flight']:9d} {r['hops']:5d} {r['samples_per_s']:10.1f} "
                         f"{_ratio(r['ratio_to_0ms']):>6} {r['expert_rows_per_s']:13.1f} "
                         f"{r['client_ms_per_sample']:16.2f}")
    at = headline_ms if any(r["latency_ms"] == headline_ms for r in rows) else max(r["latency_ms"] for r in rows)
    fractions = {r["mode"]: r["ratio_to_0ms"] for r in rows if r["latency_ms"] == at}
    lines.append(f"headline: throughput at {at:.0f} ms as a fraction of 0 ms: "
                 + ", ".join(f"{m} {_ratio(fractions[m])}" for m in modes) + " (DMoE goal >= 0.9)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the client's own compute is tiny; the cores belong to the servers
    runs = []
    for round_ in range(args.rounds):
        for latency in sorted(args.latencies, reverse=bool(round_ % 2)):
            runs.extend(run_latency(args, latency))
    rows = average(runs, args.rounds)
    add_ratios(rows)
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.tag or ("latency_quick" if args.quick else "latency")
    csv_path, png_path = args.results / f"{stem}.csv", args.results / f"{stem}.png"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    title = (f"h={args.hidden} grid={'x'.join(map(str, args.grid))} k={args.k} layers={args.layers} "
             f"servers={args.servers} batch={args.batch} trainers={args.trainers} jitter={args.jitter}")
    plot(rows, png_path, title)
    print(title)
    print(summary(rows))
    print(f"wrote {csv_path} and {png_path}")
    return {"rows": rows, "csv": csv_path, "png": png_path}


if __name__ == "__main__":
    sys.exit(main() and 0)
