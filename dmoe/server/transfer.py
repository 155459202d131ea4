"""How a batch's tensors reach the compute device and come back: one object per compute worker.

On a CPU there is nothing to move: requests are joined into one batch and outputs handed back as they are. On a
GPU, plain copies by default; with ``--overlap-copies`` (:class:`CudaTransfers`), meant to keep a volunteer's card
from waiting on copies:

* a batch of host tensors is joined once into a pinned (page-locked) host buffer and copied to the device with
  ``non_blocking=True`` on the worker's own copy stream, so one worker's copies run beside another worker's kernels
  on the compute stream (a pageable copy would stage through a driver buffer and block the worker);
* outputs come back into pinned host tensors with non-blocking copies, and the worker waits once per batch (one
  event) instead of once per output tensor (``.cpu()`` synchronises every time).

On the H200 measured (benchmarks/README.md, "On a GPU") the plain copies were faster: staging every batch in
pinned memory cost more than the overlap saved, with one worker or several.

Compute itself stays on the device's current stream, as before: the experts' weights, optimizer state and kept
activations are shared by all workers, and one compute stream keeps their ordering what it was. Only tensors made
on a copy stream cross to the compute stream, and each is marked with ``record_stream`` so that the caching
allocator does not hand its memory out again while compute still reads it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dmoe.timing import Laps


class Transfers:
    """Moves a batch's inputs to ``device`` and its outputs to host memory (any device; plain copies)."""

    def __init__(self, device: torch.device):
        self.device = device

    def inputs(self, requests: Sequence[Sequence[torch.Tensor]], timer: Laps | None = None) -> list[torch.Tensor]:
        """The i-th tensors of all ``requests`` joined along their first (batch) dimension, on the device.
        ``timer``: charges the join to ``batch`` and the copies to ``to_device`` (``dmoe-server --profile``)."""
        joined = [join([request[i] for request in requests], self.device) for i in range(len(requests[0]))]
        if timer is not None:
            timer.lap("batch")
        moved = [x.to(self.device, non_blocking=True) for x in joined]
        if timer is not None:
            timer.lap("to_device")
        return moved

    def outputs(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``outputs`` detached and in host memory, complete when this returns."""
        return [y.detach().cpu() for y in outputs]


class CudaTransfers(Transfers):
    """Pinned staging, a copy stream of this worker's own and one wait per batch (see the module docstring)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.copy_stream = torch.cuda.Stream(device)
        self.done = torch.cuda.Event()

    def inputs(self, requests: Sequence[Sequence[torch.Tensor]], timer: Laps | None = None) -> list[torch.Tensor]:
        compute = torch.cuda.current_stream(self.device)
        parts = [[request[i] for request in requests] for i in range(len(requests[0]))]
        on_host = [all(part.device.type == "cpu" for part in group) for group in parts]
        # the one copy out of the decoded request buffers, into pinned memory the device can read asynchronously
        staged = [pinned_join(group) if host else None for group, host in zip(parts, on_host)]
        if timer is not None:
            timer.lap("batch")
        joined: list[torch.Tensor | None] = [None] * len(parts)
        with torch.cuda.stream(self.copy_stream):
            for i, host in enumerate(staged):
                if host is not None:
                    x = host.to(self.device, non_blocking=True)
                    x.record_stream(compute)  # made on the copy stream, read and freed on the compute stream
                    joined[i] = x
        if any(on_host):
            compute.wait_stream(self.copy_stream)  # kernels of this batch start once its copies are done
        for i, x in enumerate(joined):
            if x is None:  # some parts kept on the device (rare: kept inputs batched with fresh ones)
                joined[i] = join(parts[i], self.device)  # on the compute stream, as everything it reads was made
        if timer is not None:
            timer.lap("to_device")
        return joined  # type: ignore[return-value]

    def outputs(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        host = []
        for y in outputs:
            y = y.detach()
            if y.device.type == "cpu":
                host.append(y)
                continue
            pinned = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
            pinned.copy_(y, non_blocking=True)
            host.append(pinned)
        self.done.record(torch.cuda.current_stream(self.device))
        self.done.synchronize()  # one wait for the whole batch; the caller reads the host tensors next
        return host


def join(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``parts`` concatenated along their first dimension: where they all are when they share a device (a CPU
    batch; a host batch copied once after), else each moved to ``device`` first (kept inputs beside fresh ones)."""
    if len(parts) == 1:
        return parts[0]
    if all(part.device == parts[0].device for part in parts):
        return torch.cat(list(parts))
    return torch.cat([part.to(device, non_blocking=True) for part in parts])


def pinned_join(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` (host tensors, equal trailing shapes) concatenated into one new pinned host tensor: the one copy
    out of the decoded request buffers. The host allocator caches pinned blocks and does not reuse one before the
    device copies that read it have finished."""
    first = parts[0]
    rows = sum(part.shape[0] for part in parts)
    out = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    if len(parts) == 1:
        out.copy_(first)
    else:
        torch.cat(list(parts), out=out)
    return out


def make_transfers(device: torch.device, overlap: bool = False) -> Transfers:
    """The transfers for one compute worker on ``device``: plain copies, or with ``overlap`` on a GPU pinned staging
    on a copy stream (slower than plain copies on the H200 measured: benchmarks/README.md, "On a GPU")."""
    if device.type == "cuda" and overlap:
        return CudaTransfers(device)
    return Transfers(device)
