"""``Runtime``: the one thread per server that runs every expert's batches on the device, oldest request first."""
from __future__ import annotations

import contextlib
import heapq
import logging
import threading
import time
from typing import Callable, Sequence

import torch

from dmoe.server.task_pool import ProcessFn, Task, TaskPool

BatchObserver = Callable[[TaskPool, Sequence[Task], float, float, "BaseException | None"], None]

logger = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Runtime:
    """Takes the pool whose oldest task is oldest, joins its queued tasks into one batch, runs it, answers each.

    One thread runs all compute, so an expert's forward and backward never race on its weights and the device is
    never oversubscribed; torch releases the GIL while it computes, so the gRPC loop keeps receiving meanwhile.
    A batch that raises is run again one task at a time, so only the task that raises fails; the runtime carries
    on with the next batch.

    Args:
        device: where experts run (their modules must already be there); inputs are moved there with one copy.
        autocast: ``'bf16'`` or ``'fp16'`` to run under ``torch.autocast``; None for full precision.
    """

    def __init__(self, device: str | torch.device = "cpu", autocast: str | None = None):
        if autocast is not None and autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be one of {', '.join(AUTOCAST_DTYPES)} or None, got {autocast!r}")
        self.device = torch.device(device)
        self.autocast = autocast
        self.pools: list[TaskPool] = []
        self._cond = threading.Condition()
        # (sequence number of the pool's oldest task, pool) for every non-empty pool
        self._ready: list[tuple[int, TaskPool]] = []
        self._closed = False
        #: held while a batch runs: whoever holds it (a checkpoint snapshot) sees no optimizer step half done
        self.compute_lock = threading.Lock()
        #: called after every batch as ``on_batch(pool, tasks, started, seconds, error)`` (metrics); None: nothing
        self.on_batch: BatchObserver | None = None
        self._thread = threading.Thread(target=self._serve, name="dmoe-runtime", daemon=True)

    def create_pool(self, name: str, process: ProcessFn, max_batch_size: int, keyed: bool = False) -> TaskPool:
        pool = TaskPool(self, name, process, max_batch_size, keyed)
        self.pools.append(pool)
        return pool

    def start(self) -> "Runtime":
        self._thread.start()
        return self

    def enqueue(self, pool: TaskPool, task: Task) -> None:
        with self._cond:
            if self._closed:
                task.future.set_exception(RuntimeError("the server is shutting down"))
                return
            pool.tasks.append(task)
            if len(pool.tasks) == 1:
                heapq.heappush(self._ready, (task.seq, pool))
                self._cond.notify()

    def _next_batch(self) -> tuple[TaskPool, list[Task]] | None:
        """Blocks until there is work (or the runtime closes: then None)."""
        with self._cond:
            while True:
                while not self._ready and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return None
                _, pool = heapq.heappop(self._ready)
                batch: list[Task] = []
                rows = 0
                while pool.tasks and (not batch or rows + pool.tasks[0].rows <= pool.max_batch_size):
                    task = pool.tasks.popleft()
                    if task.future.set_running_or_notify_cancel():  # False: the caller gave up already
                        batch.append(task)
                        rows += task.rows
                if pool.tasks:
                    heapq.heappush(self._ready, (pool.tasks[0].seq, pool))
                if batch:
                    return pool, batch

    def _serve(self) -> None:
        while (work := self._next_batch()) is not None:
            with self.compute_lock:
                self._run(*work)

    def _run(self, pool: TaskPool, batch: list[Task]) -> None:
        started = time.monotonic()
        try:
            outputs = self._compute(pool, batch)
        except Exception as error:
            self._observe(pool, batch, started, error)
            if len(batch) > 1:
                # one caller's bad request must not fail the others it was batched with: each runs alone again,
                # and only the culprit fails
                logger.warning("%s failed on a batch of %d tasks (%r): running each alone", pool.name, len(batch),
                               error)
                for task in batch:
                    self._run(pool, [task])
                return
            logger.warning("%s failed on a task: %r", pool.name, error)
            batch[0].future.set_exception(error)
            return
        self._observe(pool, batch, started, None)
        sizes = [task.rows for task in batch]
        pieces = [torch.split(y, sizes) if len(batch) > 1 else (y,) for y in outputs]
        for i, task in enumerate(batch):
            task.future.set_result([parts[i] for parts in pieces])

    def _observe(self, pool: TaskPool, batch: Sequence[Task], started: float, error: BaseException | None) -> None:
        if self.on_batch is not None:
            try:
                self.on_batch(pool, batch, started, time.monotonic() - started, error)
            except Exception:  # noqa: BLE001 - a broken observer must not fail the callers' requests
                logger.exception("batch observer failed")

    def _compute(self, pool: TaskPool, batch: Sequence[Task]) -> list[torch.Tensor]:
        first = batch[0].inputs
        if len(batch) == 1:
            inputs = [x.to(self.device, non_blocking=True) for x in first]
        else:  # tasks may hold tensors on the device already (inputs the server kept): move each, then join
            inputs = [torch.cat([task.inputs[i].to(self.device, non_blocking=True) for task in batch])
                      for i in range(len(first))]
        autocast = (torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[self.autocast])
                    if self.autocast else contextlib.nullcontext())
        with autocast:
            if pool.keyed:
                outputs = pool.process(*inputs, segments=[(task.key, task.rows) for task in batch])
            else:
                outputs = pool.process(*inputs)
        rows = sum(task.rows for task in batch)
        outputs = [y.detach().cpu() for y in outputs]
        for i, y in enumerate(outputs):
            if y.dim() == 0 or y.shape[0] != rows:
                raise RuntimeError(f"output {i} has shape {list(y.shape)}, expected a batch of {rows} rows first")
        pool.batches += 1
        pool.rows += rows
        return outputs

    def close(self) -> None:
        """Stops the thread after its current batch; queued tasks fail with 'shutting down'."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            leftovers = [task for _, pool in self._ready for task in pool.tasks]
            for _, pool in self._ready:
                pool.tasks.clear()
            self._ready.clear()
        if self._thread.is_alive():
            self._thread.join()
        for task in leftovers:
            if task.future.set_running_or_notify_cancel():
                task.future.set_exception(RuntimeError("the server is shutting down"))

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
