"""Where a new server places its experts: grid cells nobody serves yet."""
from __future__ import annotations

import math
import random
from typing import Callable, Collection, Sequence, Union

from dmoe.dht import DHT
from dmoe.directory.lookups import ContinuationSource, alive_experts
from dmoe.uid import grid_uids


def choose_experts(layers: Sequence[str], grid: Sequence[int], count: int, taken: Collection[str] = (),
                   rng: random.Random | None = None, avoid: Collection[str] = ()) -> list[str]:
    """Up to ``count`` uids per layer of ``grid`` among the cells nobody serves (not in ``taken``), in random order
    (which keeps servers that join at the same moment apart); fewer where fewer are free. Cells in ``avoid`` are
    chosen only where the other free cells run out.

    A served cell is never chosen: its uid is owned (a signed DHT subkey), so a second server could not declare it,
    and would serve it to nobody (the served cells were once drawn from when free ones ran out, review 56).
    """
    if count > math.prod(grid):
        raise ValueError(f"{count} experts do not fit a grid of {' x '.join(map(str, grid))} = {math.prod(grid)} cells")
    rng = rng or random.Random()
    taken = set(taken)
    chosen = []
    for layer in layers:
        cells = grid_uids(layer, grid)
        free = [uid for uid in cells if uid not in taken]
        rng.shuffle(free)
        free.sort(key=lambda uid: uid in avoid)  # (stable: random among each kind)
        chosen.extend(free[:count])
    return chosen


def free_experts(dht: Union[DHT, ContinuationSource], layers: Sequence[str], grid: Sequence[int], count: int,
                 rng: random.Random | None = None, avoid: Callable[[list[str]], Collection[str]] | None = None,
                 tries: int = 3) -> list[str]:
    """:func:`choose_experts` with the taken cells read from the directory now. ``avoid``: of the cells chosen,
    those to trade for others where other free cells remain (asked again of each new choice, ``tries`` times at
    most)."""
    taken = set()
    for layer in layers:
        taken.update(alive_experts(dht, layer, grid))
    avoided: set[str] = set()
    chosen = choose_experts(layers, grid, count, taken, rng, avoided)
    for _ in range(tries if avoid is not None else 0):
        found = set(avoid([uid for uid in chosen if uid not in avoided])) - avoided
        if not found:
            break
        avoided |= found
        chosen = choose_experts(layers, grid, count, taken, rng, avoided)
    return chosen
