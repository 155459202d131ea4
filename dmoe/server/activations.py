"""Activations kept between an expert's forward and its backward, so that backward need not recompute forward,
and the client need not send the inputs again.

A client that will send a backward names its forward request with a random ``activation_id``. The server then
holds that request's inputs under (uid, activation_id); when the request ran in a batch of its own, it also holds
the autograd graph of its forward. The backward naming the same id may leave the inputs out (the server answers
FAILED_PRECONDITION if it no longer holds them, and the client sends them again), and when the graph is still
valid it only runs the backward pass: about a third less compute than recomputing the forward.

A kept graph is used only when it computes what recomputing would:
- the expert's weights are unchanged since the forward: the same backend object (a uid removed and served again
  is another backend, whose weights differ), with no optimizer step or ``load_state_dict`` since (an optimizer step
  of the expert drops all of its graphs, as autograd saved the old weights; the inputs stay). This is told by a
  stamp the backend renews at each such change, beside ``Tensor._version``: fused optimizers (the server's
  default) change the weights without bumping ``_version`` (review 84), and
- the backward computes on the very inputs of the forward (compared element for element when sent again).
Otherwise, or when the graph was evicted (byte budget, age) or never kept (the forward shared a batch with other
requests), backward recomputes the forward as before. So the cache changes speed and traffic, not what is computed:
a backward batch of one request gives bit for bit what recomputing gives. In a batch of several requests, each kept
graph's backward adds its parameter gradients on its own and the recomputed rows add theirs together, so the step
equals recomputing's up to the order of floating-point sums, not bit for bit (review 95 D4); how the runtime joins
requests into batches, which depends on timing, changes those sums the same way.

The budget is shared fairly between the machines that call: the servicer names a request's kept forward by
(caller's machine, activation_id), and when room must be made the machine holding the most (bytes, plus
:data:`ENTRY_OVERHEAD_BYTES` per entry) loses its oldest entry. A client that keeps forwards it never takes back
then evicts its own, not another's, once it holds more than they do.

One owner per server. The runtime workers add and take entries; the gRPC thread peeks at inputs; a lock covers
both.
"""
from __future__ import annotations

import logging
import threading
import time
import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

#: Longest ``activation_id`` a server accepts (clients use 16 random bytes).
MAX_ACTIVATION_ID_BYTES = 64
#: about what a kept forward costs beyond its tensors' bytes (its key, entry and tensor objects: 0.9 KB measured).
#: The cache holds at most one entry per this many bytes of its budget (and at least :data:`MIN_ENTRIES`), so that a
#: client keeping forwards of one small row each cannot make the server hold many times its budget: 14 times with
#: h=16 before (review 48)
ENTRY_OVERHEAD_BYTES = 1024
MIN_ENTRIES = 64

#: How a kept forward is named: the request's activation_id, or (the caller's machine, activation_id) as the
#: servicer names it, so that each machine's share of the budget is counted (a bare id counts as machine "").
ActivationKey = bytes | tuple[str, bytes]


def kept_key(machine: str, activation_id: bytes) -> tuple[str, bytes] | None:
    """How the servicer names a request's kept forward: its caller's machine and its activation_id (None: none)."""
    return (machine, activation_id) if activation_id else None


def owner_of(key: ActivationKey) -> str:
    """The machine whose share a kept forward counts against."""
    return key[0] if isinstance(key, tuple) else ""


@dataclass(eq=False)
class KeptForward:
    """One forward request: its inputs and, when its graph was kept, its outputs and the stamp of the weights the
    graph saw (``ExpertBackend.weights_stamp``: compared, never read). ``nbytes``: what holding it costs (the
    distinct storages of its inputs, saved activations and outputs; the weights do not count)."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...] | None
    weights: Hashable
    nbytes: int
    created: float = field(default_factory=time.monotonic)

    @classmethod
    def inputs_only(cls, inputs: Sequence[torch.Tensor]) -> "KeptForward":
        return cls(tuple(x.detach() for x in inputs), None, (), sum(x.nbytes for x in inputs))


    @property
    def device(self) -> str:
        """Where its memory is: the inputs' device (its saved activations live beside them)."""
        return str(self.inputs[0].device) if self.inputs else "cpu"


def parameter_versions(params: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """In-place version counters: ``load_state_dict``'s copies and a plain (for-loop) optimizer's step bump them, a
    fused optimizer's step does not, so alone they never tell that the weights are unchanged."""
    return tuple(p._version for p in params)


class SavedBytes:
    """Counts the bytes autograd saves during a forward, as ``torch.autograd.graph.saved_tensors_hooks``, and
    whatever else a kept forward holds (its inputs and outputs, given to :meth:`pack`).

    Each storage counts once; the expert's own parameters count zero (they exist anyway).
    """

    def __init__(self, params: Iterable[torch.Tensor]):
        self._seen = {p.untyped_storage().data_ptr() for p in params}
        self.nbytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.nbytes += storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class ActivationCache:
    """Kept forwards of every expert of one server, bounded in bytes and in age; least recently kept go first.

    The bytes are also counted per device (``held``) with the most held at once (``peak``): on a GPU server the
    kept forwards are in the GPU's memory, which the budget must leave to the experts' own computations, so a
    volunteer sizing ``--activation-cache-mb`` reads how much of it was used (``dmoe_activation_cache_bytes``).

    Args:
        max_bytes: the most bytes of saved activations held at once (0 keeps nothing).
        ttl: seconds a kept forward waits for its backward before it is dropped.
    """

    def __init__(self, max_bytes: int, ttl: float = 60.0):
        if max_bytes < 0 or ttl <= 0:
            raise ValueError(f"max_bytes must be >= 0 and ttl > 0, got {max_bytes} and {ttl}")
        self.max_bytes, self.ttl = max_bytes, ttl
        #: the most entries held at once (see :data:`ENTRY_OVERHEAD_BYTES`)
        self.max_entries = max(MIN_ENTRIES, max_bytes // ENTRY_OVERHEAD_BYTES)
        self._entries: OrderedDict[tuple[str, ActivationKey], KeptForward] = OrderedDict()
        #: uid -> ids of its entries that hold a graph: what an optimizer step of that expert makes stale, found
        #: without walking every entry of every expert (a 512 MiB cache of small forwards holds ~100k)
        self._graphs: dict[str, set[ActivationKey]] = {}
        #: machine -> its entries, oldest first, and what they weigh (bytes + ENTRY_OVERHEAD_BYTES each); a heap of
        #: (-weight, n, machine), stale items skipped when read, finds the heaviest without a walk over every machine
        self._owned: dict[str, OrderedDict[tuple[str, ActivationKey], None]] = {}
        self._weight: dict[str, int] = {}
        self._heaviest: list[tuple[int, int, str]] = []
        self._pushes = itertools.count()
        self._lock = threading.Lock()
        self.held: dict[str, int] = {}  # device -> bytes kept there now
        self.peak: dict[str, int] = {}  # device -> the most bytes kept there at once
        #: backward requests that named an id: those that used a kept graph, those that had to recompute
        self.hits = self.misses = 0
        self.evicted = 0      # kept forwards dropped for room or age before their backward came
        self.invalidated = 0  # kept forwards dropped because an optimizer step changed the parameters
        self.released = 0     # kept forwards dropped to give their memory to a computation that ran out of it

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes kept now, on every device: what the budget bounds."""
        return sum(self.held.values())

    def put(self, uid: str, activation_id: ActivationKey, kept: KeptForward) -> bool:
        """Holds ``kept`` unless it alone exceeds the budget; evicts expired entries, then, to make room in bytes and
        in entries (:attr:`max_entries`), the oldest of the heaviest machine's (``kept``'s own machine counted with
        ``kept``)."""
        if kept.nbytes > self.max_bytes:
            return False
        owner = owner_of(activation_id)
        with self._lock:
            self._drop_expired(time.monotonic())
            self._pop((uid, activation_id))
            while self._entries and (self.nbytes + kept.nbytes > self.max_bytes
                                     or len(self._entries) >= self.max_entries):
                victim = self._heaviest_owner()
                mine = self._weight.get(owner, 0)
                if mine and mine + kept.nbytes + ENTRY_OVERHEAD_BYTES > self._weight[victim]:
                    victim = owner
                self._remove(next(iter(self._owned[victim])))
                self.evicted += 1
            self._entries[(uid, activation_id)] = kept
            self._owned.setdefault(owner, OrderedDict())[(uid, activation_id)] = None
            self._weigh(owner, kept.nbytes + ENTRY_OVERHEAD_BYTES)
            self._count(kept, 1)
            if kept.outputs is not None:
                self._graphs.setdefault(uid, set()).add(activation_id)
        return True

    def _weigh(self, owner: str, change: int) -> None:
        weight = self._weight[owner] = self._weight.get(owner, 0) + change
        if not weight:
            del self._weight[owner]
            del self._owned[owner]
            return
        if len(self._heaviest) > 2 * len(self._weight) + 64:  # mostly stale: rebuilt, so it stays O(machines)
            self._heaviest = [(-w, next(self._pushes), o) for o, w in self._weight.items()]
            heapq.heapify(self._heaviest)
        else:
            heapq.heappush(self._heaviest, (-weight, next(self._pushes), owner))

    def _heaviest_owner(self) -> str:
        """The machine whose entries weigh the most (the cache holds some)."""
        while True:
            weight, _, owner = self._heaviest[0]
            if self._weight.get(owner) == -weight:
                return owner
            heapq.heappop(self._heaviest)

    def machines(self) -> dict[str, int]:
        """machine -> what its kept forwards weigh now (bytes plus :data:`ENTRY_OVERHEAD_BYTES` each)."""
        with self._lock:
            return dict(self._weight)

    def _pop(self, entry_key: tuple[str, ActivationKey]) -> KeptForward | None:
        """Removes an entry, uncounted and out of the graphs' index; None if there was none."""
        kept = self._entries.pop(entry_key, None)
        if kept is not None:
            self._count(kept, -1)
            owner = owner_of(entry_key[1])
            del self._owned[owner][entry_key]
            self._weigh(owner, -(kept.nbytes + ENTRY_OVERHEAD_BYTES))
            if kept.outputs is not None:
                ids = self._graphs.get(entry_key[0])
                if ids is not None:
                    ids.discard(entry_key[1])
                    if not ids:
                        del self._graphs[entry_key[0]]
        return kept

    def usage(self) -> dict[str, tuple[int, int]]:
        """device -> (bytes kept there now, the most kept there at once), read consistently."""
        with self._lock:
            return {device: (held, self.peak.get(device, 0)) for device, held in self.held.items()}

    def _count(self, kept: KeptForward, sign: int) -> None:
        device = kept.device
        self.held[device] = held = self.held.get(device, 0) + sign * kept.nbytes
        if held > self.peak.get(device, 0):
            self.peak[device] = held

    def inputs(self, uid: str, activation_id: ActivationKey) -> tuple[torch.Tensor, ...] | None:
        """The inputs of the forward kept under (uid, activation_id), left in place; None when not held."""
        with self._lock:
            kept = self._entries.get((uid, activation_id))
            return kept.inputs if kept is not None else None

    def take(self, uid: str, activation_id: ActivationKey, weights: Hashable,
             inputs: Sequence[torch.Tensor]) -> KeptForward | None:
        """Removes the forward kept under (uid, activation_id); returns it if it has a graph, its weights' stamp is
        still ``weights`` and it was computed from exactly ``inputs``, else None (recompute)."""
        with self._lock:
            self._drop_expired(time.monotonic())
            kept = self._pop((uid, activation_id))
            if kept is not None and kept.outputs is not None and kept.weights != weights:
                self.invalidated += 1
                kept = None
            if kept is not None and (kept.outputs is None or not all(
                    _same_values(k, x) for k, x in zip(kept.inputs, inputs, strict=True))):
                kept = None  # inputs only; or the client sent other inputs than its forward's: recompute
            if kept is None:
                self.misses += 1
            else:
                self.hits += 1
            return kept

    def discard(self, uid: str, activation_id: ActivationKey) -> None:
        """Removes the forward kept under (uid, activation_id), if any, counting neither a hit nor a miss: a backward
        that recomputes in any case (an expert run as CUDA graphs) needed only its inputs."""
        with self._lock:
            self._pop((uid, activation_id))

    def drop_graphs(self, uid: str) -> None:
        """Keeps only the inputs of ``uid``'s forwards: called after its optimizer step made their graphs stale.
        Visits only that expert's entries with a graph (an index, not a walk over the whole cache)."""
        with self._lock:
            for activation_id in self._graphs.pop(uid, ()):
                entry_key = (uid, activation_id)
                kept = self._entries[entry_key]
                stale = self._entries[entry_key] = KeptForward.inputs_only(kept.inputs)
                stale.created = kept.created
                self._count(kept, -1)
                self._count(stale, 1)
                self._weigh(owner_of(activation_id), stale.nbytes - kept.nbytes)
                self.invalidated += 1

    def forget(self, uid: str) -> int:
        """Drops every forward kept for ``uid`` (inputs and graphs); returns how many. Called when the server stops
        or starts serving ``uid``: a graph holds the removed backend's weights alive (device memory on a GPU), and a
        backend served later under the same uid must not run backward through it. A walk over the whole cache: rare
        (adoption, removal), unlike an optimizer step's :meth:`drop_graphs`."""
        with self._lock:
            mine = [entry_key for entry_key in self._entries if entry_key[0] == uid]
            for entry_key in mine:
                self._pop(entry_key)
            return len(mine)

    def expire(self) -> int:
        """Drops the kept forwards older than :attr:`ttl`; returns how many. :meth:`put` and :meth:`take` do it too,
        but only when requests come: the server calls this on a timer, so that an idle server lets go of them."""
        with self._lock:
            return self._drop_expired(time.monotonic())

    def _drop_expired(self, now: float) -> int:
        dropped = 0
        while self._entries:
            entry_key, oldest = next(iter(self._entries.items()))
            if now - oldest.created <= self.ttl:
                break
            self._remove(entry_key)
            self.evicted += 1
            dropped += 1
        return dropped

    def _remove(self, entry_key: tuple[str, ActivationKey]) -> None:
        self._pop(entry_key)

    def clear(self) -> int:
        """Drops every kept forward; returns the bytes freed."""
        with self._lock:
            return self._drop_all()

    def release(self) -> int:
        """:meth:`clear`, because a computation ran out of device memory (the experts' own work comes first), and
        counted as such. Their backwards recompute, and ask the client for their inputs again."""
        with self._lock:
            self.released += len(self._entries)
            return self._drop_all()

    def _drop_all(self) -> int:
        freed = self.nbytes
        self._entries.clear()
        self._graphs.clear()
        self._owned.clear()
        self._weight.clear()
        self._heaviest.clear()
        self.held = {device: 0 for device in self.held}
        return freed


def _same_values(kept: torch.Tensor, given: torch.Tensor) -> bool:
    if (kept.data_ptr(), kept.shape, kept.stride(), kept.dtype) == (given.data_ptr(), given.shape, given.stride(),
                                                                   given.dtype):
        return True  # the very tensor the server held (a backward that left its inputs out)
    return torch.equal(kept, given)
