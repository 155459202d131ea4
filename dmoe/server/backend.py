"""``ExpertBackend``: one expert module with its optimizer, trained asynchronously by whoever calls backward."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from dmoe.server.activations import ActivationCache, ActivationKey, KeptForward, SavedBytes, parameter_versions
from dmoe.server.cuda_graphs import ExpertGraphs, GraphSwitch
from dmoe.server.optimizer_state import check_optimizer_state
from dmoe.wire.codec import DTYPES, dtype_name

logger = logging.getLogger(__name__)

#: (kept-forward key or None, rows) of every request in a batch, in order: see :mod:`dmoe.server.activations`
Segments = Sequence[tuple[ActivationKey | None, int]]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}

#: a setting that only this optimizer's param groups hold: tells which of :data:`OPTIMIZERS` saved a state
_OPTIMIZER_SIGNATURES = {"adam": "betas", "sgd": "momentum"}

#: settings of a restored optimizer that keep the value given now (``--lr``; the trainer's ``--weight-decay``), not
#: the saved one: the saved state carries them, and would otherwise silently undo a change made on restart
GIVEN_NOW = ("lr", "weight_decay")


def optimizer_name(optimizer: torch.optim.Optimizer | None) -> str | None:
    """The :data:`OPTIMIZERS` name of ``optimizer``'s class; None for None or another class."""
    return next((name for name, cls in OPTIMIZERS.items() if type(optimizer) is cls), None)


def saved_optimizer_name(state: dict[str, Any] | None) -> str | None:
    """Which of :data:`OPTIMIZERS` saved ``state`` (an ``optimizer.state_dict()``), None if it cannot be told."""
    groups = (state or {}).get("param_groups") or []
    found = [name for name, key in _OPTIMIZER_SIGNATURES.items()
             if groups and all(isinstance(g, dict) and key in g for g in groups)]
    return found[0] if len(found) == 1 else None


#: the most elements a CPU checks in one fused pass (:func:`all_finite`); more are summed, which only reads them
FUSED_CHECK_MAX_CPU_NUMEL = 1 << 20


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when no element of ``tensors`` (gradients) is NaN or infinite, with one host sync.

    Tensors of one device and dtype are checked in one fused call, the check AMP's gradient scaler makes every step,
    with a scale of 1, so that each element is rewritten as itself. That is one dispatch for all the tensors, where
    the sums below cost about a dozen small operations per step. Those operations dominated a small expert's
    backward on a CPU, and on a GPU each is a kernel launch. On a CPU, more than
    :data:`FUSED_CHECK_MAX_CPU_NUMEL` elements are summed instead, because summing only reads them. Past that size
    the fused pass, which also writes them, was 1.2x slower (8M gradients on the 2-core VM).
    """
    if not tensors:
        return True
    first = tensors[0]
    if (all(t.device == first.device and t.dtype == first.dtype for t in tensors) and first.is_floating_point()
            and (first.device.type != "cpu" or sum(t.numel() for t in tensors) <= FUSED_CHECK_MAX_CPU_NUMEL)):
        found = torch.zeros(1, device=first.device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found, torch.ones(1, device=first.device))
            return not found.item()
        except (NotImplementedError, RuntimeError):  # a device without the fused check: sum instead
            pass
    return _sums_finite(tensors)


def _sums_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """:func:`all_finite` in one read pass per tensor. A sum is NaN or infinite when any element is, and torch sums
    in parallel and vectorised: cheaper than the total norm, whose squares also overflow far sooner. A sum that
    overflows counts as non-finite too, which takes gradients summing past ~3e38."""
    sums = [t.sum(dtype=torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype) for t in tensors]
    return bool(torch.isfinite(torch.stack([s.to(torch.float64) for s in sums])).all())


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _owned(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` in memory of their own: a slice of a batch would pin the whole batch (on a GPU, device memory) in
    the activation cache, which counts only the slice's bytes and could then hold far more than its budget."""
    return rows.clone() if rows.untyped_storage().nbytes() > rows.nbytes else rows


@dataclass(frozen=True)
class TensorSchema:
    """Shape without the batch dimension, and dtype name: what one input or output of an expert looks like."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSchema":
        return cls(tuple(tensor.shape[1:]), dtype_name(tensor.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        """Elements per row (per sample of the batch)."""
        return math.prod(self.shape)

    def describe(self) -> str:
        return f"[{', '.join(['*', *map(str, self.shape)])}] {self.dtype}"


class NonFiniteBatch(Exception):
    """The summed parameter gradients of a backward batch of several requests were not finite; nothing was applied
    and the gradients are cleared. The runtime runs each request of the batch alone again (as for any failing
    batch), so that only the request whose own gradients are not finite loses its step: skipping the batch's one
    step would silently drop the gradients of every other caller batched with it (review 66)."""


class ExpertBackend:
    """One expert: its module, optimizer, optional LR scheduler and gradient clipping, and its schema.

    ``forward`` runs without autograd (the caller only needs outputs), unless the request asked to keep its
    activations for a backward to come (see :mod:`dmoe.server.activations`). ``backward`` uses such a kept graph
    when it is still valid and otherwise recomputes the forward pass with autograd; it returns the input gradients
    and applies one optimizer step right away: experts train asynchronously, each on whatever gradients reach it.
    On a server ``backward`` is called once per batch the runtime joined (the queued backward requests of this
    expert, from any callers): their gradients are summed into that one step.

    Args:
        name: the expert's uid.
        module: the expert, already on the device it will run on.
        sample_input: example inputs with a batch dimension; they fix the input schema, and running the module on
            them fixes the output schema.
        optimizer: built over ``module``'s parameters; None for parameter-free experts (nothing to train).
        scheduler: stepped after every optimizer step.
        clip_grad_norm: clip the gradient norm to this before each step (None: no clipping).
        expert_cls: the registry name, reported by the ``info`` RPC.
        hparams: constructor and optimizer arguments, reported by the ``info`` RPC (JSON-serialisable).
        activations: where forwards are kept for their backward (the server's, shared by its experts); None:
            always recompute.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        sample_input: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scheduler: Any = None,
        clip_grad_norm: float | None = None,
        expert_cls: str = "custom",
        hparams: dict[str, Any] | None = None,
        activations: ActivationCache | None = None,
    ):
        self.name, self.module, self.optimizer, self.scheduler = name, module, optimizer, scheduler
        self.activations = activations
        self.clip_grad_norm = clip_grad_norm
        self.expert_cls = expert_cls
        self.hparams = dict(hparams or {})
        self.forward_calls = 0
        self.backward_calls = 0
        self.skipped_steps = 0  # optimizer steps refused because the gradients were not finite
        self.updates = 0  # optimizer steps applied: how far the expert has trained (replicas compare it)
        #: renewed whenever this backend changes its weights (:meth:`weights_stamp`); a new object each time, so
        #: never equal to another backend's, nor to one a kept forward still holds
        self._weights_token = object()
        #: CUDA graphs of the forward and of the training step (:meth:`use_cuda_graphs`); None: eager
        self.graphs: ExpertGraphs | None = None
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        sample = tuple(x.to(device) for x in sample_input)
        self.inputs_schema = tuple(TensorSchema.of(x) for x in sample)
        with torch.no_grad():
            outputs = self._as_tuple(module(*sample))
            self.outputs_schema = tuple(TensorSchema.of(y) for y in outputs)
            self._check_rows(sample, outputs)
            # again with one row more: an output of a fixed number of rows that happened to be the sample's
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                longer = tuple(torch.cat([x, x[:1]]) for x in sample)
                self._check_rows(longer, self._as_tuple(module(*longer)))

    def _check_rows(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Raises ValueError unless every output has the inputs' rows first: an expert that reduced over its batch
        was announced, and failed every call, on the callers' side (review 100 D9)."""
        rows = inputs[0].shape[0] if inputs and inputs[0].dim() else None
        for at, y in enumerate(outputs):
            if not isinstance(y, torch.Tensor) or rows is None or y.dim() == 0 or y.shape[0] != rows:
                got = f"of shape {list(y.shape)}" if isinstance(y, torch.Tensor) else f"a {type(y).__name__}"
                raise ValueError(f"expert class {self.expert_cls!r} answers a batch of {rows} rows with output {at} "
                                 f"{got}: each output must keep the batch's rows first")

    @staticmethod
    def _as_tuple(outputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)

    def use_cuda_graphs(self, max_rows: int, switch: GraphSwitch | None = None) -> None:
        """From now on the forward and the training step replay CUDA graphs, per bucket of batch sizes up to
        ``max_rows`` (:mod:`dmoe.server.cuda_graphs`). Where the training step is a graph too, forwards keep only
        their inputs for their backward, which recomputes the forward inside the step's graph; where it is not (an
        optimizer other than fused Adam, a scheduler, a failed capture), forwards that a backward will follow run
        eagerly as before, keeping their autograd graph. An expert without parameters stays eager (its work is
        not worth a graph's memory). ``switch``: the server process's, which one failed capture turns off for all
        of its experts. Raises ValueError off a CUDA device."""
        if next(self.module.parameters(), None) is None:
            return
        self.graphs = ExpertGraphs(
            self.module, self.optimizer, [s.shape for s in self.inputs_schema],
            [s.torch_dtype for s in self.inputs_schema], [s.torch_dtype for s in self.outputs_schema],
            clip_grad_norm=self.clip_grad_norm, max_rows=max_rows, scheduler=self.scheduler, name=self.name,
            switch=switch)
        if self.graphs.train_off is not None:
            logger.info("%s: its training step runs eagerly, not as a CUDA graph: %s", self.name, self.graphs.train_off)

    def forward(self, *inputs: torch.Tensor, segments: Segments | None = None) -> tuple[torch.Tensor, ...]:
        """The expert's outputs for a batch. ``segments``: (activation id or None, rows) of each request in it.

        Requests with an id have their inputs held for their backward; a batch of one such request also keeps
        its autograd graph (not when the training step is a CUDA graph). Anything else runs without autograd.
        """
        cache = self.activations if self.activations is not None and self.activations.enabled else None
        keep = cache is not None and segments is not None and any(aid is not None for aid, _ in segments)
        # a graph's forward keeps no autograd graph: worth it when no backward follows, or when the backward's step
        # is a graph too (it recomputes the forward); else the kept graph saves the eager backward a forward
        if self.graphs is not None and (not keep or self.graphs.trains):
            if keep:
                assert cache is not None and segments is not None
                self._keep_inputs(cache, inputs, segments)
            outputs = self.graphs.forward(inputs)
            return outputs if outputs is not None else self._forward_no_grad(inputs)
        if not keep:
            return self._forward_no_grad(inputs)
        assert cache is not None and segments is not None
        if len(segments) > 1:
            self._keep_inputs(cache, inputs, segments)
            return self._forward_no_grad(inputs)
        params = list(self.module.parameters())
        leaves = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)
        saved = SavedBytes(params)
        for x in leaves:
            saved.pack(x)  # held with the graph whether or not the module saves them
        with torch.enable_grad(), saved.hooks():
            outputs = self._as_tuple(self.module(*leaves))
        graph = outputs if any(y.requires_grad for y in outputs) else None
        if graph is not None:  # the entry holds the outputs too: an up-projection's outweigh what autograd saves
            for y in graph:
                saved.pack(y)  # counted once, whether a saved tensor, an input or new
        self._keep(cache, segments[0][0], KeptForward(leaves, graph, self.weights_stamp(), saved.nbytes))
        return self._to_schema(tuple(y.detach() for y in outputs))

    def _keep(self, cache: ActivationCache, activation_id: ActivationKey, kept: KeptForward) -> None:
        """Puts ``kept`` into ``cache``, unless this backend left it meanwhile (``activations`` set to None: its
        server removed it, then forgot its uid's entries). A forward queued before the removal ran after it, and its
        graph held the removed expert's weights, uncounted, until it expired (review 95 D3)."""
        cache.put(self.name, activation_id, kept)
        if self.activations is not cache:  # (checked after the put: the remover's forget may have come before it)
            cache.discard(self.name, activation_id)

    def weights_stamp(self) -> tuple[object, tuple[int, ...]]:
        """What a kept graph must still match to be used (:mod:`dmoe.server.activations`): this backend's token,
        renewed at each optimizer step and load, and the parameters' version counters, bumped by in-place changes
        made from outside (a copy into them). The counters alone do not do: a fused optimizer's step leaves them
        unchanged, and two backends of one uid loaded once each have equal counters whatever their weights."""
        return self._weights_token, parameter_versions(self.module.parameters())

    def _weights_changed(self) -> None:
        """Makes every graph kept from the weights before stale: a new token, and the graphs dropped now (their
        memory back, their inputs kept)."""
        self._weights_token = object()
        if self.activations is not None:
            self.activations.drop_graphs(self.name)

    def _keep_inputs(self, cache: ActivationCache, inputs: Sequence[torch.Tensor], segments: Segments) -> None:
        """Holds the inputs of each request with an activation id, without a graph: its backward recomputes."""
        start = 0
        for activation_id, rows in segments:
            if activation_id is not None:
                self._keep(cache, activation_id,
                           KeptForward.inputs_only([_owned(x[start:start + rows]) for x in inputs]))
            start += rows

    def _forward_no_grad(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        with torch.inference_mode():
            return self._to_schema(self._as_tuple(self.module(*inputs)))

    def _to_schema(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # under autocast outputs may come out in half precision; callers were promised the schema's dtype
        return tuple(y.to(s.torch_dtype) for y, s in zip(outputs, self.outputs_schema))

    def backward(self, *inputs_and_grads: torch.Tensor, segments: Segments | None = None) -> tuple[torch.Tensor, ...]:
        """Takes the inputs followed by the gradients of the outputs; returns input gradients, then steps once.

        ``segments`` as in :meth:`forward`: requests whose forward was kept (and is still valid) reuse that graph;
        the others are recomputed together in one batch.
        """
        n_in = len(self.inputs_schema)
        inputs, grad_outputs = inputs_and_grads[:n_in], inputs_and_grads[n_in:]
        requests = len(segments) if segments is not None else 1  # several: maybe of several callers
        if self.graphs is not None and self.graphs.trains:
            if segments is not None and self.activations is not None:
                for activation_id, _ in segments:
                    if activation_id:
                        self.activations.discard(self.name, activation_id)  # held inputs only: nothing to reuse
            segments = None  # recompute, in the step's graph or eagerly
            replayed = self.graphs.train_step(inputs, grad_outputs)
            if replayed is not None:
                input_grads, stepped = replayed
                if not stepped and requests > 1:  # the replay skipped its step on the device: nothing applied
                    raise NonFiniteBatch(f"{self.name}: the gradients of a batch of {requests} requests are not "
                                         "finite")
                self._count_step(stepped)
                return input_grads
        try:
            if segments is None or self.activations is None or all(aid is None for aid, _ in segments):
                input_grads = self._recompute_backward(inputs, grad_outputs)
            else:
                input_grads = self._segmented_backward(inputs, grad_outputs, segments)
            self._apply_gradients(requests)
        except BaseException:
            # a backward or step that failed half-way leaves this batch's gradients in .grad, and the runtime runs
            # the batch again (after freeing memory, or each request alone): that run must start from none, or its
            # step would apply these gradients twice
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            raise
        return input_grads

    def _segmented_backward(self, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                            segments: Segments) -> tuple[torch.Tensor, ...]:
        assert self.activations is not None
        weights = self.weights_stamp()
        pieces: list[tuple[torch.Tensor, ...] | None] = []
        recompute: list[slice] = []
        start = 0
        for activation_id, rows in segments:
            part = slice(start, start + rows)
            start += rows
            kept = (self.activations.take(self.name, activation_id, weights, [x[part] for x in inputs])
                    if activation_id else None)
            if kept is None:
                pieces.append(None)
                recompute.append(part)
                continue
            pairs = [(y, g[part]) for y, g in zip(kept.outputs, grad_outputs) if y.requires_grad]
            torch.autograd.backward([y for y, _ in pairs], [g.to(y.dtype) for y, g in pairs])
            pieces.append(tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in kept.inputs))
        if recompute:
            redone = self._recompute_backward([torch.cat([x[p] for p in recompute]) for x in inputs],
                                              [torch.cat([g[p] for p in recompute]) for g in grad_outputs])
            sizes = [p.stop - p.start for p in recompute]
            redone_parts = iter(zip(*(torch.split(g, sizes) for g in redone)))
            pieces = [piece if piece is not None else next(redone_parts) for piece in pieces]
        return tuple(torch.cat([piece[i] for piece in pieces]) if len(pieces) > 1 else pieces[0][i]
                     for i in range(len(inputs)))

    def _recompute_backward(self, inputs: Sequence[torch.Tensor],
                            grad_outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Runs the forward again with autograd, then backward: input gradients; parameter gradients accumulate."""
        inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        with torch.enable_grad():
            outputs = self._as_tuple(self.module(*inputs))
            pairs = [(y, g) for y, g in zip(outputs, grad_outputs) if y.requires_grad]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g.to(y.dtype) for y, g in pairs])
        return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs)

    def _apply_gradients(self, requests: int = 1) -> None:
        """One optimizer step on the accumulated gradients of ``requests`` requests (a batch the runtime joined)."""
        if self.optimizer is None:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if grads and not all_finite(grads):
            # a NaN/Inf gradient (sent by a client, or an overflow) would poison the weights for every later caller
            self.optimizer.zero_grad(set_to_none=True)
            if requests > 1:  # which request is to blame? Each runs alone again: only that one loses its step
                raise NonFiniteBatch(f"{self.name}: the gradients of a batch of {requests} requests are not finite")
            self.skipped_steps += 1
            logger.warning("%s: skipped an optimizer step with non-finite gradients (%d so far)", self.name,
                           self.skipped_steps)
            return
        if self.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.module.parameters(), self.clip_grad_norm)
        self._step()
        self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._weights_changed()  # graphs kept before this step saved the old weights
        if self.scheduler is not None:
            try:
                self.scheduler.step()
            except Exception:  # noqa: BLE001 - the step is applied: raising would make the runtime apply it again
                logger.exception("%s: the LR scheduler's step failed after the optimizer's", self.name)

    def _count_step(self, stepped: bool) -> None:
        """Counts a training step replayed as a CUDA graph, which skipped its update on the device when a gradient
        was not finite."""
        if self.optimizer is None:
            return
        if stepped:
            self.updates += 1
            self._weights_token = object()  # (its forwards kept inputs only: no graph to drop)
            return
        self.skipped_steps += 1
        logger.warning("%s: skipped an optimizer step with non-finite gradients (%d so far)", self.name,
                       self.skipped_steps)

    def _step(self) -> None:
        """``optimizer.step()``; when it raises, counts the weights as changed and warns that they may have.

        Whether it changed some cannot be told: a fused step (the server's default, :func:`make_optimizer`) bumps
        no ``_version``, and comparing every weight would need a copy of each, memory the step may just have run
        out of (Adam's first step allocates its state, before it changes any weight). So the graphs kept before it
        are dropped in any case. Changes cannot be undone either: the batch's rerun steps once more from the
        weights as they are, with its own fresh gradients, so a weight the failed step moved gets at most one
        extra step of its gradient, never the gradients summed twice.
        """
        assert self.optimizer is not None
        try:
            self.optimizer.step()
        except BaseException:
            self._weights_changed()
            logger.warning("%s: the optimizer step failed; any weights it changed before failing may move twice",
                           self.name)
            raise

    def reset_nonfinite_optimizer_state(self) -> list[str]:
        """Resets the optimizer state of each parameter whose state holds a NaN or infinity, and returns their names.

        A step checks that the gradients are finite, not that the optimizer's own arithmetic stays so: a finite
        gradient of 1e20 (a server with ``--max-abs-value 0`` and no ``--clip-grad-norm``) overflows Adam's running
        average of squared gradients to +inf, after which those weights never move again, and the checkpoint that
        saved it was refused whole at the restart (review 111). Called before a checkpoint or replica is taken (not
        every step: it reads all the state): the weights are kept, the parameter's state starts afresh at its next
        step."""
        if self.optimizer is None:
            return []
        reset = [parameter for parameter, state in self.optimizer.state.items()
                 if any(isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all()
                        for t in state.values())]
        if not reset:
            return []
        for parameter in reset:
            self.optimizer.state[parameter] = {}  # (torch's optimizers build a parameter's state when it is empty)
        names = {id(p): name for name, p in self.module.named_parameters()}
        if self.graphs is not None:
            self.graphs.reset()  # they read the old state tensors
        reset_names = [names.get(id(p), "?") for p in reset]
        logger.warning("%s: the optimizer state of %s was not finite (a gradient whose square overflows?): reset, the "
                       "weights kept; bound the gradients with --clip-grad-norm or --max-abs-value", self.name,
                       ", ".join(reset_names))
        return reset_names

    def hparams_json(self) -> str:
        return json.dumps(self.hparams, sort_keys=True, default=str)

    def state_dict(self) -> dict[str, Any]:
        """Module, optimizer and scheduler state: everything a checkpoint needs to resume training."""
        return {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def check_state(self, state: Any) -> list[torch.Tensor]:
        """Raises ValueError, naming the first tensor that does not fit, unless :meth:`load_state_dict` can load
        ``state`` whole: the module's tensors by name, each of its shape (and floating-point where the module's is);
        the optimizer's per-parameter buffers against the parameters they will be given to, by position
        (:func:`check_optimizer_state`: a buffer of another shape corrupted the heap at the first fused step,
        review 100 D1). Checked before anything is loaded, so that a refused state leaves the expert as it was.
        Returns the optimizer's step counters."""
        def refused(message: str) -> ValueError:
            return ValueError(f"{self.name}: {message}")

        if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
            raise refused("the state holds no module tensors")
        module, expected = state["module"], self.module.state_dict()
        if set(module) != set(expected):
            raise refused(f"module tensors differ: missing {sorted(set(expected) - set(module))[:4]}, unexpected "
                          f"{sorted(map(str, set(module) - set(expected)))[:4]}")
        for name, tensor in expected.items():
            saved = module[name]
            if not isinstance(saved, torch.Tensor) or saved.shape != tensor.shape \
                    or saved.is_floating_point() != tensor.is_floating_point() or saved.is_complex():
                got = f"{list(saved.shape)} {_dtype(saved)}" if isinstance(saved, torch.Tensor) else repr(saved)[:40]
                raise refused(f"module tensor {name} is {got}, the expert's is {list(tensor.shape)} {_dtype(tensor)}")
        if self.optimizer is None or state.get("optimizer") is None:
            return []  # (none saved: the optimizer starts afresh)
        steps, _ = check_optimizer_state(state["optimizer"], self.optimizer, refused)
        return steps

    def load_state_dict(self, state: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Restores :meth:`state_dict`'s output. The optimizer keeps the settings of :data:`GIVEN_NOW` it was built
        with (the learning rate, unless a scheduler sets it; weight decay): returns those that differ from the
        saved ones, as ``{name: (saved, now)}``. Raises ValueError for the state of another kind of optimizer (its
        per-parameter state would fail the first step with a KeyError), or one :meth:`check_state` refuses."""
        saved_optimizer = state.get("optimizer") if self.optimizer is not None else None
        saved_kind, kind = saved_optimizer_name(saved_optimizer), optimizer_name(self.optimizer)
        if saved_kind is not None and kind is not None and saved_kind != kind:
            raise ValueError(f"{self.name}: the saved optimizer state is {saved_kind!r}'s, this expert's optimizer "
                             f"is {kind!r}")
        self.check_state(state)
        self.module.load_state_dict(state["module"])
        self._weights_changed()
        changed: dict[str, tuple[Any, Any]] = {}
        if saved_optimizer is not None:
            given = [{key: group[key] for key in GIVEN_NOW if key in group
                      and not (key == "lr" and self.scheduler is not None)} for group in self.optimizer.param_groups]
            self.optimizer.load_state_dict(saved_optimizer)
            for group, values in zip(self.optimizer.param_groups, given):
                for key, value in values.items():
                    if group.get(key) != value:
                        changed.setdefault(key, (group.get(key), value))
                        group[key] = value
            if changed:
                logger.debug("%s: restored with %s", self.name,
                             ", ".join(f"{key} {now} (saved: {was})" for key, (was, now) in changed.items()))
        if self.graphs is not None:
            self.graphs.reset()  # they read the optimizer's old state tensors
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        return changed


#: devices whose fused optimizer kernels torch provides
FUSED_DEVICES = frozenset({"cpu", "cuda"})


def make_optimizer(name: str, params: Sequence[nn.Parameter], lr: float) -> torch.optim.Optimizer | None:
    """``'adam'``/``'sgd'`` over ``params``; None when there is nothing to train.

    The fused implementation where torch has one for the parameters' device and dtype: the same update in one pass
    over each tensor instead of one per arithmetic operation. An expert server spends much of its time in these
    steps.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    params = [p for p in params if p.requires_grad]
    if not params:
        return None
    fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    return OPTIMIZERS[name](params, lr=lr, fused=fused or None)
