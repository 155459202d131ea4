"""``CollaborativeOptimizer``: many trainers, one set of dense parameters, one optimizer step at a time (DeDLOC).

Each trainer wraps its torch optimizer and calls :meth:`CollaborativeOptimizer.step` after every backward of its
own batches. The gradients of the dense parameters accumulate locally (weighted by batch size) while the
trainers publish their progress in the DHT (:mod:`~dmoe.collab.progress`). When the samples accumulated by the
trainers at the current global step reach ``target_batch_size``, every one of them averages its accumulated
gradients with the others (:class:`~dmoe.averaging.DecentralizedAverager`, one group, weights = samples), so all
hold the same mean gradient over all those samples, and applies the same optimizer step: their parameters stay
equal (up to float error; bit for bit on identical machines). Experts are not part of it: they keep training on
their servers.

Joining, dying, falling behind:

* A trainer that starts, restarts or falls behind the top step (or finds its parameters off the canonical
  lineage) downloads the dense parameters, the optimizer state and the step from a live trainer on it, the
  furthest that serves its state (:mod:`~dmoe.collab.state_sync`), before it contributes; the batch it was
  computing is thrown away.
* A trainer that dies only loses its accumulated samples: the averager drops it and the others finish the step
  among themselves; it stops being counted once its progress record expires.
* When averaging fails, a trainer that sees the others moved on re-syncs from them; one that sees nobody ahead
  applies its own gradients (a collaboration of one still trains) under a lineage of its own, so if the others
  did step together it re-syncs from them at its next step (after the last step: in :meth:`finish`, so that the
  trainers end on one model).

Bad input: records with absurd numbers are refused (see :mod:`~dmoe.collab.progress`); a trainer that claims a step
its state server cannot back, or serves a state that does not fit this model (or breaks its download in any way),
is logged and ignored for ``ban_time`` while training goes on. So is its state server's machine, whatever peer ids
and host names name it (twice as long each time it fails again), for every failed download but those that may be no
fault of the server's (busy, or a record naming an honest trainer with a step or lineage it does not serve), came to
nothing quickly (:func:`slow_refusal`) and followed no other such one from that machine: peer ids cost nothing, and
a server that failed each download just before ``state_timeout``, under a new id each time, held every ``step()``
for that long (review 87). A quick refusal of a state that another record naming that server claims counts against
that record only, and the state is downloaded through the other record (review 114). Records are free to write and
may name any address, so whatever their sources, downloads that come to nothing take at most
``config.failed_download_share`` of the trainer's time, after a first few seconds' worth (review 107).

Threads: the progress tracker's (publish and read), the state server's event loop (and one for captures), the
averager's two; all stop in :meth:`CollaborativeOptimizer.shutdown`.
"""
from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from dataclasses import fields, replace
from typing import Any, Callable, Iterable

import grpc
import torch

from dmoe.averaging import AveragerConfig, DecentralizedAverager
from dmoe.averaging.matchmaking import new_peer_id
from dmoe.collab.config import CollaborationConfig, check_run_id
from dmoe.collab.progress import (
    ACCUMULATING,
    AVERAGING,
    LINEAGE_CHARS,
    STRIKES_TO_BAN,
    CollaborationState,
    Progress,
    ProgressTracker,
    endpoint_machine,
    resolve_endpoint,
)
from dmoe.collab.state_sync import (
    CONNECT_TIMEOUT,
    StateDownloadError,
    StateMismatch,
    StateServer,
    StateServicer,
    TrainingState,
    download_limits,
    download_state,
    encode_state,
    load_state,
)
from dmoe.dht import DHT

logger = logging.getLogger(__name__)

#: seconds a trainer whose state server is busy (RESOURCE_EXHAUSTED: serving its most downloads) is not asked again
BUSY_BAN = 5.0
#: seconds (at most; see :func:`slow_refusal`) a state download may take to end in a refusal that is not the server's
#: fault (busy, or a step or lineage other than a record claimed for it) before its machine is banned all the same
SLOW_REFUSAL = 5.0
#: seconds within which a busy trainer's refusal counts toward no ban of its machine: an honest one refuses at once,
#: before any work, and a wave of joiners may find it busy again and again (one that takes longer is counted, as other
#: refusals are: review 107 D2)
QUICK_BUSY = 1.0
#: servers whose state a record backed, remembered at most (the oldest forgotten first): see ``_backed``
MAX_BACKED = 256
#: seconds for which records claiming more of a server than it served are passed over undialed, after a refusal there
#: that another record backed, nothing there ahead of this trainer: a hostile server backed by a record of its own was
#: dialed, and excused, for every fresh throwaway record claiming more of it (review 116 D1). Short, as anyone may write
#: the backing record: kept while it stood unchanged, a pin made an honest trainer's own records, once it stepped on,
#: be banned, and a trainer that fell behind could not catch up from it (review 117 D1)
PIN_SECONDS = 5.0
#: sources one catch-up tries at most, the next at once after a quick refusal another record excused (see
#: ``CollaborativeOptimizer._sync_if_needed``)
SOURCES_PER_SYNC = 4


def slow_refusal(state_timeout: float) -> float:
    """How long a download may take to come to nothing without its server's machine being banned: an honest server
    refuses at once when busy, and its first message (step and lineage) follows its encoded state, which it keeps
    for every joiner of a step; a quarter of ``state_timeout`` when that is shorter."""
    return min(SLOW_REFUSAL, state_timeout / 4)


def _lineage(*parts: Any) -> str:
    return hashlib.blake2b(";".join(map(str, parts)).encode(), digest_size=LINEAGE_CHARS // 2).hexdigest()


def parameters_lineage(parameters: Iterable[torch.Tensor]) -> str:
    """The lineage of freshly initialised (or checkpointed) parameters: a hash of their values, so trainers that
    started from the same seed agree without talking, and one that did not is found off the canonical lineage."""
    digest = hashlib.blake2b(digest_size=LINEAGE_CHARS // 2)
    for p in parameters:
        digest.update(str(tuple(p.shape)).encode())
        # flattened before the byte view, which a 0-dimensional tensor does not allow (same bytes for the others)
        digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class CollaborativeOptimizer:
    """Wraps ``opt`` so that every trainer of run ``run_id`` applies the same steps to the same dense parameters.

    Args:
        opt: the trainer's torch optimizer over the dense parameters (experts train on their servers).
        dht: a running :class:`dmoe.DHT` (trainers use ``client_mode=True``) of the swarm.
        run_id: the collaboration's name (letters, digits, ``-``, ``_``); trainers of one run must build the same
            model (shapes) and optimizer.
        target_batch_size: samples per global step, summed over all trainers.
        config: :class:`CollaborationConfig`; averager: :class:`~dmoe.averaging.AveragerConfig`. Keyword
            arguments override fields of either (``refresh_period=0.5``, ``matchmaking_time=3``).
        step: the global step the parameters are at (a trainer resumed from its checkpoint); 0 for new ones.

    Use it like the optimizer: ``loss.backward(); collab.step(batch_size); collab.zero_grad()``; set the
    learning rate for :attr:`local_step` before each call (every trainer then steps with the same one).
    """

    def __init__(self, opt: torch.optim.Optimizer, dht: DHT, run_id: str, target_batch_size: int | None = None, *,
                 config: CollaborationConfig | None = None, averager: AveragerConfig | None = None, step: int = 0,
                 **overrides: Any):
        collab_fields = {f.name for f in fields(CollaborationConfig)}
        averager_fields = {f.name for f in fields(AveragerConfig)}
        unknown = set(overrides) - collab_fields - averager_fields
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}; see CollaborationConfig and AveragerConfig")
        collab_overrides = {k: v for k, v in overrides.items() if k in collab_fields}
        if target_batch_size is not None:
            collab_overrides["target_batch_size"] = target_batch_size
        if config is None:
            if "target_batch_size" not in collab_overrides:
                raise TypeError("give target_batch_size (or a CollaborationConfig)")
            config = CollaborationConfig(**collab_overrides)
        else:
            config = replace(config, **collab_overrides)
        averager_config = replace(averager or AveragerConfig(),
                                  **{k: v for k, v in overrides.items() if k in averager_fields})
        if averager_config.grid:
            raise ValueError("collaborative steps average in one group of every trainer: leave the averager's grid "
                             "empty")
        if averager_config.min_group_size != 2:
            # every group of two or more trainers at the step averages, and a trainer alone steps alone: a larger
            # minimum made each step with fewer partners raise out of step(), half done
            raise ValueError(f"collaborative steps average with whoever is at the step: min_group_size must be 2, "
                             f"got {averager_config.min_group_size}")
        self.opt, self.dht, self.run_id, self.config = opt, dht, check_run_id(run_id), config
        self.parameters = [p for group in opt.param_groups for p in group["params"]]
        if not self.parameters:
            raise ValueError("the optimizer has no parameters")
        #: guards the parameters and the optimizer state: steps, downloads and snapshots for joiners
        self.lock = threading.RLock()
        #: True from the first change a step or a downloaded state makes to the parameters, the optimizer state or
        #: :attr:`local_step` until its last; it stays True when an exception (a second Ctrl-C) cut that short, and
        #: they then hold parts of two steps. Most of :meth:`step` is waiting (for reports, for the partners, for
        #: the all-reduce), which changes none of them: a trainer interrupted there still holds a complete step, and
        #: can save it (review 90)
        self.updating = False
        self.local_step = int(step)
        self.lineage = parameters_lineage(self.parameters)
        self._left_lineage: str | None = None  # the lineage of the step before (None: it came downloaded)
        self._left_partners: frozenset[bytes] = frozenset()  # the DHT keys of the partners that step expected
        self.group_size = 0
        self.samples = 0
        self.steps_applied = self.steps_downloaded = 0
        self._peer_id = new_peer_id()  # the tracker's from then on: it draws another if anyone takes this one
        self._accumulators = [torch.zeros_like(p, dtype=torch.float32) for p in self.parameters]
        self._speed, self._last_call = 0.0, None
        self._reset_at = 0.0  # wall clock of the last step applied or state downloaded
        self._waited_in_vain = -1  # the step at which a wait for the partners' reports ended without them
        self._state_limits = download_limits(self.parameters)  # (bytes, messages)
        self._served: tuple[tuple[int, str], list] | None = None
        self._rng = random.Random()
        #: machine dialed (:func:`~dmoe.collab.progress.endpoint_machine`) -> (until, step, lineage): what a server
        #: there served when a record's claim about it was refused and another record backed it, nothing there ahead
        #: of this trainer (:meth:`_off_claim`); a machine's servers on other ports are taken to serve it too
        self._backed: dict[str, tuple[float, int, str]] = {}
        # seconds that downloads which come to nothing may take now, and when that was reckoned (see _may_download)
        self._download_budget, self._budget_at = slow_refusal(config.state_timeout), time.monotonic()
        self._closed = False
        self.averager: DecentralizedAverager | None = None
        self.state_server: StateServer | None = None
        self.tracker: ProgressTracker | None = None
        try:
            self.averager = DecentralizedAverager(self._accumulators, dht, f"{self.run_id}.grad", averager_config)
            if not averager_config.client_mode:
                servicer = StateServicer(self.run_id, self._encoded_state, timeout=config.state_timeout)
                self.state_server = StateServer(servicer, config.state_host, config.state_port)
            self.tracker = ProgressTracker(dht, self.run_id, config, self._peer_id, Progress(
                self.local_step, 0, 0.0, time.time(), self.endpoint, ACCUMULATING, self.lineage, 0))
            self.tracker.refresh_now()
            self._sync_if_needed()  # a joiner downloads the state before it contributes anything
        except BaseException:
            self.shutdown()
            raise
        logger.info("trainer %s joined run %r at step %d, lineage %s (%d trainers seen, target %d samples per "
                    "step)", self.peer_id, self.run_id, self.local_step, self.lineage,
                    self.collaboration.num_trainers, config.target_batch_size)

    @property
    def peer_id(self) -> int:
        """This trainer's id in the progress record."""
        return self.tracker.peer_id if self.tracker is not None else self._peer_id

    @property
    def endpoint(self) -> str | None:
        """Where this trainer serves its state, as the others are told (None in client mode)."""
        if self.state_server is None:
            return None
        return self.dht.announced(self.state_server.endpoint, self.config.state_announce_host)

    @property
    def param_groups(self) -> list[dict]:
        return self.opt.param_groups

    @property
    def collaboration(self) -> CollaborationState:
        """The collaboration as of the last read of the others' progress."""
        return self.tracker.state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    # ---- the step ----
    def step(self, batch_size: int) -> bool:
        """Adds the gradients of a batch of ``batch_size`` samples (in the parameters' ``.grad``, as the mean over
        the batch); when the collaboration reached the target, averages and applies the global step. Returns True
        when the parameters changed (a step was applied or a newer state downloaded): :attr:`local_step` says which
        step they are at."""
        try:
            return self._step(batch_size)
        finally:
            self._last_call = time.monotonic()  # the speed counts the time between calls: computing batches

    def _step(self, batch_size: int) -> bool:
        if self._closed:
            raise RuntimeError("this collaborative optimizer is shut down")
        if not (isinstance(batch_size, int) and batch_size > 0):
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if self._sync_if_needed():
            self.zero_grad()  # computed with the old parameters
            return True
        self._measure_speed(batch_size)
        with torch.no_grad():
            for p, accumulator in zip(self.parameters, self._accumulators):
                if p.grad is not None:
                    accumulator.add_(p.grad.to(torch.float32), alpha=batch_size)
        self.samples += batch_size
        self.tracker.update(samples=self.samples, samples_per_second=self._speed)
        if self.tracker.read_at < self._reset_at:
            # the first batch since this trainer's step: its view still shows the partners before theirs, which
            # they published meanwhile; without them it would count nobody toward the target and overshoot it
            self.tracker.refresh_now()
        state = self.tracker.state()
        if not state.ready and self._waited_in_vain != self.local_step and self._target_near(state, batch_size):
            state = self._wait_for_reports(batch_size)
        if not state.ready:
            if state.eta < self.config.refresh_period:
                self.tracker.wake()
            return False
        # a fresh read before committing: who the partners are now (how many the group waits for), and whether
        # they moved on meanwhile (then this trainer's samples are stale: it downloads their state instead)
        self.tracker.refresh_now()
        if self._sync_if_needed():
            return True
        state = self.tracker.state()
        if not state.ready:
            return False
        self._global_step(self._await_finishing(state))
        return True

    def _await_finishing(self, state: CollaborationState) -> CollaborationState:
        """The collaboration once the partners of this trainer's last step have finished it: trainers still
        averaging the step before, from the lineage this trainer left (their all-reduce ends a moment later than
        this trainer's, or their record of the new step has not arrived yet), publish this step within moments,
        and must average it with this trainer. A fast trainer that reached the target before they published
        would step without them, alone, and put them a lineage behind, to download its state and lose their
        samples (two trainers of a test did, 1 run in 2 on a loaded machine). Waits at most the averager's
        all-reduce timeout (a partner killed while averaging stays in its record until it expires).

        Only for the trainers seen at that step on that lineage while this trainer was there (its partners, and
        those that joined late, too late for its group: a joiner that just downloaded the state, whose record this
        trainer read while averaging), by the DHT keys that signed their records, and for each only until a record
        it signed is at this step: the step and lineage are public, and one record of anyone's claiming to average
        the step before, published once this trainer had moved on, held every trainer for the all-reduce timeout
        at every step (review 87)."""
        if self._left_lineage is None or not self._left_partners:
            return state
        deadline = time.monotonic() + self.averager.config.allreduce_timeout
        while time.monotonic() < deadline:
            records = self.tracker.signed_by(self._left_partners).values()
            moved_on = {key for key, p in records if p.step >= self.local_step}
            finishing = {key for key, p in records if p.step == self.local_step - 1 and p.phase == AVERAGING
                         and p.lineage == self._left_lineage}
            if not finishing - moved_on:
                break
            time.sleep(self.config.refresh_period / 4)
            self.tracker.refresh_now()
            state = self.tracker.state()
        return state

    def _batch_time(self, batch_size: int) -> float:
        return batch_size / self._speed if self._speed > 0 else self.config.refresh_period

    def _target_near(self, state: CollaborationState, batch_size: int) -> bool:
        """Whether the partners alone, at their speed, reach the target before half of this trainer's next batch
        would be done: that batch would then mostly overshoot the target."""
        missing = self.config.target_batch_size - state.samples_estimate
        if missing <= 0:
            return bool(state.partners)
        speed = sum(p.samples_per_second for p in state.partners.values())
        return speed > 0 and missing / speed < self._batch_time(batch_size) / 2

    def _wait_for_reports(self, batch_size: int) -> CollaborationState:
        """The partners' speeds say the target is (nearly) reached, but their reports have not said so yet: rather
        than start a batch that would overshoot it, publish now and read the others again until they report it
        (or start averaging), for at most two of this trainer's batch times (a partner that died keeps being
        extrapolated until its record expires). A wait that ends without the reports is not tried again at this
        step: the speeds that predicted it were wrong (a partner paused, or a record claiming an absurd speed,
        which would otherwise hold this trainer up to two batch times after each of its batches)."""
        deadline = time.monotonic() + 2 * self._batch_time(batch_size)
        self.tracker.publish_now()
        while True:
            self.tracker.refresh_now()
            state = self.tracker.state()
            if state.ready:
                return state
            if time.monotonic() > deadline:
                self._waited_in_vain = self.local_step
                return state
            time.sleep(min(0.05, self.config.refresh_period / 10))

    def _measure_speed(self, batch_size: int) -> None:
        """This trainer's speed computing batches: from the end of the previous call to this one (waits and steps
        inside :meth:`step` do not count; what the partners' speeds predict is how soon their batches come)."""
        if self._last_call is not None:
            rate = batch_size / max(time.monotonic() - self._last_call, 1e-6)
            self._speed = rate if self._speed == 0 else 0.8 * self._speed + 0.2 * rate

    def _global_step(self, state: CollaborationState) -> None:
        partners = state.partners
        step, samples = self.local_step, self.samples
        with torch.no_grad():
            for accumulator in self._accumulators:
                accumulator.div_(max(samples, 1))  # the mean gradient; with no samples zeros, which weigh nothing
        if not partners:
            logger.info("step %d: stepped alone with %d samples (nobody else at this step)", step, samples)
            self._apply(_lineage(self.lineage, "alone", self.peer_id), 1)
            return
        self.tracker.update(phase=AVERAGING)
        self.tracker.publish_now()  # partners that have not seen the target reached yet join on seeing this
        self.averager.round = step  # trainers meet in the round of their global step
        expected = frozenset(self.tracker.owners(partners))
        info = self.averager.step(weight=float(samples), timeout=self.config.averaging_timeout or None,
                                  group_size=len(partners) + 1, single_group=True, expected_peers=set(expected))
        if info is not None:
            self._apply(_lineage(self.lineage, info.group_id, info.contributors), len(info.contributors), expected)
            logger.info("step %d: averaged %d samples of %d trainers (%.2fs matchmaking, %.2fs all-reduce)",
                        step, int(info.total_weight), len(info.contributors), info.matchmaking_s, info.allreduce_s)
            return
        if self._wait_for_others(step):
            logger.warning("step %d: averaging failed and the others moved on; downloading their state", step)
            if self._sync_if_needed():
                return
        logger.warning("step %d: averaging failed; stepped alone with %d samples", step, samples)
        self._apply(_lineage(self.lineage, "alone", self.peer_id), 1, expected)

    def _wait_for_others(self, step: int) -> bool:
        """After a failed averaging: True once a trainer that serves its state is past ``step`` (as for
        :meth:`CollaborationState.source`, one that serves none cannot be downloaded from: a client-mode trainer,
        or a record claiming a step with nothing behind it, must not cut the wait short). While partners still
        average (this trainer came too late for their group) it waits for them to publish their step, so that it
        downloads their state rather than stepping alone; at most the averager's all-reduce timeout."""
        deadline = time.monotonic() + self.averager.config.allreduce_timeout
        while True:
            self.tracker.refresh_now()
            state = self.tracker.state()
            if any(p.step > step and p.endpoint is not None for p in state.peers.values()):
                return True
            averaging = any(p.step == step and p.phase == AVERAGING for p in state.peers.values())
            if not averaging or time.monotonic() > deadline:
                return False
            time.sleep(self.config.refresh_period / 4)

    def _apply(self, lineage: str, group_size: int, partners: frozenset[bytes] = frozenset()) -> None:
        """Applies the accumulators (the mean gradient) as the global step, then resets them. ``partners``: the
        DHT keys of the partners the step's averaging expected; with the others seen at the step (the tracker's
        companions), :meth:`_await_finishing` waits for them."""
        partners = partners | self.tracker.companions()  # read before the step moves this trainer's record on
        with self.lock, torch.no_grad():
            self.updating = True
            for p, accumulator in zip(self.parameters, self._accumulators):
                p.grad = accumulator.to(p.dtype, copy=True)
            if self.config.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.parameters, self.config.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.local_step += 1
            self._left_lineage, self._left_partners = self.lineage, partners
            self.lineage, self.group_size = lineage, group_size
            self.updating = False
        self.steps_applied += 1
        self._reset()

    def _reset(self) -> None:
        for accumulator in self._accumulators:
            accumulator.zero_()
        self.samples = 0
        self.tracker.update(step=self.local_step, samples=0, phase=ACCUMULATING, lineage=self.lineage,
                            group_size=self.group_size)
        self.tracker.publish_now()
        self._reset_at = time.time()

    # ---- joining and catching up ----
    def _sync_if_needed(self, at_most: int | None = None) -> bool:
        """Downloads the state when this trainer is behind or off the canonical lineage; True when it did.
        ``at_most``: only a state of that step or before (:meth:`finish` takes none beyond the last step).

        Downloads that came to nothing, whatever their sources, take at most ``config.failed_download_share`` of
        this trainer's time (:meth:`_may_download`): records are free to write, each may name an address nobody
        answers at or a new name of one failing server, and each such record cost every trainer's ``step()`` a
        connection timeout, or up to ``state_timeout``, one after another without end (review 107 D1)."""
        for _ in range(SOURCES_PER_SYNC):
            self._drop_contradicted()
            chosen = self.tracker.state().source(self._rng)
            if chosen is None or (at_most is not None and chosen[1].step > at_most) or not self._may_download():
                return False
            started = time.monotonic()
            downloaded = self._download(*chosen, at_most)
            if downloaded:
                return True
            if downloaded is False:
                # A download that came to nothing slowly banned its server's machine (see _refused,
                # _ban_endpoint), which costs an attacker an address each: it is charged at most slow_refusal, so
                # one honest trainer dying during a long download costs a joiner a pause of ~1/share of that, not of
                # the whole download (9 min at 60 s)
                self._download_budget -= min(time.monotonic() - started, slow_refusal(self.config.state_timeout))
                return False
            # a quick refusal another record excused, its server now pinned (_off_claim): the next source at once,
            # uncharged; hostile servers refusing just within slow_refusal, each excused, spent the budget and held a
            # joiner from an honest server for good (review 119 D1)
        return False

    def _may_download(self) -> bool:
        """Whether a download may be tried now: the seconds of downloads that came to nothing accrue at
        ``config.failed_download_share`` per second, up to :func:`slow_refusal` (a joiner passes over a few dead
        trainers' records at once), and each such download spends its own. So over ``T`` seconds they take at most
        ``share * T``, plus that allowance and one download's time, for those that failed within
        :func:`slow_refusal` (the cheap ones: an address that drops packets, a name of one failing server); a slower
        one is charged that much, and banned its server's machine."""
        now = time.monotonic()
        self._download_budget = min(self._download_budget + self.config.failed_download_share * (
            now - self._budget_at), slow_refusal(self.config.state_timeout))
        self._budget_at = now
        return self._download_budget > 0

    def _download(self, peer_id: int, claimed: Progress, at_most: int | None, excuse: bool = True) -> bool | None:
        """Downloads and loads the state of ``peer_id``'s record ``claimed``; False when it came to nothing (logged,
        and the record or its server's machine banned as it deserves). ``excuse``: a state off that claim that
        another record naming the same server claims may excuse it (:meth:`_off_claim`: None then, when there is
        nothing to take there)."""
        check = _claim_check(claimed, at_most)
        started = time.monotonic()
        dialed = claimed.endpoint
        try:
            # the address dialed is the one banned if it fails: every name of a wildcard domain is a new name
            dialed = resolve_endpoint(claimed.endpoint, min(CONNECT_TIMEOUT, self.config.state_timeout))
            if self.tracker.endpoint_banned(dialed):  # a name of a machine banned under another
                self._ban_endpoint(claimed.endpoint, dialed, f" (it is {dialed}, banned)")
                return False
            contradicted = self._contradicted(claimed, dialed)  # (under another name of that server)
            if contradicted is not None:
                self.tracker.ban(peer_id, *contradicted)
                return False
            downloaded = download_state(dialed, self.run_id, self.config.state_timeout, *self._state_limits,
                                        check_head=check, parameters=self.parameters)
            check(downloaded.step, downloaded.lineage)
            with self.lock:
                self.updating = True
                try:
                    load_state(downloaded, self.parameters, self.opt)
                except Exception:  # refused before anything was written (a KeyboardInterrupt leaves it True)
                    self.updating = False
                    raise
                self.local_step, self.lineage, self._left_lineage = downloaded.step, downloaded.lineage, None
                self._left_partners = frozenset()
                self.group_size = downloaded.group_size
                self.updating = False
        except _BeyondLimit as error:  # it stepped on since its record was read: honest, and ahead of this trainer
            logger.info("no state downloaded from trainer %s: %s", peer_id, error)
            self._refused(claimed.endpoint, dialed, started)
            return False
        except _TooFarAhead as error:
            # honest when it stepped twice since its record was read (a trainer back from a pause reads records up
            # to a refresh period old): its record read now says so, and it is downloaded from at the next call
            # (unless a refusal from its machine came just before: see _refused). A record still claiming less than
            # it serves names someone else's endpoint: banned, briefly
            self.tracker.refresh_now()
            now = self.tracker.state().peers.get(peer_id)
            if now is not None and now.endpoint == claimed.endpoint and now.step + 1 >= error.step:
                logger.info("trainer %s stepped on since its record was read (%s); trying again", peer_id, error)
                self._refused(claimed.endpoint, dialed, started)
                return False
            self.tracker.ban(peer_id, f"its state at {claimed.endpoint} was refused: {error}",
                             seconds=min(BUSY_BAN, self.config.ban_time))
            return self._off_claim(peer_id, claimed, dialed, started, error, at_most, excuse)
        except _OffClaim as error:
            # the record may be anyone's, naming an honest trainer's endpoint: that trainer answered what it holds,
            # at once, and stays a source for the others' records (see _off_claim)
            self.tracker.ban(peer_id, f"its state at {claimed.endpoint} was refused: {error}")
            return self._off_claim(peer_id, claimed, dialed, started, error, at_most, excuse)
        except (StateDownloadError, StateMismatch, OSError) as error:  # (OSError: its host name did not resolve)
            code = getattr(error, "code", None)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy serving others (its limits): not a fault
                self.tracker.ban(peer_id, f"its state at {claimed.endpoint} is not served now: {error}",
                                 seconds=min(BUSY_BAN, self.config.ban_time))
                self._refused(claimed.endpoint, dialed, started, forgiven_within=QUICK_BUSY)
                return False
            # whatever the record, the server at that endpoint failed, refused or sent a state that does not fit:
            # its machine is banned, not only this peer id, which costs nothing to make (review 87: a server that
            # failed each download just before state_timeout, under a new id each time, held every step() for it)
            self.tracker.ban(peer_id, f"its state at {claimed.endpoint} was refused: {error}")
            self._ban_endpoint(claimed.endpoint, dialed)
            return False
        except Exception as error:  # noqa: BLE001 - the checks missed something: still that peer's state, not a crash
            # anyone who publishes a record one step ahead is downloaded from: what its payload breaks must not end
            # this trainer's step(), its constructor or wait_for_trainers (and come back at every restart)
            logger.debug("the state of trainer %s broke its download", peer_id, exc_info=True)
            self.tracker.ban(peer_id, f"its state at {claimed.endpoint} was refused: it broke the download "
                                      f"({type(error).__name__}: {str(error)[:200]})")
            self._ban_endpoint(claimed.endpoint, dialed)
            return False
        self.tracker.endpoint_served(dialed)
        self.steps_downloaded += 1
        logger.info("downloaded the state at step %d from trainer %s (%s)", self.local_step, peer_id, claimed.endpoint)
        self._reset()
        return True

    def _ban_endpoint(self, endpoint: str, dialed: str, why: str = "") -> None:
        seconds = self.tracker.ban_endpoint(endpoint, dialed)
        logger.info("no state downloads from %s for %g s%s", endpoint, seconds, why)

    def _off_claim(self, peer_id: int, claimed: Progress, dialed: str, started: float, error: _ClaimMismatch,
                   at_most: int | None, excuse: bool) -> bool | None:
        """After a quick refusal of a state off ``peer_id``'s record (that record banned): when another live record
        naming the same server claims what it served, the lie was ``peer_id``'s, and its machine gets no strike
        (see :meth:`_refused`); the state is downloaded through that record at once, when it is ahead of this
        trainer, and a refusal then counts (no second excuse). Records are free to write under any peer id: two
        naming an honest trainer's endpoint one step above what it serves were tried first (the highest step) and
        banned its machine, doubling, so a joiner had no source at all (review 114 D2). A server that serves
        nothing it delivers still gets its strikes: what it served is backed by no record, or the download through
        the record that backs it comes to nothing too. True when that download succeeded; None when excused with
        nothing there ahead of this trainer (no fault: see :meth:`_sync_if_needed`)."""
        backing = None
        # (an honest server answers its head at once: a refusal taking longer is excused no more, review 119 D1)
        if excuse and time.monotonic() - started <= QUICK_BUSY:
            backing = next(((pid, p) for pid, p in sorted(self.tracker.state().peers.items())
                            if pid != peer_id and p.endpoint in (claimed.endpoint, dialed)
                            and _claim_fits(p, at_most, error.step, error.lineage)), None)
        if backing is None:
            self._refused(claimed.endpoint, dialed, started)
            return False
        logger.info("the state at %s is what trainer %s claims (step %d, lineage %s): the lie was trainer %s's",
                    claimed.endpoint, backing[0], error.step, error.lineage, peer_id)
        if error.step <= self.local_step:  # nothing to take there (it may be this trainer's own state)
            # ...and no strike, but no more dialing it for a while either: records claiming more of that server are
            # passed over undialed for PIN_SECONDS (_drop_contradicted), or a hostile server, backed by a record of
            # its own, was dialed for each fresh record of a throwaway id claiming more, and excused each time
            # (review 116 D1)
            self._backed[endpoint_machine(dialed)] = (time.monotonic() + PIN_SECONDS, error.step, error.lineage)
            while len(self._backed) > MAX_BACKED:
                del self._backed[next(iter(self._backed))]
            return None
        return self._download(*backing, at_most, excuse=False)

    def _contradicted(self, claimed: Progress, dialed: str) -> tuple[str, float] | None:
        """Why a record ``claimed`` lies about the server at ``dialed``, without asking that server, and for how many
        seconds more that holds: within :data:`PIN_SECONDS` of a refusal there that another record backed (see
        :attr:`_backed`), ``claimed`` claims a state that is not the one it served. None otherwise."""
        machine = endpoint_machine(dialed)
        known = self._backed.get(machine)
        if known is None:
            return None
        until, step, lineage = known
        left = until - time.monotonic()
        if left <= 0:
            del self._backed[machine]
            return None
        if _claim_fits(claimed, None, step, lineage):
            return None
        return f"it claims step {claimed.step} at {claimed.endpoint}, which served step {step} (lineage {lineage}) " \
               f"{PIN_SECONDS - left:.1f}s ago", left

    def _drop_contradicted(self) -> None:
        """Passes over, undialed, the records that :meth:`_contradicted` finds lying about a server under the
        address it was dialed at (a record naming it by another name is found when dialed: its name is resolved
        first)."""
        if not self._backed:
            return
        for pid, progress in self.tracker.state().peers.items():
            if progress.endpoint is not None and endpoint_machine(progress.endpoint) in self._backed:
                contradicted = self._contradicted(progress, progress.endpoint)
                if contradicted is not None:
                    self.tracker.ban(pid, *contradicted)

    def _refused(self, endpoint: str, dialed: str, started: float, forgiven_within: float = 0.0) -> None:
        """Bans the machine of ``endpoint`` (``dialed``: the address it resolved to) after a download it refused in
        a way that may be no fault of its server, when that held this trainer longer than :func:`slow_refusal`, or
        when its refusals came :data:`~dmoe.collab.progress.STRIKES_TO_BAN` times in a row. An honest trainer
        refuses at once (busy) and answers its step and lineage within moments, so a record naming it with a claim
        it does not serve costs that record only; a server that takes its time to fail held the training loop for
        it, and would again under every new peer id; one that refused just within that time, under fresh peer ids
        or with its record raised one step to explain it, was never banned (review 107 D2). A refusal within
        ``forgiven_within`` seconds counts toward no ban (see :data:`QUICK_BUSY`)."""
        took = time.monotonic() - started
        if took > slow_refusal(self.config.state_timeout):
            self._ban_endpoint(endpoint, dialed, f" (its download took {took:.1f}s to come to nothing)")
        elif took > forgiven_within and self.tracker.strike_endpoint(dialed):
            self._ban_endpoint(endpoint, dialed, f" ({STRIKES_TO_BAN} downloads from its machine in a row came to "
                                                 f"nothing)")

    def _encoded_state(self) -> list | None:
        """The messages of this trainer's current state, encoded once per step for every joiner."""
        with self.lock:
            key = (self.local_step, self.lineage)
            if self._served is not None and self._served[0] == key:
                return self._served[1]
            captured = TrainingState.capture(self.local_step, self.lineage, self.group_size, self.parameters,
                                             self.opt)
        messages = encode_state(captured, self.run_id)
        self._served = (key, messages)
        return messages

    def wait_for_trainers(self, count: int, timeout: float, stop: Callable[[], bool] | None = None) -> int:
        """Blocks until ``count`` trainers (this one included) are in the collaboration, so that trainers started
        together also begin together (a run compared with another, a test); returns how many there are, which is
        fewer when ``timeout`` seconds passed first or ``stop()`` became true (checked every poll: a trainer whose
        launcher died waited out the whole timeout). Downloads the state if one of them is ahead."""
        deadline = time.monotonic() + timeout
        while True:
            self.tracker.refresh_now()
            self._sync_if_needed()  # a peer that claims a step it cannot back is banned here, not counted
            seen = len(self.tracker.state().peers) + 1
            if seen >= count or time.monotonic() > deadline or (stop is not None and stop()):
                return seen
            time.sleep(0.05)

    # ---- the end ----
    def finish(self, timeout: float | None = None) -> bool:
        """Waits until every live trainer it trained with reached this trainer's step and holds its model: one
        lineage at that step. When the last step's averaging failed, trainers stepped alone onto lineages of their
        own, and no later step re-synced them: each then validated and saved another model (review 60). So a trainer
        off the canonical lineage of its step downloads it here, and one on it waits for the others to. True when
        every live trainer it trained with is at this step on this lineage; False at the timeout
        (``config.finish_timeout`` by default), with a warning naming who is behind or elsewhere (a trainer that
        serves no state, in client mode, cannot be downloaded from).

        The trainers it trained with are those whose records it read at its own step and lineage at some time
        (:meth:`ProgressTracker.fellows`). Any other record behind or elsewhere is named, not waited for: anyone's,
        kept at a lower step, made every trainer wait ``finish_timeout`` and say its model may differ (review 107
        D3)."""
        deadline = time.monotonic() + (self.config.finish_timeout if timeout is None else timeout)
        self.tracker.publish_now()
        while True:
            self.tracker.refresh_now()
            self._sync_if_needed(at_most=self.local_step)
            fellows = {pid: p for pid, (_, p) in self.tracker.signed_by(self.tracker.fellows()).items()}
            behind = sorted(pid for pid, p in fellows.items() if p.step < self.local_step)
            elsewhere = sorted(pid for pid, p in fellows.items()
                               if p.step == self.local_step and p.lineage != self.lineage)
            if (not behind and not elsewhere) or time.monotonic() > deadline:
                strangers = sorted(pid for pid, p in self.tracker.state().peers.items() if pid not in fellows and (
                    p.step < self.local_step or (p.step == self.local_step and p.lineage != self.lineage)))
                if strangers:
                    logger.info("not waited for trainers %s, behind or on another lineage: none trained with this "
                                "one", strangers)
                if not behind and not elsewhere:
                    return True
                logger.warning("finished at step %d on lineage %s; trainers %s are still behind, trainers %s hold "
                               "another model at this step", self.local_step, self.lineage, behind or "none",
                               elsewhere or "none")
                return False
            time.sleep(self.config.refresh_period / 2)

    def shutdown(self) -> None:
        """Marks this trainer gone in its progress record and stops the tracker, the state server and the
        averager; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for owner in (self.tracker, self.state_server):
            if owner is not None:
                owner.close()
        if self.averager is not None:
            self.averager.shutdown()

    def __enter__(self) -> "CollaborativeOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _ClaimMismatch(StateMismatch):
    """A state off the claim of the record that named its trainer (``step``, ``lineage``: what it serves)."""

    def __init__(self, message: str, step: int, lineage: str):
        super().__init__(message)
        self.step, self.lineage = step, lineage


class _TooFarAhead(_ClaimMismatch):
    """A state more than one step past the one its record claimed."""


class _OffClaim(_ClaimMismatch):
    """A state at another step or lineage than the record that named its trainer claimed."""


class _BeyondLimit(StateMismatch):
    """A state past the step a download may take (:meth:`CollaborativeOptimizer.finish` takes none beyond its own)."""


def _claim_check(claimed: Progress, at_most: int | None) -> Callable[[int, str], None]:
    """What a downloaded state's step and lineage must be, given the record that named its trainer: its claimed step
    on its claimed lineage, or one step further (it stepped between the read of its record and the download; that
    step's lineage cannot be checked), and never past ``at_most``. A state beyond the claim was taken whatever its
    step and lineage: a record one step ahead moved every trainer to step 999,999,999, which ends a run (review 77)."""

    def check(step: int, lineage: str) -> None:
        if at_most is not None and step > at_most:
            raise _BeyondLimit(f"it serves step {step}, past step {at_most}, the last this download may take")
        if step < claimed.step:
            raise _OffClaim(f"it claims step {claimed.step} but serves step {step}", step, lineage)
        if step == claimed.step and lineage != claimed.lineage:
            raise _OffClaim(f"it claims lineage {claimed.lineage} at step {claimed.step} but serves {lineage}", step,
                            lineage)
        if step > claimed.step + 1:
            raise _TooFarAhead(f"it claims step {claimed.step} but serves step {step}, more than one step further",
                               step, lineage)

    return check


def _claim_fits(claimed: Progress, at_most: int | None, step: int, lineage: str) -> bool:
    """Whether a state at ``step`` on ``lineage`` is one that ``claimed`` backs (:func:`_claim_check`)."""
    try:
        _claim_check(claimed, at_most)(step, lineage)
    except StateMismatch:
        return False
    return True
