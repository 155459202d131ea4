"""Decentralized averaging: all-reduce speed against one gRPC stream, and Moshpit convergence with failures.

1. The limit: 25M float32 (100 MB) through one gRPC stream from one process to another, in the pieces the
   averager sends (encoded, then decoded into a buffer on the other side, as an owner does).
2. All-reduce: 2, 4, 8 and 16 peer processes, each with its own DHT node and 25M float32, start together and
   average as one group (``DecentralizedAverager.step``) for ``--rounds`` rounds. Seconds per round (the slowest
   peer's all-reduce, the median over rounds) and bandwidth per peer: in a butterfly all-reduce each peer sends (and
   receives) ``2 (n-1)/n`` times the tensor's bytes, which over the round's seconds is its effective bandwidth, set
   next to the limit. On one machine every peer process competes for the same cores, which are then the "link":
   the aggregate column (all peers' bandwidth over the limit) says how much of the machine's single-stream
   throughput the group used.
3. The same with every peer's uplink paced to ``--uplink-MBps`` (``AveragerConfig.max_send_rate``; the limit
   is then one stream paced alike): the regime of peers on their own machines, where the link, not the CPU, is
   the bottleneck. ``--paced-peers`` counts, 0 to skip.
4. Moshpit: 16 peers on a 4x4 grid (threads in ``--moshpit-processes`` processes, each peer with its own DHT node
   and gRPC server), each with its own random vector, one round per time slot (``--slot`` seconds, as a trainer
   that averages every so often). After each round, the spread around the true mean relative to the spread
   before averaging: sqrt(sum_i |x_i - mean|^2 / sum_i |x_i(0) - mean|^2). With a failure rate p, ceil(p x peers)
   peers drawn at random (seeded) sit out each round: they keep their values and coordinates. Next to it, the same
   plan simulated with perfectly timed rounds (numpy, no network): what the algorithm itself gives.

    python benchmarks/bench_averaging.py                       # the full run
    python benchmarks/bench_averaging.py --numel 200000 --peers 2 4 --rounds 1 --paced-peers 0 --moshpit-rounds 2

The last line reads ``peers8_round_s=... peers8_fraction_of_limit=... moshpit16_err_after_2=...`` (unpaced).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import csv
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dmoe import DHT, AveragerConfig, DecentralizedAverager  # noqa: E402
from dmoe.averaging.allreduce import SendPace, decode_piece  # noqa: E402
from dmoe.averaging.grid import check_coordinates  # noqa: E402
from dmoe.launch import Proc, processes  # noqa: E402
from dmoe.wire import STREAM_PART_BYTES, dmoe_pb2, dmoe_pb2_grpc, grpc_options  # noqa: E402
from dmoe.wire.codec import serialize  # noqa: E402
from options import RESULTS  # noqa: E402  (benchmarks/)

SCRIPT = str(Path(__file__).resolve())


def vector(index: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + index))


# --- the limit: one stream between two processes -------------------------------------------------------------

class Sink(dmoe_pb2_grpc.AveragingServiceServicer):
    """Receives a stream of pieces the way an owner does (decoded into its buffer) and answers once."""

    async def reduce(self, request_iterator, context):
        buffer, filled = None, 0
        async for message in request_iterator:
            if buffer is None:
                buffer = torch.empty(int(message.weight), dtype=torch.float32)  # the sender says the length
            piece = decode_piece(message.values, buffer.numel() - filled)
            buffer[filled:filled + piece.numel()] = piece
            filled += piece.numel()
        yield dmoe_pb2.AveragedPart(total_weight=filled)


async def serve_sink() -> None:
    server = grpc.aio.server(options=grpc_options())
    dmoe_pb2_grpc.add_AveragingServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"sink listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


async def stream_to(endpoint: str, numel: int, repeats: int, rate: float) -> list[float]:
    values = vector(0, numel)
    piece_elements = STREAM_PART_BYTES // 4
    seconds = []
    pace = SendPace(rate)
    async with grpc.aio.insecure_channel(endpoint, options=grpc_options()) as channel:
        stub = dmoe_pb2_grpc.AveragingServiceStub(channel)
        for _ in range(repeats + 1):  # the first one warms the connection up
            async def requests():
                for start in range(0, numel, piece_elements):  # encoded as the averager encodes its pieces
                    message = dmoe_pb2.AveragingPart(weight=numel)
                    serialize(values[start:start + piece_elements], out=message.values)
                    await pace.wait(message.ByteSize())
                    yield message
            began = time.perf_counter()
            async for reply in stub.reduce(requests(), timeout=600):
                assert reply.total_weight == numel
            seconds.append(time.perf_counter() - began)
    return seconds[1:]


def single_stream_limits(numel: int, runs: list[tuple[int, float]]) -> list[float]:
    """Bytes per second through one gRPC stream between two processes, for each ``(repeats, rate)`` of ``runs`` in
    turn: the median of ``repeats`` streams, their sender paced to ``rate`` bytes per second (0: as fast as it goes).
    One sink and one source process serve every run (each run on a connection of its own, warmed up first)."""
    with processes() as procs:
        procs.append(Proc([SCRIPT, "--role", "sink"]))
        endpoint = procs[0].wait_for(r"listening on (\S+)").group(1)
        procs.append(Proc([SCRIPT, "--role", "source", "--endpoint", endpoint, "--numel", str(numel),
                           "--limit-runs", json.dumps(runs)]))
        runs_seconds = [json.loads(procs[1].wait_for(r"^seconds (.*)", timeout=600).group(1)) for _ in runs]
    return [numel * 4 / statistics.median(seconds) for seconds in runs_seconds]


# --- peers ---------------------------------------------------------------------------------------------------

def run_peers(args: argparse.Namespace) -> None:
    """``--role peers``: averagers with their own DHT nodes, one thread each; prints one JSON line per round."""
    indices = args.indices
    grid = tuple(args.grid)
    skip = json.loads(args.skip)  # round -> indices that sit it out
    config = AveragerConfig(target_group_size=args.target, grid=grid, matchmaking_time=args.matchmaking_time,
                            allreduce_timeout=args.allreduce_timeout, poll_period=0.1,
                            max_send_rate=args.max_send_rate)
    with concurrent.futures.ThreadPoolExecutor(len(indices)) as pool:  # each may wait out dead contacts
        dhts = list(pool.map(lambda _: DHT(initial_peers=[args.initial_peers]), indices))
    cells = [None] * len(indices)
    if grid:
        cells = [check_coordinates(grid, [(i // math.prod(grid[d + 1:])) % grid[d] for d in range(len(grid))])
                 for i in indices]
    averagers = [DecentralizedAverager([vector(i, args.numel)], dht, args.prefix, config, coordinates=cell)
                 for i, dht, cell in zip(indices, dhts, cells)]
    mean = None
    if args.check:  # every peer's start is known from its index: the true mean, computed here
        mean = sum(vector(i, args.numel) for i in range(args.total)) / args.total
    lock = threading.Lock()
    print("ready", flush=True)
    start_file = Path(args.start_file)
    while not start_file.exists():  # every peer of the run is up: the main process writes the start time
        time.sleep(0.05)
    started = json.loads(start_file.read_text())["t0"]

    def run(index: int, averager: DecentralizedAverager) -> None:
        for round_number in range(args.rounds):
            time.sleep(max(0.0, started + round_number * args.slot - time.time()))
            if index in skip.get(str(round_number), []):
                averager.round += 1  # sits this round out, keeps its values and coordinates
                info = None
            else:
                info = averager.step()
            line = {"round": round_number, "index": index, "peer_id": averager.peer_id, "averaged": info is not None,
                    "allreduce_s": info.allreduce_s if info else None,
                    "matchmaking_s": info.matchmaking_s if info else None,
                    "members": len(info.members) if info else 0}
            if mean is not None:
                line["err2"] = float((averager.tensors[0] - mean).pow(2).sum())
            with lock:
                print("round " + json.dumps(line), flush=True)

    threads = [threading.Thread(target=run, args=pair) for pair in zip(indices, averagers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for averager in averagers:
        averager.shutdown()
    for dht in dhts:
        dht.close()
    print("peers done", flush=True)


def start_peers(initial_peers: str, prefix: str, indices: list[int], args: argparse.Namespace, *, numel: int,
                rounds: int, target: int, total: int, start_file: Path, grid=(), skip=None, check=False,
                slot: float = 0.0, rate: float = 0.0) -> Proc:
    command = [SCRIPT, "--role", "peers", "--initial-peers", initial_peers, "--prefix", prefix, "--numel", str(numel),
               "--rounds", str(rounds), "--target", str(target), "--total", str(total),
               "--matchmaking-time", str(args.matchmaking_time), "--allreduce-timeout", str(args.allreduce_timeout),
               "--skip", json.dumps(skip or {}), "--start-file", str(start_file), "--slot", str(slot),
               "--max-send-rate", str(rate), "--indices", *map(str, indices)]
    if grid:
        command += ["--grid", *map(str, grid)]
    if check:
        command.append("--check")
    return Proc(command, env={"OMP_NUM_THREADS": "1"})


def start_together(procs: list[Proc], start_file: Path) -> None:
    """Waits until every peer process is up, then tells them all to begin (a common start, not a fixed sleep)."""
    for proc in procs:
        proc.wait_for("^ready", timeout=600)
    temporary = start_file.with_suffix(".tmp")
    temporary.write_text(json.dumps({"t0": time.time() + 0.5}))
    temporary.rename(start_file)


def rounds_of(procs: list[Proc], timeout: float) -> list[dict]:
    lines = []
    for proc in procs:
        proc.wait_for("^peers done", timeout=timeout)
        lines += [json.loads(line[len("round "):]) for line in proc.output if line.startswith("round ")]
    return lines


def allreduce_row(peers: int, limit: float, dht: DHT, args: argparse.Namespace, rate: float = 0.0) -> dict:
    start_file = args.work / f"start-ar{peers}-{int(rate)}.json"
    with processes() as procs:
        procs += [start_peers(dht.endpoint, f"ar{peers}-{int(rate)}", [i], args, numel=args.numel,
                              rounds=args.rounds, target=peers, total=peers, start_file=start_file, rate=rate)
                  for i in range(peers)]
        start_together(procs, start_file)
        lines = rounds_of(procs, timeout=1800)
    failed = [line for line in lines if not line["averaged"]]
    if failed:
        logging.warning("%d of %d peer-rounds did not average", len(failed), len(lines))
    per_round = [max(line["allreduce_s"] for line in lines if line["round"] == r and line["averaged"])
                 for r in range(args.rounds) if any(line["averaged"] for line in lines if line["round"] == r)]
    round_s = statistics.median(per_round)
    per_peer = 2 * (peers - 1) / peers * args.numel * 4 / round_s
    return {"peers": peers, "uplink_MBps": round(rate / 1e6, 1) if rate else "-", "numel": args.numel,
            "rounds": len(per_round), "round_s": round(round_s, 3),
            "peer_MBps": round(per_peer / 1e6, 1), "limit_MBps": round(limit / 1e6, 1),
            "fraction_of_limit": round(per_peer / limit, 3), "aggregate_fraction": round(peers * per_peer / limit, 3),
            "failed_peer_rounds": len(failed), "load_avg": round(os.getloadavg()[0], 2)}


def moshpit_rows(fail_rate: float, dht: DHT, args: argparse.Namespace) -> list[dict]:
    total = math.prod(args.moshpit_grid)
    rng = random.Random(args.seed)
    out_per_round = math.ceil(fail_rate * total)  # 10% of 16: 2 peers (12.5%) sit out every round
    skip = {str(r): sorted(rng.sample(range(total), out_per_round)) for r in range(args.moshpit_rounds)}
    split = [list(range(total))[p::args.moshpit_processes] for p in range(args.moshpit_processes)]
    start_file = args.work / f"start-mosh{int(fail_rate * 100)}.json"
    with processes() as procs:
        procs += [start_peers(dht.endpoint, f"mosh{int(fail_rate * 100)}", indices, args, numel=args.moshpit_numel,
                              rounds=args.moshpit_rounds, target=max(args.moshpit_grid), total=total,
                              start_file=start_file, grid=args.moshpit_grid, skip=skip, check=True, slot=args.slot)
                  for indices in split]
        start_together(procs, start_file)
        lines = rounds_of(procs, timeout=1800)
    vectors = [vector(i, args.moshpit_numel) for i in range(total)]
    mean = sum(vectors) / total
    start = sum(float((v - mean).pow(2).sum()) for v in vectors)
    ids = {(line["round"], line["index"]): line["peer_id"] for line in lines}  # a peer's id is new each round
    simulated = simulate_moshpit(vectors, args.moshpit_grid, skip, args.moshpit_rounds, ids)
    rows = []
    for r in range(args.moshpit_rounds):
        done = [line for line in lines if line["round"] == r]
        error = math.sqrt(sum(line["err2"] for line in done) / start)
        rows.append({"grid": "x".join(map(str, args.moshpit_grid)), "fail_rate": fail_rate, "round": r + 1,
                     "sat_out": len(skip[str(r)]), "averaged": sum(line["averaged"] for line in done),
                     "relative_error": error, "simulated_error": simulated[r]})
    return rows


def simulate_moshpit(vectors: list[torch.Tensor], grid: list[int], skip: dict[str, list[int]], rounds: int,
                     ids: dict[tuple[int, int], int]) -> list[float]:
    """The same plan with perfectly timed rounds: each key's waiting peers in groups of the grid's side (by their
    peer ids in the round, ``ids[round, index]``, as leaders take them), averaged, ranks becoming coordinates. What
    the algorithm gives without the network."""
    x = torch.stack(vectors).double()
    mean = x.mean(0)
    start = float((x - mean).pow(2).sum())
    cells = [[(i // math.prod(grid[d + 1:])) % grid[d] for d in range(len(grid))] for i in range(len(vectors))]
    side, errors = max(grid), []
    for r in range(rounds):
        free = r % len(grid)
        keys: dict[tuple, list[int]] = {}
        for i, cell in enumerate(cells):
            if i not in skip[str(r)]:
                keys.setdefault(tuple(c for d, c in enumerate(cell) if d != free), []).append(i)
        for members in keys.values():
            members.sort(key=lambda i: ids[r, i])
            for group in (members[k:k + side] for k in range(0, len(members), side)):
                if len(group) >= 2:
                    x[group] = x[group].mean(0)
                    for rank, i in enumerate(group):
                        cells[i][free] = rank % grid[free]
        errors.append(math.sqrt(float((x - mean).pow(2).sum()) / start))
    return errors


def print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    widths = [max(len(k), *(len(f"{row[k]:.3g}" if k.endswith("_error") else str(row[k])) for row in rows))
              for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for row in rows:
        cells = [f"{row[k]:.3g}" if k.endswith("_error") else str(row[k]) for k in keys]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)))


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=25_000_000, help="float32 values each peer averages")
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3, help="all-reduce rounds per peer count")
    parser.add_argument("--limit-repeats", type=int, default=3)
    parser.add_argument("--moshpit-grid", type=int, nargs="+", default=[4, 4])
    parser.add_argument("--moshpit-numel", type=int, default=100_000)
    parser.add_argument("--moshpit-rounds", type=int, default=4)
    parser.add_argument("--moshpit-processes", type=int, default=2)
    parser.add_argument("--fail-rates", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--uplink-MBps", type=float, default=20.0, help="pace of every peer's sends in part 3")
    parser.add_argument("--paced-peers", type=int, nargs="+", default=[2, 4, 8], help="part 3's counts; 0: skip")
    parser.add_argument("--slot", type=float, default=5.0, help="seconds between Moshpit rounds' starts")
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--allreduce-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory for the CSVs")
    # internal: the processes this script starts
    parser.add_argument("--role", choices=["main", "sink", "source", "peers"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--indices", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--target", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grid", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--start-file", help=argparse.SUPPRESS)
    parser.add_argument("--max-send-rate", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--limit-runs", default="[]", help=argparse.SUPPRESS)  # the source's [[repeats, rate], ...]
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role == "sink":
        asyncio.run(serve_sink())
        return
    if args.role == "source":
        for repeats, rate in json.loads(args.limit_runs):
            seconds = asyncio.run(stream_to(args.endpoint, args.numel, repeats, rate))
            print("seconds " + json.dumps(seconds), flush=True)
        return
    if args.role == "peers":
        run_peers(args)
        return

    paced_peers = [n for n in args.paced_peers if n > 0]
    rate = args.uplink_MBps * 1e6
    runs = [(args.limit_repeats, 0.0)] + ([(1, rate)] if paced_peers else [])  # the paced one once: it is slow
    limit, paced_limit = (single_stream_limits(args.numel, runs) + [0.0])[:2]
    print(f"single gRPC stream between two processes: {args.numel * 4 / 1e6:.0f} MB at {limit / 1e6:.1f} MB/s")
    if paced_peers:
        print(f"the same stream paced to {args.uplink_MBps:g} MB/s: {paced_limit / 1e6:.1f} MB/s")
    with tempfile.TemporaryDirectory() as work, DHT() as dht:
        args.work = Path(work)
        rows = []
        for peers in args.peers:
            rows.append(allreduce_row(peers, limit, dht, args))
            print(f"all-reduce among {peers}: {rows[-1]['round_s']} s/round", file=sys.stderr, flush=True)
        paced = []
        for peers in paced_peers:
            paced.append(allreduce_row(peers, paced_limit, dht, args, rate=rate))
            print(f"paced all-reduce among {peers}: {paced[-1]['round_s']} s/round", file=sys.stderr, flush=True)
        mosh = []
        for fail_rate in args.fail_rates:
            mosh += moshpit_rows(fail_rate, dht, args)
    print("\nall-reduce (one group, one round; bandwidth per peer = 2(n-1)/n x bytes / round_s)")
    print_table(rows)
    if paced:
        print(f"\nthe same, every peer's sends paced to {args.uplink_MBps:g} MB/s (limit: one stream paced alike)")
        print_table(paced)
    print(f"\nMoshpit averaging, grid {'x'.join(map(str, args.moshpit_grid))}: spread around the true mean after each "
          "round, relative to the start")
    print_table(mosh)
    write_csv(args.results / "bench_averaging.csv", rows + paced)
    write_csv(args.results / "bench_averaging_moshpit.csv", mosh)
    headline = next((r for r in rows if r["peers"] == 8), rows[-1])
    total = math.prod(args.moshpit_grid)
    after = next((r for r in mosh if r["fail_rate"] == 0 and r["round"] == 2), mosh[-1])
    if paced:
        row = next((r for r in paced if r["peers"] == 8), paced[-1])
        print(f"paced to {args.uplink_MBps:g} MB/s: peers{row['peers']}_round_s={row['round_s']} "
              f"peers{row['peers']}_fraction_of_paced_limit={row['fraction_of_limit']}")
    failing = [r for r in mosh if r["fail_rate"] > 0]
    if failing:
        row = failing[-1]
        print(f"with {row['sat_out']} of {total} peers out per round: error after {row['round']} rounds "
              f"{row['relative_error']:.3g} (simulated with perfect timing: {row['simulated_error']:.3g})")
    print(f"peers{headline['peers']}_round_s={headline['round_s']} "
          f"peers{headline['peers']}_fraction_of_limit={headline['fraction_of_limit']} "
          f"moshpit{total}_err_after_{after['round']}={after['relative_error']:.3g}")


if __name__ == "__main__":
    main()
