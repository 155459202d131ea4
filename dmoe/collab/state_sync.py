"""A trainer's state (dense parameters, optimizer state, global step), served to trainers that join late or fell
behind, and downloaded from a live trainer over gRPC (``CollaborationService`` in ``proto/dmoe.proto``).

The state travels as tensors in the wire codec's format (a large one cut into parts, ``Tensor.parts``) plus one
JSON text for what the optimizer holds besides tensors (its param groups' settings, per-parameter scalars). The
receiver refuses a state that does not fit its own model and optimizer (another number of parameters, another
shape or dtype, non-finite values, optimizer state of the wrong size) with :class:`StateMismatch`, whose message
names what differs, before anything is written.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
import torch

from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc, grpc_options
from dmoe.wire.channels import STREAM_PART_BYTES
from dmoe.wire.codec import InvalidTensor, TensorTooLarge, cut_into_parts, deserialize, join_parts, serialize

logger = logging.getLogger(__name__)


class StateMismatch(ValueError):
    """A downloaded state that does not fit this trainer's model or optimizer."""


class StateDownloadError(RuntimeError):
    """A state that could not be downloaded: the peer is unreachable, refused, or sent something malformed."""


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


def decode_state(messages: Sequence[dmoe_pb2.StatePart], max_bytes: int) -> TrainingState:
    """The state a stream carried; raises :class:`StateDownloadError` for a malformed one."""
    if not messages:
        raise StateDownloadError("the state stream was empty")
    head = messages[0]
    names = [m.name for m in messages if m.name]
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
        elif kind == "opt" and "." in rest and rest.split(".", 1)[0].isdigit():
            index, key = rest.split(".", 1)
            optimizer_state.setdefault(int(index), {})[key] = tensor.clone()
        else:
            raise StateDownloadError(f"malformed state: unexpected tensor {name!r}")
    for index, entry in extra["state"].items():
        if not (index.isdigit() and isinstance(entry, dict)):
            raise StateDownloadError(f"malformed state: optimizer scalars for {index!r}")
        optimizer_state.setdefault(int(index), {}).update(entry)
    return TrainingState(int(head.step), head.lineage, int(head.group_size), parameters,
                         {"param_groups": extra["param_groups"], "state": optimizer_state})


def _shape(t: torch.Tensor | torch.Size) -> list[int]:
    return list(t.shape if torch.is_tensor(t) else t)


def check_state(state: TrainingState, parameters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Raises :class:`StateMismatch` naming the first difference between ``state`` and this trainer's parameters
    and optimizer; writes nothing."""
    if len(state.parameters) != len(parameters):
        raise StateMismatch(f"the state holds {len(state.parameters)} parameter tensors, this model "
                            f"{len(parameters)}")
    for i, (theirs, mine) in enumerate(zip(state.parameters, parameters)):
        if theirs.shape != mine.shape:
            raise StateMismatch(f"parameter {i} has shape {_shape(theirs)} in the state, {_shape(mine)} here")
        if theirs.dtype != mine.dtype:
            raise StateMismatch(f"parameter {i} is {theirs.dtype} in the state, {mine.dtype} here")
        if theirs.numel() and not bool(torch.isfinite(theirs).all()):
            raise StateMismatch(f"parameter {i} holds NaN or Inf values in the state")
    groups = state.optimizer["param_groups"]
    mine_groups = optimizer.param_groups
    if len(groups) != len(mine_groups) or any(
            not isinstance(g, dict) or len(g.get("params", ())) != len(m["params"]) for g, m in zip(groups, mine_groups)):
        raise StateMismatch("the optimizer's parameter groups differ: "
                            f"{[len(g.get('params', ())) if isinstance(g, dict) else '?' for g in groups]} "
                            f"parameters per group in the state, {[len(m['params']) for m in mine_groups]} here")
    for index, entry in state.optimizer["state"].items():
        if not 0 <= index < len(parameters):
            raise StateMismatch(f"the optimizer's state names parameter {index}; this model has {len(parameters)}")
        for key, value in entry.items():
            if torch.is_tensor(value):
                if value.numel() > 1 and value.shape != parameters[index].shape:
                    raise StateMismatch(f"optimizer state {key!r} of parameter {index} has shape {_shape(value)} "
                                        f"in the state, the parameter {_shape(parameters[index])} here")
                if value.is_floating_point() and value.numel() and not bool(torch.isfinite(value).all()):
                    raise StateMismatch(f"optimizer state {key!r} of parameter {index} holds NaN or Inf values")
            elif isinstance(value, float) and not math.isfinite(value):
                raise StateMismatch(f"optimizer state {key!r} of parameter {index} is {value}")


def load_state(state: TrainingState, parameters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Writes a checked state into the parameters and the optimizer (the caller holds the training lock)."""
    check_state(state, parameters, optimizer)
    try:
        optimizer.load_state_dict(state.optimizer)  # first: it raises on what the checks above did not foresee
    except (ValueError, KeyError, TypeError) as error:
        raise StateMismatch(f"the optimizer refused the state: {error}") from None
    with torch.no_grad():
        for mine, theirs in zip(parameters, state.parameters):
            mine.copy_(theirs)


class StateServicer(dmoe_pb2_grpc.CollaborationServiceServicer):
    """Answers ``download_state`` with what ``provide()`` returns (the encoded current state; None: nothing yet)."""

    def __init__(self, run_id: str, provide: Callable[[], list[dmoe_pb2.StatePart] | None]):
        self.run_id, self.provide = run_id, provide

    def download_state(self, request: dmoe_pb2.StateRequest, context: grpc.ServicerContext):
        if request.run_id != self.run_id:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"this trainer is in run {self.run_id!r}, not {request.run_id!r}")
        try:
            messages = self.provide()
        except Exception as error:  # noqa: BLE001 - a failure to snapshot must not kill the server thread silently
            logger.exception("could not capture the state for a download")
            context.abort(grpc.StatusCode.INTERNAL, f"could not capture the state: {error}")
        if messages is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this trainer has no state to give yet")
        yield from messages


class StateServer:
    """A small gRPC server (a thread pool it owns, stopped by :meth:`close`) that serves one trainer's state."""

    def __init__(self, servicer: StateServicer, host: str = "127.0.0.1", port: int = 0, workers: int = 2):
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dmoe-state"),
                                   options=grpc_options())
        dmoe_pb2_grpc.add_CollaborationServiceServicer_to_server(servicer, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"could not listen on {host}:{port}")
        self._server.start()
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.endpoint = f"[{shown}]:{bound}" if ":" in shown else f"{shown}:{bound}"

    def close(self) -> None:
        self._server.stop(grace=1.0).wait(5)

    def __enter__(self) -> "StateServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def download_state(endpoint: str, run_id: str, timeout: float, max_bytes: int) -> TrainingState:
    """The state of the trainer at ``endpoint``; raises :class:`StateDownloadError` when it cannot be had (the
    stream is cut once it carries more than ``max_bytes`` of tensors)."""
    messages, received = [], 0
    with grpc.insecure_channel(endpoint, options=grpc_options()) as channel:
        call = dmoe_pb2_grpc.CollaborationServiceStub(channel).download_state(
            dmoe_pb2.StateRequest(run_id=run_id), timeout=timeout)
        try:
            for message in call:
                received += len(message.tensor.buffer) + len(message.tensor.aux)
                if received > max_bytes:
                    call.cancel()
                    raise StateDownloadError(f"{endpoint} sent more than {max_bytes} bytes of state: far more "
                                             f"than this model's parameters and optimizer state")
                messages.append(message)
        except grpc.RpcError as error:
            raise StateDownloadError(f"{endpoint}: {error.code().name}: {error.details()}") from None
    return decode_state(messages, max_bytes)
