"""The remote layer's failure policy: how long to wait for experts, which answers count, what gets banned.

Where the gate drops a dead expert: :func:`wait_for_experts` decides which calls answered in time,
:meth:`CallPolicy.outcome` turns every other call (failed, late, malformed) into a dropped expert and bans it,
or its whole server (:mod:`dmoe.client.bans`), so the next beam search picks the next-best alive experts; the gate
then renormalises over the experts that answered (:meth:`dmoe.client.gating.MixtureBase._combine`). A request the
server refuses as invalid drops its expert from that forward only, and bans nothing unless the expert keeps
refusing what the others answer (:meth:`CallPolicy.weigh_refusals`); so does a straggler that the
``timeout_after_k_min`` grace cut, unless its server keeps being cut (:data:`CUTS_TO_BAN`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import queue
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import grpc
import numpy as np
import torch

from dmoe.client.bans import MAX_RECORDS, Bans
from dmoe.client.gating import MoEStats
from dmoe.client.remote_expert import expert_info, value_range
from dmoe.wire import NONE, ChannelPool

logger = logging.getLogger(__name__)

#: calls in a row an expert may refuse as invalid while other experts answer the same call, before it is banned
REFUSALS_TO_BAN = 3
#: forwards in a row in which the ``timeout_after_k_min`` grace cut a server's calls, none of its experts answering,
#: before it is banned as too slow for the layer (see :meth:`CallPolicy.outcome`)
CUTS_TO_BAN = 3
#: seconds after which a server's cuts are forgotten: "in a row" means the forwards that chose it lately, not three
#: cuts however far apart (one now and then is a moment's slowness)
CUT_MEMORY = 60.0
#: :meth:`CallPolicy.outcome`'s default ``problem``: the answer is checked there
UNCHECKED = object()
#: the largest magnitude a layer accepts in an expert's answer by default: the servers' own default limit on what
#: they accept (``dmoe-server --max-abs-value``), far above what a healthy expert answers
MAX_ABS_VALUE = 1e6
#: the most requests an expert's rows are cut into to fit its server's max_batch_size: a server claiming a limit
#: that needs more (1 row, say) fails the expert as any other refusal of its kind would (its claim costs the caller
#: a request per row otherwise)
MAX_CHUNKS = 256
#: seconds a server's learnt max_batch_size is used: then the layer sends its rows uncut again, and a refusal teaches
#: the limit anew (one refused request each time), so a server restarted with a larger ``--max-batch-size`` gets
#: larger requests again; kept for good, a limit learnt once cut every later request to that endpoint (review 85)
BATCH_LIMIT_MEMORY = 300.0
#: the most seconds a forward asks a server for its max_batch_size (``info``) when its refusal does not say it
INFO_TIMEOUT = 2.0
#: the number a server's "exceeds max_batch_size" refusal names (dmoe-server: "batch of N rows exceeds this
#: server's max_batch_size M", or "... (max_batch_size M) can carry" for a streamed request)
_BATCH_LIMIT = re.compile(r"max_batch_size\D{0,8}?(\d{1,9})")
#: :func:`_named_limit`'s answer for a refusal of too many rows that names no number: the server is asked
_ASK = "ask"
#: the most servers asked their ``info`` at once (each a thread, until one deadline: :data:`INFO_TIMEOUT`, or the
#: forward's time left); more wait for a thread, within the same deadline
MAX_ASKS = 64


def _named_limit(future: Future) -> int | str | None:
    """What a request's outcome says of its server's max_batch_size: the number its refusal names, :data:`_ASK`
    when it refused too many rows without naming one, None when it is no such refusal."""
    if not future.done() or future.cancelled():
        return None
    error = future.exception()
    if getattr(error, "code", None) != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    message = str(getattr(error, "message", error))
    if "max_batch_size" not in message:
        return None
    match = _BATCH_LIMIT.search(message)
    return int(match.group(1)) if match is not None else _ASK


@dataclass
class CallPolicy:
    """Everything a layer's calls to its experts need besides the rows: what the autograd function receives
    (rather than the whole layer).

    k_min: forward waits until every row has this many answers (or no call left pending) ...
    timeout_after_k_min: ... then at most this many seconds more for the remaining experts.
    forward_timeout: no forward waits longer than this in total; slower experts are dropped.
    backward_k_min: backward raises only if a row gets fewer expert gradients than this, or than the experts that
    answered its forward where fewer did (0: never): what ``k_min`` let through forward is not failed again. It
    raises once every backward call has settled: the experts that answered have stepped on the batch by then.
    backward_timeout: experts that have not answered backward by then contribute no gradient.
    compression: wire compression of the tensors sent; channels: the gRPC channel pool (None: the shared one).
    bans: the ban book (shared between layers); stats: the layer's counters, updated by every call.
    max_abs_value: an answer (outputs, or input gradients) holding a value of a larger magnitude is malformed
    (None or 0: no limit).
    """

    k_min: int = 1
    timeout_after_k_min: float | None = 1.0
    forward_timeout: float | None = 10.0
    backward_k_min: int = 0
    backward_timeout: float | None = 10.0
    max_abs_value: float | None = MAX_ABS_VALUE
    compression: int = NONE
    channels: ChannelPool | None = None
    bans: Bans = field(default_factory=Bans)
    stats: MoEStats = field(default_factory=MoEStats)
    layer_name: str = ""
    #: the last refusal of a request as invalid ("uid at endpoint: message"), None if none since it was cleared
    refused: str | None = None
    #: experts that refused a forward request as invalid since the layer cleared this (at the start of each
    #: forward): that forward's reroutes pass them over, as they would pass over banned ones
    refusing: set[str] = field(default_factory=set)
    #: the ``torch.amp.GradScaler`` of the loss whose gradients backward sends (None: unscaled gradients)
    grad_scaler: Any = None
    #: calls in a row that an expert refused as invalid while other experts answered the same call, by
    #: ``"forward uid"`` / ``"backward uid"``
    refusal_streaks: dict[str, int] = field(default_factory=dict)
    #: forwards in a row in which the grace cut a server's calls and none of its experts answered, by endpoint
    #: (the count, and the ``time.monotonic()`` of the last cut: a streak older than :data:`CUT_MEMORY` starts over)
    cut_streaks: dict[str, tuple[int, float]] = field(default_factory=dict)
    #: the most rows each server takes in one request (its ``max_batch_size``), by endpoint, learnt from its
    #: refusals (:meth:`learn_batch_limit`), with the ``time.monotonic()`` it was learnt at: the layer cuts an
    #: expert's rows into requests of at most that many, for :data:`BATCH_LIMIT_MEMORY` (:meth:`known_batch_limits`)
    batch_limits: dict[str, tuple[int, float]] = field(default_factory=dict)

    def known_batch_limits(self) -> dict[str, int]:
        """endpoint -> its server's max_batch_size, of the limits learnt within :data:`BATCH_LIMIT_MEMORY`; older
        ones are forgotten here (the next refusal teaches the limit again, or a larger one)."""
        if not self.batch_limits:
            return {}
        now = time.monotonic()
        for endpoint in [endpoint for endpoint, (_, learnt) in self.batch_limits.items()
                         if now - learnt > BATCH_LIMIT_MEMORY]:
            del self.batch_limits[endpoint]
        return {endpoint: limit for endpoint, (limit, _) in self.batch_limits.items()}

    def learn_batch_limits(self, requests: Sequence[tuple[str, str, Future, int]],
                           time_left: float | None) -> list[int | None]:
        """For each request (uid, endpoint, future, rows): its server's ``max_batch_size`` if the future ended in its
        refusal of more rows than that (RESOURCE_EXHAUSTED naming max_batch_size), remembered for the endpoint; None
        otherwise (for :data:`BATCH_LIMIT_MEMORY` seconds).

        The number comes from the refusal's message, or, where the message names none (another server version),
        from the server's ``info``: each such server asked once, all of them at once, within ``time_left`` (one
        ask per expert, one after another, kept a forward 2 s per expert past its timeout: review 71). A limit
        that the rows do not exceed, or one that would cut them into more than :data:`MAX_CHUNKS` requests, is not
        believed: the refusal is then the expert's failure, as before. Healthy experts were banned every step when
        the gate routed them more rows than their server's limit (review 65)."""
        named: list[int | str | None] = [_named_limit(future) for _, _, future, _ in requests]
        asks = {endpoint: uid for (uid, endpoint, _, _), limit in zip(requests, named) if limit == _ASK}
        told = self._ask_limits(asks, time_left) if asks and (time_left is None or time_left > 0) else {}
        limits: list[int | None] = []
        for (uid, endpoint, _, rows), limit in zip(requests, named):
            if limit == _ASK:
                limit = told.get(endpoint)
            if not isinstance(limit, int) or not 1 <= limit < rows or -(-rows // limit) > MAX_CHUNKS:
                limits.append(None)
                continue
            self.batch_limits.pop(endpoint, None)  # (learnt again: now the newest)
            if len(self.batch_limits) >= MAX_RECORDS:
                self.batch_limits.pop(next(iter(self.batch_limits)))  # the oldest
            self.batch_limits[endpoint] = (limit, time.monotonic())
            logger.info("forward %s: %s takes at most %d rows a request (its max_batch_size): %d rows go as %d "
                        "requests", uid, endpoint, limit, rows, -(-rows // limit))
            limits.append(limit)
        return limits

    def learn_batch_limit(self, uid: str, endpoint: str, future: Future, rows: int,
                          time_left: float | None) -> int | None:
        """:meth:`learn_batch_limits` of one request."""
        return self.learn_batch_limits([(uid, endpoint, future, rows)], time_left)[0]

    def _ask_limits(self, asks: dict[str, str], time_left: float | None) -> dict[str, int]:
        """endpoint -> the ``max_batch_size`` its ``info`` gave for the uid asked, for those that answered within
        :data:`INFO_TIMEOUT` (and ``time_left``); all asked at once, a thread each (a rare path: servers that
        refuse without naming their limit)."""
        deadline = time.monotonic() + (INFO_TIMEOUT if time_left is None else min(INFO_TIMEOUT, time_left))

        def ask(endpoint: str, uid: str) -> int | None:
            left = deadline - time.monotonic()  # (one deadline for all: a thread may start after others ended)
            if left <= 0:
                return None
            try:
                return int(expert_info(endpoint, uid, channels=self.channels, timeout=left)["max_batch_size"])
            except Exception as error:  # whatever it answered, the refusal stays the expert's failure
                logger.debug("forward %s: %s's info gave no max_batch_size: %s", uid, endpoint, error)
                return None

        with ThreadPoolExecutor(max_workers=min(len(asks), MAX_ASKS), thread_name_prefix="dmoe-info") as pool:
            answers = {endpoint: pool.submit(ask, endpoint, uid) for endpoint, uid in asks.items()}
        return {endpoint: limit for endpoint, answer in answers.items() if (limit := answer.result()) is not None}

    @contextlib.contextmanager
    def settling(self) -> Iterator["Settlement"]:
        """One pass over a call's outcomes (give what it yields to :meth:`outcome`): a server's failure is banned
        at the end of the pass, and as the expert's alone when another expert of the same server answered in it.
        Settled one by one, a sibling's answer after the failure re-admitted the server, and the failed expert was
        not avoided at all (review 46): a server that answers one expert's request cannot be down, while that
        expert's request failed."""
        settlement = Settlement()
        try:
            yield settlement
        finally:
            self._weigh_cuts(settlement)
            for uid, endpoint, backward, why in settlement.deferred:
                alone = endpoint in settlement.answered
                backoff = self.bans.fail(uid=uid if alone else None, endpoint=None if alone else endpoint,
                                         backward=backward)
                logger.info("%s %s dropped (%s); %s banned for %.1fs", "backward" if backward else "forward", uid,
                            why, f"expert {uid}" if alone else f"server {endpoint}", backoff)

    def _weigh_cuts(self, settlement: "Settlement") -> None:
        """Counts the forwards in a row in which the grace cut a server's calls and none of its experts answered
        (within :data:`CUT_MEMORY` of each other); the :data:`CUTS_TO_BAN`-th bans it, as too slow for this layer's
        grace (a server that hangs, say): never banned, it was chosen again and waited for, the whole grace, every
        forward."""
        for endpoint in settlement.answered:
            self.cut_streaks.pop(endpoint, None)
        now = time.monotonic()
        for endpoint in settlement.cut - settlement.answered:
            streak, last = self.cut_streaks.pop(endpoint, (0, now))
            streak = (streak if now - last <= CUT_MEMORY else 0) + 1
            if streak < CUTS_TO_BAN:
                if len(self.cut_streaks) >= MAX_RECORDS:
                    self.cut_streaks.pop(next(iter(self.cut_streaks)))  # the oldest
                self.cut_streaks[endpoint] = (streak, now)
                continue
            backoff = self.bans.fail(endpoint=endpoint)
            logger.info("server %s: the timeout_after_k_min grace cut its calls in %d forwards in a row, none of its "
                        "experts answering: banned for %.1fs as too slow for this layer", endpoint, streak, backoff)

    def outcome(self, uid: str, endpoint: str, future: Future, backward: bool = False, *,
                 shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
                 problem: str | None | object = UNCHECKED,
                 settlement: "Settlement | None" = None, cut: bool = False,
                 limit: float | None | object = UNCHECKED) -> list[torch.Tensor] | None:
        """The future's result, or None after dropping the expert: banning whatever failed (the expert, or its whole
        server), unless the server refused the request as invalid.

        An answer whose first tensor is not floating-point of ``shape`` (and ``dtype``, what was sent) counts as the
        expert's failure: a faulty or hostile server (or one hosting other experts under these uids) must not break
        the mixture. (The calls check every tensor's header against what they expect before decoding any:
        :class:`~dmoe.client.remote_expert.MalformedAnswer`, a failure like any other here.) So does an answer
        holding NaN or Inf, forward or backward: a diverged or hostile expert's NaN would otherwise poison the
        mixture (and the loss) of every row it answered, or the gradients of the layer's inputs. And so does one
        holding a finite value above :attr:`max_abs_value`: 1e30 passed every other check, the next LayerNorm made
        the loss NaN, no gradient reached any expert, and a trainer ended as diverged with nobody blamed (review 65).

        A refusal of the request as invalid (INVALID_ARGUMENT) drops the expert from this call only. It is usually
        the caller's own mistake (rows of another width than the experts', values the server's limits refuse), and
        one ban book serves every layer of a trainer, so a ban would make all of them avoid healthy experts for the
        backoff. It is logged as a warning, kept in :attr:`refused` for the layer's error and in :attr:`refusing`
        for the forward's reroutes, and counted as a failure; it neither bans nor re-admits (an earlier ban
        record stays, to double if the expert fails again), unless the expert keeps refusing what the others answer
        (:meth:`weigh_refusals`). A hostile server gains nothing from this: refusing
        takes its experts out of every call it refuses, and anything it could cost a caller by refusing (a slot of
        the mixture, a wait until the refusal comes) it can already cost by answering, slowly, with well-formed
        nonsense that no check catches.

        A call the wait cut at the end of the ``timeout_after_k_min`` grace (``cut``, from :func:`wait_for_experts`)
        is dropped from this forward only: its server may only be slower than the others for a moment (a big
        batch, a pause). Banned as down at once (review 65), a server slower than the fastest by more than the grace
        was banned at its first late answer. Only a server cut in :data:`CUTS_TO_BAN` forwards in a row with
        ``settlement``, none of its experts answering, is banned, as too slow for this layer's grace (one that
        hangs, say): never banned, it would be chosen again and waited for, the whole grace, every forward. A call
        that misses ``forward_timeout`` itself, or fails UNAVAILABLE or DEADLINE_EXCEEDED, bans its whole server.

        ``limit``: the largest magnitude this answer may hold (:func:`answer_limit`; by default
        :attr:`max_abs_value`). ``problem``: what :func:`malformed` said of this answer already (the wait checks answers as they come,
        :func:`wait_for_experts`), so that it is not checked twice. Backward failures are banned apart from forward
        ones (:mod:`dmoe.client.bans`). With ``settlement`` (:meth:`settling`), a server's failure is banned at the pass's
        end.
        """
        direction = "backward" if backward else "forward"
        error = None if not future.done() or future.cancelled() else future.exception()
        if future.done() and not future.cancelled() and error is None:
            result = future.result()
            if problem is UNCHECKED:
                problem = malformed(result, shape, dtype, self.max_abs_value if limit is UNCHECKED else limit)
            if problem is None:
                self.bans.succeed(uid, endpoint, backward=backward)
                if settlement is not None:
                    settlement.answered.add(endpoint)
                if self.refusal_streaks:
                    self.refusal_streaks.pop(f"{direction} {uid}", None)
                return result
            error = RuntimeError(f"malformed answer: {problem}")
        elif cut and error is None:
            logger.debug("%s %s dropped from this call only: cut by timeout_after_k_min", direction, uid)
            if settlement is not None:
                settlement.cut.add(endpoint)
            return None
        if backward:
            self.stats.backward_failures += 1
        code = getattr(error, "code", None)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            self.refused = f"{uid} at {endpoint}: {getattr(error, 'message', error)}"
            if not backward:
                self.refusing.add(uid)
            logger.warning("%s %s dropped from this call only, not banned: the server refused the request as "
                           "invalid (%s)", direction, uid, error)
            return None
        server_down = error is None or code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.refusal_streaks.pop(f"{direction} {uid}", None)  # (a failure of another kind: its own ban, from here)
        why = str(error) if error is not None else "no answer in time"
        if server_down and settlement is not None:
            settlement.deferred.append((uid, endpoint, backward, why))
            return None
        backoff = self.bans.fail(uid=None if server_down else uid, endpoint=endpoint if server_down else None,
                                 backward=backward)
        what = f"server {endpoint}" if server_down else f"expert {uid}"
        logger.info("%s %s dropped (%s); %s banned for %.1fs", direction, uid, why, what, backoff)
        return None


    def weigh_refusals(self, refused: Sequence[tuple[str, str]], others_answered: bool,
                       backward: bool = False) -> None:
        """Bans the experts (``(uid, endpoint)``) that refused a forward (``backward``: a backward, counted apart)
        as invalid :data:`REFUSALS_TO_BAN` times in a row while other experts answered the same call, rows of the
        same inputs (or gradients of the same outputs: a server that answers forwards and refuses every backward
        never trains, and a row whose only expert it was gets no gradient). Then the refusals are the
        server's own, not the caller's mistake: a server whose limits are far stricter than the others'
        (``--max-abs-value``), or one serving other shapes under these uids. Unbanned, the gate would pick its
        experts every step, wait for their refusals and lose their slots of the mixture for good; banned, the next
        beam search picks the next-best experts, and the backoff retries them as it retries failed ones. A caller's
        own mistake (rows of the wrong width, non-finite values) is refused by every expert: no streak grows."""
        if not others_answered:
            return
        direction = "backward" if backward else "forward"
        for uid, endpoint in refused:
            key = f"{direction} {uid}"
            streak = self.refusal_streaks[key] = self.refusal_streaks.get(key, 0) + 1
            if streak >= REFUSALS_TO_BAN:
                del self.refusal_streaks[key]
                backoff = self.bans.fail(uid=uid, backward=backward)
                logger.warning("expert %s at %s refused %d %ss in a row that other experts answered: banned "
                               "for %.1fs", uid, endpoint, streak, direction, backoff)


@dataclass
class Settlement:
    """One pass over a call's outcomes (:meth:`CallPolicy.settling`): the server failures banned at its end, and
    the endpoints that answered in it. Local to the pass, so that layers or threads sharing a policy do not mix."""

    deferred: list[tuple[str, str, bool, str]] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)
    cut: set[str] = field(default_factory=set)  # servers the grace cut calls of, in this pass


def wait_for_experts(futures: Sequence[Future], rows: Sequence[np.ndarray], n_rows: int, k_min: int,
                      timeout: float | None, timeout_after_k_min: float | None,
                      accept: Callable[[int], bool] | None = None,
                      answered_before: np.ndarray | None = None) -> list[int]:
    """Waits until every row has ``k_min`` answers (or nothing left to wait for), then at most
    ``timeout_after_k_min`` more for stragglers; never past ``timeout`` in total. Futures left pending are
    cancelled and count as dropped. ``rows[i]``: the rows future ``i`` answers (distinct). ``accept(i)``: whether
    future ``i``'s result counts as an answer (the layer's checks: an answer it will drop, NaN say, must not end
    the wait for the others, or a fast expert answering nonsense cuts off the honest ones; review 46).

    Returns the indices of the futures cancelled at the end of the ``timeout_after_k_min`` grace, before
    ``timeout``: stragglers, merely slower than the others, not servers known to be down (review 65: banned as
    down, a server slower than the fastest by more than the grace was never used again, and a fast hostile one got
    every slower honest one banned). Those cancelled at ``timeout`` itself are not in it: they missed the forward's
    own deadline.

    ``answered_before``: answers each row has already (from an earlier wait of the same forward), towards k_min.

    Answers arrive through one queue fed by done-callbacks: ``concurrent.futures.wait(FIRST_COMPLETED)`` would
    install and remove a waiter on every pending future after each answer, and wake once per answer even when a
    server's batch call settles all its experts at once (with many trainer threads, the lock traffic of that cost
    more client CPU than the layer's own arithmetic).
    """
    start = time.monotonic()
    overall = deadline = start + timeout if timeout is not None else float("inf")
    chosen = np.zeros(n_rows, dtype=np.int64)
    for r in rows:
        chosen[r] += 1
    needed = np.minimum(chosen, k_min if answered_before is None else np.maximum(k_min - answered_before, 0))
    answered = np.zeros(n_rows, dtype=np.int64)
    pending_per_row = chosen.copy()
    finished: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i, future in enumerate(futures):
        future.add_done_callback(lambda _, i=i: finished.put(i))
    pending = [True] * len(futures)
    n_pending = len(futures)
    k_min_reached = False
    while n_pending:
        now = time.monotonic()
        if not k_min_reached and bool(((answered >= needed) | (pending_per_row == 0)).all()):
            k_min_reached = True
            if timeout_after_k_min is not None:
                deadline = min(deadline, now + timeout_after_k_min)
        remaining = deadline - now
        if remaining <= 0:
            break
        try:
            done = [finished.get(timeout=min(remaining, 3600))]
        except queue.Empty:
            continue  # the deadline check above ends the wait
        with contextlib.suppress(queue.Empty):
            while True:  # everything that settled meanwhile, without waking again
                done.append(finished.get_nowait())
        for i in done:
            if not pending[i]:
                continue
            pending[i] = False
            n_pending -= 1
            pending_per_row[rows[i]] -= 1
            if not futures[i].cancelled() and futures[i].exception() is None and (accept is None or accept(i)):
                answered[rows[i]] += 1
    cut = [i for i, still in enumerate(pending) if still]
    for i in cut:
        futures[i].cancel()
    return cut if deadline < overall else []


def refusal(future: Future) -> bool:
    """Whether the call ended in the server's refusal of the request as invalid (INVALID_ARGUMENT)."""
    if not future.done() or future.cancelled():
        return False
    return getattr(future.exception(), "code", None) == grpc.StatusCode.INVALID_ARGUMENT


def answer_limit(max_abs_value: float | None, dtype: torch.dtype, terms: int = 1) -> float | None:
    """The largest magnitude an expert's answer may hold: ``max_abs_value`` (None: any), and no more than the
    caller's ``dtype`` holds, divided by the ``terms`` added up per value (the experts' input gradients of a row).
    Checked in float32 and cast afterwards, a float16 caller's answer of 7e4 passed 1e6 and became inf: the mixture
    and the loss were inf/NaN whatever the expert's weight, and nobody was blamed (review 94)."""
    if not dtype.is_floating_point:
        return max_abs_value
    largest = torch.finfo(dtype).max / max(1, terms)
    return largest if not max_abs_value else min(max_abs_value, largest)


def malformed(result: Sequence[torch.Tensor], shape: tuple[int, ...] | None,
              dtype: torch.dtype | None = None, max_abs_value: float | None = None) -> str | None:
    """What is wrong with an expert's answer that should be floating-point of ``shape`` and ``dtype``, finite, and
    of magnitude at most ``max_abs_value`` (None or 0: any) (None: nothing). Finiteness and magnitude both come
    from numpy's smallest and largest value of each tensor (:func:`~dmoe.client.remote_expert.value_range`): two
    passes on the caller's thread, no torch op."""
    if not result:
        return "no tensors"
    first = result[0]
    if shape is not None and tuple(first.shape) != shape:
        return f"expected shape {list(shape)}, got {list(first.shape)}"
    if not first.is_floating_point():
        return f"expected floating-point values, got {first.dtype}"
    if dtype is not None and first.dtype != dtype:
        return f"expected {dtype}, got {first.dtype}"
    for tensor in result:
        low, high = value_range(tensor)
        if not (math.isfinite(low) and math.isfinite(high)):
            return "non-finite values (NaN or Inf)"
        if max_abs_value and max(-low, high) > max_abs_value:
            return f"a value of magnitude {max(-low, high):.3g}, above the layer's max_abs_value {max_abs_value:g}"
    return None
