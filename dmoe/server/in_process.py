"""Experts trained in the client's process exactly as a server trains them: the no-network baseline.

A remote expert is stepped by its server's own optimizer, once per backward batch: the backward requests of one
expert that are queued together on its server, from any callers, are joined into one batch of up to
``--max-batch-size`` rows, and their gradients are summed into one step (a lone trainer's backward, which finds
nothing else queued, steps alone with its own gradients, as here); the client's optimizer never sees its
parameters. An in-process expert steps once per backward call. An ordinary submodule would instead be
trained by the client's optimizer (its schedule, weight decay and clipping), so "local vs remote" would compare
two training procedures, not the network. :class:`InProcessExpert` wraps the server's own
:class:`~dmoe.server.backend.ExpertBackend`, so both paths run one implementation, and
:class:`ExpertOptimizerConfig` is the one set of settings both are given (the trainer turns it into the servers'
flags with :meth:`ExpertOptimizerConfig.server_args`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dmoe.experts import create_expert, expert_class, expert_seed, mixture_input_problem
from dmoe.server.backend import OPTIMIZERS, ExpertBackend, make_optimizer


@dataclass(frozen=True)
class ExpertOptimizerConfig:
    """How each expert is trained: by a server (``dmoe-server --optimizer --lr --clip-grad-norm``) or in process.

    Servers apply no learning-rate schedule: the rate is constant.
    """

    optimizer: str = "adam"
    lr: float = 3e-3
    clip_grad_norm: float | None = None  # None: no clipping

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown expert optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"the expert learning rate must be positive, got {self.lr}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"the experts' gradient clipping must be positive or None, got {self.clip_grad_norm}")

    def server_args(self) -> list[str]:
        """The ``dmoe-server`` flags that make a server train its experts this way."""
        args = ["--optimizer", self.optimizer, "--lr", repr(self.lr)]
        if self.clip_grad_norm is not None:
            args += ["--clip-grad-norm", repr(self.clip_grad_norm)]
        return args

    def backend(self, uid: str, module: nn.Module, sample_input: tuple[torch.Tensor, ...],
                **kwargs: Any) -> ExpertBackend:
        """An :class:`ExpertBackend` over ``module`` with this optimizer and clipping."""
        return ExpertBackend(uid, module, sample_input, make_optimizer(self.optimizer, module.parameters(), self.lr),
                             clip_grad_norm=self.clip_grad_norm, **kwargs)


class _BackendStep(torch.autograd.Function):
    """Forward without autograd; backward recomputes the forward, returns the input gradient and steps the
    expert's optimizer: what a server's ``ExpertBackend.backward`` does for a backward call."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, backend: ExpertBackend) -> torch.Tensor:
        ctx.backend = backend
        ctx.save_for_backward(x)
        backend.forward_calls += 1  # counted per call, as the servicer counts them
        y = backend.forward(x)[0]
        return y.clone() if y.is_inference() else y  # inference tensors may not enter the client's graph

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        ctx.backend.backward_calls += 1
        return ctx.backend.backward(x, grad)[0], None


class InProcessExpert(nn.Module):
    """An expert trained by its own optimizer in backward, as on a server.

    Its parameters are not registered with this module, so the client's optimizer, weight decay and gradient
    clipping never touch them. They are still in the model's ``state_dict`` (as this module's extra state, with
    the optimizer state), so a checkpoint of the model resumes its experts too.
    """

    def __init__(self, backend: ExpertBackend):
        super().__init__()
        self._backend = (backend,)  # a tuple, so nn.Module does not register the expert's parameters

    @property
    def backend(self) -> ExpertBackend:
        return self._backend[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BackendStep.apply(x, self.backend)

    def get_extra_state(self) -> dict[str, Any]:
        return self.backend.state_dict()

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.backend.load_state_dict(state)


def in_process_experts(expert_cls: str, hidden_dim: int, optimizer: ExpertOptimizerConfig, *, seed: int = 0,
                       device: str | torch.device = "cpu") -> Callable[[str], InProcessExpert]:
    """An ``expert_factory`` for :class:`~dmoe.client.moe.LocalMixtureOfExperts`: expert ``uid`` starts from the
    weights a server started with ``--seed seed`` gives it, and trains with ``optimizer``. Raises ValueError for a
    class whose experts do not take and answer one ``[rows, hidden_dim]`` tensor, what the layer sends and takes
    back (:func:`~dmoe.experts.mixture_input_problem`)."""
    registered = expert_class(expert_cls)
    problem = mixture_input_problem(expert_cls, hidden_dim)
    if problem is not None:
        raise ValueError(problem)

    def build(uid: str) -> InProcessExpert:
        module = create_expert(expert_cls, hidden_dim, seed=expert_seed(seed, uid)).to(device)
        with torch.random.fork_rng(devices=[]):  # the sample must not shift the client's initialisation
            sample = tuple(x.to(device) for x in registered.sample(2, hidden_dim))
        backend = optimizer.backend(uid, module, sample, expert_cls=expert_cls)
        answers = [list(schema.shape) for schema in backend.outputs_schema]
        if answers != [[hidden_dim]]:
            raise ValueError(f"expert class {expert_cls!r} answers rows of {answers}, but a mixture layer takes "
                             f"back one [rows, {hidden_dim}] tensor: it cannot be a mixture layer's expert")
        return InProcessExpert(backend)

    return build
