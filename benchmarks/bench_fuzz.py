"""Fuzz one real ``dmoe-server`` with tens of thousands of hostile cases and count what it answered.

The cases are tests/fuzzing.py's hypothesis strategies (junk in every field of a request, mutated valid requests,
random bytes as the serialized message, streams of junk; a third of the unary ones through shared memory), plus raw
junk written to the gRPC TCP port. Claims checked: zero server crashes, every case answered with a clear status before
its deadline, the server's memory (RSS) bounded, and valid requests still answered correctly afterwards (compared with
a local copy of the expert, which the fuzzer never trains).

    python benchmarks/bench_fuzz.py                  # 10,000 cases + 1,000 raw TCP junk streams
    python benchmarks/bench_fuzz.py --cases 50000
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys
import time
from pathlib import Path

import grpc
import torch
from hypothesis import HealthCheck, given, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dmoe.client.remote_expert import forward_future  # noqa: E402
from dmoe.experts import create_expert, expert_seed  # noqa: E402
from dmoe.launch import Proc  # noqa: E402
from dmoe.wire import grpc_options  # noqa: E402
from options import RESULTS  # noqa: E402  (benchmarks/)
from tests import fuzzing  # noqa: E402

HIDDEN, MAX_BATCH = 8, 32
TARGET = fuzzing.Target(uids=("fz.0", "fz.1"), hidden=HIDDEN, max_batch=MAX_BATCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000, help="gRPC fuzz cases")
    parser.add_argument("--tcp-junk", type=int, default=1_000, help="raw junk streams on the TCP port")
    parser.add_argument("--rss-bound-mib", type=float, default=128.0,
                        help="fail when the server's RSS grows by more than this after warm-up")
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory for the CSV")
    parser.add_argument("--quick", action="store_true", help="300 cases and 50 junk streams: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.cases, args.tcp_junk = 300, 50

    server = Proc(["-m", "dmoe.cli.server", "--experts", "fz.[0:2]", "--expert-cls", "ffn",
                   "--hidden-dim", str(HIDDEN), "--max-batch-size", str(MAX_BATCH), "--max-message-bytes",
                   str(64 * 1024), "--optimizer", "sgd", "--torch-threads", "1", "--log-level", "ERROR"],
                  env={"OMP_NUM_THREADS": "1"})
    counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
    problems: list[str] = []
    rss_samples: list[tuple[int, int]] = []
    try:
        endpoint = server.endpoint()
        pid = server.popen.pid
        x = torch.randn(MAX_BATCH, HIDDEN)
        forward_future(endpoint, "fz.1", [x]).result(timeout=60)
        channel = grpc.insecure_channel(endpoint, options=grpc_options(16 * 1024 * 1024))
        started = time.perf_counter()
        done = 0

        @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=fuzzing.cases(TARGET))
        def fuzz(case):
            nonlocal done
            case = fuzzing.spare(case, "fz.1")  # fz.1 stays untrained: the reference for correctness afterwards
            code, details, response = fuzzing.send(channel, case)
            counts[(case.rpc, case.kind, code.name)] += 1
            problem = fuzzing.check_outcome(case, code, details, response, TARGET)
            if problem is not None:
                problems.append(problem)
            done += 1
            if done % 1000 == 0 or done == 1:
                rss_samples.append((done, fuzzing.rss_bytes(pid)))
                print(f"{done:>7,} cases, {time.perf_counter() - started:6.1f}s, server RSS "
                      f"{rss_samples[-1][1] / 2**20:.0f} MiB", flush=True)

        fuzz()
        fuzz_seconds = time.perf_counter() - started
        tcp_endings = collections.Counter(fuzzing.junk_on_tcp(endpoint, junk)
                                          for junk in fuzzing.junk_streams(seed=1, count=args.tcp_junk))
        rss_samples.append((done, fuzzing.rss_bytes(pid)))
        alive = server.alive
        with torch.no_grad():
            expected = create_expert("ffn", HIDDEN, seed=expert_seed(0, "fz.1")).eval()(x)
        correct = alive and torch.allclose(forward_future(endpoint, "fz.1", [x]).result(timeout=60)[0], expected,
                                           atol=1e-5, rtol=1e-4)
        trained = forward_future(endpoint, "fz.0", [x]).result(timeout=60)[0] if alive else None
        trained_finite = trained is not None and bool(torch.isfinite(trained).all())
        channel.close()
    finally:
        server.stop()

    print(f"\n{done:,} gRPC cases in {fuzz_seconds:.1f}s ({done / fuzz_seconds:,.0f}/s); statuses:")
    by_code = collections.Counter()
    for (rpc, kind, code), n in sorted(counts.items()):
        by_code[code] += n
        print(f"  {rpc:16} {kind:13} {code:20} {n:>7,}")
    print("  totals: " + ", ".join(f"{code} {n:,}" for code, n in by_code.most_common()))
    print(f"raw TCP junk: {args.tcp_junk:,} streams, endings {dict(tcp_endings)}")
    growth = (rss_samples[-1][1] - rss_samples[0][1]) / 2**20
    print(f"server RSS {rss_samples[0][1] / 2**20:.0f} -> {rss_samples[-1][1] / 2**20:.0f} MiB "
          f"(growth {growth:+.1f} MiB, bound {args.rss_bound_mib:.0f})")
    print(f"server alive: {alive}; reference expert correct afterwards: {correct}; fuzzed expert finite: "
          f"{trained_finite}; unclear or malformed answers: {len(problems):,}")
    for problem in problems[:20]:
        print("  " + problem)
    if len(problems) > 20:
        print(f"  ... and {len(problems) - 20:,} more")

    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"fuzz_{time.strftime('%Y%m%d-%H%M%S')}.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["rpc", "kind", "status", "count"])
        writer.writerows([*key, n] for key, n in sorted(counts.items()))
    print(f"wrote {path}")
    ok = alive and correct and trained_finite and not problems and "timeout" not in tcp_endings \
        and growth <= args.rss_bound_mib and done >= args.cases
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
