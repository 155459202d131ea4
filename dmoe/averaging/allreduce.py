"""Butterfly all-reduce inside one group: parts, the owner's checks and weighted average, the member's exchange.

The tensors of every member are flattened into one float32 vector and cut into one contiguous part per member,
sized in proportion to the bandwidth each declared (DeDLOC): a member in client mode owns an empty part. Each
member streams its values of every part to that part's owner (scatter-reduce); the owner checks each piece as it
arrives, and once every member delivered (or was refused, broke its stream, was found gone, or
``allreduce_timeout`` passed) it averages the values it accepted, weighted, and streams the average back to every
sender (all-gather).

Agreement: an owner's answer names the members its average is over (its contributors). A member keeps the result
only if every part came back and all owners name the same contributors with the same total weight, itself
included. Otherwise (an owner died or answered garbage, or a refused or dying member reached some owners and not
others) the members retry among those every owner accepted, minus the owners that failed, which every survivor
computes alike from the same answers. Owners' totals over the same contributors disagree when an owner lies or a
member signed a different weight for each owner: an answer forwards, with each contributor's weight, the signature
its stream carried for it, and a member whose own signatures name different weights for different owners is left
out of the retry too (an owner cannot forge them, so no honest member is named), and so is an owner whose total is
not the sum of the weights it forwards, or that forwards a weight without its contributor's signature of it. A
member that cannot agree keeps its own values: a mix of parts averaged over different sets of peers is never
written, and neither is anything non-finite.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

import grpc
import torch

from dmoe.averaging.matchmaking import Group, Member
from dmoe.dht.signing import Identity, verify
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from dmoe.wire.codec import NONE, InvalidTensor, TensorTooLarge, deserialize, serialize

logger = logging.getLogger(__name__)

#: the dtype parts travel and are averaged in (before any compression)
DTYPE = torch.float32
DTYPE_NAME = "float32"
#: weights above this are refused: a sum of weights must stay finite and exact enough to divide by
MAX_WEIGHT = 1e12


#: what a member's signature of its stream covers is told apart from any DHT entry's (see :func:`part_digest`)
_PART_DOMAIN = b"dmoe-averaging-part-v1\x00"
#: bytes of a DHT record key's digest: a part's signed "key" has that length, as every entry's signed key does
_DIGEST_BYTES = 20


def part_digest(group_id: str, owner: int) -> bytes:
    """What a member's signature of its stream to ``owner`` in ``group_id`` is made over, in place of a DHT
    record's key (the signature is an :meth:`Identity.sign` of an entry whose expiration, 0, makes it one no DHT
    node stores). The owner is in it, so a stream's signature cannot be replayed to another owner."""
    return hashlib.blake2b(b"%s%s\x00%d" % (_PART_DOMAIN, group_id.encode(), owner), digest_size=_DIGEST_BYTES).digest()


def sign_part(identity: Identity, group_id: str, owner: int, sender: int, weight: float) -> bytes:
    """``sender``'s signature of its stream to ``owner`` in ``group_id``, with ``weight``, by its DHT key."""
    return identity.sign(part_digest(group_id, owner), sender, repr(float(weight)), 0.0)


def part_signed(key: bytes, group_id: str, owner: int, sender: int, weight: float, signature: bytes) -> bool:
    """Whether ``signature`` is the DHT key ``key``'s over ``sender``'s stream to ``owner`` in ``group_id``."""
    return verify(part_digest(group_id, owner), sender, repr(float(weight)), 0.0, key, signature)


class Refused(Exception):
    """A stream refused by a part's owner, with the gRPC status to answer it with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def partition(total: int, bandwidths: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` of each member's part of ``total`` values, sized in proportion to
    ``bandwidths`` (0: an empty part). Every member computes the same bounds from the same published floats."""
    shares = [max(0.0, float(b)) for b in bandwidths]
    largest = max(shares, default=0.0)
    if not largest > 0:
        raise ValueError("no member of the group accepts connections, nobody can own a part")
    # in [0, 1]: a leader may publish bandwidths near the float limit, whose sum (or total * share) is inf
    shares = [share / largest for share in shares]
    whole = sum(shares)
    exact = [total * share / whole for share in shares]
    sizes = [math.floor(x) for x in exact]
    # the values left by rounding down go to the largest remainders (ties: the earlier member)
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_remainder[:total - sum(sizes)]:
        sizes[i] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def bad_values(values: torch.Tensor, max_abs_value: float) -> str | None:
    """Why ``values`` (float32, CPU) must be refused, or None. numpy's min and max: two passes, no copy, and no
    torch thread team spinning on the gRPC thread afterwards."""
    if values.numel() == 0:
        return None
    array = values.numpy()
    low, high = float(array.min()), float(array.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        return "holds NaN or Inf values"
    if max_abs_value and max(-low, high) > max_abs_value:
        return f"holds a value of magnitude {max(-low, high):.3g}, above the limit {max_abs_value:g} (max_abs_value)"
    return None


def encode_piece(values: torch.Tensor, compression: int, out: dmoe_pb2.Tensor) -> dmoe_pb2.Tensor:
    """Serializes a piece of a part into ``out``. float16 saturates finite values beyond its range to +-65504 (the
    codec's :data:`~dmoe.wire.codec.FLOAT16_MAX`): cast as they are, they would arrive as inf and the receiver would
    refuse them (and ban the sender) as garbage, though they passed ``max_abs_value``. NaN and inf stay what they
    are, and are refused as before."""
    return serialize(values, compression, out=out)


def bad_total(contributors: Sequence[int], total_weight: float, me: int, weight: float) -> str | None:
    """Why an owner's ``total_weight`` cannot be the sum of its contributors' weights, or None. Each weight was
    accepted in [0, MAX_WEIGHT], and this member's own (``weight``) is one of them when it contributed: the
    member's next weight is taken from the total, and one out of those bounds would be refused by every owner."""
    if not (math.isfinite(total_weight) and 0 <= total_weight <= MAX_WEIGHT * len(contributors)):
        return f"total weight {total_weight} is not in [0, {MAX_WEIGHT:g} x {len(contributors)} contributors]"
    if me in contributors and total_weight < weight:
        return f"total weight {total_weight} is below this member's own weight {weight}"
    return None


def decode_piece(message: dmoe_pb2.Tensor, room: int) -> torch.Tensor:
    """A piece of a part (1-d float32, any compression, at most ``room`` values) as a float32 tensor; raises
    :class:`Refused` naming what is wrong, before allocating anything for a wrong one."""
    if message.dtype != DTYPE_NAME:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"values must be {DTYPE_NAME} (the dtype parts are averaged in), got {message.dtype or 'none'}")
    if len(message.shape) != 1:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"a piece of a part must be 1-d, got shape {list(message.shape)}")
    if message.shape[0] > room:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"wrong part size: a piece of {message.shape[0]} values exceeds the {room} left of the part")
    try:
        return deserialize(message, max_numel=room)
    except (InvalidTensor, TensorTooLarge) as error:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed piece: {error}") from None


class SendPace:
    """Paces every message a peer sends, over all its streams, to ``rate`` bytes per second (0: no pacing).

    One clock for the peer's link: a message goes out when its bytes would have crossed a link of that rate after
    the bytes sent before it, as on a real uplink (so a short burst is paced too). Lives on the averager's loop.
    """

    def __init__(self, rate: float = 0.0):
        self.rate = rate
        self._free_at = 0.0

    async def wait(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        now = asyncio.get_running_loop().time()
        self._free_at = max(now, self._free_at) + nbytes / self.rate
        await asyncio.sleep(self._free_at - now)


@dataclass
class PartResult:
    """An owner's average of its part, as every member (the owner included) will hold it."""

    contributors: tuple[int, ...]
    total_weight: float
    messages: list[dmoe_pb2.AveragedPart]  # what is streamed back, encoded once for every member
    values: torch.Tensor | None             # None when nobody contributed
    released: bool = False                  # messages and values freed: every reader had them (see release)
    weights: tuple[float, ...] = ()         # each contributor's weight, as it signed it for this owner ...
    signatures: tuple[bytes, ...] = ()      # ... and its signature of it (b"": unsigned, in tests without keys)

    @classmethod
    def encode(cls, contributors: tuple[int, ...], total_weight: float, values: torch.Tensor | None,
               compression: int, piece_elements: int, weights: Sequence[float] = (),
               signatures: Sequence[bytes] = ()) -> "PartResult":
        messages = []
        for start in range(0, values.numel() if values is not None else 0, piece_elements):
            message = dmoe_pb2.AveragedPart()
            encode_piece(values[start:start + piece_elements], compression, out=message.values)
            messages.append(message)
        if not messages:
            messages.append(dmoe_pb2.AveragedPart())
        messages[0].contributors.extend(contributors)
        messages[0].total_weight = total_weight
        messages[0].weights.extend(weights)
        messages[0].signatures.extend(signatures)
        if values is not None and compression != NONE:  # the owner keeps what the others will decode
            values = torch.cat([deserialize(m.values) for m in messages])
        return cls(contributors, total_weight, messages, values, weights=tuple(weights),
                   signatures=tuple(signatures))

    def release(self) -> None:
        """Frees the average and its encoding (about twice the part) once nobody will read them again: the
        servicer keeps a group's reducer for ``KEPT_GROUPS`` groups, and late streams and :meth:`PartReducer.drop`
        read only the contributors. Streams that are still sending hold their own reference to the messages."""
        self.messages, self.values, self.released = [], None, True


class PartReducer:
    """The owner's side of one part in one group: accepts each member's values once, checks every piece, and
    averages what it accepted when everyone delivered or was dropped, or ``timeout`` seconds passed.

    Lives on the averager's event loop (no locks: every method runs there). Refusals ban the sender from the group:
    its values are thrown away and its later streams refused. A stream from the network is first
    :meth:`authenticate`-d: ``owner`` is this peer's id, ``keys`` each member's DHT key (as the group lists it).
    """

    def __init__(self, group_id: str, members: Sequence[int], length: int, *, timeout: float, compression: int = NONE,
                 max_abs_value: float = 0.0, piece_elements: int = 1 << 19, owner: int = 0,
                 keys: Mapping[int, bytes] | None = None):
        self.group_id, self.members, self.length = group_id, frozenset(members), length
        self.owner, self.keys = owner, dict(keys or {})
        self.compression, self.max_abs_value, self.piece_elements = compression, max_abs_value, piece_elements
        self.timeout, self.deadline = timeout, asyncio.get_running_loop().time() + timeout
        self.answer_deadline = math.inf  # set when the average is taken: by then every sender must have read it
        self.values: dict[int, torch.Tensor] = {}
        self.filled: dict[int, int] = {}
        self.weights: dict[int, float] = {}
        self.signatures: dict[int, bytes] = {}  # each sender's signature of its weight, forwarded in the answer
        self.complete: set[int] = set()
        self.dropped: dict[int, str] = {}
        self.result: PartResult | None = None
        self._answered: set[int] = set()  # members (the owner too) whose stream or own part had the answer, or ended
        self._done = asyncio.Event()

    def time_left(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def answer_time_left(self) -> float:
        """Seconds left to stream the average back: ``timeout`` from when it was taken (review 109 D1)."""
        return max(0.0, self.answer_deadline - asyncio.get_running_loop().time())

    def waiting_for(self, sender: int) -> bool:
        """Whether the part still waits for ``sender``'s stream to begin."""
        return (self.result is None and sender in self.members and sender not in self.values
                and sender not in self.complete and sender not in self.dropped)

    def ban(self, sender: int, refusal: Refused) -> Refused:
        """Drops ``sender`` from the group with the reason it was refused; returns the refusal to raise."""
        self.drop(sender, refusal.message)
        return refusal

    def drop(self, sender: int, reason: str) -> None:
        """Leaves ``sender`` out of the average (even if it delivered: its own part was found unreachable, say),
        unless the average was already taken with it."""
        if sender not in self.members or sender in self.dropped:
            return
        if self.result is not None and sender in self.result.contributors:
            return
        logger.info("group %s: dropped peer %s: %s", self.group_id, sender, reason)
        self.dropped[sender] = reason
        self.complete.discard(sender)
        self.values.pop(sender, None)
        self._check_done()

    def authenticate(self, sender: int, weight: float, signature: bytes) -> None:
        """Refuses a stream that ``sender``'s DHT key did not sign (PERMISSION_DENIED; nobody is banned: anyone who
        reads the DHT knows the members' ids, and a stream under one of them must not get that member dropped)."""
        if sender not in self.members:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"peer {sender} is not a member of group {self.group_id}")
        key = self.keys.get(sender)
        if not key or not part_signed(key, self.group_id, self.owner, sender, weight, signature):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"a stream under peer {sender}'s id in group {self.group_id} is not signed by the DHT key "
                          f"the group lists for it; refused")

    def begin(self, sender: int, weight: float, signature: bytes = b"") -> None:
        """A sender's stream starts: it must be a member, not banned, not already streaming, with a sane weight.
        A second stream is refused, and the first goes on: banning both handed anyone who could open one (or a
        broken retry) the power to evict a member. ``signature`` (its :meth:`authenticate`-d one) goes into the
        answer with the weight, as evidence of what the sender signed for this owner."""
        if sender not in self.members:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"peer {sender} is not a member of group {self.group_id}")
        if sender in self.dropped:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"peer {sender} is banned from group {self.group_id}: {self.dropped[sender]}")
        if sender in self.values or sender in self.complete:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"duplicate sender: peer {sender} already streams its part of group {self.group_id}; this "
                          f"stream is refused, the first one counts")
        if self.result is not None:
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"group {self.group_id} was already averaged without peer {sender} (allreduce_timeout)")
        if not (math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT):
            raise self.ban(sender, Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                           f"weight {weight} of peer {sender} is not a finite number in "
                                           f"[0, {MAX_WEIGHT:g}]; banned from group {self.group_id}"))
        self.values[sender] = torch.empty(self.length, dtype=DTYPE)
        self.filled[sender] = 0
        self.weights[sender] = weight
        self.signatures[sender] = signature
        logger.debug("group %s: peer %s began sending its part", self.group_id, sender)

    def add(self, sender: int, piece: dmoe_pb2.Tensor | torch.Tensor) -> None:
        """The next piece of ``sender``'s values (a message, or a tensor for the owner's own values)."""
        if sender not in self.values:  # dropped meanwhile (the deadline passed)
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"peer {sender} was dropped from group "
                          f"{self.group_id}: {self.dropped.get(sender, 'the part was averaged without it')}")
        room = self.length - self.filled[sender]
        try:
            values = decode_piece(piece, room) if isinstance(piece, dmoe_pb2.Tensor) else piece
            problem = bad_values(values, self.max_abs_value)
            if problem is not None:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the values of peer {sender} {problem}")
        except Refused as refused:
            raise self.ban(sender, Refused(refused.code, f"{refused.message}; peer {sender} is banned from group "
                                                         f"{self.group_id}")) from None
        start = self.filled[sender]
        self.values[sender][start:start + values.numel()] = values
        self.filled[sender] = start + values.numel()

    def short(self, sender: int) -> bool:
        """Whether ``sender`` is still in and has sent less than the whole part."""
        return sender in self.values and self.filled[sender] < self.length

    def finish(self, sender: int) -> None:
        """``sender``'s stream ended: its values count if they fill the part exactly."""
        if sender not in self.values:
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"peer {sender} was dropped from group {self.group_id}: {self.dropped.get(sender, '')}")
        if self.filled[sender] != self.length:
            raise self.ban(sender, Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                           f"wrong part size: peer {sender} sent {self.filled[sender]} values, the "
                                           f"part has {self.length}; banned from group {self.group_id}"))
        self.complete.add(sender)
        self._check_done()

    def _check_done(self) -> None:
        if self.result is None and self.members <= self.complete | self.dropped.keys():
            self._finalize()

    def _finalize(self) -> None:
        contributors = tuple(sorted(self.complete))
        total = sum(self.weights[s] for s in contributors)
        values = None
        if contributors:
            coefficients = [self.weights[s] / total if total > 0 else 1 / len(contributors) for s in contributors]
            values = self.values[contributors[0]].mul_(coefficients[0])  # reuses the buffer: it is not needed again
            for sender, coefficient in zip(contributors[1:], coefficients[1:]):
                values.add_(self.values[sender], alpha=coefficient)
        self.values.clear()
        self.answer_deadline = asyncio.get_running_loop().time() + self.timeout
        self.result = PartResult.encode(contributors, total, values, self.compression, self.piece_elements,
                                        [self.weights[s] for s in contributors],
                                        [self.signatures[s] for s in contributors])
        self._done.set()
        self._release_if_answered()

    def answered(self, sender: int) -> None:
        """``sender``'s stream ended (the owner: its own part was read), answered or not: it reads the average no
        more. Once the owner and every contributor are done with it, the average is freed (review 87 D4: the
        servicer's last 8 groups each held their average twice, 8x the averaged tensors in a group of two). Late
        streams are still refused as before: :meth:`begin` and :meth:`drop` read only the contributors."""
        self._answered.add(sender)
        self._release_if_answered()

    def _release_if_answered(self) -> None:
        if (self.result is not None and not self.result.released
                and self._answered.issuperset(self.result.contributors) and self.owner in self._answered):
            self.result.release()

    async def settled(self, timeout: float) -> None:
        """Returns once the part is averaged, or after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def wait(self) -> PartResult:
        """The average, once every member delivered or was dropped; at the deadline, without the stragglers."""
        try:
            await asyncio.wait_for(self._done.wait(), self.time_left())
        except asyncio.TimeoutError:
            for sender in self.members - self.complete - self.dropped.keys():
                self.drop(sender, "did not deliver its part within allreduce_timeout")
            self._check_done()
        assert self.result is not None
        return self.result


@dataclass
class Outcome:
    """What one owner answered a member, or why it did not."""

    contributors: tuple[int, ...] | None = None
    total_weight: float = 0.0
    error: str | None = None
    weights: tuple[float, ...] = ()      # per contributor: the weight the owner took, and the signature
    signatures: tuple[bytes, ...] = ()   # it forwarded for it (both empty from an owner that predates them)


#: seconds between a member's streams to an owner that did not know the group yet
RETRY_PAUSE = 0.25


async def send_and_receive(stub: dmoe_pb2_grpc.AveragingServiceStub, group_id: str, me: int, weight: float,
                           values: torch.Tensor, out: torch.Tensor, *, compression: int, piece_elements: int,
                           max_abs_value: float, timeout: float, pace: SendPace | None = None,
                           retry_until: float = 0.0, signature: bytes = b"") -> Outcome:
    """Streams ``values`` (this member's values of one part) to its owner and writes the average it answers into
    ``out``; never raises (a failure is the outcome's ``error``).

    ``signature``: this member's :func:`sign_part` for this owner, which the owner checks before it takes anything.
    ``retry_until`` (``time.monotonic()``): until then, an owner that does not know the group yet (NOT_FOUND: it
    has not read it from the DHT within its ``join_timeout``, or not begun the round) is sent the part again. A
    member that read the group sooner than the owner would otherwise be dropped. On a loaded DHT an owner may
    read its group seconds after the others, and every member then waited ``allreduce_timeout`` for a retry
    without the dropped member.
    """
    started = time.monotonic()
    while True:
        outcome = await _stream_part(stub, group_id, me, weight, values, out, compression=compression,
                                     piece_elements=piece_elements, max_abs_value=max_abs_value,
                                     timeout=timeout - (time.monotonic() - started), pace=pace,
                                     signature=signature)
        now = time.monotonic()
        if not (outcome.error is not None and outcome.error.startswith(f"{grpc.StatusCode.NOT_FOUND.name}:")
                and now + RETRY_PAUSE < min(retry_until, started + timeout)):
            return outcome
        logger.debug("group %s: the owner did not know the group yet (%s); sending again", group_id, outcome.error)
        await asyncio.sleep(RETRY_PAUSE)


async def _stream_part(stub: dmoe_pb2_grpc.AveragingServiceStub, group_id: str, me: int, weight: float,
                       values: torch.Tensor, out: torch.Tensor, *, compression: int, piece_elements: int,
                       max_abs_value: float, timeout: float, pace: SendPace | None,
                       signature: bytes = b"") -> Outcome:
    """One stream of :func:`send_and_receive`."""

    async def requests():
        for start in range(0, values.numel(), piece_elements):
            message = dmoe_pb2.AveragingPart(group_id=group_id, sender=me, weight=weight, signature=signature) \
                if start == 0 else dmoe_pb2.AveragingPart()
            encode_piece(values[start:start + piece_elements], compression, out=message.values)  # encoded as sent
            if pace is not None:
                await pace.wait(message.ByteSize())
            yield message

    outcome, filled = Outcome(), 0
    try:
        call = stub.reduce(requests(), timeout=timeout)
        async for reply in call:
            if outcome.contributors is None:
                outcome.contributors, outcome.total_weight = tuple(reply.contributors), reply.total_weight
                outcome.weights, outcome.signatures = tuple(reply.weights), tuple(reply.signatures)
                if outcome.weights or outcome.signatures:
                    if not len(outcome.weights) == len(outcome.signatures) == len(outcome.contributors):
                        return Outcome(error=f"malformed answer: {len(outcome.weights)} weights and "
                                             f"{len(outcome.signatures)} signatures for "
                                             f"{len(outcome.contributors)} contributors")
            try:
                piece = decode_piece(reply.values, out.numel() - filled)
            except Refused as refused:
                return Outcome(error=f"malformed average: {refused.message}")
            problem = bad_values(piece, max_abs_value)
            if problem is not None:
                return Outcome(error=f"the average {problem}")
            out[filled:filled + piece.numel()] = piece
            filled += piece.numel()
    except grpc.aio.AioRpcError as error:
        return Outcome(error=f"{error.code().name}: {error.details()}")
    except Exception as error:  # noqa: BLE001 - an owner's failure, whatever it is, is this outcome
        return Outcome(error=f"{type(error).__name__}: {error}")
    if outcome.contributors is None or filled != out.numel() or not math.isfinite(outcome.total_weight):
        return Outcome(error=f"incomplete average: {filled} of {out.numel()} values")
    return outcome


@dataclass
class AllReduceResult:
    contributors: tuple[int, ...]
    total_weight: float
    members: tuple[int, ...]            # of the attempt that succeeded
    dropped: dict[int, str] = field(default_factory=dict)
    attempts: int = 1


def retry_group_id(group: Group, attempt: int, members: Sequence[Member]) -> str:
    """The id of a retry among ``members``: a member that computed another set names another group, which the
    others refuse as unknown, so no part is ever averaged over two different views of who survived."""
    digest = hashlib.blake2b(",".join(str(m.peer_id) for m in members).encode(), digest_size=4).hexdigest()
    return f"{group.group_id}.r{attempt}.{digest}"


async def allreduce(group: Group, me: int, flat: torch.Tensor, weight: float, out: torch.Tensor, *,
                    stub_for: Callable[[str], dmoe_pb2_grpc.AveragingServiceStub],
                    register: Callable[[str, PartReducer], None] | None,
                    compression: int, piece_elements: int, max_abs_value: float, allreduce_timeout: float,
                    join_timeout: float, max_retries: int, min_group_size: int, deadline: float,
                    pace: SendPace | None = None,
                    send: Callable[..., Awaitable[Outcome]] = send_and_receive,
                    reachable: Callable[[str], Awaitable[bool]] | None = None,
                    identity: Identity | None = None) -> AllReduceResult | None:
    """Averages ``flat`` with the group into ``out`` (never into ``flat``); None when the members could not agree.

    ``register`` makes this peer's owned parts reachable by its gRPC service (None in client mode); ``deadline``
    is ``time.monotonic()`` by which to give up. ``reachable(endpoint)``: False once the peer there refuses
    connections (see :func:`_dead_owner_leaves`); None: never asked. ``identity``: this peer's DHT identity (the key
    the group lists for it), which signs its streams (None: unsigned, which owners refuse; tests).
    """
    members = list(group.members)
    dropped: dict[int, str] = {}
    for attempt in range(1 + max_retries):
        group_id = group.group_id if attempt == 0 else retry_group_id(group, attempt, members)
        left = deadline - time.monotonic()
        if left <= 0:
            logger.warning("group %s: out of time before attempt %d", group.group_id, attempt + 1)
            return None
        bounds, problem = _parts(members, me, flat.numel(), can_own=register is not None)
        if problem is not None:
            logger.warning("group %s cannot average: %s; tensors unchanged", group.group_id, problem)
            return None
        ids = [m.peer_id for m in members]
        mine = bounds[ids.index(me)]
        reducer = None
        if mine[1] > mine[0]:
            reducer = PartReducer(group_id, ids, mine[1] - mine[0], timeout=min(allreduce_timeout, left),
                                  compression=compression, max_abs_value=max_abs_value, piece_elements=piece_elements,
                                  owner=me, keys={m.peer_id: m.key for m in members})
            register(group_id, reducer)
        tasks: dict[int, Awaitable[Outcome]] = {}
        for member, (start, end) in zip(members, bounds):
            if end == start:
                continue
            if member.peer_id == me:
                tasks[me] = _own_part(reducer, me, weight, flat[start:end], out[start:end],
                                      sign_part(identity, group_id, me, me, weight) if identity else b"")
            else:
                tasks[member.peer_id] = _dead_owner_leaves(reducer, member, reachable, attempt > 0, send(
                    stub_for(member.endpoint), group_id, me, weight, flat[start:end], out[start:end],
                    compression=compression, piece_elements=piece_elements, max_abs_value=max_abs_value,
                    timeout=min(allreduce_timeout + join_timeout + 5.0, left), pace=pace,
                    signature=sign_part(identity, group_id, member.peer_id, me, weight) if identity else b"",
                    # the leader's group: every owner in it learns it, maybe late. A retry's id is computed by each
                    # survivor, and one with another view never learns this one: refused, as before
                    retry_until=time.monotonic() + min(allreduce_timeout, left) if attempt == 0 else 0.0))
        outcomes = {owner: _checked(outcome, me, weight)
                    for owner, outcome in zip(tasks, await asyncio.gather(*tasks.values()))}
        keys = {m.peer_id: m.key for m in members}
        if len({(o.contributors, o.total_weight) for o in outcomes.values() if o.error is None}) > 1:
            # an owner that forwards a weight its contributor did not sign for it lies (review 109 D4): it failed,
            # and the others retry without it, rather than all give up (the liar alone keeping the average)
            outcomes.update({owner: Outcome(error=f"bad answer: {proof}")
                             for owner, proof in _unbacked(group_id, outcomes, keys, me).items()})
        failed = {owner: o.error for owner, o in outcomes.items() if o.error is not None}
        # owners that name the same contributors with different totals disagree too: an owner lies, or a member
        # signed a different weight for each owner. The attempt fails rather than take a weight that may be a lie;
        # a member's lie is proven by its own signatures, which the owners forward, and the retry leaves it out
        views = {(o.contributors, o.total_weight) for o in outcomes.values() if o.error is None}

        def why(pid: int, otherwise: str) -> str:  # this peer's own part knows why it left a member out
            return reducer.dropped.get(pid, otherwise) if reducer is not None else otherwise

        if not failed and len(views) == 1:
            contributors, total = next(iter(views))
            if me in contributors:
                dropped.update({pid: why(pid, "refused or missing") for pid in ids if pid not in contributors})
                return AllReduceResult(contributors, total, tuple(ids), dropped, attempt + 1)
        accepted = set(ids).intersection(*(contributors for contributors, _ in views)) if views else set()
        two_faced = _two_faced(group_id, outcomes, keys) if len(views) > 1 else {}
        for owner, error in failed.items():
            dropped[owner] = error
        for pid in set(ids) - accepted - set(failed):  # the retry leaves them out too: say why
            dropped[pid] = why(pid, "refused by some owners" if views else "no owner answered")
        for pid, proof in two_faced.items():
            logger.warning("group %s: peer %s %s; left out of the retry", group.group_id, pid, proof)
            dropped[pid] = proof
        survivors = [m for m in members if m.peer_id in accepted and m.peer_id not in failed
                     and m.peer_id not in two_faced]
        logger.info("group %s attempt %d: owners failed %s, %d different answers, %d members signed different "
                    "weights; survivors %s", group.group_id, attempt + 1, failed or "none", len(views),
                    len(two_faced), [m.peer_id for m in survivors])
        if (me not in {m.peer_id for m in survivors} or len(survivors) < min_group_size
                or not any(m.bandwidth > 0 for m in survivors) or len(survivors) == len(members)):
            return None
        members = survivors
    return None


def _parts(members: Sequence[Member], me: int, total: int,
           can_own: bool) -> tuple[list[tuple[int, int]], str | None]:
    """The bounds of the members' parts, or why the all-reduce cannot begin among them: matchmaking refuses such
    groups, so this guards groups that came some other way, which must fail the round, not the caller's step."""
    ids = [m.peer_id for m in members]
    if me not in ids:
        return [], "this peer is not a member"
    if not any(m.bandwidth > 0 for m in members):
        return [], "no member has a positive bandwidth, so nobody can own a part"
    bounds = partition(total, [m.bandwidth for m in members])
    start, end = bounds[ids.index(me)]
    if end > start and not can_own:
        return [], "it gives this peer a part, but this peer is in client mode and cannot own one"
    return bounds, None


def _two_faced(group_id: str, outcomes: Mapping[int, Outcome], keys: Mapping[int, bytes]) -> dict[int, str]:
    """The members whose own signatures, as the owners forwarded them in ``outcomes``, name different weights for
    different owners of ``group_id``: each with the proof, in words. An honest member signs one weight for every
    owner, and an owner cannot make a member's signature for itself pass for one made for another owner (or group),
    so nobody is named here by another's lie. Every member that read the same answers names the same members. Claims
    that do not verify are ignored (they prove nothing)."""
    claims: dict[int, dict[int, float]] = {}  # member -> owner -> the weight it signed for that owner
    for owner in sorted(outcomes):
        outcome = outcomes[owner]
        if outcome.error is not None:
            continue
        seen: set[int] = set()  # one claim per member and owner: a list naming one many times costs one check
        for pid, weight, signature in zip(outcome.contributors, outcome.weights, outcome.signatures):
            key = keys.get(pid)
            if key and pid not in seen and part_signed(key, group_id, owner, pid, weight, signature):
                claims.setdefault(pid, {})[owner] = weight
            seen.add(pid)
    return {pid: "signed different weights for different owners: " +
                 ", ".join(f"{weight!r} for owner {owner}" for owner, weight in by_owner.items())
            for pid, by_owner in sorted(claims.items()) if len(set(by_owner.values())) > 1}


def _unbacked(group_id: str, outcomes: Mapping[int, Outcome], keys: Mapping[int, bytes], me: int) -> dict[int, str]:
    """The owners (but this peer) whose answer in ``outcomes`` forwards a contributor's weight without that
    contributor's signature of it for this owner of ``group_id``: each with the proof, in words. An honest owner
    forwards the signature it checked before it took the weight, so none is named; every member that read the same
    answer names the same owners. Contributors without a key in ``keys`` prove nothing."""
    unbacked = {}
    for owner in sorted(outcomes):
        outcome = outcomes[owner]
        if owner == me or outcome.error is not None:
            continue
        for pid, weight, signature in zip(outcome.contributors, outcome.weights, outcome.signatures):
            key = keys.get(pid)
            if key and not part_signed(key, group_id, owner, pid, weight, signature):
                unbacked[owner] = f"weight {weight!r} of peer {pid} is not what that peer signed for this owner"
                break
    return unbacked


def _checked(outcome: Outcome, me: int, weight: float) -> Outcome:
    """``outcome``, or a failed one when its total weight is absurd (a broken answer, as a NaN average is), or is
    not the sum of the weights the answer forwards (review 109 D4: an owner computes its total as that very sum, in
    that order, so a difference proves it lies)."""
    if outcome.error is None:
        problem = bad_total(outcome.contributors, outcome.total_weight, me, weight)
        if problem is None and outcome.weights and outcome.total_weight != sum(outcome.weights):
            problem = f"total weight {outcome.total_weight!r} is not the sum of the weights it forwards " \
                      f"({sum(outcome.weights)!r})"
        if problem is not None:
            return Outcome(error=f"bad answer: {problem}")
    return outcome


#: seconds between checks that a member which answered, but whose values have not arrived, still accepts connections
PROBE_PERIOD = 1.0


async def _dead_owner_leaves(reducer: PartReducer | None, owner: Member,
                             reachable: Callable[[str], Awaitable[bool]] | None, retry: bool,
                             sending: Awaitable[Outcome]) -> Outcome:
    """A member whose own part this peer could not reach is dead: it will not send its values of this peer's part
    either, so this peer's part stops waiting for them (a member killed before its streams reached everyone would
    otherwise hold up every part it never reached until allreduce_timeout). So is, in a ``retry``, a member that
    refused this peer's stream as an unknown group: it is not in this retry (it left already, or saw another list
    of survivors), and a retry's stream is not sent again (review 109 D2: this part waited allreduce_timeout for it).

    A member that answered, but whose stream to this peer has not begun, is watched until it begins (or the part
    is averaged): once its peer refuses connections (``reachable``), it is dropped too. Killed after it answered and
    before its stream arrived, it left no broken stream here, and this part waited allreduce_timeout for it.
    """
    outcome = await sending
    if reducer is None:
        return outcome
    if outcome.error is not None:
        if outcome.error.startswith(f"{grpc.StatusCode.UNAVAILABLE.name}:"):
            reducer.drop(owner.peer_id, f"its own part was unreachable ({outcome.error})")
        elif retry and outcome.error.startswith(f"{grpc.StatusCode.NOT_FOUND.name}:"):
            reducer.drop(owner.peer_id, f"it does not know this retry's group ({outcome.error})")
        return outcome
    if reachable is None or not owner.endpoint or not reducer.waiting_for(owner.peer_id):
        return outcome
    logger.debug("group %s: peer %s answered, its values have not arrived yet: watching that it stays reachable",
                 reducer.group_id, owner.peer_id)
    while reducer.waiting_for(owner.peer_id):
        if not await reachable(owner.endpoint):
            if reducer.waiting_for(owner.peer_id):
                reducer.drop(owner.peer_id, "it stopped accepting connections before its values arrived")
            break
        await reducer.settled(PROBE_PERIOD)
    return outcome


async def _own_part(reducer: PartReducer, me: int, weight: float, values: torch.Tensor,
                    out: torch.Tensor, signature: bytes = b"") -> Outcome:
    """The owner's own values go into its reducer without a network hop (checked like anyone's). ``signature``:
    its :func:`sign_part` for itself, which its answer forwards as any member's."""
    try:
        try:
            reducer.begin(me, weight, signature)
            reducer.add(me, values)
            reducer.finish(me)
        except Refused as refused:
            logger.warning("this peer's own values were refused: %s", refused.message)
        result = await reducer.wait()
        if result.values is None:
            return Outcome(error="nobody contributed to this peer's own part")
        problem = bad_values(result.values, max_abs_value=0.0)  # finite inputs can still overflow without a limit
        if problem is not None:
            return Outcome(error=f"the average of this peer's own part {problem}")
        out.copy_(result.values)
        return Outcome(result.contributors, result.total_weight, weights=result.weights,
                       signatures=result.signatures)
    finally:
        reducer.answered(me)
