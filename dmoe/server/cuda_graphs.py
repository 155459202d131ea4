"""CUDA graphs of one expert's forward and of its whole training step, per batch size (``dmoe-server --cuda-graphs``).

Why: at the sizes a DMoE layer sends (tens to hundreds of rows of h=1024), an expert's work on a GPU is bound by
the host launching kernels, not by the kernels. On an H200 a server process spent ~1.4 ms per batch in its forward
or its backward and optimizer step, where the in-process layer spends ~0.55 ms (benchmarks/README.md, "On a GPU").
A graph replays a recorded sequence of kernels with one launch: the forward's, or the training step's (the forward
recomputed, the backward, the check that the gradients are finite and the optimizer step).

How:

* Rows are padded up to a bucket (a power of two, at least :data:`MIN_ROWS`): a graph's shapes are fixed. Rows
  are independent for every expert a server hosts (the runtime already joins different callers' requests into one
  batch; an expert mixing rows, such as one with BatchNorm, is not served correctly either way), so padding rows
  change nothing for the real ones. The padding repeats the batch's first row, with output gradients of zero in the
  training step, so it adds nothing to the parameters' gradients, and a row that overflows inside the expert
  spoils only the batch that holds it, as it would eagerly (rows of earlier batches left in the padding would
  keep spoiling later ones: review 45).
* The training step's recomputed forward draws new random numbers: an expert with dropout gets gradients for
  another mask than the one its forward answered with, as the eager path does whenever it recomputes.
* A bucket is captured once it has run :data:`EAGER_RUNS` times eagerly: sizes seen once cost no graph's memory,
  and the eager runs warm up what a capture must not do (cuBLAS's set-up, the optimizer's state).
* The training step recomputes the forward inside its graph: a forward's autograd graph cannot be kept across
  replays (its buffers are the graph's), so forwards keep only their inputs and the activation cache holds those.
* The optimizer must be fused Adam (the server's default): it takes the finiteness check's flag (``found_inf``,
  as AMP's gradient scaler gives it) and skips a step on the device, without waiting for the host, as the eager
  path's check does. Other optimizers, and an LR scheduler (a graph keeps the learning rate it was captured with),
  leave the training step eager; then only forwards that no backward follows are graphed (the others keep their
  autograd graph for the eager backward, as without graphs). What a step's graph records,
  :func:`training_step`, also runs eagerly on any device: the CPU tests check it against the eager path.
* One memory pool per expert: its graphs never run at once (an expert's batches run one at a time) and each
  replay's outputs are copied to the host before the next, so each graph may reuse what another freed.
* A server runs graphs with one compute worker per process (``--workers 1``, the default on a GPU; more processes
  with ``--processes``): a capture must not meet another thread's device synchronisation, which breaks it in any
  capture mode.
* A capture that fails (an expert doing what a graph cannot record, such as reading a value on the host) is logged,
  and turns graphs off for every expert of the process (:class:`GraphSwitch`): on torch before 2.12 a failed capture
  leaves the allocator believing a capture is still under way. The current stream is restored either way.
"""
from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch
from torch import nn

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: the smallest bucket: requests of a few rows share one graph
MIN_ROWS = 16
#: eager runs of a bucket before it is captured
EAGER_RUNS = 2


def bucket_rows(rows: int) -> int:
    """The rows a batch of ``rows`` is padded to: the next power of two, at least :data:`MIN_ROWS`."""
    return max(MIN_ROWS, 1 << max(rows - 1, 0).bit_length())


def training_step_support(optimizer: torch.optim.Optimizer | None, scheduler: object = None) -> str | None:
    """None when a training step with ``optimizer`` can be captured; else why it runs eagerly."""
    if scheduler is not None:
        return "an LR scheduler changes the learning rate a graph would keep"
    if optimizer is None:
        return None
    if type(optimizer) is not torch.optim.Adam or not all(group.get("fused") for group in optimizer.param_groups):
        return f"the optimizer is {type(optimizer).__name__}, not fused Adam"
    return None


class GraphSwitch:
    """Whether the experts of one server process may still capture graphs: one failed capture turns them all off.
    Owned by the server, shared by its experts' :class:`ExpertGraphs`."""

    def __init__(self) -> None:
        self.off: str | None = None

    def turn_off(self, why: str) -> None:
        if self.off is None:
            logger.warning("CUDA graphs are off for this server process from now on, its experts compute eagerly: %s",
                           why)
        self.off = why


@dataclass
class _Captured:
    """One captured graph: the buffers it reads (filled before each replay) and the ones it writes."""

    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    grad_outputs: list[torch.Tensor]
    found_inf: torch.Tensor | None = None


class ExpertGraphs:
    """The graphs of one expert: its forward without autograd and its training step, one of each per bucket.

    Args:
        module: the expert, with its parameters on a CUDA device.
        optimizer: its optimizer (None: nothing to train); see :func:`training_step_support`.
        input_shapes: the shape of each input without the batch dimension (the expert's schema).
        input_dtypes: the dtype of each input (the expert's schema).
        output_dtypes: the dtype each output is answered in (outputs under autocast are cast back to them).
        clip_grad_norm: clip the gradients' norm to this before each step, inside the graph.
        max_rows: batches of more rows run eagerly.
        scheduler: the expert's LR scheduler (with one, the training step runs eagerly).
        switch: the process's :class:`GraphSwitch` (shared by the server's experts); None: one of its own.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, input_shapes: Sequence[tuple],
                 input_dtypes: Sequence[torch.dtype], output_dtypes: Sequence[torch.dtype], *,
                 clip_grad_norm: float | None = None, max_rows: int = 4096, scheduler: object = None, name: str = "",
                 switch: GraphSwitch | None = None):
        first = next(module.parameters(), None)
        if first is None or first.device.type != "cuda":
            raise ValueError("CUDA graphs need an expert with parameters on a CUDA device")
        self.device = first.device
        self.module, self.optimizer, self.name = module, optimizer, name
        self.input_shapes, self.input_dtypes = [tuple(s) for s in input_shapes], list(input_dtypes)
        self.output_dtypes = list(output_dtypes)
        self.clip_grad_norm, self.max_rows = clip_grad_norm, max_rows
        #: why the training step runs eagerly (None: it is captured); the forward is captured regardless
        self.train_off: str | None = training_step_support(optimizer, scheduler)
        self.forward_off: str | None = None
        self.switch = switch if switch is not None else GraphSwitch()
        self._seen: Counter[tuple[str, int, torch.dtype | None]] = Counter()
        self._graphs: dict[tuple[str, int, torch.dtype | None], _Captured] = {}
        self._stream = torch.cuda.Stream(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        self.captures = self.replays = 0
        self.replays_by_kind: Counter[str] = Counter()  # "forward", "train": what dmoe_cuda_graph_replays counts

    @property
    def trains(self) -> bool:
        """Whether training steps may still run as graphs (then forwards keep no autograd graph for them)."""
        return self.train_off is None and self.switch.off is None

    def reset(self) -> None:
        """Drops every graph: the optimizer's state was replaced (``load_state_dict``), and the graphs read the old
        tensors. Buckets are captured again after their eager runs."""
        self._graphs.clear()
        self._seen.clear()
        self._pool = torch.cuda.graph_pool_handle()

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        """The outputs for ``inputs`` by a graph's replay, or None: run it eagerly (bucket not captured yet)."""
        if self.forward_off is not None or self.switch.off is not None:
            return None
        captured = self._ready("forward", inputs, self._capture_forward)
        if captured is None:
            return None
        rows = inputs[0].shape[0]
        with torch.no_grad():
            for buffer, x in zip(captured.inputs, inputs):
                buffer[:rows].copy_(x)
        captured.graph.replay()
        self.replays += 1
        self.replays_by_kind["forward"] += 1
        return tuple(y[:rows] for y in captured.outputs)

    def train_step(self, inputs: Sequence[torch.Tensor],
                   grad_outputs: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], bool] | None:
        """(input gradients, whether the optimizer stepped) by a graph's replay, or None: run it eagerly. The step
        is skipped, on the device, when a parameter's gradient is not finite."""
        if self.train_off is not None or self.switch.off is not None:
            return None
        captured = self._ready("train", inputs, self._capture_train)
        if captured is None:
            return None
        rows = inputs[0].shape[0]
        for buffer, x in zip(captured.inputs, inputs):
            fill_padded(buffer, x)
        for buffer, g in zip(captured.grad_outputs, grad_outputs):
            fill_padded(buffer, g, zeros=True)  # the padding's gradients: nothing for the parameters
        captured.graph.replay()
        self.replays += 1
        self.replays_by_kind["train"] += 1
        stepped = captured.found_inf is None or not bool(captured.found_inf.item())
        return tuple(g[:rows] for g in captured.outputs), stepped

    def _ready(self, kind: str, inputs: Sequence[torch.Tensor],
               capture: Callable[[int], _Captured]) -> _Captured | None:
        rows = inputs[0].shape[0]
        if rows == 0 or rows > self.max_rows or any(x.device != self.device for x in inputs):
            return None
        key = (kind, bucket_rows(rows), _autocast_dtype())
        captured = self._graphs.get(key)
        if captured is not None:
            return captured
        self._seen[key] += 1
        if self._seen[key] <= EAGER_RUNS:
            return None
        try:
            captured = capture(key[1])
        except NotReady as why:  # tried again after as many eager runs
            logger.info("%s: its %s is not captured yet: %s", self.name, kind, why)
            self._seen[key] = 0
            return None
        except Exception as exc:  # noqa: BLE001 - the experts still compute, eagerly
            self.switch.turn_off(f"capturing the {kind} of {self.name} failed: {exc!r}")
            return None
        self._graphs[key] = captured
        self.captures += 1
        return captured

    def _static_inputs(self, rows: int) -> list[torch.Tensor]:
        return [torch.zeros((rows, *shape), dtype=dtype, device=self.device)
                for shape, dtype in zip(self.input_shapes, self.input_dtypes)]

    def _warm_up(self, run: Callable[[], T]) -> T:
        """``run`` once on this expert's side stream, where it will be captured: lazy set-up such as cuBLAS's
        workspace for that stream must not happen during capture."""
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            result = run()
        current.wait_stream(self._stream)
        return result

    def _capture(self, record: Callable[[], list[torch.Tensor]]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
        """Records ``record`` on this expert's side stream (after :meth:`_warm_up`)."""
        current = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: only this thread's unsafe calls (none, if the expert records cleanly) break the capture
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                outputs = record()
        finally:
            # a capture that CUDA refused raises from torch's exit before it restores the stream: the worker would
            # compute everything after on the side stream
            torch.cuda.set_stream(current)
        return graph, outputs

    def _outputs_as_answered(self, outputs: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return [y.to(dtype) for y, dtype in zip(outputs, self.output_dtypes)]

    def _capture_forward(self, rows: int) -> _Captured:
        inputs = self._static_inputs(rows)

        def run() -> list[torch.Tensor]:
            with torch.no_grad(), _uncached_autocast():
                return self._outputs_as_answered(self.module(*inputs))

        self._warm_up(run)
        graph, outputs = self._capture(run)
        return _Captured(graph, inputs, outputs, [])

    def _capture_train(self, rows: int) -> _Captured:
        params = [p for p in self.module.parameters() if p.requires_grad]
        inputs = self._static_inputs(rows)
        grad_outputs = [torch.zeros((rows, *shape), dtype=dtype, device=self.device)
                        for shape, dtype in self._output_shapes(inputs)]
        found_inf = finiteness_flag(self.device) if self.optimizer is not None else None

        def warm_up() -> list[torch.Tensor | None]:
            with _uncached_autocast():
                return gradients(self.module, params, inputs, grad_outputs)[1]

        stepped = [p for p, g in zip(params, self._warm_up(warm_up)) if g is not None]
        if self.optimizer is not None and not all(self.optimizer.state.get(p) for p in stepped):
            # made inside a capture, the state would be zeroed again by every replay: the eager steps make it first
            # (none yet, where every step so far was skipped for non-finite gradients)
            raise NotReady("the optimizer has no state yet for parameters it would step")

        def record() -> list[torch.Tensor]:
            return training_step(self.module, self.optimizer, inputs, grad_outputs, found_inf, self.clip_grad_norm)

        try:
            graph, outputs = self._capture(record)
        finally:
            for p in params:
                p.grad = None  # the graph's own gradients; an eager step must start from none
        return _Captured(graph, inputs, outputs, grad_outputs, found_inf)

    def _output_shapes(self, inputs: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        with torch.no_grad(), _uncached_autocast():
            outputs = self.module(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return [(tuple(y.shape[1:]), dtype) for y, dtype in zip(outputs, self.output_dtypes)]


class NotReady(Exception):
    """A capture cannot be made yet, and may be later (after more eager runs)."""


def fill_padded(buffer: torch.Tensor, rows: torch.Tensor, zeros: bool = False) -> None:
    """``rows`` into the first rows of ``buffer`` (a graph's static input), and the rest of it filled with zeros
    (``zeros``: output gradients) or with ``rows``' first row, whose values the batch computes anyway."""
    count = rows.shape[0]
    with torch.no_grad():
        buffer[:count].copy_(rows)
        if count < buffer.shape[0]:
            if zeros:
                buffer[count:].zero_()
            else:
                buffer[count:].copy_(rows[:1].expand_as(buffer[count:]))


def finiteness_flag(device: torch.device | str) -> torch.Tensor:
    """The flag :func:`training_step` sets when a gradient is not finite: 0-dim, as fused Adam subtracts it from
    each parameter's 0-dim step count (a 1-element flag of shape [1] made every capture of a step fail)."""
    return torch.zeros((), device=device)


def gradients(module: nn.Module, params: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
              grad_outputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """(input gradients, parameter gradients) of ``module`` at ``inputs`` for ``grad_outputs``, by its forward
    with autograd and ``torch.autograd.grad``: nothing is accumulated into ``.grad``. Inputs that are not floating
    point get zeros; parameters that got no gradient, None."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    with torch.enable_grad():
        outputs = module(*leaves)
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    pairs = [(y, g) for y, g in zip(outputs, grad_outputs) if y.requires_grad]
    wrt = [x for x in leaves if x.requires_grad] + list(params)
    grads = (list(torch.autograd.grad([y for y, _ in pairs], wrt, [g.to(y.dtype) for y, g in pairs],
                                      allow_unused=True)) if pairs and wrt else [None] * len(wrt))
    found = iter(grads)
    input_grads = [next(found) if x.requires_grad else None for x in leaves]
    return ([g if g is not None else torch.zeros_like(x) for g, x in zip(input_grads, leaves)], list(found))


def training_step(module: nn.Module, optimizer: torch.optim.Optimizer | None, inputs: Sequence[torch.Tensor],
                  grad_outputs: Sequence[torch.Tensor], found_inf: torch.Tensor | None,
                  clip_grad_norm: float | None = None) -> list[torch.Tensor]:
    """What a training step's graph records: the forward again, the backward, then (with an optimizer) the check
    that every parameter's gradient is finite into ``found_inf`` (a 0-dim float tensor), clipping, and one step of
    ``optimizer`` (fused Adam) that leaves the weights and its state alone where ``found_inf`` is set. Returns the
    input gradients (in the inputs' dtypes). Nothing here waits for the device, so it can be recorded; it also runs
    eagerly on any device, which is how the CPU tests check it against the eager path's
    :meth:`~dmoe.server.backend.ExpertBackend.backward`. Leaves ``.grad`` set to this step's gradients."""
    params = [p for p in module.parameters() if p.requires_grad]
    with _uncached_autocast():
        input_grads, param_grads = gradients(module, params, inputs, grad_outputs)
    if optimizer is not None:
        assert found_inf is not None
        present = [(p, g) for p, g in zip(params, param_grads) if g is not None]
        found_inf.zero_()
        if present:  # AMP's fused check, with a scale of 1 (each gradient rewritten as itself)
            torch._amp_foreach_non_finite_check_and_unscale_([g for _, g in present], found_inf,
                                                             torch.ones((), device=found_inf.device))
        for p, g in present:
            p.grad = g
        if clip_grad_norm is not None:
            nn.utils.clip_grad_norm_([p for p, _ in present], clip_grad_norm, foreach=True)
        step_unless_found_inf(optimizer, found_inf)
    return [g.to(x.dtype) for g, x in zip(input_grads, inputs)]


def step_unless_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` given ``found_inf``, as AMP's gradient scaler gives it to fused optimizers: where it is
    set, the step leaves the weights and the state (its step count too) as they were. Capturing it asks the param
    groups to be ``capturable``; fused Adam computes alike either way, and outside a capture (or on a CPU, where
    capturable is refused) the flag would only make torch warn, so it is set for a capture alone."""
    capturing = found_inf.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    groups = optimizer.param_groups
    before = [group.get("capturable", False) for group in groups]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # read by Adam.step, as GradScaler does
    try:
        if capturing:
            for group in groups:
                group["capturable"] = True
        optimizer.step()
    finally:
        if capturing:
            for group, flag in zip(groups, before):
                group["capturable"] = flag
        del optimizer.found_inf  # type: ignore[attr-defined]


def _autocast_dtype() -> torch.dtype | None:
    """The dtype autocast computes in here (part of a graph's key), None when it is off."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def _uncached_autocast() -> contextlib.AbstractContextManager:
    """Autocast as it is, without its cache of cast weights: a cast cached outside a graph would be read by the
    graph's replays after the weights changed, and one cached during capture would outlive it."""
    dtype = _autocast_dtype()
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=dtype, cache_enabled=False)
