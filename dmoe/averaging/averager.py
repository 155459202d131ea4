"""``DecentralizedAverager``: averages a peer's tensors with peers found through the DHT, one Moshpit round per step.

Threads: one asyncio loop (the gRPC server of the parts this peer owns, and its calls to other owners) and one
step thread (matchmaking through the DHT's synchronous API, then waiting for the all-reduce on the loop). Both
belong to the averager and stop in :meth:`DecentralizedAverager.shutdown`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields, replace
from typing import Any, Awaitable, Collection, Iterator, Mapping, Sequence

import grpc
import torch

from dmoe.averaging import grid as moshpit
from dmoe.averaging.allreduce import MAX_WEIGHT, AllReduceResult, Outcome, SendPace, allreduce, send_and_receive
from dmoe.averaging.config import MAX_PIECE_BYTES, MESSAGE_OVERHEAD_BYTES, AveragerConfig
from dmoe.averaging.matchmaking import Group, Matchmaker, Member, check_entry_fits
from dmoe.averaging.service import AveragingServicer, connection_limits
from dmoe.dht import DHT
from dmoe.endpoints import PortUnavailable, join_host_port, reachable_endpoint
from dmoe.wire import dmoe_pb2_grpc, grpc_options
from dmoe.wire.codec import parse_compression

logger = logging.getLogger(__name__)

#: seconds a check that a peer accepts connections may take before it counts as "cannot tell" (then: reachable)
PROBE_TIMEOUT = 5.0
#: rounds are below this: owners read at most 18 digits of a group id's round
MAX_ROUND = 10**18
#: channels to other peers kept open: the least recently used beyond these are closed (and made again if their peer
#: comes back), except those of the round in flight (a group may have more members)
MAX_CHANNELS = 64


@dataclass(frozen=True)
class GroupInfo:
    """What a step that averaged did.

    peer_id: this peer's id in the round (drawn afresh for each round, see :mod:`~dmoe.averaging.matchmaking`);
    members: the group as matchmaking formed it (peer ids, sorted); contributors: whose tensors the average is
    over (members that died, stalled or were refused are left out); weight: what the averaged tensors weigh in the
    next round (the contributors' mean weight, so that a full grid gives the exact weighted mean); dropped: members
    left out, with the reason (an owner's failure, or why this peer's own part left them out when it did: a broken
    stream, a refusal, a timeout).
    """

    group_id: str
    round: int
    peer_id: int
    members: tuple[int, ...]
    contributors: tuple[int, ...]
    weight: float
    total_weight: float
    attempts: int = 1
    dropped: Mapping[int, str] = field(default_factory=dict)
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0


class DecentralizedAverager:
    """Averages ``tensors`` in place with other peers of averaging run ``prefix``, found through ``dht``.

    Each :meth:`step` is one round of Moshpit SGD: matchmaking forms a group of up to ``target_group_size`` peers
    through DHT records, then the group averages by butterfly all-reduce over gRPC (weighted by each member's
    ``weight``). The tensors are written only once every part arrived and passed the checks, and only with the
    average over one agreed set of members; otherwise they are left as they were.

    Args:
        tensors: floating-point tensors (any device), averaged as float32; keep using them, they are updated in
            place (hold :meth:`get_tensors` while changing them, so a step never reads half an update).
        dht: a running :class:`dmoe.DHT`; its signed records carry matchmaking.
        prefix: the run's name: only averagers with the same prefix and the same tensor sizes average together.
        config: :class:`AveragerConfig`; keyword arguments override its fields (``target_group_size=8``).
        coordinates: this peer's cell in ``config.grid``; default random. Peers placed one per cell of a full grid
            hold the exact average after ``len(grid)`` rounds.

    Peers meet only peers of the same round (its number is in the DHT key, and picks the grid's free dimension). By
    default a step's round is how many steps this averager took before (:attr:`round`), which agrees only among
    peers that call :meth:`step` equally often from the start: one that starts late, steps while nobody else is up
    or restarts never meets the others again. Otherwise pass ``step(round=...)`` a number the peers share (a global
    step, as :class:`~dmoe.CollaborativeOptimizer` does, or ``int(time.time() // period)`` with clocks in sync).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], dht: DHT, prefix: str = "run1",
                 config: AveragerConfig | None = None, *, coordinates: Sequence[int] | None = None, **overrides: Any):
        known = {f.name for f in fields(AveragerConfig)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown averager settings {sorted(unknown)}; see AveragerConfig")
        self.config = replace(config or AveragerConfig(), **overrides)
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"prefix must be a non-empty name without spaces, got {prefix!r}")
        self.tensors = list(tensors)
        if not self.tensors or any(not t.is_floating_point() for t in self.tensors):
            raise ValueError("averaging needs at least one tensor, all of them floating-point")
        self.numel = sum(t.numel() for t in self.tensors)
        if self.numel == 0:
            raise ValueError("the tensors hold no values")
        self.dht, self.prefix = dht, prefix
        cfg = self.config
        self.coordinates = (moshpit.check_coordinates(cfg.grid, coordinates) if coordinates is not None
                            else moshpit.random_coordinates(cfg.grid))
        self.compression = parse_compression(cfg.compression)
        #: the round of the next step given none: one more than the latest step's
        self.round = 0
        #: what this peer's tensors weigh when a step is given no weight (after a step: its group's mean weight)
        self.weight = 1.0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._inflight: concurrent.futures.Future | None = None
        # endpoint -> its channel and stub, least recently used first (see MAX_CHANNELS); on the loop's thread only
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, dmoe_pb2_grpc.AveragingServiceStub]] = OrderedDict()
        self._held: frozenset[str] = frozenset()  # the endpoints of the round in flight: their channels stay open
        self._server: grpc.aio.Server | None = None
        self.servicer: AveragingServicer | None = None
        self.endpoint: str | None = None
        self._pace = SendPace(cfg.max_send_rate)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dmoe-averager-loop", daemon=True)
        self._thread.start()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dmoe-averager-step")
        try:
            if not cfg.client_mode:
                self.endpoint = dht.announced(self._run(self._serve(), timeout=30), cfg.announce_host)
        except BaseException:
            self.shutdown()
            raise
        me = Member(0, self.endpoint, 0.0 if cfg.client_mode else cfg.bandwidth,  # its id: drawn each round
                    key=dht.identity.public_key)
        try:
            check_entry_fits(me, dht.config.max_value_bytes)
        except ValueError:
            self.shutdown()
            raise
        self.matchmaker = Matchmaker(dht, me, cfg, self._stop)
        logger.info("averager of run %r (DHT key %s): %d values in %d tensors, %s", prefix,
                    dht.identity.public_key.hex()[:16], self.numel, len(self.tensors),
                    f"serving at {self.endpoint}" if self.endpoint else "client mode")

    @property
    def peer_id(self) -> int:
        """This peer's id in its current (or latest) round; 0 before the first. Drawn afresh each round from the
        DHT's key, the round's key and a random salt, so that nobody can store under it first (see
        :mod:`~dmoe.averaging.matchmaking`)."""
        return self.matchmaker.me.peer_id

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _serve(self) -> str:
        cfg = self.config
        self.servicer = AveragingServicer(self.prefix, cfg.join_timeout, self._pace)
        self._server = grpc.aio.server(options=grpc_options(MAX_PIECE_BYTES + MESSAGE_OVERHEAD_BYTES)
                                       + connection_limits(cfg.allreduce_timeout, cfg.join_timeout))
        dmoe_pb2_grpc.add_AveragingServiceServicer_to_server(self.servicer, self._server)
        address = join_host_port(cfg.host, cfg.port)
        try:
            port = self._server.add_insecure_port(address)
        except RuntimeError:  # what gRPC raises when it cannot bind (older versions returned 0)
            port = 0
        if port == 0:
            raise PortUnavailable.at("averager", address)
        await self._server.start()
        return reachable_endpoint(cfg.host, port)

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        """A channel per endpoint, created on the loop that uses it."""
        return self._connection(endpoint)[0]

    def _stub(self, endpoint: str) -> dmoe_pb2_grpc.AveragingServiceStub:
        return self._connection(endpoint)[1]

    def _connection(self, endpoint: str) -> tuple[grpc.aio.Channel, dmoe_pb2_grpc.AveragingServiceStub]:
        pair = self._channels.get(endpoint)
        if pair is not None:
            # least recently used first: by creation order, a peer met in every round was the next one closed (review 98 D5)
            self._channels.move_to_end(endpoint)
            return pair
        channel = grpc.aio.insecure_channel(endpoint, options=grpc_options(MAX_PIECE_BYTES + MESSAGE_OVERHEAD_BYTES))
        pair = self._channels[endpoint] = channel, dmoe_pb2_grpc.AveragingServiceStub(channel)
        self._evict()
        return pair

    def _evict(self) -> None:
        """Closes the least recently used channels beyond MAX_CHANNELS (peers of long ago: a run with churn meets
        ever new ones), never one of the round in flight: the all-reduce fetches every owner's stub before its calls
        start, and one closed by the fetch of the next ("Channel is closed") dropped its owner and cost the round its
        allreduce_timeout, in every round of a group of more than MAX_CHANNELS + 1 (review 98 D5)."""
        for endpoint in [e for e in self._channels if e not in self._held][:max(0, len(self._channels) - MAX_CHANNELS)]:
            old, _ = self._channels.pop(endpoint)
            asyncio.ensure_future(old.close(grace=self.config.allreduce_timeout))  # its calls (if any) may end

    async def _holding(self, group: Group, coro: Awaitable[AllReduceResult | None]) -> AllReduceResult | None:
        """Awaits ``coro`` (the round's all-reduce) with the channels to ``group``'s members kept open (see
        :meth:`_evict`); those beyond MAX_CHANNELS are closed once it ends."""
        self._held = frozenset(m.endpoint for m in group.members if m.endpoint is not None)
        try:
            return await coro
        finally:
            self._held = frozenset()
            self._evict()

    async def _reachable(self, endpoint: str) -> bool:
        """False when the peer at ``endpoint`` refuses connections (its process is gone); True when it is connected
        or cannot be told within ``PROBE_TIMEOUT`` (a host that vanished without closing its connections is only
        found out by gRPC's keepalive)."""
        channel = self._channel(endpoint)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PROBE_TIMEOUT
        state = channel.get_state(try_to_connect=True)  # after a lost connection the channel idles until asked
        while state in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING):
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return True
            state = channel.get_state(try_to_connect=True)
        return state is not grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def step(self, weight: float | None = None, timeout: float | None = None, wait: bool = True, *,
             group_size: int | None = None, single_group: bool = False, expected_peers: Collection[bytes] | None = None,
             round: int | None = None) -> "GroupInfo | None | concurrent.futures.Future[GroupInfo | None]":
        """One round: find a group and average with it. Returns its :class:`GroupInfo`, or None when the tensors
        were left unchanged (nobody to average with, or the group could not agree in time).

        weight: how much this peer's tensors count (samples since the last round); None: :attr:`weight`.
        timeout: seconds for the whole step (default ``config.step_timeout``). Below ``matchmaking_time`` too, a
            group short of its target forms in time: a quarter of it (at least a second) is left to the all-reduce.
        wait: False returns a ``concurrent.futures.Future`` at once; steps run one after another.
        group_size: this round's target group size, when the caller knows how many peers will come (default
            ``config.target_group_size``): a leader forms the group as soon as that many are waiting.
        expected_peers: the DHT keys (``DHT.identity.public_key``, the ``owner`` of their DHT entries) of the peers
            this round is meant for besides this one (a collaboration's partners). Matchmaking then reads only their
            declarations and this peer's own: nobody else's records can lead this peer, hold it up, join its group
            or make it give up. Default: every peer of the round's key.
        single_group: the round is meant to form one group of every peer (a collaboration's step): a peer that finds
            a group formed without it, and nobody else waiting, returns None at once. That group must be led by one
            of ``expected_peers``; without them, it must hold a peer this one saw waiting in the round, so a peer
            that came after the group formed waits out ``matchmaking_time`` (anyone can store a group of ids it signs
            itself under a round's key ahead of time: it must not make peers give up).
        round: the round to meet the others in: only peers stepping in the same round meet (see the class
            docstring). Default :attr:`round`, this averager's count of steps, which agrees only among peers that
            call step equally often from the start (one that stepped alone once was a round apart for good, review
            98 D2). A step sets :attr:`round` to its own round + 1.
        """
        if self._closed:
            raise RuntimeError("this averager is shut down")
        if weight is not None and not (math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT):
            raise ValueError(f"weight must be a finite number in [0, {MAX_WEIGHT:g}], got {weight}")
        if group_size is not None and group_size < self.config.min_group_size:
            raise ValueError(f"group_size {group_size} is below min_group_size {self.config.min_group_size}")
        if expected_peers is not None:
            expected_peers = frozenset(expected_peers)
            if not all(isinstance(key, bytes) for key in expected_peers):
                raise TypeError("expected_peers are DHT public keys (bytes), such as DHT.identity.public_key")
        if round is not None and (not isinstance(round, int) or isinstance(round, bool) or not 0 <= round < MAX_ROUND):
            raise ValueError(f"round must be an int in [0, 10**18), got {round!r}")
        future = self._executor.submit(self._step, weight, timeout, group_size, single_group, expected_peers, round)
        return future.result() if wait else future

    def _step(self, weight: float | None, timeout: float | None, group_size: int | None = None,
              single_group: bool = False, expected_peers: frozenset[bytes] | None = None,
              round_number: int | None = None) -> GroupInfo | None:
        cfg = self.config
        started = time.monotonic()
        deadline = started + (cfg.step_timeout if timeout is None else timeout)
        weight = self.weight if weight is None else float(weight)
        round_number = self.round if round_number is None else round_number
        self.round = round_number + 1
        key = moshpit.group_key(self.prefix, round_number, cfg.grid, self.coordinates)
        if self.servicer is not None:
            self._loop.call_soon_threadsafe(self.servicer.begin_round, round_number)
        group = self.matchmaker.find_group(round_number, key, time.time() + (deadline - time.monotonic()),
                                           group_size, single_group, expected_peers)
        if group is None or self._stop.is_set():  # shut down while matchmaking: no all-reduce starts
            return None
        me = self.matchmaker.me.peer_id  # this round's
        matched = time.monotonic()
        with self.lock:
            flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in self.tensors])
        out = torch.empty_like(flat)
        running = asyncio.run_coroutine_threadsafe(self._holding(group, allreduce(
            group, me, flat, weight, out, stub_for=self._stub,
            register=self.servicer.register if self.servicer is not None else None,
            compression=self.compression, piece_elements=cfg.piece_bytes // 4, max_abs_value=cfg.max_abs_value,
            allreduce_timeout=cfg.allreduce_timeout, join_timeout=cfg.join_timeout, max_retries=cfg.max_retries,
            min_group_size=cfg.min_group_size, deadline=deadline, pace=self._pace, send=self._send_part,
            reachable=self._reachable, identity=self.dht.identity)), self._loop)
        self._inflight = running
        if self._stop.is_set():  # shutdown began after the check above but read no all-reduce in flight
            running.cancel()
        try:
            result: AllReduceResult | None = running.result(max(0.0, deadline - time.monotonic()) + 1.0)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            running.cancel()
            logger.warning("group %s: the all-reduce did not finish in time; tensors unchanged", group.group_id)
            return None
        finally:
            self._inflight = None
        if result is None:
            logger.warning("group %s: the members could not agree on an average; tensors unchanged", group.group_id)
            return None
        with self.lock, torch.no_grad():
            offset = 0
            for tensor in self.tensors:
                tensor.copy_(out[offset:offset + tensor.numel()].view(tensor.shape))
                offset += tensor.numel()
        self.weight = result.total_weight / len(result.contributors)
        self.coordinates = moshpit.coordinates_after(round_number, cfg.grid, self.coordinates,
                                                     group.peer_ids.index(me))
        done = time.monotonic()
        info = GroupInfo(group.group_id, round_number, me, group.peer_ids, result.contributors,
                         self.weight, result.total_weight, result.attempts, dict(result.dropped),
                         matched - started, done - matched)
        logger.info("round %d: averaged with %d of %d members in %.2fs (+%.2fs matchmaking)", round_number,
                 len(info.contributors), len(info.members), info.allreduce_s, info.matchmaking_s)
        return info

    async def _send_part(self, *args: Any, **kwargs: Any) -> Outcome:
        """Sends this peer's values of one part to its owner and receives the average (test helpers that play a
        misbehaving peer override it)."""
        return await send_and_receive(*args, **kwargs)

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, locked: a step neither reads nor writes them while the caller holds them."""
        with self.lock:
            yield self.tensors

    def shutdown(self) -> None:
        """Stops matchmaking, any all-reduce in flight (the tensors are then left as they were), the gRPC server
        and both threads; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        inflight = self._inflight
        if inflight is not None:
            inflight.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._loop.is_running():
            async def stop() -> None:
                if self._server is not None:
                    await self._server.stop(grace=0.5)
                for channel, _ in self._channels.values():
                    await channel.close()
            try:
                self._run(stop(), timeout=10)
            except Exception:  # noqa: BLE001 - shutting down regardless
                logger.warning("averager shutdown did not finish cleanly", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> "DecentralizedAverager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
