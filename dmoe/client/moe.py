"""The remote DMoE layer: beam search for alive experts, one call per server, answers gathered per row.

The gate and its maths are in :mod:`dmoe.client.gating` (shared with the in-process layer); what happens to
experts that fail, are late or answer nonsense (dropped, banned, renormalised around) is the failure policy in
:mod:`dmoe.client.failures`, which the autograd function below receives as a :class:`CallPolicy`.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import wait as wait_futures
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from dmoe.client.bans import BanConfig, Bans
from dmoe.client.beam_search import PrefixCache, beam_search
from dmoe.client.failures import (MAX_ABS_VALUE, MAX_CHUNKS, UNCHECKED, CallPolicy, answer_limit, malformed, refusal,
                                  wait_for_experts)
from dmoe.client.gating import MixtureBase, TooFewGradients
from dmoe.client.remote_expert import (NON_FINITE_GRADIENTS, RemoteExpertError, all_finite, backward_futures,
                                       expert_info, forward_futures, loss_scale, new_activation_id)
from dmoe.timing import NO_LAPS, Laps, NoLaps
from dmoe.wire import NONE, ChannelPool
from dmoe.wire.codec import GatheredRows, parse_compression

logger = logging.getLogger(__name__)


class PlannedCall(NamedTuple):
    """One expert's request in a forward: its rows of the batch and the top-k slot each row chose it in."""

    uid: str
    endpoint: str
    rows: np.ndarray
    slots: np.ndarray


class AnsweredCall(NamedTuple):
    """A forward request that answered, kept for its backward: ``rows_in`` are the rows sent, sent again only if
    the server no longer holds them (a backward with ``activation_id`` sends gradients alone)."""

    uid: str
    endpoint: str
    rows: np.ndarray
    slots: np.ndarray
    activation_id: bytes | None
    rows_in: GatheredRows


#: integer types by byte width, to move elements of any torch dtype as raw bits (numpy lacks bfloat16)
_BITS = {1: (torch.int8, np.int8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32), 8: (torch.int64, np.int64)}


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's elements as same-width integers.

    The layer gathers each expert's rows and scatters its answers with numpy rather than torch: torch runs such
    copies (64 rows of 1024 floats and up) on its OpenMP team, whose idle threads then spin for milliseconds after
    every one. A client sharing its machine with an expert server took that CPU from the server's compute; numpy
    copies on the calling thread.
    """
    return tensor.view(_BITS[tensor.element_size()][0]).numpy()


def _from_bits(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(bits).view(dtype)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros``, filled by numpy on this thread (all-zero bits are zero in every float format)."""
    return _from_bits(np.zeros(shape, dtype=_BITS[dtype.itemsize][1]), dtype)


#: what rows and gradients travel as: the experts' schema (every built-in class takes float32 rows; a server's
#: --autocast decides the precision it computes in). Inputs of other float dtypes (under autocast, a .half() or
#: .double() model) are cast for the wire and the mixture comes back in their dtype.
WIRE_DTYPE = torch.float32


def _chunks(call: PlannedCall, limit: int) -> list[PlannedCall]:
    """``call``'s rows cut into requests of at most ``limit`` rows each, as even as they go."""
    parts = -(-len(call.rows) // limit)
    return [PlannedCall(call.uid, call.endpoint, rows, slots)
            for rows, slots in zip(np.array_split(call.rows, parts), np.array_split(call.slots, parts))]


def _split(plan: list[PlannedCall], limits: dict[str, int]) -> list[PlannedCall]:
    """The plan with every expert's rows cut into requests its server takes (``limits``: max_batch_size by
    endpoint, where known): a server refuses a request of more rows (RESOURCE_EXHAUSTED), and an expert whose rows
    exceed it was banned every step (review 65). The requests of one server still travel in one call.

    An expert whose rows would take more than :data:`~dmoe.client.failures.MAX_CHUNKS` requests goes uncut, as on a
    layer that knows no limit: its server refuses the request (or answers it, if its limit grew meanwhile), and
    :meth:`~dmoe.client.failures.CallPolicy.learn_batch_limits` believes no limit that needs that many, so the
    expert fails as at a first refusal. Cut regardless, a server that once answered "max_batch_size 1" to a
    forward of few rows got a request per row from every later forward (review 85)."""
    split: list[PlannedCall] = []
    for call in plan:
        limit = limits.get(call.endpoint)
        if limit is None or len(call.rows) <= limit or -(-len(call.rows) // limit) > MAX_CHUNKS:
            split.append(call)
        else:
            split.extend(_chunks(call, limit))
    return split


class _RemoteExperts(torch.autograd.Function):
    """Calls each chosen expert once with all of its rows (one call per server; rows beyond its server's
    max_batch_size in several requests of that call); backward sends the matching output gradients, request by
    request."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, flat: torch.Tensor, policy: CallPolicy, plan: list[PlannedCall], k: int,
                will_backward: bool, laps: Laps | NoLaps = NO_LAPS, timeout: float | None = None):
        inputs = flat.detach()
        timeout = policy.forward_timeout if timeout is None else timeout
        # requests are built and answers gathered in host memory: inputs on a GPU cross to it once, and the
        # mixed outputs cross back once, instead of one small copy per expert each way
        host = inputs.cpu().to(WIRE_DTYPE).contiguous()
        host_bits = _bits(host)
        if will_backward and host.data_ptr() == inputs.data_ptr():
            # the rows are kept to send again in backward: a copy of the caller's tensor, which may change meanwhile
            host_bits = host_bits.copy()
        laps.lap("to_host")
        started = time.monotonic()
        experts = len(plan)
        known = policy.known_batch_limits()
        if known:  # rows beyond a server's max_batch_size go as several requests (review 65)
            plan = _split(plan, known)

        def send(calls: list[PlannedCall], seconds: float | None) -> tuple[list, list, list]:
            # a backward will follow: the servers keep each forward's inputs (and activations) under its id until
            # then (one id per request: an expert's rows cut into several requests are several activations)
            ids = [new_activation_id() if will_backward else None for _ in calls]
            # each expert's rows are gathered straight into its request (GatheredRows), not into a tensor first
            sent = [GatheredRows(host_bits, call.rows, WIRE_DTYPE) for call in calls]
            # one call per server carries all of its experts' requests; each expert still answers (or fails) alone
            # experts map rows of in_features to rows of in_features (the layer's output is their mixture): any
            # other answer fails undecoded, and a streamed one as soon as it exceeds those rows' bytes
            futures = forward_futures([(uid, endpoint, [rows_in], activation_id)
                                       for (uid, endpoint, _, _), rows_in, activation_id in zip(calls, sent, ids)],
                                      timeout=seconds, compression=policy.compression, channels=policy.channels,
                                      expect=[[(rows_in.shape, WIRE_DTYPE)] for rows_in in sent])
            return ids, sent, futures

        ids, sent, futures = send(plan, timeout)
        laps.lap("send")
        # (the mixture is a convex sum of the answers: within the inputs' dtype when each answer is)
        limit = answer_limit(policy.max_abs_value, inputs.dtype)
        n, d = len(inputs), inputs.shape[-1]
        # answers are checked as they come: one the layer will drop (NaN, a wrong shape) must not count towards
        # k_min, or a fast expert answering nonsense cuts the wait for the honest ones short
        problems: dict[int, str | None] = {}

        def accept(i: int) -> bool:
            problems[i] = malformed(futures[i].result(), (len(plan[i].rows), d), WIRE_DTYPE, limit)
            return problems[i] is None

        # stragglers cut by the k_min grace are dropped from this forward (banned only if cut again and again)
        cut = set(wait_for_experts(futures, [call.rows for call in plan], n, policy.k_min, timeout,
                                   policy.timeout_after_k_min, accept))
        # requests refused for more rows than their server's max_batch_size: cut to its limit and sent again, once
        resent: set[int] = set()  # (their parts answer for them)
        unsent: set[int] = set()  # (no time was left: dropped, not banned)
        if len(problems) < len(plan):
            left = None if timeout is None else timeout - (time.monotonic() - started)
            silent = [i for i in range(len(plan)) if i not in problems]  # (no answer)
            limits = policy.learn_batch_limits([(plan[i].uid, plan[i].endpoint, futures[i], len(plan[i].rows))
                                                for i in silent], left)
            learnt = [(i, limit) for i, limit in zip(silent, limits) if limit is not None]
            if learnt:
                left = None if timeout is None else timeout - (time.monotonic() - started)
                (resent if left is None or left > 0 else unsent).update(i for i, _ in learnt)
                if resent:
                    before = np.bincount(np.concatenate([plan[i].rows for i, problem in problems.items()
                                                         if problem is None] or [np.empty(0, np.int64)]),
                                         minlength=n)
                    first = len(plan)
                    chunks = [chunk for i, limit in learnt for chunk in _chunks(plan[i], limit)]
                    plan = plan + chunks
                    more = send(chunks, left)
                    ids, sent, futures = ids + more[0], sent + more[1], futures + more[2]
                    cut.update(first + j for j in wait_for_experts(
                        futures[first:], [call.rows for call in chunks], n, policy.k_min, left,
                        policy.timeout_after_k_min, lambda j: accept(first + j), before))
        laps.lap("wait")
        # answers land in [n * k, d] at row * k + slot; left uninitialised, as only the pairs nobody answered (often
        # none) need zeros: zeroing all of it first cost a pass over the whole output
        out_bits: np.ndarray | None = None
        alive = np.zeros(n * k, dtype=bool)
        answered, refused, lost = [], [], []
        with policy.settling() as settlement:
            for i, ((uid, endpoint, rows, slots), future, activation_id, rows_in) in enumerate(
                    zip(plan, futures, ids, sent)):
                if i in resent or i in unsent:  # refused for its rows' number: not the expert's failure
                    if i in unsent:
                        lost.append(uid)
                    continue
                # experts map rows of in_features to rows of in_features (the layer's output is their mixture)
                result = policy.outcome(uid, endpoint, future, shape=(len(rows), d), dtype=WIRE_DTYPE,
                                        problem=problems.get(i, UNCHECKED), settlement=settlement,
                                        cut=i in cut)
                if result is None:
                    lost.append(uid)
                    if uid in policy.refusing:
                        refused.append((uid, endpoint))
                    continue
                if out_bits is None:
                    out_bits = np.empty((n * k, d), dtype=_BITS[WIRE_DTYPE.itemsize][1])
                pairs = rows * k + slots
                out_bits[pairs] = _bits(result[0])
                alive[pairs] = True
                # the rows sent are kept only to send again if the server lost them (a backward sends gradients
                # alone)
                answered.append(AnsweredCall(uid, endpoint, rows, slots, activation_id, rows_in))
        if out_bits is None:
            out = _zeros((n, k, d), WIRE_DTYPE)
        else:
            missing = ~alive
            if missing.any():
                out_bits[missing] = 0
            out = _from_bits(out_bits.reshape(n, k, d), WIRE_DTYPE)
        alive = alive.reshape(n, k)
        if refused:
            policy.weigh_refusals(list(dict.fromkeys(refused)), bool(answered))  # (an expert's requests: one refusal)
        policy.stats.experts_chosen += experts
        # an expert is dropped when any of its requests is (an expert cut into several requests counts once)
        policy.stats.experts_dropped += len(set(lost))
        ctx.policy, ctx.answered, ctx.clock = policy, answered, laps.clock
        ctx.inputs_like = (inputs.shape, inputs.dtype, inputs.device)
        alive_t = torch.from_numpy(alive)
        ctx.mark_non_differentiable(alive_t)
        laps.lap("gather")
        out = out.to(inputs.device, dtype=inputs.dtype)
        laps.lap("to_device")
        return out, alive_t

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_alive: Any):
        policy, answered = ctx.policy, ctx.answered
        shape, dtype, device = ctx.inputs_like
        laps = NO_LAPS if ctx.clock is None else ctx.clock.laps(device)
        # one copy off the GPU, sliced per expert (with numpy: see _bits)
        grad_host = grad_out.cpu().to(WIRE_DTYPE).contiguous()                     # [n, k, d]
        laps.lap("bwd_to_host")
        if not all_finite(grad_host):
            # An overflow, usually AMP's. Servers refuse NaN and Inf (and must never step on them), so nothing is
            # sent, not even the rows that are finite: a GradScaler skips this step whatever they hold, and
            # experts stepping on it would train on a batch the rest of the model throws away. Every row's input
            # gradient is NaN, unknown as none was sent, so that the GradScaler sees the overflow, as it would
            # for a local layer.
            bad = int((~np.isfinite(grad_host.numpy()).reshape(len(grad_host), -1).all(1)).sum())
            policy.stats.nonfinite_backwards += 1
            logger.warning("%r: %d of %d rows' %s", policy.layer_name, bad, len(grad_host), NON_FINITE_GRADIENTS)
            return None, torch.full(tuple(shape), float("nan"), dtype=dtype, device=device), *(None,) * 6
        scale = loss_scale(policy.grad_scaler)
        if scale != 1.0:  # the experts step on what they get: unscaled (into a new array: grad_host may be grad_out)
            grad_host = torch.from_numpy(np.multiply(grad_host.numpy(), np.float32(1.0 / scale)))
        # each expert's (row, slot) gradients, gathered straight into its request
        grad_bits = _bits(grad_host).reshape(-1, grad_host.shape[-1])                 # [n * k, d]
        k = grad_host.shape[1]
        futures = backward_futures([(uid, endpoint, [rows_in], [GatheredRows(grad_bits, rows * k + slots, WIRE_DTYPE)],
                                     activation_id) for uid, endpoint, rows, slots, activation_id, rows_in in answered],
                                   timeout=policy.backward_timeout, compression=policy.compression,
                                   channels=policy.channels)
        laps.lap("bwd_send")
        _, late = wait_futures(futures, timeout=policy.backward_timeout)
        for future in late:  # dropped: a server that has not begun it need not step on gradients nobody waits for
            future.cancel()
        laps.lap("bwd_wait")
        # summed in float32 (float64 for float64 inputs), scaled again, and only then cast to the inputs' dtype:
        # float16 inputs under a GradScaler held the unscaled gradients, which underflowed to zero (review 46)
        grad_sum = np.zeros((shape[0], *shape[1:]), dtype=np.float64 if dtype == torch.float64 else np.float32)
        got = np.zeros(shape[0], dtype=np.int64)
        wanted = np.zeros(shape[0], dtype=np.int64)
        refused = []
        # the experts' gradients of a row are summed (k of them at most), unscaled: a loss scale that overflows
        # them is the scaler's to lower, not the experts' fault
        limit = answer_limit(policy.max_abs_value, dtype, k)
        with policy.settling() as settlement:
            for (uid, endpoint, rows, _, _, rows_in), future in zip(answered, futures):
                wanted[rows] += 1
                result = policy.outcome(uid, endpoint, future, backward=True, shape=tuple(rows_in.shape),
                                        dtype=WIRE_DTYPE, settlement=settlement, limit=limit)
                if result is None:
                    if refusal(future):
                        refused.append((uid, endpoint))
                    continue
                # rows are distinct within one expert's request, so a plain indexed add accumulates them
                grad_sum[rows] += result[0].numpy()
                got[rows] += 1
        if refused:
            policy.weigh_refusals(refused, bool(got.any()), backward=True)
        policy.stats.backward_calls += len(answered)
        # capped by the experts that answered each row's forward (wanted): a row that k_min let through with fewer
        # answers is not failed again here, or every run with k_min < backward_k_min would stop at a dead server
        short = got < np.minimum(wanted, policy.backward_k_min)
        if bool(short.any()):
            raise TooFewGradients(
                f"{int(short.sum())} rows got fewer than backward_k_min={policy.backward_k_min} expert gradients "
                f"in {policy.layer_name!r}"
            )
        if scale != 1.0:  # scaled again, as the caller's scaler expects of every gradient
            grad_sum *= scale
        laps.lap("bwd_sum")
        grad_inputs = torch.from_numpy(grad_sum).to(device, dtype=dtype)
        laps.lap("bwd_to_device")
        return None, grad_inputs, None, None, None, None, None, None


class RemoteMixtureOfExperts(MixtureBase):
    """A mixture-of-experts layer whose experts are served by other machines and found through the DHT.

    :param in_features: hidden size of the inputs (the experts' input and output size).
    :param grid: the expert grid of this layer, e.g. ``(16, 16)`` for uids ``ffn0.0.0`` .. ``ffn0.15.15``.
    :param layer: the layer name, e.g. ``"ffn0"``.
    :param dht: a :class:`dmoe.dht.DHT` node to search for alive experts.
    :param k_best: experts chosen per row (token).
    :param k_min: forward waits until every row has this many answers (or no call left pending) ...
    :param timeout_after_k_min: ... then at most this many seconds more for the remaining experts (those it cuts
        are dropped from that forward; a server cut in 3 forwards in a row is banned as too slow).
    :param forward_timeout: no forward waits longer than this in total; slower experts are dropped.
    :param backward_k_min: backward raises if a row gets fewer expert gradients than this, or than the experts
        that answered its forward where fewer did: a floor on what backward loses, not on the answers (a row that
        ``k_min`` let through with one answer passes ``backward_k_min=2`` with that expert's gradient; set
        ``k_min >= backward_k_min`` for an absolute floor). 0, the default: never, as in ``dmoe-train``; a row
        whose experts all failed then gets its input gradient through the gate alone.
        Above 0, mind when it raises: after every backward call has settled, so the experts that did answer have
        already stepped on the batch, while the caller's own step is lost (``loss.backward()`` raised: none of its
        parameters got a gradient). Client and experts then drift apart by that batch, each time a server dies
        between a forward and its backward.
    :param backward_timeout: experts that have not answered backward by then contribute no gradient.
    :param allow_zero_outputs: rows that no expert answered give zeros instead of raising.
    :param max_abs_value: an expert whose answer (outputs, or input gradients) holds a value of a larger magnitude
        is dropped and banned, as for NaN (None or 0: no limit; the default is the servers' own ``--max-abs-value``):
        a finite but huge answer, from a diverged or hostile expert, would make the loss NaN downstream, and then
        no expert would be blamed.
    :param compression: wire compression of the tensors sent (``dmoe.wire.NONE``, ``FLOAT16``, ``UINT8``).
    :param bans: shares the ban book between layers (experts of a dead server are banned once for all).
    :param reroute_attempts: rows that none of their experts answered are sent, within the same forward, to
        the next-best experts that are not banned (nor refused this forward's rows as invalid), up to this many
        times.
    :param switch: Switch-style weights (the router's probability over the whole grid; usually with ``k_best=1``)
        and a :attr:`balance_loss` per forward; see :class:`~dmoe.client.gating.MixtureBase`.
    :param grad_scaler: the ``torch.amp.GradScaler`` scaling the loss whose gradients reach this layer (also
        settable later: ``layer.grad_scaler = scaler``). The experts then get their gradients unscaled, as they
        step on them at once, where the caller's optimizer waits for ``scaler.unscale_``/``scaler.step``: without
        it an SGD expert would step ``scale`` (65536 at first) times too far, and servers with ``--max-abs-value``
        would refuse the scaled gradients. The layer's input gradients stay scaled, as the scaler expects.

    Routing is per token: ``[batch, seq, hidden]`` inputs are flattened to rows. Rows sent to the same expert
    travel in one request (several, of at most its server's ``max_batch_size`` each, once the server refused more
    and so told it), the requests to one server's experts in one gRPC call, and all servers are called
    concurrently. Each expert still answers or fails alone (and is dropped alone).
    """

    def __init__(self, in_features: int, grid: Sequence[int], layer: str, dht: Any, *, k_best: int = 4,
                 k_min: int = 1, forward_timeout: float | None = 10.0, timeout_after_k_min: float | None = 1.0,
                 backward_k_min: int = 0, backward_timeout: float | None = 10.0, allow_zero_outputs: bool = False,
                 compression: int = NONE, bans: Bans | None = None, ban_config: BanConfig | None = None,
                 channels: ChannelPool | None = None, cache: Any = None, reroute_attempts: int = 1,
                 switch: bool = False, grad_scaler: Any = None, max_abs_value: float | None = MAX_ABS_VALUE):
        super().__init__(in_features, grid, layer, k_best, allow_zero_outputs, switch)
        if dht is None:
            raise ValueError("dht is required: a dmoe.DHT node joined to the swarm, to find its experts")
        if not 1 <= k_min <= k_best:
            raise ValueError(f"k_min must be between 1 and k_best={k_best}, got {k_min}")
        if not 0 <= backward_k_min <= k_best:
            raise ValueError(f"backward_k_min must be between 0 and k_best={k_best}, got {backward_k_min}")
        for name, seconds, zero_ok in (("forward_timeout", forward_timeout, False),
                                       ("backward_timeout", backward_timeout, False),
                                       ("timeout_after_k_min", timeout_after_k_min, True)):
            if seconds is not None and not (seconds >= 0 if zero_ok else seconds > 0):
                raise ValueError(f"{name} must be {'>= 0' if zero_ok else '> 0'} seconds (or None: no limit), "
                                 f"got {seconds}")
        if max_abs_value is not None and not max_abs_value >= 0:
            raise ValueError(f"max_abs_value must be >= 0 (or 0/None: no limit), got {max_abs_value}")
        if reroute_attempts < 0:
            raise ValueError(f"reroute_attempts must be >= 0, got {reroute_attempts}")
        compression = parse_compression(compression)  # raises ValueError naming the choices
        self.reroute_attempts = reroute_attempts
        self.dht = dht
        self.policy = CallPolicy(k_min=k_min, timeout_after_k_min=timeout_after_k_min,
                                 forward_timeout=forward_timeout, backward_k_min=backward_k_min,
                                 backward_timeout=backward_timeout, max_abs_value=max_abs_value or None,
                                 compression=compression, channels=channels,
                                 bans=bans if bans is not None else Bans(ban_config or BanConfig()),
                                 stats=self.stats, layer_name=layer, grad_scaler=grad_scaler)
        self.bans = self.policy.bans
        self._cache = cache if cache is not None else PrefixCache()
        self._endpoints: dict[str, str] = {}
        # autograd needs one input that requires grad, or backward (and so the experts' training) is skipped
        # whenever the layer's inputs do not require grad.
        self._dummy = torch.empty(0, requires_grad=True)

    @property
    def grad_scaler(self) -> Any:
        """The ``torch.amp.GradScaler`` whose scale the experts' gradients are divided by (None: none)."""
        return self.policy.grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler: Any) -> None:
        self.policy.grad_scaler = scaler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.policy.refused = None  # what this forward's servers refuse, for its error
        self.policy.refusing.clear()  # experts its reroutes pass over
        return super().forward(x)

    def expert_schemas(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """The :func:`~dmoe.client.remote_expert.expert_info` of the experts of this layer that a uniform gate would
        choose (up to ``k_best``; banned ones skipped), of those that answer, asked one at a time as the caller
        iterates; none while no expert is found. A caller checks with it that the experts take ``in_features``-wide
        rows: a layer of another width has every request refused as invalid, which only drops the expert from that
        call (with ``allow_zero_outputs``, every row then skips the layer, step after step: review 112 D1)."""
        found = beam_search(self.dht, self.layer, [torch.zeros(1, size) for size in self.grid], self.k_best,
                            exclude=self._is_excluded if len(self.bans) else None, cache=self._cache)
        for uid, endpoint in found[0] if found else ():
            try:
                yield expert_info(endpoint, uid, timeout=timeout, channels=self.policy.channels)
            except RemoteExpertError:  # (a server gone since it declared its experts: the next one)
                continue

    def _time_left(self, started: float) -> float | None:
        timeout = self.policy.forward_timeout
        return None if timeout is None else timeout - (time.monotonic() - started)

    def _why_no_answers(self) -> str:
        refused = self.policy.refused
        return "" if refused is None else f" (the servers refused the requests as invalid, e.g. {refused})"

    def _is_excluded(self, uid: str, endpoint: str) -> bool:
        return uid in self.policy.refusing or self.bans.is_banned(uid, endpoint)

    def _choose(self, grid_scores: list[torch.Tensor]) -> list[list[str]]:
        # (no predicate while nothing is excluded: beam search would call it for every candidate expert)
        excluding = len(self.bans) or self.policy.refusing
        found = beam_search(self.dht, self.layer, [s.float().cpu() for s in grid_scores], self.k_best,
                            exclude=self._is_excluded if excluding else None, cache=self._cache)
        remember = self._endpoints.update  # (uid, endpoint) pairs, a row at a time in C: thousands of rows a step
        for row in found:
            remember(row)
        return [[uid for uid, _ in row] for row in found]

    def _plan(self, chosen: list[list[str]]) -> list[PlannedCall]:
        """Groups (row, slot) pairs by expert: one request per expert carries all of its rows (in row order); the
        experts in order of first appearance."""
        codes, uids = self._expert_codes(chosen, len(chosen))
        flat = codes.reshape(-1)
        held = np.flatnonzero(flat >= 0)  # row * k + slot of every pair, ascending
        order = held[np.argsort(flat[held], kind="stable")]
        groups = np.split(order, np.cumsum(np.bincount(flat[held], minlength=len(uids)))[:-1])
        return [PlannedCall(uid, self._endpoints[uid], group // self.k_best, group % self.k_best)
                for uid, group in zip(uids, groups)]

    def _run_experts(self, flat: torch.Tensor, chosen: list[list[str]], laps: Laps | NoLaps = NO_LAPS,
                     timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan(chosen)
        laps.lap("plan")
        # the dummy requires grad, so autograd records this call (and a backward can follow) whenever grad is on
        return _RemoteExperts.apply(self._dummy, flat, self.policy, plan, self.k_best, torch.is_grad_enabled(), laps,
                                    timeout)
