"""``ExpertServer``: hosts experts behind gRPC; owns the runtime workers and the asyncio loop thread."""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import grpc
import torch

from dmoe.endpoints import PortUnavailable, join_host_port, reachable_endpoint
from dmoe.experts import ExpertBuildError, create_expert, expert_class, expert_seed
from dmoe.server.activations import ActivationCache
from dmoe.server.backend import ExpertBackend, make_optimizer
from dmoe.server.cuda_graphs import GraphSwitch
from dmoe.server.checkpoints import CheckpointNotWritten, Checkpoints
from dmoe.server.decoding import RejectUndecodable
from dmoe.server.faults import FaultConfig, Faults
from dmoe.server.metrics import ServerMetrics
from dmoe.server.profile import StageClock
from dmoe.server.runtime import Runtime, is_out_of_memory
from dmoe.server.servicer import ExpertServicer, HostedExpert, add_to_server
from dmoe.uid import check_uid, expand_pattern
from dmoe.wire import MAX_MESSAGE_BYTES, grpc_options, parse_compression
from dmoe.wire.shared_memory import SWEEP_SECONDS as SEGMENT_SWEEP_SECONDS
from dmoe.wire.shared_memory import SegmentMaps

if TYPE_CHECKING:  # the server calls whatever it is given; it needs no DHT of its own
    from dmoe.directory import Announcer
    from dmoe.replicas import Replication

logger = logging.getLogger(__name__)

#: the shortest period of the sweep that expires kept forwards (``activation_ttl / 2``, at least this)
MIN_SWEEP_SECONDS = 0.05

#: builds the backend of one more expert like the server's others (``ExpertServer.create`` makes one)
BackendFactory = Callable[[str], ExpertBackend]


@dataclass
class ServerConfig:
    """How a server listens and runs; every field has a sensible default.

    Attributes:
        host: interface to bind; the endpoint reported to clients uses it (``0.0.0.0`` is reported as 127.0.0.1).
        port: 0 picks a free port.
        device: ``'cuda'``, ``'cpu'``, ... ; None uses cuda when available.
        max_batch_size: most rows in one request and in one batch the runtime forms.
        autocast: ``'bf16'``/``'fp16'`` to compute under torch.autocast; None for full precision.
        response_compression: ``'none'``, ``'float16'`` or ``'uint8'``, used when a request asks for none.
        max_message_bytes: limit of one gRPC message (larger payloads must be streamed).
        max_stream_bytes: limit of one streamed request in total.
        max_stream_seconds: a streamed request not received whole this many seconds after its call began is
            refused (DEADLINE_EXCEEDED): a stalled stream holds its bytes, counted against ``max_queued_mb``, no
            longer.
        shutdown_grace: seconds in-flight calls get to finish on ``close()``.
        faults: latency and failures to inject into every expert call (experiments only); None: none.
        checkpoint_dir: where experts are checkpointed (see :mod:`dmoe.server.checkpoints`); a server started
            with a directory holding a checkpoint restores every expert from it before serving. None: no checkpoints.
        checkpoint_interval: seconds between periodic checkpoints (one is also written on ``close()``).
        reject_nonfinite: refuse (INVALID_ARGUMENT) requests whose floating-point tensors hold NaN or Inf, before
            they reach an expert. On by default: one bad client must not spoil a batch shared with others.
        max_abs_value: refuse (INVALID_ARGUMENT) requests holding values of a larger magnitude (0: no limit). A
            finite but huge gradient (2e19 from one flipped bit) would push an expert's weights past what float32
            outputs survive in one SGD step. It bounds each value, not a step: two backwards of 4096 rows of 1e6
            (inputs and gradients) still wreck an SGD expert without ``clip_grad_norm`` (review 55); Adam's step
            is bounded by its learning rate whatever the gradient.
        metrics_port: serve Prometheus metrics (:mod:`dmoe.server.metrics`) on this port, 0 for a free one;
            None: collect them (``server.metrics``) but serve no endpoint.
        metrics_host: interface of the metrics endpoint; None: the same as ``host``.
        activation_cache_mb: (:meth:`ExpertServer.create`) MiB of activations kept between a forward and its
            backward, so that backward skips recomputing the forward (:mod:`dmoe.server.activations`); 0: always
            recompute.
        activation_ttl: seconds a kept forward waits for its backward (the server sweeps every ``ttl / 2`` s, so
            one is dropped at most 1.5 ttl after its forward even when no other request comes).
        workers: threads that compute (see :class:`~dmoe.server.runtime.Runtime`); torch's intra-op threads are
            shared out between them. None: two on a CPU with two or more threads (each half of them), one on a
            GPU.
        overlap_copies: on a GPU, copy through pinned memory on each worker's own copy stream and wait once per
            batch (:mod:`dmoe.server.transfer`); False (the default: faster on the GPUs measured, see
            benchmarks/README.md): plain blocking copies. No effect on a CPU.
        cuda_graphs: on a GPU, replay each expert's forward and its training step (forward again, backward,
            optimizer step) as CUDA graphs, one per bucket of batch sizes (:mod:`dmoe.server.cuda_graphs`): one launch
            instead of one per kernel, where an expert's work at a layer's sizes is bound by launching kernels. Off by
            default: each bucket's graphs cost device memory, and forwards then keep only their inputs (backward
            recomputes them inside the graph). Needs a CUDA device and one compute worker (``workers`` 1 or None).
        profile: time every stage of the server's path (decode, queue, batch, copies, compute, encode; see
            :mod:`dmoe.server.profile`) into ``server.stages`` and the metrics. On a GPU it synchronises the
            device between stages, so leave it off where speed counts.
        shared_memory: clients on this host (connected over loopback) may pass requests and answers through
            memory they share with the server instead of gRPC's transport (:mod:`dmoe.wire.shared_memory`);
            False: the server refuses, and they call the plain way.
        max_queued_mb: MiB of inputs that the requests waiting for the experts (or computing) may hold in all;
            more are refused with RESOURCE_EXHAUSTED (clients move on to other experts), so that clients sending
            faster than the experts compute, or on purpose, cannot take all of the server's memory. Streamed
            requests count as their messages arrive, and while anything else is queued or arriving those still
            arriving may take at most half of it; answers count until their clients have taken them (see
            :class:`~dmoe.server.servicer.ExpertServicer`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    device: str | None = None
    max_batch_size: int = 4096
    autocast: str | None = None
    response_compression: str = "none"
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_stream_bytes: int = 1 << 30
    max_stream_seconds: float = 120.0
    shutdown_grace: float = 1.0
    faults: FaultConfig | None = None
    checkpoint_dir: str | None = None
    checkpoint_interval: float = 60.0
    reject_nonfinite: bool = True
    max_abs_value: float = 1e6
    metrics_port: int | None = None
    metrics_host: str | None = None
    activation_cache_mb: float = 512.0
    activation_ttl: float = 60.0
    workers: int | None = None
    overlap_copies: bool = False
    cuda_graphs: bool = False
    profile: bool = False
    shared_memory: bool = True
    max_queued_mb: float = 1024.0


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_device(device: torch.device) -> None:
    """Raises ValueError saying why this torch build cannot compute on ``device``: no CUDA, a CUDA index beyond
    the GPUs it sees, ``meta`` (tensors without data), or another type it cannot allocate on (``mps`` or ``xpu``
    where torch was built without them). Such a device was only found unusable once the model or the experts were
    moved to it, with a traceback (review 72). A CUDA device is not allocated on here: that would create a CUDA
    context in a process that may compute nothing (the parent of ``dmoe-server --processes``)."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("cuda was asked for but torch sees no CUDA device")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{device} was asked for but torch sees {count} CUDA device{'s' * (count != 1)} "
                             f"(cuda:0 to cuda:{count - 1})")
        return
    if device.type == "meta":
        raise ValueError("meta tensors hold no data: nothing can be computed on them")
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, NotImplementedError, ValueError) as error:
        said = (str(error).strip().splitlines() or [type(error).__name__])[0]  # (torch's can run to 60 lines)
        if len(said) > 160:
            said = said.split(". ")[0]
        raise ValueError(f"this torch build cannot allocate on {device}: {said}") from None


def compute_workers(workers: int | None, device: torch.device,
                    threads: int | None = None) -> tuple[int, int | None]:
    """(compute threads, torch intra-op threads for each) for a server on ``device``: ``workers`` share out torch's
    ``threads`` (default: this process's); None picks two on a CPU with two or more threads, one on a GPU (its
    kernels queue on one stream)."""
    threads = threads or torch.get_num_threads()
    if workers is None:
        workers = 2 if device.type == "cpu" and threads >= 2 else 1
    if workers < 1:
        raise ValueError(f"workers must be positive, got {workers}")
    return workers, (max(1, threads // workers) if workers > 1 else None)


class ExpertServer:
    """Serves ``backends`` over gRPC: ``start()``, then ``endpoint``; ``close()`` or use as a context manager.

    Threads: the runtime's workers compute (see :class:`Runtime`), one thread runs the asyncio loop of the gRPC
    server. All belong to this object and stop in ``close()``. With ``config.checkpoint_dir``, experts are restored
    from the directory's checkpoint in the constructor (a mismatch raises CheckpointMismatch before anything
    serves), and a third thread checkpoints every ``checkpoint_interval`` s; ``close()`` writes a last one.

    Args:
        backends: uid -> expert backend (modules are moved to the server's device). Backends built with an
            activation cache (:meth:`create` gives them one of ``config.activation_cache_mb``) must share it.
        config: listening and runtime settings.
        announcer: optional; gets ``start(uids, endpoint)`` once serving and ``close()`` at shutdown, and
            ``add``/``remove`` when experts are added to or removed from the running server.
        backend_factory: builds one more expert like these (:meth:`create` passes one), for experts adopted at
            runtime (:meth:`add_expert`, :mod:`dmoe.replicas`).

    Set :attr:`replication` (a :class:`~dmoe.replicas.Replication`) before :meth:`start` to keep replicas of these
    experts on other servers, hold theirs, and adopt the experts of servers that leave.
    """

    def __init__(self, backends: Mapping[str, ExpertBackend], config: ServerConfig | None = None,
                 announcer: Announcer | None = None, *, backend_factory: BackendFactory | None = None):
        if not backends:
            raise ValueError("a server needs at least one expert")
        self.config = config or ServerConfig()
        self.backends = {check_uid(uid): backend for uid, backend in backends.items()}
        self.device = resolve_device(self.config.device)
        if self.config.cuda_graphs and (self.config.workers or 1) > 1:
            raise ValueError("cuda_graphs needs one compute worker (a capture must not meet another worker's device "
                             f"synchronisation), got workers={self.config.workers}; run more processes instead")
        if self.config.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, not {self.device}")
        #: one failed CUDA graph capture turns graphs off for every expert here (dmoe.server.cuda_graphs)
        self.graph_switch = GraphSwitch()
        self.announcer = announcer
        self.backend_factory = backend_factory
        self.replication: Replication | None = None
        self._experts_lock = threading.Lock()  # experts added or removed at runtime (adoption) one at a time
        workers, threads = compute_workers(self.config.workers, self.device)
        #: seconds per stage of the server's path (``config.profile``); None: not timed
        self.stages: StageClock | None = StageClock() if self.config.profile else None
        self.runtime = Runtime(self.device, self.config.autocast, workers=workers, threads_per_worker=threads,
                               overlap_copies=self.config.overlap_copies, stages=self.stages)
        caches = {id(b.activations): b.activations for b in self.backends.values() if b.activations is not None}
        if len(caches) > 1:
            raise ValueError("the experts of one server must share one activation cache (or have none)")
        #: the kept forwards of every expert (given to each backend by :meth:`create`); None: always recompute
        self.activations: ActivationCache | None = next(iter(caches.values()), None)
        experts = {uid: self._host(uid, backend) for uid, backend in self.backends.items()}
        self.servicer = ExpertServicer(
            experts, self.runtime, max_batch_size=self.config.max_batch_size, device=str(self.device),
            default_compression=parse_compression(self.config.response_compression),
            max_stream_bytes=self.config.max_stream_bytes, max_stream_seconds=self.config.max_stream_seconds,
            faults=Faults(self.config.faults) if self.config.faults is not None else None,
            reject_nonfinite=self.config.reject_nonfinite, max_abs_value=self.config.max_abs_value or None,
            stages=self.stages,
            shared_memory=SegmentMaps(self.config.max_message_bytes) if self.config.shared_memory else None,
            max_queued_bytes=int(self.config.max_queued_mb * 2**20),
        )
        self.metrics = ServerMetrics(experts, self.activations, self.stages)
        self.metrics.watch_budget(self.servicer)
        self.runtime.on_batch = self.metrics.observe_batch
        if self.activations is not None:  # kept forwards live on the experts' device: first to go when it is full
            self.runtime.on_out_of_memory = self.activations.release
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._grpc_server: grpc.aio.Server | None = None
        self._sweep: asyncio.TimerHandle | None = None  # the next expiry of kept forwards, on the loop
        self._closed = False
        self.checkpoints: Checkpoints | None = None
        if self.config.checkpoint_dir is not None:  # restored now: a mismatch fails construction, before serving
            self.checkpoints = Checkpoints(self.config.checkpoint_dir, self.backends,
                                           pause=self.runtime.paused,
                                           interval=self.config.checkpoint_interval, serving=self.backends)
            try:
                self.checkpoints.restore()
            except BaseException:
                self.checkpoints.close(save=False)  # lets go of the directory
                raise

    def _host(self, uid: str, backend: ExpertBackend) -> HostedExpert:
        """``backend`` on the server's device with its two task pools (one group: never run at once)."""
        backend.module.to(self.device)
        if self.config.cuda_graphs and backend.graphs is None:
            backend.use_cuda_graphs(self.config.max_batch_size, self.graph_switch)
        return HostedExpert(
            backend,
            self.runtime.create_pool(f"{uid}.forward", backend.forward, self.config.max_batch_size, segmented=True,
                                     group=uid),
            self.runtime.create_pool(f"{uid}.backward", backend.backward, self.config.max_batch_size, segmented=True,
                                     group=uid),
        )

    def add_expert(self, uid: str, backend: ExpertBackend, *, announce: bool = True) -> None:
        """Starts serving one more expert on this (running or not yet started) server: its task pools, the
        servicer's table, its metrics, and (``announce``) the announcer's uids, which declares it at once.

        Used to adopt the expert of a server that left (:mod:`dmoe.replicas`). An added expert is not in the
        server's checkpoint (a restart with the same flags must find the checkpoint it wrote): its replicas on other
        servers keep it, and so does this server's own replica directory (:class:`~dmoe.replicas.ReplicaPusher`).
        One whose uid the checkpoint holds (a standby's cell, adopted back after it was dropped) is saved there in
        place of the dropped one.
        Raises ValueError if ``uid`` is served here already or ``backend`` keeps its activations in another cache
        than the server's.
        """
        uid = check_uid(uid)
        if self._closed:
            raise RuntimeError("the server is closed")
        if backend.activations is not None and backend.activations is not self.activations:
            raise ValueError(f"{uid}: the experts of one server must share one activation cache")
        with self._experts_lock:
            if uid in self.servicer.experts:
                raise ValueError(f"expert {uid} is served here already")
            hosted = self._host(uid, backend)
            if self.activations is not None:  # a forward of a removed backend may have run after its removal
                self.activations.forget(uid)
            self.backends[uid] = backend
            self.metrics.add_expert(uid, hosted)
            self.servicer.experts[uid] = hosted  # last: calls find the expert only once the rest is in place
        logger.info("now serving %s too (%d experts)", uid, len(self.backends))
        if announce and self.announcer is not None and self.port is not None:
            self.announcer.add([uid])

    def remove_expert(self, uid: str) -> ExpertBackend:
        """Stops serving ``uid`` (calls get NOT_FOUND; its declaration is no longer refreshed and expires) and
        returns its backend. Requests already queued for it still run; then the server keeps no reference to the
        backend (its task pools leave the runtime, its kept forwards the activation cache, which it keeps nothing in
        from now on: its ``activations`` is None), so it is freed once the caller drops it. Raises KeyError if it is
        not served here."""
        with self._experts_lock:
            hosted = self.servicer.experts.pop(uid)
            self.backends.pop(uid, None)
            self.metrics.remove_expert(uid)
            self.runtime.remove_pool(hosted.forward_pool)
            self.runtime.remove_pool(hosted.backward_pool)
            # its forwards still queued or running keep nothing from now on (review 95 D3); then those it kept go:
            # their graphs hold its weights, and must not serve a later backend
            hosted.backend.activations = None
            if self.activations is not None:
                self.activations.forget(uid)
        if self.announcer is not None and self.port is not None:
            self.announcer.remove([uid])
        logger.info("no longer serving %s (%d experts left)", uid, len(self.backends))
        return hosted.backend

    @classmethod
    def create(
        cls,
        uids: str | Sequence[str],
        expert_cls: str = "ffn",
        hidden_dim: int = 1024,
        *,
        cls_kwargs: dict[str, Any] | None = None,
        optimizer: str = "adam",
        lr: float = 1e-3,
        clip_grad_norm: float | None = None,
        seed: int = 0,
        config: ServerConfig | None = None,
        announcer: Announcer | None = None,
    ) -> "ExpertServer":
        """Builds experts of a registered class (``uids`` may be a pattern such as ``'ffn0.[0:4].[0:4]'``).

        Expert ``uid`` starts from weights seeded by ``expert_seed(seed, uid)``, so
        ``create_expert(expert_cls, hidden_dim, seed=expert_seed(seed, uid), **cls_kwargs)`` rebuilds it.
        """
        config = config or ServerConfig()
        device = resolve_device(config.device)
        if optimizer == "sgd" and clip_grad_norm is None:
            logger.warning("SGD experts without clip_grad_norm (--clip-grad-norm): a client's large but allowed "
                           "gradients (within --max-abs-value) can push their weights past what float32 survives "
                           "in two steps; clip them where clients are not all trusted")
        uids = expand_pattern(uids) if isinstance(uids, str) else list(uids)
        cls_kwargs = dict(cls_kwargs or {})
        registered = expert_class(expert_cls)
        hparams = {"hidden_dim": hidden_dim, **cls_kwargs, "optimizer": optimizer, "lr": lr,
                   "clip_grad_norm": clip_grad_norm, "seed": seed}
        activations = ActivationCache(int(config.activation_cache_mb * 2**20), config.activation_ttl)

        if "seed" in cls_kwargs:  # (create_expert's own: a TypeError of the call, with a traceback)
            raise ExpertBuildError(f"expert class {expert_cls!r} gets its seed from the server's (--seed), not from "
                                   "its keyword arguments")

        def backend_factory(uid: str) -> ExpertBackend:
            module = create_expert(expert_cls, hidden_dim, seed=expert_seed(seed, uid), **cls_kwargs).to(device)
            try:  # the backend runs the expert on its sample input, to learn its outputs' schema
                return ExpertBackend(
                    uid, module, registered.sample(2, hidden_dim), make_optimizer(optimizer, module.parameters(), lr),
                    clip_grad_norm=clip_grad_norm, expert_cls=expert_cls, hparams=hparams, activations=activations,
                )
            except Exception as error:  # noqa: BLE001 - a user's class may raise anything on its own sample input
                if is_out_of_memory(error):
                    raise
                raise ExpertBuildError(f"expert class {expert_cls!r} with hidden_dim={hidden_dim} and {cls_kwargs} "
                                       f"builds an expert that fails on its sample input: {type(error).__name__}: "
                                       f"{error}") from error

        return cls({uid: backend_factory(uid) for uid in uids}, config, announcer, backend_factory=backend_factory)

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise RuntimeError("the server is not started")
        return reachable_endpoint(self.config.host, self.port)

    def start(self) -> "ExpertServer":
        """Starts computing and listening; returns once the port is bound and calls are accepted."""
        if self._loop is not None:
            raise RuntimeError("the server was started already")
        self.runtime.start()
        if self.checkpoints is not None:
            self.checkpoints.start()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="dmoe-grpc", daemon=True)
        threads = torch.get_num_threads()
        self._loop_thread.start()
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._loop).result()  # it set its torch threads
            # torch.set_num_threads sets the calling thread's count and the default of threads that have not used
            # torch yet (the workers, with no threads_per_worker): the default back, before any call comes
            torch.set_num_threads(threads)
            self.port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result()
            if self.config.metrics_port is not None:
                self.metrics.serve(self.config.metrics_host or self.config.host, self.config.metrics_port)
        except BaseException:
            self.close()
            raise
        logger.info("serving %d experts on %s (device %s)", len(self.backends), self.endpoint, self.device)
        try:  # (a server that cannot announce, or replicate, is stopped whole: no port or thread left behind)
            if self.announcer is not None:
                self.announcer.start(list(self.backends), self.endpoint)
            if self.replication is not None:
                self.replication.start(self)
        except BaseException:
            self.close()
            raise
        return self

    def _run_loop(self) -> None:
        """Runs the gRPC loop, with one torch thread: the torch ops it runs (decoding compressed requests, encoding
        compressed answers) would otherwise start an OpenMP team of its own, whose threads spin after every request
        and take cores from the compute workers (review 84; ``start`` puts the default back for other threads)."""
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        torch.get_num_threads()  # torch's lazy per-thread set-up first, or it would undo the next line later
        torch.set_num_threads(1)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _serve(self) -> int:
        server = grpc.aio.server(options=grpc_options(self.config.max_message_bytes),
                                 interceptors=[RejectUndecodable(), self.metrics.interceptor()])
        add_to_server(self.servicer, server)
        if self.replication is not None:
            self.replication.servicer.add_to_server(server)
        address = join_host_port(self.config.host, self.config.port)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:  # what gRPC raises when it cannot bind
            port = 0
        if port == 0:
            raise PortUnavailable(f"could not listen on {address}: another process listens there, or the host is "
                                  "not an address of this machine")
        await server.start()
        self._grpc_server = server
        self._schedule_sweep()
        return port

    def _schedule_sweep(self) -> None:
        """On the loop: expires kept forwards every ``activation_ttl / 2`` s, and unmaps the shared-memory segments
        their clients let go of every :data:`~dmoe.wire.shared_memory.SWEEP_SECONDS`. Both are done on requests
        too, but only when requests come: a server whose trainers went away held their inputs and graphs (on a GPU,
        device memory: review 66) and their segments (review 71) for good. The timer is the server's, on its loop:
        :meth:`close` cancels it."""
        cache, maps = self.activations, self.servicer.shared_memory
        periods = ([cache.ttl / 2] if cache is not None and cache.enabled else []) + \
            ([SEGMENT_SWEEP_SECONDS] if maps is not None else [])
        if not periods or self._closed or self._loop is None:
            return
        self._sweep = self._loop.call_later(max(min(periods), MIN_SWEEP_SECONDS), self._sweep_expired)

    def _sweep_expired(self) -> None:
        try:
            if self.activations is not None and self.activations.enabled:
                self.activations.expire()
            if self.servicer.shared_memory is not None:
                self.servicer.shared_memory.sweep()
        except Exception:  # noqa: BLE001 - the next sweep tries again
            logger.exception("sweeping kept activations and shared-memory segments failed")
        self._schedule_sweep()

    def _cancel_sweep(self) -> None:
        """On the loop: no more sweeps."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def close(self) -> None:
        """Lets in-flight calls finish (up to ``shutdown_grace`` s), stops refreshing the experts' declarations,
        writes the last checkpoint, pushes the experts' last replicas, closes the announcer, stops both threads.

        Every step runs even when an earlier one failed (each failure is logged), so a final checkpoint that cannot
        be written still leaves no thread running and no port bound; then the first failure is raised.
        """
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        for step, run in self._shutdown_steps():
            try:
                run()
            except BaseException as error:  # noqa: BLE001 - raised below, once the later steps have run
                if isinstance(error, CheckpointNotWritten):  # (says it all in one line; the cause at DEBUG)
                    logger.error("closing the server: %s", error)
                    logger.debug("the last checkpoint's failure", exc_info=True)
                else:
                    logger.exception("closing the server: %s failed", step)
                first = first if first is not None else error
        logger.info("server stopped")
        if first is not None:
            raise first

    def _shutdown_steps(self) -> list[tuple[str, Callable[[], Any]]]:
        """(name, step) of :meth:`close`, in order."""
        started = self._loop is not None
        replication, checkpoints = self.replication, self.checkpoints
        steps: list[tuple[str, Callable[[], Any]]] = []
        if started and self._grpc_server is not None:
            steps.append(("the gRPC server", self._stop_grpc))
        if self.announcer is not None:  # nobody answers for its experts now: declarations refreshed through the
            # steps below (a checkpoint, replica pushes) sent clients to them, and kept replica holders from
            # adopting them for that long on top of their expiration (review 99 D2)
            steps.append(("the announcer's refreshing", self.announcer.stop_refreshing))
        if checkpoints is not None:  # after in-flight calls finished, before the runtime stops, and first of all
            # what may take long (pushes to other hosts): a supervisor's stop timeout must not cut the disk's copy
            steps.append(("the last checkpoint", lambda: checkpoints.close(save=started)))
        if replication is not None:  # after in-flight calls, while the DHT node (the announcer's) still runs
            steps.append(("replication", lambda: replication.close(push=started)))
        if self.announcer is not None:  # (its DHT node, after replication's last use of it)
            steps.append(("the announcer", self.announcer.close))
        steps.append(("the runtime", self.runtime.close))
        if self.activations is not None:
            steps.append(("the activation cache", self.activations.clear))
        steps.append(("the metrics", self.metrics.close))
        if started and self._loop_thread is not None:
            steps.append(("the gRPC loop thread", self._stop_loop))
        return steps

    def _stop_grpc(self) -> None:
        assert self._loop is not None and self._grpc_server is not None
        server, servicer, grace = self._grpc_server, self.servicer, self.config.shutdown_grace

        async def stop() -> None:
            self._cancel_sweep()
            servicer.release_holds()  # clients' held calls end now; the calls that compute get the grace period
            await server.stop(grace)
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result()

    def _stop_loop(self) -> None:
        assert self._loop is not None and self._loop_thread is not None
        self._loop.call_soon_threadsafe(self._cancel_sweep)  # in case stopping the gRPC server did not
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()

    def __enter__(self) -> "ExpertServer":
        return self.start() if self._loop is None else self

    def __exit__(self, *exc) -> None:
        self.close()
