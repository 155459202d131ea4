"""The DMoE layer: structured gating, beam search for alive experts, batched fan-out, and dropping failures.

Gating is *structured*: one linear projection scores every coordinate of every grid dimension, and an
expert's score is the sum of its coordinates' scores, so ``ffn0.3.17`` scores ``s0[3] + s1[17]``. Inputs with
extra dimensions (``[batch, seq, hidden]``) are routed **per token**: every position picks its own experts.

Where the gate drops a dead expert: :func:`_wait_for_experts` decides which calls answered in time,
:class:`_RemoteExperts` marks the rest as not alive, and :meth:`_MixtureBase._combine` renormalises the gate's
softmax over the experts that answered, row by row. Failed experts and servers are banned locally
(:mod:`dmoe.client.bans`) so the next beam search picks the next-best alive experts instead.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import grpc
import numpy as np
import torch
from torch import nn

from dmoe.client.bans import BanConfig, Bans
from dmoe.uid import join_uid, split_uid
from dmoe.wire import NONE, ChannelPool

logger = logging.getLogger(__name__)


class NoAliveExpertsError(RuntimeError):
    """Some rows got no answer from any expert (and ``allow_zero_outputs`` is off)."""


@dataclass
class MoEStats:
    """Cumulative counters; the trainer shows ``experts_dropped / experts_chosen`` over an interval."""

    forward_passes: int = 0
    experts_chosen: int = 0        # expert calls made in forward (one per chosen expert per batch)
    experts_dropped: int = 0       # of those, missing, failed or too slow
    rows_without_expert: int = 0   # rows that got zeros (allow_zero_outputs) or made forward raise
    backward_calls: int = 0
    backward_failures: int = 0


class _MixtureBase(nn.Module):
    """Gating maths shared by the remote layer and its in-process twin (same maths, other transport).

    Two ways to weigh the chosen experts:

    - default: a softmax over the chosen experts' scores, renormalised over those that answered;
    - ``switch=True`` (Switch Transformer style, usually with ``k_best=1``): each chosen expert's probability under
      the router's softmax over the *whole* grid, which for summed coordinate scores is the product of one softmax
      per grid dimension. Not renormalised: with one expert per row a renormalised weight would always be 1 and the
      gate would get no gradient. Each forward also sets :attr:`balance_loss`, the load-balancing term to add
      (times a small coefficient) to the training loss.
    """

    def __init__(self, in_features: int, grid_size: Sequence[int], uid_prefix: str, k_best: int,
                 allow_zero_outputs: bool = False, switch: bool = False):
        super().__init__()
        if k_best < 1:
            raise ValueError(f"k_best must be >= 1, got {k_best}")
        self.in_features = in_features
        self.grid_size = tuple(int(g) for g in grid_size)
        self.uid_prefix = uid_prefix
        self.k_best = k_best
        self.allow_zero_outputs = allow_zero_outputs
        self.switch = switch
        #: set by each forward when ``switch``: 1 when tokens and router probability spread evenly over every grid
        #: dimension's coordinates, up to the dimension's size when all go to one coordinate. Differentiable
        #: w.r.t. the gate.
        self.balance_loss: torch.Tensor | None = None
        self.proj = nn.Linear(in_features, sum(self.grid_size))
        self.stats = MoEStats()
        self._coords_cache: dict[str, tuple[int, ...]] = {}
        self.reroute_attempts = 0  # in-process experts never fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs [..., {self.in_features}], got {list(x.shape)}")
        flat = x.reshape(-1, self.in_features)
        grid_scores = list(self.proj(flat).split(self.grid_size, dim=-1))
        detached = [s.detach() for s in grid_scores]
        chosen = self._choose(detached)                                # per row: uids, best first
        coords, valid = self._coords_tensor(chosen, flat.shape[0])     # [n, k, ndim], [n, k]
        expert_out, alive = self._run_experts(flat, chosen)            # [n, k, out], [n, k]
        for _ in range(self.reroute_attempts):
            # Rows that none of their experts answered: the failed ones are banned now, so a second search
            # finds the next-best alive experts for exactly those rows (a dead server costs no lost rows).
            lost = torch.nonzero(valid.any(1) & ~(valid & alive).any(1)).squeeze(1)
            if len(lost) == 0:
                break
            rechosen = self._choose([s[lost] for s in detached])
            if not any(rechosen):
                break
            coords[lost], valid[lost] = self._coords_tensor(rechosen, len(lost))
            retry_out, alive[lost] = self._run_experts(flat[lost], rechosen)
            expert_out = expert_out.index_put((lost,), retry_out.to(expert_out.dtype))
        self.stats.forward_passes += 1
        if self.switch:
            self.balance_loss = self._balance_loss(grid_scores, coords, valid)
        out = self._combine(grid_scores, coords, valid & alive, expert_out)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _balance_loss(self, grid_scores: list[torch.Tensor], coords: torch.Tensor,
                      valid: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's auxiliary loss ``n * sum_i f_i * P_i`` per grid dimension, averaged over dimensions.

        ``f_i``: the share of routed (row, slot) pairs whose expert has coordinate ``i`` in that dimension;
        ``P_i``: the router's mean probability of coordinate ``i``. Factorised by dimension because the router's
        probability of an expert is the product of its coordinates' (and the grid may hold far more experts than
        a batch has rows).
        """
        coords, valid = coords.to(grid_scores[0].device), valid.to(grid_scores[0].device)
        routed = valid.sum().clamp_min(1)
        terms = []
        for dim, (size, scores) in enumerate(zip(self.grid_size, grid_scores)):
            share = torch.zeros(size, dtype=scores.dtype, device=scores.device).index_add_(
                0, coords[:, :, dim][valid], torch.ones(int(valid.sum()), dtype=scores.dtype, device=scores.device))
            terms.append(size * (share / routed * torch.softmax(scores, dim=-1).mean(0)).sum())
        return torch.stack(terms).mean()

    def _choose(self, grid_scores: list[torch.Tensor]) -> list[list[str]]:
        raise NotImplementedError

    def _run_experts(self, flat: torch.Tensor, chosen: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _coords_tensor(self, chosen: list[list[str]], n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grid coordinates [n, k, ndim] of the chosen experts, and which slots hold one (rows may get < k)."""
        pad = (0,) * len(self.grid_size)
        coords, valid = [], []
        for uids in chosen:
            uids = uids[: self.k_best]
            row = [self._coords_of(uid) for uid in uids]
            coords.append(row + [pad] * (self.k_best - len(row)))
            valid.append([True] * len(row) + [False] * (self.k_best - len(row)))
        shape = (n_rows, self.k_best, len(self.grid_size))
        return torch.tensor(coords, dtype=torch.long).reshape(shape), torch.tensor(valid, dtype=torch.bool).reshape(shape[:2])

    def _coords_of(self, uid: str) -> tuple[int, ...]:
        coords = self._coords_cache.get(uid)
        if coords is None:
            coords = self._coords_cache[uid] = split_uid(uid)[1]
        return coords

    def _combine(self, grid_scores: list[torch.Tensor], coords: torch.Tensor, alive: torch.Tensor,
                 expert_out: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weights (see the class docstring), then their weighted sum."""
        coords, alive = coords.to(expert_out.device), alive.to(expert_out.device)
        has_any = alive.any(dim=1)
        if not bool(has_any.all()):
            missing = int((~has_any).sum())
            self.stats.rows_without_expert += missing
            if not self.allow_zero_outputs:
                raise NoAliveExpertsError(
                    f"{missing} of {len(has_any)} rows got no answer from any expert of {self.uid_prefix!r}; "
                    "pass allow_zero_outputs=True to use zeros for them instead"
                )
        if self.switch:
            # the router's probability of each chosen expert over the whole grid: summed coordinate scores, so the
            # log-probability is the sum of each dimension's log-softmax; experts that did not answer weigh 0
            log_probs = [torch.log_softmax(scores, dim=-1) for scores in grid_scores]
            log_p = sum(lp.gather(1, coords[:, :, dim]) for dim, lp in enumerate(log_probs))
            weights = torch.exp(log_p) * alive
            return torch.einsum("nk,nkd->nd", weights.to(expert_out.dtype), expert_out)
        logits = sum(scores.gather(1, coords[:, :, dim]) for dim, scores in enumerate(grid_scores))
        # -inf for experts that did not answer; rows with none at all get finite logits and zero weights, so
        # neither the output nor the gradient ever sees NaN.
        fill = torch.where(has_any, float("-inf"), 0.0).to(logits.dtype)[:, None]
        weights = torch.softmax(torch.where(alive, logits, fill), dim=1) * alive
        return torch.einsum("nk,nkd->nd", weights.to(expert_out.dtype), expert_out)


def _wait_for_experts(futures: Sequence[Future], rows: Sequence[np.ndarray], n_rows: int, k_min: int,
                      timeout: float | None, timeout_after_k_min: float | None) -> None:
    """Waits until every row has ``k_min`` answers (or nothing left to wait for), then at most
    ``timeout_after_k_min`` more for stragglers; never past ``timeout`` in total. Futures left pending are
    cancelled and count as dropped. ``rows[i]``: the rows future ``i`` answers (distinct)."""
    start = time.monotonic()
    deadline = start + timeout if timeout is not None else float("inf")
    chosen = np.zeros(n_rows, dtype=np.int64)
    for r in rows:
        chosen[r] += 1
    needed = np.minimum(chosen, k_min)
    answered = np.zeros(n_rows, dtype=np.int64)
    pending_per_row = chosen.copy()
    pending = set(range(len(futures)))
    index = {id(f): i for i, f in enumerate(futures)}
    k_min_reached_at: float | None = None
    while pending:
        now = time.monotonic()
        if k_min_reached_at is None and bool(((answered >= needed) | (pending_per_row == 0)).all()):
            k_min_reached_at = now
            if timeout_after_k_min is not None:
                deadline = min(deadline, now + timeout_after_k_min)
        remaining = deadline - now
        if remaining <= 0:
            break
        done, _ = wait_futures([futures[i] for i in pending], timeout=min(remaining, 3600),
                               return_when=FIRST_COMPLETED)
        for future in done:
            i = index[id(future)]
            pending.discard(i)
            pending_per_row[rows[i]] -= 1
            if future.exception() is None:
                answered[rows[i]] += 1
    for i in pending:
        futures[i].cancel()


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


#: dtypes whose input gradients are summed with numpy (others with torch's index_add_)
_NUMPY_SUMS = (torch.float32, torch.float64)


class _RemoteExperts(torch.autograd.Function):
    """Calls each chosen expert once with all of its rows (one call per server); backward sends the matching
    output gradients."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, flat: torch.Tensor, layer: "RemoteMixtureOfExperts",
                plan: list[tuple[str, str, np.ndarray, np.ndarray]], k: int, will_backward: bool):
        from dmoe.client.remote_expert import forward_futures, new_activation_id

        inputs = flat.detach()
        # requests are built and answers gathered in host memory: inputs on a GPU cross to it once, and the
        # mixed outputs cross back once, instead of one small copy per expert each way
        host = inputs.cpu().contiguous()
        host_bits = _bits(host)
        # a backward will follow: the servers keep each forward's inputs (and activations) under its id until then
        ids = [new_activation_id() if will_backward else None for _ in plan]
        sent = [_from_bits(host_bits[rows], host.dtype) for _, _, rows, _ in plan]
        # one call per server carries all of its experts' requests; each expert still answers (or fails) alone
        futures = forward_futures([(uid, endpoint, [rows_in], key)
                                   for (uid, endpoint, _, _), rows_in, key in zip(plan, sent, ids)],
                                  timeout=layer.forward_timeout, compression=layer.compression, channels=layer.channels)
        _wait_for_experts(futures, [rows for _, _, rows, _ in plan], len(inputs), layer.k_min,
                          layer.forward_timeout, layer.timeout_after_k_min)
        out: torch.Tensor | None = None
        out_bits = None
        alive = np.zeros((len(inputs), k), dtype=bool)
        answered = []
        for (uid, endpoint, rows, slots), future, key, rows_in in zip(plan, futures, ids, sent):
            # experts map rows of in_features to rows of in_features (the layer's output is their mixture)
            result = layer._outcome(uid, endpoint, future, shape=(len(rows), inputs.shape[-1]))
            if result is None:
                continue
            if out is None:
                out = _zeros((len(inputs), k, inputs.shape[-1]), result[0].dtype)
                out_bits = _bits(out)
            out_bits[rows, slots] = _bits(result[0].to(out.dtype))
            alive[rows, slots] = True
            # the rows sent are kept only to send again if the server lost them (a backward sends gradients alone)
            answered.append((uid, endpoint, rows, slots, key, rows_in))
        if out is None:
            out = _zeros((len(inputs), k, inputs.shape[-1]), host.dtype)
        layer.stats.experts_chosen += len(plan)
        layer.stats.experts_dropped += len(plan) - len(answered)
        ctx.layer, ctx.answered = layer, answered
        ctx.inputs_like = (inputs.shape, inputs.dtype, inputs.device)
        alive_t = torch.from_numpy(alive)
        ctx.mark_non_differentiable(alive_t)
        return out.to(inputs.device), alive_t

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_alive: Any):
        from dmoe.client.remote_expert import backward_futures

        layer, answered = ctx.layer, ctx.answered
        shape, dtype, device = ctx.inputs_like
        grad_host = grad_out.cpu().contiguous()  # one copy off the GPU, sliced per expert (with numpy: see _bits)
        grad_bits = _bits(grad_host)
        futures = backward_futures([(uid, endpoint, [rows_in], [_from_bits(grad_bits[rows, slots], grad_host.dtype)],
                                     key) for uid, endpoint, rows, slots, key, rows_in in answered],
                                   timeout=layer.backward_timeout, compression=layer.compression,
                                   channels=layer.channels)
        wait_futures(futures, timeout=layer.backward_timeout)
        grad_inputs = _zeros(tuple(shape), dtype)
        # rows are distinct within one expert's request, so a plain indexed add accumulates them
        grad_sum = grad_inputs.numpy() if dtype in _NUMPY_SUMS else None
        got = np.zeros(shape[0], dtype=np.int64)
        wanted = np.zeros(shape[0], dtype=np.int64)
        for (uid, endpoint, rows, _, _, rows_in), future in zip(answered, futures):
            wanted[rows] += 1
            result = layer._outcome(uid, endpoint, future, backward=True, shape=tuple(rows_in.shape))
            if result is None:
                continue
            if grad_sum is not None:
                grad_sum[rows] += result[0].to(dtype).numpy()
            else:
                grad_inputs.index_add_(0, torch.from_numpy(rows), result[0].to(dtype))
            got[rows] += 1
        layer.stats.backward_calls += len(answered)
        short = got < np.minimum(wanted, layer.backward_k_min)
        if bool(short.any()):
            raise RuntimeError(
                f"{int(short.sum())} rows got fewer than backward_k_min={layer.backward_k_min} expert gradients "
                f"in {layer.uid_prefix!r}"
            )
        return None, grad_inputs.to(device), None, None, None, None


class RemoteMixtureOfExperts(_MixtureBase):
    """A mixture-of-experts layer whose experts are served by other machines and found through the DHT.

    :param in_features: hidden size of the inputs (the experts' input and output size).
    :param grid_size: the expert grid of this layer, e.g. ``(16, 16)`` for uids ``ffn0.0.0`` .. ``ffn0.15.15``.
    :param uid_prefix: the layer name, e.g. ``"ffn0"``.
    :param dht: a :class:`dmoe.dht.DHT` node to search for alive experts.
    :param k_best: experts chosen per row (token).
    :param k_min: forward waits until every row has this many answers (or no call left pending) ...
    :param timeout_after_k_min: ... then at most this many seconds more for the remaining experts.
    :param forward_timeout: no forward waits longer than this in total; slower experts are dropped.
    :param backward_k_min: backward raises only if a row gets fewer expert gradients than this.
    :param backward_timeout: experts that have not answered backward by then contribute no gradient.
    :param allow_zero_outputs: rows that no expert answered give zeros instead of raising.
    :param compression: wire compression of the tensors sent (``dmoe.wire.NONE``, ``FLOAT16``, ``UINT8``).
    :param bans: shares the ban book between layers (experts of a dead server are banned once for all).
    :param reroute_attempts: rows that none of their experts answered are sent, within the same forward, to
        the next-best experts that are not banned, up to this many times.
    :param switch: Switch-style weights (the router's probability over the whole grid; usually with ``k_best=1``)
        and a :attr:`balance_loss` per forward; see :class:`_MixtureBase`.

    Routing is per token: ``[batch, seq, hidden]`` inputs are flattened to rows. Rows sent to the same expert
    travel in one request, the requests to one server's experts in one gRPC call, and all servers are called
    concurrently. Each expert still answers or fails alone (and is dropped alone).
    """

    def __init__(self, in_features: int, grid_size: Sequence[int], uid_prefix: str, dht: Any, *, k_best: int = 4,
                 k_min: int = 1, forward_timeout: float | None = 10.0, timeout_after_k_min: float | None = 1.0,
                 backward_k_min: int = 1, backward_timeout: float | None = 10.0, allow_zero_outputs: bool = False,
                 compression: int = NONE, bans: Bans | None = None, ban_config: BanConfig | None = None,
                 channels: ChannelPool | None = None, cache: Any = None, reroute_attempts: int = 1,
                 switch: bool = False):
        super().__init__(in_features, grid_size, uid_prefix, k_best, allow_zero_outputs, switch)
        self.reroute_attempts = reroute_attempts
        self.dht = dht
        self.k_min, self.backward_k_min = k_min, backward_k_min
        self.forward_timeout, self.timeout_after_k_min = forward_timeout, timeout_after_k_min
        self.backward_timeout = backward_timeout
        self.compression = compression
        self.bans = bans if bans is not None else Bans(ban_config or BanConfig())
        self.channels = channels
        self._cache = cache
        self._endpoints: dict[str, str] = {}
        # autograd needs one input that requires grad, or backward (and so the experts' training) is skipped
        # whenever the layer's inputs do not require grad.
        self._dummy = torch.empty(0, requires_grad=True)

    def _is_excluded(self, uid: str, endpoint: str) -> bool:
        return self.bans.is_banned(uid, endpoint)

    def _choose(self, grid_scores: list[torch.Tensor]) -> list[list[str]]:
        from dmoe.client.beam_search import PrefixCache, beam_search

        if self._cache is None:
            self._cache = PrefixCache()
        # (no predicate while nothing is banned: beam search would call it for every candidate expert)
        found = beam_search(self.dht, self.uid_prefix, [s.float().cpu() for s in grid_scores], self.k_best,
                            exclude=self._is_excluded if len(self.bans) else None, cache=self._cache)
        chosen = []
        for row in found:
            for uid, endpoint in row:
                self._endpoints[uid] = endpoint
            chosen.append([uid for uid, _ in row])
        return chosen

    def _plan(self, chosen: list[list[str]]) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
        """Groups (row, slot) pairs by expert: one request per expert carries all of its rows."""
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for row, uids in enumerate(chosen):
            for slot, uid in enumerate(uids[: self.k_best]):
                rows, slots = groups.setdefault(uid, ([], []))
                rows.append(row)
                slots.append(slot)
        return [(uid, self._endpoints[uid], np.array(rows, dtype=np.int64), np.array(slots, dtype=np.int64))
                for uid, (rows, slots) in groups.items()]

    def _run_experts(self, flat: torch.Tensor, chosen: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        # the dummy requires grad, so autograd records this call (and a backward can follow) whenever grad is on
        return _RemoteExperts.apply(self._dummy, flat, self, self._plan(chosen), self.k_best, torch.is_grad_enabled())

    def _outcome(self, uid: str, endpoint: str, future: Future, backward: bool = False, *,
                 shape: tuple[int, ...] | None = None) -> list[torch.Tensor] | None:
        """The future's result, or None after banning whatever failed (the expert, or its whole server).

        An answer whose first tensor is not floating-point of ``shape`` counts as the expert's failure: a faulty or
        hostile server (or one hosting other experts under these uids) must not break the mixture.
        """
        error = None if not future.done() or future.cancelled() else future.exception()
        if future.done() and not future.cancelled() and error is None:
            result = future.result()
            problem = _malformed(result, shape)
            if problem is None:
                self.bans.succeed(uid, endpoint)
                return result
            error = RuntimeError(f"malformed answer: {problem}")
        code = getattr(error, "code", None)
        server_down = error is None or code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        backoff = self.bans.fail(uid=None if server_down else uid, endpoint=endpoint if server_down else None)
        what = f"server {endpoint}" if server_down else f"expert {uid}"
        logger.info("%s %s dropped (%s); %s banned for %.1fs", "backward" if backward else "forward", uid,
                    error if error is not None else "no answer in time", what, backoff)
        if backward:
            self.stats.backward_failures += 1
        return None


def _malformed(result: Sequence[torch.Tensor], shape: tuple[int, ...] | None) -> str | None:
    """What is wrong with an expert's answer that should be floating-point of ``shape`` (None: nothing)."""
    if not result:
        return "no tensors"
    first = result[0]
    if shape is not None and tuple(first.shape) != shape:
        return f"expected shape {list(shape)}, got {list(first.shape)}"
    if not first.is_floating_point():
        return f"expected floating-point values, got {first.dtype}"
    return None


class LocalMixtureOfExperts(_MixtureBase):
    """The same gating maths with every expert of the grid in this process: the no-network baseline.

    ``expert_factory(uid)`` builds each expert (by default the ``expert_cls`` of the server's expert zoo with
    ``in_features`` as its hidden size). The experts are ordinary submodules, trained by the caller's
    optimizer, so comparisons with :class:`RemoteMixtureOfExperts` should give that optimizer the same settings
    as the servers'.
    """

    def __init__(self, in_features: int, grid_size: Sequence[int], uid_prefix: str, *, k_best: int = 4,
                 expert_cls: str = "ffn", expert_factory: Callable[[str], nn.Module] | None = None,
                 allow_zero_outputs: bool = False, switch: bool = False, **expert_kwargs: Any):
        super().__init__(in_features, grid_size, uid_prefix, k_best, allow_zero_outputs, switch)
        if expert_factory is None:
            from dmoe.server.layers import create_expert

            def expert_factory(uid: str) -> nn.Module:
                return create_expert(expert_cls, in_features, **expert_kwargs)

        self.uids = [join_uid(uid_prefix, coords) for coords in torch.cartesian_prod(
            *[torch.arange(g) for g in self.grid_size]).reshape(-1, len(self.grid_size)).tolist()]
        # ModuleDict keys may not contain dots
        self.experts = nn.ModuleDict({uid.replace(".", "_"): expert_factory(uid) for uid in self.uids})

    def _choose(self, grid_scores: list[torch.Tensor]) -> list[list[str]]:
        total = grid_scores[0]
        for scores in grid_scores[1:]:
            total = (total[:, :, None] + scores[:, None, :]).reshape(total.shape[0], -1)
        top = total.topk(min(self.k_best, total.shape[1]), dim=1).indices.tolist()
        return [[self.uids[i] for i in row] for row in top]

    def _run_experts(self, flat: torch.Tensor, chosen: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for row, uids in enumerate(chosen):
            for slot, uid in enumerate(uids):
                rows, slots = groups.setdefault(uid, ([], []))
                rows.append(row)
                slots.append(slot)
        alive = torch.zeros(flat.shape[0], self.k_best, dtype=torch.bool)
        all_rows, all_slots, outputs = [], [], []
        for uid, (rows, slots) in groups.items():
            rows_t = torch.tensor(rows)
            outputs.append(self.experts[uid.replace(".", "_")](flat[rows_t]))
            all_rows.append(rows_t)
            all_slots.append(torch.tensor(slots))
        rows_t, slots_t = torch.cat(all_rows), torch.cat(all_slots)
        alive[rows_t, slots_t] = True
        # one differentiable scatter of every expert's rows (not one full copy of the buffer per expert)
        out = flat.new_zeros(flat.shape[0], self.k_best, outputs[0].shape[-1]).index_put((rows_t, slots_t),
                                                                                       torch.cat(outputs))
        self.stats.experts_chosen += len(groups)
        return out, alive
