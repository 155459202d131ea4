"""Soak: 64 concurrent clients call forward and backward on a local swarm for minutes; 0 errors, flat memory.

Each client is a thread in this process looping over random experts of the grid: a forward, then a backward with
the output's gradient, each with a deadline. Every ``--sample`` seconds the servers' RSS is recorded. Reported:
calls made, errors (any status but OK), latency percentiles, and the servers' memory at the start of the second
minute (after warm-up) against the end.

    python benchmarks/bench_soak.py --minutes 10        # the issue's figure
    python benchmarks/bench_soak.py --minutes 1         # a quick look
"""
from __future__ import annotations

import argparse
import collections
import csv
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dmoe.client.remote_expert import backward_future, forward_future  # noqa: E402
from dmoe.launch import LocalSwarm, SwarmConfig  # noqa: E402
from dmoe.uid import expand_pattern  # noqa: E402
from options import RESULTS  # noqa: E402  (benchmarks/)
from tests.fuzzing import rss_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16, help="rows per request")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of each call")
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory for the CSV")
    args = parser.parse_args()

    config = SwarmConfig(layers=("soak",), grid=(4, 4), n_servers=args.servers, hidden_dim=args.hidden,
                         server_args=["--optimizer", "sgd", "--lr", "1e-4", "--torch-threads", "1",
                                      "--log-level", "WARNING"])
    calls, errors, latencies = collections.Counter(), collections.Counter(), []
    lock, stop = threading.Lock(), threading.Event()
    memory: list[tuple[float, int]] = []

    with LocalSwarm(config) as swarm:
        owner = {uid: endpoint for server, endpoint in zip(swarm.servers, swarm.server_endpoints)
                 for uid in expand_pattern(server.args[server.args.index("--experts") + 1])}
        uids = sorted(owner)
        pids = [server.popen.pid for server in swarm.servers]

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                uid = rng.choice(uids)
                x = torch.randn(args.rows, args.hidden)
                started = time.perf_counter()
                try:
                    y = forward_future(owner[uid], uid, [x], timeout=args.timeout).result()[0]
                    backward_future(owner[uid], uid, [x], [torch.randn_like(y)], timeout=args.timeout).result()
                    outcome = None
                except Exception as error:
                    outcome = f"{type(error).__name__}: {str(error)[:120]}"
                with lock:
                    calls["forward+backward"] += 1
                    latencies.append(time.perf_counter() - started)
                    if outcome is not None:
                        errors[outcome] += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        end = began + 60 * args.minutes
        while (now := time.monotonic()) < end:
            memory.append((now - began, sum(rss_bytes(pid) for pid in pids)))
            print(f"t={now - began:6.0f}s calls {calls['forward+backward']:>8,} errors {sum(errors.values())} "
                  f"servers' RSS {memory[-1][1] / 2**20:.0f} MiB", flush=True)
            time.sleep(min(args.sample, max(end - now, 0.01)))
        stop.set()
        for thread in threads:
            thread.join(args.timeout * 2 + 5)
        memory.append((time.monotonic() - began, sum(rss_bytes(pid) for pid in pids)))
        alive = all(server.alive for server in swarm.servers)
        elapsed = time.monotonic() - began

    warm = next((rss for t, rss in memory if t >= min(60.0, elapsed / 2)), memory[0][1])
    final = memory[-1][1]
    lat = sorted(latencies)
    pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: float("nan"))
    total = calls["forward+backward"]
    print(f"\n{args.clients} clients, {elapsed / 60:.1f} min: {total:,} forward+backward pairs "
          f"({total / elapsed:,.0f}/s), errors {sum(errors.values())}; latency ms p50 {pct(0.5):.0f} "
          f"p99 {pct(0.99):.0f} max {pct(1.0):.0f}; servers alive: {alive}")
    print(f"servers' RSS: start {memory[0][1] / 2**20:.0f} MiB, after warm-up {warm / 2**20:.0f} MiB, "
          f"end {final / 2**20:.0f} MiB ({(final - warm) / 2**20:+.1f} MiB since warm-up)"
          + (f"; mean latency {statistics.mean(lat) * 1000:.0f} ms" if lat else ""))
    for error, n in errors.most_common(5):
        print(f"  {n} x {error}")
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"soak_{time.strftime('%Y%m%d-%H%M%S')}.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["seconds", "servers_rss_bytes"])
        writer.writerows((round(t, 1), rss) for t, rss in memory)
    print(f"wrote {path}")
    ok = alive and not errors and total > 0 and final - warm < 64 * 2**20
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
