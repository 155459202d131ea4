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

from dmoe.averaging.allreduce import PartReducer, Refused, allreduce, send_and_receive, sign_part
from dmoe.averaging.matchmaking import Group, Member
from dmoe.averaging.service import AveragingServicer
from dmoe.dht import Identity
from dmoe.wire import dmoe_pb2_grpc

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
        return dmoe_pb2_grpc.AveragingServiceStub(channels[endpoint])

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
