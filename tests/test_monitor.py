"""dmoe-monitor against a real local swarm: its JSON, and its page rendered by a real headless browser."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from html.parser import HTMLParser

import pytest
import torch

from dmoe.client import backward_future, forward_future
from dmoe.launch import LocalSwarm, SwarmConfig
from tests.procs import Proc

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
LAYERS, GRID, HIDDEN = ("ffn0", "ffn1"), (4, 4), 8


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def swarm_and_monitor():
    """Two servers (ffn0/ffn1 rows 0-1 and 2-3) refreshing every second, records expiring after 4 s; a monitor."""
    config = SwarmConfig(layers=LAYERS, grid=GRID, n_servers=2, hidden_dim=HIDDEN,
                         server_args=("--refresh-period", "1", "--expiration", "4"))
    with LocalSwarm(config) as swarm:
        monitor = Proc(["-m", "dmoe.monitor", "--initial-peers", swarm.initial_peers, "--layers", *LAYERS,
                        "--grid", *map(str, GRID), "--period", "0.5"])
        try:
            yield swarm, monitor.endpoint()
        finally:
            assert monitor.stop() == 0, "dmoe-monitor did not exit cleanly on SIGINT"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_until(condition, timeout: float, what: str, interval: float = 0.2):
    """Returns condition()'s first truthy value; fails naming ``what`` (and the last value) after ``timeout`` s."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = condition()
        if last and last[0]:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last seen: {last and last[1]}")


def test_monitor_json_shows_every_alive_expert_its_server_and_its_calls(swarm_and_monitor):
    swarm, monitor = swarm_and_monitor
    x, grad = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    for _ in range(2):
        forward_future(swarm.server_endpoints[0], "ffn0.1.2", [x]).result(30)
    backward_future(swarm.server_endpoints[0], "ffn0.1.2", [x], [grad]).result(30)

    def seen():
        view = get_json(f"http://{monitor}/api/swarm")
        expert = view["layers"][0]["experts"].get("ffn0.1.2", {})
        alive = [layer["alive"] for layer in view["layers"]]
        done = alive == [16, 16] and expert.get("forward_calls") == 2 and expert.get("backward_calls") == 1
        return done, f"alive per layer {alive}, ffn0.1.2: {expert}"
    wait_until(seen, 60, "all 32 experts and the calls of ffn0.1.2")
    view = get_json(f"http://{monitor}/api/swarm")
    assert view["layers"][0]["experts"]["ffn0.1.2"]["endpoint"] == swarm.server_endpoints[0]
    assert view["layers"][1]["experts"]["ffn1.3.0"]["endpoint"] == swarm.server_endpoints[1]
    servers = {server["endpoint"]: server for server in view["servers"]}
    assert set(servers) == set(swarm.server_endpoints)
    assert all(server["experts"] == 16 and server["latency_ms"] is not None for server in servers.values())
    assert len({server["color"] for server in servers.values()}) == 2


class Cells(HTMLParser):
    """Collects the page's grid cells (uid -> attributes) and the endpoints in its server legend."""

    def __init__(self, html: str):
        super().__init__()
        self.cells: dict[str, dict[str, str]] = {}
        self.legend: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attributes = {key: value or "" for key, value in attrs}
        if "cell" in attributes.get("class", "").split() and "data-uid" in attributes:
            self.cells[attributes["data-uid"]] = attributes
        if tag == "tr" and "server" in attributes.get("class", "").split():
            self.legend.append(attributes.get("data-endpoint", ""))

    def __repr__(self) -> str:
        states: dict[str, int] = {}
        for cell in self.cells.values():
            states[cell.get("data-state", "?")] = states.get(cell.get("data-state", "?"), 0) + 1
        return f"<page: cells {states}, legend {self.legend}>"


def render(executable: str, url: str, user_data_dir, *extra: str) -> subprocess.CompletedProcess:
    command = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
               f"--user-data-dir={user_data_dir}", "--virtual-time-budget=3000", "--window-size=1400,800",
               *extra, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def required_browser() -> str:
    """The browser's path. Without one the test skips on a laptop (``make test``) but fails in CI (``CI`` set, as
    ``.ci/run`` does after installing Chromium), where a skip would leave the page untested."""
    executable = browser()
    if executable is None:
        reason = (f"no headless browser installed (looked for {', '.join(BROWSERS)} on PATH; "
                  "on Debian: apt-get install chromium)")
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {reason}")
        pytest.skip(reason)
    return executable


def test_page_in_a_headless_browser_draws_the_grid_and_drops_a_dead_servers_experts(swarm_and_monitor, tmp_path):
    executable = required_browser()
    swarm, monitor = swarm_and_monitor
    url = f"http://{monitor}/"

    def page():
        result = render(executable, url, tmp_path / "profile", "--dump-dom")
        assert result.returncode == 0, result.stderr[-2000:]
        return Cells(result.stdout)

    def all_alive():
        cells = page()
        states = [cells.cells.get(uid, {}).get("data-state") for uid in expected]
        return states == ["alive"] * len(expected) and sorted(cells.legend) == sorted(swarm.server_endpoints), cells

    expected = [f"{layer}.{i}.{j}" for layer in LAYERS for i in range(GRID[0]) for j in range(GRID[1])]
    _, cells = wait_until(all_alive, 60, "a page with all 32 experts alive")
    hosted_by_second = [uid for uid in expected if int(uid.split(".")[1]) >= 2]
    assert {cells.cells[uid]["data-endpoint"] for uid in hosted_by_second} == {swarm.server_endpoints[1]}
    assert "calls/s" in cells.cells["ffn0.0.0"]["title"]

    dead_endpoint = swarm.server_endpoints[1]
    swarm.servers[1].kill()  # SIGKILL: no goodbye, its records just stop being refreshed

    def second_gone():
        cells = page()
        states = {cells.cells.get(uid, {}).get("data-state") for uid in hosted_by_second}
        survivors = {cells.cells.get(uid, {}).get("data-state") for uid in expected if uid not in hosted_by_second}
        return states == {"dead"} and survivors == {"alive"} and cells.legend == [swarm.server_endpoints[0]], cells
    _, cells = wait_until(second_gone, 60, f"the experts of the killed server {dead_endpoint} to disappear")
    assert dead_endpoint not in json.dumps(get_json(f"http://{monitor}/api/swarm"))


def test_an_idle_connection_to_the_page_is_closed_and_requests_are_still_answered():
    import socket
    from types import SimpleNamespace

    from dmoe.monitor import MonitorServer

    server = MonitorServer(SimpleNamespace(snapshot_json=lambda: b'{"layers": []}'), idle_timeout=0.5).start()
    try:
        host, port = server.endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as idle:
            idle.settimeout(10)
            assert idle.recv(1) == b""  # closed by the server, well before this side's 10 s
        assert get_json(f"http://{server.endpoint}/api/swarm") == {"layers": []}
    finally:
        server.close()


def test_the_page_is_served_while_the_first_poll_still_runs_and_shows_it_never_updated(monkeypatch):
    """The first poll reads every cell and asks every alive expert for its info (seconds on a large grid); the
    monitor used to run it before it listened, and signals waited for it."""
    import threading
    from types import SimpleNamespace

    from dmoe.monitor import MonitorServer, SwarmMonitor

    polling, release, pollers = threading.Event(), threading.Event(), []

    def slow_poll() -> None:
        pollers.append(threading.current_thread())
        polling.set()
        if threading.current_thread() is not threading.main_thread():  # would block start() itself: fail instead
            release.wait(60)

    monitor = SwarmMonitor(["127.0.0.1:1"], ["ffn0"], (2, 2), dht=SimpleNamespace(), period=0.1)
    monkeypatch.setattr(monitor, "_poll", slow_poll)
    try:
        with monitor, MonitorServer(monitor) as server:
            assert polling.wait(10), "the first poll did not start"
            assert pollers[0] is not threading.main_thread(), "the first poll ran before the page was served"
            view = get_json(f"http://{server.endpoint}/api/swarm")
            assert view["updated"] is None and view["layers"][0]["alive"] == 0
            release.set()
    finally:
        release.set()


class StandInDirectory:
    """A DHT as the monitor reads it: every cell of ``layer`` alive at ``endpoint``; ``records`` for the rest."""

    def __init__(self, endpoint: str, records: dict | None = None):
        self.endpoint, self.records = endpoint, records or {}

    def get_alive_continuations(self, prefixes, experts_under=()):
        return {prefix: {coord: self.endpoint_of(f"{prefix}.{coord}") for coord in range(GRID[0])}
                for prefix in prefixes}

    def endpoint_of(self, prefix: str) -> str:
        """The endpoint the directory names for ``prefix`` (a cell's uid, or a prefix of one)."""
        return self.endpoint

    def get_many(self, keys):
        return {key: self.records.get(key, {}) for key in keys}


def test_closing_the_monitor_does_not_wait_for_a_poll_of_experts_that_do_not_answer():
    """Each expert's info call waits info_timeout: a poll of many experts that accept connections and never answer
    held a Ctrl-C up for about 20 s (close() joined the poll before cancelling its calls)."""
    import socket
    import threading

    from dmoe.monitor import SwarmMonitor

    with socket.socket() as silent:  # connections are accepted by the kernel, and nothing is ever answered
        silent.bind(("127.0.0.1", 0))
        silent.listen(256)
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        monitor = SwarmMonitor(["127.0.0.1:1"], ["ffn0", "ffn1"], GRID, dht=StandInDirectory(endpoint),
                               info_timeout=3.0, workers=2).start()
        try:
            deadline = time.monotonic() + 10
            while not any(t.name.startswith("dmoe-monitor-info") for t in threading.enumerate()):
                assert time.monotonic() < deadline, "the poll never called an expert"
                time.sleep(0.05)
        finally:
            started = time.monotonic()
            monitor.close()
            closed_in = time.monotonic() - started
    assert closed_in < 5.0, f"close() took {closed_in:.1f} s"  # the poll had 32 calls of 3 s on 2 workers ahead


def test_cells_declared_at_new_silent_endpoints_each_poll_neither_stretch_the_poll_nor_hide_the_servers(monkeypatch):
    """Each cell cost an info_timeout of one of the monitor's threads, and anyone may declare free cells at new
    silent addresses each period: 64 of them stretched a 2 s poll to 8 s (review 91), and the answering servers'
    calls waited behind theirs. Now an endpoint is asked for one cell before the others, the servers that answered
    last poll go first, and the poll ends max(period, info_timeout) after its calls began."""
    import socket

    from dmoe.monitor import SwarmMonitor

    listeners: list[socket.socket] = []

    def silent() -> str:  # a new address that accepts connections (the kernel does) and never answers
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listeners.append(listener)
        return f"127.0.0.1:{listener.getsockname()[1]}"

    answering, one_silent = "127.0.0.1:1", silent()
    fresh: dict[str, str] = {}

    class Rotating(StandInDirectory):
        def endpoint_of(self, prefix: str) -> str:  # row 0 answers, row 1 is one silent server, the rest rotate
            row = prefix.split(".")[1]
            return {"0": answering, "1": one_silent}.get(row) or fresh.setdefault(prefix, silent())

    monitor = SwarmMonitor(["127.0.0.1:1"], ["ffn0"], GRID, dht=Rotating(""), period=0.5, info_timeout=0.5,
                           workers=2)
    asked: list[str] = []
    real_info = monitor._info

    def info(uid: str, endpoint: str):
        asked.append(endpoint)
        if endpoint == answering:
            return {"forward_calls": 1, "backward_calls": 0}, 0.001
        return real_info(uid, endpoint)
    monkeypatch.setattr(monitor, "_info", info)
    try:
        took = []
        for _ in range(4):
            fresh.clear()  # 8 cells at 8 new silent addresses each poll
            asked.clear()
            started = time.monotonic()
            snapshot = monitor.poll()
            took.append(time.monotonic() - started)
            assert asked.count(one_silent) <= 1, "each cell of a silent server was asked, not one"
        assert max(took[1:]) < 1.5, f"polls took {[round(t, 1) for t in took]} s (12 silent cells on 2 threads)"
        experts = snapshot["layers"][0]["experts"]
        assert [uid for uid, expert in experts.items() if expert["reachable"]] == [f"ffn0.0.{i}" for i in range(4)]
        assert len(experts) == 16
    finally:
        monitor.close()
        for listener in listeners:
            listener.close()


def test_a_layer_named_twice_is_refused_it_counted_every_expert_twice(capsys):
    from dmoe.cli.monitor import main
    from dmoe.monitor import SwarmMonitor

    with pytest.raises(SystemExit) as exit_info:
        main(["--initial-peers", "127.0.0.1:1", "--layers", "ffn0", "ffn1", "ffn0"])
    assert exit_info.value.code == 2 and "argument --layers: ffn0 given more than once" in capsys.readouterr().err
    with pytest.raises(ValueError, match="more than once"):
        SwarmMonitor(["127.0.0.1:1"], ["ffn0", "ffn0"], GRID, dht=StandInDirectory("127.0.0.1:1"))


def test_an_adoption_dated_ahead_of_this_clock_is_not_shown_as_recent():
    """Anyone may write a cell's adoption (a shared entry): one dated in the future stayed "adopted in the last
    hour" for as long as the DHT kept it."""
    from dmoe.dht.storage import Entry
    from dmoe.monitor import SwarmMonitor
    from dmoe.replicas.records import adopted_key

    now = time.time()
    record = {"0.1": Entry(f"{now - 60:.0f}/3/3", now + 600), "1.2": Entry(f"{now + 30:.0f}/3/3", now + 600),
              "2.3": Entry(f"{now + 86400:.0f}/3/3", now + 600), "3.0": Entry(f"{now - 7200:.0f}/3/3", now + 600)}
    monitor = SwarmMonitor(["127.0.0.1:1"], ["ffn0"], GRID, dht=StandInDirectory("127.0.0.1:1", {
        adopted_key("ffn0"): record}))
    snapshot = monitor._empty()
    snapshot["layers"][0]["experts"] = {f"ffn0.{cell}": {"endpoint": "127.0.0.1:2"} for cell in record}
    monitor._replication(snapshot)
    monitor.close()
    assert sorted(snapshot["layers"][0]["adopted"]) == ["ffn0.0.1", "ffn0.1.2"]  # not a day ahead, nor 2 h ago


def test_replicas_are_counted_per_machine_and_adoptions_only_of_cells_served_now():
    """One peer with free keys showed "xN replicas" on every cell, dead ones included, and outlined dead cells as
    adopted: the page told the operator lost experts were safe (review 91). Holders count per machine (as the
    adopters' votes count them), and an adoption shows only on a cell served now."""
    from dmoe.dht import Identity
    from dmoe.dht.storage import Entry
    from dmoe.monitor import SwarmMonitor
    from dmoe.replicas.records import adopted_key, replicas_key, server_subkey

    now = time.time()
    keys = [Identity().public_key for _ in range(5)]
    holders = {server_subkey(key): Entry(f"{endpoint}/7/0123456789abcdef", now + 600, key)
               for key, endpoint in zip(keys, ["10.0.0.9:1", "10.0.0.9:2", "10.0.0.9:3", "10.0.0.8:1", "[2001:db8::1]:5"])}
    adopted = {"0.0": Entry(f"{now - 60:.0f}/3/3", now + 600), "0.1": Entry(f"{now - 60:.0f}/3/3", now + 600)}
    monitor = SwarmMonitor(["127.0.0.1:1"], ["ffn0"], GRID, dht=StandInDirectory("127.0.0.1:1", {
        replicas_key("ffn0.0.0"): holders, adopted_key("ffn0"): adopted}))
    snapshot = monitor._empty()
    snapshot["layers"][0]["experts"] = {"ffn0.0.1": {"endpoint": "127.0.0.1:2"}}  # ffn0.0.0 is dead
    monitor._replication(snapshot)
    monitor.close()
    assert snapshot["layers"][0]["replicas"] == {"ffn0.0.0": 3}  # 10.0.0.9, 10.0.0.8, 2001:db8::/64
    assert list(snapshot["layers"][0]["adopted"]) == ["ffn0.0.1"]


def rotated_monitor(monkeypatch, polls: int, **limits):
    """A monitor that polled ``polls`` times a swarm whose every cell moves to a new endpoint every other poll (a
    server restarted on a free port)."""
    from dmoe.monitor import SwarmMonitor

    directory = StandInDirectory("127.0.0.1:20000")
    monitor = SwarmMonitor(["127.0.0.1:1"], ["ffn0"], GRID, dht=directory, **limits)
    monkeypatch.setattr(monitor, "_info", lambda uid, endpoint: ({"forward_calls": 1, "backward_calls": 0}, 0.001))
    colors = []
    try:
        for i in range(polls):
            directory.endpoint = f"127.0.0.1:{20000 + i // 2}"  # each endpoint found by two polls in a row
            snapshot = monitor.poll()
            assert snapshot["layers"][0]["alive"] == 16 and len(snapshot["servers"]) == 1
            colors.append(snapshot["servers"][0]["color"])
    finally:
        monitor.close()
    assert all(colors[i] == colors[i + 1] for i in range(0, polls, 2)), "a server's color changed between polls"
    assert len(set(colors[::2])) > 1  # and a new server gets a new one
    return monitor


def test_endpoints_not_seen_for_a_while_are_forgotten(monkeypatch):
    """Every endpoint ever seen kept its color and its experts' call counts: a cell declared at a new endpoint each
    period grew the monitor by one endpoint per poll, for as long as it ran."""
    monitor = rotated_monitor(monkeypatch, 200, forget_after=0.0)
    assert list(monitor._colors) == ["127.0.0.1:20099"]
    assert {endpoint for _, endpoint in monitor._previous} == {"127.0.0.1:20099"}


def test_at_most_max_remembered_endpoints_are_kept_however_recent(monkeypatch):
    monitor = rotated_monitor(monkeypatch, 200, max_remembered=8)
    assert len(monitor._colors) <= 8 and "127.0.0.1:20099" in monitor._colors
    assert len({endpoint for _, endpoint in monitor._previous}) <= 8


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts file descriptors in /proc")
def test_endpoints_a_poll_no_longer_finds_hold_no_connection(monkeypatch):
    """The monitor asked through the process-wide channel pool, which keeps an idle channel 10 minutes: cells
    declared at a new address of a silent listener each period ran it out of file descriptors (review 79)."""
    import socket

    from dmoe.monitor import SwarmMonitor

    listeners = [socket.socket() for _ in range(12)]
    try:
        for listener in listeners:  # accept connections (the kernel does) and never answer
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
        endpoints = [f"127.0.0.1:{listener.getsockname()[1]}" for listener in listeners]
        directory = StandInDirectory(endpoints[0])
        monitor = SwarmMonitor(["127.0.0.1:1"], ["ffn0"], GRID, dht=directory, info_timeout=0.2, workers=8)
        try:
            directory.endpoint = endpoints[0]
            monitor.poll()
            before = open_fds()
            for endpoint in endpoints[1:]:
                directory.endpoint = endpoint
                assert monitor.poll()["layers"][0]["alive"] == GRID[0] * GRID[1]
            assert open_fds() - before < 6, "connections to endpoints no poll finds any more were kept"
            assert monitor._channels.endpoints() == [endpoints[-1]]
        finally:
            monitor.close()
    finally:
        for listener in listeners:
            listener.close()


def test_an_oversized_info_answer_costs_the_monitor_nothing_and_callers_refuse_junk_hyperparameters():
    """A server answering info with 60 MiB of hyper-parameters made each poll take seconds and a gigabyte, parsed
    after the call's deadline (review 79): the monitor reads at most 1 MiB, and nobody parses over 64 KiB."""
    from concurrent import futures

    import grpc

    from dmoe.client.remote_expert import MAX_HPARAMS_CHARS, MalformedAnswer, expert_info
    from dmoe.monitor import SwarmMonitor
    from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc, grpc_options

    class Bloated(dmoe_pb2_grpc.ExpertServiceServicer):
        def __init__(self, what: str, chars: int):
            self.what, self.chars = what, chars

        def info(self, request, context):
            if self.what == "hparams_json":
                return dmoe_pb2.ExpertInfo(uid=request.uid, hparams_json="[" + "0," * (self.chars // 2) + "0]")
            return dmoe_pb2.ExpertInfo(uid=request.uid, expert_cls="x" * self.chars)

    servers = []
    try:
        for what, chars in (("expert_cls", 2 * 1024 * 1024), ("hparams_json", MAX_HPARAMS_CHARS + 10)):
            server = grpc.server(futures.ThreadPoolExecutor(2), options=grpc_options())
            dmoe_pb2_grpc.add_ExpertServiceServicer_to_server(Bloated(what, chars), server)
            servers.append((server, f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"))
            server.start()
        (_, huge), (_, long) = servers
        monitor = SwarmMonitor(["127.0.0.1:1"], ["ffn0"], GRID, dht=StandInDirectory(huge), info_timeout=5.0)
        try:
            assert monitor._info("ffn0.0.0", huge)[0] is None  # refused by the channel, not read
            assert expert_info(huge, "ffn0.0.0", timeout=5.0)["expert_cls"] == "x" * 2 * 1024 * 1024  # (others read)
        finally:
            monitor.close()
        with pytest.raises(MalformedAnswer, match=f"more than {MAX_HPARAMS_CHARS}"):
            expert_info(long, "ffn0.0.0", timeout=5.0)
    finally:
        for server, _ in servers:
            server.stop(None)


def test_the_swarm_json_is_encoded_once_per_poll_however_many_ask(monkeypatch):
    """Every request encoded the snapshot again (0.2 s for a large grid): a few clients asking in a loop starved
    the polls (review 79)."""
    from dmoe.monitor import SwarmMonitor

    monitor = SwarmMonitor(["127.0.0.1:1"], ["ffn0"], GRID, dht=StandInDirectory("127.0.0.1:20000"))
    monkeypatch.setattr(monitor, "_info", lambda uid, endpoint: ({"forward_calls": 1, "backward_calls": 0}, 0.001))
    encodings = []
    real_dumps = json.dumps
    monkeypatch.setattr("dmoe.monitor.json.dumps", lambda value: encodings.append(1) or real_dumps(value))
    try:
        monitor.poll()
        first = [monitor.snapshot_json() for _ in range(5)]
        assert len(encodings) == 1 and json.loads(first[0])["layers"][0]["alive"] == GRID[0] * GRID[1]
        monitor.poll()
        assert monitor.snapshot_json() is not first[0] and len(encodings) == 2
    finally:
        monitor.close()


def test_the_snapshot_says_when_no_contact_of_the_monitors_dht_node_answers():
    """A monitor whose DHT peers all went silent kept a fresh snapshot of an empty swarm, "0 of 16 experts alive on
    0 servers", as if every server had left (review 112 D3): the snapshot now counts the contacts that answer."""
    from dmoe.dht import DHT
    from dmoe.monitor import SwarmMonitor

    boot = DHT()
    monitor = SwarmMonitor([boot.endpoint], ["ffn0"], GRID, period=0.5, info_timeout=0.5)
    try:
        state = monitor.poll()["dht"]
        assert state["contacts"] >= 1 and state["answering"] >= 1, state
        boot.close()  # its one contact gone, as a network cut would do

        def lost():
            state = monitor.poll()["dht"]
            return state == {"contacts": state["contacts"], "answering": 0}, state
        wait_until(lost, 30, "the snapshot to say no contact answers", interval=0)
    finally:
        monitor.close()
        boot.close()


def test_a_layer_declared_with_another_grid_than_the_monitors_is_named_not_shown_empty():
    """With --grid 4 4, a layer served as ffn2.[0:2].[0:2].[0:3] showed every cell "not declared in the DHT" though
    its 12 experts were alive: the look-up found ffn2.0.0 as a prefix with continuations (review 112 D3)."""
    from dmoe.dht import DHT
    from dmoe.directory import declare_experts
    from dmoe.monitor import SwarmMonitor
    from dmoe.uid import expand_pattern

    declared = {"ffn1": "ffn1.[0:4]", "ffn2": "ffn2.[0:2].[0:2].[0:3]", "ffn3": "ffn3.[4:6].[0:4]",
                "ffn4": "ffn4.[0:2].[0:4]"}
    with DHT() as node:
        for pattern in declared.values():
            assert all(declare_experts(node, expand_pattern(pattern), "127.0.0.1:1", expiration=60))
        monitor = SwarmMonitor([], ["ffn0", *declared], GRID, dht=node, info_timeout=0.2)
        try:
            layers = {layer["name"]: layer for layer in monitor.poll()["layers"]}
        finally:
            monitor.close()
    notes = {name: layer["grid_mismatch"] for name, layer in layers.items()}
    assert notes["ffn0"] is None and notes["ffn4"] is None and layers["ffn4"]["alive"] == 8, notes
    assert notes["ffn2"] == ("layer ffn2 has more grid dimensions than --grid 4 4: its experts are declared as "
                             "ffn2.0.0.0 (3 dimensions)")
    assert notes["ffn1"] == ("layer ffn1 has fewer grid dimensions than --grid 4 4: its experts are declared as "
                             "ffn1.0 (1 dimension)")
    assert notes["ffn3"] == "layer ffn3's experts are declared outside --grid 4 4 (e.g. ffn3.4.0)"


def test_page_in_a_headless_browser_says_the_dht_is_unreachable_and_why_a_layer_is_empty(tmp_path):
    """(review 112 D3) The header's status, in the page's stale style, and the layer's note."""
    import re
    from types import SimpleNamespace

    from dmoe.monitor import MonitorServer

    executable = required_browser()
    note = "layer ffn0 has more grid dimensions than --grid 4 4: its experts are declared as ffn0.0.0.0 (3 dimensions)"
    snapshot = {"updated": time.time(), "period": 2.0, "initial_peers": ["127.0.0.1:1"], "grid": [4, 4],
                "dht": {"contacts": 2, "answering": 0}, "servers": [],
                "layers": [{"name": "ffn0", "grid": [4, 4], "cells": 16, "alive": 0, "experts": {}, "replicas": {},
                            "adopted": {}, "adopted_last_hour": 0, "grid_mismatch": note}]}
    server = MonitorServer(SimpleNamespace(snapshot_json=lambda: json.dumps(snapshot).encode())).start()
    try:
        result = render(executable, f"http://{server.endpoint}/", tmp_path / "profile", "--dump-dom")
    finally:
        server.close()
    assert result.returncode == 0, result.stderr[-2000:]
    status = re.search(r'<span id="status"([^>]*)>([^<]*)</span>', result.stdout)
    assert status and 'class="stale"' in status[1] and status[2].startswith("DHT unreachable: no contact answers (2 "
                                                                             "known)"), status
    assert f'<p class="mismatch">{note}</p>' in result.stdout
