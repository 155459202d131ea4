"""A trainer's state (dense parameters, optimizer state, global step), served to trainers that join late or fell
behind, and downloaded from a live trainer over gRPC (``CollaborationService`` in ``proto/dmoe.proto``).

The state travels as tensors in the wire codec's format (a large one cut into parts, ``Tensor.parts``) plus one
JSON text for what the optimizer holds besides tensors (its param groups' settings, per-parameter scalars). The
receiver refuses a state that does not fit its own model and optimizer exactly (another number of parameters,
another shape or dtype, non-finite values, other parameter groups, optimizer state of another shape or kind or
with other keys than its optimizer holds, or would hold after a first step, a negative step), that its optimizer
could not step with (a trial step on copies raises or leaves a NaN or Inf: Adam's moments missing, a negative
second moment), or that it could not publish as its own (a malformed lineage) with :class:`StateMismatch`, whose
message names what differs, before anything is written. It keeps its own optimizer settings (:func:`load_state`).
A download is bounded in bytes and messages (:func:`download_limits`), whatever the sender streams. The server
(:class:`StateServer`) is bounded too, whatever its clients do: a download ends after about ``state_timeout``
even when the client stops reading, and a machine may hold only a few downloads at once.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
import torch

from dmoe.collab.progress import MAX_GROUP_SIZE, RECORD_MAX_STEP, check_lineage
from dmoe.endpoints import PortUnavailable, join_host_port, peer_machine, reachable_endpoint
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc, grpc_options
from dmoe.wire.channels import MAX_MESSAGE_BYTES, STREAM_PART_BYTES
from dmoe.wire.codec import (
    DTYPES,
    NONE,
    Compression,
    InvalidTensor,
    TensorTooLarge,
    cut_into_parts,
    deserialize,
    join_parts,
    serialize,
)

logger = logging.getLogger(__name__)


class StateMismatch(ValueError):
    """A downloaded state that does not fit this trainer's model or optimizer."""


class StateDownloadError(RuntimeError):
    """A state that could not be downloaded: the peer is unreachable, refused, or sent something malformed.
    ``code``: the gRPC status that ended the download, if one did (UNAVAILABLE: no connection could be made)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


@dataclass
class TrainingState:
    """What a trainer joining the collaboration needs: the dense parameters (in the optimizer's order), the
    optimizer's ``state_dict``, the global step and the parameters' lineage (see :mod:`dmoe.collab.progress`)."""

    step: int
    lineage: str
    group_size: int
    parameters: list[torch.Tensor]
    optimizer: dict

    @classmethod
    def capture(cls, step: int, lineage: str, group_size: int, parameters: Sequence[torch.Tensor],
                optimizer: torch.optim.Optimizer) -> "TrainingState":
        """A copy of the live state (the caller holds the lock that keeps the training loop off it)."""
        saved = optimizer.state_dict()
        copied = {"param_groups": [dict(group) for group in saved["param_groups"]],
                  "state": {index: {key: value.detach().cpu().clone() if torch.is_tensor(value) else value
                                    for key, value in entry.items()} for index, entry in saved["state"].items()}}
        return cls(step, lineage, group_size, [p.detach().cpu().clone() for p in parameters], copied)


def encode_state(state: TrainingState, run_id: str, part_bytes: int = STREAM_PART_BYTES) -> list[dmoe_pb2.StatePart]:
    """The messages of one download, built once per state and sent to every joiner."""
    named = [(f"param.{i}", p) for i, p in enumerate(state.parameters)]
    scalars: dict[str, dict] = {}
    for index, entry in state.optimizer["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                named.append((f"opt.{index}.{key}", value))
            else:
                scalars.setdefault(str(index), {})[key] = value
    try:
        optimizer_json = json.dumps({"param_groups": state.optimizer["param_groups"], "state": scalars})
    except TypeError as error:
        raise ValueError(f"the optimizer's state holds values that cannot be sent: {error}") from None
    messages: list[dmoe_pb2.StatePart] = []
    for name, tensor in named:
        for i, group in enumerate(cut_into_parts([serialize(tensor.contiguous())], part_bytes)):
            for j, part in enumerate(group):
                message = dmoe_pb2.StatePart(tensor=part)
                if i == 0 and j == 0:
                    message.name = name
                messages.append(message)
    head = messages[0]
    head.run_id, head.step, head.lineage, head.group_size = run_id, state.step, state.lineage, state.group_size
    head.optimizer_json, head.tensors = optimizer_json, len(named)
    return messages


#: an index of a parameter as a state names it: ASCII digits only (``str.isdigit`` takes "²", which ``int`` refuses)
_INDEX = re.compile(r"[0-9]{1,9}")


def _index(text: str) -> int | None:
    """``text`` as a parameter index, or None when it is not one."""
    return int(text) if _INDEX.fullmatch(text) else None


def decode_state(messages: Sequence[dmoe_pb2.StatePart], max_bytes: int,
                 parameters: Sequence[torch.Tensor] | None = None) -> TrainingState:
    """The state a stream carried; raises :class:`StateDownloadError` for a malformed one, whatever breaks on it:
    the sender is any peer that publishes a record, and a payload that raised anything else (a RecursionError from
    a deeply nested JSON) crashed the trainer that downloaded it instead of getting its sender banned.

    Every tensor's header is checked before any tensor is joined or decoded (:class:`_Layout`): a compressed one is
    malformed (:func:`encode_state` never compresses, and a UINT8 tensor declared float64 decoded to 8 times its
    bytes on the wire, review 87), and given this trainer's ``parameters``, one of another shape or dtype than they
    imply is refused with :class:`StateMismatch`, so that nothing of a size the model does not call for is
    allocated: decoded, the tensors take no more memory than their bytes on the wire."""
    try:
        return _decode_state(messages, max_bytes, parameters)
    except (StateDownloadError, StateMismatch):
        raise
    except Exception as error:  # noqa: BLE001 - any failure on a peer's payload is that peer's malformed state
        raise StateDownloadError(f"malformed state: {type(error).__name__}: {str(error)[:200]}") from None


class _Layout:
    """What a state's tensors must be, checked on each one's header (the first message of its parts) as the
    messages come: a name on each header and on nothing else (``param.<i>`` in order, or ``opt.<i>.<key>``), no
    compression, and given ``parameters`` (the
    trainer's, in the optimizer's order) their shapes and dtypes: ``param.<i>`` parameter i's, ``opt.<i>.<key>`` of
    parameter i's shape (``step``: a scalar) and floating point where the parameter is. The rest (how many tensors,
    values, keys, the optimizer's settings) is for :func:`_decode_state` and :func:`check_state`. Raises
    :class:`StateDownloadError` for a malformed stream, :class:`StateMismatch` for a state of another model."""

    def __init__(self, parameters: Sequence[torch.Tensor] | None = None):
        self.parameters = parameters
        self.names: list[str] = []
        self._params = 0

    def see(self, message: dmoe_pb2.StatePart) -> None:
        tensor = message.tensor  # the header's fields only: its buffer is not read (every read copies it)
        if tensor.parts < 1:
            if message.name:
                raise StateDownloadError(f"malformed state: the name {_short(message.name)} on a tensor's "
                                         f"continuation part")
            return
        if not message.name:
            raise StateDownloadError("malformed state: a tensor without a name")
        if tensor.compression != NONE:
            raise StateDownloadError(f"malformed state: tensor {_short(message.name)} is compressed "
                                     f"({Compression.Name(tensor.compression)}); a state's tensors are sent as "
                                     f"they are")
        self._expect(message.name, list(tensor.shape), tensor.dtype)
        self.names.append(message.name)

    def _expect(self, name: str, shape: list[int], dtype_name: str) -> None:
        kind, _, rest = name.partition(".")
        index, _, key = rest.partition(".")
        if kind == "param" and rest == str(self._params):
            index, self._params = self._params, self._params + 1
        elif not (kind == "opt" and key and _index(index) is not None):
            raise StateDownloadError(f"malformed state: unexpected tensor {_short(name)}")
        if self.parameters is None:
            return
        dtype, index, count = DTYPES.get(dtype_name), int(index), len(self.parameters)
        if dtype is None:
            raise StateDownloadError(f"malformed state: tensor {_short(name)} has unknown dtype {_short(dtype_name)}")
        if kind == "param":
            if index >= count:
                raise StateMismatch(f"the state holds more than {count} parameter tensors, this model {count}")
            mine = self.parameters[index]
            if shape != _shape(mine):
                raise StateMismatch(f"parameter {index} has shape {shape} in the state, {_shape(mine)} here")
            if dtype != mine.dtype:
                raise StateMismatch(f"parameter {index} is {dtype} in the state, {mine.dtype} here")
            return
        if index >= count:
            raise StateMismatch(f"the optimizer's state names parameter {index}; this model has {count}")
        where, parameter = f"optimizer state {key!r} of parameter {index}", self.parameters[index]
        if key == "step":
            if shape or dtype == torch.bool:
                raise StateMismatch(f"{where} is not a real scalar: {dtype} of shape {shape}")
        elif shape != _shape(parameter):
            raise StateMismatch(f"{where} has shape {shape} in the state, the parameter {_shape(parameter)} here")
        elif parameter.is_floating_point() and not dtype.is_floating_point:
            raise StateMismatch(f"{where} is {dtype}, not floating point")


def _decode_state(messages: Sequence[dmoe_pb2.StatePart], max_bytes: int,
                  parameters: Sequence[torch.Tensor] | None = None) -> TrainingState:
    if not messages:
        raise StateDownloadError("the state stream was empty")
    head = messages[0]
    layout = _Layout(parameters)
    for message in messages:  # before anything is joined or decoded
        layout.see(message)
    names = layout.names
    try:
        tensors = [deserialize(t) for t in join_parts([[m.tensor] for m in messages], max_bytes)]
        extra = json.loads(head.optimizer_json)
    except (InvalidTensor, TensorTooLarge, ValueError) as error:
        raise StateDownloadError(f"malformed state: {error}") from None
    if len(tensors) != head.tensors or len(names) != len(tensors) or len(set(names)) != len(names):
        raise StateDownloadError(f"malformed state: {len(tensors)} tensors and {len(names)} distinct names, the "
                                 f"header announced {head.tensors}")
    if not (isinstance(extra, dict) and isinstance(extra.get("param_groups"), list)
            and isinstance(extra.get("state"), dict)):
        raise StateDownloadError("malformed state: the optimizer's JSON lacks param_groups or state")
    parameters, optimizer_state = [], {}
    for name, tensor in zip(names, tensors):
        kind, _, rest = name.partition(".")
        if kind == "param" and rest == str(len(parameters)):
            parameters.append(tensor.clone())  # the codec's tensors share the message's read-only buffer
        elif kind == "opt" and "." in rest and _index(rest.split(".", 1)[0]) is not None:
            index, key = rest.split(".", 1)
            optimizer_state.setdefault(_index(index), {})[key] = tensor.clone()
        else:
            raise StateDownloadError(f"malformed state: unexpected tensor {name!r}")
    for index, entry in extra["state"].items():
        if not (_index(index) is not None and isinstance(entry, dict)):
            raise StateDownloadError(f"malformed state: optimizer scalars for {index!r}")
        tensors_of = optimizer_state.setdefault(_index(index), {})
        if set(entry) & set(tensors_of):
            raise StateDownloadError(f"malformed state: optimizer state {sorted(set(entry) & set(tensors_of))} of "
                                     f"parameter {index} sent both as tensors and as scalars")
        tensors_of.update(entry)
    return TrainingState(int(head.step), head.lineage, int(head.group_size), parameters,
                         {"param_groups": extra["param_groups"], "state": optimizer_state})


def _shape(t: torch.Tensor | torch.Size) -> list[int]:
    return list(t.shape if torch.is_tensor(t) else t)


def check_state(state: TrainingState, parameters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Raises :class:`StateMismatch` naming the first difference between ``state`` and this trainer's parameters
    and optimizer, or the first value it could not train on (see :func:`_check_optimizer_state`, and a trial step:
    a throwaway copy of this optimizer, over copies of the state's parameters, loads the state's optimizer values
    and steps once on zero gradients; the state is refused if that raises or leaves a NaN or Inf anywhere); writes
    nothing. The trial costs, while it runs, one more copy of the parameters, their gradients and the optimizer
    state, on the parameters' device."""
    _check_header(state)
    _check_parameters(state.parameters, parameters)
    if not isinstance(state.optimizer, dict):
        raise StateMismatch("the optimizer's state is not a dict")
    _check_param_groups(state.optimizer.get("param_groups"), optimizer)
    trial = _Trial(optimizer, parameters, state.parameters)
    entries = state.optimizer.get("state")
    _check_optimizer_state(entries, parameters, optimizer, trial)
    trial.check(entries)


def _check_header(state: TrainingState) -> None:
    """The step, lineage and group size this trainer will publish as its own: what a progress record may hold."""
    if isinstance(state.step, bool) or not isinstance(state.step, int) or not 0 <= state.step <= RECORD_MAX_STEP:
        raise StateMismatch(f"the state is at step {state.step!r}")
    try:
        check_lineage(state.lineage)
    except ValueError:
        raise StateMismatch(f"the state's lineage {_short(state.lineage)} is malformed") from None
    if isinstance(state.group_size, bool) or not isinstance(state.group_size, int) \
            or not 0 <= state.group_size <= MAX_GROUP_SIZE:
        raise StateMismatch(f"the state's last step was averaged by {state.group_size!r} trainers")


def _check_parameters(theirs_all: Sequence[torch.Tensor], parameters: Sequence[torch.Tensor]) -> None:
    if len(theirs_all) != len(parameters):
        raise StateMismatch(f"the state holds {len(theirs_all)} parameter tensors, this model {len(parameters)}")
    for i, (theirs, mine) in enumerate(zip(theirs_all, parameters)):
        if not torch.is_tensor(theirs):
            raise StateMismatch(f"parameter {i} is not a tensor in the state")
        if theirs.shape != mine.shape:
            raise StateMismatch(f"parameter {i} has shape {_shape(theirs)} in the state, {_shape(mine)} here")
        if theirs.dtype != mine.dtype:
            raise StateMismatch(f"parameter {i} is {theirs.dtype} in the state, {mine.dtype} here")
        if theirs.numel() and not bool(torch.isfinite(theirs).all()):
            raise StateMismatch(f"parameter {i} holds NaN or Inf values in the state")


def _check_param_groups(groups: object, optimizer: torch.optim.Optimizer) -> None:
    """The state's groups must list this optimizer's parameter indices, in its groups and order: the state's
    indices would name other parameters otherwise. Their hyperparameters are not taken (see :func:`load_state`)."""
    expected, start = [], 0
    for group in optimizer.param_groups:
        expected.append(list(range(start, start + len(group["params"]))))
        start += len(group["params"])
    listed = [g.get("params") if isinstance(g, dict) else None for g in groups] if isinstance(groups, list) else None
    if listed is None or listed != expected or any(
            isinstance(i, bool) or not isinstance(i, int) for params in listed for i in params):
        theirs = _short(groups if listed is None else listed)
        raise StateMismatch(f"the optimizer's parameter groups differ: params {theirs} in the state, "
                            f"{_short(expected)} here")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_optimizer_state(entries: object, parameters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                           trial: "_Trial") -> None:
    """Every value as this optimizer could step with it: keyed by a parameter's index, finite numbers, tensors of
    the parameter's exact shape (a scalar ``step``), a ``step`` >= 0, and exactly the keys this optimizer holds for
    that parameter, each a tensor where it holds one; where it holds nothing yet (a trainer that just started),
    the keys and kinds a fresh copy of it holds after one step (:meth:`_Trial.fresh_kinds`)."""
    if not isinstance(entries, dict):
        raise StateMismatch("the optimizer's state is not a dict of parameters")
    kinds: dict[str, tuple[str, int]] = {}
    for index, entry in entries.items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(parameters):
            raise StateMismatch(f"the optimizer's state names parameter {index!r}; this model has "
                                f"{len(parameters)}")
        if not isinstance(entry, dict) or not all(isinstance(key, str) for key in entry):
            raise StateMismatch(f"the optimizer's state of parameter {index} is not a dict of names")
        mine = optimizer.state.get(parameters[index])
        expected = {key: torch.is_tensor(value) for key, value in mine.items()} if mine else \
            trial.fresh_kinds().get(index)
        for key, value in entry.items():
            where = f"optimizer state {key!r} of parameter {index}"
            _check_state_value(where, key, value, parameters[index], None if expected is None else expected.get(key))
            kind, first = kinds.setdefault(key, (_kind(key, value), index))
            if _kind(key, value) != kind:
                raise StateMismatch(f"{where} is {_kind(key, value)}, that of parameter {first} {kind}")
        if expected is not None and set(entry) != set(expected):
            raise StateMismatch(f"the optimizer's state of parameter {index} holds {sorted(entry)} in the state, "
                                f"{sorted(expected)} here")


def _check_state_value(where: str, key: str, value: object, parameter: torch.Tensor, tensor_here: bool | None) -> None:
    if tensor_here is not None and tensor_here != torch.is_tensor(value):
        raise StateMismatch(f"{where} is {'not ' if tensor_here else ''}a tensor in the state, "
                            f"{'' if tensor_here else 'not '}one here")
    if key == "step":  # a count of steps (Adam's bias correction divides by 1 - beta ** step)
        if torch.is_tensor(value):
            if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
                raise StateMismatch(f"{where} is not a real scalar: {value.dtype} of shape {_shape(value)}")
            value = value.item()
        if not _non_negative(value):
            raise StateMismatch(f"{where} is {value!r}, not a finite number >= 0")
    elif torch.is_tensor(value):
        if value.shape != parameter.shape:
            raise StateMismatch(f"{where} has shape {_shape(value)} in the state, the parameter "
                                f"{_shape(parameter)} here")
        if parameter.is_floating_point() and not value.is_floating_point():
            # torch's optimizers keep a parameter's state in floating point (loading casts it to its dtype)
            raise StateMismatch(f"{where} is {value.dtype}, not floating point")
        if value.is_floating_point() and value.numel() and not bool(torch.isfinite(value).all()):
            raise StateMismatch(f"{where} holds NaN or Inf values")
    elif not (isinstance(value, bool) or _finite(value)):
        raise StateMismatch(f"{where} is {_short(value)}, not a tensor or a finite number")


def _finite(value: object) -> bool:
    """A finite int or float; an int too large for a float is not (optimizers turn numbers into float tensors)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _non_negative(value: object) -> bool:
    return _finite(value) and value >= 0


def _kind(key: str, value: object) -> str:
    """What one key's values must share across parameters: torch's optimizers convert or step them all together
    (Adam turns a number ``step`` into a tensor only when the first parameter's is one)."""
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor" if key == "step" else "a tensor"
    return f"a {type(value).__name__}"


class _NoTrial(Exception):
    """No trial step can be taken here (the optimizer cannot be copied, or there is no memory for the copy)."""


class _Trial:
    """Trial steps of a throwaway copy of ``optimizer``, each once on zero gradients: from a state, over copies of
    its parameters ``values`` (in the optimizer's order, already checked to fit ``parameters``), or from fresh
    state over copies of ``parameters`` (the trainer's own: nothing the sender chose). They tell whether this
    optimizer could step from a state, without writing into anything of the trainer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: Sequence[torch.Tensor],
                 values: Sequence[torch.Tensor]):
        self.optimizer, self.parameters, self.values = optimizer, parameters, values
        self.name = type(optimizer).__name__
        self._fresh: tuple[str | None, dict[int, dict[str, bool]]] | None = None
        self._fresh_done = False

    def check(self, entries: dict) -> None:
        """Raises :class:`StateMismatch` when a step from the optimizer values ``entries`` raises or leaves a NaN
        or Inf. A failure that a step from fresh state shares is this optimizer's (or its settings'), not the
        state's: it is logged and the state is taken on the other checks alone, as when no trial can be made
        here."""
        try:
            problem, _ = self._step({index: {key: self._copy(index, key, value) for key, value in entry.items()}
                                     for index, entry in entries.items()})
        except _NoTrial as error:
            self._skip(str(error))
            return
        if problem is None:
            return
        fresh = self._fresh_result()
        if fresh is None or fresh[0] is not None:  # logged
            return
        raise StateMismatch(problem)

    def fresh_kinds(self) -> dict[int, dict[str, bool]]:
        """The keys this optimizer holds per parameter index after one step from fresh state, each with whether
        its value is a tensor (empty when no trial step can be taken here)."""
        fresh = self._fresh_result()
        return {} if fresh is None or fresh[0] is not None else fresh[1]

    def _fresh_result(self) -> tuple[str | None, dict[int, dict[str, bool]]] | None:
        if not self._fresh_done:
            self._fresh_done = True
            try:
                self._fresh = self._step(None)
            except _NoTrial as error:
                self._skip(str(error))
            else:
                if self._fresh[0] is not None:
                    self._skip(self._fresh[0])
        return self._fresh

    def _copy(self, index: int, key: str, value: object) -> object:
        """A copy the trial may step in place (loading would otherwise share the state's tensors), on the device
        it is stepped on (loading moves it there)."""
        if not torch.is_tensor(value):
            return value
        return value.clone() if key == "step" else value.to(self.parameters[index].device, copy=True)

    def _step(self, entries: dict | None) -> tuple[str | None, dict[int, dict[str, bool]]]:
        """What went wrong in a step from ``entries`` (None: fresh state), or None; and the keys held after it."""
        try:
            with torch.no_grad():
                trial, copies = self._build(self.values if entries is not None else self.parameters)
        except (MemoryError, torch.OutOfMemoryError) as error:
            raise _NoTrial(f"no memory for a copy: {error}") from None
        except Exception as error:  # noqa: BLE001 - any constructor: one that cannot be called like torch's
            raise _NoTrial(f"it cannot be copied ({type(error).__name__}: {error})") from None
        start = f"a trial step of this {self.name} from the state" if entries is not None else \
            f"a trial step of this {self.name} from fresh state"
        try:
            if entries is not None:
                trial.load_state_dict({"param_groups": trial.state_dict()["param_groups"], "state": entries})
            for copy in copies:
                copy.grad = torch.zeros_like(copy)
            with torch.no_grad():  # as CollaborativeOptimizer steps
                if _takes_closure(trial):  # LBFGS needs one; the others call it for the loss they return
                    trial.step(lambda: torch.zeros(()))
                else:
                    trial.step()
        except (MemoryError, torch.OutOfMemoryError) as error:
            raise _NoTrial(f"no memory for a step: {error}") from None
        except Exception as error:  # noqa: BLE001 - whatever this optimizer raises on the state is the point
            return f"{start} failed: {type(error).__name__}: {error}", {}
        kinds: dict[int, dict[str, bool]] = {}
        for index, copy in enumerate(copies):
            if not _all_finite(copy):
                return f"{start} turns parameter {index} into NaN or Inf", {}
            held = trial.state.get(copy) or {}
            for key, value in held.items():
                if not _all_finite(value):
                    return f"{start} turns its optimizer state {key!r} of parameter {index} into NaN or Inf", {}
            if held:
                kinds[index] = {key: torch.is_tensor(value) for key, value in held.items()}
        return None, kinds

    def _build(self, values: Sequence[torch.Tensor]) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
        """A new optimizer of this one's class and settings (none of its hooks) over copies of ``values``."""
        copies, groups, start = [], [], 0
        for group in self.optimizer.param_groups:
            count = len(group["params"])
            group_copies = [value.detach().to(p.device, p.dtype, copy=True).requires_grad_(p.requires_grad)
                            for p, value in zip(group["params"], values[start:start + count])]
            groups.append({**group, "params": group_copies})
            copies += group_copies
            start += count
        kind = type(self.optimizer)
        try:
            return kind(groups, **self.optimizer.defaults), copies
        except TypeError:  # a constructor that does not take every default as an argument (AdamW's); the groups
            return kind(groups), copies  # hold every setting anyway

    def _skip(self, why: str) -> None:
        """Logs why no trial step decides (downloads are rare: no log flood)."""
        logger.warning("a downloaded state cannot be checked by a trial step of this %s: %s; it is checked for "
                       "shapes, kinds and finite values only", self.name, why)


def _takes_closure(optimizer: torch.optim.Optimizer) -> bool:
    try:
        return bool(inspect.signature(optimizer.step).parameters)
    except (TypeError, ValueError):
        return True


def _all_finite(value: object) -> bool:
    if torch.is_tensor(value):
        return not (value.is_floating_point() or value.is_complex()) or not value.numel() \
            or bool(torch.isfinite(value).all())
    return isinstance(value, bool) or not isinstance(value, (int, float)) or _finite(value)


def load_state(state: TrainingState, parameters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Writes a checked state into the parameters and the optimizer (the caller holds the training lock).

    Only the optimizer's per-parameter state is taken, not the sender's hyperparameters (learning rate, betas,
    weight decay...): every trainer of a collaboration runs with the same flags and sets the learning rate of
    each step itself (from the step, before it), so the sender's carry nothing this trainer lacks; and one
    peer's settings would otherwise become everyone's (a finite learning rate of 1e30 passes any check)."""
    check_state(state, parameters, optimizer)
    own_groups = optimizer.state_dict()["param_groups"]
    try:
        # first: it raises on what the checks above did not foresee, before any parameter is written
        optimizer.load_state_dict({"param_groups": own_groups, "state": state.optimizer["state"]})
    except (ValueError, KeyError, TypeError, RuntimeError, ArithmeticError) as error:
        raise StateMismatch(f"the optimizer refused the state: {error}") from None
    with torch.no_grad():
        for mine, theirs in zip(parameters, state.parameters):
            mine.copy_(theirs)


#: how long one download may take on the server's side by default (``CollaborationConfig.state_timeout``'s default)
SERVE_TIMEOUT = 60.0
#: downloads served at once by default, in all and to one machine (an IPv4 address, an IPv6 /64)
MAX_DOWNLOADS, MAX_DOWNLOADS_PER_HOST = 32, 4


class StateServicer(dmoe_pb2_grpc.CollaborationServiceServicer):
    """Answers ``download_state`` with what ``provide()`` returns (the encoded current state; None: nothing yet).

    A download ends after ``timeout`` seconds whatever the client reads (DEADLINE_EXCEEDED; :class:`StateServer`
    also closes the connection soon after, see there). At most ``max_downloads`` downloads are served at once,
    ``max_per_host`` of them to one machine: the others are refused with RESOURCE_EXHAUSTED, so that a few
    clients that open downloads and never read them cannot keep every other joiner out. ``provide()`` runs on a
    thread (it may wait for the training lock and encode the state), one call at a time."""

    def __init__(self, run_id: str, provide: Callable[[], list[dmoe_pb2.StatePart] | None], *,
                 timeout: float = SERVE_TIMEOUT, max_downloads: int = MAX_DOWNLOADS,
                 max_per_host: int = MAX_DOWNLOADS_PER_HOST):
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be positive, got {timeout}")
        if not 1 <= max_per_host <= max_downloads:
            raise ValueError(f"need 1 <= max_per_host <= max_downloads, got {max_per_host} and {max_downloads}")
        self.run_id, self.provide = run_id, provide
        self.timeout, self.max_downloads, self.max_per_host = timeout, max_downloads, max_per_host
        self._by_host: dict[str, int] = {}  # touched on the server's event loop only
        self._providing: asyncio.Lock | None = None

    def in_progress(self) -> dict[str, int]:
        """The downloads being served now, per client machine."""
        return dict(self._by_host)

    async def download_state(self, request: dmoe_pb2.StateRequest, context: grpc.aio.ServicerContext) -> None:
        if request.run_id != self.run_id:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"this trainer is in run {self.run_id!r}, not {request.run_id!r}")
        host = peer_machine(context.peer())
        if sum(self._by_host.values()) >= self.max_downloads:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this trainer serves {self.max_downloads} "
                                f"state downloads already, its most at once; try again later")
        if self._by_host.get(host, 0) >= self.max_per_host:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{host} has {self.max_per_host} state "
                                f"downloads from this trainer in progress already, the most one machine may have "
                                f"at once; try again once one ends")
        self._by_host[host] = self._by_host.get(host, 0) + 1
        deadline = asyncio.get_running_loop().time() + self.timeout
        try:
            messages = await self._provide(context)
            try:
                await asyncio.wait_for(self._send(messages, context),
                                       max(deadline - asyncio.get_running_loop().time(), 0.0))
            except asyncio.TimeoutError:
                logger.info("a state download to %s was cut after %gs unfinished", host, self.timeout)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the download took more than {self.timeout:g}s, this trainer's limit")
        finally:
            self._by_host[host] -= 1
            if not self._by_host[host]:
                del self._by_host[host]

    async def _provide(self, context: grpc.aio.ServicerContext) -> list[dmoe_pb2.StatePart]:
        if self._providing is None:
            self._providing = asyncio.Lock()
        async with self._providing:  # one capture at a time: the others then find it encoded
            try:
                messages = await asyncio.get_running_loop().run_in_executor(None, self.provide)
            except Exception as error:  # noqa: BLE001 - a failure to snapshot is the client's to hear of, and logged
                logger.exception("could not capture the state for a download")
                await context.abort(grpc.StatusCode.INTERNAL, f"could not capture the state: {error}")
        if messages is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this trainer has no state to give yet")
        return messages

    @staticmethod
    async def _send(messages: Sequence[dmoe_pb2.StatePart], context: grpc.aio.ServicerContext) -> None:
        for message in messages:
            await context.write(message)  # waits while the client does not read (HTTP/2 flow control)




class StateServer:
    """A small asyncio gRPC server that serves one trainer's state, on an event loop thread of its own (stopped by
    :meth:`close`): a download stalled by a client that does not read holds no thread, only its place among the
    servicer's ``max_downloads``.

    A stalled download cannot be ended by the server's own code (its status waits behind the message that does not
    leave), so the transport ends it: every connection is told to go away after about the servicer's ``timeout``
    (gRPC's ``max_connection_age``, within 10%) and closed, with whatever it still carries, a fifth of that later.
    A joiner opens a connection per download and is not hurt: its own deadline passes first."""

    def __init__(self, servicer: StateServicer, host: str = "127.0.0.1", port: int = 0):
        self._server: grpc.aio.Server | None = None
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="dmoe-state", daemon=True)
        self._thread.start()
        try:
            bound = asyncio.run_coroutine_threadsafe(self._serve(servicer, host, port), self._loop).result(30)
        except BaseException:
            self.close()
            raise
        self.endpoint = reachable_endpoint(host, bound)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    async def _serve(self, servicer: StateServicer, host: str, port: int) -> int:
        age_ms = int(servicer.timeout * 1000)
        self._server = grpc.aio.server(options=grpc_options() + [
            ("grpc.max_connection_age_ms", age_ms), ("grpc.max_connection_age_grace_ms", max(age_ms // 5, 1000))])
        dmoe_pb2_grpc.add_CollaborationServiceServicer_to_server(servicer, self._server)
        address = join_host_port(host, port)
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError:  # what gRPC raises when it cannot bind
            bound = 0
        if bound == 0:
            raise PortUnavailable.at("state server", address)
        await self._server.start()
        return bound

    def close(self) -> None:
        """Stops serving (downloads in progress get a second to finish) and the loop's thread; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._server.stop(grace=1.0), self._loop).result(10)
            except Exception:  # noqa: BLE001 - stopping regardless
                logger.warning("the state server did not stop cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "StateServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: seconds a download waits for a connection to the trainer serving the state (within the download's timeout)
CONNECT_TIMEOUT = 5.0


def download_state(endpoint: str, run_id: str, timeout: float, max_bytes: int,
                   max_messages: int = 10_000, connect_timeout: float = CONNECT_TIMEOUT,
                   check_head: Callable[[int, str], None] | None = None,
                   parameters: Sequence[torch.Tensor] | None = None) -> TrainingState:
    """The state of the trainer at ``endpoint``; raises :class:`StateDownloadError` when it cannot be had. The
    stream is cut once its messages hold more than ``max_bytes`` in all (every field, not only the tensors: this
    bounds what is kept in memory) or number more than ``max_messages`` (an empty message holds no bytes, but its
    object costs memory all the same). An endpoint that gives no connection within ``connect_timeout`` (an address
    that drops packets, a port that accepts TCP and never speaks HTTP/2) fails then, not after the whole
    ``timeout``: anyone can publish a record pointing at one, and the trainer waits in its training loop.

    ``check_head(step, lineage)`` sees the first message's step and lineage before anything else is read, and raises
    :class:`StateMismatch` to cut the stream there: records naming an honest trainer's endpoint with a claim it does
    not serve had every reader pull that trainer's whole state, only to refuse it, at every step (review 77).

    ``parameters``: this trainer's (the optimizer's order). Each tensor's header is checked against them as it
    arrives (see :func:`decode_state`): a state of another model is cut at its first tensor that does not fit, with
    :class:`StateMismatch`, and a compressed tensor ends the download as malformed."""
    messages, received = [], 0
    layout = _Layout(parameters)
    # no single message beyond the cap either: gRPC holds a message whole before the loop below can count it, and
    # a peer sent one of 64 MiB (its limit) to a trainer whose whole state is a few MiB
    with grpc.insecure_channel(endpoint, options=grpc_options(min(MAX_MESSAGE_BYTES, max_bytes + 1))) as channel:
        if not _connects(channel, min(connect_timeout, timeout)):
            raise StateDownloadError(f"{endpoint}: UNAVAILABLE: no connection within "
                                     f"{min(connect_timeout, timeout):g}s", grpc.StatusCode.UNAVAILABLE)
        call = dmoe_pb2_grpc.CollaborationServiceStub(channel).download_state(
            dmoe_pb2.StateRequest(run_id=run_id), timeout=timeout)
        try:
            for message in call:
                if not messages and check_head is not None:
                    try:
                        check_head(int(message.step), message.lineage)
                    except StateMismatch:
                        call.cancel()
                        raise
                received += message.ByteSize()
                if received > max_bytes or len(messages) >= max_messages:
                    call.cancel()
                    raise StateDownloadError(f"{endpoint} sent more than {max_bytes} bytes or {max_messages} "
                                             f"messages of state: far more than this model's parameters and "
                                             f"optimizer state")
                try:
                    layout.see(message)
                except (StateDownloadError, StateMismatch):
                    call.cancel()
                    raise
                messages.append(message)
        except grpc.RpcError as error:
            raise StateDownloadError(f"{endpoint}: {error.code().name}: {error.details()}", error.code()) from None
    return decode_state(messages, max_bytes, parameters)


def _connects(channel: grpc.Channel, timeout: float) -> bool:
    """False when ``channel`` is still trying to connect after ``timeout`` seconds; True once it is connected or
    its connection failed (a refused port: the call then fails at once, with gRPC's own status)."""
    settled = threading.Event()

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                     grpc.ChannelConnectivity.SHUTDOWN):
            settled.set()

    channel.subscribe(watch, try_to_connect=True)
    try:
        return settled.wait(timeout)
    finally:
        channel.unsubscribe(watch)


def download_limits(parameters: Sequence[torch.Tensor], part_bytes: int = STREAM_PART_BYTES) -> tuple[int, int]:
    """The most bytes and messages a download of a state for ``parameters`` may take: the parameters and up to
    three optimizer tensors of each one's size (Adam's moments, AMSGrad's maximum) and a scalar step, cut into
    ``part_bytes`` parts (what :func:`encode_state` does), plus 1 MiB for names, settings and message headers."""
    tensor_bytes = sum(p.numel() * p.element_size() for p in parameters)
    max_bytes = 4 * tensor_bytes + (1 << 20)
    return max_bytes, 5 * len(parameters) + max_bytes // part_bytes + 1
