"""The Moshpit grid (Moshpit SGD, Algorithm 1): which peers average together in which round.

Each peer holds coordinates ``c`` in a virtual grid ``M1 x ... x Md``. In round ``r`` the free dimension is
``r mod d``: peers that share every other coordinate meet under one DHT key and average. Each then takes its rank in
its group as its coordinate along the free dimension, so the members of one group scatter to different groups in
the next round. On a full grid (one peer per cell) each round averages along one axis, and after ``d`` rounds every
peer holds the exact global average; with peers missing the spread still shrinks by about the group size per round.
"""
from __future__ import annotations

import random
from typing import Sequence


def free_dimension(round_number: int, grid: Sequence[int]) -> int | None:
    """The dimension along which round ``round_number``'s groups average (None without a grid)."""
    return round_number % len(grid) if grid else None


def group_key(prefix: str, round_number: int, grid: Sequence[int], coordinates: Sequence[int]) -> str:
    """The DHT key under which this round's group is matched: ``<prefix>.<round>.<coordinates>``, with ``*`` for
    the free dimension (``run1.5.*_3``); without a grid every peer of the prefix meets under ``<prefix>.<round>.*``."""
    dim = free_dimension(round_number, grid)
    if dim is None:
        return f"{prefix}.{round_number}.*"
    return f"{prefix}.{round_number}." + "_".join("*" if i == dim else str(c) for i, c in enumerate(coordinates))


def random_coordinates(grid: Sequence[int], rng: random.Random | None = None) -> list[int]:
    rng = rng or random.Random()
    return [rng.randrange(side) for side in grid]


def check_coordinates(grid: Sequence[int], coordinates: Sequence[int]) -> list[int]:
    if len(coordinates) != len(grid) or any(not 0 <= c < side for c, side in zip(coordinates, grid)):
        raise ValueError(f"coordinates {list(coordinates)} do not lie in the grid {list(grid)}")
    return [int(c) for c in coordinates]


def coordinates_after(round_number: int, grid: Sequence[int], coordinates: Sequence[int], rank: int) -> list[int]:
    """A peer's coordinates after it averaged in round ``round_number`` as member ``rank`` of its group."""
    dim = free_dimension(round_number, grid)
    moved = list(coordinates)
    if dim is not None:
        moved[dim] = rank % grid[dim]
    return moved
