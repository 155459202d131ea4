"""What the DHT says about the swarm: which experts of a layer's grid are alive and where, and which grid cells
nobody serves yet (so a new server can fill them)."""
from __future__ import annotations

import math
import random
from typing import Collection, Protocol, Sequence

from dmoe.uid import grid_uids


class ContinuationSource(Protocol):
    """The part of :class:`dmoe.dht.DHT` this module needs."""

    def get_alive_continuations(self, prefixes: Sequence[str]) -> dict[str, dict[int, str]]: ...


def alive_experts(dht: ContinuationSource, layer: str, grid: Sequence[int]) -> dict[str, str]:
    """uid -> endpoint of every declared, unexpired expert of ``layer`` inside ``grid``.

    Walks the grid-prefix records one dimension at a time (as beam search does), so a sparse grid costs one
    look-up per alive prefix rather than one per cell. Coordinates outside ``grid`` are ignored.
    """
    prefixes = [layer]
    found: dict[str, str] = {}
    for axis, size in enumerate(grid):
        continuations = dht.get_alive_continuations(prefixes) if prefixes else {}
        last = axis == len(grid) - 1
        next_prefixes = []
        for prefix in prefixes:
            for coord, endpoint in sorted((continuations.get(prefix) or {}).items()):
                if not 0 <= coord < size:
                    continue
                if last:
                    found[f"{prefix}.{coord}"] = endpoint
                else:
                    next_prefixes.append(f"{prefix}.{coord}")
        prefixes = next_prefixes
    return found


def choose_experts(layers: Sequence[str], grid: Sequence[int], count: int, taken: Collection[str] = (),
                   rng: random.Random | None = None) -> list[str]:
    """``count`` uids per layer of ``grid``, cells nobody serves (not in ``taken``) first, in random order.

    When a layer has fewer free cells than ``count``, the rest are drawn from served cells (more replicas of
    those experts is better than idling). Random order keeps servers that join at the same moment apart.
    """
    if count > math.prod(grid):
        raise ValueError(f"{count} experts do not fit a grid of {' x '.join(map(str, grid))} = {math.prod(grid)} cells")
    rng = rng or random.Random()
    taken = set(taken)
    chosen = []
    for layer in layers:
        cells = grid_uids(layer, grid)
        free = [uid for uid in cells if uid not in taken]
        served = [uid for uid in cells if uid in taken]
        rng.shuffle(free)
        rng.shuffle(served)
        chosen.extend((free + served)[:count])
    return chosen


def free_experts(dht: ContinuationSource, layers: Sequence[str], grid: Sequence[int], count: int,
                 rng: random.Random | None = None) -> list[str]:
    """:func:`choose_experts` with the taken cells read from the DHT now."""
    taken = set()
    for layer in layers:
        taken.update(alive_experts(dht, layer, grid))
    return choose_experts(layers, grid, count, taken, rng)


__all__ = ["alive_experts", "choose_experts", "free_experts"]
