"""``dmoe-server --profile``: the time of each stage of the server's path (dmoe/server/profile.py), counted where
it happens, exposed in the metrics and printed at shutdown."""
from __future__ import annotations

import urllib.request

import pytest
import torch

from dmoe.client import backward_future, forward_future, forward_futures
from dmoe.server import ExpertServer, ServerConfig
from dmoe.server.profile import STAGES, StageClock, format_stages, read_stages, scrape_stages, stage_difference
from dmoe.server.runtime import Runtime
from tests.procs import running

INNER = ("decode", "queue", "batch", "to_device", "compute", "to_host", "encode")


def metrics_text(endpoint: str) -> str:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
        return response.read().decode()


def test_a_profiled_server_process_counts_every_stage_once_per_call_request_and_batch_and_prints_them():
    args = ("-m", "dmoe.cli.server", "--experts", "ffn0.[0:2]", "--hidden-dim", "32", "--optimizer", "sgd",
            "--workers", "1", "--profile", "--metrics-port", "0")
    with running(*args) as proc:
        metrics = proc.wait_for(r"dmoe-server metrics on (\S+:\d+)").group(1)
        endpoint = proc.endpoint()
        x, grad = torch.randn(16, 32), torch.randn(16, 32)
        before = read_stages(metrics)
        assert all(count == 0 for _, count in before.values()), before
        for index in range(3):  # the last one keeps its activations for a backward that never comes
            forward_future(endpoint, "ffn0.0", [x], activation_id=b"kept" if index == 2 else None).result(30)
        for _ in range(2):
            backward_future(endpoint, "ffn0.1", [x], [grad]).result(30)
        forward_future(endpoint, "ffn0.1", [x], unary_limit=0).result(30)  # streamed: the same stages, once
        unary = read_stages(metrics)
        # one batch call of two items (two experts): one call, two requests, two batches
        for future in forward_futures([(uid, endpoint, [x], None) for uid in ("ffn0.0", "ffn0.1")], timeout=30):
            future.result()
        after = stage_difference(read_stages(metrics), unary)
        proc.interrupt()
        table = [proc.wait_for(rf"^\s*{stage}\s+\d").group(0) for stage in STAGES]
        proc.wait_for(r"^kept activations on cpu: at most [\d.]+ MiB at once \(--activation-cache-mb 512\)")

    assert {stage: count for stage, (_, count) in unary.items()} == {
        "call": 6, "decode": 6, "queue": 6, "batch": 6, "to_device": 6, "compute": 6, "to_host": 6, "encode": 6}
    assert {stage: count for stage, (_, count) in after.items()} == {
        "call": 1, "decode": 2, "queue": 2, "batch": 2, "to_device": 2, "compute": 2, "to_host": 2, "encode": 2}
    assert all(seconds >= 0 for seconds, _ in unary.values())
    assert unary["compute"][0] > 0 and unary["decode"][0] > 0 and unary["encode"][0] > 0
    # calls one at a time: every inner stage of a call happened inside its handler
    assert sum(unary[stage][0] for stage in INNER) <= unary["call"][0], unary
    assert len(table) == len(STAGES)  # printed at shutdown, one line per stage


def test_an_unprofiled_server_times_nothing_and_exposes_no_stages():
    with ExpertServer.create("a.[0:2]", "ffn", 4, config=ServerConfig(device="cpu", metrics_port=0)) as server:
        forward_future(server.endpoint, "a.0", [torch.randn(2, 4)]).result(30)
        text = metrics_text(server.metrics.endpoint)
    assert server.stages is None and server.runtime.stages is None and server.servicer.stages is None
    assert "dmoe_stage_seconds" not in text
    with pytest.raises(ValueError, match="--profile"):
        scrape_stages(text)


def test_requests_queued_together_are_one_batch_of_stages():
    clock = StageClock()
    runtime = Runtime(workers=1, stages=clock)
    pool = runtime.create_pool("double", lambda x: (2 * x,), max_batch_size=64)
    futures = [runtime.submit(pool, torch.full((n, 3), float(n))) for n in (1, 2, 3)]  # queued before it starts
    with runtime:
        results = [f.result(30)[0] for f in futures]
    for n, result in zip((1, 2, 3), results):
        assert torch.equal(result, torch.full((n, 3), 2.0 * n))
    snapshot = clock.snapshot()
    assert all(snapshot[stage][1] == 1 for stage in ("batch", "to_device", "compute", "to_host")), snapshot
    # the runtime alone: no gRPC stages, and the queue is timed by the server's metrics (see the process test)
    assert snapshot["call"][1] == snapshot["decode"][1] == snapshot["queue"][1] == 0


def test_the_stage_table_and_its_difference_and_bad_stage_names():
    clock = StageClock()
    clock.add("compute", 0.5, count=2)
    first = clock.snapshot()
    clock.add("compute", 0.25)
    clock.add("decode", 0.1)
    diff = stage_difference(clock.snapshot(), first)
    assert diff["compute"] == (0.25, 1) and diff["decode"] == (0.1, 1) and diff["call"] == (0.0, 0)
    table = format_stages(clock.snapshot(), per=5)
    compute = next(line for line in table.splitlines() if line.split()[0] == "compute")
    assert compute.split() == ["compute", "0.750", "3", "250.000", "150.000"]  # total, events, ms/event, ms/step
    with pytest.raises(ValueError, match="unknown stage"):
        clock.add("network", 1.0)
