"""One group's all-reduce between averaging services in one event loop: each member has its own
:class:`AveragingServicer` behind a gRPC server on 127.0.0.1 and its own DHT identity, and runs :func:`allreduce`
as an averager does, without a DHT or matchmaking (the group is given). Seconds per test."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable, Sequence

import grpc
import pytest
import torch

from dmoe.averaging.allreduce import Outcome, PartReducer, Refused, _two_faced, allreduce, send_and_receive, sign_part
from dmoe.averaging.matchmaking import Group, Member
from dmoe.averaging.service import AveragingServicer
from dmoe.dht import Identity
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from dmoe.wire.codec import serialize

GROUP = "grp.0.*.1.0123abcd"


class Peer:
    """A member: its identity, servicer and server; ``send`` may be replaced to play a misbehaving member."""

    def __init__(self, index: int):
        self.peer_id, self.identity = index + 1, Identity()
        self.servicer = AveragingServicer("grp", join_timeout=2.0)
        self.servicer.begin_round(0)
        self.server = grpc.aio.server()
        dmoe_pb2_grpc.add_AveragingServiceServicer_to_server(self.servicer, self.server)
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.send: Callable = send_and_receive

    @property
    def member(self) -> Member:
        return Member(self.peer_id, self.endpoint, 1.0, self.identity.public_key)


@contextlib.asynccontextmanager
async def peers(count: int):
    group = [Peer(index) for index in range(count)]
    channels: dict[str, grpc.aio.Channel] = {}
    for peer in group:
        await peer.server.start()
    try:
        yield group, channels
    finally:
        for channel in channels.values():
            await channel.close()
        for peer in group:
            await peer.server.stop(0)


async def average(group: Sequence[Peer], channels: dict[str, grpc.aio.Channel], tensors: Sequence[torch.Tensor],
                  weights: Sequence[float], allreduce_timeout: float = 5.0) -> list:
    """Every peer's all-reduce of its tensor, at once: [(result, what it holds after), ...]."""
    members = Group(GROUP, 0, group[0].peer_id, tuple(peer.member for peer in group))

    def stub_for(endpoint: str) -> dmoe_pb2_grpc.AveragingServiceStub:
        if endpoint not in channels:
            channels[endpoint] = grpc.aio.insecure_channel(endpoint)
        stub = dmoe_pb2_grpc.AveragingServiceStub(channels[endpoint])
        stub.owner = next(peer.peer_id for peer in group if peer.endpoint == endpoint)  # for misbehaving senders
        return stub

    async def one(peer: Peer, tensor: torch.Tensor, weight: float):
        out = torch.empty_like(tensor)
        result = await allreduce(members, peer.peer_id, tensor, weight, out, stub_for=stub_for,
                                 register=peer.servicer.register, compression=0, piece_elements=1 << 10,
                                 max_abs_value=0.0, allreduce_timeout=allreduce_timeout, join_timeout=2.0,
                                 max_retries=1, min_group_size=2, deadline=time.monotonic() + 20, send=peer.send,
                                 identity=peer.identity)
        return result, (out if result is not None else tensor)

    return await asyncio.gather(*(one(peer, tensor, weight) for peer, tensor, weight in zip(group, tensors, weights)))


def test_an_owner_frees_its_average_once_every_member_had_it_and_late_streams_still_get_a_clear_answer():
    """Review 87 D4: the servicer keeps its last 8 groups' reducers, and each held its average twice (the values
    and their encoding) for good: about 8x the averaged tensors in a group of two."""
    async def run():
        async with peers(2) as (group, channels):
            results = await average(group, channels, [torch.zeros(4096), torch.full((4096,), 2.0)], [1.0, 1.0])
            await asyncio.sleep(0.2)  # the servers' handlers end just after their last answer went out
            return results, [peer.servicer.groups[GROUP] for peer in group]

    results, reducers = asyncio.run(run())
    for result, held in results:
        assert result is not None and result.contributors == (1, 2)
        assert torch.equal(held, torch.ones(4096))
    for reducer in reducers:
        assert reducer.result.values is None and reducer.result.messages == [] and reducer.result.released
        assert reducer.result.contributors == (1, 2) and reducer.result.total_weight == 2.0
        # what late streams and drop() read is still there: a member's second stream gets its clear answer
        with pytest.raises(Refused) as refused:
            reducer.begin(2 if reducer.owner == 1 else 1, 1.0)
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS and "duplicate sender" in refused.value.message


def test_an_average_is_kept_until_the_owner_and_every_contributor_had_it():
    async def run():
        reducer = PartReducer("g", [1, 2, 3], 4, timeout=0.2, owner=1)  # 3 never delivers
        for sender in (1, 2):
            reducer.begin(sender, 1.0)
            reducer.add(sender, torch.full((4,), float(sender)))
            reducer.finish(sender)
        reducer.answered(3)  # a stream that ended without being a contributor holds nothing up
        result = await reducer.wait()
        reducer.answered(2)
        assert not result.released and torch.equal(result.values, torch.full((4,), 1.5))  # the owner has not read it
        reducer.answered(1)
        assert result.released and result.values is None and not result.messages
        reducer.drop(2, "its own part was unreachable")  # taken already: stays a contributor
        assert 2 not in reducer.dropped and result.contributors == (1, 2) and result.total_weight == 2.0
        with pytest.raises(Refused) as late:
            reducer.begin(3, 1.0)
        assert late.value.code == grpc.StatusCode.PERMISSION_DENIED and "within allreduce_timeout" in late.value.message
    asyncio.run(run())


def test_a_member_that_signs_another_weight_for_each_owner_is_left_out_and_the_others_average():
    """Review 87 D5: such a member made the owners' totals disagree; the retry was among the same members, so no
    round ever averaged, and nobody was named. Its signatures, which the owners now forward, prove what it did."""
    async def run():
        async with peers(3) as (group, channels):
            liar = group[2]

            async def two_faced(stub, group_id, me, weight, *args, **kwargs):
                weight += stub.owner  # another weight for each owner, each signed properly
                kwargs["signature"] = sign_part(liar.identity, group_id, stub.owner, me, weight)
                return await send_and_receive(stub, group_id, me, weight, *args, **kwargs)
            liar.send = two_faced
            return await average(group, channels, [torch.zeros(64), torch.full((64,), 1.0), torch.full((64,), 9.0)],
                                 [1.0, 3.0, 1.0])

    (first, held_first), (second, held_second), (liar, held_liar) = asyncio.run(run())
    for result in (first, second):
        assert result is not None and result.contributors == (1, 2) and result.attempts == 2, result
        assert result.total_weight == 4.0 and result.dropped[3].startswith("signed different weights"), result.dropped
    assert torch.equal(held_first, torch.full((64,), 0.75)) and torch.equal(held_second, torch.full((64,), 0.75))
    assert liar is None and torch.equal(held_liar, torch.full((64,), 9.0))


def test_only_a_members_own_signatures_name_it_two_faced():
    member, other = Identity(), Identity()
    keys = {1: other.public_key, 2: member.public_key}

    def answer(owner: int, weight: float, signed_for: int, signed_weight: float | None = None) -> Outcome:
        signature = sign_part(member, "g.0.x", signed_for, 2, weight if signed_weight is None else signed_weight)
        return Outcome((1, 2), 1.0 + weight, weights=(1.0, weight), signatures=(b"", signature))

    honest = answer(1, 1.0, signed_for=1)
    # an owner that reports another weight for the member cannot back it: the member's signature for another
    # owner, or of another weight, proves nothing, and the member is not named
    assert _two_faced("g.0.x", {1: honest, 3: answer(3, 5.0, signed_for=1)}, keys) == {}
    assert _two_faced("g.0.x", {1: honest, 3: answer(3, 5.0, signed_for=3, signed_weight=1.0)}, keys) == {}
    assert _two_faced("g.0.y", {1: honest, 3: answer(3, 5.0, signed_for=3)}, keys) == {}  # made for another group
    assert _two_faced("g.0.x", {1: honest, 3: answer(3, 1.0, signed_for=3)}, keys) == {}  # one weight: honest
    proof = _two_faced("g.0.x", {1: honest, 3: answer(3, 5.0, signed_for=3)}, keys)
    assert proof == {2: "signed different weights for different owners: 1.0 for owner 1, 5.0 for owner 3"}


def test_a_member_that_never_reads_its_answer_costs_the_owner_one_allreduce_timeout_and_frees_its_average():
    """Review 109 D1: the owner's handler waited at its write for as long as the member's connection lived, holding
    the encoded answer and the average (never released: that member never "answered"), a part or two every round."""
    numel, timeout = 1 << 20, 1.0  # an answer of 4 MiB: more than gRPC's flow control lets through unread

    async def run():
        async with peers(2) as (group, channels):
            owner, member = group
            reducer = PartReducer(GROUP, [1, 2], numel, timeout=timeout, owner=1, piece_elements=1 << 18,
                                  keys={1: owner.identity.public_key, 2: member.identity.public_key})
            owner.servicer.register(GROUP, reducer)
            channels[owner.endpoint] = grpc.aio.insecure_channel(owner.endpoint)

            async def requests():
                signature = sign_part(member.identity, GROUP, 1, 2, 1.0)
                for start in range(0, numel, 1 << 18):
                    message = dmoe_pb2.AveragingPart(group_id=GROUP, sender=2, weight=1.0, signature=signature) \
                        if start == 0 else dmoe_pb2.AveragingPart()
                    serialize(torch.ones(1 << 18), 0, out=message.values)
                    yield message
            call = dmoe_pb2_grpc.AveragingServiceStub(channels[owner.endpoint]).reduce(requests())  # never read
            reducer.begin(1, 1.0)
            reducer.add(1, torch.zeros(numel))
            reducer.finish(1)
            result = await reducer.wait()
            taken = time.monotonic()
            reducer.answered(1)  # the owner's own part had it
            while not result.released and time.monotonic() < taken + 4 * timeout:
                await asyncio.sleep(0.05)
            freed_after, released = time.monotonic() - taken, result.released
            call.cancel()
            return result, released, freed_after

    result, released, freed_after = asyncio.run(run())
    assert released and freed_after < 2 * timeout, freed_after
    assert result.contributors == (1, 2) and result.values is None and not result.messages


@pytest.mark.parametrize("lie", ["total", "its own weight and the total"])
def test_an_owner_whose_total_its_forwarded_signed_weights_disprove_is_left_out_and_the_others_average(lie):
    """Review 109 D4: an owner answering a total 1 too high (finite, in range) failed the round for every honest
    member (no retry: nobody was two-faced), and the liar alone kept the average. Its answer forwards each
    contributor's signed weight: their sum, or a weight nobody signed, proves the lie."""
    async def run():
        async with peers(4) as (group, channels):
            liar = group[2].servicer
            answer = liar._answer

            async def lying(messages, context):
                first = dmoe_pb2.AveragedPart()
                first.CopyFrom(messages[0])
                first.total_weight += 1.0
                if lie != "total":
                    first.weights[2] += 1.0  # its own (peer 3's), as it signed it for nobody
                await answer([first, *messages[1:]], context)
            liar._answer = lying
            return await average(group, channels, [torch.full((64,), value) for value in (0.0, 3.0, 9.0, 6.0)],
                                 [1.0] * 4)

    results = asyncio.run(run())
    for peer, (result, held) in enumerate(results, 1):
        if peer == 3:  # its own part's answer is honest: it sees no lie, and leaves with the first attempt
            assert result is not None and result.contributors == (1, 2, 3, 4) and result.attempts == 1, result
            continue
        assert result is not None and result.contributors == (1, 2, 4) and result.attempts == 2, result
        assert result.total_weight == 3.0 and result.dropped[3].startswith("bad answer"), result.dropped
        assert torch.equal(held, results[0][1]) and torch.allclose(held, torch.full((64,), 3.0))


def test_a_member_whose_retry_a_peer_that_left_refuses_stops_waiting_for_that_peer():
    """Review 109 D2: an owner answers one member half its average (then ends the stream); the others write the
    average and leave. That member's retry, refused NOT_FOUND by the peer that left, still waited allreduce_timeout
    for that peer's values before it gave up (keeping its own values, as it still does)."""
    timeout = 12.0

    async def run():
        async with peers(3) as (group, channels):
            owner = group[2].servicer
            answer, cut = owner._answer, []

            async def half_to_the_first(messages, context):
                if not cut:
                    cut.append(True)
                    messages = messages[:1]  # of two: the stream then ends as if complete
                await answer(messages, context)
            owner._answer = half_to_the_first
            started = time.monotonic()
            results = await average(group, channels, [torch.full((4096,), float(i)) for i in range(3)],
                                    [1.0, 1.0, 1.0], allreduce_timeout=timeout)
            return results, time.monotonic() - started

    results, took = asyncio.run(run())
    cut_short = [peer for peer, (result, _) in enumerate(results, 1) if result is None]
    assert len(cut_short) == 1 and cut_short[0] in (1, 2), results
    assert torch.equal(results[cut_short[0] - 1][1], torch.full((4096,), float(cut_short[0] - 1)))  # its own
    for result, held in results[:cut_short[0] - 1] + results[cut_short[0]:]:
        assert result.contributors == (1, 2, 3) and torch.equal(held, torch.ones(4096)), result
    assert took < timeout / 2, took
