"""Snapshots of an expert's training state (weights, optimizer state, update count), signed by the server that
owns the expert, and every check a receiver makes before keeping one.

A :class:`~dmoe.wire.dmoe_pb2.Snapshot` holds the expert's state as named tensors (the wire codec's; the weights
optionally compressed, the optimizer's state always exact) plus a JSON layout of the nesting around them; its
serialized bytes travel and are stored as they are.
A :class:`~dmoe.wire.dmoe_pb2.ReplicaHeader` says how many bytes follow, their SHA-256, the update count, and
carries the owner's Ed25519 signature over all of it. The signature is made by the owner's DHT
:class:`~dmoe.dht.Identity` over the message of a DHT entry whose record key cannot name any record anyone stores
(``{uid}/snapshot``) and whose expiration is the time the snapshot was taken: a signature replayed as a DHT entry
would only be refused as expired.

Checks, in the order a receiver makes them (each failure a :class:`SnapshotRefused` with its gRPC status):
the signature (:func:`check_signature`), the bytes (:func:`open_body`: size, SHA-256, no more tensors than its
experts can have, parse), then the state against the receiver's own expert class (:func:`check_state`: class,
hyperparameters, every tensor's shape and dtype, every tensor part of the state, the optimizer's per-parameter
state: each parameter's empty or exactly the buffers the receiver's own optimizer keeps for it) and the update count
against the state (an optimizer that counts its steps must have taken exactly that many, a whole number, and carry
its counters when it has taken any; no more updates than backward calls).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, NamedTuple

import grpc
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from kademlia.utils import digest

from dmoe.dht import Identity
from dmoe.dht.signing import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, verify
from dmoe.replicas.records import SIGNER_HEX
from dmoe.server.backend import ExpertBackend
from dmoe.server.checkpoints import describe, fixed_hparams, to_host, with_default_arguments
from dmoe.server.optimizer_state import MAX_UPDATES, check_optimizer_state, whole_steps
from dmoe.uid import is_valid_uid
from dmoe.wire import dmoe_pb2
from dmoe.wire.codec import NONE, InvalidTensor, TensorTooLarge, deserialize, dtype_name, expected_numel, serialize

logger = logging.getLogger(__name__)

#: bytes of snapshot per streamed message
CHUNK_BYTES = 1 << 20
#: the largest message of a replica stream: a chunk of bytes and the header (a few hundred bytes), with room to
#: spare. No honest message is larger, so the replica channels take none larger, and a holder's push none: with
#: gRPC's usual 64 MiB, every endpoint an adopter probed could make it hold 64 MiB for a header (review 105 D1)
MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)
#: the parts of an expert's state that ``--replica-compression`` packs: the module's weights alone. The optimizer's
#: state goes exact: Adam's second moments are squares of gradients, mostly below float16's smallest value (6e-8)
#: late in training, and uint8 blocks round the small ones of a block down to its smallest; loaded as 0 (or far too
#: small), the next step divides the first moments by about eps and moves the weights by about 1 instead of lr
COMPRESSED_PARTS = frozenset({"module"})
_MAX_DEPTH = 16
_MAX_LAYOUT_BYTES = 4 << 20


class SnapshotRefused(ValueError):
    """A snapshot a server will not keep or load: ``code`` is the gRPC status to answer, ``reason`` a short label
    (the ``reason`` of the refused-replicas metric)."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


@dataclass(frozen=True)
class SignedSnapshot:
    """A snapshot's serialized bytes with the header that vouches for them (as pushed, fetched and stored)."""

    header: dmoe_pb2.ReplicaHeader
    body: bytes

    @property
    def uid(self) -> str:
        return self.header.uid

    @property
    def updates(self) -> int:
        return self.header.updates

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[dmoe_pb2.ReplicaChunk]:
        """The stream that carries it: the header with the first bytes, then the rest in ``chunk_bytes`` pieces."""
        yield dmoe_pb2.ReplicaChunk(header=self.header, data=self.body[:chunk_bytes])
        for start in range(chunk_bytes, len(self.body), chunk_bytes):
            yield dmoe_pb2.ReplicaChunk(data=self.body[start:start + chunk_bytes])


# ---- taking and signing ----

def take(backend: ExpertBackend, pause: Callable[[], ContextManager[Any]] | None = None,
         compression: int = NONE) -> dmoe_pb2.Snapshot:
    """The expert's state now, copied while ``pause`` holds (the runtime's: no optimizer step half done), encoded
    afterwards. ``compression`` packs the module's floating-point tensors of one dimension or more (its weights);
    the optimizer and scheduler state always go exact (see :data:`COMPRESSED_PARTS`)."""
    with pause() if pause is not None else contextlib.nullcontext():
        backend.reset_nonfinite_optimizer_state()  # (review 111)
        state = to_host(backend.state_dict())
        counters = (backend.updates, backend.forward_calls, backend.backward_calls)
        taken_at = time.time()
    tensors: list[dmoe_pb2.NamedTensor] = []
    layout = {"d": [[part, _pack(value, part, tensors, compression if part in COMPRESSED_PARTS else NONE)]
                    for part, value in state.items()]}
    return dmoe_pb2.Snapshot(uid=backend.name, expert_cls=backend.expert_cls, hparams_json=backend.hparams_json(),
                             updates=counters[0], forward_calls=counters[1], backward_calls=counters[2],
                             taken_at=taken_at, layout_json=json.dumps(layout), tensors=tensors)


def _pack(value: Any, path: str, tensors: list[dmoe_pb2.NamedTensor], compression: int) -> Any:
    if isinstance(value, torch.Tensor):
        packed = serialize(value, compression if value.dim() >= 1 else NONE)
        tensors.append(dmoe_pb2.NamedTensor(name=path, tensor=packed))
        return {"t": len(tensors) - 1}
    if isinstance(value, dict):
        if not all(isinstance(key, (str, int)) and not isinstance(key, bool) for key in value):
            raise TypeError(f"{path or 'state'}: only str and int keys can go into a replica")
        return {"d": [[key, _pack(item, f"{path}.{key}".lstrip("."), tensors, compression)]
                      for key, item in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"l" if isinstance(value, list) else "u": [_pack(item, f"{path}.{i}", tensors, compression)
                                                          for i, item in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    raise TypeError(f"{path}: a {type(value).__name__} cannot go into a replica")


def signed_fields(header: dmoe_pb2.ReplicaHeader) -> tuple[bytes, int, str, float]:
    """(record key, subkey, value, expiration) of the DHT-entry message the owner signs (see the module doc)."""
    return (digest(f"{header.uid}/snapshot"), 0, f"{header.updates}/{header.size}/{header.sha256.hex()}",
            header.taken_at)


def sign(snapshot: dmoe_pb2.Snapshot, identity: Identity) -> SignedSnapshot:
    """Serializes ``snapshot`` and signs its header with ``identity`` (the expert's owner's)."""
    body = snapshot.SerializeToString()
    header = dmoe_pb2.ReplicaHeader(uid=snapshot.uid, updates=snapshot.updates, size=len(body),
                                    sha256=hashlib.sha256(body).digest(), taken_at=snapshot.taken_at,
                                    signer=identity.public_key)
    header.signature = identity.sign(*signed_fields(header))
    return SignedSnapshot(header, body)


# ---- checking ----

#: per-parameter tensors of an optimizer's state a snapshot can carry, at most (Adam: exp_avg and exp_avg_sq, with
#: amsgrad max_exp_avg_sq too; SGD: momentum_buffer)
OPTIMIZER_BUFFERS = 3
#: bytes a snapshot may take beyond its tensors' data: names, shapes, layout, counters, hyperparameters
SNAPSHOT_SLACK_BYTES = 1 << 20
#: tensors an LR scheduler's state may add to a snapshot, at most (torch's keep plain numbers: none)
SCHEDULER_TENSORS = 64


def max_tensors(template: ExpertBackend) -> int:
    """The most tensors a snapshot of ``template``'s experts can carry: each of the module's tensors, for each up to
    :data:`OPTIMIZER_BUFFERS` buffers and a step counter of the optimizer, and a scheduler's few
    (:data:`SCHEDULER_TENSORS`)."""
    return len(template.module.state_dict()) * (2 + OPTIMIZER_BUFFERS) + SCHEDULER_TENSORS


def max_snapshot_bytes(template: ExpertBackend) -> int:
    """The most bytes a snapshot of ``template``'s experts can take, exact: the module's tensors, as much again for
    each optimizer buffer (:data:`OPTIMIZER_BUFFERS`), and room for the rest. A replica header announcing more is
    no snapshot of these experts, whoever signed it: refused before its bytes are read."""
    tensors = template.module.state_dict()
    data = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    names = sum(64 + 2 * len(name) for name in tensors) * (2 + OPTIMIZER_BUFFERS)  # each kept as several tensors
    return data * (1 + OPTIMIZER_BUFFERS) + names + 4 * len(template.hparams_json()) + SNAPSHOT_SLACK_BYTES


def check_header(header: dmoe_pb2.ReplicaHeader, max_bytes: int) -> None:
    """Everything that can be checked before the bytes arrive: a valid uid, a sane size and a valid signature."""
    if not is_valid_uid(header.uid):
        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                              f"replica header names no valid expert uid: {header.uid!r}")
    if header.size > max_bytes:
        raise SnapshotRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large",
                              f"replica of {header.uid} has {header.size} bytes, more than the {max_bytes} this "
                              "server keeps")
    if header.updates > MAX_UPDATES:
        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "updates",
                              f"replica of {header.uid} claims an absurd update count {header.updates} "
                              f"(more than {MAX_UPDATES})")
    if len(header.sha256) != 32:
        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                              f"replica header of {header.uid} carries no SHA-256 of its bytes")
    check_signature(header)


def check_signature(header: dmoe_pb2.ReplicaHeader) -> None:
    if len(header.signer) != PUBLIC_KEY_BYTES or len(header.signature) != SIGNATURE_BYTES \
            or not verify(*signed_fields(header), header.signer, header.signature):
        raise SnapshotRefused(grpc.StatusCode.UNAUTHENTICATED, "signature",
                              f"the signature on the replica of {header.uid} does not verify against its signer's "
                              f"key {header.signer.hex()[:SIGNER_HEX]}")


def check_body(signed: SignedSnapshot) -> None:
    """Raises SnapshotRefused unless the bytes behind ``signed`` are what its header says (size, SHA-256)."""
    header = signed.header
    if len(signed.body) != header.size:
        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "truncated",
                              f"the replica of {header.uid} is truncated: the stream ended after {len(signed.body)} "
                              f"of {header.size} bytes")
    if hashlib.sha256(signed.body).digest() != header.sha256:
        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "digest",
                              f"the bytes of the replica of {header.uid} do not match the SHA-256 of its header")


def _tensor_counter() -> type:
    """A message class that reads a serialized Snapshot's tensors as plain bytes and the rest as unknown fields:
    counting them this way costs about 3x the snapshot's bytes and no Python object per tensor, where parsing the
    Snapshot built one message per tensor, 13x its bytes for millions of empty ones (review 78)."""
    tensors = dmoe_pb2.Snapshot.DESCRIPTOR.fields_by_name["tensors"]
    file = descriptor_pb2.FileDescriptorProto(name="dmoe/replicas/snapshot_tensors.proto", package="dmoe.replicas",
                                              syntax="proto3")
    message = file.message_type.add(name="SnapshotTensors")
    message.field.add(name="tensors", number=tensors.number, type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("dmoe.replicas.SnapshotTensors"))


_SnapshotTensors = _tensor_counter()


def open_body(signed: SignedSnapshot, max_tensors: int | None = None) -> dmoe_pb2.Snapshot:
    """The snapshot behind ``signed`` once its bytes match the header (size, SHA-256) and parse, with no more than
    ``max_tensors`` tensors (None: any number; counted before they are parsed, see :func:`max_tensors`)."""
    header = signed.header
    check_body(signed)
    snapshot = dmoe_pb2.Snapshot()
    try:
        if max_tensors is not None:
            counted = _SnapshotTensors()
            counted.ParseFromString(signed.body)
            if len(counted.tensors) > max_tensors:
                raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                                      f"the replica of {header.uid} carries {len(counted.tensors)} tensors, more "
                                      f"than the {max_tensors} a snapshot of this server's experts can have")
            del counted
        snapshot.ParseFromString(signed.body)
    except DecodeError as error:
        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                              f"the replica of {header.uid} is not a snapshot: {error}") from None
    if snapshot.uid != header.uid or snapshot.updates != header.updates or snapshot.taken_at != header.taken_at:
        raise SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                              f"the snapshot inside the replica of {header.uid} is of {snapshot.uid} with "
                              f"{snapshot.updates} updates, not what its header says ({header.updates})")
    return snapshot


class TensorRef(NamedTuple):
    """A tensor of a snapshot's layout before it is decoded: enough to check it."""
    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    compression: int = NONE


def layout(snapshot: dmoe_pb2.Snapshot, max_tensors: int | None = None) -> Any:
    """The snapshot's state with :class:`TensorRef` in place of tensors; every tensor message validated (dtype,
    shape, buffer length) without decoding it. Raises SnapshotRefused for anything malformed, for more than
    ``max_tensors`` tensors (None: any number; counted before anything is built for them), and for tensors the
    layout does not reference."""
    malformed = lambda message: SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",  # noqa: E731
                                                f"the state in the replica of {snapshot.uid} is malformed: {message}")
    if max_tensors is not None and len(snapshot.tensors) > max_tensors:
        # (review 78: millions of empty tensors cost ~14x their bytes in memory and ~1 s per MiB here, and passed)
        raise malformed(f"{len(snapshot.tensors)} tensors, more than the {max_tensors} a snapshot of this server's "
                        "experts can have")
    try:
        tree = json.loads(snapshot.layout_json) if len(snapshot.layout_json) <= _MAX_LAYOUT_BYTES else None
        refs = []
        for index, named in enumerate(snapshot.tensors):
            expected_numel(named.tensor, 2**40)
            refs.append(TensorRef(index, named.name, tuple(named.tensor.shape), named.tensor.dtype,
                                  named.tensor.compression))
        used: set[int] = set()
        state = _unpack(tree, refs, 0, used)
    except (ValueError, RecursionError, TypeError, KeyError, InvalidTensor, TensorTooLarge) as error:
        raise malformed(error) from None
    if len(used) != len(refs):
        unused = next(index for index in range(len(refs)) if index not in used)
        raise malformed(f"{len(refs) - len(used)} of its tensors are in no part of its state (e.g. tensor {unused}, "
                        f"{snapshot.tensors[unused].name[:80]!r})")
    return state


def _unpack(node: Any, leaves: list, depth: int, used: set[int]) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deep")
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"unexpected layout node {str(node)[:80]}")
    (kind, value), = node.items()
    if kind == "t":
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(leaves):
            raise ValueError(f"tensor index {value!r} out of range")
        used.add(value)
        return leaves[value]
    if kind == "d":
        if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
            raise ValueError("a dict must be a list of [key, value] pairs")
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k, _ in value):
            raise ValueError("dict keys must be str or int")
        return {key: _unpack(item, leaves, depth + 1, used) for key, item in value}
    if kind in ("l", "u"):
        if not isinstance(value, list):
            raise ValueError("a list must be a list")
        items = [_unpack(item, leaves, depth + 1, used) for item in value]
        return items if kind == "l" else tuple(items)
    if kind == "v" and (value is None or isinstance(value, (bool, int, float, str))):
        return value
    raise ValueError(f"unexpected layout node kind {kind!r}")


def check_state(snapshot: dmoe_pb2.Snapshot, template: ExpertBackend) -> Any:
    """Refuses a snapshot that this server's experts (``template`` is one) could not load or that lies about its
    update count; returns its layout (see :func:`layout`)."""
    uid = snapshot.uid
    mismatch = lambda message: SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "mismatch",  # noqa: E731
                                               f"replica of {uid} does not fit this server's experts: {message}")
    want = describe(template)
    if snapshot.expert_cls != want["expert_cls"]:
        raise mismatch(f"expert class {snapshot.expert_cls!r}, here {want['expert_cls']!r}")
    try:  # (an argument spelled out at its default is the same expert as one left out: review 100 D6)
        hparams = fixed_hparams(with_default_arguments({"expert_cls": snapshot.expert_cls,
                                                        "hparams_json": snapshot.hparams_json})["hparams_json"])
    except ValueError:
        raise mismatch("its hyperparameters are not a JSON object") from None
    # the seed, learning rate and clipping may differ (MAY_CHANGE)
    here = fixed_hparams(with_default_arguments(want)["hparams_json"])
    if hparams != here:
        changed = [f"{k} {hparams.get(k)!r} (here {here.get(k)!r})" for k in sorted(set(hparams) | set(here))
                   if hparams.get(k) != here.get(k)]
        raise mismatch(f"hyperparameters differ: {', '.join(changed)}")
    state = layout(snapshot, max_tensors(template))
    if not isinstance(state, dict) or set(state) != {"module", "optimizer", "scheduler"}:
        raise mismatch("its state is not an expert's (module, optimizer, scheduler)")
    module = state["module"]
    expected = {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in template.module.state_dict().items()}
    if not isinstance(module, dict) or set(module) != set(expected):
        names = set(module) if isinstance(module, dict) else set()
        raise mismatch(f"module tensors differ: missing {sorted(set(expected) - names)[:4]}, "
                       f"unexpected {sorted(names - set(expected))[:4]}")
    for name, (shape, dtype) in expected.items():
        ref = module[name]
        if not isinstance(ref, TensorRef) or (ref.shape, ref.dtype) != (shape, dtype):
            got = f"{list(ref.shape)} {ref.dtype}" if isinstance(ref, TensorRef) else repr(ref)[:40]
            raise mismatch(f"tensor {name} is {got}, this server's {want['expert_cls']} experts have "
                           f"{list(shape)} {dtype}")
    steps, counts_steps = _check_optimizer(state["optimizer"], template, mismatch)
    _check_updates(snapshot, template, steps, counts_steps)
    return state


def _check_optimizer(optimizer: Any, template: ExpertBackend,
                     mismatch: Callable[[str], Exception]) -> tuple[list[TensorRef], bool]:
    """:func:`~dmoe.server.optimizer_state.check_optimizer_state` on the snapshot's tensor references, which
    also refuses a compressed buffer (see :data:`COMPRESSED_PARTS`: loaded, it would wreck the next step)."""
    def exact(key: Any, index: int, ref: TensorRef) -> None:
        if ref.compression != NONE:
            raise mismatch(f"optimizer state {key} of parameter {index} is compressed; replicas carry the "
                           "optimizer's state exact")

    return check_optimizer_state(optimizer, template.optimizer, mismatch, tensor_types=(TensorRef,),
                                 check_tensor=exact)


def _check_updates(snapshot: dmoe_pb2.Snapshot, template: ExpertBackend, steps: list[TensorRef],
                   counts_steps: bool = False) -> None:
    uid, updates = snapshot.uid, snapshot.updates

    def absurd(message: str) -> SnapshotRefused:
        return SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, "updates",
                               f"replica of {uid} claims an absurd update count: {message}")

    if updates > snapshot.backward_calls:
        raise absurd(f"{updates} updates from {snapshot.backward_calls} backward calls (each takes at least one)")
    if template.optimizer is None and updates:
        raise absurd(f"{updates} updates of an expert without an optimizer")
    if counts_steps and updates and not steps:
        raise absurd(f"{updates} updates, but its optimizer state has taken no steps (it counts none)")
    if steps:
        counts = [_step_count(snapshot, ref) for ref in steps]
        bad = next((ref for ref, count in zip(steps, counts) if count is None), None)
        if bad is not None:
            raise absurd(f"its optimizer state {bad.name} is {_step_value(snapshot, bad)}, not a count of steps")
        taken = max(counts)
        if taken != updates:
            raise absurd(f"{updates} updates, but its optimizer state has taken {taken} steps")


def _step_value(snapshot: dmoe_pb2.Snapshot, ref: TensorRef) -> str:
    try:
        return repr(deserialize(snapshot.tensors[ref.index].tensor).item())[:40]
    except Exception as error:  # noqa: BLE001 - only for the message
        return f"unreadable ({type(error).__name__})"


def _step_count(snapshot: dmoe_pb2.Snapshot, ref: TensorRef) -> int | None:
    """An optimizer's step counter as an int, or None unless it is a whole number of steps (:func:`whole_steps`):
    a signer may send any value, and one that crashed a new server's restore aborted whole adoptions (review 78)."""
    try:
        value = deserialize(snapshot.tensors[ref.index].tensor).item()
    except Exception:  # noqa: BLE001 - an undecodable counter is no count
        return None
    return whole_steps(value)


# ---- loading ----

def materialize(state: Any, snapshot: dmoe_pb2.Snapshot) -> Any:
    """The layout with every :class:`TensorRef` decoded (writable copies: the optimizer steps them in place)."""
    if isinstance(state, TensorRef):
        return deserialize(snapshot.tensors[state.index].tensor).clone()
    if isinstance(state, dict):
        return {key: materialize(value, snapshot) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(materialize(value, snapshot) for value in state)
    return state


def load_into(backend: ExpertBackend, snapshot: dmoe_pb2.Snapshot, state: Any) -> None:
    """Makes ``backend`` the snapshot's expert: weights, optimizer state and counters (``state``: checked layout)."""
    device = next((p.device for p in backend.module.parameters()), torch.device("cpu"))
    decoded = materialize(state, snapshot)
    decoded["module"] = {name: tensor.to(device) for name, tensor in decoded["module"].items()}
    backend.load_state_dict(decoded)
    backend.updates = snapshot.updates
    backend.forward_calls, backend.backward_calls = snapshot.forward_calls, snapshot.backward_calls
