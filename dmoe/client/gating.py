"""The structured gate and its maths, shared by the remote layer and the in-process one.

Gating is *structured*: one linear projection scores every coordinate of every grid dimension, and an
expert's score is the sum of its coordinates' scores, so ``ffn0.3.17`` scores ``s0[3] + s1[17]``. Inputs with
extra dimensions (``[batch, seq, hidden]``) are routed **per token**: every position picks its own experts.
:meth:`MixtureBase._combine` weighs the experts that answered (renormalising the softmax over them, row by row);
:class:`LocalMixtureOfExperts` is the same layer with every expert in this process: the no-network baseline.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from dmoe.experts import create_expert
from dmoe.timing import NO_LAPS, Laps, NoLaps, StageClock
from dmoe.uid import DELIMITER, is_valid_prefix, join_uid, split_uid

logger = logging.getLogger(__name__)

#: where a layer's forward and the backward of its experts' calls spend their time, in order (``stage_clock``):
#: the gate's scores, the search for experts, grouping rows per expert, the rows' copy to host memory, building and
#: sending the calls, waiting for answers, gathering them per row, the copy back to the inputs' device, rerouting
#: rows that lost all their experts, the weighted mix; then the same for the backward's calls. What they leave out
#: of a training step is autograd's own work (the mix's and the gate's backward) and the caller's. The in-process
#: layer times gate, search, plan, wait (its experts' compute), gather and combine.
CLIENT_STAGES = ("gate", "search", "plan", "to_host", "send", "wait", "gather", "to_device", "reroute", "combine",
                 "bwd_to_host", "bwd_send", "bwd_wait", "bwd_sum", "bwd_to_device")


class NoAliveExpertsError(RuntimeError):
    """Some rows got no answer from any expert (and ``allow_zero_outputs`` is off)."""


class TooFewGradients(RuntimeError):
    """A backward left some rows with fewer expert gradients than ``backward_k_min`` (see
    :class:`~dmoe.client.moe.RemoteMixtureOfExperts`)."""


@dataclass
class MoEStats:
    """Cumulative counters; the trainer shows ``experts_dropped / experts_chosen`` over an interval."""

    forward_passes: int = 0
    experts_chosen: int = 0        # expert calls made in forward (one per chosen expert per batch)
    experts_dropped: int = 0       # of those, missing, failed or too slow
    rows_without_expert: int = 0   # rows that got zeros (allow_zero_outputs) or made forward raise
    backward_calls: int = 0
    backward_failures: int = 0
    nonfinite_backwards: int = 0   # backwards whose output gradients held NaN or Inf: nothing sent (AMP overflows)


class MixtureBase(nn.Module):
    """Gating maths shared by the remote layer and its in-process twin (same maths, other transport).

    Two ways to weigh the chosen experts:

    - default: a softmax over the chosen experts' scores, renormalised over those that answered;
    - ``switch=True`` (Switch Transformer style, usually with ``k_best=1``): each chosen expert's probability under
      the router's softmax over the *whole* grid, which for summed coordinate scores is the product of one softmax
      per grid dimension. Not renormalised: with one expert per row a renormalised weight would always be 1 and the
      gate would get no gradient. Each forward also sets :attr:`balance_loss`, the load-balancing term to add
      (times a small coefficient) to the training loss.
    """

    def __init__(self, in_features: int, grid: Sequence[int], layer: str, k_best: int,
                 allow_zero_outputs: bool = False, switch: bool = False):
        super().__init__()
        if not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        if not len(grid) or any(int(g) < 1 for g in grid):
            raise ValueError(f"grid must hold one or more positive sizes, got {tuple(grid)}")
        if not isinstance(layer, str) or not is_valid_prefix(layer) or DELIMITER in layer:
            raise ValueError(f"invalid layer name {layer!r} (letters, digits, _ or -, no dots)")
        if not 1 <= k_best <= math.prod(int(g) for g in grid):
            raise ValueError(f"k_best must be between 1 and the {math.prod(int(g) for g in grid)} experts of the grid, "
                             f"got {k_best}")
        self.in_features = in_features
        self.grid = tuple(int(g) for g in grid)
        self.layer = layer
        self.k_best = k_best
        self.allow_zero_outputs = allow_zero_outputs
        self.switch = switch
        if k_best == 1 and not switch and math.prod(self.grid) > 1:
            logger.warning("layer %s: k_best=1 without switch=True: the one expert's weight is always 1, so the "
                           "gate gets no gradient and never learns", layer)
        #: set by each forward when ``switch``: 1 when tokens and router probability spread evenly over every grid
        #: dimension's coordinates, up to the dimension's size when all go to one coordinate. Differentiable
        #: w.r.t. the gate.
        self.balance_loss: torch.Tensor | None = None
        self.proj = nn.Linear(in_features, sum(self.grid))
        self.stats = MoEStats()
        self._coords_cache: dict[str, tuple[int, ...]] = {}
        self.reroute_attempts = 0  # in-process experts never fail
        #: set to ``StageClock(CLIENT_STAGES)`` to time each forward's (and its calls' backward's) stages; None: no
        #: timing at all. On a GPU each stage then waits for the device (:class:`dmoe.timing.Laps`).
        self.stage_clock: StageClock | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs [..., {self.in_features}], got {list(x.shape)}")
        flat = x.reshape(-1, self.in_features)
        laps: Laps | NoLaps = NO_LAPS if self.stage_clock is None else self.stage_clock.laps(flat.device)
        grid_scores = list(self.proj(flat).split(self.grid, dim=-1))
        detached = [s.detach() for s in grid_scores]
        laps.lap("gate")
        chosen = self._choose(detached)                                # per row: uids, best first
        laps.lap("search")
        started = time.monotonic()
        coords, valid = self._coords_tensor(chosen, flat.shape[0])     # [n, k, ndim], [n, k]
        expert_out, alive = self._run_experts(flat, chosen, laps)      # [n, k, out], [n, k]
        for _ in range(self.reroute_attempts):
            # Rows that none of their experts answered: the failed ones are banned now (those that refused the
            # rows as invalid are left out of this forward), so a second search finds the next-best alive experts
            # for exactly those rows (a dead server costs no lost rows).
            lost = torch.nonzero(valid.any(1) & ~(valid & alive).any(1)).squeeze(1)
            left = self._time_left(started)
            if len(lost) == 0 or (left is not None and left <= 0):
                break
            rechosen = self._choose([s[lost] for s in detached])
            left = self._time_left(started)  # the search itself may have taken DHT round trips
            if not any(rechosen) or (left is not None and left <= 0):
                break
            coords[lost], valid[lost] = self._coords_tensor(rechosen, len(lost))
            retry_out, alive[lost] = self._run_experts(flat[lost], rechosen, timeout=left)
            expert_out = expert_out.index_put((lost,), retry_out.to(expert_out.dtype))
        laps.lap("reroute")
        self.stats.forward_passes += 1
        if self.switch:
            self.balance_loss = self._balance_loss(grid_scores, coords, valid)
        out = self._combine(grid_scores, coords, valid & alive, expert_out)
        laps.lap("combine")
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
        rows = max(len(grid_scores[0]), 1)  # an empty batch gives 0 (not the NaN of a mean over no rows)
        terms = []
        for dim, (size, scores) in enumerate(zip(self.grid, grid_scores)):
            # counted exactly and in float32: in the scores' dtype under autocast the count stopped at 256 (bfloat16)
            # or 2048 (float16), and the loss of 4096 tokens was 8x too small (review 104)
            dtype = torch.promote_types(scores.dtype, torch.float32)
            share = torch.bincount(coords[:, :, dim][valid], minlength=size).to(dtype)
            terms.append(size * (share / routed * torch.softmax(scores.to(dtype), dim=-1).sum(0) / rows).sum())
        return torch.stack(terms).mean()

    def _choose(self, grid_scores: list[torch.Tensor]) -> list[list[str]]:
        raise NotImplementedError

    def _run_experts(self, flat: torch.Tensor, chosen: list[list[str]], laps: Laps | NoLaps = NO_LAPS,
                     timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts' outputs and which of them answered; ``laps`` times the stages from ``plan``
        to ``to_device`` (see :data:`CLIENT_STAGES`); ``timeout``: the most seconds the calls may take (None: the
        layer's own limit)."""
        raise NotImplementedError

    def _time_left(self, started: float) -> float | None:
        """Seconds a forward that began at ``started`` may still wait for experts (None: no limit)."""
        return None

    def _why_no_answers(self) -> str:
        """What the last forward's failed calls said, for the error of rows that got no answer ('' if nothing)."""
        return ""

    def _expert_codes(self, chosen: list[list[str]], n_rows: int) -> tuple[np.ndarray, list[str]]:
        """Per row and slot, the index of its expert among ``uids`` (-1 where a row has fewer than ``k_best``), and
        the chosen uids in order of first appearance. One pass of Python over the (row, slot) pairs; what is built
        from them is numpy's (a trainer's layer routes thousands of tokens per step)."""
        k = self.k_best
        index: dict[str, int] = {}
        code = index.setdefault
        if all(len(uids) == k for uids in chosen):  # the usual case: every row got its k experts
            codes = np.fromiter((code(uid, len(index)) for uids in chosen for uid in uids), dtype=np.int64,
                                count=n_rows * k).reshape(n_rows, k)
        else:
            codes = np.full((n_rows, k), -1, dtype=np.int64)
            for row, uids in enumerate(chosen):
                uids = uids[:k]
                codes[row, :len(uids)] = [code(uid, len(index)) for uid in uids]
        return codes, list(index)

    def _coords_tensor(self, chosen: list[list[str]], n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grid coordinates [n, k, ndim] of the chosen experts (0 in empty slots), and which slots hold one (rows
        may get < k)."""
        codes, uids = self._expert_codes(chosen, n_rows)
        table = np.zeros((len(uids) + 1, len(self.grid)), dtype=np.int64)  # the last row: empty slots' (-1) zeros
        for i, uid in enumerate(uids):
            table[i] = self._coords_of(uid)
        return torch.from_numpy(table[codes]), torch.from_numpy(codes >= 0)

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
                    f"{missing} of {len(has_any)} rows got no answer from any expert of {self.layer!r}; "
                    "pass allow_zero_outputs=True to use zeros for them instead" + self._why_no_answers()
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


class LocalMixtureOfExperts(MixtureBase):
    """The same gating maths with every expert of the grid in this process: the no-network baseline.

    ``expert_factory(uid)`` builds each expert (by default the ``expert_cls`` of the server's expert zoo with
    ``in_features`` as its hidden size). The experts are ordinary submodules, trained by the caller's
    optimizer, so comparisons with :class:`RemoteMixtureOfExperts` should give that optimizer the same settings
    as the servers'.
    """

    def __init__(self, in_features: int, grid: Sequence[int], layer: str, *, k_best: int = 4,
                 expert_cls: str = "ffn", expert_factory: Callable[[str], nn.Module] | None = None,
                 allow_zero_outputs: bool = False, switch: bool = False, **expert_kwargs: Any):
        super().__init__(in_features, grid, layer, k_best, allow_zero_outputs, switch)
        if expert_factory is None:
            def expert_factory(uid: str) -> nn.Module:
                return create_expert(expert_cls, in_features, **expert_kwargs)

        self.uids = [join_uid(layer, coords) for coords in torch.cartesian_prod(
            *[torch.arange(g) for g in self.grid]).reshape(-1, len(self.grid)).tolist()]
        # ModuleDict keys may not contain dots
        self.experts = nn.ModuleDict({uid.replace(".", "_"): expert_factory(uid) for uid in self.uids})

    def _choose(self, grid_scores: list[torch.Tensor]) -> list[list[str]]:
        total = grid_scores[0]
        for scores in grid_scores[1:]:
            total = (total[:, :, None] + scores[:, None, :]).reshape(total.shape[0], total.shape[1] * scores.shape[1])
        top = total.topk(min(self.k_best, total.shape[1]), dim=1).indices.tolist()
        return [[self.uids[i] for i in row] for row in top]

    def _run_experts(self, flat: torch.Tensor, chosen: list[list[str]], laps: Laps | NoLaps = NO_LAPS,
                     timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for row, uids in enumerate(chosen):
            for slot, uid in enumerate(uids):
                rows, slots = groups.setdefault(uid, ([], []))
                rows.append(row)
                slots.append(slot)
        alive = torch.zeros(flat.shape[0], self.k_best, dtype=torch.bool)
        laps.lap("plan")
        if not groups:  # an empty batch: no expert is called, but the output still has the experts' width
            width = self.experts[self.uids[0].replace(".", "_")](flat).shape[-1]
            return flat.new_zeros(0, self.k_best, width), alive
        all_rows, all_slots, outputs = [], [], []
        for uid, (rows, slots) in groups.items():
            rows_t = torch.tensor(rows)
            outputs.append(self.experts[uid.replace(".", "_")](flat[rows_t]))
            all_rows.append(rows_t)
            all_slots.append(torch.tensor(slots))
        rows_t, slots_t = torch.cat(all_rows), torch.cat(all_slots)
        alive[rows_t, slots_t] = True
        laps.lap("wait")  # in process, "waiting for the experts" is their compute
        # one differentiable scatter of every expert's rows (not one full copy of the buffer per expert)
        # (in the input's dtype: under autocast an expert ending in a Linear answers in the autocast dtype, which
        # index_put refused to put into the buffer: review 104)
        out = flat.new_zeros(flat.shape[0], self.k_best, outputs[0].shape[-1]).index_put(
            (rows_t, slots_t), torch.cat(outputs).to(flat.dtype))
        self.stats.experts_chosen += len(groups)
        laps.lap("gather")
        return out, alive
