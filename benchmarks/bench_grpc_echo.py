"""What gRPC's Python transport costs per byte on one host, next to a memcpy: the figure behind the shared-memory
path of dmoe/wire/shared_memory.py.

A gRPC server in this process echoes raw bytes (no protobuf: identity serializers); a client on loopback sends a
payload and waits for it back, one call at a time. The same payload is then copied with numpy.

    python benchmarks/bench_grpc_echo.py                 # 8 MiB, 30 round trips
    python benchmarks/bench_grpc_echo.py --mib 1 --calls 100
"""
from __future__ import annotations

import argparse
import csv
import statistics
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

from options import RESULTS  # benchmarks/


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=8.0, help="payload size in MiB")
    parser.add_argument("--calls", type=int, default=30, help="timed round trips (and copies)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="directory for the CSV (default: the checkout's results/)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    size = int(args.mib * 2**20)
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request,
                                               request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {"echo": echo})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_unary("/bench.Echo/echo")
            payload = np.random.default_rng(0).bytes(size)
            for _ in range(3):
                assert call(payload, timeout=60) == payload
            trips = []
            for _ in range(args.calls):
                started = time.perf_counter()
                call(payload, timeout=60)
                trips.append(time.perf_counter() - started)
    finally:
        server.stop(None)
    source, target = np.frombuffer(payload, np.uint8), np.empty(size, np.uint8)
    copies = []
    for _ in range(args.calls):
        started = time.perf_counter()
        np.copyto(target, source)
        copies.append(time.perf_counter() - started)
    trip, copy = statistics.median(trips), statistics.median(copies)
    args.results.mkdir(parents=True, exist_ok=True)
    with (args.results / "bench_grpc_echo.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["bytes", "calls", "round_trip_ms", "memcpy_ms", "memcpys_per_round_trip"])
        writer.writerow([size, args.calls, round(trip * 1e3, 4), round(copy * 1e3, 4), round(trip / copy, 1)])
    print(f"{args.mib:g} MiB: gRPC round trip {trip * 1e3:.2f} ms ({2 * size / trip / 1e9:.2f} GB/s both ways), "
          f"memcpy {copy * 1e3:.2f} ms; a round trip costs {trip / copy:.0f} memcpys (medians of {args.calls})")


if __name__ == "__main__":
    main()
