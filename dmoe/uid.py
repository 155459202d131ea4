"""Expert uids on a grid, in one place.

An expert uid is a layer prefix followed by one integer coordinate per grid dimension: ``ffn0.3.17`` sits at
(3, 17) of layer ``ffn0``'s grid. Every *strict* prefix of a uid (``ffn0``, ``ffn0.3``) names a set of
experts; the DHT keeps one record per prefix whose subkeys are the coordinates that continue it, which is
what beam search walks dimension by dimension.
"""
from __future__ import annotations

import itertools
import math
import re
from typing import Iterable, Sequence

DELIMITER = "."
#: The largest grid coordinate (at most 9 digits)
MAX_COORDINATE = 999_999_999
#: A layer name: starts with a letter or underscore, no dots (dots separate grid coordinates).
_LAYER = r"[A-Za-z_][A-Za-z0-9_\-]{0,63}"
_UID_RE = re.compile(rf"{_LAYER}(\.(0|[1-9][0-9]{{0,8}}))+")
_PREFIX_RE = re.compile(rf"{_LAYER}(\.(0|[1-9][0-9]{{0,8}}))*")
_PATTERN_PART = re.compile(r"([0-9]+)|\[([0-9]+):([0-9]+)\]|\*")
#: The most uids one pattern may name: a typo such as ``[0:100000000]`` must not exhaust memory
MAX_PATTERN_UIDS = 1 << 20


class UIDError(ValueError):
    """A uid, prefix or pattern that does not name a place on an expert grid."""


def is_valid_uid(uid: str) -> bool:
    """True for ``layer.i.j...`` with at least one non-negative integer coordinate."""
    return isinstance(uid, str) and _UID_RE.fullmatch(uid) is not None


def is_valid_prefix(prefix: str) -> bool:
    """True for a layer name optionally followed by coordinates (``ffn0``, ``ffn0.3``)."""
    return isinstance(prefix, str) and _PREFIX_RE.fullmatch(prefix) is not None


def check_uid(uid: str) -> str:
    """Returns ``uid`` or raises :class:`UIDError` saying what a uid must look like."""
    if not is_valid_uid(uid):
        raise UIDError(f"invalid expert uid {uid!r}: expected 'layer.i.j...' with integer coordinates, e.g. 'ffn0.3.17'")
    return uid


def split_uid(uid: str) -> tuple[str, tuple[int, ...]]:
    """``'ffn0.3.17'`` -> ``('ffn0', (3, 17))``."""
    layer, *coords = check_uid(uid).split(DELIMITER)
    return layer, tuple(int(c) for c in coords)


def join_uid(layer: str, coords: Iterable[int]) -> str:
    """``('ffn0', (3, 17))`` -> ``'ffn0.3.17'``."""
    return DELIMITER.join([layer, *map(str, coords)])


def strict_prefixes(uid: str) -> list[tuple[str, int]]:
    """Each strict prefix of ``uid`` with the coordinate that continues it towards ``uid``.

    ``'ffn0.3.17'`` -> ``[('ffn0', 3), ('ffn0.3', 17)]``: the (record key, subkey) pairs a server declares so that
    beam search can tell which continuations of a prefix are alive.
    """
    layer, coords = split_uid(uid)
    return [(join_uid(layer, coords[:i]), coords[i]) for i in range(len(coords))]


def grid_uids(layer: str, grid: Sequence[int]) -> list[str]:
    """Every uid of a full grid, e.g. ``grid_uids('ffn0', (4, 4))`` -> 16 uids."""
    if not is_valid_prefix(layer) or DELIMITER in layer:
        raise UIDError(f"invalid layer name {layer!r}")
    if not grid or any(int(g) < 1 for g in grid):
        raise UIDError(f"grid dimensions must be positive integers, got {tuple(grid)}")
    return [join_uid(layer, coords) for coords in itertools.product(*(range(int(g)) for g in grid))]


def expand_pattern(pattern: str, grid: Sequence[int] | None = None) -> list[str]:
    """Expands ``'ffn0.[0:8].[0:8]'`` (half-open ranges), ``'ffn0.3.*'`` (needs ``grid``) or a plain uid.

    Comma-separated patterns are expanded one after another; duplicates are dropped, order is kept.
    """
    uids: dict[str, None] = {}
    for part in (p.strip() for p in pattern.split(",")):
        if not part:
            continue
        layer, *dims = part.split(DELIMITER)
        if not dims or not is_valid_prefix(layer):
            raise UIDError(f"invalid expert pattern {part!r}: expected e.g. 'ffn0.[0:8].[0:8]'")
        ranges = []
        for axis, dim in enumerate(dims):
            match = _PATTERN_PART.fullmatch(dim)
            if match is None:
                raise UIDError(f"invalid expert pattern {part!r}: coordinate {dim!r} is not N, [A:B] or *")
            single, start, stop = match.groups()
            if single is not None:
                ranges.append(range(int(single), int(single) + 1))
            elif start is not None:
                if int(start) >= int(stop):
                    raise UIDError(f"invalid expert pattern {part!r}: empty range {dim!r}")
                ranges.append(range(int(start), int(stop)))
            else:
                if grid is None or axis >= len(grid):
                    raise UIDError(f"expert pattern {part!r} uses '*' but no grid size was given for axis {axis}")
                ranges.append(range(int(grid[axis])))
        if math.prod(map(len, ranges)) + len(uids) > MAX_PATTERN_UIDS:
            raise UIDError(f"expert pattern {pattern!r} names more than {MAX_PATTERN_UIDS} experts")
        for axis, values in enumerate(ranges):
            if values[-1] > MAX_COORDINATE:
                raise UIDError(f"invalid expert pattern {part!r}: coordinate {values[-1]} of axis {axis} is above "
                               f"{MAX_COORDINATE}")
        for coords in itertools.product(*ranges):
            uids[join_uid(layer, coords)] = None
    if not uids:
        raise UIDError(f"expert pattern {pattern!r} names no experts")
    return list(uids)
