"""Hostile input for an expert server, shared by tests/test_fuzz.py and benchmarks/bench_fuzz.py.

Cases are hypothesis strategies: structured requests with junk in every field (lying shapes, wrong and unknown
dtypes, NaN/Inf, truncated and oversized buffers, unknown uids, out-of-range enums), valid requests mutated at the
byte level, and random bytes sent as the serialized message through a generic channel with identity serializers.
Some forward and backward cases travel through shared memory (``call_shared``, dmoe/wire/shared_memory.py): the
same bytes, written into a segment of this process. :func:`send` answers each case with the status code it got;
:func:`check_outcome` says whether that answer is one a healthy server may give.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from hypothesis import strategies as st

from dmoe.wire import dmoe_pb2, serialize, status_code
from dmoe.wire import shared_memory as shm
from dmoe.wire.codec import DTYPES, deserialize, join_parts

SERVICE = "/dmoe.ExpertService/"
#: What a server may answer a hostile case with (FAILED_PRECONDITION: a backward naming inputs it does not hold).
#: INTERNAL (a request that passed validation and then failed inside compute), UNKNOWN (an exception escaping a
#: handler, or junk bytes that did not parse), DEADLINE_EXCEEDED (a hang) and UNAVAILABLE (a dead server) are
#: failures of the server: validation should have refused the request with a status naming what is wrong.
CLEAR_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
               grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}
DEADLINE = 20.0


@dataclass(frozen=True)
class Target:
    """The server under fuzz: the experts' uids and schema (every expert takes ``[batch, hidden]`` float32)."""

    uids: tuple[str, ...]
    hidden: int
    max_batch: int


@dataclass
class Case:
    """One hostile call: ``rpc`` is a method of ExpertService; ``payload`` serialized bytes or a list of them
    (one per message of a streaming call)."""

    rpc: str
    payload: bytes | list[bytes]
    kind: str
    shared: bool = False  # sent through shared memory (call_shared) instead of as the call's own message


def _floats(rows: int, hidden: int, special: str) -> torch.Tensor:
    x = torch.randn(rows, hidden)
    if special != "finite":
        x.view(-1)[0] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "huge": 3e38}[special]
    return x


@st.composite
def junk_tensor(draw, target: Target) -> dmoe_pb2.Tensor:
    """A tensor message whose every field may lie."""
    hidden = target.hidden
    shape = draw(st.one_of(
        st.just([draw(st.integers(1, target.max_batch)), hidden]),
        st.lists(st.integers(-3, 2 * hidden), max_size=4),
        st.lists(st.sampled_from([0, 1, -1, 2**31, 2**62, -(2**63), 2**63 - 1]), max_size=9),
    ))
    dtype = draw(st.one_of(st.sampled_from(sorted(DTYPES)), st.text(max_size=12)))
    numel = math.prod(shape) if shape and all(0 <= d < 2**20 for d in shape) else 4
    honest = numel * 4 if numel < 2**16 else 16
    length = draw(st.one_of(st.just(honest), st.integers(0, 2 * honest + 8), st.sampled_from([0, 1, 3, honest - 1,
                                                                                               honest + 1])))
    length = max(0, length)
    buffer = (draw(st.binary(min_size=length, max_size=length)) if length < 512
              else bytes([draw(st.integers(0, 255))]) * length)
    return dmoe_pb2.Tensor(
        buffer=buffer, shape=shape, dtype=dtype,
        compression=draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(-2**31, 2**31 - 1))),
        aux=draw(st.binary(max_size=24)), parts=draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1))),
    )


@st.composite
def plausible_tensor(draw, target: Target) -> dmoe_pb2.Tensor:
    """A well-formed tensor, possibly of the right schema, holding NaN/Inf or extreme values now and then."""
    rows = draw(st.integers(1, target.max_batch + 2))
    special = draw(st.sampled_from(["finite", "finite", "nan", "inf", "-inf", "huge"]))
    x = _floats(rows, draw(st.sampled_from([target.hidden, target.hidden, target.hidden + 1])), special)
    x = x.to(draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.float64, torch.int64])))
    return serialize(x, draw(st.sampled_from([0, 0, 1, 2])))


def uids(target: Target):
    return st.one_of(st.sampled_from(target.uids), st.text(max_size=20), st.just(target.uids[0] + "\x00"))


@st.composite
def structured_request(draw, target: Target) -> dmoe_pb2.ExpertRequest:
    tensors = draw(st.lists(st.one_of(junk_tensor(target), plausible_tensor(target)), max_size=3))
    compression = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(-2**31, 2**31 - 1)))
    return dmoe_pb2.ExpertRequest(uid=draw(uids(target)), tensors=tensors, response_compression=compression)


def valid_request(target: Target, rpc: str, rows: int = 4, uid: str | None = None) -> dmoe_pb2.ExpertRequest:
    tensors = [serialize(torch.randn(rows, target.hidden))]
    if rpc == "backward":
        tensors.append(serialize(torch.randn(rows, target.hidden)))
    return dmoe_pb2.ExpertRequest(uid=uid or target.uids[0], tensors=tensors)


@st.composite
def mutated_bytes(draw, target: Target, rpc: str) -> bytes:
    """A valid request's bytes with a few flips, cuts, insertions and duplications: mostly not parseable,
    sometimes parseable into a different (lying) request."""
    if rpc.endswith("_batch"):
        kind = rpc.removesuffix("_batch")
        items = [valid_request(target, kind, draw(st.integers(1, 6)), uid=draw(st.sampled_from(target.uids)))
                 for _ in range(draw(st.integers(1, 3)))]
        data = bytearray(dmoe_pb2.BatchRequest(items=items).SerializeToString())
    else:
        data = bytearray(valid_request(target, rpc, draw(st.integers(1, 6))).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "duplicate", "set"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[at:at + draw(st.integers(1, 64))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "duplicate":
            data[at:at] = data[at:at + draw(st.integers(1, 64))]
        elif op == "set" and data:
            data[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x1A]))
    return bytes(data)


RPCS = ["forward", "backward", "forward", "backward", "info", "forward_batch", "backward_batch"]


@st.composite
def cases(draw, target: Target) -> Case:
    rpc = draw(st.sampled_from(RPCS + ["forward_stream", "backward_stream", "hold"]))
    if rpc == "hold":  # short or malformed: a valid hold of 60 s would only outlast the deadline
        seconds = draw(st.sampled_from([-1.0, -0.0, 0.0, 0.01, float("nan"), float("inf"), float("-inf")]))
        return Case(rpc, dmoe_pb2.Hold(seconds=seconds).SerializeToString(), "structured")
    kind = draw(st.sampled_from(["structured", "structured", "mutated", "random bytes"]))
    if rpc.endswith("_stream"):
        messages = draw(st.lists(structured_request(target), max_size=3))
        return Case(rpc, [m.SerializeToString() for m in messages], "stream")
    if rpc == "info":
        if kind == "structured":
            return Case(rpc, dmoe_pb2.ExpertUID(uid=draw(uids(target))).SerializeToString(), kind)
        return Case(rpc, draw(st.binary(max_size=64)), "random bytes")
    case = draw(_unary_case(target, rpc, kind))
    if shm.AVAILABLE and draw(st.integers(0, 2)) == 0:  # a third of the unary calls through shared memory
        case.shared, case.kind = True, f"{case.kind} (shared memory)"
    return case


@st.composite
def _unary_case(draw, target: Target, rpc: str, kind: str) -> Case:
    if kind == "structured":
        if rpc.endswith("_batch"):
            # junk items beside valid ones: each must get its own clear status
            items = draw(st.lists(st.one_of(structured_request(target), st.builds(
                valid_request, st.just(target), st.just(rpc.removesuffix("_batch")), st.integers(1, 6),
                st.sampled_from(target.uids))), max_size=4))
            return Case(rpc, dmoe_pb2.BatchRequest(items=items).SerializeToString(), kind)
        return Case(rpc, draw(structured_request(target)).SerializeToString(), kind)
    if kind == "mutated":
        return Case(rpc, draw(mutated_bytes(target, rpc)), kind)
    return Case(rpc, draw(st.binary(max_size=2048)), kind)


def spare(case: Case, uid: str) -> Case:
    """``case`` with its backward turned into the same forward if its bytes name expert ``uid``: that expert is
    never trained, so it can be checked against a local copy after the fuzzing."""
    if case.rpc.startswith("backward") and isinstance(case.payload, bytes) and uid.encode() in case.payload:
        case.rpc = case.rpc.replace("backward", "forward")
    return case


def _send_shared(channel: grpc.Channel, case: Case) -> bytes:
    """``case``'s bytes through a fresh segment; the answer's bytes (from the segment or inline). A refusal (this
    server would not map the segment) raises, as an unclear outcome: the fuzzed servers run on this host."""
    payload = case.payload
    segment = shm.Segment(shm.HEADER_BYTES + 2 * len(payload) + 2 * shm.ALIGN + (1 << 16))
    try:
        segment.view[shm.HEADER_BYTES:shm.HEADER_BYTES + len(payload)] = payload
        answer_offset = shm.HEADER_BYTES + -(-len(payload) // shm.ALIGN) * shm.ALIGN
        request = dmoe_pb2.SharedMemoryCall(
            method=case.rpc, pid=os.getpid(), fd=segment.fd, key=segment.key, request_offset=shm.HEADER_BYTES,
            request_length=len(payload), answer_offset=answer_offset, answer_capacity=segment.size - answer_offset)
        call = channel.unary_unary(SERVICE + "call_shared", request_serializer=None, response_deserializer=None)
        answer = dmoe_pb2.SharedMemoryAnswer.FromString(call(request.SerializeToString(), timeout=DEADLINE))
        if answer.refused:
            raise AssertionError(f"the server refused a segment of a client on its host: {answer.refused}")
        if answer.answer_length:
            return bytes(segment.view[answer_offset:answer_offset + answer.answer_length])
        return answer.inline_answer
    finally:
        segment.close()


def send(channel: grpc.Channel, case: Case) -> tuple[grpc.StatusCode, str, bytes | list[bytes] | None]:
    """Sends ``case`` as raw bytes; returns (status code, details, raw response or responses)."""
    try:
        if case.shared:
            return grpc.StatusCode.OK, "", _send_shared(channel, case)
        if isinstance(case.payload, list):
            call = channel.stream_stream(SERVICE + case.rpc, request_serializer=None, response_deserializer=None)
            return grpc.StatusCode.OK, "", list(call(iter(case.payload), timeout=DEADLINE))
        call = channel.unary_unary(SERVICE + case.rpc, request_serializer=None, response_deserializer=None)
        return grpc.StatusCode.OK, "", call(case.payload, timeout=DEADLINE)
    except grpc.RpcError as error:
        return error.code(), error.details() or "", None


def answer_problem(tensors, request: dmoe_pb2.ExpertRequest, target: Target) -> str | None:
    """What is wrong with the tensors of an OK unary answer (or batch item) to ``request``; None when they decode
    into the one float32 ``[rows, hidden]`` tensor the schema promises, ``rows`` being those of the request's first
    tensor (a forward's inputs, a backward's inputs whose gradient it answers with). Checking the shape field alone
    passed an answer whose buffer was truncated or whose dtype was bogus (review 72)."""
    if len(tensors) != 1:
        return f"{len(tensors)} tensors, not 1"
    try:
        decoded = deserialize(tensors[0])
    except Exception as error:  # noqa: BLE001 - any failure to read the answer back is the finding
        return f"it does not decode: {error}"
    if decoded.dtype != torch.float32:
        return f"dtype {decoded.dtype}, not float32"
    rows = request.tensors[0].shape[0] if request.tensors and request.tensors[0].shape else None
    if list(decoded.shape) != [rows, target.hidden]:
        return f"shape {list(decoded.shape)}, not [{rows}, {target.hidden}] for the request's {rows} rows"
    return None


def check_outcome(case: Case, code: grpc.StatusCode, details: str, response, target: Target) -> str | None:
    """None when the answer is a clear one; otherwise what is wrong with it."""
    if code not in CLEAR_CODES:
        return f"{case.kind} {case.rpc}: unclear status {code.name}: {details}"
    if code != grpc.StatusCode.OK and not details:
        return f"{case.kind} {case.rpc}: status {code.name} without a message"
    if code == grpc.StatusCode.OK and case.rpc in ("forward", "backward"):
        request = dmoe_pb2.ExpertRequest.FromString(case.payload)  # it parsed on the server, so here too
        problem = answer_problem(dmoe_pb2.ExpertResponse.FromString(response).tensors, request, target)
        if problem is not None:
            return f"{case.kind} {case.rpc}: answered with a malformed response: {problem}"
    if code == grpc.StatusCode.OK and case.rpc.endswith("_stream"):
        try:
            tensors = join_parts([dmoe_pb2.ExpertResponse.FromString(r).tensors for r in response], 1 << 30)
            decoded = [deserialize(t) for t in tensors]
        except Exception as error:  # noqa: BLE001 - any failure to read the answer back is the finding
            return f"{case.kind} {case.rpc}: answered with a stream that does not decode: {error}"
        if len(decoded) != 1 or list(decoded[0].shape[1:]) != [target.hidden]:
            return f"{case.kind} {case.rpc}: answered with malformed streamed tensors"
    if code == grpc.StatusCode.OK and case.rpc == "hold" and dmoe_pb2.HoldEnd.FromString(response).stopping:
        return f"{case.kind} hold: answered that the server is stopping while it serves"
    if code == grpc.StatusCode.OK and case.rpc == "info":
        info = dmoe_pb2.ExpertInfo.FromString(response)
        if info.uid not in target.uids or [list(s.shape) for s in info.inputs] != [[target.hidden]]:
            return f"{case.kind} info: answered with a malformed ExpertInfo for {info.uid!r}"
    if code == grpc.StatusCode.OK and case.rpc.endswith("_batch"):
        items = dmoe_pb2.BatchRequest.FromString(case.payload).items  # it parsed on the server, so here too
        results = dmoe_pb2.BatchResponse.FromString(response).results
        if len(results) != len(items):
            return f"{case.kind} {case.rpc}: {len(results)} results for {len(items)} items"
        for result in results:
            item_code = status_code(result.code)
            if item_code not in CLEAR_CODES:
                return f"{case.kind} {case.rpc}: an item got the unclear status {result.code}: {result.message}"
            if result.code != 0 and not result.message:
                return f"{case.kind} {case.rpc}: an item got status {item_code.name} without a message"
        for item, result in zip(items, results):
            problem = answer_problem(result.tensors, item, target) if result.code == 0 else None
            if problem is not None:
                return f"{case.kind} {case.rpc}: an item was answered with malformed tensors: {problem}"
    return None


def junk_on_tcp(endpoint: str, data: bytes, timeout: float = 10.0) -> str:
    """Opens a plain TCP connection to the gRPC port, writes ``data`` and reads until the server closes or goes
    quiet; returns how the connection ended."""
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
            return "closed"
        except socket.timeout:
            return "timeout"
        except OSError as error:  # reset by the server: also a clear refusal
            return type(error).__name__


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def junk_streams(seed: int, count: int) -> list[bytes]:
    """Raw junk for the TCP port: random bytes, HTTP/1 requests, and a valid HTTP/2 preface followed by junk."""
    rng = np.random.default_rng(seed)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    out = []
    for i in range(count):
        junk = rng.integers(0, 256, int(rng.integers(0, 4096)), dtype=np.uint8).tobytes()
        out.append([junk, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + junk, preface + junk,
                    preface + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + junk, b""][i % 5])
    return out
