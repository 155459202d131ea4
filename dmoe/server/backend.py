"""``ExpertBackend``: one expert module with its optimizer, trained asynchronously by whoever calls backward."""
from __future__ import annotations

import json
import logging
import math
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from dmoe.wire.codec import DTYPES, dtype_name

logger = logging.getLogger(__name__)

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


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


def expert_seed(seed: int, uid: str) -> int:
    """A reproducible per-expert seed, so experts differ from each other and a test can rebuild any one of them."""
    return (seed * 1_000_003 + zlib.crc32(uid.encode())) % 2**31


class ExpertBackend:
    """One expert: its module, optimizer, optional LR scheduler and gradient clipping, and its schema.

    ``forward`` runs without autograd (the caller only needs outputs). ``backward`` recomputes the forward pass
    with autograd instead of keeping activations between the two calls (a server cannot know whether, or when,
    a backward will follow), returns the input gradients and applies one optimizer step right away: experts
    train asynchronously, each on whatever gradients reach it.

    Args:
        name: the expert's uid.
        module: the expert, already on the device it will run on.
        sample_input: example inputs with a batch dimension; they fix the input schema, and running the module on
            them fixes the output schema.
        optimizer: built over ``module``'s parameters; None for parameter-free experts (nothing to train).
        scheduler: stepped after every optimizer step.
        clip_grad_norm: clip the gradient norm to this before each step (None: no clipping).
        expert_cls: the registry name, reported by ``info``.
        hparams: constructor and optimizer arguments, reported by ``info`` (JSON-serialisable).
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
    ):
        self.name, self.module, self.optimizer, self.scheduler = name, module, optimizer, scheduler
        self.clip_grad_norm = clip_grad_norm
        self.expert_cls = expert_cls
        self.hparams = dict(hparams or {})
        self.forward_calls = 0
        self.backward_calls = 0
        self.skipped_steps = 0  # optimizer steps refused because the gradients were not finite
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        sample = tuple(x.to(device) for x in sample_input)
        self.inputs_schema = tuple(TensorSchema.of(x) for x in sample)
        with torch.no_grad():
            self.outputs_schema = tuple(TensorSchema.of(y) for y in self._as_tuple(module(*sample)))

    @staticmethod
    def _as_tuple(outputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The expert's outputs for a batch, computed without autograd."""
        with torch.inference_mode():
            outputs = self._as_tuple(self.module(*inputs))
            # under autocast outputs may come out in half precision; callers were promised the schema's dtype
            return tuple(y.to(s.torch_dtype) for y, s in zip(outputs, self.outputs_schema))

    def backward(self, *inputs_and_grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Takes the inputs followed by the gradients of the outputs; returns input gradients, then steps."""
        n_in = len(self.inputs_schema)
        inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs_and_grads[:n_in]]
        grad_outputs = inputs_and_grads[n_in:]
        with torch.enable_grad():
            outputs = self._as_tuple(self.module(*inputs))
            pairs = [(y, g) for y, g in zip(outputs, grad_outputs) if y.requires_grad]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g.to(y.dtype) for y, g in pairs])
        input_grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs)
        self._apply_gradients()
        return input_grads

    def _apply_gradients(self) -> None:
        if self.optimizer is None:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if grads and not bool(torch.isfinite(nn.utils.get_total_norm(grads)).item()):
            # a NaN/Inf gradient (sent by a client, or an overflow) would poison the weights for every later caller
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            logger.warning("%s: skipped an optimizer step with non-finite gradients (%d so far)", self.name,
                           self.skipped_steps)
            return
        if self.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.module.parameters(), self.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def info(self) -> dict[str, Any]:
        """What ``ExpertService.info`` reports (minus server-wide fields such as the device)."""
        return {
            "uid": self.name,
            "expert_cls": self.expert_cls,
            "inputs": [(list(s.shape), s.dtype) for s in self.inputs_schema],
            "outputs": [(list(s.shape), s.dtype) for s in self.outputs_schema],
            "hparams": self.hparams,
            "forward_calls": self.forward_calls,
            "backward_calls": self.backward_calls,
        }

    def hparams_json(self) -> str:
        return json.dumps(self.hparams, sort_keys=True, default=str)

    def state_dict(self) -> dict[str, Any]:
        """Module, optimizer and scheduler state: everything a checkpoint needs to resume training."""
        return {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])


def make_optimizer(name: str, params: Sequence[nn.Parameter], lr: float) -> torch.optim.Optimizer | None:
    """``'adam'``/``'sgd'`` over ``params``; None when there is nothing to train."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    params = [p for p in params if p.requires_grad]
    return OPTIMIZERS[name](params, lr=lr) if params else None
