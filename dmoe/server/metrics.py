"""Prometheus metrics of one expert server: requests, latency, batches, queues, errors and optimizer steps.

Each :class:`ServerMetrics` owns its own ``CollectorRegistry`` (never the process-wide default), so several
servers can live in one process, as they do in tests. Scrape ``http://HOST:PORT/metrics`` once
:meth:`ServerMetrics.serve` has started the endpoint.

Series (``expert`` is the uid; ``method`` is ``forward`` or ``backward``):
    dmoe_requests_total{expert, method, code}      expert requests answered, by gRPC status code (OK,
                                                    INVALID_ARGUMENT, ...); each item of a batch call is one
    dmoe_request_seconds{expert, method}            histogram of the time from receiving a call to answering it
    dmoe_grpc_calls_total{rpc}                      gRPC calls received, by RPC (forward, forward_batch, ...;
                                                    forward_shared, forward_batch_shared, ...: through shared
                                                    memory, see :mod:`dmoe.wire.shared_memory`)
    dmoe_batch_rows{expert, method}                 histogram of rows per batch the runtime ran
    dmoe_batch_seconds{expert, method}              histogram of compute time per batch
    dmoe_queue_wait_seconds{expert, method}         histogram of time requests waited in their task pool
    dmoe_batch_errors_total{expert, method}         batches whose compute raised
    dmoe_optimizer_steps_total{expert}              optimizer steps applied (one per backward batch whose
                                                    gradients were finite: the backend's ``updates``)
    dmoe_optimizer_steps_skipped_total{expert}      optimizer steps the expert skipped, its gradients not finite
                                                    (sent by a client, or an overflow): its ``skipped_steps``
    dmoe_queue_length{expert, method}               requests waiting now (read at scrape time)
    dmoe_activation_cache_total{result}             backward requests naming an activation id, by what happened:
                                                    hit (kept graph used) or miss (forward recomputed); and kept
                                                    forwards dropped unused: evicted (room, age), invalidated (step),
                                                    released (memory given to a batch that ran out of it)
    dmoe_activation_cache_bytes{device}             bytes of activations kept now, where they are (cpu, cuda:0)
    dmoe_activation_cache_peak_bytes{device}        the most bytes kept there at once (to size the budget by)
    dmoe_held_bytes{kind}                           bytes counted against --max-queued-mb now: ``queued`` (inputs
                                                    waiting or computing), ``arriving`` (streams), ``answers`` (not
                                                    yet taken by their clients); ``dmoe_held_bytes_limit`` the budget
    dmoe_stage_seconds_total{stage}                 with ``--profile`` only: seconds spent in each stage of the
    dmoe_stage_events_total{stage}                  server's path, and how many calls, requests or batches they
                                                    sum over (:mod:`dmoe.server.profile`)
"""
from __future__ import annotations

import asyncio

import contextlib
import functools
import inspect
import logging
import time
import urllib.request
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Iterator, Sequence

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.registry import Collector

from dmoe.endpoints import reachable_endpoint
from dmoe.httpd import (IDLE_TIMEOUT, MAX_CONNECTIONS, RENDER_INTERVAL, BoundedHTTPServer, HTTPLimits, HTTPThread,
                        QuietHandler, ThrottledPage)
from dmoe.wire import status_code
from dmoe.wire.shared_memory import METHODS as SHARED_METHODS

if TYPE_CHECKING:
    from dmoe.server.activations import ActivationCache
    from dmoe.server.backend import ExpertBackend
    from dmoe.server.profile import StageClock
    from dmoe.server.servicer import ExpertServicer, HostedExpert
    from dmoe.server.task_pool import Task, TaskPool

logger = logging.getLogger(__name__)

UNKNOWN_EXPERT = "unknown"  # label for calls naming an expert this server does not host (bounds the label set)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _QueueLengths(Collector):
    """Reads every task pool's length when scraped, so nothing is updated on the hot path."""

    def __init__(self, pools: Callable[[], Iterable[tuple[str, str, "TaskPool"]]]):
        self._pools = pools

    def collect(self):
        gauge = GaugeMetricFamily("dmoe_queue_length", "requests waiting in a task pool", labels=["expert", "method"])
        for uid, method, pool in self._pools():
            gauge.add_metric([uid, method], len(pool))
        yield gauge


class _ActivationCacheStats(Collector):
    """Reads the server's activation cache counters when scraped."""

    def __init__(self, cache: "ActivationCache"):
        self._cache = cache

    def collect(self):
        cache = self._cache
        counts = CounterMetricFamily("dmoe_activation_cache", "activation cache outcomes", labels=["result"])
        for result, count in (("hit", cache.hits), ("miss", cache.misses), ("evicted", cache.evicted),
                              ("invalidated", cache.invalidated), ("released", cache.released)):
            counts.add_metric([result], count)
        yield counts
        held = GaugeMetricFamily("dmoe_activation_cache_bytes", "bytes of activations kept now, by device",
                                 labels=["device"])
        peak = GaugeMetricFamily("dmoe_activation_cache_peak_bytes", "the most bytes of activations kept at once, "
                                 "by device", labels=["device"])
        for device, (now, most) in sorted(cache.usage().items()):
            held.add_metric([device], now)
            peak.add_metric([device], most)
        yield held
        yield peak


class _HeldBytes(Collector):
    """Reads what the servicer counts against its memory budget when scraped (:meth:`ServerMetrics.watch_budget`):
    an operator sees clients that queue faster than the experts compute, or never read their answers."""

    def __init__(self, servicer: "ExpertServicer"):
        self._servicer = servicer

    def collect(self):
        servicer = self._servicer
        held = GaugeMetricFamily("dmoe_held_bytes", "bytes counted against --max-queued-mb now", labels=["kind"])
        for kind, value in (("queued", servicer.queued_bytes), ("arriving", servicer.arriving_bytes),
                            ("answers", servicer.answer_bytes)):
            held.add_metric([kind], value)
        yield held
        yield GaugeMetricFamily("dmoe_held_bytes_limit", "--max-queued-mb, in bytes", value=servicer.max_queued_bytes)


class _CudaGraphStats(Collector):
    """Reads the experts' CUDA graph counters when scraped (``--cuda-graphs``): a benchmark or an operator can tell
    graphs that replay from a server that asked for them and computes eagerly (a failed capture turns them off)."""

    def __init__(self, experts: Callable[[], Iterable[tuple[str, "HostedExpert"]]]):
        self._experts = experts

    def collect(self):
        captures = CounterMetricFamily("dmoe_cuda_graph_captures", "CUDA graphs captured (one per expert, kind and "
                                       "bucket of batch sizes)", labels=["expert"])
        replays = CounterMetricFamily("dmoe_cuda_graph_replays", "forwards and training steps computed by replaying "
                                      "a CUDA graph", labels=["expert", "kind"])
        off = GaugeMetricFamily("dmoe_cuda_graphs_off", "1 when the server asked for CUDA graphs and they were "
                                "turned off (a capture failed: its experts compute eagerly)", labels=["expert"])
        for uid, expert in self._experts():
            graphs = expert.backend.graphs
            if graphs is None:
                continue
            captures.add_metric([uid], graphs.captures)
            for kind in ("forward", "train"):
                replays.add_metric([uid, kind], graphs.replays_by_kind[kind])
            off.add_metric([uid], float(graphs.switch.off is not None))
        yield captures
        yield replays
        yield off


class _StageTimes(Collector):
    """Reads the server's stage clock when scraped."""

    def __init__(self, stages: "StageClock"):
        self._stages = stages

    def collect(self):
        seconds = CounterMetricFamily("dmoe_stage_seconds", "seconds spent in a stage of the server's path",
                                      labels=["stage"])
        events = CounterMetricFamily("dmoe_stage_events", "calls, requests or batches a stage's seconds sum over",
                                     labels=["stage"])
        for stage, (total, count) in self._stages.snapshot().items():
            seconds.add_metric([stage], total)
            events.add_metric([stage], count)
        yield seconds
        yield events


class ServerMetrics:
    """The metrics of one server, in a registry of its own.

    Args:
        experts: uid -> hosted expert, as the servicer holds them (their pools give queue lengths and tell
            which batch belongs to which expert).
        activations: the server's activation cache, whose counters are read at scrape time.
        stages: the server's stage clock (``--profile``): exposed, and given each call's time as ``call`` and each
            request's wait in its task pool as ``queue``.

    Wire it up with :meth:`interceptor` (the gRPC server's calls) and :meth:`observe_batch` (the runtime's
    batches); :meth:`serve` exposes the registry over HTTP and :meth:`close` stops that endpoint.
    """

    def __init__(self, experts: dict[str, "HostedExpert"], activations: "ActivationCache | None" = None,
                 stages: "StageClock | None" = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.experts = experts
        #: id(pool) -> (uid, method, the backend whose steps its batches take: backward pools with an optimizer)
        self._pool_labels: dict[int, tuple[str, str, "ExpertBackend | None"]] = {}
        self._skipped_seen: dict[int, int] = {}  # id(backward pool) -> its backend's skipped_steps when last seen
        for uid, expert in experts.items():
            self.add_expert(uid, expert)
        labels = ["expert", "method"]
        self.requests = Counter("dmoe_requests", "calls answered, by gRPC status code", labels + ["code"],
                                registry=self.registry)
        self.grpc_calls = Counter("dmoe_grpc_calls", "gRPC calls received, by RPC", ["rpc"], registry=self.registry)
        self.request_seconds = Histogram("dmoe_request_seconds", "time from receiving a call to answering it",
                                         labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_rows = Histogram("dmoe_batch_rows", "rows per batch the runtime ran", labels,
                                    buckets=ROW_BUCKETS, registry=self.registry)
        self.batch_seconds = Histogram("dmoe_batch_seconds", "compute time per batch", labels,
                                       buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_wait_seconds = Histogram("dmoe_queue_wait_seconds", "time requests waited in their task pool",
                                            labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_errors = Counter("dmoe_batch_errors", "batches whose compute raised", labels,
                                    registry=self.registry)
        self.optimizer_steps = Counter("dmoe_optimizer_steps", "optimizer steps applied to an expert", ["expert"],
                                       registry=self.registry)
        self.optimizer_steps_skipped = Counter("dmoe_optimizer_steps_skipped", "optimizer steps an expert skipped, "
                                               "its gradients not finite", ["expert"], registry=self.registry)
        self.registry.register(_QueueLengths(self._pools))
        self.registry.register(_CudaGraphStats(lambda: list(self.experts.items())))
        if activations is not None:
            self.registry.register(_ActivationCacheStats(activations))
        self.stages = stages
        if stages is not None:
            self.registry.register(_StageTimes(stages))
        self._http: HTTPThread | None = None
        self.endpoint: str | None = None
        self.page: ThrottledPage | None = None  # what the endpoint serves, once serve() started it

    def watch_budget(self, servicer: "ExpertServicer") -> None:
        """Serves what ``servicer`` counts against its memory budget (``dmoe_held_bytes{kind}``)."""
        self.registry.register(_HeldBytes(servicer))

    def add_expert(self, uid: str, expert: "HostedExpert") -> None:
        """Labels the batches of an expert added to the running server (the server adds it to ``experts``)."""
        backend = expert.backend if expert.backend.optimizer is not None else None
        self._pool_labels[id(expert.forward_pool)] = (uid, "forward", None)
        self._pool_labels[id(expert.backward_pool)] = (uid, "backward", backend)
        if backend is not None:
            self._skipped_seen[id(expert.backward_pool)] = backend.skipped_steps

    def remove_expert(self, uid: str) -> None:
        """Forgets the pools of an expert the server stopped serving (its later calls count as ``unknown``)."""
        for key in [key for key, labels in self._pool_labels.items() if labels[0] == uid]:
            del self._pool_labels[key]
            self._skipped_seen.pop(key, None)

    def _pools(self) -> Iterable[tuple[str, str, "TaskPool"]]:
        for uid, expert in list(self.experts.items()):  # experts may be added meanwhile (adoption)
            yield uid, "forward", expert.forward_pool
            yield uid, "backward", expert.backward_pool

    # ---- runtime side ----
    def observe_batch(self, pool: "TaskPool", batch: Sequence["Task"], started: float, seconds: float,
                      error: BaseException | None) -> None:
        """Records one batch the runtime ran (``started``: ``time.monotonic()`` when compute began)."""
        labels = self._pool_labels.get(id(pool))
        if labels is None:
            return
        uid, method, backend = labels
        if backend is not None:
            self._count_step(uid, id(pool), backend, error is None)
        for task in batch:
            waited = max(0.0, started - task.created)
            self.queue_wait_seconds.labels(uid, method).observe(waited)
            if self.stages is not None:
                self.stages.add("queue", waited)
        if error is not None:
            self.batch_errors.labels(uid, method).inc()
            return
        self.batch_rows.labels(uid, method).observe(sum(task.rows for task in batch))
        self.batch_seconds.labels(uid, method).observe(seconds)

    def _count_step(self, uid: str, key: int, backend: "ExpertBackend", succeeded: bool) -> None:
        """Counts the optimizer step of one backward batch: skipped if the backend's ``skipped_steps`` grew since
        the last batch (eager and CUDA-graph steps both count there), else applied if the batch succeeded: counting
        every backward batch that returned counted the skipped steps as applied. (The runtime runs one batch of an
        expert at a time and observes it before the next, so the difference is this batch's.)"""
        skipped = backend.skipped_steps - self._skipped_seen.get(key, backend.skipped_steps)
        self._skipped_seen[key] = backend.skipped_steps
        if skipped > 0:
            self.optimizer_steps_skipped.labels(uid).inc(skipped)
        elif succeeded:
            self.optimizer_steps.labels(uid).inc()

    # ---- servicer side ----
    def _expert_label(self, uid: str) -> str:
        return uid if uid in self.experts else UNKNOWN_EXPERT

    def _record(self, uid: str, method: str, context: Any, started: float, error: BaseException | None) -> None:
        if error is None:
            code = grpc.StatusCode.OK
        else:
            code = _failure_code(context, error)
        label = self._expert_label(uid)
        elapsed = time.monotonic() - started
        self.requests.labels(label, method, code.name).inc()
        self.request_seconds.labels(label, method).observe(elapsed)
        if self.stages is not None:
            self.stages.add("call", elapsed)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """A gRPC server interceptor that counts every forward/backward call (unary, batch and streamed): pass it
        to ``grpc.aio.server(interceptors=[...])``. The servicer itself knows nothing of metrics."""
        return _MetricsInterceptor(self)

    def _wrap_unary(self, handler: Callable, method: str) -> Callable:
        @functools.wraps(handler)
        async def counted(request, context):
            self.grpc_calls.labels(method).inc()
            started, error = time.monotonic(), None
            try:
                return await handler(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                self._record(request.uid, method, context, started, error)
        return counted

    def _wrap_batch(self, handler: Callable, method: str) -> Callable:
        """Counts each item of a batch call as a request of its own, with the item's status code."""
        @functools.wraps(handler)
        async def counted(request, context):
            self.grpc_calls.labels(f"{method}_batch").inc()
            started = time.monotonic()
            try:
                response = await handler(request, context)
            except BaseException as error:
                # the whole call was refused (no items, too many): one request of no expert
                code = _failure_code(context, error)
                self.requests.labels(UNKNOWN_EXPERT, method, code.name).inc()
                raise
            self._count_items(request, response, method, started)
            return response
        return counted

    def _count_items(self, request: Any, response: Any, method: str, started: float) -> None:
        elapsed = time.monotonic() - started
        if self.stages is not None:
            self.stages.add("call", elapsed)
        for item, result in zip(request.items, response.results):
            label = self._expert_label(item.uid)
            self.requests.labels(label, method, (status_code(result.code) or grpc.StatusCode.UNKNOWN).name).inc()
            self.request_seconds.labels(label, method).observe(elapsed)

    def _wrap_shared(self, handler: Callable) -> Callable:
        """``call_shared``: counted as the call it carries (its requests by expert and status), once the server
        read it; a call the server refused (the client sends it the plain way) counts as a gRPC call only."""
        @functools.wraps(handler)
        async def counted(request, context):
            rpc = request.call.method if request.call.method in SHARED_METHODS else "unknown"  # labels stay few
            method, _, variant = rpc.partition("_")
            self.grpc_calls.labels(f"{rpc}_shared").inc()
            started, error, answer = time.monotonic(), None, None
            try:
                answer = await handler(request, context)
                return answer
            except BaseException as exc:
                error = exc
                raise
            finally:
                parsed = request.parsed
                if method not in ("forward", "backward") or (answer is not None and answer.refused):
                    pass
                elif variant != "batch":
                    self._record(parsed.uid if parsed is not None else "", method, context, started, error)
                elif error is not None or parsed is None:
                    code = _failure_code(context, error)
                    self.requests.labels(UNKNOWN_EXPERT, method, code.name).inc()
                else:
                    self._count_items(parsed, answer.answer, method, started)
        return counted

    def _wrap_stream(self, handler: Callable, method: str) -> Callable:
        """``handler`` counted: an async generator of answers, or a coroutine sending them with ``context.write``
        (as the servicer's streamed calls do), wrapped as the same kind."""
        def remembering(request_iterator, uid: list[str]) -> AsyncIterator:
            async def remember_uid():
                async for message in request_iterator:
                    if not uid[0]:
                        uid[0] = message.uid
                    yield message
            return remember_uid()

        @contextlib.contextmanager
        def counting(context) -> Iterator[list[str]]:
            """One streamed call counted, as the expert its first message names (the list it yields)."""
            self.grpc_calls.labels(f"{method}_stream").inc()
            started, error, uid = time.monotonic(), None, [""]
            try:
                yield uid
            except BaseException as exc:
                error = exc
                raise
            finally:
                self._record(uid[0], method, context, started, error)

        if not inspect.isasyncgenfunction(handler):
            @functools.wraps(handler)
            async def counted_writing(request_iterator, context) -> None:
                with counting(context) as uid:
                    await handler(remembering(request_iterator, uid), context)
            return counted_writing

        @functools.wraps(handler)
        async def counted(request_iterator, context) -> AsyncIterator:
            with counting(context) as uid:
                async for response in handler(remembering(request_iterator, uid), context):
                    yield response
        return counted

    # ---- HTTP endpoint ----
    def serve(self, host: str = "127.0.0.1", port: int = 0, max_connections: int = MAX_CONNECTIONS,
              idle_timeout: float = IDLE_TIMEOUT, limits: HTTPLimits | None = None,
              render_interval: float = RENDER_INTERVAL) -> str:
        """Serves ``/metrics`` on ``host:port`` (0: a free port) from a daemon thread; returns ``HOST:PORT``. At most
        ``max_connections`` at once, each closed after ``idle_timeout`` seconds without a byte, and the other limits
        of :class:`~dmoe.httpd.HTTPLimits` (``limits``, when given, sets them all): prometheus_client's own server
        gave every connection a thread for as long as the client kept it open. Renders of the page take at most a
        fifth of the process's time, and start at least ``render_interval`` seconds apart, however many clients
        scrape it (:class:`~dmoe.httpd.ThrottledPage`: each render holds the GIL of this server's process, 178 ms
        with 64 experts); what a scrape reads is never older than the request.
        Raises OSError when ``host:port`` cannot be listened on."""
        if self._http is not None:
            raise RuntimeError("the metrics endpoint is running already")
        registry = self.registry
        page = self.page = ThrottledPage(lambda: generate_latest(registry), render_interval)
        limits = limits or HTTPLimits(max_connections=max_connections, idle_timeout=idle_timeout)

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
                if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                    self.send_error(404)
                    return
                self.send_body(page.get(), CONTENT_TYPE_LATEST)

        self._http = HTTPThread(BoundedHTTPServer(host, port, Handler, limits), "dmoe-metrics-http").start()
        self.endpoint = reachable_endpoint(host, self._http.port)
        logger.info("metrics on http://%s/metrics", self.endpoint)
        return self.endpoint

    def close(self) -> None:
        """Stops the HTTP endpoint (if serving); safe to call twice."""
        if self._http is not None:
            self._http.close()
            self._http = None


class _MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the handlers of ``ExpertService``'s forward/backward RPCs with the metrics' counting wrappers."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method -> (its handler, the wrapped one): asked every call

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        cached = self._wrapped.get(handler_call_details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler_call_details.method, handler)
        self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, full_method: str, handler):
        rpc = full_method.rsplit("/", 1)[-1]  # "/dmoe.ExpertService/forward_batch" -> forward_batch
        if rpc == "call_shared" and full_method.startswith("/dmoe.ExpertService/") and handler.unary_unary:
            return handler._replace(unary_unary=self.metrics._wrap_shared(handler.unary_unary))
        method, _, variant = rpc.partition("_")
        if method not in ("forward", "backward"):
            return handler
        if variant == "stream" and handler.stream_stream is not None:
            return handler._replace(stream_stream=self.metrics._wrap_stream(handler.stream_stream, method))
        if variant == "batch" and handler.unary_unary is not None:
            return handler._replace(unary_unary=self.metrics._wrap_batch(handler.unary_unary, method))
        if not variant and handler.unary_unary is not None:
            return handler._replace(unary_unary=self.metrics._wrap_unary(handler.unary_unary, method))
        return handler


def read_metrics(metrics_endpoint: str, timeout: float = 30.0) -> list[Sample]:
    """Every sample of the metrics page a server serves at ``HOST:PORT`` (how benchmarks read remote servers)."""
    with urllib.request.urlopen(f"http://{metrics_endpoint}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _failure_code(context: Any, error: BaseException | None) -> grpc.StatusCode:
    """The status of a call whose handler raised ``error``: the one it aborted with, CANCELLED for a call the client
    cancelled or let pass its deadline (the layer cancels late experts all the time: counted as UNKNOWN, a server
    error, a healthy swarm showed a steady stream of them, review 91), else UNKNOWN (a bug)."""
    code = _status_code(context)
    if code is not None:
        return code
    cancelled = isinstance(error, asyncio.CancelledError)
    if not cancelled:
        try:
            cancelled = bool(context.cancelled())
        except Exception:  # noqa: BLE001 - contexts of tests may not know
            pass
    return grpc.StatusCode.CANCELLED if cancelled else grpc.StatusCode.UNKNOWN


def _status_code(context: Any) -> grpc.StatusCode | None:
    """The status an aborted handler set, where the context can tell (grpc.aio's does)."""
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - contexts of tests or older grpc may not know
        return None
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return status_code(code)
    return None
