"""Prometheus metrics of an expert server, scraped from a real dmoe-server process."""
from __future__ import annotations

import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dmoe.client import RemoteExpertError, backward_future, forward_future, forward_futures
from dmoe.server import ExpertServer, ServerConfig
from dmoe.wire import ChannelPool
from tests.procs import running


def scrape(endpoint: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from http://endpoint/metrics."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape_once(endpoint: str, name: str, expected: float, timeout: float = 30.0, **labels
                ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """:func:`scrape`, once ``name{labels}`` reads ``expected``. A call is counted as its handler returns, which
    can be just after the client got its status (a refusal is sent first)."""
    deadline = time.monotonic() + timeout
    while value(samples := scrape(endpoint), name, **labels) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return samples


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "grpc"])
def test_server_process_started_from_a_config_file_counts_requests_batches_errors_and_steps(tmp_path,
                                                                                           shared_memory):
    config = tmp_path / "server.toml"
    config.write_text('experts = "ffn0.[0:2]"\nhidden-dim = 8\nmetrics-port = 0\noptimizer = "sgd"\n')
    with running("-m", "dmoe.cli.server", "--config", str(config), "--max-batch-size", "64") as proc, \
            ChannelPool(shared_memory=shared_memory, shared_memory_min_bytes=0) as channels:
        metrics = proc.wait_for(r"dmoe-server metrics on (\S+:\d+)").group(1)
        endpoint = proc.endpoint()
        x, grad = torch.randn(5, 8), torch.randn(5, 8)
        for _ in range(2):
            forward_future(endpoint, "ffn0.0", [x], channels=channels).result(30)
        forward_future(endpoint, "ffn0.0", [x], unary_limit=0, channels=channels).result(30)  # streamed: the same
        backward_future(endpoint, "ffn0.0", [x], [grad], channels=channels).result(30)
        backward_future(endpoint, "ffn0.0", [x], [grad], channels=channels).result(30)
        with pytest.raises(RemoteExpertError):  # wrong width: refused before compute
            forward_future(endpoint, "ffn0.1", [torch.randn(2, 3)], channels=channels).result(30)
        with pytest.raises(RemoteExpertError):
            forward_future(endpoint, "ffn0.9", [x], channels=channels).result(30)
        with pytest.raises(RemoteExpertError):  # more rows than --max-batch-size
            forward_future(endpoint, "ffn0.1", [torch.randn(65, 8)], channels=channels).result(30)
        # one batch call of three items: each counts as a request of its expert, with its own status
        items = forward_futures([(uid, endpoint, [x], None) for uid in ("ffn0.1", "ffn0.1", "ffn0.7")], timeout=30,
                                channels=channels)
        assert [future.exception() is None for future in items] == [True, True, False]
        samples = scrape(metrics)
    how = "_shared" if shared_memory else ""  # the calls' names: the same requests, counted the same either way

    assert value(samples, "dmoe_requests_total", expert="ffn0.0", method="forward", code="OK") == 3
    assert value(samples, "dmoe_requests_total", expert="ffn0.0", method="backward", code="OK") == 2
    assert value(samples, "dmoe_requests_total", expert="ffn0.1", method="forward", code="INVALID_ARGUMENT") == 1
    assert value(samples, "dmoe_requests_total", expert="ffn0.1", method="forward", code="RESOURCE_EXHAUSTED") == 1
    assert value(samples, "dmoe_requests_total", expert="unknown", method="forward", code="NOT_FOUND") == 2
    assert value(samples, "dmoe_requests_total", expert="ffn0.1", method="forward", code="OK") == 2
    assert value(samples, "dmoe_grpc_calls_total", rpc=f"forward_batch{how}") == 1
    assert value(samples, "dmoe_grpc_calls_total", rpc=f"forward{how}") == 5  # streamed forward: one forward_stream
    assert value(samples, "dmoe_grpc_calls_total", rpc=f"backward{how}") == 2
    assert value(samples, "dmoe_grpc_calls_total", rpc="forward_stream") == 1
    assert value(samples, "dmoe_grpc_calls_total", rpc="forward_batch" if shared_memory else "forward_shared") == 0
    assert value(samples, "dmoe_request_seconds_count", expert="ffn0.0", method="forward") == 3
    assert value(samples, "dmoe_batch_rows_sum", expert="ffn0.0", method="forward") == 15
    assert value(samples, "dmoe_batch_rows_count", expert="ffn0.0", method="backward") == 2
    assert value(samples, "dmoe_optimizer_steps_total", expert="ffn0.0") == 2
    assert value(samples, "dmoe_optimizer_steps_total", expert="ffn0.1") == 0
    assert value(samples, "dmoe_queue_wait_seconds_count", expert="ffn0.0", method="forward") == 3
    assert ("dmoe_queue_length", (("expert", "ffn0.1"), ("method", "backward"))) in samples
    assert value(samples, "dmoe_batch_errors_total", expert="ffn0.0", method="forward") == 0


def test_two_in_process_servers_keep_separate_registries_and_batch_errors_are_counted():
    configs = [ServerConfig(device="cpu", metrics_port=0) for _ in range(2)]
    with ExpertServer.create("a.[0:2]", "ffn", 4, config=configs[0]) as first, \
            ExpertServer.create("a.[0:2]", "ffn", 4, config=configs[1]) as second:
        boom = first.servicer.experts["a.0"].forward_pool
        boom.process = lambda *inputs, **kwargs: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(RemoteExpertError, match="boom"):
            forward_future(first.endpoint, "a.0", [torch.randn(2, 4)]).result(30)
        forward_future(second.endpoint, "a.1", [torch.randn(2, 4)]).result(30)
        one, two = scrape(first.metrics.endpoint), scrape(second.metrics.endpoint)
    assert value(one, "dmoe_batch_errors_total", expert="a.0", method="forward") == 1
    assert value(one, "dmoe_requests_total", expert="a.0", method="forward", code="INTERNAL") == 1
    assert value(one, "dmoe_requests_total", expert="a.1", method="forward", code="OK") == 0
    assert value(two, "dmoe_requests_total", expert="a.1", method="forward", code="OK") == 1
    assert value(two, "dmoe_batch_errors_total", expert="a.0", method="forward") == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the endpoint is gone once the server closed
        try:
            scrape(first.metrics.endpoint or "")
        except OSError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the metrics endpoint kept answering after close()")


def test_idle_connections_to_the_metrics_endpoint_cannot_pile_up_threads():
    """prometheus_client's server gave every connection a thread for as long as the client kept it open: 300
    connections that sent half a request grew a dmoe-server from 15 to 315 threads, still 315 a minute later. Now
    at most max_connections are served at once (more are closed at once) and each is closed when idle."""
    import socket
    import threading

    from dmoe.server.metrics import ServerMetrics

    metrics = ServerMetrics({})
    endpoint = metrics.serve("127.0.0.1", 0, max_connections=4, idle_timeout=1.0)
    host, port = endpoint.rsplit(":", 1)
    before = threading.active_count()
    idle = []
    try:
        for _ in range(12):
            connection = socket.create_connection((host, int(port)), timeout=10)
            connection.sendall(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
            idle.append(connection)
        assert threading.active_count() <= before + 4
        closed = []
        for connection in idle:  # the 8 beyond the limit were answered 503 at once, the 4 others closed when idle
            connection.settimeout(10)
            started = time.monotonic()
            answer = b""
            while chunk := connection.recv(4096):
                answer += chunk
            assert answer == b"" or answer.startswith(b"HTTP/1.0 503 "), answer
            closed.append(time.monotonic() - started)
        assert sum(seconds < 0.5 for seconds in closed) >= 8, closed
        assert scrape(endpoint) is not None  # served again
    finally:
        for connection in idle:
            connection.close()
        metrics.close()


def test_cuda_graph_counters_are_exported_so_a_run_can_tell_graphs_from_a_silent_fallback():
    """A server asked for --cuda-graphs whose captures all failed computed eagerly while the benchmarks said
    "server on CUDA graphs": nothing counted captures or replays."""
    from collections import Counter as Counts
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from dmoe.server.metrics import ServerMetrics

    def hosted(graphs):
        return SimpleNamespace(backend=SimpleNamespace(graphs=graphs, optimizer=None), forward_pool=[],
                               backward_pool=[])

    replaying = SimpleNamespace(captures=3, replays_by_kind=Counts(forward=5, train=7), switch=SimpleNamespace(off=None))
    failed = SimpleNamespace(captures=0, replays_by_kind=Counts(), switch=SimpleNamespace(off="capture failed"))
    metrics = ServerMetrics({"g.0": hosted(replaying), "g.1": hosted(failed), "e.0": hosted(None)})
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for sample in family.samples}
    assert samples[("dmoe_cuda_graph_captures_total", (("expert", "g.0"),))] == 3
    assert samples[("dmoe_cuda_graph_replays_total", (("expert", "g.0"), ("kind", "train")))] == 7
    assert samples[("dmoe_cuda_graph_replays_total", (("expert", "g.0"), ("kind", "forward")))] == 5
    assert samples[("dmoe_cuda_graphs_off", (("expert", "g.1"),))] == 1
    assert samples[("dmoe_cuda_graphs_off", (("expert", "g.0"),))] == 0
    assert not any(labels == (("expert", "e.0"),) for _, labels in samples)  # eager by choice: nothing to count


def test_concurrent_scrapes_share_one_render_and_each_shows_what_was_counted_before_it(monkeypatch):
    """Each scrape rendered the whole registry in the server's process (178 ms for 64 experts, holding the GIL), up
    to one per connection at once: scrapers stalled the server. Now one render serves every scrape waiting for it,
    and renders start at most once per render_interval, each never older than the scrape."""
    import threading

    from dmoe.httpd import HTTPLimits
    from dmoe.server import metrics as metrics_module

    renders = []

    def slow_render(registry):
        renders.append(threading.current_thread().name)
        time.sleep(0.2)  # long enough for the scrapes to pile up behind it
        return real_render(registry)

    real_render = metrics_module.generate_latest
    monkeypatch.setattr(metrics_module, "generate_latest", slow_render)
    metrics = metrics_module.ServerMetrics({})
    endpoint = metrics.serve("127.0.0.1", 0, limits=HTTPLimits(max_connections=32, max_per_client=32),
                             render_interval=2.0)
    try:
        metrics.grpc_calls.labels("forward").inc()
        assert value(scrape(endpoint), "dmoe_grpc_calls_total", rpc="forward") == 1
        assert len(renders) == 1
        start, pages = threading.Barrier(24), []

        def scraper() -> None:
            start.wait()
            pages.append(value(scrape(endpoint), "dmoe_grpc_calls_total", rpc="forward"))

        metrics.grpc_calls.labels("forward").inc()
        threads = [threading.Thread(target=scraper) for _ in range(24)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert pages == [2] * 24  # every one of them saw the count made before it
        # one render for the 24, or two where a loaded machine delayed some scrapes past the first render's start
        assert len(renders) in (2, 3), renders
        before = len(renders)
        metrics.grpc_calls.labels("forward").inc()
        assert value(scrape(endpoint), "dmoe_grpc_calls_total", rpc="forward") == 3  # not the cached page
        assert len(renders) == before + 1
    finally:
        metrics.close()


def test_optimizer_steps_count_the_applied_ones_and_the_skipped_ones_apart():
    """A backward whose weight gradients overflow to inf is answered, but its step is skipped (the weights stay
    finite): dmoe_optimizer_steps_total counted it as applied (3 steps for 1 update)."""
    from dmoe.client.remote_expert import RemoteExpert, expert_info

    with running("-m", "dmoe.cli.server", "--experts", "ffn0.0.0", "--hidden-dim", "16", "--metrics-port", "0",
                 "--max-abs-value", "0") as proc:
        metrics = proc.wait_for(r"dmoe-server metrics on (\S+:\d+)").group(1)
        endpoint = proc.endpoint()
        expert = RemoteExpert("ffn0.0.0", endpoint, timeout=30)
        x = torch.randn(4, 16, requires_grad=True)
        for scale in (1.0, 1e38, 1e38):  # one ordinary backward, then two whose weight gradients overflow
            (expert(x) * scale).sum().backward()
        samples = scrape_once(metrics, "dmoe_optimizer_steps_skipped_total", 2, expert="ffn0.0.0")
        updates = expert_info(endpoint, "ffn0.0.0", timeout=10)["updates"]
    assert value(samples, "dmoe_optimizer_steps_skipped_total", expert="ffn0.0.0") == 2
    assert value(samples, "dmoe_optimizer_steps_total", expert="ffn0.0.0") == updates == 1


def test_steps_replayed_as_cuda_graphs_are_counted_as_the_backend_counts_them():
    """A training step replayed as a CUDA graph skips its update on the device when a gradient is not finite
    (ExpertBackend._count_step): the metrics count it as skipped, as an eager step."""
    from types import SimpleNamespace

    from dmoe.server.backend import ExpertBackend
    from dmoe.server.metrics import ServerMetrics

    backend = SimpleNamespace(name="g.0", optimizer=object(), updates=0, skipped_steps=0, graphs=None)
    hosted = SimpleNamespace(backend=backend, forward_pool=[], backward_pool=[])
    metrics = ServerMetrics({"g.0": hosted})
    for stepped in (True, False, False, True):
        ExpertBackend._count_step(backend, stepped)  # what backward() does with a replayed step's outcome
        metrics.observe_batch(hosted.backward_pool, [], time.monotonic(), 0.0, None)
    assert metrics.optimizer_steps.labels("g.0")._value.get() == backend.updates == 2
    assert metrics.optimizer_steps_skipped.labels("g.0")._value.get() == backend.skipped_steps == 2


def test_calls_the_client_gave_up_on_are_counted_as_cancelled_not_as_server_errors():
    """The layer cancels late experts all the time; their calls were counted with code UNKNOWN, the code of a
    server's own error, so a healthy swarm showed a steady stream of errors (review 91)."""
    from dmoe.server.faults import FaultConfig

    config = ServerConfig(device="cpu", metrics_port=0, faults=FaultConfig(latency_ms=400))
    with ExpertServer.create("late.[0:1]", "ffn", 4, config=config) as server:
        for _ in range(2):
            with pytest.raises(RemoteExpertError, match="DEADLINE_EXCEEDED"):
                forward_future(server.endpoint, "late.0", [torch.randn(2, 4)], timeout=0.05).result(30)
        samples = scrape_once(server.metrics.endpoint, "dmoe_requests_total", 2.0, expert="late.0",
                              method="forward", code="CANCELLED")
        assert value(samples, "dmoe_requests_total", expert="late.0", method="forward", code="CANCELLED") == 2.0
        assert value(samples, "dmoe_requests_total", expert="late.0", method="forward", code="UNKNOWN") == 0.0
