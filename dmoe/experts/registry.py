"""The registry of expert classes: a name -> (module class, sample input builder).

A server builds experts by name (``--expert-cls ffn``), and it must know each expert's input schema before any
request arrives so it can reject malformed ones early; the sample input builder gives it that schema. Users add
their own classes with :func:`register_expert_class`; constructor arguments are free-form keyword arguments.
"""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

#: ``sample_input(batch_size, hidden_dim) -> tensor or tuple of tensors`` with the shapes/dtypes the expert takes.
SampleInputFn = Callable[[int, int], "torch.Tensor | Sequence[torch.Tensor]"]


@dataclass(frozen=True)
class ExpertClass:
    """A registered expert class: ``cls(hidden_dim, **kwargs)`` builds one expert."""

    name: str
    cls: type[nn.Module]
    sample_input: SampleInputFn

    def sample(self, batch_size: int, hidden_dim: int) -> tuple[torch.Tensor, ...]:
        inputs = self.sample_input(batch_size, hidden_dim)
        return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


_REGISTRY: dict[str, ExpertClass] = {}


def register_expert_class(name: str, sample_input: SampleInputFn) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: makes ``cls`` available to servers as ``name``.

    ``cls`` must accept ``hidden_dim`` as its first argument (plus any keyword arguments you pass at build time);
    ``sample_input(batch_size, hidden_dim)`` returns example inputs, which fix the expert's input schema.
    """

    def register(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _REGISTRY and _class_id(_REGISTRY[name].cls) != _class_id(cls):
            raise ValueError(f"expert class {name!r} is already registered to {_REGISTRY[name].cls.__qualname__}")
        _REGISTRY[name] = ExpertClass(name, cls, sample_input)
        return cls

    return register


def _class_id(cls: type) -> tuple[str, str]:
    # the same file imported twice (as a path and as a package module) defines equal classes: not a conflict
    return cls.__module__.rsplit(".", 1)[-1], cls.__qualname__


def expert_class(name: str) -> ExpertClass:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown expert class {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def expert_class_names() -> list[str]:
    return sorted(_REGISTRY)


def mixture_input_problem(name: str, hidden_dim: int) -> str | None:
    """Why a mixture-of-experts layer cannot use expert class ``name``, or None: the layer sends each expert one
    ``[rows, hidden_dim]`` tensor, the tokens routed to it. The ``transformer`` expert (``[batch, seq, hidden]``)
    took such rows for one unbatched sequence: every token attended to later tokens and to other samples, and a
    trainer of a causal LM learned from the tokens it was to predict (review 100 D2). Its sample input is built on
    the meta device: no memory, whatever ``hidden_dim``."""
    with torch.device("meta"):
        sample = expert_class(name).sample(2, hidden_dim)
    if len(sample) == 1 and list(sample[0].shape) == [2, hidden_dim] and sample[0].is_floating_point():
        return None
    takes = " and ".join(f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}" for x in sample)
    return (f"expert class {name!r} takes {takes} for a batch of 2, but a mixture layer sends each expert one "
            f"[rows, {hidden_dim}] tensor of the tokens routed to it: it cannot be a mixture layer's expert")


class ExpertBuildError(ValueError):
    """An expert class refused its arguments (``hidden_dim`` and the keyword arguments): what a program reports as
    a bad flag, told apart from any other failure while it builds a server."""


def create_expert(name: str, hidden_dim: int, /, *, seed: int | None = None, **kwargs: Any) -> nn.Module:
    """Builds expert ``name``; with ``seed`` its initial weights are reproducible (e.g. to compare with a server).
    Raises :class:`ExpertBuildError` for arguments the class does not take or refuses (any exception its
    constructor raises, but running out of memory; ``name`` and ``hidden_dim`` are positional only, so that keyword
    arguments of those names are the class's to refuse, not a TypeError of this call: review 75)."""
    cls = expert_class(name).cls
    # unseeded, from the process's generator (and advancing it: experts built one after another differ)
    seeded = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with seeded:
        if seed is not None:
            # the CPU generator only (what initialisation draws from, and all fork_rng restores): torch.manual_seed
            # seeds every CUDA device too, which left a GPU process's dropout following the last expert's seed
            torch.random.default_generator.manual_seed(seed)
        try:
            return cls(hidden_dim, **kwargs)
        except (MemoryError, torch.cuda.OutOfMemoryError):
            raise
        except Exception as error:  # noqa: BLE001 - a user's class may raise anything for a bad argument
            raise ExpertBuildError(f"expert class {name!r} with hidden_dim={hidden_dim} and {kwargs} builds no "
                                   f"expert: {type(error).__name__}: {error}") from error


def expert_seed(seed: int, uid: str) -> int:
    """A reproducible per-expert seed, so experts differ from each other and a test can rebuild any one of them."""
    return (seed * 1_000_003 + zlib.crc32(uid.encode())) % 2**31
