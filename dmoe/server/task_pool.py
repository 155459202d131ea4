"""Task pools: the queues in front of one expert's forward or backward, from which the runtime forms batches."""
from __future__ import annotations

import itertools
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from dmoe.server.activations import ActivationKey

ProcessFn = Callable[..., Sequence[torch.Tensor]]
_sequence = itertools.count()


@dataclass(eq=False)
class Task:
    """One request: tensors with a batch dimension, and the future its caller awaits.

    ``activation_id``: what its kept forward is named by, if it names one (the caller's machine and the request's
    activation_id, see :mod:`dmoe.server.activations`).
    """

    inputs: tuple[torch.Tensor, ...]
    future: "Future[list[torch.Tensor]]"
    rows: int
    activation_id: ActivationKey | None = None
    seq: int = field(default_factory=lambda: next(_sequence))
    created: float = field(default_factory=time.monotonic)


class TaskPool:
    """Requests waiting for one function (an expert's forward or backward), oldest first.

    Pools are created by a :class:`~dmoe.server.runtime.Runtime`, the one owner of their queues: requests enter
    through :meth:`Runtime.submit <dmoe.server.runtime.Runtime.submit>` (from any thread) and leave in the batches
    it forms, under its lock.

    Args:
        name: for logs, e.g. ``'ffn0.3_forward'``.
        process: called with the concatenated batch; returns tensors whose first dimension is the batch.
        max_batch_size: the most rows the runtime will put in one call of ``process``.
        segmented: ``process`` also takes ``segments=[(activation id, rows), ...]``, one per task of the batch.
        group: pools of one group (an expert's forward and backward) never run at once; None: this pool alone.
    """

    def __init__(self, name: str, process: ProcessFn, max_batch_size: int, segmented: bool = False,
                 group: Hashable = None):
        self.name, self.process, self.max_batch_size = name, process, max_batch_size
        self.segmented = segmented
        self.group = group if group is not None else id(self)
        self.tasks: deque[Task] = deque()
        self.batches = 0
        self.rows = 0
        self.removed = False  # by Runtime.remove_pool: it takes no more tasks

    def __len__(self) -> int:
        return len(self.tasks)

    def __repr__(self) -> str:
        return f"TaskPool({self.name!r}, queued={len(self.tasks)})"
