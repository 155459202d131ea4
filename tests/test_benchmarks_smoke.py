"""Fault injection against a real server process, and tiny runs of the benchmarks that time one part (latency,
layer, DHT, beam search, gRPC, throughput, averaging); those that train the language model are in
tests/test_benchmarks_training_smoke.py (what both share: tests/benchmark_runs.py).

The benchmarks' real figures come from their commands (see benchmarks/README.md); here they only have to run
and write sane CSV and PNG files, so that they never rot.
"""
from __future__ import annotations

import asyncio
import math
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import wait

import grpc
import pytest
import torch

from dmoe.cli import server as run_server
from dmoe.client import forward_future, forward_futures
from dmoe.client.remote_expert import RemoteExpertError
from dmoe.server.faults import INJECTED_FAILURE, FaultConfig, Faults, InjectedFailure
from tests.benchmark_runs import PNG_MAGIC, last_line_fields, read_csv, run_benchmark
from tests.procs import kill_tree, running


def serve(*flags: str):
    return running("-m", "dmoe.cli.server", "--experts", "ffn0.[0:2]", "--hidden-dim", "8",
                   "--torch-threads", "1", *flags)


def test_injected_latency_delays_every_call_without_serialising_them():
    with serve("--inject-latency-ms", "400") as server:
        endpoint = server.endpoint()
        x = torch.randn(2, 8)
        forward_future(endpoint, "ffn0.0", [x], timeout=30).result()  # connect and warm up
        start = time.perf_counter()
        forward_future(endpoint, "ffn0.0", [x], timeout=30).result()
        single = time.perf_counter() - start
        start = time.perf_counter()
        futures = [forward_future(endpoint, f"ffn0.{i % 2}", [x], timeout=30) for i in range(8)]
        wait(futures)
        concurrent = time.perf_counter() - start
        start = time.perf_counter()
        items = forward_futures([(f"ffn0.{i % 2}", endpoint, [x], None) for i in range(8)], timeout=30)
        wait(items)
        batched = time.perf_counter() - start
    assert all(f.exception() is None for f in futures + items)
    assert single >= 0.4
    # eight calls that each wait 0.4 s on the server's event loop overlap instead of taking 3.2 s
    assert concurrent < 2.4, f"8 concurrent calls took {concurrent:.2f} s"  # serialised: 3.2 s; slack for load
    # eight experts' requests in one batch call: their delays do not add up either
    assert 0.4 <= batched < 2.4, f"a batch call of 8 items took {batched:.2f} s"


def test_fail_rate_fails_some_calls_with_a_clear_status_and_serves_the_rest():
    with serve("--fail-rate", "0.5", "--fault-seed", "1") as server:
        endpoint = server.endpoint()
        futures = [forward_future(endpoint, "ffn0.1", [torch.randn(3, 8)], timeout=30) for _ in range(30)]
        # the items of one batch call fail or not each on its own, like calls of their own
        futures += forward_futures([("ffn0.1", endpoint, [torch.randn(3, 8)], None) for _ in range(30)], timeout=30)
        wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    assert 0 < len(errors) < len(futures)
    assert all(isinstance(e, RemoteExpertError) and e.code == grpc.StatusCode.ABORTED for e in errors)
    assert all(INJECTED_FAILURE in str(e) for e in errors)
    assert all(f.result()[0].shape == (3, 8) for f in futures if f.exception() is None)


def test_a_batch_call_waits_one_delay_and_each_item_draws_its_own_failure():
    # no jitter: the call waits exactly 1 s; a second wait per item would make it 2 s, far from a loaded machine's lag
    faults = Faults(FaultConfig(latency_ms=1000, jitter="none", fail_rate=0.5, seed=0))

    async def batch_call():  # what the servicer does for a batch call of 20 items
        start = time.perf_counter()
        await faults.wait()
        items = await asyncio.gather(*(faults.apply(delay=False) for _ in range(20)), return_exceptions=True)
        return time.perf_counter() - start, items

    seconds, items = asyncio.run(batch_call())
    assert 1.0 <= seconds < 1.9, seconds  # items that waited too would take 2 s at least
    failed = sum(isinstance(item, InjectedFailure) for item in items)
    assert 0 < failed < 20 and faults.calls == 20 and faults.failures == failed


def test_exponential_jitter_has_the_configured_mean_and_fail_rate_its_share():
    faults = Faults(FaultConfig(latency_ms=100, jitter="exponential", fail_rate=0.25, seed=0))
    draws = [faults.draw() for _ in range(4000)]
    delays = [d for d, _ in draws]
    assert math.isclose(sum(delays) / len(delays), 0.1, rel_tol=0.1)
    assert max(delays) > 0.3  # a real tail, not a constant
    assert math.isclose(sum(f for _, f in draws) / len(draws), 0.25, abs_tol=0.03)


@pytest.mark.parametrize("flags, named", [
    (["--fail-rate", "1.5"], "--fail-rate"),
    (["--inject-latency-ms", "-5"], "--inject-latency-ms"),
    (["--latency-jitter", "exponential"], "--latency-jitter"),
])
def test_bad_fault_flags_are_refused_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as exited:
        run_server.main(["--experts", "ffn0.0", "--hidden-dim", "8", *flags])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_latency_benchmark_quick_writes_sane_csv_and_png(tmp_path):
    # (half --quick's trainers, and half-length windows: every mode still completes steps in each)
    stdout = run_benchmark("bench_latency.py", "--quick", "--trainers", "4", "--window", "0.25", "--warmup", "0.1",
                           "--results", str(tmp_path))
    assert "headline: throughput at" in stdout
    rows = read_csv(tmp_path / "latency_quick.csv")
    latencies = sorted({float(r["latency_ms"]) for r in rows})
    modes = {"dmoe", "pipeline", "pipeline-mb", "pipeline-async", "shallow", "shallow-async"}
    assert {r["mode"] for r in rows} == modes
    assert len(rows) == len(latencies) * len(modes) and latencies[0] == 0 and len(latencies) >= 2
    assert all(float(r["samples_per_s"]) > 0 and float(r["expert_rows_per_s"]) > 0 for r in rows), stdout
    assert all(float(r["ratio_to_0ms"]) == 1 for r in rows if float(r["latency_ms"]) == 0)
    at_0ms = {r["mode"]: float(r["samples_per_s"]) for r in rows if float(r["latency_ms"]) == 0}
    for r in rows:  # each mode's throughput over its own at 0 ms, not the other way round or another mode's
        assert math.isclose(float(r["ratio_to_0ms"]), float(r["samples_per_s"]) / at_0ms[r["mode"]], rel_tol=1e-3,
                            abs_tol=1e-4), r
    in_flight = {r["mode"]: int(r["in_flight"]) for r in rows}
    assert in_flight["pipeline"] == in_flight["shallow"] == 1
    assert in_flight["pipeline-async"] == in_flight["shallow-async"] == in_flight["dmoe"]  # same total in flight
    hops = {r["mode"]: int(r["hops"]) for r in rows}
    assert hops["shallow"] == hops["dmoe"] <= hops["pipeline"]  # equal depth (--quick has one server: no deeper)
    assert (tmp_path / "latency_quick.png").read_bytes().startswith(PNG_MAGIC)


def test_layer_benchmark_quick_writes_sane_csv(tmp_path):
    # (a 2x2 grid: a quarter of the experts to build, step and report on, for the same checks)
    stdout = run_benchmark("bench_layer.py", "--quick", "--grid", "2", "2", "--rounds", "2", "--profile",
                           "--client-profile", "--results", str(tmp_path))
    assert "speed vs in-proc" in stdout
    assert "server stages at batch 8" in stdout and "server stages at batch 32" in stdout
    # the client's stages: every timed step sent calls and waited for them (3 steps x 2 rounds)
    client = re.search(r"client stages at batch 32 \(6 remote steps; .*?\n(.*?)\n(?:client|wrote|server)", stdout, re.S)
    assert client, stdout
    counts = {line.split()[0]: int(line.split()[2]) for line in client.group(1).splitlines()[1:]}
    assert counts["send"] == counts["wait"] == counts["bwd_send"] == counts["bwd_wait"] == 6, counts
    cache = re.search(r"activation cache over the run: (\d+) hits, \d+ misses, 0 evicted, 0 released for a batch out "
                      r"of memory; at most [\d.]+ MiB on cpu", stdout)
    assert cache and int(cache.group(1)) > 0, stdout  # backwards used their forwards' kept graphs
    rows = read_csv(tmp_path / "bench_layer.csv")
    assert [int(r["batch"]) for r in rows] == [8, 32]
    for r in rows:
        assert int(r["rounds"]) == 2 and int(r["dropped"]) == 0  # a calm local swarm answers every call
        assert 0 < float(r["ratio_min"]) <= float(r["ratio"]) <= float(r["ratio_max"])
        assert math.isclose(float(r["ratio"]), float(r["inprocess_s"]) / float(r["remote_s"]), rel_tol=0.5)
        # the ratio is the median of the rounds' own ratios (2 rounds: their mean), and those are printed
        rounds = [float(x) for x in r["ratios_per_round"].split()]
        assert len(rounds) == 2 and math.isclose(float(r["ratio"]), statistics.median(rounds), abs_tol=1e-4)
        assert math.isclose(float(r["ratio_min"]), min(rounds), abs_tol=1e-4)
        assert math.isclose(float(r["ratio_max"]), max(rounds), abs_tol=1e-4)
        printed = next(line.split() for line in stdout.splitlines() if line.split()[:1] == [r["batch"]])
        assert [float(x) for x in printed[-2:]] == [round(x, 2) for x in rounds], printed
        # no --autocast: the best in-process layer is the only one
        assert r["inprocess_fp32_s"] == "" and r["ratio_vs_best"] == r["ratio"]
        # what the server did, read from its metrics: h=64 requests are far under 64 KiB, so none used shared memory
        assert float(r["shared_memory_share"]) == 0, r
    assert "WARNING: shared memory was asked for, but no call went through it at batch 8, batch 32" in stdout
    assert "goals" not in stdout  # no goal at batches 8 and 32
    # the load of every round, printed and in the CSV (review 103 D1)
    assert re.search(r"^load \(1-minute load average .*: round 1: [\d.]+ [\d.]+; round 2: [\d.]+ [\d.]+$", stdout,
                     re.M), stdout
    assert all(len(r["load_avg_per_round"].split()) == 2 for r in rows), rows


def test_dht_benchmark_small_swarm_finds_exactly_what_brute_force_finds(tmp_path):
    run_benchmark("bench_dht.py", "--nodes", "16", "--grid", "8", "8", "--searches", "5", "--settle", "1",
                  "--results", str(tmp_path))
    rows = read_csv(tmp_path / "bench_dht.csv")
    phases = {r["phase"] for r in rows}
    assert {"before_kill", "before_kill_cached", "after_killing_8"} <= phases
    for r in rows:
        assert 0 <= float(r["p50_ms"]) <= float(r["p95_ms"]) <= float(r["max_ms"]) < 60_000
        if r["phase"].startswith("before_kill"):
            assert float(r["success_rate"]) == 1.0, r  # equal to brute force over the declared experts


def test_beam_search_benchmark_compares_the_default_and_per_row_searches_on_the_same_answers(tmp_path):
    run_benchmark("bench_beam_search.py", "--grids", "4x4", "3x3x3", "9x8", "64x64", "--batches", "8", "64",
                  "--repeats", "1", "--results", str(tmp_path))
    rows = read_csv(tmp_path / "bench_beam_search.csv")
    assert [(r["grid"], r["records"], r["batch"]) for r in rows] == [
        ("4x4", "5", "8"), ("4x4", "5", "64"), ("3x3x3", "13", "8"), ("3x3x3", "13", "64"), ("9x8", "10", "8"),
        ("9x8", "10", "64"), ("64x64", "65", "8"), ("64x64", "65", "64")]
    assert all(float(r["per_row_ms"]) > 0 for r in rows)
    assert all(float(r["default_ms"]) > 0 for r in rows[:6]) and rows[6]["default_ms"] == rows[7]["default_ms"] == ""


def test_grpc_echo_benchmark_times_a_round_trip_and_a_copy(tmp_path):
    run_benchmark("bench_grpc_echo.py", "--mib", "0.25", "--calls", "3", "--results", str(tmp_path))
    (row,) = read_csv(tmp_path / "bench_grpc_echo.csv")
    assert row["bytes"] == str(2**18) and float(row["round_trip_ms"]) > 0 and float(row["memcpy_ms"]) > 0


def test_throughput_benchmark_smoke_reports_what_the_server_formed(tmp_path):
    from dmoe.wire.shared_memory import AVAILABLE

    # every request through shared memory, however small (the smoke's are 2 KiB): the share is read from the server;
    # one client process (the preset's are 2 of 1 request in flight) and windows of a quarter second (not half)
    stdout = run_benchmark("bench_throughput.py", "--preset", "smoke", "--rounds", "2", "--clients", "1",
                           "--inflight", "2", "--duration", "0.25", "--shared-memory-min-bytes", "0", "--results",
                           str(tmp_path))
    (path,) = tmp_path.glob("throughput_smoke_cpu_*.csv")
    rows = {r["mode"]: r for r in read_csv(path)}
    assert set(rows) == {"fwd", "fwd+bwd", "fwd+bwd cached"}
    assert all((r["clients"], r["inflight"]) == ("1", "2") for r in rows.values())  # the flags replaced the preset's
    for mode, r in rows.items():
        batch = int(r["batch"])
        assert float(r["remote_samples_per_s"]) > 0 and float(r["limit_samples_per_s"]) > 0
        assert math.isclose(float(r["remote_requests_per_s"]) * batch, float(r["remote_samples_per_s"]), rel_tol=0.01)
        # the server ran every request as a batch of its own, the size the limit runs
        assert f"forward {batch}x" in r["server_formed"]
        assert (f"backward {batch}x" in r["server_formed"]) == (mode != "fwd")
        assert ("cache hits" in r["server_formed"]) == (mode == "fwd+bwd cached")
        # the ratios are remote over limit (per wall-clock second, per CPU second, per server CPU second)
        assert math.isclose(float(r["ratio"]), float(r["remote_samples_per_s"]) / float(r["limit_samples_per_s"]),
                            rel_tol=2e-3, abs_tol=1e-3), r
        assert math.isclose(float(r["cpu_ratio"]),
                            float(r["remote_samples_per_cpu_s"]) / float(r["limit_samples_per_cpu_s"]),
                            rel_tol=2e-3, abs_tol=1e-3), r
        assert math.isclose(float(r["server_cpu_ratio"]),
                            float(r["server_samples_per_cpu_s"]) / float(r["limit_samples_per_cpu_s"]),
                            rel_tol=2e-3, abs_tol=1e-3), r
        # each round's ratio pairs that round's remote rate with that round's limit, and the range is theirs
        remote, limit = ([float(x) for x in r[column].split()] for column in ("remote_per_round", "limit_per_round"))
        per_round = [float(x) for x in r["ratio_per_round"].split()]
        assert len(per_round) == 2 and all(math.isclose(ratio, rem / lim, rel_tol=1e-2, abs_tol=2e-3)
                                           for ratio, rem, lim in zip(per_round, remote, limit)), r
        printed = next(line for line in stdout.splitlines() if re.match(rf"\s*ffn32\s+{re.escape(mode)}\s+16\s", line))
        low, high = (float(x) for x in re.search(r"\s(\d+\.\d\d)-(\d+\.\d\d)\s", printed).groups())
        # (the CSV's ratios are rounded to 3 places, the printed range to 2 from the unrounded ones)
        assert abs(low - min(per_round)) <= 0.006 and abs(high - max(per_round)) <= 0.006, printed
        assert float(r["shared_memory_share"]) == (1.0 if AVAILABLE else 0.0), r


def test_averaging_benchmark_small_runs_and_a_full_grid_is_exact(tmp_path):
    stdout = run_benchmark("bench_averaging.py", "--numel", "100000", "--peers", "2", "--rounds", "1",
                           "--limit-repeats", "1", "--paced-peers", "2", "--uplink-MBps", "2",
                           "--moshpit-grid", "2", "2", "--moshpit-rounds", "2", "--moshpit-processes", "1",
                           "--fail-rates", "0", "--slot", "1", "--results", str(tmp_path))
    fields = last_line_fields(stdout)
    assert set(fields) == {"peers2_round_s", "peers2_fraction_of_limit", "moshpit4_err_after_2"}, fields
    assert float(fields["peers2_round_s"]) > 0 and float(fields["peers2_fraction_of_limit"]) > 0
    assert float(fields["moshpit4_err_after_2"]) < 1e-5, stdout  # a full 2x2 grid: the exact mean after 2 rounds
    free, paced = read_csv(tmp_path / "bench_averaging.csv")
    assert int(free["peers"]) == int(paced["peers"]) == 2
    assert int(free["failed_peer_rounds"]) == int(paced["failed_peer_rounds"]) == 0
    assert 0 < float(paced["fraction_of_limit"]) < 1.5  # paced peers against a stream paced alike
    assert float(paced["round_s"]) > float(free["round_s"])  # 2 MB/s is far below what loopback carries
    rounds = read_csv(tmp_path / "bench_averaging_moshpit.csv")
    assert [int(r["averaged"]) for r in rounds] == [4, 4]
    assert float(rounds[1]["simulated_error"]) < 1e-5


def test_a_killed_benchmark_takes_every_process_it_started_along(tmp_path):
    """Review 54: a smoke test that timed out killed the benchmark alone, and the processes it had started, in
    sessions of their own, ran on (a bench_averaging sink for over a minute)."""
    pids = tmp_path / "pids"
    tree = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
            "time.sleep(600)\n")
    with subprocess.Popen([sys.executable, "-c", tree]) as top:
        deadline = time.monotonic() + 60
        while not pids.exists() or len(pids.read_text().split()) < 2:
            assert time.monotonic() < deadline and top.poll() is None
            time.sleep(0.05)
        child = int(pids.read_text().split()[1])
        kill_tree(top.pid)
        assert top.wait(30) == -9
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{child}") and "Z" not in open(f"/proc/{child}/stat").read().rsplit(")", 1)[1][:3]:
        assert time.monotonic() < deadline, "the grandchild in its own session still runs"
        time.sleep(0.05)
