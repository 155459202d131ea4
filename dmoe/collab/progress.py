"""Progress tracking in the DHT: how far each trainer of a collaboration is toward the next global step.

Every trainer publishes one signed entry in record ``<run_id>.progress``, under its own peer id (an owned int
subkey: nobody else can rewrite it), and refreshes it every ``refresh_period`` with an expiration ``progress_ttl``
ahead, so a trainer that dies stops being counted soon after. The entry says (:class:`Progress`): the global step
its samples accumulate toward, the samples accumulated so far and its speed, when it published, where it serves
its state to joiners, whether it is accumulating or averaging, and the **lineage** of its parameters.

The lineage names the history of a trainer's dense parameters: a hash of the initial parameters, then after every
step a hash of the previous lineage and the group whose average made the step (or of the trainer alone). Trainers
at one step with one lineage hold equal parameters, without comparing them. Where lineages differ at one step
(trainers that averaged in two separate groups, or one that stepped alone after its group failed), the
**canonical** one wins: made by the largest group, then held by the most trainers, then the smallest name. A
trainer behind, or off the canonical lineage, downloads the state of a trainer on it
(:mod:`~dmoe.collab.state_sync`): of the furthest trainers that serve their state (those in client mode serve none).

A record must fit one DHT value (96 characters by default) for the whole run: a trainer whose state endpoint
leaves too little room (a full-length IPv6 address) is refused at the start (:func:`check_record_fits`).

Every trainer sees the collaboration from the records it read (:class:`CollaborationState`): the samples its
partners (same step, same lineage) accumulated, their speed and the estimated time until the target batch size.
Records that are malformed, claim absurd numbers, or were stamped in the future (or so long ago that no clock could
be that far behind) are refused with a logged message; liveness is judged on the reader's clock.
"""
from __future__ import annotations

import ipaddress
import logging
import math
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from dmoe.averaging.matchmaking import new_peer_id
from dmoe.collab.config import CollaborationConfig, check_run_id
from dmoe.dht import DHT
from dmoe.dht.messages import check_entry
from dmoe.dht.routing import contact_machine
from dmoe.dht.throttle import ThrottledWarnings
from dmoe.endpoints import bare_host, is_host_port, join_host_port

logger = logging.getLogger(__name__)

ACCUMULATING, AVERAGING, GONE = "a", "v", "x"
LINEAGE_CHARS = 8
#: publishes in a row that no node took before the trainer says so (and again at 100 times as many)
UNPUBLISHED_WARNING = 5
#: a group larger than this cannot have made a step: a matchmaking record holds at most this many peers
MAX_GROUP_SIZE = 256
#: a trainer's record must fit the DHT's value limit up to this step: no collaboration gets near a billion steps,
#: and an endpoint that only fits for fewer would make the trainer vanish from the others' view in mid-run
RECORD_MAX_STEP = 10**9 - 1
#: banned peer ids (and state servers' machines) kept before the expired bans are dropped
MAX_BANNED = 1024
#: downloads in a row from one machine, each within ``ban_time`` of the last, that came to nothing for a reason
#: that may be no fault of its server (busy, another step than claimed), before its machine is banned all the same
STRIKES_TO_BAN = 2
#: DHT keys of fellow trainers (:meth:`ProgressTracker.fellows`) kept before those that sign no record now are dropped
MAX_FELLOWS = 4096


def check_lineage(lineage: object) -> str:
    """Raises ValueError for anything but a lineage as :func:`dmoe.collab.optimizer.parameters_lineage` writes it
    (it travels in progress records: a malformed one could not be published)."""
    if not isinstance(lineage, str) or len(lineage) != LINEAGE_CHARS or any(
            c not in "0123456789abcdef" for c in lineage):
        raise ValueError(f"malformed lineage {lineage!r}")
    return lineage


def progress_key(run_id: str) -> str:
    """The DHT record every trainer of ``run_id`` publishes its progress in."""
    return f"{check_run_id(run_id)}.progress"


@dataclass(frozen=True)
class Progress:
    """One trainer's progress as it publishes it.

    step: the global step its samples accumulate toward (the optimizer steps its parameters have seen).
    samples: samples accumulated toward that step. samples_per_second: its recent speed.
    time: wall-clock time of publication. endpoint: where it serves its state (None: client mode).
    phase: ``a`` accumulating, ``v`` averaging this step's gradients, ``x`` gone (stopped on purpose).
    lineage: the history of its parameters (see the module docstring). group_size: the trainers whose average made
        the step that produced the lineage (0: initial parameters, 1: a step alone).
    """

    step: int
    samples: int
    samples_per_second: float
    time: float
    endpoint: str | None
    phase: str
    lineage: str
    group_size: int

    def encode(self) -> str:
        return (f"{self.step};{self.samples};{self.samples_per_second:.4g};{self.time:.2f};{self.endpoint or '-'};"
                f"{self.phase};{self.lineage};{self.group_size}")

    @classmethod
    def parse(cls, value: str) -> "Progress":
        """Raises ValueError for anything but what :meth:`encode` writes."""
        fields = value.split(";")
        if len(fields) != 8:
            raise ValueError(f"{len(fields)} fields instead of 8")
        step, samples, speed, stamp, endpoint, phase, lineage, group_size = fields
        if not (step.isdigit() and samples.isdigit() and group_size.isdigit()):
            raise ValueError("step, samples and group size must be non-negative integers")
        if phase not in (ACCUMULATING, AVERAGING, GONE):
            raise ValueError(f"unknown phase {phase!r}")
        check_lineage(lineage)
        if endpoint != "-" and not is_host_port(endpoint):  # (review 99 D3: unix:/... is a socket of the reader's)
            raise ValueError(f"malformed endpoint {endpoint!r}")
        return cls(int(step), int(samples), float(speed), float(stamp), None if endpoint == "-" else endpoint,
                   phase, lineage, int(group_size))


class RecordTooLong(ValueError):
    """This trainer's progress record could not be published for the whole run (a setting to change, not a bug)."""


def check_record_fits(peer_id: int, progress: Progress, config: CollaborationConfig, max_value_bytes: int) -> None:
    """Raises :class:`RecordTooLong`, naming the settings to change, when this trainer's record could grow past what the DHT
    stores before :data:`RECORD_MAX_STEP`: its endpoint takes too much of the value (a full-length IPv6 address
    leaves no room for the numbers). Checked once at the start, rather than failing to publish in mid-run."""
    worst = replace(progress, step=max(progress.step, RECORD_MAX_STEP),
                    samples=max(progress.samples, int(config.max_samples)), samples_per_second=9.999e99,
                    time=9999999999.99, phase=ACCUMULATING, group_size=MAX_GROUP_SIZE)
    value = worst.encode()
    try:
        check_entry(peer_id, value, worst.time, max_value_bytes)
    except ValueError as error:
        raise RecordTooLong(
            f"this trainer's progress record cannot carry its state endpoint {progress.endpoint!r}: at step "
            f"{worst.step} it would be {value!r} ({len(value)} characters; {error}). Serve the state at a shorter "
            f"address (dmoe-train --averaging-host and --state-port; CollaborationConfig.state_host and state_port), "
            f"or train in client mode (--averaging-client-mode), which serves no state") from None


def refusal(progress: Progress, config: CollaborationConfig, now: float) -> tuple[str, str] | None:
    """Why a well-formed record must be refused, as (kind, message), or None. Absurd numbers would make every
    trainer step too early (samples), never (a negative speed) or misjudge who is alive (a time stamped in the
    future)."""
    if progress.samples > config.max_samples:
        return "samples", (f"claims {progress.samples} samples toward step {progress.step}, more than "
                           f"{config.max_samples:g} ({config.max_samples_ratio:g} target batches)")
    if not (math.isfinite(progress.samples_per_second) and progress.samples_per_second >= 0):
        return "speed", f"claims a speed of {progress.samples_per_second} samples/s"
    if not math.isfinite(progress.time) or progress.time > now + config.max_clock_skew:
        return "future", (f"is stamped {progress.time - now:.0f} s in the future (more than max_clock_skew "
                          f"{config.max_clock_skew:g} s ahead of this clock)")
    if progress.group_size > MAX_GROUP_SIZE:
        return "group", f"claims a step averaged by {progress.group_size} trainers, more than {MAX_GROUP_SIZE}"
    return None


def canonical_lineage(at_step: Mapping[int, Progress]) -> str | None:
    """The lineage that wins among trainers at one step: made by the largest group, then held by the most
    trainers, then held by a trainer that serves its state, then the smallest name (every trainer that sees the same
    records picks the same). Serving before the name: when every trainer stepped alone, a client-mode trainer's
    lineage won half the time, nobody could download it, and it and the others stopped being partners (review 77)."""
    if not at_step:
        return None
    counts = Counter(p.lineage for p in at_step.values())
    sizes: dict[str, int] = {}
    served: set[str] = set()
    for p in at_step.values():
        sizes[p.lineage] = max(sizes.get(p.lineage, 0), p.group_size)
        if p.endpoint is not None:
            served.add(p.lineage)
    return min(counts, key=lambda lineage: (-sizes[lineage], -counts[lineage], lineage not in served, lineage))


@dataclass(frozen=True)
class CollaborationState:
    """The collaboration as one trainer sees it (``me``; None for an observer such as the demo's progress bar):
    its own progress, fresh, and the accepted records of the other live trainers."""

    me: Progress | None
    my_id: int | None
    peers: Mapping[int, Progress]
    target_batch_size: int
    now: float

    def _everyone(self) -> dict[int, Progress]:
        everyone = dict(self.peers)
        if self.me is not None and self.my_id is not None:
            everyone[self.my_id] = self.me
        return everyone

    @property
    def num_trainers(self) -> int:
        return len(self.peers) + (self.me is not None)

    @property
    def top_step(self) -> int:
        """The furthest step any live trainer reached (-1 for an observer that sees nobody)."""
        steps = [p.step for p in self._everyone().values()]
        return max(steps) if steps else -1

    @property
    def step(self) -> int:
        """This trainer's step; for an observer, the top step."""
        return self.me.step if self.me is not None else self.top_step

    def canonical(self, step: int) -> str | None:
        return canonical_lineage({pid: p for pid, p in self._everyone().items() if p.step == step})

    @property
    def partners(self) -> dict[int, Progress]:
        """Other trainers whose samples count toward this trainer's next step: same step, same (canonical for an
        observer) lineage."""
        lineage = self.me.lineage if self.me is not None else self.canonical(self.step)
        return {pid: p for pid, p in self.peers.items() if p.step == self.step and p.lineage == lineage}

    @property
    def samples_accumulated(self) -> int:
        """Samples reported toward the next step, by this trainer and its partners."""
        return (self.me.samples if self.me is not None else 0) + sum(p.samples for p in self.partners.values())

    @property
    def samples_per_second(self) -> float:
        return (self.me.samples_per_second if self.me is not None else 0.0) + sum(
            p.samples_per_second for p in self.partners.values())

    @property
    def samples_estimate(self) -> float:
        """Samples accumulated toward the next step by now: partners' reports extrapolated at their speed since
        they published (their records are up to a refresh period old)."""
        return (self.me.samples if self.me is not None else 0) + sum(
            p.samples + (p.samples_per_second * max(0.0, self.now - p.time) if p.phase == ACCUMULATING else 0.0)
            for p in self.partners.values())

    @property
    def ready(self) -> bool:
        """Time to average and step: the samples reported reached the target, or a partner started averaging (it
        saw the target reached in records this trainer may not have read yet). Reports, not the estimate: a step
        never takes fewer samples than the target (it may take a few more, what the trainers computed while their
        reports travelled)."""
        return self.samples_accumulated >= self.target_batch_size or any(
            p.phase == AVERAGING for p in self.partners.values())

    @property
    def eta(self) -> float:
        """Estimated seconds until the target is reached (inf when nobody is training)."""
        missing = self.target_batch_size - self.samples_estimate
        if missing <= 0:
            return 0.0
        speed = self.samples_per_second
        return missing / speed if speed > 0 else math.inf

    def source(self, rng: random.Random | None = None) -> tuple[int, Progress] | None:
        """Whom this trainer should download the state from, or None when nobody who serves a state is better off:
        a random trainer among those that serve theirs, at the highest step any of them reached, on that step's
        canonical lineage. Only servers count toward that step: trainers above it (in client mode, or a record
        that claims a step with nothing behind it) cannot be downloaded from, and must not keep a joiner at its
        own step. If no server holds the canonical lineage there, this trainer takes the servers' own canonical
        lineage when that moves it forward, never to swap one lineage for another at its own step."""
        if self.me is None:
            return None
        serving = {pid: p for pid, p in self.peers.items() if p.endpoint is not None}
        best = max((p.step for p in serving.values()), default=-1)
        if best < self.me.step:
            return None
        at_best = {pid: p for pid, p in serving.items() if p.step == best}
        canonical = self.canonical(best)
        if not any(p.lineage == canonical for p in at_best.values()) and best > self.me.step:
            canonical = canonical_lineage(at_best)
        if best == self.me.step and canonical == self.me.lineage:
            return None
        candidates = sorted((pid, p) for pid, p in at_best.items() if p.lineage == canonical)
        return (rng or random).choice(candidates) if candidates else None


def endpoint_machine(endpoint: str) -> str:
    """The machine a ``HOST:PORT`` is on, as the DHT counts contacts (:func:`dmoe.dht.routing.contact_machine`). A
    host name counts as one machine whatever its case (DNS ignores it) and port, ``localhost`` as each loopback
    ``ip:port`` does: every spelling and port of one name was a machine of its own, each record naming one server
    anew got past its ban (review 107 D1). Names are not resolved here (no DNS in a read of the records): a
    download resolves the name first (:func:`resolve_endpoint`) and bans the address too."""
    host, _, port = endpoint.rpartition(":")
    host = bare_host(host)
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        host = host.lower()
        return f"{host}:{port}" if host == "localhost" else host
    return contact_machine(host, int(port) if port.isdigit() else 0)


def resolve_endpoint(endpoint: str, timeout: float) -> str:
    """``endpoint`` with its host name resolved to an IP address (IPv4 where it has both, as the DHT listens), or as
    it is when its host is one; raises OSError when the name does not resolve within ``timeout`` seconds. A download
    dials the address it resolved, so that the ban of a server that failed is the ban of the machine it dialed: a
    record may name any host name, and every name of a wildcard domain, each a new name, led to one server (review
    107 D1). The look-up runs in a thread of its own: the DNS server of a hostile name may take its time to answer,
    and ``getaddrinfo`` has no timeout."""
    host, _, port = endpoint.rpartition(":")
    try:
        ipaddress.ip_address(bare_host(host).split("%", 1)[0])
        return endpoint
    except ValueError:
        pass
    found: list = []

    def look_up() -> None:
        try:
            found.append(socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as error:  # (an IDNA-invalid name raises UnicodeError)
            found.append(error)

    thread = threading.Thread(target=look_up, name="dmoe-collab-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if not found:
        raise TimeoutError(f"{host} did not resolve within {timeout:g}s")
    if isinstance(found[0], BaseException):
        raise OSError(f"{host} does not resolve: {found[0]}")
    if not found[0]:
        raise OSError(f"{host} resolves to no address")
    *_, address = min(found[0], key=lambda info: info[0] != socket.AF_INET)
    return join_host_port(address[0], port)


class ProgressTracker:
    """Publishes this trainer's :class:`Progress` and reads the others', every ``refresh_period``, in a background
    thread it owns (stopped by :meth:`close`). ``peer_id`` None makes an observer that publishes nothing.

    Refused records are logged at most once an hour per peer and reason (100 an hour in all); :meth:`ban` ignores a
    peer for ``config.ban_time``.
    """

    def __init__(self, dht: DHT, run_id: str, config: CollaborationConfig, peer_id: int | None = None,
                 progress: Progress | None = None):
        if (peer_id is None) != (progress is None):
            raise ValueError("a trainer gives both its peer_id and its progress; an observer neither")
        if peer_id is not None:
            check_record_fits(peer_id, progress, config, dht.config.max_value_bytes)
        self.dht, self.config, self.peer_id = dht, config, peer_id
        self.key = progress_key(run_id)
        self._progress = progress
        self._peers: dict[int, Progress] = {}
        self._stamps: dict[int, tuple[float, float]] = {}  # peer: (its record's stamp, when first read here)
        self._owners: dict[int, bytes] = {}  # accepted peer: the DHT key that signed its record
        # the DHT keys of records read at this trainer's (step, lineage) since it got there (see companions())
        self._companions: tuple[tuple[int, str] | None, set[bytes]] = (None, set())
        self._fellows: set[bytes] = set()  # the DHT keys of records read at any of its steps and lineages (fellows())
        self._unpublished = 0  # publishes in a row that no node took
        self._banned: dict[int, float] = {}
        self._banned_endpoints: dict[str, tuple[float, float]] = {}  # machine: (until, the ban's length)
        self._strikes: dict[str, tuple[int, float]] = {}  # machine: (refusals in a row, wall clock of the last)
        # one warning per peer and reason an hour, 100 an hour in all: a writer cycling fresh ids under malformed
        # entries logged a line per id (90 a second in review 77's repro) and grew a set of them without bound
        self._warnings = ThrottledWarnings(logger, period=3600.0, max_per_period=100)
        self._warnings_lock = threading.Lock()  # (the tracker's thread and the trainer's both refresh)
        self._expiration = 0.0
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self.read_at = 0.0  # wall clock of the last successful read
        self._thread = threading.Thread(target=self._run, name="dmoe-collab-progress", daemon=True)
        self._thread.start()

    # ---- this trainer's side ----
    @property
    def progress(self) -> Progress | None:
        with self._lock:
            return self._progress

    def update(self, **changes) -> Progress:
        """Changes this trainer's progress (published at the next refresh, or by :meth:`publish_now`)."""
        with self._lock:
            self._progress = replace(self._progress, **changes)
            return self._progress

    def publish_now(self) -> bool:
        """Stores this trainer's progress now (stamped now); True when a replica took it."""
        if self.peer_id is None:
            return False
        with self._publish_lock:
            now = time.time()
            progress = self.update(time=now)
            # the latest expiration of an owned entry wins: each store must outlive the previous one
            self._expiration = max(now + self.config.progress_ttl, self._expiration + 0.01)
            try:
                stored = self.dht.store(self.key, self.peer_id, progress.encode(), self._expiration)
            except (TimeoutError, RuntimeError) as error:
                logger.warning("could not publish progress: %s", error)
                return False
            except ValueError as error:  # no node would take it: a failure to publish must not stop training
                logger.error("could not publish progress %r: %s", progress.encode(), error)
                return False
            self._unpublished = 0 if stored else self._unpublished + 1
            if self._unpublished in (UNPUBLISHED_WARNING, UNPUBLISHED_WARNING * 100):
                # the others do not see this trainer: they neither count its samples nor wait for it
                logger.warning("%d publishes of this trainer's progress in a row were taken by no DHT node (a "
                               "record full of other entries, or no node reachable): the other trainers do not "
                               "see it", self._unpublished)
            return stored

    # ---- the others ----
    def state(self, me: Progress | None = None) -> CollaborationState:
        """The collaboration as of the last read, with this trainer's progress as it is now."""
        with self._lock:
            peers, own = dict(self._peers), self._progress
        return CollaborationState(me or own, self.peer_id, peers, self.config.target_batch_size, time.time())

    def refresh_now(self) -> dict[int, Progress]:
        """Reads the others' records now; returns the accepted ones (also kept for :meth:`state`)."""
        try:
            record = self.dht.get(self.key)
        except (TimeoutError, RuntimeError) as error:
            logger.debug("could not read %s: %s", self.key, error)
            with self._lock:
                return dict(self._peers)
        now = time.time()
        accepted = {}
        with self._lock:
            previous = self._stamps
        stamps: dict[int, tuple[float, float]] = {}
        taken = False
        for subkey, entry in record.items():
            if subkey == self.peer_id:
                taken = entry.owner != self.dht.identity.public_key
                continue
            if not isinstance(subkey, int) or isinstance(subkey, bool):
                continue
            if self._banned.get(subkey, 0.0) > now:
                continue
            try:
                progress = Progress.parse(entry.value)
            except ValueError as error:
                self._refuse(subkey, "malformed", f"is malformed: {entry.value!r} ({error})")
                continue
            problem = refusal(progress, self.config, now)
            if problem is not None:
                self._refuse(subkey, *problem)
                continue
            # liveness by this reader's clock: since when it reads this stamp (a writer whose clock is behind would
            # look dead by its own stamps; one ahead, fresh for long); the stamp itself only rules out a writer
            # silent for longer than any clock could be behind (its entry outlived it: a long expiration)
            first_read = previous.get(subkey)
            if first_read is None or first_read[0] != progress.time:
                first_read = (progress.time, now)
            stamps[subkey] = first_read
            if progress.phase == GONE or now - first_read[1] > self.config.progress_ttl:
                continue  # stopped, or silent since
            if now - progress.time > self.config.progress_ttl + self.config.max_clock_skew:
                self._refuse(subkey, "past", f"is stamped {now - progress.time:.0f} s in the past (more than "
                                             f"progress_ttl + max_clock_skew): a trainer that went silent, or a "
                                             f"clock far behind this one")
                continue
            # extrapolated from when it was first read here, on this clock
            progress = replace(progress, time=first_read[1])
            if progress.endpoint is not None and self.endpoint_banned(progress.endpoint):
                progress = replace(progress, endpoint=None)  # no state to download there, for now
            accepted[subkey] = progress
        with self._lock:
            self._peers = accepted
            self._stamps = stamps
            self._owners = {subkey: record[subkey].owner for subkey in accepted}
            companions = self._companions_now()
            if self._progress is not None:
                met = {self._owners[pid] for pid, p in accepted.items()
                       if (p.step, p.lineage) == (self._progress.step, self._progress.lineage)}
                companions.update(met)
                self._fellows.update(met)
                if len(self._fellows) > MAX_FELLOWS:  # keys that sign no record now cannot be waited for
                    self._fellows = (self._fellows & set(self._owners.values())) | companions
        self.read_at = now
        if taken:
            self._draw_new_id()
        return accepted

    def _draw_new_id(self) -> None:
        """Publishes under a new peer id: another DHT key holds this one. An id is anyone's to take once its entry
        lapsed (a network blip, a paused laptop: ``progress_ttl`` without a refresh), and it is public (the record's
        subkey), so a watcher took it for as long as it liked and the trainer, refused at every publish, was invisible
        to the others for the rest of the run (review 77)."""
        with self._publish_lock:
            taken, self.peer_id = self.peer_id, new_peer_id()
            self._expiration, self._unpublished = 0.0, 0
        with self._warnings_lock:  # (at most once an hour: whoever holds the record's replicas could make it every read)
            self._warnings.warn("id taken", "", "another DHT key took this trainer's progress id %s; publishing as %s "
                                "from now on", taken, self.peer_id)
        self.publish_now()

    def owners(self, peer_ids: Iterable[int]) -> set[bytes]:
        """The DHT keys that signed these trainers' records (as of the last read; those no longer accepted are left
        out). A trainer's averager declares itself with the same key: these are the peers its averaging expects."""
        with self._lock:
            return {self._owners[pid] for pid in peer_ids if pid in self._owners}

    def companions(self) -> frozenset[bytes]:
        """The DHT keys that signed records read at this trainer's step and lineage since it got there (by every
        read: the tracker's own thread keeps reading while the trainer averages): the partners it knew of at that
        step, and those that joined it late. Only they could still be finishing that step once this trainer has
        moved on (:meth:`dmoe.collab.CollaborativeOptimizer._await_finishing`)."""
        with self._lock:
            return frozenset(self._companions_now())

    def fellows(self) -> frozenset[bytes]:
        """The DHT keys that signed records read at this trainer's step and lineage at any time of the run: the
        trainers it trained with (or began with, from the same parameters), which :meth:`dmoe.collab.
        CollaborativeOptimizer.finish` waits for; anyone's record elsewhere is no such trainer's (review 107 D3)."""
        with self._lock:
            return frozenset(self._fellows)

    def _companions_now(self) -> set[bytes]:
        """(under the lock) The set of :meth:`companions`, emptied when this trainer's step or lineage changed."""
        own = None if self._progress is None else (self._progress.step, self._progress.lineage)
        if self._companions[0] != own:
            self._companions = (own, set())
        return self._companions[1]

    def signed_by(self, keys: Iterable[bytes]) -> dict[int, tuple[bytes, Progress]]:
        """The accepted records (as of the last read) that these DHT keys signed, each with its key."""
        keys = set(keys)
        with self._lock:
            return {pid: (self._owners[pid], p) for pid, p in self._peers.items() if self._owners.get(pid) in keys}

    def ban(self, peer_id: int, reason: str, seconds: float | None = None) -> None:
        """Ignores ``peer_id``'s records for ``seconds`` (default ``config.ban_time``)."""
        seconds = self.config.ban_time if seconds is None else seconds
        logger.warning("ignoring trainer %s for %g s: %s", peer_id, seconds, reason)
        now = time.time()
        if len(self._banned) >= MAX_BANNED:  # bans of ids long gone: the record holds at most 256 at once
            self._banned = {pid: until for pid, until in self._banned.items() if until > now}
        self._banned[peer_id] = now + seconds
        with self._lock:
            self._peers.pop(peer_id, None)

    def ban_endpoint(self, endpoint: str, dialed: str | None = None) -> float:
        """Downloads no state from ``endpoint``'s machine (no connection could be made to it) for
        ``config.ban_time``, twice as long each time it fails again after its ban (at most 16 times as long);
        returns how long. Any record naming that machine meanwhile counts as one serving no state: anyone can
        publish records pointing at an address that drops packets, under as many peer ids as they like, and each try
        costs the trainer a connection timeout. By machine (an IPv4 address, an IPv6 /64; on loopback each
        ip:port), not by ``HOST:PORT``: a new port for every record got past a ban of the last one (review 53).
        ``dialed``: the address ``endpoint``'s host name resolved to (:func:`resolve_endpoint`), whose machine is
        banned, and the name with it, until then (review 107 D1)."""
        now = time.time()
        machine = endpoint_machine(dialed or endpoint)
        until, seconds = self._banned_endpoints.get(machine, (0.0, 0.0))
        if until <= now:
            if len(self._banned_endpoints) >= MAX_BANNED:  # (review 107 D1: one entry per address ever tried)
                self._banned_endpoints = {key: ban for key, ban in self._banned_endpoints.items() if ban[0] > now}
            seconds = min(2 * seconds, 16 * self.config.ban_time) if seconds else self.config.ban_time
            until = now + seconds
            self._banned_endpoints[machine] = (until, seconds)
        banned = {machine}
        if dialed is not None and endpoint_machine(endpoint) != machine:
            banned.add(endpoint_machine(endpoint))
            self._banned_endpoints[endpoint_machine(endpoint)] = (until, seconds)
        self._strikes.pop(machine, None)
        with self._lock:  # at once, not at the next read: records read meanwhile (new ids) name it too
            self._peers = {pid: replace(p, endpoint=None) if p.endpoint is not None
                           and endpoint_machine(p.endpoint) in banned else p for pid, p in self._peers.items()}
        return seconds

    def endpoint_banned(self, endpoint: str) -> bool:
        """Whether ``endpoint``'s machine is banned now (see :meth:`ban_endpoint`)."""
        return self._banned_endpoints.get(endpoint_machine(endpoint), (0.0,))[0] > time.time()

    def strike_endpoint(self, endpoint: str) -> bool:
        """Counts a download from ``endpoint`` that came to nothing for a reason that may be no fault of its server
        (busy, or a state at another step than a record claimed for it); True at the :data:`STRIKES_TO_BAN`-th
        such download from its machine within ``ban_time`` with none that succeeded between them: then ban it. Each
        of them was forgiven, and one server that refused every download just within ``slow_refusal``, under fresh
        peer ids or with its record raised to explain it, held every ``step()`` for that long (review 107 D2)."""
        now = time.time()
        machine = endpoint_machine(endpoint)
        if len(self._strikes) >= MAX_BANNED:
            self._strikes = {key: strike for key, strike in self._strikes.items()
                             if strike[1] + self.config.ban_time > now}
        count, last = self._strikes.get(machine, (0, 0.0))
        count = count + 1 if last + self.config.ban_time > now else 1
        self._strikes[machine] = (count, now)
        return count >= STRIKES_TO_BAN

    def endpoint_served(self, endpoint: str) -> None:
        """A download from ``endpoint`` succeeded: its refusals before do not count toward a ban."""
        self._strikes.pop(endpoint_machine(endpoint), None)

    def _refuse(self, peer_id: int, kind: str, message: str) -> None:
        with self._warnings_lock:
            self._warnings.warn(kind, str(peer_id), "refused the progress record of trainer %s: it %s", peer_id,
                                message)

    def wake(self) -> None:
        """Publishes and reads again now instead of at the end of the refresh period (the target is near: every
        trainer doing so keeps the step's overshoot to about one batch per trainer)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.peer_id is not None:
                    self.publish_now()
                self.refresh_now()
            except Exception:  # noqa: BLE001 - a dead thread would leave the trainer invisible and blind, silently
                logger.exception("the progress tracker's refresh failed; trying again at the next one")
            self._wake.wait(self.config.refresh_period * random.uniform(0.8, 1.0))
            self._wake.clear()

    def close(self) -> None:
        """Stops the thread; a trainer marks itself gone, so the others stop counting it at once."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(self.config.refresh_period + self.dht.config.call_timeout)
        if self.peer_id is not None:
            self.update(phase=GONE)
            self.publish_now()

    def __enter__(self) -> "ProgressTracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
