"""Size flags checked against the machine before anything is built: a model whose parameters alone could never be
trained in the memory of the device it would train on is refused naming the flags that size it (review 100 D8:
``dmoe-train --hidden 1000000000`` ended in torch's allocator traceback, ``dmoe-server --hidden-dim
99999999999999999999`` in some 40 lines of C++ frames blaming ``--expert-kwargs``, which was not given).

The parameters are counted on torch's meta device, where a module is built without taking any memory.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: the widest model a width flag takes (dmoe-train's --hidden, dmoe-server's --hidden-dim): beyond it torch's
#: sizes overflow before any memory is asked for, and no model trained anywhere is a hundredth as wide
MAX_WIDTH = 2**20

#: what each parameter takes at least while it trains: its value and its gradient, of its own size each
COPIES_IN_TRAINING = 2


def check_width(flag: str, value: int) -> None:
    """Raises ValueError naming ``flag`` for a width above :data:`MAX_WIDTH`."""
    if value > MAX_WIDTH:
        raise ValueError(f"{flag} {value} is absurd (at most {MAX_WIDTH})")


class _NoValuesToChange(TorchFunctionMode):
    """Skips in-place operations (``normal_``, ``uniform_``, ``nn.init.*_``: a module's initialisation) on meta
    tensors, which hold no values for them to change: torch runs some of them through its compiler's Python
    references, whose first import took 4 s of a program's start."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            target = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if target is not None and target.is_meta:
                return target
        return func(*args, **kwargs)


def parameter_bytes(build: Callable[[], nn.Module]) -> int:
    """The bytes of the parameters of the module ``build()`` makes, built on the meta device (no memory taken,
    in milliseconds). Raises what the build raises: a size torch cannot represent is a RuntimeError, TypeError
    or OverflowError."""
    with torch.device("meta"), _NoValuesToChange():
        module = build()
    return sum(p.numel() * p.element_size() for p in module.parameters())


def memory_bytes(device: torch.device) -> int | None:
    """The memory of ``device`` in all: a GPU's, or this machine's RAM for the CPU; None where it is not known."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AssertionError, OSError, RuntimeError, ValueError):  # (no such GPU; no sysconf names)
        return None
    return None


def check_trainable(what: str, parameters: int, device: torch.device) -> None:
    """Raises ValueError starting with ``what`` (the flags that size the model) where ``parameters`` bytes of
    parameters, with their gradients, exceed the memory of ``device``."""
    total = memory_bytes(device)
    needed = COPIES_IN_TRAINING * parameters
    if total is not None and needed > total:
        where = "this machine's memory" if device.type == "cpu" else str(device)
        raise ValueError(f"{what}: its parameters and their gradients alone take {gib(needed)}, more than the "
                         f"{gib(total)} of {where}")


def gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB"
