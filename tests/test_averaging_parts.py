"""The pieces of averaging that need no network: parts by bandwidth, the owner's checks and weighted average,
Moshpit grid keys and coordinates, matchmaking records, settings."""
from __future__ import annotations

import asyncio
from typing import NamedTuple

import grpc
import pytest
import torch

from dmoe import AveragerConfig
from dmoe.averaging import grid as moshpit
from dmoe.averaging.allreduce import PartReducer, Refused, SendPace, partition
from dmoe.averaging.matchmaking import parse_declarations
from dmoe.wire.codec import FLOAT16, serialize


def test_parts_are_proportional_to_bandwidth_and_empty_for_client_mode():
    bounds = partition(1000, [1.0, 3.0, 0.0, 1.0])
    sizes = [end - start for start, end in bounds]
    assert sizes == [200, 600, 0, 200]
    assert bounds[0][0] == 0 and bounds[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in member order


def test_parts_cover_every_value_whatever_the_rounding():
    for total in (1, 7, 1001, 1236464):
        bounds = partition(total, [1.0, 2.5, 0.3, 0.0, 1.7, 1.0])
        assert sum(end - start for start, end in bounds) == total and bounds[3][0] == bounds[3][1]
    with pytest.raises(ValueError, match="nobody can own a part"):
        partition(10, [0.0, 0.0])


def reduce(senders: dict[int, tuple[float, torch.Tensor]], members=None, timeout: float = 5.0, **kwargs):
    """Feeds each sender's values to a reducer in one piece; returns (result, reducer)."""
    async def run():
        reducer = PartReducer("run.0.*.1.abcd0123", members or list(senders), 6, timeout=timeout, **kwargs)
        for sender, (weight, values) in senders.items():
            reducer.begin(sender, weight)
            reducer.add(sender, serialize(values))
            reducer.finish(sender)
        return await reducer.wait(), reducer
    return asyncio.run(run())


def test_an_owner_averages_its_part_weighted_by_the_senders_weights():
    a, b = torch.arange(6.0), torch.full((6,), 10.0)
    result, _ = reduce({1: (1.0, a), 2: (3.0, b)})
    assert result.contributors == (1, 2) and result.total_weight == 4.0
    torch.testing.assert_close(result.values, (a + 3 * b) / 4)


def test_weights_all_zero_give_the_plain_mean():
    result, _ = reduce({1: (0.0, torch.zeros(6)), 2: (0.0, torch.full((6,), 2.0))})
    torch.testing.assert_close(result.values, torch.ones(6))


def test_at_the_deadline_an_owner_averages_without_the_members_that_did_not_deliver():
    result, reducer = reduce({1: (1.0, torch.ones(6)), 2: (1.0, torch.zeros(6))}, members=[1, 2, 3], timeout=0.2)
    assert result.contributors == (1, 2) and "within allreduce_timeout" in reducer.dropped[3]


def test_with_compression_the_owner_keeps_what_the_others_decode():
    values = torch.tensor([0.1, 0.2, 0.3, 1 / 3, 5.0, -7.1])
    result, _ = reduce({1: (1.0, values), 2: (1.0, values)}, compression=FLOAT16)
    assert not torch.equal(result.values, values)  # rounded to half precision, as every member will hold it
    torch.testing.assert_close(result.values, values.half().float())


@pytest.mark.parametrize("values, code, words", [
    (torch.tensor([1.0, 2, 3, float("nan"), 5, 6]), grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
    (torch.tensor([1.0, 2, 3, 4e7, 5, 6]), grpc.StatusCode.INVALID_ARGUMENT, "above the limit 1e+06"),
    (torch.ones(7), grpc.StatusCode.INVALID_ARGUMENT, "wrong part size"),
    (torch.ones(6, dtype=torch.float64), grpc.StatusCode.INVALID_ARGUMENT, "must be float32"),
])
def test_a_bad_piece_is_refused_naming_the_problem_and_bans_its_sender(values, code, words):
    async def run():
        reducer = PartReducer("g", [1, 2], 6, timeout=5, max_abs_value=1e6)
        reducer.begin(1, 1.0)
        with pytest.raises(Refused) as refused:
            reducer.add(1, serialize(values))
        assert refused.value.code == code and words in refused.value.message and "banned" in refused.value.message
        with pytest.raises(Refused) as again:
            reducer.begin(1, 1.0)
        assert again.value.code == grpc.StatusCode.PERMISSION_DENIED and "banned" in again.value.message
        reducer.begin(2, 1.0)
        reducer.add(2, serialize(torch.ones(6)))
        reducer.finish(2)
        return await reducer.wait()
    assert asyncio.run(run()).contributors == (2,)  # the round completes for the others


def test_a_duplicate_stream_bans_the_sender_even_after_its_first_stream_delivered():
    async def run():
        reducer = PartReducer("g", [1, 2], 6, timeout=5)
        reducer.begin(1, 1.0)
        reducer.add(1, serialize(torch.ones(6)))
        reducer.finish(1)
        with pytest.raises(Refused) as refused:
            reducer.begin(1, 1.0)
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS and "duplicate sender" in refused.value.message
        for bad_weight in (float("nan"), -1.0, 1e13):
            with pytest.raises(Refused, match="weight"):
                PartReducer("g", [1], 6, timeout=5).begin(1, bad_weight)
        reducer.begin(2, 1.0)
        reducer.add(2, serialize(torch.zeros(6)))
        reducer.finish(2)
        return await reducer.wait()
    assert asyncio.run(run()).contributors == (2,)


def test_group_keys_free_one_dimension_per_round_and_ranks_become_coordinates():
    assert moshpit.group_key("run", 0, (), []) == "run.0.*"
    assert moshpit.group_key("run", 4, (4, 4), [2, 3]) == "run.4.*_3"
    assert moshpit.group_key("run", 5, (4, 4), [2, 3]) == "run.5.2_*"
    assert moshpit.coordinates_after(5, (4, 4), [2, 3], rank=1) == [2, 1]
    assert moshpit.coordinates_after(2, (2, 2, 2), [1, 1, 1], rank=2) == [1, 1, 0]  # more members than the side
    with pytest.raises(ValueError, match="do not lie in the grid"):
        moshpit.check_coordinates((4, 4), [4, 0])


class Entry(NamedTuple):  # what DHT.get returns per subkey (only these fields are read)
    value: str
    expiration: float
    owner: bytes = b""


def test_malformed_declarations_are_skipped():
    record = {
        5: Entry("127.0.0.1:80;1;w", 1e12), 6: Entry("-;0;L3.0123abcd", 1e12), 7: Entry("nohost;1;w", 1e12),
        8: Entry("127.0.0.1:80;inf;w", 1e12), 9: Entry("127.0.0.1:80;1;sleeping", 1e12), "x": Entry("a;1;w", 1e12),
    }
    found = parse_declarations(record)
    assert sorted(found) == [5, 6]
    assert found[6].member.endpoint is None and found[6].member.bandwidth == 0.0 and found[6].state == "L3.0123abcd"


@pytest.mark.parametrize("settings, words", [
    ({"min_group_size": 5}, "min_group_size"), ({"grid": (4, 0)}, "grid"), ({"bandwidth": 0}, "bandwidth"),
    ({"compression": "zip"}, "compression"), ({"allreduce_timeout": 0}, "allreduce_timeout"),
])
def test_bad_settings_are_refused_naming_them(settings, words):
    with pytest.raises(ValueError, match=words):
        AveragerConfig(**settings)


def test_a_paced_peer_sends_no_faster_than_its_rate():
    async def send_five() -> float:
        pace = SendPace(rate=10_000)  # bytes per second
        start = asyncio.get_running_loop().time()
        for _ in range(5):
            await pace.wait(1000)  # each goes 0.1 s after the one before, the first 0.1 s after the start
        return asyncio.get_running_loop().time() - start
    assert asyncio.run(send_five()) >= 0.5
    assert asyncio.run(asyncio.wait_for(SendPace(0).wait(10**9), 1)) is None  # 0: no pacing
