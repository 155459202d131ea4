"""Expert classes for tests, loaded by servers through ``--custom-module tests/custom_experts.py``."""
import torch
from torch import nn

from dmoe.experts import register_expert_class


@register_expert_class("explode", lambda batch, hidden: torch.randn(batch, hidden))
class ExplodingExpert(nn.Module):
    """A linear layer that raises on any input above 1000: a failure inside compute, on demand."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.abs() > 1000).any():
            raise ValueError("input too large to handle")
        return self.linear(x)


@register_expert_class("widen", lambda batch, hidden: torch.randn(batch, hidden))
class WideningExpert(nn.Module):
    """Answers rows twice as wide as its inputs: a server whose experts do not fit the layer that calls them."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, 2 * hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@register_expert_class("small_device", lambda batch, hidden: torch.randn(batch, hidden))
class SmallDeviceExpert(nn.Module):
    """A linear layer on a stand-in for a small GPU: a call of more than ``ROWS`` rows raises torch.OutOfMemoryError,
    as a CUDA allocation that does not fit would (a CPU's failed allocation raises a plain RuntimeError)."""

    ROWS = 64

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.ROWS:
            raise torch.OutOfMemoryError(f"stand-in device: {x.shape[0]} rows do not fit, at most {self.ROWS}")
        return self.linear(x)


@register_expert_class("double", lambda batch, hidden: torch.randn(batch, hidden))
class DoublePrecisionExpert(nn.Module):
    """Answers float64 rows of the right shape: a server whose answers the layer must not mix into float32 ones."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).double()


@register_expert_class("up8", lambda batch, hidden: torch.randn(batch, hidden))
class UpProjectionExpert(nn.Module):
    """``hidden -> 8 * hidden``: outputs eight times its inputs, while autograd saves only the inputs (review 66:
    a kept forward's size must count its outputs)."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.proj = nn.Linear(hidden_dim, 8 * hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


#: what torch's CPU allocator raises when an allocation fails (a plain RuntimeError)
CPU_ALLOCATION_FAILURE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                          "you tried to allocate 134217728 bytes. Error code 12 (Cannot allocate memory)")


@register_expert_class("small_cpu", lambda batch, hidden: torch.randn(batch, hidden))
class SmallCpuExpert(nn.Module):
    """A linear layer on a stand-in for a CPU short of memory: a call of more than ``ROWS`` rows, and the next
    ``failures`` calls, raise what a CPU's failed allocation raises: torch's RuntimeError, or (``error = 'memory'``)
    Python's MemoryError."""

    ROWS = 64

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)
        self.failures = 0
        self.error = "allocator"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.ROWS or self.failures:
            self.failures = max(0, self.failures - 1)
            raise MemoryError() if self.error == "memory" else RuntimeError(CPU_ALLOCATION_FAILURE)
        return self.linear(x)


@register_expert_class("huge", lambda batch, hidden: torch.randn(batch, hidden))
class HugeExpert(nn.Module):
    """Answers finite rows of magnitude about 1e30 (float32 holds up to 3.4e38): a diverged or hostile expert that
    no NaN or Inf check catches."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 1e30


class _Amplified(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1e30


@register_expert_class("huge_grad", lambda batch, hidden: torch.randn(batch, hidden))
class HugeGradientExpert(nn.Module):
    """A linear layer whose forward answers are ordinary, and whose input gradients are finite but about 1e30."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(_Amplified.apply(x))


@register_expert_class("one_row", lambda batch, hidden: torch.randn(batch, hidden))
class OneRowExpert(nn.Module):
    """Answers one row whatever the batch (a reduction over it): an output that does not keep the batch's rows."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).mean(0, keepdim=True)


@register_expert_class("two_rows", lambda batch, hidden: torch.randn(batch, hidden))
class TwoRowsExpert(nn.Module):
    """Answers two rows whatever the batch: as many as a sample of 2 rows has, and no other batch."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).mean(0, keepdim=True).expand(2, -1)
