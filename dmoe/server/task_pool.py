"""Task pools: the queues in front of one expert's forward or backward, from which the runtime forms batches."""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

import torch

from dmoe.server.activations import ActivationKey

if TYPE_CHECKING:
    from dmoe.server.runtime import Runtime

ProcessFn = Callable[..., Sequence[torch.Tensor]]
_sequence = itertools.count()


class TaskFuture(Future):
    """The future of a task: cancelling it while the task waits takes the task, and the inputs it holds, out of its
    pool at once, not when a worker next reaches that pool. The servicer stops counting a request's bytes when its
    future is done, cancelled included: a pool kept holding the inputs of requests cancelled (or past their deadline)
    while its workers were busy, counted by nobody (review 95 D1)."""

    def __init__(self, runtime: "Runtime") -> None:
        super().__init__()
        self.runtime = runtime
        #: the pool its task waits in (set and cleared by the runtime, under its lock); None: not waiting
        self.pool: "TaskPool | None" = None

    def cancel(self) -> bool:
        pool = self.pool
        if pool is not None:
            self.runtime.dequeue(pool, self)
        return super().cancel()


@dataclass(eq=False)
class Task:
    """One request: tensors with a batch dimension, and the future its caller awaits.

    ``activation_id``: what its kept forward is named by, if it names one (the caller's machine and the request's
    activation_id, see :mod:`dmoe.server.activations`).
    """

    inputs: tuple[torch.Tensor, ...]
    future: TaskFuture
    rows: int
    activation_id: ActivationKey | None = None
    seq: int = field(default_factory=lambda: next(_sequence))
    created: float = field(default_factory=time.monotonic)


class TaskPool:
    """Requests waiting for one function (an expert's forward or backward), oldest first.

    Pools are created by a :class:`~dmoe.server.runtime.Runtime`, the one owner of their queues: requests enter
    through :meth:`Runtime.submit <dmoe.server.runtime.Runtime.submit>` (from any thread) and leave in the batches
    it forms, or when their future is cancelled, under its lock.

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
        #: the queued tasks by their future (what a cancel names), oldest first
        self.tasks: OrderedDict[TaskFuture, Task] = OrderedDict()
        self.batches = 0
        self.rows = 0
        self.removed = False  # by Runtime.remove_pool: it takes no more tasks

    def __len__(self) -> int:
        return len(self.tasks)

    def oldest(self) -> Task:
        return next(iter(self.tasks.values()))

    def __repr__(self) -> str:
        return f"TaskPool({self.name!r}, queued={len(self.tasks)})"
