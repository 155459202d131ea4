"""The gRPC face of an averager: ``AveragingService.reduce`` streams, each a member's values of a part this peer owns.

Every refusal is a gRPC status whose message names what is wrong (unknown round or group, not a member, not signed
by the member's DHT key, duplicate sender, wrong dtype, shape or size, non-finite or too large values); refusals of
a member's values also ban it from the group, and the round goes on for the others. A stream is authenticated
before anything of it counts: its first message carries the member's signature (by the DHT key the group lists
for it) of the group, this owner, its id and its weight; an unsigned one, or a second stream under an id, is
refused without touching the member. Handlers run on the averager's event loop.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import re
from typing import AsyncIterator

import grpc

from dmoe.averaging.allreduce import PartReducer, Refused, SendPace
from dmoe.endpoints import peer_machine
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc

logger = logging.getLogger(__name__)

#: groups whose reducers are kept (for late streams to get a clear answer); older ones are forgotten. A kept reducer
#: frees its average once the owner and every contributor had it (PartReducer.answered): only who contributed stays
KEPT_GROUPS = 8
#: rounds (the current one and the ones before) whose groups this peer still answers for
KEPT_ROUNDS = 2
#: longest group id accepted: a real one is ``<prefix>.<round>.<key>.<leader>.<nonce>`` (plus ``.r<n>.<digest>`` for a
#: retry), well under this; a longer one is refused before it is kept anywhere (gRPC alone allows 64 MiB)
MAX_GROUP_ID_CHARS = 1024
#: groups not known yet that streams may wait for at once (to learn them from the DHT); a stream for one more is
#: refused as unknown at once, and a member's sends it again (``send_and_receive`` retries NOT_FOUND)
MAX_WAITED_GROUPS = 64
#: streams of one calling machine (an IPv4 address, an IPv6 /64) that wait to learn their group at once: the waits
#: are open before any signature is checked, and one machine naming made-up groups took every place, so that honest
#: streams for a group this peer was about to learn were refused at once (review 69)
MAX_WAITING_PER_MACHINE = 8
#: a round number in a group id: ASCII digits only (``str.isdigit`` takes "²", which ``int`` refuses)
_ROUND = re.compile(r"[0-9]{1,18}")
#: seconds a stream that ended short of its part waits for gRPC to report it cancelled, before the short part is
#: refused as the sender's (a killed sender's stream ends first and is reported cancelled a moment later)
BROKEN_STREAM_GRACE = 1.0


MAX_GRPC_MS = 2**31 - 1


def connection_limits(allreduce_timeout: float, join_timeout: float) -> list[tuple[str, int]]:
    """Server options that close a connection some time after it opened, its streams given as long as one may
    legitimately last to end first (a first message and the group learnt within ``join_timeout`` each, the values
    within ``allreduce_timeout``, the answer read within another). A stream whose sender stops reading its answer
    cannot be ended from the handler: gRPC's status waits behind the unread message, and the call (with what it
    buffered of the answer, megabytes) stayed as long as the connection (review 109 D1). The members' channels
    connect again as needed."""
    # (gRPC takes a 32-bit count of milliseconds: a timeout of two weeks or more, or an infinite one, is its most,
    # 24.8 days; review 116 D2)
    longest_ms = int(min(1000 * (2 * (allreduce_timeout + join_timeout) + 5.0), MAX_GRPC_MS))
    return [("grpc.max_connection_age_ms", longest_ms), ("grpc.max_connection_age_grace_ms", longest_ms)]


class _Waited:
    """A group that streams wait to learn, and how many of them wait."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.streams = 0


class AveragingServicer(dmoe_pb2_grpc.AveragingServiceServicer):
    """Serves the parts this peer owns in the groups of averaging run ``prefix``.

    join_timeout: how long a stream for a group of a current round waits for this peer to learn the group from
        the DHT (a member may learn it sooner) before it is refused as unknown.
    pace: paces the answers with the peer's own streams (``max_send_rate``).
    """

    def __init__(self, prefix: str, join_timeout: float, pace: SendPace | None = None):
        self.prefix, self.join_timeout, self.pace = prefix, join_timeout, pace
        self.rounds: collections.deque[int] = collections.deque(maxlen=KEPT_ROUNDS)
        self.groups: collections.OrderedDict[str, PartReducer] = collections.OrderedDict()
        self._learnt: dict[str, _Waited] = {}  # groups that streams wait to learn: removed when the last one ends
        self._waiting: collections.Counter[str] = collections.Counter()  # calling machine -> its streams waiting

    def begin_round(self, round_number: int) -> None:
        if round_number not in self.rounds:
            self.rounds.append(round_number)

    def register(self, group_id: str, reducer: PartReducer) -> None:
        self.groups[group_id] = reducer
        while len(self.groups) > KEPT_GROUPS:
            self.groups.popitem(last=False)
        waited = self._learnt.pop(group_id, None)
        if waited is not None:
            waited.event.set()

    async def _find(self, group_id: str, machine: str = "") -> PartReducer:
        if len(group_id) > MAX_GROUP_ID_CHARS:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed group id: {len(group_id)} characters, more "
                                                            f"than the {MAX_GROUP_ID_CHARS} a group id may have")
        if not group_id.startswith(self.prefix + "."):
            raise Refused(grpc.StatusCode.NOT_FOUND,
                          f"unknown group {group_id!r}: this peer averages run {self.prefix!r} only")
        round_text = group_id[len(self.prefix) + 1:].split(".", 1)[0]
        if not _ROUND.fullmatch(round_text):
            raise Refused(grpc.StatusCode.NOT_FOUND, f"malformed group id {group_id!r}: no round number after "
                                                     f"{self.prefix!r}")
        if int(round_text) not in self.rounds:
            at = f"round {self.rounds[-1]}" if self.rounds else "no round yet"
            raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown round {int(round_text)} (this peer is at {at})")
        if group_id not in self.groups:
            await self._wait_to_learn(group_id, machine)
        reducer = self.groups.get(group_id)
        if reducer is None:
            raise Refused(grpc.StatusCode.NOT_FOUND,
                          f"unknown group {group_id!r} in round {int(round_text)}: this peer is not in it "
                          f"(or did not learn it within {self.join_timeout:g}s)")
        return reducer

    async def _wait_to_learn(self, group_id: str, machine: str = "") -> None:
        """Waits up to ``join_timeout`` for this peer to learn ``group_id`` (:meth:`register`). Its entry goes when
        the last stream waiting for it ends, however it ends: one left by a cancelled stream stayed for good, and
        anyone who knows the current round could pile them up. Beyond ``MAX_WAITED_GROUPS`` groups, or
        ``MAX_WAITING_PER_MACHINE`` streams of the calling ``machine``, it returns at once."""
        if self._waiting[machine] >= MAX_WAITING_PER_MACHINE:
            logger.debug("not waiting to learn group %r: %d streams of %s wait already", group_id,
                         self._waiting[machine], machine)
            return
        waited = self._learnt.get(group_id)
        if waited is None:
            if len(self._learnt) >= MAX_WAITED_GROUPS:
                logger.debug("not waiting to learn group %r: %d groups are waited for already", group_id,
                             len(self._learnt))
                return
            waited = self._learnt[group_id] = _Waited()
        waited.streams += 1
        self._waiting[machine] += 1
        try:
            await asyncio.wait_for(waited.event.wait(), self.join_timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiting[machine] -= 1
            if not self._waiting[machine]:
                del self._waiting[machine]
            waited.streams -= 1
            if waited.streams == 0 and self._learnt.get(group_id) is waited:
                del self._learnt[group_id]

    async def reduce(self, request_iterator: AsyncIterator[dmoe_pb2.AveragingPart],
                     context: grpc.aio.ServicerContext) -> None:
        reducer, sender = None, None
        try:
            try:
                try:
                    first = await asyncio.wait_for(anext(request_iterator, None), self.join_timeout)
                except asyncio.TimeoutError:
                    raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"no first message within {self.join_timeout:g}s of opening the stream") from None
                if first is None:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                  "empty stream: the first message must name the group and the sender")
                reducer = await self._find(first.group_id, peer_machine(context.peer()))
                reducer.authenticate(first.sender, first.weight, first.signature)
                reducer.begin(first.sender, first.weight, first.signature)
                sender = first.sender
                try:
                    await asyncio.wait_for(self._receive(reducer, sender, first, request_iterator, context),
                                           reducer.time_left())
                except asyncio.TimeoutError:
                    raise reducer.ban(sender, Refused(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"peer {sender} did not deliver its part of group "
                        f"{reducer.group_id} within allreduce_timeout; dropped from the group")) from None
                except Refused:
                    raise
                except BaseException as error:  # the sender went away (cancelled, connection lost): not a refusal
                    reducer.drop(sender, f"its stream broke ({type(error).__name__})")
                    raise
                result = await reducer.wait()
                if sender in reducer.dropped:  # dropped after its values arrived (its own part was unreachable)
                    raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                                  f"peer {sender} is banned from group {reducer.group_id}: {reducer.dropped[sender]}")
                # the answer phase is bounded too (review 109 D1): a sender that never read its answer held this
                # handler at its write for as long as its connection lived, and with it the encoded answer and the
                # reducer's average (never released: this sender never "answered"), a part or two each round
                try:
                    await asyncio.wait_for(self._answer(result.messages, context), reducer.answer_time_left())
                except asyncio.TimeoutError:
                    # not abort(): its status would queue behind the unread message and never go, and this
                    # handler would wait on it; gRPC sends the status once the handler ended (or never)
                    logger.info("group %s: peer %s did not read the average within allreduce_timeout of its "
                                "being taken; its stream is ended", reducer.group_id, sender)
                    context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
                    context.set_details(f"peer {sender} did not read the average of group {reducer.group_id} "
                                        f"within allreduce_timeout of its being taken")
            except Refused as refused:
                await context.abort(refused.code, refused.message)
        finally:
            if sender is not None:  # this stream began: it reads the average no more, however it ended
                reducer.answered(sender)

    async def _answer(self, messages: list[dmoe_pb2.AveragedPart], context: grpc.aio.ServicerContext) -> None:
        """Streams the average (``messages``, encoded once for every sender) back, paced."""
        for message in messages:
            if self.pace is not None:
                await self.pace.wait(message.ByteSize())
            await context.write(message)

    @staticmethod
    async def _receive(reducer: PartReducer, sender: int, first: dmoe_pb2.AveragingPart,
                       request_iterator: AsyncIterator[dmoe_pb2.AveragingPart],
                       context: grpc.aio.ServicerContext) -> None:
        if first.HasField("values"):
            reducer.add(sender, first.values)
        async for message in request_iterator:
            if message.group_id or message.sender:
                raise reducer.ban(sender, Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                                  f"peer {sender}: only the first message of a stream may name the "
                                                  f"group and the sender; banned from group {reducer.group_id}"))
            reducer.add(sender, message.values)
        if reducer.short(sender) and not context.cancelled():
            # gRPC ends a killed sender's stream as if it had finished, and reports the cancellation (cancelling
            # this task) a moment later: until then a short part may be a broken stream, not the sender's doing
            await asyncio.sleep(BROKEN_STREAM_GRACE)
        if context.cancelled():  # a sender that died mid-stream ends it too: dropped, not refused
            reducer.drop(sender, "its stream broke")
            raise asyncio.CancelledError
        reducer.finish(sender)
