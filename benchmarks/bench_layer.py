"""One DMoE layer, remote vs in-process: forward + backward time per batch, and the ratio.

Remote: a DHT node and an expert server process host ``--grid`` ffn experts; this process holds the gate and
calls them through :class:`dmoe.RemoteMixtureOfExperts` (beam search over the DHT, one request per chosen expert,
all of a server's in one call, backward requests that make each expert take an Adam step).
In-process, two baselines doing the server's work without the network, with the same experts, gate and top-k:

* ``in-proc``: :class:`dmoe.LocalMixtureOfExperts` over plain experts (autograd keeps their activations) and one
  Adam step per used expert after every backward: what the server does when its activation cache holds the
  forward's graph (the remote layer sends activation ids, and a forward that ran alone in its batch is kept);
* ``in-proc+recompute``: the experts of ``dmoe-train --experts local`` (:mod:`dmoe.server.in_process`): the
  server's own ``ExpertBackend``, forward without autograd, backward recomputing it and stepping Adam, which is
  what a server does when it holds no activations for a backward.

Both this process and the server use dmoe.cli.allocator.keep_freed_memory(), as dmoe-server does, and the same
torch thread count, ``--threads``: on a CPU 1 by default, so that both sides compute one expert at a time on one
thread. With more, the server spreads them over ``--workers`` (two of one thread each for 2 threads on a CPU,
computing different experts at once) where the baselines use them inside each operation (``--server-workers 1``
places them the same way); and two OpenMP threads in one operation stall whenever another process runs, which
slows the baselines far more than the server's single-threaded workers: on a 2-core machine at load 14-17,
``--quick`` printed speeds of up to 23 from that alone (review 103 D1). The 1-minute load average is printed for
every round, and rounds that ran with a load above the machine's cores are named.

    python benchmarks/bench_layer.py                 # h=1024, 4x4 grid, top-4, batches 16 64 256, 3 rounds
    python benchmarks/bench_layer.py --quick         # small and fast (what the test suite runs)
    python benchmarks/bench_layer.py --device cuda   # server, in-process experts, gate and inputs on the GPU
    python benchmarks/bench_layer.py --device cuda --autocast bf16        # server and baselines under autocast
    python benchmarks/bench_layer.py --device cuda --overlap-copies    # the server's pinned copies, to compare
    python benchmarks/bench_layer.py --device cuda --compression float16   # half the bytes on the wire
    python benchmarks/bench_layer.py --profile       # and where the server's time goes (dmoe-server --profile)
    python benchmarks/bench_layer.py --no-shared-memory   # every byte through gRPC (on one host the payload
                                                          # otherwise goes through shared memory)
    python benchmarks/bench_layer.py --no-hold-calls   # no hold call kept open per channel (gRPC then starts a
                                                       # thread to poll a channel for nearly every call)

``--profile`` starts the server with ``--profile`` and prints, per batch size, the milliseconds per step that each
stage of the server's path took (dmoe/server/profile.py), summed over the step's calls, requests and batches, and
the part of the remote step spent outside the server's handlers (the client's gate, beam search and encoding, and
gRPC's transport), then the server's activation cache over the run (hits, misses, evictions, forwards released for a
batch out of memory, and the most memory it held: on a GPU, device memory). On a GPU the profiled server
synchronises between stages, so its remote times are not the unprofiled ones: take speed from a run without
``--profile``.

With ``--autocast``, the server computes under ``torch.autocast`` and each baseline runs its whole step (forward
and backward) inside it; on a GPU autograd runs backward on its own thread, where autocast is off, so
``in-proc+recompute`` recomputes its forward in full precision there (``in-proc`` keeps the forward's
half-precision graph, as the server's activation cache does). Autocast can make the in-process layer *slower* (at
h=1024 it casts the experts' fp32 weights again every step), which would raise the ratio without the remote layer
getting any faster; so with ``--autocast`` the same in-process layer is also timed without autocast
(``in-proc fp32``) in the same rounds, and ``vs best in-proc`` is the remote speed against the faster of the two
in-process layers in each round. The goals (issue #24's, set for a GPU: at least 0.6 at batch 64 and 0.8 at batch
256) are judged on ``vs best in-proc`` only; without ``--autocast`` it equals ``speed vs in-proc``.

Speeds are ratios of seconds per step, ``in-process / remote``, computed per round: the variants take turns step by
step within a round, so a round's figures are paired. Printed per batch size: the median of the rounds' ratios
(with an even number of rounds, the mean of the middle two: ``--rounds 2`` prints the mean of the two rounds), their
lowest and highest, and every round's ratio; the seconds printed are each variant's median over the rounds, taken
separately, so they need not divide exactly to the ratio.

What the server did is read from its metrics (it always runs with ``--metrics-port 0``), not from the flags:
``via shm`` is the share of its calls in the timed steps that came through shared memory (requests under 64 KiB go
through gRPC; a warning names the batch sizes where shared memory was asked for and no call used it); with
``--cuda-graphs`` a line gives the graphs captured, the forward and training-step replays per batch size and the
experts whose graphs were turned off, with a warning when no training step replayed (the server then trained
eagerly). The in-process layers never use CUDA graphs: with ``--cuda-graphs`` the speeds compare a server with
graphs against eager in-process layers.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from dmoe.cli.allocator import keep_freed_memory
from dmoe.client.gating import LocalMixtureOfExperts
from dmoe.client.moe import RemoteMixtureOfExperts
from dmoe.dht import DHT
from dmoe.launch import LocalSwarm, SwarmConfig, announced
from dmoe.server.backend import make_optimizer
from dmoe.server.in_process import ExpertOptimizerConfig, in_process_experts
from dmoe.server.metrics import read_metrics
from dmoe.client.gating import CLIENT_STAGES
from dmoe.server.profile import format_stages, read_all_stages, stage_difference
from dmoe.timing import StageClock
from dmoe.server.runtime import AUTOCAST_DTYPES
from dmoe.server.server import compute_workers
from dmoe.wire import ChannelPool
from dmoe.wire.codec import parse_compression
from options import RESULTS, parse_with_quick  # benchmarks/
from server_counts import (add, difference, format_share, graphs_summary, graphs_warning, read_counts,  # benchmarks/
                           shared_memory_warning, shared_share)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--grid", type=int, nargs="+", default=[4, 4])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--steps", type=int, default=15, help="timed forward+backward steps per batch size")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every batch size is measured, in turns (default 3, --quick 1); the ratio printed "
                             "is the median of the rounds' ratios (with an even number of rounds the mean of the middle "
                             "two: with 2, the mean of both), with the lowest and highest, and each round's (one "
                             "round's moves by several hundredths on a quiet 2-core VM); use an odd number for a "
                             "median that is one round's")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads, the same for server and baseline (default: 1 on a CPU, where the server "
                             "would otherwise compute two experts at once on threads of their own while each "
                             "baseline operation used both; 2 on a GPU)")
    parser.add_argument("--client-threads", type=int, default=None,
                        help="torch threads of this process while it runs the remote layer, whose own compute is "
                             "only the gate (default: --threads)")
    parser.add_argument("--server-workers", type=int, default=None,
                        help="the server's --workers (default: the server's own choice, two of 1 thread each for 2)")
    parser.add_argument("--server-processes", type=int, default=1,
                        help="the server's --processes: its experts dealt out among this many server processes, "
                             "each called at once by the layer")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--device", default="cpu", help="where the server, the baselines and the gate compute")
    parser.add_argument("--autocast", choices=sorted(AUTOCAST_DTYPES), default=None,
                        help="the server's --autocast, and the baselines' steps under torch.autocast; the in-process "
                             "layer is also timed without it, and the goals are judged against the faster of the two")
    parser.add_argument("--overlap-copies", action=argparse.BooleanOptionalAction, default=False,
                        help="the server's --overlap-copies (GPU only: pinned copies on a copy stream per worker)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                        help="the server's --cuda-graphs (GPU only: each expert's forward and training step replayed "
                             "as CUDA graphs)")
    parser.add_argument("--compression", choices=["none", "float16", "uint8"], default="none",
                        help="the remote layer's wire compression (requests, and asked of the answers)")
    parser.add_argument("--shared-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="the layer's calls pass their payload through memory shared with the server (the "
                             "default on one host); --no-shared-memory: every byte through gRPC's transport")
    parser.add_argument("--hold-calls", action=argparse.BooleanOptionalAction, default=True,
                        help="the client keeps a hold call open per channel (the default; dmoe.wire.channels.HeldCall)")
    parser.add_argument("--profile", action="store_true",
                        help="run the server with --profile and print where its time goes per step")
    parser.add_argument("--client-profile", action="store_true",
                        help="time the remote layer's own stages (gate, search, copies, sending, waiting, gathering; "
                             "dmoe.client.gating.CLIENT_STAGES) and print them per step")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="directory for the CSV (default: the checkout's results/)")
    parser.add_argument("--quick", action="store_true",
                        help="h=64, batches 8 32, 3 steps after 1 of warm-up, 1 round (flags given with it keep their "
                             "values)")
    args = parse_with_quick(parser, argv, dict(hidden=64, batches=[8, 32], steps=3, warmup=1, rounds=1))
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.threads is None:  # one thread a side on a CPU: the same placement for server and baselines (review 103 D1)
        args.threads = 1 if torch.device(args.device).type == "cpu" else 2
    return args


#: issue #24's goals for the layer (set for a GPU): the remote speed against the fastest in-process layer, by batch
GOALS = {64: 0.6, 256: 0.8}


def time_steps(steps: dict, batch: int, hidden: int, n_steps: int, warmup: int,
               device: torch.device, autocast: str | None = None,
               after_warmup: Callable[[], None] = lambda: None,
               under_autocast: set[str] | None = None) -> dict[str, float]:
    """Median seconds of one forward+backward of each variant; the variants take turns step by step, so that
    the machine's slow and fast moments hit all of them alike. ``autocast``: the steps of the variants named in
    ``under_autocast`` (default: all but ``remote``, whose server computes under its own) run under
    ``torch.autocast`` with that dtype. ``after_warmup``: called once the warm-up steps are done."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    under_autocast = set(steps) - {"remote"} if under_autocast is None else under_autocast
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + n_steps):
        if i == warmup:
            after_warmup()
        for name, step in steps.items():
            x = torch.randn(batch, hidden, device=device, requires_grad=True)
            sync()
            start = time.perf_counter()
            if autocast is not None and name in under_autocast:
                with torch.autocast(device.type, dtype=AUTOCAST_DTYPES[autocast]):
                    step(x)
            else:
                step(x)
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def summarise_rounds(timed: list[dict[str, float]]) -> dict:
    """One batch size's figures from its rounds, each a dict of variant -> median seconds per step (``remote``,
    ``local``, ``recompute`` and, with --autocast, ``local_fp32``). Ratios are in-process over remote seconds,
    computed per round (a round's variants took turns step by step); summarised by the median of the rounds' ratios
    (the mean of the middle two for an even number of rounds) and their range. ``ratio_vs_best``: against the
    faster in-process layer of each round, with or without autocast."""
    ratios = [t["local"] / t["remote"] for t in timed]
    best = [min(t["local"], t.get("local_fp32", t["local"])) / t["remote"] for t in timed]

    def median(name: str) -> float | str:
        return statistics.median(t[name] for t in timed) if name in timed[0] else ""

    return dict(remote_s=median("remote"), inprocess_s=median("local"), inprocess_recompute_s=median("recompute"),
                ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                ratio_vs_recompute=statistics.median(t["recompute"] / t["remote"] for t in timed),
                rounds=len(timed), inprocess_fp32_s=median("local_fp32"), ratio_vs_best=statistics.median(best),
                ratio_vs_best_min=min(best), ratio_vs_best_max=max(best),
                ratios_per_round=" ".join(f"{r:.4f}" for r in ratios),
                ratios_vs_best_per_round=" ".join(f"{r:.4f}" for r in best))


def goal_verdicts(rows: list[dict]) -> list[tuple[int, float, float, bool]]:
    """(batch, goal, speed against the fastest in-process layer, met) for each batch size measured that has a goal.
    Judged on ``ratio_vs_best`` only: a slower baseline (autocast's) cannot make a goal met."""
    return [(r["batch"], GOALS[r["batch"]], r["ratio_vs_best"], r["ratio_vs_best"] >= GOALS[r["batch"]])
            for r in rows if r["batch"] in GOALS]


def load_report(loads: dict[int, list[float]], cores: int) -> str:
    """The 1-minute load average after each batch size's steps, round by round, and a warning naming the rounds that
    ran under a load above ``cores``: other processes then took CPU from the timed steps, and a variant that stalled
    moved those rounds' ratios (review 103 D1)."""
    rounds = list(zip(*loads.values()))  # per round: the load after each batch size, in the order they ran
    lines = [f"load (1-minute load average of this machine's {cores} cores after each batch size's steps, "
             f"batches {' '.join(map(str, loads))}): "
             + "; ".join(f"round {i + 1}: " + " ".join(f"{load:.1f}" for load in round_)
                         for i, round_ in enumerate(rounds))]
    loaded = [str(i + 1) for i, round_ in enumerate(rounds) if max(round_) > cores]
    if loaded:
        lines.append(f"WARNING: round(s) {', '.join(loaded)} ran under a load above the {cores} cores: other "
                     "processes took CPU from the timed steps, and their speeds compare the variants' stalls as much "
                     "as the variants")
    return "\n".join(lines)


def local_step_fn(layer: LocalMixtureOfExperts, lr: float):
    """Plain experts: one Adam step per expert that got gradients, after the backward."""
    optimizers = {name: make_optimizer("adam", expert.parameters(), lr) for name, expert in layer.experts.items()}

    def step(x):
        layer(x).sum().backward()
        for name, expert in layer.experts.items():
            if next(expert.parameters()).grad is not None:
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
        layer.proj.zero_grad(set_to_none=True)

    return step


def server_code_step_fn(layer: LocalMixtureOfExperts):
    """In-process experts that step themselves in backward, as on the server."""
    def step(x):
        layer(x).sum().backward()
        layer.proj.zero_grad(set_to_none=True)

    return step


def main(argv=None) -> list[dict]:
    keep_freed_memory()  # as dmoe-server does: the in-process baseline gets the same allocator settings
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    rows = []
    swarm_config = SwarmConfig(layers=("ffn0",), grid=tuple(args.grid), n_servers=1, hidden_dim=args.hidden,
                               threads_per_server=args.threads,
                               server_args=("--optimizer", "adam", "--lr", str(args.lr), "--device", args.device,
                                            "--max-batch-size", str(max(args.batches) * args.k),
                                            *(("--autocast", args.autocast) if args.autocast else ()),
                                            ("--overlap-copies" if args.overlap_copies else "--no-overlap-copies"),
                                            *(("--cuda-graphs",) if args.cuda_graphs else ()),
                                            ("--shared-memory" if args.shared_memory else "--no-shared-memory"),
                                            *(("--workers", str(args.server_workers)) if args.server_workers else ()),
                                            "--processes", str(args.server_processes),
                                            "--metrics-port", "0",  # what it did: graphs, calls through shared memory
                                            *(("--profile",) if args.profile else ())))
    with LocalSwarm(swarm_config) as swarm, DHT(initial_peers=[swarm.initial_peers]) as dht, \
            ChannelPool(shared_memory=args.shared_memory, hold_calls=args.hold_calls) as channels:
        swarm.wait_declared()
        remote = RemoteMixtureOfExperts(args.hidden, args.grid, "ffn0", dht, k_best=args.k, forward_timeout=60,
                                        backward_timeout=60, timeout_after_k_min=60, k_min=args.k,
                                        compression=parse_compression(args.compression),
                                        channels=channels).to(device)

        def remote_step(x):
            torch.set_num_threads(args.client_threads or args.threads)
            remote(x).sum().backward()
            remote.proj.zero_grad(set_to_none=True)
            torch.set_num_threads(args.threads)

        local = LocalMixtureOfExperts(args.hidden, args.grid, "ffn0", k_best=args.k).to(device)
        server_code = in_process_experts("ffn", args.hidden, ExpertOptimizerConfig("adam", args.lr), device=device)
        recompute = LocalMixtureOfExperts(args.hidden, args.grid, "ffn0", k_best=args.k,
                                          expert_factory=server_code).to(device)
        local_step, recompute_step = local_step_fn(local, args.lr), server_code_step_fn(recompute)
        variants = {"remote": remote_step, "local": local_step, "recompute": recompute_step}
        if args.autocast:  # the same in-process layer without autocast: the fastest reference may be this one
            variants["local_fp32"] = local_step
        stages = ServerStages(swarm, args.steps) if args.profile else None
        client_stages = ClientStages(remote, args.steps) if args.client_profile else None
        metrics = announced(swarm.servers[0].output, "metrics on")  # of every server process
        window: dict[str, dict[str, float]] = {}

        def after_warmup() -> None:
            window["start"] = read_counts(metrics)
            for profile in (stages, client_stages):
                if profile is not None:
                    profile.start()
        rounds: dict[int, list[dict[str, float]]] = {batch: [] for batch in args.batches}
        served: dict[int, dict[str, float]] = {}  # per batch size: what the server did in the timed steps
        loads: dict[int, list[float]] = {batch: [] for batch in args.batches}  # per batch size, one per round
        for _ in range(args.rounds):
            for batch in args.batches:
                rounds[batch].append(time_steps(variants, batch, args.hidden, args.steps, args.warmup, device,
                                                args.autocast, after_warmup=after_warmup,
                                                under_autocast={"local", "recompute"}))
                loads[batch].append(os.getloadavg()[0])
                served[batch] = add(served.get(batch, {}), difference(read_counts(metrics), window["start"]))
                for profile in (stages, client_stages):
                    if profile is not None:
                        profile.stop(batch)
        over_run = read_counts(metrics)  # since the server started: its captures, warm-up included
        for batch, timed in rounds.items():
            share = shared_share(served[batch])
            rows.append({"batch": batch, **summarise_rounds(timed), "dropped": remote.stats.experts_dropped,
                         "shared_memory_share": "" if share is None else round(share, 4),
                         "load_avg_per_round": " ".join(f"{load:.2f}" for load in loads[batch]),
                         **({"graph_forward_replays": int(served[batch]["graph_forward_replays"]),
                             "graph_train_replays": int(served[batch]["graph_train_replays"])}
                            if args.cuda_graphs else {})})
    args.results.mkdir(parents=True, exist_ok=True)
    suffix = ("" if device.type == "cpu" else f"_{device.type}") + (f"_{args.autocast}" if args.autocast else "")
    suffix += "_overlap_copies" if args.overlap_copies and device.type != "cpu" else ""
    suffix += "_cuda_graphs" if args.cuda_graphs else ""
    suffix += "" if args.compression == "none" else f"_{args.compression}"
    suffix += "" if args.shared_memory else "_grpc_only"
    suffix += "" if args.hold_calls else "_no_hold_calls"
    suffix += "" if args.server_processes == 1 else f"_{args.server_processes}_processes"
    out = args.results / f"bench_layer{suffix}.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    workers, _ = compute_workers(args.server_workers, device)  # what the server (with as many threads) runs
    server = f"{workers} workers sharing them"
    if args.server_processes > 1:  # each process gets its share of the threads (dmoe-server --processes)
        per_process = max(1, args.threads // args.server_processes)
        workers, _ = compute_workers(args.server_workers, device, per_process)
        server = f"{args.server_processes} processes of {per_process} thread(s), {workers} worker(s) each"
    print(f"DMoE layer: h={args.hidden}, grid {'x'.join(map(str, args.grid))}, top-{args.k}, "
          f"{args.threads} torch threads (remote client: {args.client_threads or args.threads}; server: {server}"
          f"), device {args.device}, autocast {args.autocast or 'off'}"
          f"{', server copies pinned on copy streams' if args.overlap_copies else ''}"
          f"{', server asked for CUDA graphs (the in-process layers compute eagerly)' if args.cuda_graphs else ''}"
          f"{'' if args.compression == 'none' else f', wire compression {args.compression}'}"
          f", {'shared memory asked for (the share used: via shm)' if args.shared_memory else 'payload through gRPC'}"
          f"{'' if args.hold_calls else ', no hold calls'}, median of {args.steps} steps, "
          f"{args.rounds} round(s)")
    fp32 = bool(args.autocast)  # the in-process layer was timed without autocast too
    print(f"{'batch':>6} {'remote s':>10} {'in-proc s':>10} " + (f"{'in-proc fp32 s':>15} " if fp32 else "")
          + f"{'in-proc+recompute s':>20} {'speed vs in-proc':>17} {'(rounds: low-high)':>19} {'vs recompute':>13}"
          + (f" {'vs best in-proc':>16} {'(rounds: low-high)':>19}" if fp32 else "") + f" {'via shm':>7}"
          + "  rounds' speeds vs in-proc")
    for r in rows:
        print(f"{r['batch']:>6} {r['remote_s']:>10.4f} {r['inprocess_s']:>10.4f} "
              + (f"{r['inprocess_fp32_s']:>15.4f} " if fp32 else "")
              + f"{r['inprocess_recompute_s']:>20.4f} {r['ratio']:>17.2f} {r['ratio_min']:>14.2f}-{r['ratio_max']:.2f} "
              f"{r['ratio_vs_recompute']:>13.2f}"
              + (f" {r['ratio_vs_best']:>16.2f} {r['ratio_vs_best_min']:>14.2f}-{r['ratio_vs_best_max']:.2f}"
                 if fp32 else "")
              + f" {format_share(shared_share(served[r['batch']])):>7}"
              + "  " + " ".join(f"{float(x):.2f}" for x in r["ratios_per_round"].split()))
    summarised = ("one round's speed" if args.rounds == 1 else f"the median of the {args.rounds} rounds' speeds ("
                  + ("for an even count, the mean of the middle two)" if args.rounds % 2 == 0 else "the middle round's)"))
    print(f"speed = in-process s / remote s, per round (a round's variants take turns step by step); printed: "
          f"{summarised}{', their range and each' if args.rounds > 1 else ''}; the seconds are medians over the "
          "rounds, taken separately"
          + ("; vs best in-proc: against the faster of in-proc under autocast and in-proc fp32, per round"
             if fp32 else "")
          + "; via shm: the share of the server's calls in the timed steps that came through shared memory")
    print(load_report(loads, os.cpu_count() or 1))
    warning = shared_memory_warning({f"batch {b}": shared_share(c) for b, c in served.items()}, args.shared_memory)
    if warning:
        print(warning)
    if args.cuda_graphs:
        print("server with CUDA graphs vs eager in-process layers: the server's graphs over the run: "
              + graphs_summary(over_run) + "; replays in the timed steps: "
              + ", ".join(f"batch {b} {c['graph_forward_replays']:.0f} forward / {c['graph_train_replays']:.0f} "
                          "training-step" for b, c in served.items()))
        warning = graphs_warning(over_run, asked=True)
        if warning:
            print(warning)
    verdicts = goal_verdicts(rows)
    if verdicts:
        print("goals (issue #24's, set for a GPU) against the fastest in-process layer"
              + (" (in-proc under autocast or fp32, whichever was faster)" if fp32 else "") + ": "
              + "; ".join(f"batch {batch} {speed:.2f} (goal >= {goal}) {'met' if met else 'missed'}"
                          for batch, goal, speed, met in verdicts))
    if stages is not None:
        stages.report({r["batch"]: r["remote_s"] for r in rows})
    if client_stages is not None:
        client_stages.report({r["batch"]: r["remote_s"] for r in rows})
    print(f"wrote {out}")
    return rows


class StageRounds:
    """A stage clock read before and after each batch size's timed steps (warm-up left out), one difference per
    round; :meth:`summed` adds a batch size's rounds up."""

    def __init__(self, steps: int):
        self.steps = steps
        self.rounds: dict[int, list[dict]] = {}
        self._start: dict | None = None

    def read(self) -> dict:
        raise NotImplementedError

    def start(self) -> None:
        self._start = self.read()

    def stop(self, batch: int) -> None:
        assert self._start is not None, "start() comes first"
        self.rounds.setdefault(batch, []).append(stage_difference(self.read(), self._start))

    def summed(self) -> Iterator[tuple[int, dict, int]]:
        """Per batch size: (batch, every stage's seconds and events over its rounds, the remote steps timed)."""
        for batch, rounds in self.rounds.items():
            yield batch, {stage: (sum(r[stage][0] for r in rounds), sum(r[stage][1] for r in rounds))
                          for stage in rounds[0]}, self.steps * len(rounds)


class ClientStages(StageRounds):
    """The remote layer's own stages (``stage_clock``)."""

    def __init__(self, layer: RemoteMixtureOfExperts, steps: int):
        super().__init__(steps)
        self.clock = layer.stage_clock = StageClock(CLIENT_STAGES)

    def read(self) -> dict:
        return self.clock.snapshot()

    def report(self, remote_seconds: dict[int, float]) -> None:
        """Per batch size: each stage in ms per remote step, and the client's own share of them."""
        for batch, snapshot, steps in self.summed():
            staged_ms = 1e3 * sum(total for total, _ in snapshot.values()) / steps
            waits_ms = 1e3 * (snapshot["wait"][0] + snapshot["bwd_wait"][0]) / steps
            print(f"client stages at batch {batch} ({steps} remote steps; remote step {1e3 * remote_seconds[batch]:.2f}"
                  f" ms median; in these stages {staged_ms:.2f} ms per step on average, of which {waits_ms:.2f} ms "
                  f"waiting for the servers' answers (their work and gRPC's) and {staged_ms - waits_ms:.2f} ms the "
                  f"client's own; not in them: autograd's backward of the mix and the gate):")
            print(format_stages(snapshot, per=steps))


class ServerStages(StageRounds):
    """The profiled server's stage times, scraped from its metrics (of all its processes)."""

    def __init__(self, swarm: LocalSwarm, steps: int):
        super().__init__(steps)
        self.endpoints = announced(swarm.servers[0].output, "metrics on")
        self.cache: dict = {}

    def read(self) -> dict:
        return read_all_stages(self.endpoints)

    def stop(self, batch: int) -> None:
        super().stop(batch)
        self.cache = self.activation_cache()  # its counts so far (report() comes after the server stopped)

    def report(self, remote_seconds: dict[int, float]) -> None:
        """Per batch size: each stage in ms per remote step, and what the step spent outside the handlers."""
        for batch, snapshot, steps in self.summed():
            call_ms = 1e3 * snapshot["call"][0] / steps
            step_ms = 1e3 * remote_seconds[batch]
            if len(self.endpoints) > 1:  # the processes' handlers run side by side: their sum may exceed the step
                where = f"{call_ms:.2f} ms in the handlers of the server's {len(self.endpoints)} processes, summed"
            else:
                where = (f"{call_ms:.2f} ms in the server's handlers, {step_ms - call_ms:.2f} ms outside them: client "
                         f"and gRPC transport")
            print(f"server stages at batch {batch} ({steps} remote steps; remote step {step_ms:.2f} ms median, "
                  f"{where}):")
            print(format_stages(snapshot, per=steps))
        cache = self.cache
        peaks = ", ".join(f"{value / 2**20:.1f} MiB on {device}" for device, value in cache["peak"].items())
        print(f"the server's activation cache over the run: {cache['hit']:.0f} hits, {cache['miss']:.0f} misses, "
              f"{cache['evicted']:.0f} evicted, {cache['released']:.0f} released for a batch out of memory; at most "
              f"{peaks or 'nothing'} kept at once")

    def activation_cache(self) -> dict:
        """Hits, misses, evictions and releases of the server's activation cache, and its peak bytes per device."""
        found: dict = {"hit": 0, "miss": 0, "evicted": 0, "released": 0, "peak": {}}
        for sample in (sample for endpoint in self.endpoints for sample in read_metrics(endpoint)):
            if sample.name == "dmoe_activation_cache_total" and sample.labels["result"] in found:
                found[sample.labels["result"]] += sample.value
            elif sample.name == "dmoe_activation_cache_peak_bytes":  # summed: each process keeps its own
                device = sample.labels["device"]
                found["peak"][device] = found["peak"].get(device, 0) + sample.value
        return found


if __name__ == "__main__":
    sys.exit(main() and 0)
