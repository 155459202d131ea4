"""Checks of a saved optimizer state against the optimizer it is to be loaded into: a server's checkpoint, a peer's
replica, a backend's ``load_state_dict``.

``torch.optim.Optimizer.load_state_dict`` hands each saved per-parameter state to a parameter **by position** and
checks none of its buffers: a buffer of another shape reached the fused Adam kernel, which does not check sizes
either, and corrupted the heap at the first step (review 100 D1). So every buffer is checked first, against the
parameter it will be given to.
"""
from __future__ import annotations

import logging
import math
import threading
import weakref
from typing import Any, Callable

import torch

from dmoe.wire.codec import DTYPES

logger = logging.getLogger(__name__)

#: no expert trains this many steps; a count beyond it is a lie or a bug
MAX_UPDATES = 10**12

#: the shape of the stand-in parameters :func:`optimizer_buffers` steps: a buffer of this shape is one shaped like
#: its parameter (Adam's moments), any other has that shape whatever the parameter's (its step counter: ``()``)
_STAND_IN = (2, 3)
#: optimizer -> what :func:`optimizer_buffers` found for it (a template's optimizer: checks of every replica ask)
_BUFFERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[dict[Any, Any]] | None]" = \
    weakref.WeakKeyDictionary()
_BUFFERS_LOCK = threading.Lock()
LIKE_PARAMETER = "like the parameter"


def optimizer_buffers(optimizer: torch.optim.Optimizer) -> list[dict[Any, Any]] | None:
    """Per parameter (in ``state_dict`` order), the state ``optimizer``'s class and settings keep for it once it
    has stepped: key -> :data:`LIKE_PARAMETER` (a tensor of the parameter's shape), a tensor's shape (a tuple), or
    None (no tensor). Found by stepping a copy of the optimizer over small stand-in parameters once, so it holds for
    any optimizer (Adam: ``step``, ``exp_avg``, ``exp_avg_sq``, and ``max_exp_avg_sq`` with amsgrad; SGD:
    ``momentum_buffer`` with momentum, nothing without). None when that copy cannot be made or stepped."""
    with _BUFFERS_LOCK:
        if optimizer in _BUFFERS:
            return _BUFFERS[optimizer]
    try:
        groups = []
        for group in optimizer.param_groups:
            stand_ins = [torch.zeros(_STAND_IN, dtype=p.dtype, device=p.device, requires_grad=True)
                         for p in group["params"]]
            for stand_in in stand_ins:
                stand_in.grad = torch.ones_like(stand_in)
            groups.append({**{key: value for key, value in group.items() if key != "params"}, "params": stand_ins})
        trial = type(optimizer)(groups)
        trial.step()
        state = trial.state_dict()["state"]
        count = sum(len(group["params"]) for group in groups)
        found: list[dict[Any, Any]] | None = [
            {key: (LIKE_PARAMETER if tuple(value.shape) == _STAND_IN else tuple(value.shape))
             if isinstance(value, torch.Tensor) else None for key, value in state.get(index, {}).items()}
            for index in range(count)]
    except Exception as error:  # noqa: BLE001 - an optimizer this cannot copy: its state's keys go unchecked
        logger.warning("could not tell the per-parameter state of a %s (%s: %s): saved optimizer states are checked "
                       "for their tensors' shapes only", type(optimizer).__name__, type(error).__name__, error)
        found = None
    with _BUFFERS_LOCK:
        _BUFFERS[optimizer] = found
    return found


def _floating(dtype: torch.dtype | str) -> bool | None:
    """Whether ``dtype`` (a torch dtype, or a wire dtype's name) is a real floating-point type; None if unknown."""
    dtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    return dtype.is_floating_point if isinstance(dtype, torch.dtype) else None


def _name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _target(index: int, at: int) -> str:
    """The parameter the state saved as ``index`` goes to: the one at position ``at``."""
    return "the parameter" if index == at else f"the parameter its place in the groups gives it to ({at})"


def check_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer | None, mismatch: Callable[[str], Exception],
                          *, tensor_types: tuple[type, ...] = (torch.Tensor,),
                          check_tensor: Callable[[Any, int, Any], None] | None = None) -> tuple[list[Any], bool]:
    """Checks a saved optimizer state (``optimizer.state_dict()``'s form; its tensors are ``tensor_types``, values
    with ``shape`` and ``dtype``: torch tensors, or a replica's unread tensor references) against ``optimizer``'s
    parameters: each parameter's state is empty (it has not stepped) or holds exactly the buffers ``optimizer``
    keeps for it (:func:`optimizer_buffers`), each a tensor of the right shape, and floating-point where it is like
    a floating-point parameter (torch converts it to the parameter's dtype). A buffer missing made an expert fail
    every training step with a KeyError, a step counter missing left the update count unchecked (review 88), a
    buffer of another shape corrupted the heap (review 100 D1). Each saved state is compared with the parameter
    ``load_state_dict`` will give it: the one at its index's position in the saved groups. ``check_tensor(key,
    index, value)`` may refuse a tensor for more reasons. Raises ``mismatch(message)``; returns the step counters
    and whether ``optimizer`` counts its steps (then a state of an expert with updates must carry them)."""
    if optimizer is None:
        if saved is not None:
            raise mismatch("it carries an optimizer state, this server's experts have no optimizer")
        return [], False
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    shapes = [tuple(p.shape) for p in parameters]
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise mismatch("its optimizer state is not a torch optimizer's state_dict")
    indices = [i for group in saved["param_groups"] if isinstance(group, dict)
               for i in (group.get("params") if isinstance(group.get("params"), list) else [None])]
    sizes = [len(group["params"]) if isinstance(group, dict) and isinstance(group.get("params"), list) else None
             for group in saved["param_groups"]]
    if sizes != [len(group["params"]) for group in optimizer.param_groups] or sorted(
            i for i in indices if isinstance(i, int) and not isinstance(i, bool)) != list(range(len(shapes))):
        raise mismatch(f"its optimizer covers other parameters than the {len(shapes)} of this server's experts")
    position = {index: at for at, index in enumerate(indices)}  # what load_state_dict gives index's state to
    buffers = optimizer_buffers(optimizer)
    if buffers is not None and len(buffers) != len(shapes):
        buffers = None
    counts_steps = buffers is not None and any(kept.get("step") == () for kept in buffers)
    steps = []
    for index, per_parameter in saved["state"].items():
        if isinstance(index, bool) or index not in position or not isinstance(per_parameter, dict):
            raise mismatch(f"optimizer state of unknown parameter {index!r}")
        at = position[index]
        kept = buffers[at] if buffers is not None else None
        if kept is not None and per_parameter and set(per_parameter) != set(kept):
            raise mismatch(f"optimizer state of parameter {index} holds {sorted(map(str, per_parameter))[:8]}, "
                           f"this server's {type(optimizer).__name__} keeps {sorted(map(str, kept))} for it")
        for key, value in per_parameter.items():
            want = kept.get(key) if kept is not None else None
            if not isinstance(value, tensor_types):
                if want is not None:
                    raise mismatch(f"optimizer state {key} of parameter {index} is {repr(value)[:40]}, not a tensor")
                continue
            if check_tensor is not None:
                check_tensor(key, index, value)
            if kept is not None and want is None:
                raise mismatch(f"optimizer state {key} of parameter {index} is a tensor, this server's "
                               f"{type(optimizer).__name__} keeps none there")
            shape = shapes[at] if want in (None, LIKE_PARAMETER) else want
            if key == "step" and tuple(value.shape) == () and want in (None, ()):
                steps.append(value)
            elif tuple(value.shape) != shape:
                raise mismatch(f"optimizer state {key} of parameter {index} is {list(value.shape)}, "
                               + (f"{_target(index, at)} is {list(shape)}" if shape == shapes[at] else
                                  f"this server's optimizer keeps {list(shape)}"))
            elif want in (None, LIKE_PARAMETER) and _floating(parameters[at].dtype) \
                    and _floating(value.dtype) is False:
                raise mismatch(f"optimizer state {key} of parameter {index} is {_name(value.dtype)}, "
                               f"{_target(index, at)} is {_name(parameters[at].dtype)}")
    return steps, counts_steps


def whole_steps(value: Any) -> int | None:
    """An optimizer's step counter (a Python number) as an int, or None unless it is a whole number of steps from 0
    to :data:`MAX_UPDATES`. ``int()`` of +inf raised OverflowError (of NaN, ValueError), which no caller expected
    (review 78); a NaN count made Adam's bias correction, and so the weights, NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # (a complex number, say)
    if not math.isfinite(value) or value < 0 or value > MAX_UPDATES or value != int(value):
        return None
    return int(value)
