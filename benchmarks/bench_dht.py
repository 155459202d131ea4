"""DHT scale: beam search top-k over a 64x64 grid (4096 experts) with N DHT nodes, before and after killing half.

Each of N nodes is a real DHT node listening on 127.0.0.1; several nodes share one process (``--nodes-per-process``,
one asyncio loop each process) so that 128 nodes fit on a two-core machine. Four more processes declare the grid
(each a quarter of every row, so every prefix record merges four declarers). This process runs a client node and
times ``beam_search`` for batches of rows (``--batch``, default 1 and 16) with fresh random scores and no cache,
so every search goes to the DHT; then the largest batch again with a warm :class:`PrefixCache`, as a training
loop would run it. Success means the answer equals brute force over the declared experts. Then half of the N
nodes are killed (SIGKILL, whole processes) and the cold searches are timed again at once, while the swarm still
routes through the dead; the declarers refresh only every ``--refresh-period`` (60 s), so what the after-kill
phase finds comes from surviving replicas and read repair, not from owners re-declaring. The killed half is taken
from the member nodes only: the bootstrap node, the four declarers' own nodes and the client's stay up (the
declarers stand for servers, which are alive by definition of what a search must find; killing servers is the
chaos benchmark's part), so the half that dies holds a share of the replicas, not all of any record's.

    python benchmarks/bench_dht.py            # N = 16, 64, 128
    python benchmarks/bench_dht.py --quick    # N = 16, 64; fewer searches
"""
from __future__ import annotations

import argparse
import csv
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dmoe.client.beam_search import PrefixCache, beam_search, brute_force_top_k  # noqa: E402
from dmoe.dht import DHT, DHTConfig  # noqa: E402
from dmoe.launch import Proc, processes  # noqa: E402
from dmoe.uid import grid_uids  # noqa: E402
from options import RESULTS  # noqa: E402  (benchmarks/)

FIELDS = ["nodes", "phase", "searches", "batch", "k", "p50_ms", "p95_ms", "max_ms", "success_rate", "load_avg"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_searches(client: DHT, alive: dict[str, str], args: argparse.Namespace, batch: int, seed: int,
                 searches: int, cache: PrefixCache | None = None) -> tuple[list[float], float]:
    generator = torch.Generator().manual_seed(seed)
    latencies, successes = [], 0
    for _ in range(searches):
        scores = [torch.randn(batch, size, generator=generator) for size in args.grid]
        start = time.perf_counter()
        try:
            found = beam_search(client, "ffn0", scores, args.k, cache=cache)
        except Exception as error:  # a failed search counts as a failure, not a crash of the benchmark
            logging.warning("beam search failed: %r", error)
            found = None
        latencies.append(time.perf_counter() - start)
        successes += found == brute_force_top_k(alive, "ffn0", scores, args.k)
    return latencies, successes / searches


def row(nodes: int, phase: str, batch: int, latencies: list[float], success: float, args: argparse.Namespace) -> dict:
    return {"nodes": nodes, "phase": phase, "searches": len(latencies), "batch": batch, "k": args.k,
            "p50_ms": round(1000 * statistics.median(latencies), 1),
            "p95_ms": round(1000 * percentile(latencies, 0.95), 1),
            "max_ms": round(1000 * max(latencies), 1), "success_rate": round(success, 3),
            "load_avg": round(os.getloadavg()[0], 2)}


def bench(nodes: int, args: argparse.Namespace) -> list[dict]:
    common = ["--log-level", "ERROR", "--rpc-timeout", str(args.rpc_timeout),
              "--num-replicas", str(args.num_replicas), "--read-width", str(args.read_width)]
    rows, cols = args.grid
    with processes() as procs:
        def start(*extra: str, program: str = "dmoe.dht") -> Proc:
            procs.append(Proc(["-m", program, *common, *extra]))
            return procs[-1]

        boot = start()
        peer = boot.endpoint()
        members, remaining = [], nodes - 1
        while remaining > 0:
            count = min(args.nodes_per_process, remaining)
            members.append((start("--initial-peers", peer, "--num-nodes", str(count)), count))
            remaining -= count
        member_endpoints = [proc.endpoint(timeout=120) for proc, _ in members]
        quarter = cols // 4
        alive = {}
        declarers = []
        for i in range(4):
            endpoint = f"127.0.0.1:{9000 + i}"
            declarers.append(start("--initial-peers", member_endpoints[i % len(members)], "--declare",
                                   f"ffn0.[0:{rows}].[{i * quarter}:{(i + 1) * quarter}]", "--endpoint", endpoint,
                                   "--refresh-period", str(args.refresh_period),
                                   "--expiration", str(10 * args.refresh_period), program="dmoe.directory"))
            alive.update({uid: endpoint for uid in grid_uids("ffn0", (rows, cols))
                          if i * quarter <= int(uid.split(".")[2]) < (i + 1) * quarter})
        for proc in declarers:
            proc.endpoint(timeout=120)
        # every node verifies the entries stored on it: let that burst (and the nodes' start-up) finish first, so
        # the searches are timed on a settled swarm rather than inside the declaration storm
        time.sleep(args.settle)
        with DHT([peer], config=DHTConfig(rpc_timeout=args.rpc_timeout, num_replicas=args.num_replicas,
                                              read_width=args.read_width)) as client:
            run_searches(client, alive, args, max(args.batch), seed=0, searches=3)  # warm-up: routing table
            results = []
            for batch in args.batch:
                latencies, success = run_searches(client, alive, args, batch, seed=batch, searches=args.searches)
                results.append(row(nodes, "before_kill", batch, latencies, success, args))
            cache = PrefixCache(ttl=args.cache_ttl)
            run_searches(client, alive, args, max(args.batch), seed=99, searches=3, cache=cache)  # fill the cache
            latencies, success = run_searches(client, alive, args, max(args.batch), seed=100,
                                              searches=args.searches, cache=cache)
            results.append(row(nodes, "before_kill_cached", max(args.batch), latencies, success, args))
            killed = 0
            for proc, count in members:  # the bootstrap node, the declarers and this client stay up
                if killed + count > nodes // 2:
                    continue
                proc.kill()
                killed += count
            for batch in sorted(args.batch, reverse=True):  # the largest batch meets the freshest damage
                latencies, success = run_searches(client, alive, args, batch, seed=1000 + batch,
                                                  searches=args.searches)
                results.append(row(nodes, f"after_killing_{killed}", batch, latencies, success, args))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--nodes-per-process", type=int, default=8)
    parser.add_argument("--grid", type=int, nargs="+", default=[64, 64])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="rows per beam search")
    parser.add_argument("--cache-ttl", type=float, default=30.0, help="PrefixCache TTL for the cached phase")
    parser.add_argument("--searches", type=int, default=50, help="timed beam searches per phase")
    parser.add_argument("--rpc-timeout", type=float, default=DHTConfig.rpc_timeout)
    parser.add_argument("--num-replicas", type=int, default=DHTConfig.num_replicas)
    parser.add_argument("--read-width", type=int, default=DHTConfig.read_width,
                        help="closest responding nodes a lookup merges (client and nodes)")
    parser.add_argument("--refresh-period", type=float, default=60.0,
                        help="declarers' refresh period (long: the after-kill phase sees no owner refresh)")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds between the declarers' first declaration and the first timed search")
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory for the CSV")
    parser.add_argument("--quick", action="store_true", help="N = 16, 64 and 20 searches per phase")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.searches = [16, 64], 20
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    results = []
    for nodes in args.nodes:
        results.extend(bench(nodes, args))
        for result in results:
            if result["nodes"] == nodes:
                print("  ".join(f"{key}={result[key]}" for key in FIELDS), flush=True)
    print()
    print(f"{'nodes':>6} {'phase':<20} {'batch':>5} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'success':>8} "
          f"{'load':>5}")
    for r in results:
        print(f"{r['nodes']:>6} {r['phase']:<20} {r['batch']:>5} {r['p50_ms']:>8} {r['p95_ms']:>8} {r['max_ms']:>8} "
              f"{r['success_rate']:>8} {r['load_avg']:>5}")
    print(f"(load: 1-minute load average of this machine's {os.cpu_count()} cores when the phase ended; "
          "every node, declarer and the client share them)")
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "bench_dht.csv"
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
