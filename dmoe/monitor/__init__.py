"""A live view of the swarm: which experts of each layer's grid are alive, who hosts them, their load and latency,
how many replicas of each cell's expert other servers hold, and which cells were adopted in the last hour.

:class:`SwarmMonitor` reads the DHT every ``period`` seconds (as beam search does, one grid dimension per look-up),
asks every alive expert for its call counters through the ``info`` RPC, reads the replication records
(:mod:`dmoe.replicas.records`), and keeps the result as one JSON-able snapshot. :class:`MonitorServer` serves that
snapshot at ``/api/swarm`` and a page at ``/`` that draws it as a heatmap per layer and refreshes itself. ``dmoe-monitor`` (:mod:`dmoe.cli.monitor`) runs both.
"""
from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import logging
import math
import threading
import time
from http import HTTPStatus
from importlib import resources
from typing import Any, Callable, Sequence

from dmoe.client.remote_expert import expert_info
from dmoe.wire.channels import ChannelPool
from dmoe.dht import DHT
from dmoe.directory import ContinuationSource, alive_experts
from dmoe.directory.lookups import continuation_source
from dmoe.endpoints import reachable_endpoint
from dmoe.httpd import IDLE_TIMEOUT, MAX_CONNECTIONS, BoundedHTTPServer, HTTPLimits, HTTPThread, QuietHandler
from dmoe.replicas.records import (ADOPTION_MEMORY, adopted_key, adoptions, counted_machine, endpoint_host, holders,
                                   replicas_key)
from dmoe.uid import grid_uids

logger = logging.getLogger(__name__)

GOLDEN_ANGLE = 137.508  # degrees: consecutive hues stay far apart however many servers there are


#: seconds an adoption's time may lie ahead of this clock (clocks differ) and still count as recent
MAX_CLOCK_SKEW = 60.0
#: seconds after which an endpoint no poll found is forgotten (its color, its experts' call counts)
FORGET_AFTER = 3600.0
#: endpoints remembered at most; beyond, the least recently seen are forgotten first
MAX_REMEMBERED = 4096
#: grid dimensions :func:`grid_mismatch` looks down at most for a layer's experts
MAX_GRID_DEPTH = 16
#: the largest ``info`` answer the monitor reads: an honest one takes a few KiB, and a server answering 60 MiB made
#: each poll take seconds and a gigabyte of memory (review 79)
MAX_INFO_BYTES = 1024 * 1024


class _Closing(Exception):
    """Raised inside a poll when the monitor is closing."""


class SwarmMonitor:
    """Polls the DHT and the alive experts in a background thread; :meth:`snapshot` returns the latest view.

    Args:
        initial_peers: ``HOST:PORT`` of any DHT node of the swarm.
        layers: layer names to show (``ffn0``, ``ffn1``).
        grid: the grid every layer has, one size per dimension.
        period: seconds between polls.
        info_timeout: seconds to wait for one expert's ``info`` answer; an expert that does not answer is shown as
            declared but unreachable (its server may just have died; its DHT record has not expired yet).
        workers: concurrent ``info`` calls.
        dht: an existing DHT node to read through (then ``initial_peers`` is unused and the node is not closed);
            by default the monitor's own node, in client mode (it reads the swarm and answers nobody).
        forget_after, max_remembered: an endpoint no poll found for ``forget_after`` seconds is forgotten (its
            color and its experts' last call counts), and so are the least recently seen beyond
            ``max_remembered``: every endpoint ever seen was kept, and a server restarted on a free port, or anyone
            declaring its cell at a new endpoint each period, grew the monitor without bound.

    Load is the calls (forward + backward) per second an expert answered between two polls; latency is the round
    trip of the ``info`` RPC, per server (the median over its experts).
    """

    def __init__(self, initial_peers: Sequence[str], layers: Sequence[str], grid: Sequence[int], *,
                 period: float = 2.0, info_timeout: float = 1.0, workers: int = 8, dht: DHT | None = None,
                 forget_after: float = FORGET_AFTER, max_remembered: int = MAX_REMEMBERED):
        if not layers:
            raise ValueError("at least one layer is needed")
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers given more than once: {list(layers)}")
        if not grid or any(size < 1 for size in grid):
            raise ValueError(f"grid sizes must be positive, got {tuple(grid)}")
        self.layers, self.grid = list(layers), tuple(int(size) for size in grid)
        if max_remembered < 1:
            raise ValueError(f"max_remembered must be >= 1, got {max_remembered}")
        self.period, self.info_timeout = period, info_timeout
        self.forget_after, self.max_remembered = forget_after, max_remembered
        self.initial_peers = list(initial_peers)
        self._own_dht = dht is None
        self.dht = dht if dht is not None else DHT(initial_peers=self.initial_peers, client_mode=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dmoe-monitor-info")
        # channels of the monitor's own, closed once no poll finds their endpoint: through the process-wide pool,
        # each made-up endpoint (anyone can declare a cell at a new address each period) held a connection for
        # 10 minutes, and a few rotated cells ran the monitor out of file descriptors (review 79)
        # for as long as a TCP connection that never answers HTTP/2 lingers after its channel closed, which gRPC
        # bounds by the least time it gives a connection to come up (20 s by default: 8 channels a second kept 160)
        connect_ms = int(1000 * max(0.5, info_timeout))
        self._channels = ChannelPool(max_message_bytes=MAX_INFO_BYTES, shared_memory=False, hold_calls=False,
                                     idle_seconds=None, options=[("grpc.min_reconnect_backoff_ms", connect_ms)])
        self._encoded: tuple[dict[str, Any], bytes] | None = None  # the latest snapshot and its JSON
        self._encoding = threading.Lock()  # pages asking at once wait for one encoding
        self._colors: dict[str, str] = {}
        self._hues = 0  # colors handed out: the next hue (not len(_colors), which shrinks as endpoints are forgotten)
        self._answered: set[str] = set()  # endpoints that answered the latest poll: asked first in the next
        self._seen: dict[str, float] = {}  # endpoint -> time.monotonic() of the last poll that found it
        self._previous: dict[tuple[str, str], tuple[float, int]] = {}  # (uid, endpoint) -> (time, calls)
        self._lock = threading.Lock()
        self._polling = threading.Lock()
        self._snapshot: dict[str, Any] = self._empty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _empty(self) -> dict[str, Any]:
        return {"updated": None, "period": self.period, "initial_peers": self.initial_peers, "grid": list(self.grid),
                "dht": None, "layers": [{"name": layer, "grid": list(self.grid), "cells": math.prod(self.grid),
                                         "alive": 0, "experts": {}, "replicas": {}, "adopted": {},
                                         "adopted_last_hour": 0, "grid_mismatch": None}
                                        for layer in self.layers], "servers": []}

    def color(self, endpoint: str) -> str:
        """A color per server endpoint, fixed the first time the monitor sees it."""
        if endpoint not in self._colors:
            hue = (self._hues * GOLDEN_ANGLE + 200) % 360
            self._hues += 1
            self._colors[endpoint] = f"hsl({hue:.0f}, 70%, 50%)"
        return self._colors[endpoint]

    def _info(self, uid: str, endpoint: str) -> tuple[dict[str, Any] | None, float]:
        started = time.monotonic()
        try:
            info = expert_info(endpoint, uid, timeout=self.info_timeout, channels=self._channels)
        except Exception as error:  # noqa: BLE001 - a dead or wrong endpoint is what the view should show
            logger.debug("info of %s at %s failed: %s", uid, endpoint, error)
            info = None
        return info, time.monotonic() - started

    def poll(self) -> dict[str, Any]:
        """Reads the DHT and every alive expert now; stores and returns the new snapshot. One poll at a time: a
        caller's poll waits for the background thread's (their bookkeeping of calls per second is shared)."""
        with self._polling:
            return self._poll()

    def _poll(self) -> dict[str, Any]:
        snapshot = self._empty()
        located: dict[str, str] = {}
        for layer in snapshot["layers"]:
            try:
                alive = alive_experts(self.dht, layer["name"], self.grid)
                if not alive:  # (review 112 D3: a --grid of another depth than the swarm's showed an empty grid)
                    layer["grid_mismatch"] = grid_mismatch(self.dht, layer["name"], self.grid)
            except Exception as error:  # noqa: BLE001 - keep showing the swarm when one look-up fails
                logger.warning("reading layer %s from the DHT failed: %s", layer["name"], error)
                alive = {}
            layer["alive"] = len(alive)
            layer["experts"] = {uid: {"endpoint": endpoint} for uid, endpoint in alive.items()}
            located.update(alive)
        snapshot["dht"] = self._dht_state()  # (after the look-ups: they find out which contacts are silent)
        asked = self._ask(located)
        try:
            self._replication(snapshot)
        except Exception as error:  # noqa: BLE001 - the grid is worth showing without the replica counts
            logger.warning("reading the replication records from the DHT failed: %s", error)
        answers = asked()
        self._answered = {located[uid] for uid, (info, _) in answers.items() if info is not None}
        now = time.monotonic()
        servers: dict[str, dict[str, Any]] = {}
        latencies: dict[str, list[float]] = {}
        for layer in snapshot["layers"]:
            for uid, expert in layer["experts"].items():
                endpoint = expert["endpoint"]
                self._seen[endpoint] = now
                info, seconds = answers[uid]
                server = servers.setdefault(endpoint, {"endpoint": endpoint, "color": self.color(endpoint),
                                                       "experts": 0, "reachable": 0, "load": 0.0})
                server["experts"] += 1
                expert["reachable"] = info is not None
                if info is None:
                    continue
                server["reachable"] += 1
                latencies.setdefault(endpoint, []).append(seconds)
                calls = info["forward_calls"] + info["backward_calls"]
                before = self._previous.get((uid, endpoint))
                load = 0.0
                if before is not None and calls >= before[1] and now > before[0]:
                    load = (calls - before[1]) / (now - before[0])
                self._previous[(uid, endpoint)] = (now, calls)
                expert.update(forward_calls=info["forward_calls"], backward_calls=info["backward_calls"],
                              load=round(load, 3))
                server["load"] += load
        for endpoint, server in servers.items():
            samples = sorted(latencies.get(endpoint, []))
            server["latency_ms"] = round(1000 * samples[len(samples) // 2], 2) if samples else None
            server["load"] = round(server["load"], 3)
            for layer in snapshot["layers"]:
                for expert in layer["experts"].values():
                    if expert["endpoint"] == endpoint:
                        expert["color"], expert["latency_ms"] = server["color"], server["latency_ms"]
        snapshot["servers"] = sorted(servers.values(), key=lambda s: s["endpoint"])
        self._forget(now)
        self._channels.retain(servers)
        snapshot["updated"] = time.time()
        with self._lock:
            self._snapshot = snapshot
        return snapshot

    def _dht_state(self) -> dict[str, int] | None:
        """How many contacts the DHT node knows and how many of them answer (are not silent since their last
        question), or None for a directory that is no :class:`DHT`. With none answering, reads find nothing: the
        page showed that as an empty swarm, "0 of 16 experts alive on 0 servers", fresh each poll (review 112 D3)."""
        if not isinstance(self.dht, DHT):
            return None
        try:
            contacts, answering = self.dht.contacts(timeout=max(1.0, self.info_timeout))
            return {"contacts": contacts, "answering": answering}
        except (RuntimeError, TimeoutError) as error:  # closing, or a loop too busy to answer: unknown
            logger.debug("the DHT node's contacts could not be counted: %s", error)
            return None

    def _forget(self, now: float) -> None:
        """Drops what is kept of endpoints not seen for ``forget_after`` seconds, then of the least recently seen
        beyond ``max_remembered`` (never of those this poll found, seen at ``now``)."""
        stale = {endpoint for endpoint, seen in self._seen.items() if now - seen > self.forget_after}
        excess = len(self._seen) - len(stale) - self.max_remembered
        if excess > 0:
            oldest = sorted((seen, endpoint) for endpoint, seen in self._seen.items()
                            if endpoint not in stale and seen < now)
            stale.update(endpoint for _, endpoint in oldest[:excess])
        for endpoint in stale:
            del self._seen[endpoint]
        self._colors = {endpoint: color for endpoint, color in self._colors.items() if endpoint in self._seen}
        self._previous = {key: value for key, value in self._previous.items()
                          if key[1] in self._seen and now - value[0] <= self.forget_after}

    def _ask(self, located: dict[str, str]) -> Callable[[], dict[str, tuple[dict[str, Any] | None, float]]]:
        """Starts the ``info`` calls of a poll; the returned function waits for them: uid -> (info or None, seconds).

        The experts of endpoints that answered the previous poll are asked first, all at once; every other endpoint
        is asked for one of its experts, and for the others only once that one answered; whatever has not answered
        ``max(period, info_timeout)`` after the calls began (or ``info_timeout`` after the wait began, if that is
        later) is shown unreachable. Anyone may declare free cells at silent addresses, new ones each period: every
        such cell cost an ``info_timeout`` of one of the ``workers`` threads, and 64 of them stretched a 2 s poll to
        8 s and pushed the answering servers' calls behind theirs (review 91)."""
        started = time.monotonic()
        hosted: dict[str, list[str]] = {}
        for uid, endpoint in located.items():
            hosted.setdefault(endpoint, []).append(uid)
        calls = {uid: self._pool.submit(self._info, uid, endpoint)
                 for endpoint, uids in hosted.items() if endpoint in self._answered for uid in uids}
        probed = [endpoint for endpoint in hosted if endpoint not in self._answered]
        calls.update({hosted[endpoint][0]: self._pool.submit(self._info, hosted[endpoint][0], endpoint)
                      for endpoint in probed})

        def answers() -> dict[str, tuple[dict[str, Any] | None, float]]:
            deadline = max(started + max(self.period, self.info_timeout), time.monotonic() + self.info_timeout)
            found = {uid: self._result(calls[uid], deadline) for uids in hosted.values() for uid in uids[:1]}
            for endpoint in probed:
                first, *rest = hosted[endpoint]
                if found[first][0] is None:  # no need to wait for each of its other cells to fail alike
                    found.update({uid: found[first] for uid in rest})
                else:
                    calls.update({uid: self._pool.submit(self._info, uid, endpoint) for uid in rest})
            found.update({uid: self._result(call, deadline) for uid, call in calls.items() if uid not in found})
            return found
        return answers

    def _result(self, future: concurrent.futures.Future, deadline: float) -> tuple[dict[str, Any] | None, float]:
        """``future``'s result, or no answer once ``deadline`` (``time.monotonic()``) has passed; unless the monitor
        is closing: then :class:`_Closing` at once. A poll waiting on the ``info`` calls of many unreachable experts
        held a Ctrl-C up for 20 s."""
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0 and not future.done():
                future.cancel()  # if it has not started: a worker free for the next poll
                return None, self.info_timeout
            try:
                return future.result(timeout=min(0.1, max(0.0, left)))
            except concurrent.futures.TimeoutError:
                continue
            except concurrent.futures.CancelledError:
                break
        raise _Closing

    def _replication(self, snapshot: dict[str, Any]) -> None:
        """Per layer: how many servers announce a replica of each cell's expert (``replicas``: uid -> count, cells
        with none left out) and the cells adopted in the last hour (``adopted``: uid -> time.time() of it)."""
        cells = {layer: grid_uids(layer, self.grid) for layer in self.layers}
        keys = [replicas_key(uid) for uids in cells.values() for uid in uids]
        keys += [adopted_key(layer) for layer in self.layers]
        records = self.dht.get_many(keys)
        now = time.time()
        recent_after = now - ADOPTION_MEMORY
        for layer in snapshot["layers"]:
            name = layer["name"]
            # counted per machine, as the adopters' votes count holders: keys cost nothing, and one peer writing an
            # entry per key showed any count on every cell, dead ones included (review 91). The counts are what is
            # announced: a holder is not asked whether it holds the replica
            local = getattr(self.dht, "outbound_host", None) is None  # every peer on this machine
            counts = {uid: len({holding_machine(h.endpoint, local) for h in holders(records[replicas_key(uid)])})
                      for uid in cells[name]}
            layer["replicas"] = {uid: count for uid, count in counts.items() if count}
            alive = set(layer.get("experts", {}))
            # (a time ahead of this clock is no recent adoption: anyone may write one, and it stayed "recent" for
            # as long as the DHT kept it; nor is one of a cell nobody serves now: a forged one outlined dead cells)
            layer["adopted"] = {a.uid: a.at for a in adoptions(name, records[adopted_key(name)])
                                if a.uid in alive and recent_after <= a.at <= now + MAX_CLOCK_SKEW}
            layer["adopted_last_hour"] = len(layer["adopted"])

    def snapshot(self) -> dict[str, Any]:
        """The latest view (see :meth:`poll`), as plain JSON-able data."""
        with self._lock:
            return self._snapshot

    def snapshot_json(self) -> bytes:
        """:meth:`snapshot` as JSON, encoded once per poll however many pages ask: a snapshot of a large grid takes
        0.2 s of the interpreter to encode, and a few clients asking in a loop starved the polls (review 79)."""
        with self._encoding:
            snapshot = self.snapshot()
            if self._encoded is None or self._encoded[0] is not snapshot:
                self._encoded = (snapshot, json.dumps(snapshot).encode())
            return self._encoded[1]

    def start(self) -> "SwarmMonitor":
        """Polls at once and then every ``period`` seconds, in a background thread.

        The first poll runs there too: it reads every cell of the grid and asks every alive expert for its info,
        which takes up to seconds, and the page should be served (showing "updated never") and signals obeyed
        meanwhile."""
        self._thread = threading.Thread(target=self._run, name="dmoe-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except _Closing:
                return
            except Exception:  # noqa: BLE001 - the monitor outlives a bad poll
                if self._stop.is_set():  # e.g. its info calls refused by the pool close() shut down
                    return
                logger.exception("poll failed")
            self._stop.wait(self.period)

    def close(self) -> None:
        """Stops polling and closes the DHT node it made; safe to call twice. A poll in progress ends without
        waiting for the experts' answers (calls already made end with their ``info_timeout``, on their own)."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(30)  # a DHT look-up in progress ends with its own timeout
        if self._own_dht:
            self.dht.close()
        self._channels.close()

    def __enter__(self) -> "SwarmMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def grid_mismatch(dht: DHT | ContinuationSource, layer: str, grid: Sequence[int]) -> str | None:
    """Why ``layer`` shows no expert inside ``grid`` although the DHT holds declarations under its name: its
    experts have another number of grid dimensions (the look-up found ``ffn2.0.0`` as a prefix with continuations,
    not as an expert, and every cell showed "not declared"), or lie outside ``grid``; None when nothing is declared.
    Follows one declared prefix down, two look-ups a dimension (experts, then any continuation). The declarations
    read are anyone's to write: a hint for the operator, not a fact (review 112 D3)."""
    source = continuation_source(dht)
    prefix = layer
    for depth in range(1, MAX_GRID_DEPTH + 1):
        experts = source.get_alive_continuations([prefix], [prefix]).get(prefix) or {}
        if experts:
            example = f"{prefix}.{min(experts)}"
            if depth != len(grid):
                more = "more" if depth > len(grid) else "fewer"
                return (f"layer {layer} has {more} grid dimensions than --grid {' '.join(map(str, grid))}: its "
                        f"experts are declared as {example} ({depth} dimension{'s' if depth > 1 else ''})")
            return (f"layer {layer}'s experts are declared outside --grid {' '.join(map(str, grid))} "
                    f"(e.g. {example})")
        below = source.get_alive_continuations([prefix]).get(prefix) or {}
        if not below:
            return None
        prefix = f"{prefix}.{min(below)}"
    return None


def holding_machine(endpoint: str, local: bool) -> str:
    """The machine a replica holder's ``endpoint`` counts as (no name is resolved: a poll must not wait on DNS): an
    IPv4 address or IPv6 /64, a host name as written; a loopback endpoint is a machine of its own in a local swarm
    (``local``: every server announces 127.0.0.1 there), and one machine, this one, otherwise."""
    host = endpoint_host(endpoint)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    return counted_machine(address, endpoint, local)


def page() -> bytes:
    """The HTML of the live view (``dmoe/monitor/index.html``)."""
    return resources.files(__package__).joinpath("index.html").read_bytes()


class MonitorServer:
    """Serves the page at ``/`` and ``monitor.snapshot()`` as JSON at ``/api/swarm``, from a daemon thread.

    Args:
        monitor: whose snapshots to serve; may be set later (:attr:`monitor`), before :meth:`start`: ``dmoe-monitor``
            binds its port first, so that a bad ``--host`` or a port in use is refused before its DHT node joins
            (review 112 D5).
        host, port: where to listen (port 0: a free one; see :attr:`endpoint` once started).
        idle_timeout: seconds a connection may send nothing before it is closed (each open connection holds a
            thread: idle ones would pile up).
        max_connections: connections served at once; more are answered 503 at once (see :mod:`dmoe.httpd`).
        limits: all the limits of the HTTP server (then ``idle_timeout`` and ``max_connections`` are unused).
    """

    def __init__(self, monitor: SwarmMonitor | None, host: str = "127.0.0.1", port: int = 0,
                 idle_timeout: float = IDLE_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 limits: HTTPLimits | None = None):
        self.monitor = monitor
        html = page()
        outer = self
        limits = limits or HTTPLimits(max_connections=max_connections, idle_timeout=idle_timeout)

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self.send_body(html, "text/html; charset=utf-8")
                elif path == "/api/swarm":
                    self.send_body(outer.monitor.snapshot_json(), "application/json")
                else:
                    self.send_error(HTTPStatus.NOT_FOUND)

        self._http = HTTPThread(BoundedHTTPServer(host, port, Handler, limits), "dmoe-monitor-http")
        self.endpoint = reachable_endpoint(host, self._http.port)

    def start(self) -> "MonitorServer":
        """Starts answering requests."""
        self._http.start()
        return self

    def close(self) -> None:
        """Stops answering and releases the port."""
        self._http.close()

    def __enter__(self) -> "MonitorServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["MonitorServer", "SwarmMonitor", "page"]
