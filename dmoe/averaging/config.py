"""Settings of a :class:`~dmoe.averaging.DecentralizedAverager`, in one dataclass so programs can expose them as
flags."""
from __future__ import annotations

import math
from dataclasses import dataclass

from dmoe.endpoints import check_host
from dmoe.wire.channels import STREAM_PART_BYTES
from dmoe.wire.codec import parse_compression

#: the most bytes of values one streamed message may carry, on every peer: the averaging port reads no larger message
#: (any client may stream to it, and an unauthenticated stream keeps its first message while its group is looked up:
#: at gRPC's usual 64 MiB, 8 streams of one machine held 0.9 GiB of a trainer's memory, review 77)
MAX_PIECE_BYTES = 4 * 1024 * 1024
#: what a message carries besides its values: ids, weights, a signature, the group id (at most 1 KiB); an owner's
#: first answer also lists each contributor's id, weight and signature, about 80 bytes each (20 KiB for a group of
#: 256, the most subkeys a DHT record holds)
MESSAGE_OVERHEAD_BYTES = 64 * 1024


@dataclass
class AveragerConfig:
    """Knobs of decentralized averaging; every field has a sensible default.

    target_group_size: most members of one group. With a Moshpit ``grid``, the grid's side (peers that share all
        coordinates but one are meant to average together).
    min_group_size: a peer that finds fewer members (itself included) when matchmaking ends averages with nobody.
    matchmaking_time: seconds a leader waits for its group to fill up before it averages with whoever came (less
        when a step's timeout is short: it then forms the group a quarter of that timeout, at least
        ``max(1, 3 * poll_period)`` seconds, before the step's deadline, so that the all-reduce has time).
    allreduce_timeout: seconds a part's owner waits for every member's values (and a member for every owner's
        answer) in one attempt; a member that has not delivered by then is dropped from the group, and one that
        has not read the average as long again after it was taken has its stream ended (review 109 D1).
    max_retries: attempts after the first, among the members every survivor agrees on, when an attempt ends with
        owners missing or reporting different contributors (a member died, stalled or was refused by some owners).
    join_timeout: seconds an owner waits for a group it has not learnt from the DHT yet (a member may learn it a
        little sooner) before it refuses the stream as an unknown group.
    grid: Moshpit grid ``(M1, ..., Md)``: each round, peers that share all coordinates but the round's dimension
        average together, then take their rank in the group as that coordinate, so ``M**d`` peers placed on a full
        grid hold the exact global average after ``d`` rounds. Empty: every peer of the prefix is in one key.
    bandwidth: this peer's declared bandwidth (any unit, the same for all peers): parts are sized in proportion.
    client_mode: accept no connections (a peer behind NAT): no gRPC server, a part of size 0; the peer still sends
        its values to every owner and receives their averages.
    compression: ``'none'``, ``'float16'`` or ``'uint8'``, applied to every piece sent, both ways. float16
        saturates finite values beyond its range to +-65504 (as inf they would be refused as garbage).
    max_send_rate: bytes per second this peer sends at most, over all its streams (0: no limit); leaves room on a
        shared uplink, and emulates a slow one in experiments.
    max_abs_value: owners refuse values of a larger magnitude (and members averages of one); 0: no limit.
    host, port: where the gRPC server listens (port 0 picks a free one).
    announce_host: the host the others are told, where it is not ``host`` (behind NAT: a cloud VM's public address,
        the server bound to its private one or 0.0.0.0). Default: ``host``, or for 0.0.0.0 this machine's address
        toward its DHT peers.
    poll_period: seconds between DHT reads while matchmaking.
    piece_bytes: bytes of values per streamed message (at most :data:`MAX_PIECE_BYTES`, 4 MiB).
    declaration_ttl: seconds (plus a margin of ``max(1, 3 * poll_period)``) a waiting peer's matchmaking
        declaration lives unless renewed; it renews it as it polls, so the others stop waiting for a peer that died
        while waiting at most that long after.
    """

    target_group_size: int = 4
    min_group_size: int = 2
    matchmaking_time: float = 5.0
    allreduce_timeout: float = 30.0
    max_retries: int = 1
    join_timeout: float = 3.0
    grid: tuple[int, ...] = ()
    bandwidth: float = 1.0
    client_mode: bool = False
    compression: str = "none"
    max_send_rate: float = 0.0
    max_abs_value: float = 1e6
    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    poll_period: float = 0.2
    piece_bytes: int = STREAM_PART_BYTES
    declaration_ttl: float = 2.0

    def __post_init__(self) -> None:
        self.grid = tuple(int(side) for side in self.grid)
        if not 2 <= self.min_group_size <= self.target_group_size:
            raise ValueError(f"need 2 <= min_group_size <= target_group_size, got {self.min_group_size} and "
                             f"{self.target_group_size}")
        if any(side < 1 for side in self.grid):
            raise ValueError(f"grid sides must be positive, got {self.grid}")
        for name in ("matchmaking_time", "allreduce_timeout", "join_timeout", "poll_period", "declaration_ttl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"bandwidth must be positive and finite, got {self.bandwidth}")
        if not (math.isfinite(self.max_send_rate) and self.max_send_rate >= 0):
            raise ValueError(f"max_send_rate must be >= 0 (0: no limit), got {self.max_send_rate}")
        if not self.max_abs_value >= 0:
            raise ValueError(f"max_abs_value must be >= 0 (0: no limit), got {self.max_abs_value}")
        if not 1024 <= self.piece_bytes <= MAX_PIECE_BYTES:
            raise ValueError(f"piece_bytes must be between 1024 and {MAX_PIECE_BYTES} (what every peer's averaging port "
                             f"reads), got {self.piece_bytes}")
        parse_compression(self.compression)  # raises ValueError naming the choices
        if self.announce_host:  # (review 99 D5: HOST:PORT was announced as [HOST:PORT]:PORT)
            try:
                check_host(self.announce_host)
            except ValueError as error:
                raise ValueError(f"announce_host: {error}") from None

    @property
    def step_timeout(self) -> float:
        """How long a step may take at most when its caller gives no timeout: matchmaking (with the wait for a
        smaller peer's declaration to expire), then every attempt with its join wait."""
        matchmaking = 2 * self.matchmaking_time + 2 * self.declaration_ttl + 2 * self.poll_period
        return matchmaking + (1 + self.max_retries) * (self.allreduce_timeout + self.join_timeout) + 5.0
