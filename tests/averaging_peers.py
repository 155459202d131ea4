"""Averaging peers for tests: many in one process (threads), each with its own DHT node and gRPC server.

    python -m tests.averaging_peers --initial-peers HOST:PORT --out DIR --jobs JSON [--debug]

``--jobs`` is a list of runs, all started at once, each ``{"prefix": "one4", "indices": [0, 1, 2, 3], "rounds": 1,
"grid": [], "weighted": true, "settings": {AveragerConfig fields}, "peers": {"3": {"behaviour": "stall",
"settings": {...}}}, "dht_client_mode": false}`` (everything but prefix and indices optional;
``target_group_size`` defaults to the grid's side, or to the number of peers of the job in this process). Peer
``i`` averages :func:`make_tensors` ``(i)`` with weight :func:`weight_of` ``(i)`` in its first round (then the
weight its group carried), placed at cell ``i`` of the grid (row-major; grid jobs number their peers from 0), or
at ``"cell"`` when the job names one for all. After each round it saves its tensors to
``DIR/<prefix>/peer<i>.r<round>.pt``; at the end it prints ``result {json}`` (prefix, index, one GroupInfo or null
per round, seconds per step, and the gRPC statuses a misbehaving peer got). Behaviours:

* ``stall``: sends the first piece of each part, prints ``stalled mid all-reduce: peer ID`` (once per part), then
  nothing.
* ``mute``: owns and answers its part, sends nobody its values; prints ``sends nobody its values: peer ID`` (once
  per part).
* ``hostile``: client mode; in round r it attacks owner k with ``ATTACKS[r][k % len(ATTACKS[r])]``.
* ``bad-owner``: answers every member's stream with NaN values (its service lies).
* ``late``: reads its group ``LATE`` seconds after it formed (a slow DHT), past its ``join_timeout`` (default 3 s):
  the others' first streams to it find a peer that does not know the group yet.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from dmoe import DHT, AveragerConfig, DecentralizedAverager
from dmoe.averaging.allreduce import Outcome, PartReducer
from dmoe.wire import dmoe_pb2
from dmoe.wire.codec import serialize

SHAPES = [(1024, 700), (3, 333, 257), (64, 64, 64), (777,)]  # 4.95 MB of float32, mixed shapes
STALLED = "stalled mid all-reduce"
MUTE = "sends nobody its values"

#: what a hostile member sends each owner, by round: every one of them must be refused with a clear status
ATTACKS = [
    ["nan", "huge", "short"],
    ["float64", "2d", "duplicate"],
    ["honest", "nan", "nan"],  # some owners accept it, others refuse it: the members must agree without it
]


def make_tensors(index: int, shapes=SHAPES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    return [torch.randn(shape, generator=generator) * (1 + index % 3) for shape in shapes]


def weight_of(index: int, weighted: bool = True) -> float:
    return float(1 + index % 4) if weighted else 1.0


def grid_cell(index: int, grid: tuple[int, ...]) -> tuple[int, ...] | None:
    return list(itertools.product(*(range(side) for side in grid)))[index] if grid else None


class StallingAverager(DecentralizedAverager):
    """Sends one piece of each part, then hangs: a peer that stalls (or is killed) in the middle of an all-reduce."""

    async def _send_part(self, stub, group_id, me, weight, values, out, **kwargs) -> Outcome:
        async def requests():
            piece = serialize(values[:kwargs["piece_elements"]], kwargs["compression"])
            yield dmoe_pb2.AveragingPart(group_id=group_id, sender=me, weight=weight, values=piece,
                                         signature=kwargs["signature"])
            print(f"{STALLED}: peer {self.peer_id}", flush=True)
            await asyncio.Event().wait()

        try:
            async for _ in stub.reduce(requests(), timeout=kwargs["timeout"]):
                pass
        except grpc.aio.AioRpcError as error:
            return Outcome(error=error.code().name)
        return Outcome(error="stalled")


class MuteAverager(DecentralizedAverager):
    """Owns and answers its part but sends nobody its values: a peer whose streams were lost, then (in the test)
    killed."""

    async def _send_part(self, stub, group_id, me, weight, values, out, **kwargs) -> Outcome:
        print(f"{MUTE}: peer {self.peer_id}", flush=True)
        await asyncio.Event().wait()
        return Outcome(error="mute")


class HostileAverager(DecentralizedAverager):
    """A member in client mode that sends every owner malformed values, and records the statuses it gets."""

    async def _send_part(self, stub, group_id, me, weight, values, out, **kwargs) -> Outcome:
        round_number = int(group_id[len(self.prefix) + 1:].split(".")[0])
        owner = [made for _, made in self._channels.values()].index(stub)  # made in the order of the owners
        attacks = ATTACKS[round_number % len(ATTACKS)]
        attack = attacks[owner % len(attacks)]
        if attack == "honest":
            return await super()._send_part(stub, group_id, me, weight, values, out, **kwargs)
        if round_number == 0 and owner == 0:  # streams for groups nobody is in, and as a peer nobody knows
            self.record("unknown round", await self.call(stub, [self.part(group_id.replace(".0.", ".7.", 1), me,
                                                                          values)]))
            self.record("unknown group", await self.call(stub, [self.part(group_id + "x", me, values)]))
            self.record("not a member", await self.call(stub, [self.part(group_id, 12345, values)]))
        pieces = {
            "nan": [values[:10], torch.full((values.numel() - 10,), float("nan"))],
            "huge": [values[:-1], torch.tensor([1e30])],
            "short": [values[:-1]],
            "float64": [values.double()],
            "2d": [values.view(1, -1)],
            "duplicate": [values],
        }[attack]
        messages = [self.part(group_id, me, pieces[0], weight, kwargs["signature"])] + [
            dmoe_pb2.AveragingPart(values=serialize(piece)) for piece in pieces[1:]]
        if attack == "duplicate":  # two streams at once: whichever comes second is the duplicate
            for status in await asyncio.gather(self.call(stub, messages), self.call(stub, messages)):
                self.record(attack, status)
        else:
            self.record(attack, await self.call(stub, messages))
        return Outcome(error=attack)

    @staticmethod
    def part(group_id: str, sender: int, values: torch.Tensor, weight: float = 1.0,
             signature: bytes = b"") -> dmoe_pb2.AveragingPart:
        return dmoe_pb2.AveragingPart(group_id=group_id, sender=sender, weight=weight, values=serialize(values),
                                      signature=signature)

    @staticmethod
    async def call(stub, messages) -> tuple[str, str]:
        async def requests():
            for message in messages:
                yield message
        try:
            async for _ in stub.reduce(requests(), timeout=20):
                pass
        except grpc.aio.AioRpcError as error:
            return error.code().name, error.details()
        return "OK", ""

    def record(self, attack: str, status: tuple[str, str]) -> None:
        self.statuses.append({"attack": attack, "code": status[0], "message": status[1]})


class LyingOwner(PartReducer):
    """Answers NaN for its part: what a broken or hostile owner sends back."""

    def _finalize(self) -> None:
        super()._finalize()
        if self.result is not None and self.result.values is not None:
            self.result.values.fill_(float("nan"))
            self.result.messages = [dmoe_pb2.AveragedPart(contributors=self.result.contributors,
                                                          total_weight=self.result.total_weight,
                                                          values=serialize(self.result.values))]


def lying(register):
    def register_lying(group_id: str, reducer: PartReducer) -> None:
        reducer.__class__ = LyingOwner
        register(group_id, reducer)
    return register_lying


#: seconds a ``late`` peer takes to learn its group after matchmaking found it
LATE = 5.0


class LateAverager(DecentralizedAverager):
    """Learns its group ``LATE`` seconds after the others: its matchmaking returns the group that much later."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        find_group = self.matchmaker.find_group

        def late(*find_args: Any, **find_kwargs: Any):
            group = find_group(*find_args, **find_kwargs)
            time.sleep(LATE)
            return group

        self.matchmaker.find_group = late


BEHAVIOURS = {"honest": DecentralizedAverager, "stall": StallingAverager, "mute": MuteAverager,
              "hostile": HostileAverager, "bad-owner": DecentralizedAverager, "late": LateAverager}


@dataclasses.dataclass
class Peer:
    job: dict[str, Any]
    index: int
    averager: DecentralizedAverager
    result: dict[str, Any] | None = None

    def run(self, out: Path) -> None:
        job, infos, seconds, error = self.job, [], [], None
        folder = out / job["prefix"]
        try:
            for round_number in range(job.get("rounds", 1)):
                start = time.monotonic()
                weight = weight_of(self.index, job.get("weighted", False)) if round_number == 0 else None
                info = self.averager.step(weight=weight)
                seconds.append(time.monotonic() - start)
                infos.append(None if info is None else {**dataclasses.asdict(info),
                                                        "dropped": {str(k): v for k, v in info.dropped.items()}})
                torch.save(self.averager.tensors, folder / f"peer{self.index}.r{round_number}.pt")
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            error = repr(exc)
        self.result = {"prefix": job["prefix"], "index": self.index, "infos": infos, "seconds": seconds,
                       "statuses": self.averager.statuses, "error": error}


def start_peer(job: dict[str, Any], index: int, dht: DHT) -> Peer:
    grid = tuple(job.get("grid", ()))
    custom = job.get("peers", {}).get(str(index), {})
    behaviour = custom.get("behaviour", "honest")
    target = max(grid) if grid else len(job["indices"])
    settings = {"target_group_size": target, "grid": grid, **job.get("settings", {}), **custom.get("settings", {})}
    if behaviour == "hostile":
        settings["client_mode"] = True
    cell = job.get("cell") or grid_cell(index, grid)
    averager = BEHAVIOURS[behaviour](make_tensors(index), dht, job["prefix"], AveragerConfig(**settings),
                                     coordinates=cell)
    averager.statuses = []
    if behaviour == "bad-owner":
        averager.servicer.register = lying(averager.servicer.register)
    return Peer(job, index, averager)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", required=True, help="JSON list of runs (see the module docstring)")
    parser.add_argument("--debug", action="store_true",
                        help="the all-reduce's DEBUG lines: each sender an owner begins to hear from, each member "
                             "that answered and is watched until its values arrive")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("dmoe.averaging.matchmaking").setLevel(logging.INFO)  # who led which group, who gave up
    # which owners failed an attempt, and why
    logging.getLogger("dmoe.averaging.allreduce").setLevel(logging.DEBUG if args.debug else logging.INFO)
    jobs = json.loads(args.jobs)
    out = Path(args.out)
    places = [(job, index) for job in jobs for index in job["indices"]]
    for job in jobs:
        (out / job["prefix"]).mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(len(places)) as pool:  # each may wait out dead contacts
        dhts = list(pool.map(lambda place: DHT(initial_peers=[args.initial_peers],
                                               client_mode=place[0].get("dht_client_mode", False)), places))
    peers = [start_peer(job, index, dht) for (job, index), dht in zip(places, dhts)]
    threads = [threading.Thread(target=peer.run, args=(out,)) for peer in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for peer in peers:
        peer.averager.shutdown()
    for dht in dhts:
        dht.close()
    for peer in peers:
        print("result " + json.dumps(peer.result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
