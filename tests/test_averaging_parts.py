"""The pieces of averaging that need no network: parts by bandwidth, the owner's checks and weighted average,
Moshpit grid keys and coordinates, matchmaking records, settings."""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import secrets
import threading
import time
from dataclasses import replace
from typing import NamedTuple

import grpc
import pytest
import torch

from dmoe import AveragerConfig
from dmoe.dht import DHTConfig, Identity
from dmoe.dht.messages import check_entry
from dmoe.averaging import grid as moshpit
from dmoe.averaging import matchmaking
from dmoe.averaging.allreduce import (MAX_WEIGHT, Outcome, PartReducer, PartResult, Refused, SendPace, allreduce,
                                      bad_total, encode_piece, partition, sign_part)
from dmoe.averaging.matchmaking import (MAX_PEER_ID, Declaration, Group, Matchmaker, Member, check_entry_fits,
                                        declaration_value, parse_declarations, parse_group_entry, parse_member,
                                        key_text, peer_id_for, published)
from dmoe.wire import dmoe_pb2
from dmoe.wire.codec import FLOAT16, deserialize, serialize


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


def test_parts_cover_every_value_even_for_bandwidths_near_the_float_limit():
    # a leader may publish any finite bandwidth: their sum must not overflow into parts that cover nothing
    for bandwidths in ([1e308, 1.7e308, 0.0], [1.7e308, 5e-324]):
        bounds = partition(10, bandwidths)
        assert bounds[0][0] == 0 and bounds[-1][1] == 10 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


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


def test_a_duplicate_stream_is_refused_and_the_first_one_still_counts():
    """A duplicate banned the established stream too, which handed eviction to whoever could open one (review 60)."""
    async def run():
        reducer = PartReducer("g", [1, 2], 6, timeout=5)
        reducer.begin(1, 1.0)
        for stage in ("streaming", "delivered"):
            with pytest.raises(Refused) as refused:
                reducer.begin(1, 1.0)
            assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS, stage
            assert "duplicate sender" in refused.value.message and 1 not in reducer.dropped, stage
            if stage == "streaming":
                reducer.add(1, serialize(torch.ones(6)))
                reducer.finish(1)
        for bad_weight in (float("nan"), -1.0, 1e13):
            with pytest.raises(Refused, match="weight"):
                PartReducer("g", [1], 6, timeout=5).begin(1, bad_weight)
        reducer.begin(2, 1.0)
        reducer.add(2, serialize(torch.zeros(6)))
        reducer.finish(2)
        return await reducer.wait()
    assert asyncio.run(run()).contributors == (1, 2)


def test_a_stream_counts_only_with_its_members_signature_for_this_group_owner_and_weight():
    """Ids and groups are public: a stream under a member's id must be signed by the DHT key its group lists."""
    member, outsider = Identity(), Identity()

    async def run():
        reducer = PartReducer("g.0.x", [1, 2], 6, timeout=5, owner=1, keys={2: member.public_key})
        forged = [sign_part(outsider, "g.0.x", 1, 2, 1.0),  # another key
                  sign_part(member, "g.0.x", 7, 2, 1.0),    # made for another owner
                  sign_part(member, "g.0.y", 1, 2, 1.0),    # another group
                  sign_part(member, "g.0.x", 1, 2, 5.0),    # another weight
                  b"", b"\0" * 64]
        for signature in forged:
            with pytest.raises(Refused) as refused:
                reducer.authenticate(2, 1.0, signature)
            assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED and "not signed" in refused.value.message
        with pytest.raises(Refused, match="not a member"):
            reducer.authenticate(3, 1.0, sign_part(member, "g.0.x", 1, 3, 1.0))
        assert not reducer.dropped  # a refused forgery touches nobody
        reducer.authenticate(2, 1.0, sign_part(member, "g.0.x", 1, 2, 1.0))
    asyncio.run(run())


def test_float16_saturates_values_beyond_its_range_and_the_owner_averages_them_without_a_ban():
    async def run():
        reducer = PartReducer("g", [1, 2], 3, timeout=5, compression=FLOAT16, max_abs_value=1e6)
        for sender, values in ((1, torch.tensor([7e4, -7e4, 1.0])), (2, torch.tensor([7e4, 0.0, 3.0]))):
            reducer.begin(sender, 1.0)
            reducer.add(sender, encode_piece(values, FLOAT16, dmoe_pb2.Tensor()))  # as a member sends it
            reducer.finish(sender)
        return await reducer.wait(), reducer
    result, reducer = asyncio.run(run())
    assert result.contributors == (1, 2) and not reducer.dropped
    torch.testing.assert_close(result.values, torch.tensor([65504.0, -32752.0, 2.0]))
    # the owner's answer saturates too: an average beyond float16's range still arrives finite
    answer = PartResult.encode((1, 2), 2.0, torch.tensor([7e4, 1.0]), FLOAT16, piece_elements=8)
    assert deserialize(answer.messages[0].values).tolist() == [65504.0, 1.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_float16_still_carries_nan_and_inf_so_that_they_are_refused(bad):
    async def run():
        reducer = PartReducer("g", [1, 2], 3, timeout=5, compression=FLOAT16, max_abs_value=1e6)
        reducer.begin(1, 1.0)
        with pytest.raises(Refused, match="NaN or Inf"):
            reducer.add(1, encode_piece(torch.tensor([7e4, bad, 1.0]), FLOAT16, dmoe_pb2.Tensor()))
        return reducer
    assert 1 in asyncio.run(run()).dropped


class FakeDHT:
    """What matchmaking's leader and readers call on a DHT: stores succeed and are kept, reads return them."""

    def __init__(self):
        self.records: dict[str, dict[int, Entry]] = {}
        self.config = DHTConfig()

    def store_many(self, records):
        for key, entries in records.items():
            for subkey, (value, expiration) in entries.items():
                check_entry(subkey, value, expiration, self.config.max_value_bytes)  # as DHT.store_many does
                self.records.setdefault(key, {})[subkey] = Entry(value, expiration, b"leader")
        return {key: {subkey: True for subkey in entries} for key, entries in records.items()}

    def get_many(self, keys):
        return {key: self.records.get(key, {}) for key in keys}


class SquattedDHT(FakeDHT):
    """A DHT whose replicas mostly hold another key's entries where ``records`` has them: a store there counts as
    accepted (a minority of replicas took it), and reads still give the other key's entry."""

    def __init__(self):
        super().__init__()
        self.identity = Identity()

    def store_many(self, records):
        for key, entries in records.items():
            for subkey, (value, expiration) in entries.items():
                held = self.records.setdefault(key, {})
                if subkey not in held or held[subkey].owner == self.identity.public_key:
                    held[subkey] = Entry(value, expiration, self.identity.public_key)
        return {key: {subkey: True for subkey in entries} for key, entries in records.items()}

    def get(self, key):
        return dict(self.records.get(key, {}))


def test_a_declaration_read_back_under_another_key_is_made_again_under_a_new_id(caplog, monkeypatch):
    """A store counts as accepted when any replica takes it: a peer whose id most replicas held for another key was
    read (by everyone, itself too) as that key's entry, skipped, and never seen."""
    dht = SquattedDHT()
    matchmaker = Matchmaker(dht, Member(0, "127.0.0.1:1000", 1.0), AveragerConfig(matchmaking_time=0.3,
                                                                                 poll_period=0.05), threading.Event())
    taken = peer_id_for(dht.identity.public_key, "run.0.*", "00000000")
    dht.records["run.0.*"] = {taken: Entry("127.0.0.1:9;0;00000000;w", 1e12, b"squatter")}
    salts = iter(["00000000"])
    monkeypatch.setattr(matchmaking, "new_salt", lambda: next(salts, None) or secrets.token_hex(4))
    assert matchmaker.find_group(0, "run.0.*", time.time() + 5) is None  # alone: nobody to average with
    assert matchmaker.me.peer_id != taken
    assert "the DHT nodes read give its id to another key" in caplog.text
    mine = parse_declarations(dht.records["run.0.*"], "run.0.*")
    assert set(mine) == {matchmaker.me.peer_id} and mine[matchmaker.me.peer_id].state == "x"  # gone, at the end


class Killed(Exception):
    """What a :class:`SharedDHT` view raises once its peer's process is dead: the search ends where it stood."""


class SharedDHT:
    """One peer's view of a DHT that several share (``records``): entries are owned by this view's key and vanish
    once expired, as on the DHT; once ``killed`` (its peer's process died), every call raises :class:`Killed`."""

    def __init__(self, records: dict):
        self.records, self.identity, self.config, self.killed = records, Identity(), DHTConfig(), False

    def store_many(self, records):
        if self.killed:
            raise Killed
        for key, entries in records.items():
            for subkey, (value, expiration) in entries.items():
                check_entry(subkey, value, expiration, self.config.max_value_bytes)
                self.records.setdefault(key, {})[subkey] = Entry(value, expiration, self.identity.public_key)
        return {key: {subkey: True for subkey in entries} for key, entries in records.items()}

    def get(self, key):
        if self.killed:
            raise Killed
        now = time.time()
        return {subkey: entry for subkey, entry in dict(self.records.get(key, {})).items() if entry.expiration > now}

    def get_many(self, keys):
        return {key: self.get(key) for key in keys}


def searching(views: list[SharedDHT], config: AveragerConfig, deadline: float,
              pool: concurrent.futures.Executor) -> list[concurrent.futures.Future]:
    """A matchmaking search of round 0 of ``run`` per view, each in a thread of ``pool``."""
    return [pool.submit(Matchmaker(view, Member(0, f"127.0.0.1:{1000 + i}", 1.0), config, threading.Event())
                        .find_group, 0, "run.0.*", deadline) for i, view in enumerate(views)]


def test_a_peer_that_dies_while_waiting_stops_holding_up_the_others_about_declaration_ttl_later(monkeypatch):
    """A peer's first declaration lived matchmaking_time + declaration_ttl: when it drew the smallest id (1 in n
    peers does) and died, every other peer of its key waited for it to lead that long, even with a full group there
    (review 98 D3). Waiting peers now declare for declaration_ttl + margin and renew it as they poll."""
    records: dict = {}
    config = AveragerConfig(target_group_size=2, matchmaking_time=10.0, poll_period=0.05, declaration_ttl=0.5)
    dying, *alive = [SharedDHT(records) for _ in range(3)]
    small = next(salt for salt in (f"{i:08x}" for i in range(10**6))  # an id below everyone else's
                 if peer_id_for(dying.identity.public_key, "run.0.*", salt) < min(
                     peer_id_for(view.identity.public_key, "run.0.*", "ffffffff") for view in alive))
    monkeypatch.setattr(matchmaking, "new_salt", lambda: "ffffffff" if records.get("run.0.*") else small)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        (dead,) = searching([dying], config, time.time() + 30, pool)
        while not records.get("run.0.*"):  # it declared itself
            time.sleep(0.01)
        assert parse_declarations(records["run.0.*"], "run.0.*")  # under the id of the small salt
        dying.killed = True  # neither renews its declaration nor withdraws it
        start = time.monotonic()
        groups = [future.result(timeout=60) for future in searching(alive, config, time.time() + 30, pool)]
        took = time.monotonic() - start
        with pytest.raises(Killed):
            dead.result(timeout=10)
    assert groups[0] is not None and groups[0] == groups[1] and len(groups[0].members) == 2
    assert took < 5.0, took  # its declaration lapses after 0.5 + 1 s (the margin); it lived 10.5 s


def test_a_waiting_peer_renews_a_short_declaration_as_long_as_it_waits():
    """Alone, it waits to fill its own group (as a leader): its declaration stays readable throughout, yet never
    lives more than declaration_ttl + margin (+ the clock skew's allowance) ahead (review 98 D3)."""
    records: dict = {}
    config = AveragerConfig(target_group_size=2, matchmaking_time=2.5, poll_period=0.05, declaration_ttl=0.3)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        (search,) = searching([SharedDHT(records)], config, time.time() + 30, pool)
        reader, ahead = SharedDHT(records), []
        while not search.done():
            now, found = time.time(), parse_declarations(reader.get("run.0.*"), "run.0.*")
            if ahead or found:  # from its first declaration on
                ahead.append(max((d.expiration - now for d in found.values()), default=0.0))
            time.sleep(0.05)
        assert search.result() is None  # nobody came
    assert len(ahead) > 20 and 0.0 < min(ahead[:-1]) and max(ahead) <= 0.3 + 1.0 + matchmaking.CLOCK_SKEW + 0.05, ahead


def test_a_peer_whose_clock_is_seconds_behind_is_in_the_groups_of_the_others():
    """A waiting declaration lived declaration_ttl + margin ahead by its peer's clock, and leaders took it only while
    more than the margin was left by theirs: a peer 2.5 s behind was left out of every group it did not lead (and
    a trainer then downloaded the state at every step; review 102)."""
    records: dict = {}
    config = AveragerConfig(target_group_size=3, matchmaking_time=3.0, poll_period=0.05)
    views = [SharedDHT(records) for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        matchmakers = [Matchmaker(view, Member(0, f"127.0.0.1:{1000 + i}", 1.0), config, threading.Event())
                       for i, view in enumerate(views)]
        matchmakers[0].clock = lambda: time.time() - 2.5
        groups = [future.result(timeout=30) for future in
                  [pool.submit(m.find_group, 0, "run.0.*", m.clock() + 20) for m in matchmakers]]
    assert all(group is not None and len(group.members) == 3 for group in groups), groups


def test_a_leader_short_of_its_target_forms_its_group_before_the_deadline_of_a_short_step():
    """With step(timeout=...) below matchmaking_time, a leader short of target_group_size waited out the
    matchmaking time past the step's deadline: peers that were all there never averaged (review 98 D4)."""
    records: dict = {}
    config = AveragerConfig(target_group_size=4, matchmaking_time=30.0, poll_period=0.05)
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        groups = [future.result(timeout=60) for future in
                  searching([SharedDHT(records) for _ in range(2)], config, time.time() + 3.0, pool)]
    assert groups[0] is not None and groups[0] == groups[1] and len(groups[0].members) == 2
    assert time.monotonic() - start < 3.0 - 0.5  # formed with time left for the all-reduce


def test_a_leader_cuts_the_parts_from_the_bandwidths_its_members_read_from_the_group_record():
    # describe() keeps 6 significant digits: a leader cutting from its own unrounded bandwidth got other bounds
    # than everyone else, and every owner refused every stream as the wrong size
    dht = FakeDHT()
    me = Member(5, "127.0.0.1:1000", 94990151.83623111, KEY)
    leader = Matchmaker(dht, me, AveragerConfig(), threading.Event())
    other = parse_group_entry(9, f"127.0.0.1:1001;54873527.695502765;{O}")
    group = leader._lead(0, "run.0.*", [leader.me, other])
    read = tuple(parse_group_entry(pid, entry.value) for pid, entry in sorted(dht.records[group.group_id].items()))
    assert group.members == read
    assert partition(10**6 + 1, [m.bandwidth for m in group.members]) == \
        partition(10**6 + 1, [m.bandwidth for m in read])


def test_a_leader_leaves_out_a_member_its_group_entry_cannot_hold_and_a_peer_that_never_fits_is_refused():
    """A member's declaration fits the DHT's 96 bytes per value without the key a group entry adds: a leader that
    took one whose endpoint was long stored a group the DHT refused, and its step raised (review 98)."""
    long_endpoint = "[2001:db8:85a3:1111:2222:3333:8a2e:7334]:65535"  # 47 characters, declared with a 1-digit bandwidth
    assert check_entry(1, declaration_value(Member(1, long_endpoint, 1.0), "0123abcd", "w"), 1e12, 96) is None
    with pytest.raises(ValueError, match=r"over the DHT's max_value_bytes \(96\): announce a shorter host"):
        check_entry_fits(Member(1, long_endpoint, 97331933.29226607, KEY), 96)
    ipv6 = Member(1, "[2001:db8:85a3::8a2e:370:7334]:51000", 97331933.29226607, KEY)
    check_entry_fits(ipv6, 96)
    assert parse_group_entry(1, ipv6.entry()) == published(ipv6)
    dht = FakeDHT()
    leader = Matchmaker(dht, Member(5, "127.0.0.1:1000", 1.0, KEY), AveragerConfig(target_group_size=3,
                                                                                  min_group_size=2), threading.Event())
    now = time.time()
    waiting = {pid: Declaration(replace(published(Member(pid, endpoint, 97331933.29226607)), key=OTHER_KEY), "w",
                                now + 60, OTHER_KEY) for pid, endpoint in ((2**31 - 2, long_endpoint),
                                                                           (2**31 - 1, "127.0.0.1:1001"))}
    leader.me = replace(leader.me, peer_id=1)
    group = leader._look(0, "run.0.*", waiting, {}, {}, matchmaking_ends=now, target=3)  # leads who is there
    assert [m.peer_id for m in group.members] == [1, 2**31 - 1]


KEY, OTHER_KEY = bytes(range(32)), bytes(range(32, 64))
K, O = key_text(KEY), key_text(OTHER_KEY)


@pytest.mark.parametrize("me, entries, reason", [
    (Member(5, "127.0.0.1:1000", 1.0, KEY), {5: f"127.0.0.1:1000;0;{K}", 1: f"127.0.0.1:9;0;{O}"},
     "nobody could own a part"),
    (Member(5, None, 0.0, KEY), {5: f"127.0.0.1:1000;1;{K}", 1: f"127.0.0.1:9;1;{O}"},
     "lists this peer at 127.0.0.1:1000"),
    (Member(5, "127.0.0.1:1000", 1.0, KEY), {5: f"127.0.0.1:1000;1;{K}", 1: f"127.0.0.1:9;nan;{O}"},
     "malformed entries"),
    # a leader that lists no keys (or another key for this peer): its members' streams could not be authenticated
    (Member(5, "127.0.0.1:1000", 1.0, KEY), {5: "127.0.0.1:1000;1", 1: "127.0.0.1:9;1"}, "malformed entries"),
    (Member(5, "127.0.0.1:1000", 1.0, KEY), {5: f"127.0.0.1:1000;1;{O}", 1: f"127.0.0.1:9;1;{O}"},
     "lists this peer with DHT key"),
])
def test_matchmaking_ignores_a_group_that_cannot_average(me, entries, reason, caplog):
    dht = FakeDHT()
    dht.store_many({"run.0.*.1.0123abcd": {pid: (value, 1e12) for pid, value in entries.items()}})
    matchmaker = Matchmaker(dht, me, AveragerConfig(), threading.Event())
    leaders = {1: Declaration(parse_member(1, "127.0.0.1:9;1"), "L2.0123abcd", 1e12, b"leader")}
    groups: dict[int, Group] = {}
    matchmaker._read_groups(0, "run.0.*", leaders, groups)
    assert not groups and reason in caplog.text
    dht.store_many({"run.0.*.1.0123abcd": {5: (me.entry(), 1e12), 1: (f"127.0.0.1:9;1;{O}", 1e12)}})
    matchmaker._read_groups(0, "run.0.*", leaders, groups)
    assert list(groups) == [1]  # a sane group is joined


def run_allreduce(members: list[Member], me: int, answers: dict[int, Outcome] | None = None,
                  register=None, weight: float = 1.0):
    """This peer's all-reduce among ``members`` with values of 4 ones, each owner answering ``answers[owner]`` (and
    the values it was sent); returns (result, sends made)."""
    sent = []

    async def send(stub, group_id, sender, weight, values, out, **kwargs) -> Outcome:
        sent.append(stub)
        out.copy_(values)
        return answers[stub]

    async def run():
        group = Group("run.0.*.1.0123abcd", 0, members[0].peer_id, tuple(members))
        return await allreduce(group, me, torch.ones(4), weight, torch.empty(4), stub_for=lambda endpoint: int(
            endpoint.rpartition(":")[2]), register=register, compression=0, piece_elements=4, max_abs_value=0.0,
            allreduce_timeout=5, join_timeout=1, max_retries=1, min_group_size=2, deadline=time.monotonic() + 10,
            send=send)
    return asyncio.run(run()), sent


def test_a_group_that_cannot_average_fails_the_round_without_raising():
    nobody_owns = [Member(1, "127.0.0.1:1", 0.0), Member(2, "127.0.0.1:2", 0.0)]
    assert run_allreduce(nobody_owns, me=1) == (None, [])
    # this peer is in client mode (no register), yet the group gives it a part
    assert run_allreduce([Member(1, "127.0.0.1:1", 1.0), Member(2, "127.0.0.1:2", 1.0)], me=1) == (None, [])


def test_bad_total_accepts_what_a_sum_of_accepted_weights_can_be():
    assert bad_total((1, 2), 0.0, me=1, weight=0.0) is None  # every weight 0: an honest total of 0
    assert bad_total((1, 2), 2 * MAX_WEIGHT, me=1, weight=MAX_WEIGHT) is None
    assert "not in" in bad_total((1, 2), -4.0, me=1, weight=1.0)
    assert "not in" in bad_total((1, 2), 2 * MAX_WEIGHT * 1.001, me=1, weight=1.0)
    assert "not in" in bad_total((1, 2), float("inf"), me=1, weight=1.0)
    assert "below this member's own weight" in bad_total((1, 2), 0.5, me=1, weight=1.0)
    assert bad_total((2, 3), 0.5, me=1, weight=1.0) is None  # left out: its weight is not in the total


@pytest.mark.parametrize("totals", [(-4.0, -4.0), (3.1e12, 3.1e12), (0.5, 0.5), (3.0, 4.0)])
def test_an_absurd_or_disagreeing_total_weight_fails_the_round(totals):
    # this peer (3) is in client mode; owners 1 and 2 answer contributors (1, 2, 3) with these totals. Taken, a
    # negative total made this peer's weight negative, and every owner refused its every later step
    members = [Member(1, "127.0.0.1:1", 1.0), Member(2, "127.0.0.1:2", 1.0), Member(3, None, 0.0)]
    answers = {owner: Outcome((1, 2, 3), total) for owner, total in zip((1, 2), totals)}
    result, _ = run_allreduce(members, me=3, answers=answers)
    assert result is None


def test_owners_agreeing_on_a_sane_total_weight_give_it_to_the_member():
    members = [Member(1, "127.0.0.1:1", 1.0), Member(2, "127.0.0.1:2", 1.0), Member(3, None, 0.0)]
    result, sent = run_allreduce(members, me=3, answers={1: Outcome((1, 2, 3), 3.0), 2: Outcome((1, 2, 3), 3.0)})
    assert result is not None and result.total_weight == 3.0 and result.contributors == (1, 2, 3)
    assert sorted(sent) == [1, 2]


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
    key, salt = "run.0.*", "0123abcd"
    owners = [bytes([i]) * 32 for i in range(8)]
    ids = [peer_id_for(owner, key, salt) for owner in owners]
    record = {
        ids[0]: Entry(f"127.0.0.1:80;1;{salt};w", 1e12, owners[0]),
        ids[1]: Entry(f"-;0;{salt};L3.0123abcd", 1e12, owners[1]),
        ids[2]: Entry(f"nohost;1;{salt};w", 1e12, owners[2]),
        ids[3]: Entry(f"127.0.0.1:80;inf;{salt};w", 1e12, owners[3]),
        ids[4]: Entry(f"127.0.0.1:80;1;{salt};sleeping", 1e12, owners[4]),
        ids[5]: Entry("127.0.0.1:80;1;w", 1e12, owners[5]),  # no salt
        ids[6]: Entry(f"127.0.0.1:80;1;{salt}x;w", 1e12, owners[6]),
        "x": Entry(f"a;1;{salt};w", 1e12, owners[7]),
    }
    found = parse_declarations(record, key)
    assert sorted(found) == sorted(ids[:2])
    assert found[ids[1]].member.endpoint is None and found[ids[1]].member.bandwidth == 0.0
    assert found[ids[1]].state == "L3.0123abcd" and found[ids[1]].owner == owners[1]


@pytest.mark.parametrize("endpoint", ["unix:1234", "unix:/run/x.sock:1", "unix-abstract:name:1", "dns://h/h:1"])
def test_a_member_at_a_grpc_target_that_is_no_host_port_is_refused(endpoint):
    """Review 99 D3: members dial each other's endpoints as gRPC targets: unix:/path:1 was a unix socket of each
    member's own machine."""
    with pytest.raises(ValueError, match="bad endpoint"):
        parse_member(1, f"{endpoint};1")
    assert parse_member(1, "[::1]:1234;1").endpoint == "[::1]:1234"
    assert parse_member(1, "node-1.example.org:1234;1").endpoint == "node-1.example.org:1234"


def test_a_declaration_counts_only_under_the_id_its_owner_key_makes_in_that_record():
    """Ids are owned int subkeys, and the first key to store one owns it: an id anyone can store under is an id
    anyone can take first, in the predictable keys of rounds to come. So an id is a hash of the declarer's key, the
    record's key and a salt, and an entry under any other id is no declaration."""
    key, salt, victim, hostile = "run.1.*", "0123abcd", b"v" * 32, b"h" * 32
    pid = peer_id_for(victim, key, salt)
    assert 1 <= pid <= MAX_PEER_ID
    assert len({peer_id_for(victim, key, f"{s:08x}") for s in range(100)}) == 100  # each salt, another id
    assert peer_id_for(victim, "run.2.*", salt) != pid and peer_id_for(hostile, key, salt) != pid
    value = f"127.0.0.1:80;1;{salt};w"
    assert list(parse_declarations({pid: Entry(value, 1e12, victim)}, key)) == [pid]
    assert parse_declarations({pid: Entry(value, 1e12, hostile)}, key) == {}  # stored first by another key
    assert parse_declarations({pid: Entry(value, 1e12, victim)}, "run.2.*") == {}  # copied to another round


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


@pytest.mark.parametrize("allreduce_timeout", [1.2e6, math.inf])
def test_an_averaging_server_with_a_timeout_of_weeks_starts(allreduce_timeout):
    """Review 116 D2: the connection age (review 109 D1) in milliseconds overflowed gRPC's 32-bit option past 12.4
    days of timeout, and the averager did not start."""
    from dmoe.averaging.service import MAX_GRPC_MS, connection_limits

    options = connection_limits(allreduce_timeout, 3.0)
    assert dict(options)["grpc.max_connection_age_ms"] == MAX_GRPC_MS
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1), options=options)
    server.add_insecure_port("127.0.0.1:0")
    server.start()
    server.stop(None)
