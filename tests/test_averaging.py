"""Decentralized averaging between real processes on 127.0.0.1: exact weighted means in one group and on Moshpit
grids, a peer killed or stalled mid all-reduce, hostile members and owners, compression.

A DHT bootstrap node runs in its own process; peers run in ``tests/averaging_peers.py`` processes, many per process
as threads (each with its own DHT node and gRPC server), every group spread over two processes. The runs of the
module start together once (``runs``); each test checks its own run's saved tensors and reports.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

import grpc
import pytest
import torch
from kademlia.node import Node
from kademlia.utils import digest

from dmoe import DHT, DecentralizedAverager
from dmoe.averaging import averager as averager_module
from dmoe.averaging import matchmaking
from dmoe.averaging.allreduce import PartReducer
from dmoe.averaging.matchmaking import Group, Member, key_text, new_salt, parse_declarations, peer_id_for
from dmoe.averaging import service as service_module
from dmoe.averaging.service import AveragingServicer
from dmoe.dht import Identity
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from dmoe.wire.codec import serialize
from tests.averaging_peers import ATTACKS, MUTE, STALLED, make_tensors, weight_of
from tests.procs import Proc, processes, running

NAN = float("nan")

#: matchmaking waits up to 60 s for a group to fill (a full group forms at once; the wait only runs out when a peer
#: is late): the processes start at their own pace, and ~40 peers poll one DHT node, on a loaded machine. With 30 s
#: a suite on two workers once saw a peer of the uint8 job miss its group (the other three averaged without it).
QUICK = {"poll_period": 0.1, "piece_bytes": 262144, "matchmaking_time": 60.0}
CLIENT = {"settings": {"client_mode": True}}

JOBS = [
    # one group, one round: a peer with 3x the bandwidth (a 3x part), peers in client mode (no part)
    {"prefix": "one4", "indices": [0, 1, 2, 3], "weighted": True,
     "peers": {"0": {"settings": {"bandwidth": 3.0}}, "3": CLIENT}},
    {"prefix": "one8", "indices": list(range(8)), "weighted": True, "peers": {"6": CLIENT, "7": CLIENT}},
    # ... and peers whose DHT nodes are in client mode (as trainers' are): the records live on the bootstrap node
    {"prefix": "one9", "indices": list(range(9)), "weighted": True, "peers": {"4": CLIENT}, "dht_client_mode": True},
    # full Moshpit grids: d rounds
    {"prefix": "grid8", "indices": list(range(8)), "weighted": True, "grid": [2, 2, 2], "rounds": 3},
    {"prefix": "grid9", "indices": list(range(9)), "weighted": True, "grid": [3, 3], "rounds": 2},
    # every peer starts in the same cell: ranks taken as coordinates spread them over the grid
    {"prefix": "crowd", "indices": [0, 1, 2, 3], "weighted": True, "grid": [2, 2], "cell": [0, 0], "rounds": 2},
    {"prefix": "float16", "indices": [0, 1, 2, 3], "weighted": True, "settings": {"compression": "float16"}},
    {"prefix": "uint8", "indices": [0, 1, 2, 3], "weighted": True, "settings": {"compression": "uint8"}},
    # failures: peer 3 stalls / attacks / lies as an owner
    # (8 s: with 4, an honest member of a loaded suite once read the group too late to deliver in time)
    {"prefix": "stall", "indices": [0, 1, 2, 3], "settings": {"allreduce_timeout": 8.0},
     "peers": {"3": {"behaviour": "stall"}}},
    {"prefix": "hostile", "indices": [0, 1, 2, 3], "weighted": True, "rounds": len(ATTACKS),
     "settings": {"allreduce_timeout": 10.0}, "peers": {"3": {"behaviour": "hostile"}}},
    {"prefix": "liar", "indices": [0, 1, 2, 3], "settings": {"allreduce_timeout": 10.0},
     "peers": {"3": {"behaviour": "bad-owner"}}},
    # peer 1 reads its group seconds after the others (a slow DHT): it is sent its parts again, not dropped
    {"prefix": "late", "indices": [0, 1, 2, 3], "weighted": True, "peers": {"1": {"behaviour": "late"}}},
]


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[str]:
    with running("-m", "dmoe.dht", "--log-level", "WARNING") as proc:
        yield proc.endpoint()


def start_peers(bootstrap: str, out: Path, jobs: Sequence[dict[str, Any]], debug: bool = False) -> Proc:
    jobs = [{**job, "settings": {**QUICK, **job.get("settings", {})}} for job in jobs]  # run by one process
    return Proc(["-m", "tests.averaging_peers", "--initial-peers", bootstrap, "--out", str(out),
                 "--jobs", json.dumps(jobs), *(["--debug"] if debug else [])])


def results_of(proc: Proc, timeout: float = 240.0) -> dict[tuple[str, int], dict]:
    proc.popen.wait(timeout)
    proc.wait_for("^result ", timeout=5)  # raises with the output if the process printed no result
    found = {}
    for line in proc.output:
        if line.startswith("result "):
            result = json.loads(line[len("result "):])
            found[result["prefix"], result["index"]] = result
    return found


@pytest.fixture(scope="module")
def runs(bootstrap: str, tmp_path_factory) -> tuple[Path, dict[str, dict[int, dict]]]:
    """Every job of JOBS at once, each job's peers split between two processes."""
    out = tmp_path_factory.mktemp("averaging")
    jobs = [job if job.get("grid") else
            {**job, "settings": {"target_group_size": len(job["indices"]), **job.get("settings", {})}} for job in JOBS]
    halves = [[{**job, "indices": job["indices"][:len(job["indices"]) // 2]} for job in jobs],
              [{**job, "indices": job["indices"][len(job["indices"]) // 2:]} for job in jobs]]
    with processes() as procs:
        procs += [start_peers(bootstrap, out, jobs) for jobs in halves]
        found = {key: result for proc in procs for key, result in results_of(proc).items()}
        warnings = [line.strip() for proc in procs for line in proc.output
                    if " WARNING " in line or " INFO dmoe.averaging.matchmaking" in line
                    or " INFO dmoe.averaging.allreduce" in line]
    by_prefix: dict[str, dict[int, dict]] = {}
    for (prefix, index), result in found.items():
        # the peers' warnings and matchmaking news about this job's groups (keys begin with the prefix), for failures
        result["warnings"] = [line for line in warnings if f" {prefix}." in line]
        by_prefix.setdefault(prefix, {})[index] = result
    return out, by_prefix


def job_results(runs, prefix: str) -> tuple[Path, dict[int, dict]]:
    out, by_prefix = runs
    results = by_prefix[prefix]
    for result in results.values():
        assert result["error"] is None, result["error"]
    return out / prefix, results


def weighted_mean(indices: Sequence[int], weighted: bool = True) -> list[torch.Tensor]:
    weights = [weight_of(i, weighted) for i in indices]
    tensors = [make_tensors(i) for i in indices]
    return [sum(w * t[k] for w, t in zip(weights, tensors)) / sum(weights) for k in range(len(tensors[0]))]


def saved(folder: Path, index: int, round_number: int = -1) -> list[torch.Tensor]:
    if round_number < 0:
        round_number = max(int(p.name.split(".r")[1].split(".")[0]) for p in folder.glob(f"peer{index}.r*.pt"))
    return torch.load(folder / f"peer{index}.r{round_number}.pt")


def assert_holds(folder: Path, indices: Sequence[int], expected: Sequence[torch.Tensor], round_number: int = -1,
                 atol: float = 1e-5, results: dict[int, dict] | None = None) -> None:
    """``results``: the job's, whose groups a failure describes (who averaged with whom, and the peers' log)."""
    groups = f"; {describe_groups(results)}" if results is not None else ""
    for index in indices:
        for got, want in zip(saved(folder, index, round_number), expected):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"peer {index}: {m}{groups}")


@pytest.mark.parametrize("prefix", ["one4", "one8", "one9"])
def test_one_group_holds_the_exact_weighted_mean_after_one_round(runs, prefix):
    folder, results = job_results(runs, prefix)
    everyone = sorted(results)
    # first who averaged with whom: a peer left out (matchmaking, a group it could not read, a part that never
    # came) shows here by name, where the tensors alone would only show a wrong mean
    for index, result in sorted(results.items()):
        (info,) = result["infos"]
        assert info is not None and info["members"] == info["contributors"] and len(info["members"]) == len(
            everyone), f"peer {index} of {prefix}: {describe_groups(results)}"
        assert info["weight"] == pytest.approx(sum(weight_of(i) for i in everyone) / len(everyone))
    assert_holds(folder, everyone, weighted_mean(everyone), results=results)


def describe_groups(results: dict[int, dict]) -> str:
    """Each peer's rounds: its group's size, how many contributed, what it dropped, and the seconds taken."""
    def round_of(info: dict | None) -> str:
        if info is None:
            return "no group"
        return (f"group {info.get('group_id', '?')} of {len(info['members'])}, {len(info['contributors'])} "
                f"contributed, dropped {info.get('dropped') or '-'}")
    peers = "; ".join(f"peer {index}: [{', '.join(map(round_of, result['infos']))}] in "
                      f"{', '.join(f'{s:.1f}' for s in result['seconds'])} s"
                      for index, result in sorted(results.items()))
    warnings = next(iter(results.values())).get("warnings") or ["none"]
    return f"{peers}; the peers' log: " + " | ".join(warnings)


@pytest.mark.parametrize("prefix, grid", [("grid8", (2, 2, 2)), ("grid9", (3, 3))])
def test_a_full_moshpit_grid_holds_the_exact_weighted_mean_after_d_rounds(runs, prefix, grid):
    folder, results = job_results(runs, prefix)
    everyone = sorted(results)
    assert_holds(folder, everyone, weighted_mean(everyone), round_number=len(grid) - 1, results=results)
    for result in results.values():
        assert [len(info["members"]) for info in result["infos"]] == [max(grid)] * len(grid)


def test_one_round_of_a_grid_averages_each_line_only(runs):
    """After round 0 of a 3x3 grid a peer holds the mean of its line, not the global one: every round matters."""
    folder, results = job_results(runs, "grid9")
    for column in range(3):  # round 0 frees dimension 0: cells (0, c), (1, c), (2, c), peers c, 3 + c, 6 + c
        line = [column, 3 + column, 6 + column]
        assert_holds(folder, line, weighted_mean(line), round_number=0, results=results)
    assert not torch.allclose(saved(folder, 0, 0)[0], weighted_mean(range(9))[0], atol=1e-3)


def test_peers_crowded_in_one_cell_spread_over_the_grid_and_reach_the_exact_mean(runs):
    """Moshpit's rule: after averaging, a peer takes its rank in its group as the coordinate just averaged along,
    so two pairs from one crowded cell of a 2x2 grid pair across in the next round."""
    folder, results = job_results(runs, "crowd")
    assert_holds(folder, [0, 1, 2, 3], weighted_mean([0, 1, 2, 3]), round_number=1, results=results)
    # a peer's id is new in every round: members by index
    index_of = {(r, info["peer_id"]): index for index, result in results.items()
                for r, info in enumerate(result["infos"])}
    for index, result in results.items():
        first, second = ({index_of[r, pid] for pid in info["members"]} for r, info in enumerate(result["infos"]))
        assert len(first) == len(second) == 2 and first & second == {index}


@pytest.mark.parametrize("compression", ["float16", "uint8"])
def test_compressed_rounds_stay_within_the_codec_error(runs, compression):
    folder, results = job_results(runs, compression)
    everyone = sorted(results)
    alone = [i for i in everyone if results[i]["infos"] != [] and results[i]["infos"][0] is None]
    assert not alone, f"peers {alone} found no group: the codec's error is measured over a full group"
    exact, inputs = weighted_mean(everyone), [make_tensors(i) for i in everyone]
    held = [saved(folder, i) for i in everyone]
    for k, want in enumerate(exact):
        got = held[0][k]
        assert all(torch.equal(h[k], got) for h in held)  # every member holds the very same values
        error = float((got - want).abs().max())
        largest = max(float(x[k].abs().max()) for x in inputs) + float(want.abs().max())
        if compression == "float16":
            # each value is rounded to half precision twice (on its way to the owner, and back): 2**-11 each
            assert 0 < error <= largest * 2**-11
        else:
            # one 8-bit step of a block's range each way (a weighted mean of the senders' steps, then the answer's)
            spread = max(float(x[k].max() - x[k].min()) for x in inputs) + float(want.max() - want.min())
            assert largest * 2**-11 < error <= spread / 255


def test_an_owner_that_learns_its_group_late_is_sent_its_parts_again_and_everyone_averages(runs):
    folder, results = job_results(runs, "late")
    for index, result in sorted(results.items()):
        (info,) = result["infos"]
        # the others' first streams to peer 1 were refused (it did not know the group within its join_timeout);
        # they sent them again, so nobody was dropped and no second attempt was needed
        assert info is not None and len(info["contributors"]) == 4 and info["attempts"] == 1 and \
            not info["dropped"], f"peer {index}: {describe_groups(results)}"
    assert_holds(folder, [0, 1, 2, 3], weighted_mean([0, 1, 2, 3]), results=results)


def test_a_member_stalling_past_allreduce_timeout_is_dropped_and_keeps_its_own_values(runs):
    folder, results = job_results(runs, "stall")
    assert_holds(folder, [0, 1, 2], weighted_mean([0, 1, 2], weighted=False), results=results)
    # it could not agree with anyone: its own values, untouched
    assert_holds(folder, [3], make_tensors(3), atol=0, results=results)
    assert results[3]["infos"] == [None]
    for index in range(3):
        (info,) = results[index]["infos"]
        assert len(info["contributors"]) == 3 and info["attempts"] == 2
        # the member left out is named with the reason, though its own part answered (it was no failed owner)
        assert set(map(int, info["dropped"])) == set(info["members"]) - set(info["contributors"]), info
        assert all("within allreduce_timeout" in reason for reason in info["dropped"].values()), info
        # the all-reduce waited allreduce_timeout for it, and not much longer (matchmaking is left out: all the
        # module's ~40 peers start at once, and on a loaded CI machine forming the group alone once took ~10 s)
        assert 8 <= info["allreduce_s"] < 8 * 4, info


def test_a_hostile_member_is_refused_with_clear_statuses_and_the_others_average_correctly(runs):
    folder, results = job_results(runs, "hostile")
    assert_holds(folder, [0, 1, 2], weighted_mean([0, 1, 2]), results=results)
    for round_number in range(len(ATTACKS)):  # every round averaged, among the honest members only
        infos = [results[index]["infos"][round_number] for index in range(3)]
        assert all(info is not None for info in infos), describe_groups(results)
        honest = {info["peer_id"] for info in infos}  # ids are drawn afresh each round
        assert all(len(info["members"]) == 4 and set(info["contributors"]) == honest for info in infos), infos
    statuses: dict[str, list[dict]] = {}
    for status in results[3]["statuses"]:
        statuses.setdefault(status["attack"], []).append(status)
    expected = {
        "unknown round": ("NOT_FOUND", "unknown round 7"),
        "unknown group": ("NOT_FOUND", "unknown group"),
        "not a member": ("PERMISSION_DENIED", "not a member"),
        "nan": ("INVALID_ARGUMENT", "NaN"),
        "huge": ("INVALID_ARGUMENT", "above the limit"),
        "short": ("INVALID_ARGUMENT", "wrong part size"),
        "float64": ("INVALID_ARGUMENT", "must be float32"),
        "2d": ("INVALID_ARGUMENT", "must be 1-d"),
        "duplicate": ("ALREADY_EXISTS", "duplicate sender"),  # the second stream only: the first one counts
    }
    for attack, (code, words) in expected.items():
        assert any(s["code"] == code and words in s["message"] for s in statuses[attack]), (attack, statuses[attack])
    for attack in ("nan", "huge", "short", "float64", "2d"):
        assert any("banned" in s["message"] for s in statuses[attack]), (attack, statuses[attack])


def test_an_owner_answering_nan_is_dropped_and_the_others_average_among_themselves(runs):
    folder, results = job_results(runs, "liar")
    assert_holds(folder, [0, 1, 2], weighted_mean([0, 1, 2], weighted=False), results=results)
    assert results[3]["infos"] == [None]  # its own part failed its own check: it keeps its values (not NaN)
    assert_holds(folder, [3], make_tensors(3), atol=0, results=results)
    for index in range(3):
        assert len(results[index]["infos"][0]["contributors"]) == 3


def test_a_peer_killed_mid_allreduce_is_dropped_and_the_survivors_average_among_themselves(bootstrap, tmp_path):
    kill = {"prefix": "kill", "weighted": True, "settings": {"allreduce_timeout": 20.0, "target_group_size": 4}}
    with processes() as procs:
        survivors = start_peers(bootstrap, tmp_path, [{**kill, "indices": [0, 1, 2]}], debug=True)
        victim = start_peers(bootstrap, tmp_path, [{**kill, "indices": [3], "peers": {"3": {"behaviour": "stall"}}}])
        procs += [survivors, victim]
        victim_id = victim.wait_for(f"{STALLED}: peer (\\d+)", timeout=120).group(1)
        # its streams reached each of the 3 other owners: their breaking is what drops it here (streams that never
        # reached an owner: the next test)
        for _ in range(3):
            survivors.wait_for(f"group kill\\.0\\S*: peer {victim_id} began sending its part", timeout=60)
        killed_at = time.monotonic()
        victim.kill()  # SIGKILL
        results = results_of(survivors)
        returned_after = time.monotonic() - killed_at
    assert returned_after < 20, f"survivors took {returned_after:.1f}s after the kill, more than allreduce_timeout"
    assert_holds(tmp_path / "kill", [0, 1, 2], weighted_mean([0, 1, 2]))  # the survivors' mean, without the victim
    for result in results.values():
        assert result["error"] is None, result["error"]
        (info,) = result["infos"]
        assert len(info["members"]) == 4 and len(info["contributors"]) == 3 and info["attempts"] == 2
        # its stream here broke, or the call to its own part failed (if not answered yet): UNAVAILABLE, or under
        # load sometimes INTERNAL ("Internal error from Core"); not a timeout
        (reason,) = info["dropped"].values()
        assert reason.startswith("its stream broke") or reason.split(":")[0] in grpc.StatusCode.__members__, info


#: a member that sends the first piece of its part, then waits to be killed (or, told "end", ends its stream)
CUT_SENDER = """
import sys, time, grpc, torch
from dmoe.averaging.allreduce import sign_part
from dmoe.dht import Identity
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc
from dmoe.wire.codec import serialize
def parts():
    signature = sign_part(Identity.from_seed(bytes.fromhex(sys.argv[4])), sys.argv[2], 1, 2, 1.0)
    yield dmoe_pb2.AveragingPart(group_id=sys.argv[2], sender=2, weight=1.0, values=serialize(torch.ones(10)),
                                 signature=signature)
    print("sent", flush=True)
    if sys.argv[3] != "end":
        time.sleep(600)
for _ in dmoe_pb2_grpc.AveragingServiceStub(grpc.insecure_channel(sys.argv[1])).reduce(parts()):
    pass
"""


def test_a_member_killed_mid_stream_is_dropped_for_its_broken_stream_not_banned_for_a_short_part():
    # gRPC ends the stream of a killed sender as if it had finished, and reports the cancellation a moment later:
    # read at once, the part would look short, the member would be banned for a wrong part size (as the one member
    # here that ends its stream short is)
    async def run() -> list[str]:
        servicer = AveragingServicer("cut", join_timeout=10)
        servicer.begin_round(0)
        server = grpc.aio.server()
        dmoe_pb2_grpc.add_AveragingServiceServicer_to_server(servicer, server)
        endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        groups = [f"cut.0.*.1.{index:08x}" for index in range(5)]
        sender = Identity()
        reducers = [PartReducer(group, [1, 2], 1000, timeout=60, owner=1, keys={2: sender.public_key})
                    for group in groups]
        for group, reducer in zip(groups, reducers):
            servicer.register(group, reducer)
        try:
            with processes() as procs:
                procs += [Proc(["-c", CUT_SENDER, endpoint, group, "end" if group == groups[-1] else "wait",
                                sender.seed.hex()])
                          for group in groups]
                for proc in procs:
                    await asyncio.to_thread(proc.wait_for, "^sent", 120)
                deadline = time.monotonic() + 30
                while not all(reducer.filled.get(2) == 10 for reducer in reducers):  # the first pieces arrived
                    assert time.monotonic() < deadline, [reducer.filled for reducer in reducers]
                    await asyncio.sleep(0.01)
                for proc in procs[:-1]:
                    proc.kill()
                deadline = time.monotonic() + 30
                while not all(2 in reducer.dropped for reducer in reducers):
                    assert time.monotonic() < deadline, [reducer.dropped for reducer in reducers]
                    await asyncio.sleep(0.01)
        finally:
            await server.stop(0)
        return [reducer.dropped[2] for reducer in reducers]

    *killed, ended = asyncio.run(run())
    assert all(reason.startswith("its stream broke") for reason in killed), killed
    assert ended.startswith("wrong part size: peer 2 sent 10 values, the part has 1000; banned"), ended


class HeldBackAverager(DecentralizedAverager):
    """Sends its parts only once ``released`` is set (or after 30 s): the outsider of the test below gets there
    first, as a faster one would."""

    released = threading.Event()

    async def _send_part(self, *args, **kwargs):
        await asyncio.to_thread(self.released.wait, 30)
        return await super()._send_part(*args, **kwargs)


def read_group(dht: DHT, key: str) -> tuple[str, list[Member]] | None:
    """A group led in round record ``key``, as anyone reading the DHT finds it: its id and members."""
    for pid, declaration in parse_declarations(dht.get(key), key).items():
        leading = matchmaking._LEADING.fullmatch(declaration.state)
        if leading:
            group_id = f"{key}.{pid}.{leading.group(2)}"
            entries = sorted(dht.get(group_id).items())
            return group_id, [matchmaking.parse_group_entry(subkey, entry.value)
                              for subkey, entry in entries if entry.owner == declaration.owner]
    return None


async def impersonate(group_id: str, members: Sequence[Member]) -> list[tuple[str, str]]:
    """Streams NaN under every member's id to every owner, twice at once (a duplicate): the statuses it got."""
    async def one(owner: Member, victim: Member) -> tuple[str, str]:
        async with grpc.aio.insecure_channel(owner.endpoint) as channel:
            part = dmoe_pb2.AveragingPart(group_id=group_id, sender=victim.peer_id, weight=1.0,
                                          signature=secrets.token_bytes(64), values=serialize(torch.full((1,), NAN)))
            try:
                async for _ in dmoe_pb2_grpc.AveragingServiceStub(channel).reduce(iter([part]), timeout=10):
                    pass
            except grpc.aio.AioRpcError as error:
                return error.code().name, error.details()
            return "OK", ""
    return await asyncio.gather(*(one(owner, victim) for owner in members for victim in members for _ in range(2)))


def test_an_outsider_streaming_under_the_members_ids_is_refused_and_the_members_average_together(bootstrap):
    """Anyone who reads the DHT knows a group's id and its members' ids: a NaN piece (or a duplicate stream) under a
    member's id got that member banned from the owner's part, the owners named disjoint contributors, and no round
    averaged (review 60). Streams are now signed by the DHT key the group lists for the member."""
    HeldBackAverager.released.clear()
    statuses: list[tuple[str, str]] = []
    with DHT(initial_peers=[bootstrap]) as attacker, contextlib.ExitStack() as stack:
        dhts = [stack.enter_context(DHT(initial_peers=[bootstrap], client_mode=True)) for _ in range(2)]
        averagers = [stack.enter_context(HeldBackAverager([torch.full((1000,), float(i + 1))], dht, "outsider",
                                                          target_group_size=2, matchmaking_time=20.0,
                                                          allreduce_timeout=10.0))
                     for i, dht in enumerate(dhts)]
        steps = [averager.step(weight=1.0, wait=False) for averager in averagers]
        try:
            deadline = time.monotonic() + 60
            while (found := read_group(attacker, "outsider.0.*")) is None or len(found[1]) < 2:
                assert time.monotonic() < deadline and not any(step.done() for step in steps), "no group formed"
                time.sleep(0.05)
            statuses += asyncio.run(impersonate(*found))
        finally:
            HeldBackAverager.released.set()
        infos = [step.result(timeout=60) for step in steps]
    assert len(statuses) == 8 and all(code == "PERMISSION_DENIED" and "not signed" in message
                                      for code, message in statuses), statuses
    assert all(info is not None and info.contributors == info.members and len(info.members) == 2 for info in infos), \
        infos
    assert all(torch.allclose(averager.tensors[0], torch.full((1000,), 1.5)) for averager in averagers)


def test_streams_that_wait_to_learn_their_group_leave_nothing_behind_however_they_end(monkeypatch):
    """A stream cancelled while it waited for its group left the group id in the servicer for good, and the id's
    length was bounded only by gRPC's 64 MiB (review 60: 40 cancelled streams held 160 MiB). Now an entry goes with
    the last stream that waits for it, an overlong id is refused at once, and so is a group beyond those waited
    for already (a member's stream is sent again: it gets NOT_FOUND)."""
    monkeypatch.setattr(service_module, "MAX_WAITED_GROUPS", 3)

    def first(group_id: str) -> list[dmoe_pb2.AveragingPart]:
        return [dmoe_pb2.AveragingPart(group_id=group_id, sender=1, weight=1.0)]

    async def wait_until(condition, what) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what()
            await asyncio.sleep(0.01)

    async def run() -> None:
        servicer = AveragingServicer("leak", join_timeout=60)
        servicer.begin_round(0)
        server = grpc.aio.server()
        dmoe_pb2_grpc.add_AveragingServiceServicer_to_server(servicer, server)
        endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            async with grpc.aio.insecure_channel(endpoint) as channel:
                stub = dmoe_pb2_grpc.AveragingServiceStub(channel)
                groups = [f"leak.0.*.1.{index:08x}" for index in range(3)]
                calls = [stub.reduce(iter(first(group))) for group in groups + groups[:1]]  # two wait for group 0
                await wait_until(lambda: sum(w.streams for w in servicer._learnt.values()) == 4,
                                 lambda: servicer._learnt)
                beyond = stub.reduce(iter(first("leak.0.*.1.ffffffff")))
                assert await asyncio.wait_for(beyond.code(), 5) == grpc.StatusCode.NOT_FOUND
                overlong = stub.reduce(iter(first("leak.0." + "a" * (1 << 20))))
                assert await asyncio.wait_for(overlong.code(), 5) == grpc.StatusCode.INVALID_ARGUMENT
                assert "malformed group id" in await overlong.details()
                calls[0].cancel()  # group 0 still has a stream waiting for it: kept
                await wait_until(lambda: servicer._learnt[groups[0]].streams == 1, lambda: servicer._learnt)
                assert set(servicer._learnt) == set(groups)
                for call in calls[1:]:
                    call.cancel()
                await wait_until(lambda: not servicer._learnt, lambda: servicer._learnt)
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_one_machine_cannot_take_every_place_of_the_streams_waiting_to_learn_their_group(monkeypatch):
    """Review 69: the waits are open before any signature is checked, and one machine naming made-up groups of the
    current round took all of them: an honest stream for a group this peer was about to learn was refused at once.
    Each calling machine gets MAX_WAITING_PER_MACHINE places."""
    monkeypatch.setattr(service_module, "MAX_WAITING_PER_MACHINE", 2)

    async def run() -> None:
        servicer = AveragingServicer("slots", join_timeout=60)
        waits = [asyncio.create_task(servicer._wait_to_learn(f"slots.0.*.1.{i:08x}", "10.0.0.1")) for i in range(2)]
        await asyncio.sleep(0)  # (they start waiting)
        assert len(servicer._learnt) == 2 and servicer._waiting["10.0.0.1"] == 2
        third = asyncio.create_task(servicer._wait_to_learn("slots.0.*.1.ffffffff", "10.0.0.1"))
        await asyncio.wait_for(third, 5)  # no place left for this machine: not waited for
        assert "slots.0.*.1.ffffffff" not in servicer._learnt
        honest = asyncio.create_task(servicer._wait_to_learn("slots.0.*.2.00000000", "10.0.0.2"))
        await asyncio.sleep(0)
        assert "slots.0.*.2.00000000" in servicer._learnt  # another machine waits
        servicer.register("slots.0.*.2.00000000", object())  # learnt: its stream goes on
        await asyncio.wait_for(honest, 5)
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        assert not servicer._learnt and not servicer._waiting

    asyncio.run(run())


def test_a_peer_killed_after_it_answered_but_before_its_values_arrived_is_dropped_without_waiting_out_the_timeout(
        bootstrap, tmp_path):
    """Its streams never began anywhere, so no broken stream tells an owner it died: each owner, having had its
    answer, checks that it still accepts connections."""
    timeout = 30.0
    mute = {"prefix": "mute", "weighted": True, "settings": {"allreduce_timeout": timeout, "target_group_size": 4}}
    with processes() as procs:
        survivors = start_peers(bootstrap, tmp_path, [{**mute, "indices": [0, 1, 2]}], debug=True)
        victim = start_peers(bootstrap, tmp_path, [{**mute, "indices": [3], "peers": {"3": {"behaviour": "mute"}}}])
        procs += [survivors, victim]
        victim_id = victim.wait_for(f"{MUTE}: peer (\\d+)", timeout=120).group(1)
        for _ in range(3):  # each survivor had the victim's answer, and waits for its values
            survivors.wait_for(f"group mute\\.0\\S*: peer {victim_id} answered, its values have not arrived",
                               timeout=60)
        killed_at = time.monotonic()
        victim.kill()
        results = results_of(survivors)
        returned_after = time.monotonic() - killed_at
    assert returned_after < timeout / 2, f"survivors took {returned_after:.1f}s after the kill"
    assert_holds(tmp_path / "mute", [0, 1, 2], weighted_mean([0, 1, 2]))
    for result in results.values():
        assert result["error"] is None, result["error"]
        (info,) = result["infos"]
        assert len(info["contributors"]) == 3 and info["attempts"] == 2, info
        assert info["dropped"][victim_id] == "it stopped accepting connections before its values arrived", info


def test_a_lone_peer_averages_with_nobody_and_leaves_its_tensors(bootstrap):
    tensors = make_tensors(0)
    with DHT(initial_peers=[bootstrap]) as dht, \
            DecentralizedAverager([t.clone() for t in tensors], dht, "lone", matchmaking_time=1.0) as averager:
        start = time.monotonic()
        future = averager.step(wait=False)
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(timeout=30) is None
        assert time.monotonic() - start < 10
        assert all(torch.equal(a, b) for a, b in zip(averager.tensors, tensors))
        assert averager.round == 1


def test_the_averaging_port_reads_no_message_larger_than_a_piece(bootstrap):
    """Anyone may stream to the port, and an unauthenticated stream keeps its first message while its group is
    looked up: at gRPC's 64 MiB, 8 streams of one machine held 0.9 GiB of a trainer (review 77). A message past
    the largest piece any peer sends is refused now, and so is a config sending larger pieces."""
    from dmoe.averaging.config import MAX_PIECE_BYTES, MESSAGE_OVERHEAD_BYTES
    from dmoe.wire import grpc_options

    with pytest.raises(ValueError, match="piece_bytes must be between 1024 and"):
        DecentralizedAverager([torch.zeros(4)], None, "big", piece_bytes=MAX_PIECE_BYTES + 1)
    with DHT(initial_peers=[bootstrap]) as dht, \
            DecentralizedAverager([torch.zeros(4)], dht, "big", matchmaking_time=1.0) as averager:
        async def send(elements: int) -> grpc.StatusCode:
            part = dmoe_pb2.AveragingPart(group_id="big.0.*.0.deadbeef", sender=1, weight=1.0,
                                          values=serialize(torch.zeros(elements)))
            async with grpc.aio.insecure_channel(averager.endpoint, options=grpc_options()) as channel:
                try:
                    async for _ in dmoe_pb2_grpc.AveragingServiceStub(channel).reduce(iter([part]), timeout=20):
                        pass
                except grpc.aio.AioRpcError as error:
                    return error.code()
            return grpc.StatusCode.OK

        assert asyncio.run(send((MAX_PIECE_BYTES + MESSAGE_OVERHEAD_BYTES) // 4 + 1)) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert asyncio.run(send(MAX_PIECE_BYTES // 4)) == grpc.StatusCode.NOT_FOUND  # read, and no such group


def test_shutdown_ends_a_step_in_flight_and_stops_every_thread(bootstrap):
    before = set(threading.enumerate())
    with DHT(initial_peers=[bootstrap]) as dht:
        averager = DecentralizedAverager(make_tensors(0), dht, "shutdown", matchmaking_time=60.0)
        future = averager.step(wait=False)
        deadline = time.monotonic() + 30
        while averager.peer_id not in dht.get("shutdown.0.*"):  # it declared itself and waits for others
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = time.monotonic()
        averager.shutdown()
        assert time.monotonic() - start < 5
        assert future.result(timeout=1) is None
        with pytest.raises(RuntimeError, match="shut down"):
            averager.step()
    left = [t for t in set(threading.enumerate()) - before if t.is_alive() and t.name.startswith("dmoe")]
    assert not left


def recording(store_many, calls: list[set[str]]):
    """``DHT.store_many``, also noting the keys of each call in ``calls``."""
    def store(records):
        calls.append(set(records))
        return store_many(records)
    return store


def test_a_leader_lets_declarations_settle_and_publishes_its_group_before_declaring_that_it_leads(bootstrap):
    """Two races on a loaded DHT that made two groups claim one peer. A leader that formed a full group with the first
    peers it saw could miss a smaller peer declared at about the same time, which took one of them too: no group
    is led before a second (the margin) after declaring. A peer that read a leader's declaration before its group
    (stored together) waited for it in vain and went on as if the leader took nobody: the group is stored first."""
    with DHT(initial_peers=[bootstrap]) as first, DHT(initial_peers=[bootstrap]) as second:
        stores: list[list[set[str]]] = []
        averagers = []
        for dht in (first, second):
            averager = DecentralizedAverager(make_tensors(len(averagers)), dht, "order", target_group_size=2,
                                             matchmaking_time=30.0)
            stores.append([])
            dht.store_many = recording(dht.store_many, stores[-1])
            averagers.append(averager)
        try:
            infos = [future.result(timeout=60) for future in [a.step(wait=False) for a in averagers]]
        finally:
            for averager in averagers:
                averager.shutdown()
    assert all(info is not None and len(info.contributors) == 2 for info in infos), infos
    assert all(info.matchmaking_s >= 1.0 for info in infos), infos  # the margin: max(1 s, 3 poll periods)
    group_id = infos[0].group_id
    leader = [info.peer_id for info in infos].index(int(group_id.split(".")[-2]))
    calls = stores[leader]  # its declarations (waiting, then leading) and the group
    published = calls.index({group_id})  # the group alone, then the declaration that it leads
    assert calls[published + 1:] == [{"order.0.*"}] and all(call == {"order.0.*"} for call in calls[:published])
    member = stores[1 - leader]
    assert member and all(call == {"order.0.*"} for call in member)  # declarations only


def averaging_together(stack: contextlib.ExitStack, bootstrap: str, prefix: str, tensors: Sequence[torch.Tensor],
                       settings: Sequence[dict[str, Any]]) -> list[DecentralizedAverager]:
    """An averager per tensor, each with its own DHT node and settings, shut down with ``stack``."""
    averagers = []
    for tensor, own in zip(tensors, settings):
        dht = stack.enter_context(DHT(initial_peers=[bootstrap]))
        averagers.append(stack.enter_context(DecentralizedAverager(
            [tensor], dht, prefix, target_group_size=len(tensors), matchmaking_time=30.0, **own)))
    return averagers


def step_together(averagers: Sequence[DecentralizedAverager]) -> list:
    futures = [averager.step(wait=False) for averager in averagers]
    return [future.result(timeout=90) for future in futures]


def test_peers_whose_bandwidths_have_many_significant_digits_average_whoever_leads(bootstrap):
    """A group record carries each bandwidth with 6 significant digits: a leader that cut the parts from its own
    unrounded bandwidth got other bounds than its members, and every round it led failed ("wrong part size"). And
    with the endpoint of a 15-character address the group entry went over the DHT's 96 bytes per value, and the
    leader's step raised (review 98: IPv6 swarms could not average)."""
    # with any of them unrounded, in any order of the peer ids, a bound of 10**6 + 1 values moves
    bandwidths = [97331933.29226607, 44914079.07427758, 91401355.51512511]
    with contextlib.ExitStack() as stack:  # (any 127/8 address is this machine's)
        averagers = averaging_together(stack, bootstrap, "digits", [torch.full((10**6 + 1,), float(i)) for i in
                                                                     range(3)],
                                       [{"bandwidth": b, "max_retries": 0, "host": f"127.100.200.21{i}"}
                                        for i, b in enumerate(bandwidths)])
        infos = step_together(averagers)
    assert all(info is not None and len(info.contributors) == 3 and not info.dropped for info in infos), infos
    for averager in averagers:
        assert torch.equal(averager.tensors[0], torch.ones(10**6 + 1))  # the mean of 0, 1 and 2


def test_float16_values_beyond_its_range_average_saturated_and_nobody_is_banned(bootstrap):
    """float16 turned honest values in (65504, max_abs_value] into inf on the wire, and owners banned their
    senders for "NaN or Inf"; they are now sent as the largest float16."""
    tensors = [torch.tensor([7e4, 1.0, 1.0, 7e4]), torch.tensor([7e4, 3.0, 3.0, 7e4])]
    with contextlib.ExitStack() as stack:
        averagers = averaging_together(stack, bootstrap, "saturate", tensors, [{"compression": "float16"}] * 2)
        infos = step_together(averagers)
    assert all(info is not None and len(info.contributors) == 2 and not info.dropped for info in infos), infos
    for averager in averagers:
        assert averager.tensors[0].tolist() == [65504.0, 2.0, 2.0, 65504.0]


def declared_id(dht: DHT, key: str, owner: bytes, timeout: float = 30) -> int:
    """The id under which the DHT key ``owner`` declared itself in ``key`` (drawn afresh each round), once it did."""
    deadline = time.monotonic() + timeout
    while True:
        ids = [pid for pid, declaration in parse_declarations(dht.get(key), key).items() if declaration.owner == owner]
        if ids:
            return ids[0]
        assert time.monotonic() < deadline, f"{owner.hex()[:16]} never declared itself in {key}"
        time.sleep(0.05)


def lead_a_broken_group(dht: DHT, key: str, victim: bytes, victim_entry: str, leader_entry: str) -> int:
    """Publishes a group of ``dht``'s key and the peer of DHT key ``victim`` (listed as ``victim_entry``), once the
    victim declared itself: anyone can lead a group in a key, and list whom it likes. Returns the leader's id."""
    victim_id = declared_id(dht, key, victim)
    nonce, expiration, salt = "0123abcd", time.time() + 30, new_salt()
    leader = peer_id_for(dht.identity.public_key, key, salt)
    dht.store_many({f"{key}.{leader}.{nonce}": {victim_id: (f"{victim_entry};{key_text(victim)}", expiration),
                                                 leader: (f"{leader_entry};{key_text(dht.identity.public_key)}",
                                                          expiration)}})
    dht.store(key, leader, f"{leader_entry};{salt};L2.{nonce}", expiration)
    return leader


def test_a_group_that_cannot_average_is_ignored_and_fails_no_step(bootstrap, caplog):
    """Every bandwidth 0 made the victim's step raise ValueError (nobody can own a part); a part given to a victim
    in client mode, RuntimeError. Both victims ignore such groups, and, alone, average with nobody."""
    caplog.set_level(logging.WARNING, logger="dmoe.averaging.matchmaking")
    # the two groups are led at once, each as soon as its victim declared itself: one after the other, a loaded
    # machine once published the second after the client's matchmaking time had ended (it never saw the group)
    with DHT(initial_peers=[bootstrap]) as hostile, DHT(initial_peers=[bootstrap]) as dht, \
            DecentralizedAverager([torch.zeros(3)], dht, "broken0", matchmaking_time=10.0) as served, \
            DecentralizedAverager([torch.zeros(3)], dht, "broken1", matchmaking_time=10.0, client_mode=True) as client, \
            concurrent.futures.ThreadPoolExecutor(2) as leaders:
        futures = [served.step(wait=False), client.step(wait=False)]
        owner = dht.identity.public_key
        led = [leaders.submit(lead_a_broken_group, hostile, "broken0.0.*", owner, f"{served.endpoint};0",
                              "127.0.0.1:9;0"),
               leaders.submit(lead_a_broken_group, hostile, "broken1.0.*", owner, "127.0.0.1:8;1", "127.0.0.1:9;1")]
        first, second = (future.result(timeout=60) for future in led)
        assert [future.result(timeout=60) for future in futures] == [None, None]
        assert torch.equal(served.tensors[0], torch.zeros(3)) and torch.equal(client.tensors[0], torch.zeros(3))
    assert f"of peer {first}: no member accepts connections with a positive bandwidth" in caplog.text
    assert f"of peer {second}: it lists this peer at 127.0.0.1:8" in caplog.text


def test_a_peer_whose_ids_were_read_and_taken_in_the_rounds_to_come_still_averages(bootstrap, caplog, monkeypatch):
    """A peer kept one id in every round, and round keys are predictable: a client that read a round's record could
    store under each peer's id in the next round's key first; the DHT gave it those subkeys, every declaration of
    theirs was refused (and the refusal ignored), and they never averaged again. Ids are now drawn afresh each
    round (a hash of the peer's DHT key, the round's key and a random salt); one refused all the same (here: the
    salt made predictable) is logged and replaced by another."""
    caplog.set_level(logging.WARNING, logger="dmoe.averaging.matchmaking")
    with contextlib.ExitStack() as stack:
        hostile = stack.enter_context(DHT(initial_peers=[bootstrap]))
        averagers = averaging_together(stack, bootstrap, "squat", [torch.full((3,), float(i)) for i in range(3)],
                                       [{}] * 3)
        assert all(info is not None for info in step_together(averagers))
        ids = [pid for pid in hostile.get("squat.0.*") if isinstance(pid, int)]
        assert sorted(ids) == sorted(averager.peer_id for averager in averagers)
        for pid in ids:  # what it read, stored ahead in the next round's key
            assert hostile.store("squat.1.*", pid, "-;0;x", time.time() + 600)
        infos = step_together(averagers)
        assert all(info is not None and len(info.contributors) == 3 for info in infos), infos
        assert not set(ids) & {info.peer_id for info in infos}
        # the first salt drawn for round 2 is known ahead: whoever draws it finds its id taken
        owners = [averager.dht.identity.public_key for averager in averagers]
        taken = {peer_id_for(owner, "squat.2.*", "00000000") for owner in owners}
        for pid in taken:
            assert hostile.store("squat.2.*", pid, "-;0;x", time.time() + 600)
        # held by every peer's node first (each is a replica: there are fewer nodes than num_replicas), so that each
        # peer's store is refused (a store that any replica accepts counts as accepted: see the next test)
        squat(hostile, "squat.2.*", taken, averagers)
        salts = iter(["00000000"])
        monkeypatch.setattr(matchmaking, "new_salt", lambda: next(salts, None) or secrets.token_hex(4))
        infos = step_together(averagers)
        assert all(info is not None and len(info.contributors) == 3 for info in infos), infos
    (refused,) = [record.getMessage() for record in caplog.records if "could not declare" in record.getMessage()]
    assert "in squat.2.* (w): refused: subkey" in refused and int(refused.split()[4]) in taken


def squat(hostile: DHT, key: str, ids: Collection[int], averagers: Sequence[DecentralizedAverager]) -> None:
    """Stores an entry of ``hostile``'s key under each of ``ids`` in record ``key`` straight on each averager's DHT
    node (a store RPC, as any node may send to any other) and only there, until each holds them."""
    key_id = digest(key)
    expiration = round(time.time() + 600, 3)
    entries = {pid: hostile.node.identity.entry(key_id, pid, "-;0;x", expiration) for pid in ids}

    async def held(node) -> set:
        return set(node.storage.get(key_id) or {})

    for averager in averagers:
        host, port = averager.dht.endpoint.rsplit(":", 1)
        contact = Node(averager.dht.node.node.id, host, int(port))
        deadline, replies = time.monotonic() + 30, None
        while not set(ids) <= averager.dht.run_coroutine(held(averager.dht.node)):
            assert time.monotonic() < deadline, f"{contact} never held the squatter's entries: {replies}"
            replies = hostile.run_coroutine(hostile.node.protocol.call_store(contact, key_id, entries))


def test_a_peer_whose_id_most_nodes_give_to_another_key_declares_under_a_new_one(bootstrap, caplog, monkeypatch):
    """A store counts as accepted when any replica takes it. A peer whose predicted id most replicas held for
    another key (stored ahead there) had its declaration taken by the others, went on, and was read by everyone
    (itself too) as that other key's entry, which readers skip: nobody saw it, and it waited out the round alone
    (on the old code, no peer averaged). It now reads its id back and declares under a new one."""
    caplog.set_level(logging.WARNING, logger="dmoe.averaging.matchmaking")
    with contextlib.ExitStack() as stack:
        hostile = stack.enter_context(DHT(initial_peers=[bootstrap]))
        averagers = averaging_together(stack, bootstrap, "most", [torch.full((3,), float(i)) for i in range(3)],
                                       [{}] * 3)
        salts = iter(["00000000"] * 3)  # each peer's first id in the round is known ahead
        monkeypatch.setattr(matchmaking, "new_salt", lambda: next(salts, None) or secrets.token_hex(4))
        taken = {peer_id_for(averager.dht.identity.public_key, "most.0.*", "00000000") for averager in averagers}
        squat(hostile, "most.0.*", taken, averagers)  # not on the bootstrap node nor the squatter's own
        infos = step_together(averagers)
        assert all(info is not None and len(info.contributors) == 3 for info in infos), infos
        assert not taken & {info.peer_id for info in infos}
        assert all(torch.allclose(averager.tensors[0], torch.full((3,), 1.0)) for averager in averagers)
    # each taken id was replaced: read back under the squatter's key (its store taken by the nodes the squatter
    # left out), or refused by every node that answered (on a loaded machine, those left out may not answer in time;
    # the read back alone is tested in test_averaging_parts)
    messages = [record.getMessage() for record in caplog.records]
    read_back = [int(m.split()[1]) for m in messages if "give its id to another key" in m]
    refused = [int(m.split()[4]) for m in messages if "could not declare" in m and "refused: subkey" in m]
    assert sorted(read_back + refused) == sorted(taken), messages


def store_a_group_ahead(dht: DHT, key: str, size: int = 2) -> None:
    """Stores in ``key``, as anyone can ahead of a round (its key is predictable), a group of ids of ``dht``'s own
    key: their declarations, one of them leading, and the group record, all valid and living for 10 minutes."""
    nonce, expiration = "deadbeef", time.time() + 600
    salts = [new_salt() for _ in range(size)]
    ids = [peer_id_for(dht.identity.public_key, key, salt) for salt in salts]
    member = f"127.0.0.1:9;1;{key_text(dht.identity.public_key)}"  # a group entry names the member's DHT key
    assert all(dht.store_many({f"{key}.{ids[0]}.{nonce}": {pid: (member, expiration) for pid in ids}})[
        f"{key}.{ids[0]}.{nonce}"].values())
    states = [f"L{size}.{nonce}"] + ["w"] * (size - 1)
    assert all(dht.store_many({key: {pid: (f"127.0.0.1:9;1;{salt};{state}", expiration)
                                     for pid, salt, state in zip(ids, salts, states)}})[key].values())


def test_a_group_stored_ahead_of_a_single_group_round_makes_no_peer_give_up(bootstrap):
    """In a round of one group of everyone (a collaboration's step), a peer that sees a group formed without it and
    nobody else waiting gives up at once: it came too late. A group stored ahead of time by anyone made every peer
    give up, in every round it was stored for: the first to look saw nobody waiting yet, marked itself gone, and the
    next one saw nobody either. Now only a group led by a peer this one expects counts (``expected_peers``), or
    without them, one holding a peer this one saw waiting in the round."""
    with contextlib.ExitStack() as stack:
        hostile = stack.enter_context(DHT(initial_peers=[bootstrap]))
        averagers = averaging_together(stack, bootstrap, "ahead", [torch.full((3,), float(i)) for i in range(3)],
                                       [{}] * 3)
        for round_number in range(2):
            store_a_group_ahead(hostile, f"ahead.{round_number}.*")
        owners = [averager.dht.identity.public_key for averager in averagers]
        for expecting in (True, False):
            futures = []
            for averager, owner in zip(averagers, owners):  # the trainers of a step come a moment apart
                expected = set(owners) - {owner} if expecting else None
                futures.append(averager.step(weight=1.0, group_size=3, single_group=True, expected_peers=expected,
                                             wait=False))
                time.sleep(0.5)
            infos = [future.result(timeout=60) for future in futures]
            assert all(info is not None and len(info.contributors) == 3 for info in infos), (expecting, infos)
        assert all(torch.equal(averager.tensors[0], torch.ones(3)) for averager in averagers)


def lying_about_the_total_weight(register):
    """``AveragingServicer.register``, whose parts answer every member a total weight of -4."""
    def register_lying(group_id: str, reducer: PartReducer) -> None:
        finalize = reducer._finalize

        def finalize_lying() -> None:
            finalize()
            reducer.result.messages[0].total_weight = -4.0
        reducer._finalize = finalize_lying
        register(group_id, reducer)
    return register_lying


def test_an_owner_answering_an_absurd_total_weight_fails_the_round_and_leaves_the_members_weight(bootstrap):
    """A member took any finite total: with -4, its weight became -2, which every owner refused at every later
    step; its averaging was off for good."""
    with contextlib.ExitStack() as stack:
        member, owner = averaging_together(stack, bootstrap, "total", [torch.zeros(3), torch.ones(3)],
                                           [{"client_mode": True}, {}])  # the owner's part is the only one
        owner.servicer.register = lying_about_the_total_weight(owner.servicer.register)
        lied_to, _ = step_together([member, owner])
        assert lied_to is None and member.weight == 1.0 and torch.equal(member.tensors[0], torch.zeros(3))
        del owner.servicer.register  # honest again
        infos = step_together([member, owner])
    assert all(info is not None and len(info.contributors) == 2 for info in infos), infos
    assert member.weight == 1.0 and torch.equal(member.tensors[0], owner.tensors[0])


def test_peers_bound_to_every_interface_are_reached_at_the_host_they_announce(bootstrap):
    """Behind NAT (a cloud VM) a peer binds its private address or 0.0.0.0 and must be told at its public one:
    127.0.0.2 stands for it here (any 127/8 address reaches a socket bound to 0.0.0.0)."""
    tensors = [torch.zeros(1000), torch.full((1000,), 2.0)]
    with contextlib.ExitStack() as stack:
        averagers = averaging_together(stack, bootstrap, "announced", tensors,
                                       [{"host": "0.0.0.0", "announce_host": "127.0.0.2"}] * 2)
        assert all(averager.endpoint.startswith("127.0.0.2:") for averager in averagers)
        infos = step_together(averagers)
    assert all(info is not None and len(info.contributors) == 2 for info in infos), infos
    assert all(torch.equal(averager.tensors[0], torch.ones(1000)) for averager in averagers)


def test_a_shutdown_as_matchmaking_ends_starts_no_all_reduce(bootstrap, monkeypatch):
    """Shutdown came after matchmaking found a group but before the all-reduce was in flight: it saw nothing to
    cancel, waited for the step, and the step averaged and wrote the tensors anyway, up to a whole step_timeout."""
    started: list[object] = []

    async def recorded(*args, **kwargs):
        started.append(args)

    monkeypatch.setattr(averager_module, "allreduce", recorded)
    tensors = make_tensors(0)
    before = [t.clone() for t in tensors]
    with DHT(initial_peers=[bootstrap]) as dht:
        averager = DecentralizedAverager(tensors, dht, "late-shutdown")
        me = averager.matchmaker.me
        stopper = threading.Thread(target=averager.shutdown)

        def found_as_shutdown_begins(*args, **kwargs):
            stopper.start()
            assert averager._stop.wait(10)
            return Group("late-shutdown.0.g", 0, me.peer_id, (me, Member(me.peer_id + 1, "127.0.0.1:9", 1.0)))

        monkeypatch.setattr(averager.matchmaker, "find_group", found_as_shutdown_begins)
        assert averager.step(timeout=30) is None
        stopper.join(10)
    assert not started and all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_peers_whose_step_counts_differ_meet_in_the_round_they_pass(bootstrap):
    """The round is in the DHT key, and by default it is how many steps the averager took: a peer that stepped alone
    once (or started late, or restarted) was a round apart from the others for good (review 98 D2). A step may name
    its round, and the next one defaults to the round after it."""
    with contextlib.ExitStack() as stack:
        early, late = averagers = averaging_together(stack, bootstrap, "rounds", [torch.zeros(3), torch.ones(3)],
                                                     [{}] * 2)
        assert early.step(timeout=2.0) is None and early.round == 1  # nobody else up yet: round 0 alone
        with pytest.raises(ValueError, match="round must be an int"):
            late.step(round=-1)
        named = [future.result(timeout=90) for future in [a.step(round=7, wait=False) for a in averagers]]
        assert all(info is not None and info.round == 7 and len(info.contributors) == 2 for info in named), named
        assert early.round == late.round == 8
        assert all(info is not None and info.round == 8 for info in step_together(averagers))
    assert all(torch.equal(averager.tensors[0], torch.full((3,), 0.5)) for averager in averagers)


def test_channels_to_peers_of_long_ago_are_closed(bootstrap, monkeypatch):
    """A long run with churn meets ever new peers: the averager keeps channels to the MAX_CHANNELS it used last. It
    closed the oldest created, even a peer's it used in every round (review 98 D5)."""
    monkeypatch.setattr(averager_module, "MAX_CHANNELS", 3)
    with DHT(initial_peers=[bootstrap]) as dht, DecentralizedAverager(make_tensors(0), dht, "channels") as averager:
        async def connect() -> list:
            made = [averager._channel(f"127.0.0.1:{port}") for port in range(9001, 9004)]
            averager._stub("127.0.0.1:9001")  # met again
            made += [averager._channel(f"127.0.0.1:{port}") for port in range(9004, 9006)]
            await asyncio.sleep(0.1)  # the evicted channels' close runs
            return made

        made = averager._run(connect(), timeout=10)
        assert list(averager._channels) == ["127.0.0.1:9001", "127.0.0.1:9004", "127.0.0.1:9005"]
        assert averager._channel("127.0.0.1:9005") is made[-1] and averager._channel("127.0.0.1:9001") is made[0]
        for closed in made[1:3]:
            with pytest.raises(grpc.aio.UsageError):
                averager._run(closed.channel_ready(), timeout=10)


def test_a_group_larger_than_the_channel_cache_averages_with_every_member(bootstrap, monkeypatch):
    """The all-reduce fetches every owner's stub before its calls start: in a group of more than MAX_CHANNELS + 1
    members, the fetch of one owner closed the channel of another fetched just before ("Channel is closed"), which
    was dropped, in every round (review 98 D5). The round's channels now stay open until it ends. (2 stands for 64.)"""
    monkeypatch.setattr(averager_module, "MAX_CHANNELS", 2)
    with contextlib.ExitStack() as stack:
        averagers = averaging_together(stack, bootstrap, "held", [torch.full((1000,), float(i)) for i in range(4)],
                                       [{"allreduce_timeout": 5.0}] * 4)
        infos = step_together(averagers)
        assert all(info is not None and len(info.contributors) == 4 and not info.dropped for info in infos), infos
        assert all(len(averager._channels) == 2 for averager in averagers)  # the others closed once the round ended
        assert all(torch.equal(averager.tensors[0], torch.full((1000,), 1.5)) for averager in averagers)
