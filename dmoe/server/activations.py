"""Activations kept between an expert's forward and its backward, so that backward need not recompute forward.

A client that will send a backward names its forward request with a random ``activation_id``. When that
request runs in a batch of its own, the expert's forward runs with autograd and its graph is kept here under
(uid, activation_id). The backward naming the same id then only runs the backward pass: about a third less
compute than recomputing the forward, which is what a server must otherwise do.

A kept graph is used only when it gives exactly what recomputing would:
- the expert's parameters are unchanged since the forward (any optimizer step of the expert drops all of its
  graphs: autograd saved the old weights), and
- the backward request carries the same inputs as the forward did (compared element for element).
Otherwise, or when the graph was evicted (byte budget, age) or never kept (the forward shared a batch with other
requests), backward recomputes the forward as before. So the cache changes speed, never results.

One owner per server; the runtime thread is the only one that computes with it, the lock covers readers of the
counters (metrics).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

#: Longest ``activation_id`` a server accepts (clients use 16 random bytes).
MAX_ACTIVATION_ID_BYTES = 64


@dataclass(eq=False)
class KeptForward:
    """One forward's autograd graph: its input leaves, outputs, the parameter versions it saw, its size."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]
    nbytes: int
    created: float = field(default_factory=time.monotonic)


def parameter_versions(params: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """In-place version counters: any optimizer step (or ``load_state_dict``) changes them."""
    return tuple(p._version for p in params)


class SavedBytes:
    """Counts the bytes autograd saves during a forward, as ``torch.autograd.graph.saved_tensors_hooks``.

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

    Args:
        max_bytes: the most bytes of saved activations held at once (0 keeps nothing).
        ttl: seconds a kept forward waits for its backward before it is dropped.
    """

    def __init__(self, max_bytes: int, ttl: float = 60.0):
        if max_bytes < 0 or ttl <= 0:
            raise ValueError(f"max_bytes must be >= 0 and ttl > 0, got {max_bytes} and {ttl}")
        self.max_bytes, self.ttl = max_bytes, ttl
        self._entries: OrderedDict[tuple[str, bytes], KeptForward] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        #: backward requests that named an id: those that used a kept graph, those that had to recompute
        self.hits = self.misses = 0
        self.evicted = 0      # kept forwards dropped for room or age before their backward came
        self.invalidated = 0  # kept forwards dropped because an optimizer step changed the parameters

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, uid: str, key: bytes, kept: KeptForward) -> bool:
        """Holds ``kept`` unless it alone exceeds the budget; evicts expired, then oldest entries to make room."""
        if kept.nbytes > self.max_bytes:
            return False
        with self._lock:
            self._drop_expired(time.monotonic())
            while self._entries and self.nbytes + kept.nbytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self.evicted += 1
            old = self._entries.pop((uid, key), None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[(uid, key)] = kept
            self.nbytes += kept.nbytes
        return True

    def take(self, uid: str, key: bytes, versions: tuple[int, ...],
             inputs: Sequence[torch.Tensor]) -> KeptForward | None:
        """Removes the forward kept under (uid, key); returns it if its parameters are still ``versions`` and it
        was computed from exactly ``inputs``."""
        with self._lock:
            self._drop_expired(time.monotonic())
            kept = self._entries.pop((uid, key), None)
            if kept is not None:
                self.nbytes -= kept.nbytes
            if kept is not None and kept.versions != versions:
                self.invalidated += 1
                kept = None
            if kept is not None and not all(torch.equal(k, x) for k, x in zip(kept.inputs, inputs, strict=True)):
                kept = None  # the client sent other inputs than its forward's: its own bug, recomputing is right
            if kept is None:
                self.misses += 1
            else:
                self.hits += 1
            return kept

    def drop_expert(self, uid: str) -> None:
        """Drops every forward kept for ``uid``: called after its optimizer step made them stale."""
        with self._lock:
            for entry_key in [k for k in self._entries if k[0] == uid]:
                self._remove(entry_key)
                self.invalidated += 1

    def _drop_expired(self, now: float) -> None:
        while self._entries:
            entry_key, oldest = next(iter(self._entries.items()))
            if now - oldest.created <= self.ttl:
                break
            self._remove(entry_key)
            self.evicted += 1

    def _remove(self, entry_key: tuple[str, bytes]) -> None:
        self.nbytes -= self._entries.pop(entry_key).nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0
