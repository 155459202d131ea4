"""``Runtime``: the threads of a server that run every expert's batches on the device, oldest request first."""
from __future__ import annotations

import contextlib
import heapq
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Hashable, Iterator, Sequence

import torch

from dmoe.server.activations import ActivationKey
from dmoe.server.profile import StageClock
from dmoe.server.task_pool import ProcessFn, Task, TaskFuture, TaskPool
from dmoe.server.transfer import Transfers, make_transfers

BatchObserver = Callable[[TaskPool, Sequence[Task], float, float, "BaseException | None"], None]

logger = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: what torch's CPU allocator says when an allocation fails: it raises a plain RuntimeError ("DefaultCPUAllocator:
#: can't allocate memory: you tried to allocate ... bytes"), never torch.OutOfMemoryError
CPU_OUT_OF_MEMORY = "can't allocate memory"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure: a device's ``torch.OutOfMemoryError``, Python's ``MemoryError``, or
    the RuntimeError of torch's CPU allocator (review 66: a CPU server ran out of memory without freeing its kept
    activations, and answered INTERNAL, not RESOURCE_EXHAUSTED)."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and CPU_OUT_OF_MEMORY in str(error))


class AfterCompute(Exception):
    """A batch failed after its computation ran: a backward's optimizer step is already applied, so the batch is
    not run again (neither after freeing memory nor task by task)."""

    def __init__(self, cause: Exception):
        super().__init__(repr(cause))
        self.cause = cause


class PoolRemoved(RuntimeError):
    """A task submitted to a pool after :meth:`Runtime.remove_pool` (its expert is no longer served)."""


class Runtime:
    """Takes the pool whose oldest task is oldest, joins its queued tasks into one batch, runs it, answers each.

    ``workers`` threads run all compute. Pools of one ``group`` (an expert's forward and backward pools) never
    run at once, so an expert's forward and backward never race on its weights; torch releases the GIL while it
    computes, so the gRPC loop keeps receiving meanwhile. A batch that raises is run again one task at a time, so
    only the task that raises fails; the runtime carries on with the next batch. A batch that runs out of memory
    (:func:`is_out_of_memory`: ``torch.OutOfMemoryError`` on a GPU, the allocator's RuntimeError or a
    ``MemoryError`` on a CPU) first runs again whole, after ``on_out_of_memory`` freed what its owner can spare (the
    server's kept activations) and torch's cached blocks went back to the device.

    Why more than one worker on a CPU: one worker with every core as torch's intra-op threads spends its Python
    steps (module calls, autograd, optimizer bookkeeping) with the other cores idle, and each op waits for the
    slowest of its threads, so whenever the gRPC thread or a client on the same machine takes a core, the whole
    op stalls. Two workers with half the threads each interleave: one computes while the other runs Python or is
    preempted (benchmarks/README.md, "Figures behind design choices").

    Args:
        device: where experts run (their modules must already be there); inputs are moved there with one copy.
        autocast: ``'bf16'`` or ``'fp16'`` to run under ``torch.autocast``; None for full precision.
        workers: compute threads.
        threads_per_worker: torch intra-op threads each worker sets when it starts; None leaves torch's setting.
        overlap_copies: on a GPU, each worker copies through pinned memory on a copy stream of its own and waits
            once per batch (:mod:`dmoe.server.transfer`); False (default, faster where measured): plain copies.
            No effect on a CPU.
        stages: where to add the time of each batch's stages (batch, to_device, compute, to_host; see
            :mod:`dmoe.server.profile`); None: no timing.
    """

    def __init__(self, device: str | torch.device = "cpu", autocast: str | None = None, *, workers: int = 1,
                 threads_per_worker: int | None = None, overlap_copies: bool = False,
                 stages: StageClock | None = None):
        if autocast is not None and autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be one of {', '.join(AUTOCAST_DTYPES)} or None, got {autocast!r}")
        if workers < 1 or (threads_per_worker is not None and threads_per_worker < 1):
            raise ValueError(f"workers and threads_per_worker must be positive, got {workers}, {threads_per_worker}")
        self.device = torch.device(device)
        self.autocast = autocast
        self.threads_per_worker = threads_per_worker
        self.stages = stages
        self.pools: list[TaskPool] = []
        self._cond = threading.Condition()
        # (sequence number of the pool's oldest task, pool) for every non-empty pool
        self._ready: list[tuple[int, TaskPool]] = []
        self._busy: set[Hashable] = set()  # groups a worker is running a batch of
        self._running = 0  # batches running now
        self._pauses = 0  # callers inside paused(): no batch starts meanwhile
        self._closed = False
        self._started = threading.Semaphore(0)  # released by each worker once its torch threads are set
        #: called after every batch as ``on_batch(pool, tasks, started, seconds, error)`` (metrics); None: nothing
        self.on_batch: BatchObserver | None = None
        #: called when a batch ran out of device memory, before it runs again; frees what the owner can spare and
        #: returns the bytes freed (the server drops its kept activations); None: nothing to free
        self.on_out_of_memory: Callable[[], int] | None = None
        self.out_of_memory = 0  # batches that ran out of device memory
        self._threads = [threading.Thread(target=self._serve, name=f"dmoe-runtime-{i}", daemon=True,
                                          args=(make_transfers(self.device, overlap_copies),))  # its copy stream
                         for i in range(workers)]

    @property
    def workers(self) -> int:
        return len(self._threads)

    def create_pool(self, name: str, process: ProcessFn, max_batch_size: int, segmented: bool = False,
                    group: Hashable = None) -> TaskPool:
        """A new pool; pools sharing a ``group`` (default: each pool its own) never run concurrently."""
        pool = TaskPool(name, process, max_batch_size, segmented, group)
        with self._cond:
            self.pools.append(pool)
        return pool

    def remove_pool(self, pool: TaskPool) -> None:
        """Drops ``pool`` (its expert is no longer served), from any thread: the runtime keeps no reference to it
        once its queued tasks ran (they still do, as they would have; a batch of it running now finishes), so its
        ``process`` (a backend's bound method: module and optimizer state) can be freed. A task submitted to it
        later fails with :class:`PoolRemoved`."""
        with self._cond:
            pool.removed = True
            with contextlib.suppress(ValueError):  # removed twice
                self.pools.remove(pool)

    def start(self) -> "Runtime":
        """Starts the workers; returns once each has set its torch threads (see :meth:`_serve`)."""
        threads = torch.get_num_threads() if self.threads_per_worker is not None else None
        for thread in self._threads:
            thread.start()
        for _ in self._threads:
            self._started.acquire()
        if threads is not None:
            # torch.set_num_threads sets the calling thread's count and the default of threads that have not used
            # torch yet: put the default back, so that this process's other threads keep what they had
            torch.set_num_threads(threads)
        return self

    def submit(self, pool: TaskPool, *inputs: torch.Tensor,
               activation_id: ActivationKey | None = None) -> "Future[list[torch.Tensor]]":
        """Queues one request for ``pool`` (all tensors share the first, batch dimension), from any thread; the
        future gets its outputs (cancelling it before a worker takes it drops the task from the pool at once).
        ``activation_id``: what its kept forward is named by, if any."""
        if not inputs:
            raise ValueError("a task needs at least one tensor")
        task = Task(tuple(inputs), TaskFuture(self), rows=inputs[0].shape[0], activation_id=activation_id)
        with self._cond:
            if self._closed:
                task.future.set_exception(RuntimeError("the server is shutting down"))
                return task.future
            if pool.removed:
                task.future.set_exception(PoolRemoved(f"{pool.name} was removed from this server"))
                return task.future
            pool.tasks[task.future] = task
            task.future.pool = pool  # (never the task: a future must not keep inputs alive that left their pool)
            if len(pool.tasks) == 1:
                heapq.heappush(self._ready, (task.seq, pool))
                self._cond.notify()
        return task.future

    def dequeue(self, pool: TaskPool, future: TaskFuture) -> None:
        """Takes the task of a future being cancelled out of ``pool``, if it still waits there (called by
        :meth:`TaskFuture.cancel`); the pool's place among the ready ones follows its new oldest task."""
        with self._cond:
            task = pool.tasks.pop(future, None)
            if task is None:  # taken by a worker already, or failed by close()
                return
            future.pool = None
            if pool.tasks and task.seq > pool.oldest().seq:
                return  # not its oldest: its place stays
            self._ready = [entry for entry in self._ready if entry[1] is not pool]
            if pool.tasks:
                self._ready.append((pool.oldest().seq, pool))
            heapq.heapify(self._ready)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Waits for the running batches to finish and starts no other until the block exits: whoever is inside
        (a checkpoint snapshot) sees no optimizer step half done."""
        with self._cond:
            self._pauses += 1
            while self._running:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._pauses -= 1
                self._cond.notify_all()

    def _next_batch(self) -> tuple[TaskPool, list[Task]] | None:
        """Blocks until there is work this worker may run (or the runtime closes: then None); marks its group
        busy."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                work = None if self._pauses else self._take()
                if work is not None:
                    self._busy.add(work[0].group)
                    self._running += 1
                    return work
                self._cond.wait()

    def _take(self) -> tuple[TaskPool, list[Task]] | None:
        """The oldest pool whose group is idle, with a batch of its tasks (None: nothing runnable now)."""
        skipped = []
        try:
            while self._ready:
                seq, pool = heapq.heappop(self._ready)
                if pool.group in self._busy:
                    skipped.append((seq, pool))
                    continue
                batch: list[Task] = []
                rows = 0
                while pool.tasks and (not batch or rows + pool.oldest().rows <= pool.max_batch_size):
                    task = pool.tasks.popitem(last=False)[1]
                    task.future.pool = None
                    if task.future.set_running_or_notify_cancel():  # False: the caller gave up already
                        batch.append(task)
                        rows += task.rows
                if pool.tasks:
                    heapq.heappush(self._ready, (pool.oldest().seq, pool))
                if batch:
                    return pool, batch
            return None
        finally:
            for entry in skipped:
                heapq.heappush(self._ready, entry)

    def _serve(self, transfers: Transfers) -> None:
        try:
            if self.threads_per_worker is not None:
                torch.get_num_threads()  # torch's lazy per-thread set-up first, or it would undo the next line later
                torch.set_num_threads(self.threads_per_worker)  # this thread's OpenMP team and MKL threads
        finally:
            self._started.release()
        while (work := self._next_batch()) is not None:
            pool = work[0]
            try:
                self._run(*work, transfers)
            finally:
                with self._cond:
                    self._busy.discard(pool.group)
                    self._running -= 1
                    self._cond.notify_all()  # workers waiting for this group, and paused()
            work = pool = None  # waiting for the next batch, keep no pool alive (a removed one frees its backend)

    def _run(self, pool: TaskPool, batch: list[Task], transfers: Transfers, freed: bool = False) -> None:
        """Runs ``batch`` and answers its tasks; ``freed``: memory was already freed for it once."""
        started = time.monotonic()
        try:
            outputs = self._compute(pool, batch, transfers)
        except Exception as exc:
            # without its traceback, whose frames hold the failed computation's tensors: they are freed as this
            # clause ends, before anything runs again
            error = exc.with_traceback(None)
        else:
            self._observe(pool, batch, started, None)
            sizes = [task.rows for task in batch]
            pieces = [torch.split(y, sizes) if len(batch) > 1 else (y,) for y in outputs]
            for i, task in enumerate(batch):
                task.future.set_result([parts[i] for parts in pieces])
            return
        self._observe(pool, batch, started, error.cause if isinstance(error, AfterCompute) else error)
        if isinstance(error, AfterCompute):
            # the computation ran (a backward's optimizer step is applied): running it again would apply it twice
            logger.warning("%s failed after computing a batch of %d tasks: %r", pool.name, len(batch), error.cause)
            for task in batch:
                task.future.set_exception(error.cause)
        elif is_out_of_memory(error) and not freed:
            with self._cond:  # workers may run out at once
                self.out_of_memory += 1
            released = self._free_memory()
            logger.warning("%s ran out of memory on %s with %d rows: freed %.3g MiB of kept activations, running "
                           "it again", pool.name, self.device, sum(task.rows for task in batch), released / 2**20)
            self._run(pool, batch, transfers, freed=True)
        elif len(batch) > 1:
            # one caller's bad request must not fail the others it was batched with: each runs alone again,
            # and only the culprit fails
            logger.warning("%s failed on a batch of %d tasks (%r): running each alone", pool.name, len(batch), error)
            for task in batch:
                self._run(pool, [task], transfers, freed)
        else:
            logger.warning("%s failed on a task: %r", pool.name, error)
            batch[0].future.set_exception(error)

    def _free_memory(self) -> int:
        """The owner's spare memory (kept activations), then torch's cached blocks, back to the device."""
        released = 0
        if self.on_out_of_memory is not None:
            try:
                released = self.on_out_of_memory()
            except Exception:  # noqa: BLE001 - the batch still runs again
                logger.exception("freeing memory after an out-of-memory error failed")
        if self.device.type == "cuda":
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - the batch still runs again (torch < 2.12 refuses after a failed capture)
                logger.exception("giving torch's cached device memory back failed")
        return released

    def _observe(self, pool: TaskPool, batch: Sequence[Task], started: float, error: BaseException | None) -> None:
        if self.on_batch is not None:
            try:
                self.on_batch(pool, batch, started, time.monotonic() - started, error)
            except Exception:  # noqa: BLE001 - a broken observer must not fail the callers' requests
                logger.exception("batch observer failed")

    def _compute(self, pool: TaskPool, batch: Sequence[Task], transfers: Transfers) -> list[torch.Tensor]:
        timer = self.stages.laps(self.device) if self.stages is not None else None
        inputs = transfers.inputs([task.inputs for task in batch], timer)
        autocast = (torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[self.autocast])
                    if self.autocast else contextlib.nullcontext())
        with autocast:
            if pool.segmented:
                outputs = pool.process(*inputs, segments=[(task.activation_id, task.rows) for task in batch])
            else:
                outputs = pool.process(*inputs)
        rows = sum(task.rows for task in batch)
        try:
            if timer is not None:  # it waits for the device: an error there comes after the computation
                timer.lap("compute")
            outputs = self._copy_back(outputs, transfers)
            if timer is not None:
                timer.lap("to_host")
            for i, y in enumerate(outputs):
                if y.dim() == 0 or y.shape[0] != rows:
                    raise RuntimeError(f"output {i} has shape {list(y.shape)}, expected a batch of {rows} rows first")
        except Exception as exc:
            raise AfterCompute(exc.with_traceback(None)) from None
        pool.batches += 1
        pool.rows += rows
        return outputs

    def _copy_back(self, outputs: Sequence[torch.Tensor], transfers: Transfers) -> list[torch.Tensor]:
        """The outputs to the host; out of memory there, the copy alone runs again once memory is freed."""
        try:
            return transfers.outputs(outputs)
        except Exception as exc:  # noqa: BLE001 - re-raised unless out of memory
            if not is_out_of_memory(exc):
                raise
        # outside the except clause, whose traceback would hold the failed copy's tensors
        logger.warning("copying outputs back ran out of memory on %s: freed %.3g MiB of kept activations, copying "
                       "again", self.device, self._free_memory() / 2**20)
        return transfers.outputs(outputs)

    def close(self) -> None:
        """Stops the workers after their current batches; queued tasks fail with 'shutting down'."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            leftovers = [task for _, pool in self._ready for task in pool.tasks.values()]
            for task in leftovers:
                task.future.pool = None
            for _, pool in self._ready:
                pool.tasks.clear()
            self._ready.clear()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        for task in leftovers:
            if task.future.set_running_or_notify_cancel():
                task.future.set_exception(RuntimeError("the server is shutting down"))

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
