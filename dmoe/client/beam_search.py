"""Exact top-k search for alive experts on a grid, walking the DHT's prefix records.

A plain beam of size k over grid dimensions can miss the true top-k (the best uids may hide under prefixes that
looked mediocre after the first dimension). Here each row runs a best-first search over prefixes ordered by an
admissible upper bound -- the prefix's score plus the best score of every remaining dimension -- so a complete
uid is emitted only when nothing left can beat it: the result equals brute force over the alive experts. The
prefixes every row needs next are looked up together in one batched DHT call per round, and a short-lived
:class:`PrefixCache` (owned by the caller) spares repeated look-ups, including of dead prefixes.
"""
from __future__ import annotations

import heapq
import time
from typing import Callable, Container, Mapping, Protocol, Sequence, Union

import torch

from dmoe.uid import DELIMITER, is_valid_prefix, split_uid

Exclude = Union[Callable[[str, str], bool], Container[str], None]
Continuations = dict[int, str]


class ContinuationSource(Protocol):
    """What beam search needs from the DHT (``dmoe.dht.DHT`` or a test fake)."""

    def get_alive_continuations(self, prefixes: Sequence[str]) -> Mapping[str, Mapping[int, str]]: ...


class PrefixCache:
    """Alive continuations of grid prefixes, remembered for ``ttl`` seconds (dead prefixes for ``negative_ttl``).

    Keeps a forward pass from re-asking the DHT what the previous one just learnt; short, because experts come
    and go. Owned by the caller (e.g. one per MoE layer); not thread-safe.
    """

    def __init__(self, ttl: float = 5.0, negative_ttl: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.negative_ttl = ttl if negative_ttl is None else negative_ttl
        self.clock = clock
        self._entries: dict[str, tuple[float, Continuations]] = {}

    def get(self, prefix: str) -> Continuations | None:
        """The cached continuations (empty for a dead prefix), or None when unknown or stale."""
        entry = self._entries.get(prefix)
        if entry is None:
            return None
        deadline, continuations = entry
        if self.clock() >= deadline:
            del self._entries[prefix]
            return None
        return continuations

    def put(self, prefix: str, continuations: Mapping[int, str]) -> None:
        ttl = self.ttl if continuations else self.negative_ttl
        self._entries[prefix] = (self.clock() + ttl, dict(continuations))

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _excluder(exclude: Exclude) -> Callable[[str, str], bool]:
    """A predicate of (uid, endpoint): the endpoint lets callers skip every expert of a server they banned."""
    if exclude is None:
        return lambda uid, endpoint: False
    if callable(exclude):
        return exclude
    return lambda uid, endpoint: uid in exclude


def _score_lists(grid_scores: Sequence[torch.Tensor]) -> tuple[int, list[list[list[float]]]]:
    """Per dimension, per row, the scores as Python floats (float64, so sums are computed the same everywhere)."""
    if not grid_scores:
        raise ValueError("grid_scores must hold one [batch, grid_size] tensor per grid dimension")
    batch = None
    lists = []
    for dim, scores in enumerate(grid_scores):
        if scores.ndim != 2 or scores.shape[1] < 1:
            raise ValueError(f"grid_scores[{dim}] must have shape [batch, grid_size], got {tuple(scores.shape)}")
        if batch is not None and scores.shape[0] != batch:
            raise ValueError(f"grid_scores disagree on batch size: {batch} vs {scores.shape[0]} at dim {dim}")
        batch = scores.shape[0]
        lists.append(scores.detach().to("cpu", torch.float64).tolist())
    return int(batch), lists


def uid_score(scores: list[list[list[float]]], row: int, coords: Sequence[int]) -> float:
    """Summed score of a uid, added in dimension order (the bound below relies on the same order)."""
    total = 0.0
    for dim, coord in enumerate(coords):
        total += scores[dim][row][coord]
    return total


def beam_search(dht: ContinuationSource, layer: str, grid_scores: Sequence[torch.Tensor], k: int, *,
                exclude: Exclude = None, cache: PrefixCache | None = None,
                lookahead: int | None = None, speculate: bool = True,
                spare: int | None = None) -> list[list[tuple[str, str]]]:
    """For each row, up to ``k`` alive experts ``(uid, endpoint)`` with the highest summed score, best first.

    dht: anything with ``get_alive_continuations`` (a :class:`dmoe.dht.DHT`).
    layer: the grid's uid prefix, e.g. ``'ffn0'``.
    grid_scores: one ``[batch, grid_size_i]`` tensor per grid dimension.
    k: experts wanted per row (fewer are returned when fewer are alive).
    exclude: experts to skip (e.g. banned after failures): a container of uids or a predicate
        ``exclude(uid, endpoint) -> bool``.
    cache: a :class:`PrefixCache` to consult and fill; None looks everything up afresh.
    lookahead: unknown prefixes per row fetched in each round (default ``k``): more per round, fewer rounds.
    speculate: fetch, with each unknown prefix a row needs, the child prefixes that the row's best ``k + spare``
        experts would run through if every expert were alive (off that plan: its ``lookahead`` best-scoring
        children). When they are alive (the usual case), the next round's look-ups ride along with this round's: a
        cold search of a 2-d grid takes one round trip instead of two. A dead guess costs one empty look-up.
    spare: speculation plans for each row's best ``k + spare`` experts (default ``(k + 1) // 2``), so that this many
        of them may turn out dead or excluded without costing another round.
    Ties in score are broken by uid (string order), exactly as :func:`brute_force_top_k` does.
    """
    if not is_valid_prefix(layer) or DELIMITER in layer:
        raise ValueError(f"invalid layer name {layer!r}")
    if k < 1:
        raise ValueError(f"k must be positive, got {k}")
    batch, scores = _score_lists(grid_scores)
    ndims = len(scores)
    grid = [len(scores[dim][0]) if batch else 0 for dim in range(ndims)]
    is_excluded = _excluder(exclude)
    lookahead = k if lookahead is None else max(1, lookahead)
    known: dict[str, Continuations] = {}

    # heap items: (-bound, 0 for a prefix / 1 for a uid, name, coords, prefix score, endpoint)
    best = [[max(scores[dim][row]) for dim in range(ndims)] for row in range(batch)]

    def bound(row: int, prefix_score: float, depth: int) -> float:
        total = prefix_score
        for dim in range(depth, ndims):
            total += best[row][dim]
        return total

    top_coords: dict[tuple[int, int], list[int]] = {}
    planned_experts = k + ((k + 1) // 2 if spare is None else max(0, spare))
    plans: dict[int, dict[str, list[str]]] = {}

    def top(depth: int, row: int) -> list[int]:
        """The row's best coordinates at ``depth``, as many as a plan or a fallback guess can use."""
        if (depth, row) not in top_coords:
            row_scores = scores[depth][row]
            top_coords[depth, row] = heapq.nlargest(max(planned_experts, lookahead), range(grid[depth]),
                                                    key=row_scores.__getitem__)
        return top_coords[depth, row]

    def plan(row: int) -> dict[str, list[str]]:
        """Parent prefix -> the child prefixes the row's best ``k + spare`` experts run through if every expert is
        alive.

        Those experts are a beam of that width per dimension over each dimension's as many best coordinates (an
        expert's score is a sum of independent per-dimension terms, so nothing outside them can rank higher). With
        spare=0 these are exactly the prefixes a cold search of a full grid needs (~30 for 16 rows of a 64x64 grid,
        against ~42 when guessing the k best-scoring children of every needed prefix), but a grid with 10% of its
        experts missing then needed a second round in ~90% of 16-row searches; with the default spare (2 for k=4):
        ~37 prefixes, and a second round in ~7% of them (~42 and ~40% before; 50% missing: ~2 rounds either way).
        """
        if row not in plans:
            beam: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
            for dim in range(ndims):
                row_scores = scores[dim][row]
                best_coords = top(dim, row)[:planned_experts]
                beam = heapq.nlargest(planned_experts, ((score + row_scores[coord], coords + (coord,))
                                                        for score, coords in beam for coord in best_coords))
            children: dict[str, list[str]] = {}
            for _, coords in beam:
                parent = layer
                for coord in coords[:-1]:
                    child = f"{parent}.{coord}"
                    siblings = children.setdefault(parent, [])
                    if child not in siblings:
                        siblings.append(child)
                    parent = child
            plans[row] = children
        return plans[row]

    def guesses(row: int, name: str, depth: int) -> list[str]:
        """The child prefixes of ``name`` (at ``depth``) that the row would explore first if they are alive."""
        if not speculate or depth + 1 >= ndims:
            return []  # its children are experts, not prefix records
        planned = plan(row).get(name)
        if planned is not None:
            return planned
        # off the plan (something on it was dead or excluded): the best-scoring children
        return [f"{name}.{coord}" for coord in top(depth, row)[:lookahead]]

    heaps = [[(-bound(row, 0.0, 0), 0, layer, (), 0.0, "")] for row in range(batch)]
    results: list[list[tuple[str, str]]] = [[] for _ in range(batch)]
    active = set(range(batch))

    while active:
        wanted: dict[str, None] = {}
        for row in sorted(active):
            heap, found = heaps[row], results[row]
            while heap and len(found) < k:
                neg_bound, is_uid, name, coords, prefix_score, endpoint = heap[0]
                if is_uid:
                    heapq.heappop(heap)
                    found.append((name, endpoint))
                    continue
                continuations = known.get(name)
                if continuations is None:
                    break
                heapq.heappop(heap)
                depth = len(coords) + 1
                row_scores, size = scores[depth - 1][row], grid[depth - 1]
                # (names are built by hand: the layer is validated and coordinates are in-range ints)
                children = [(prefix_score + row_scores[coord], coord, child_endpoint)
                            for coord, child_endpoint in continuations.items() if 0 <= coord < size]
                if depth < ndims:
                    for child_score, coord, _ in children:
                        heapq.heappush(heap, (-bound(row, child_score, depth), 0, f"{name}.{coord}",
                                              coords + (coord,), child_score, ""))
                    continue
                # experts: only the best (k - found) allowed ones can still make this row's top k, plus any that
                # tie with the last of them (ties are broken by uid, in the heap)
                need, last = k - len(found), None
                for child_score, coord, child_endpoint in sorted(children, key=lambda c: -c[0]):
                    if need <= 0 and child_score != last:
                        break
                    child_name = f"{name}.{coord}"
                    if is_excluded(child_name, child_endpoint):
                        continue
                    heapq.heappush(heap, (-child_score, 1, child_name, coords + (coord,), child_score, child_endpoint))
                    need, last = need - 1, child_score
            if not heap or len(found) >= k:
                active.discard(row)
                continue
            unknown = 0
            for item in heapq.nsmallest(lookahead * 4, heap):
                if not item[1] and item[2] not in known:
                    wanted[item[2]] = None
                    for guess in guesses(row, item[2], len(item[3])):
                        if guess not in known:
                            wanted[guess] = None
                    unknown += 1
                    if unknown >= lookahead:
                        break
        if not wanted:
            break
        _fetch(dht, list(wanted), known, cache)
    return results


def _fetch(dht: ContinuationSource, prefixes: list[str], known: dict[str, Continuations],
           cache: PrefixCache | None) -> None:
    missing = []
    for prefix in prefixes:
        cached = cache.get(prefix) if cache is not None else None
        if cached is None:
            missing.append(prefix)
        else:
            known[prefix] = cached
    if missing:
        fetched = dht.get_alive_continuations(missing)
        for prefix in missing:
            continuations = {int(c): e for c, e in (fetched.get(prefix) or {}).items()}
            known[prefix] = continuations
            if cache is not None:
                cache.put(prefix, continuations)


def brute_force_top_k(alive: Mapping[str, str], layer: str, grid_scores: Sequence[torch.Tensor], k: int, *,
                      exclude: Exclude = None) -> list[list[tuple[str, str]]]:
    """The reference answer: score every alive uid (uid -> endpoint) of ``layer`` on the grid, keep the best k.

    Sorted by (-score, uid), with scores summed exactly as :func:`beam_search` sums them.
    """
    batch, scores = _score_lists(grid_scores)
    is_excluded = _excluder(exclude)
    grid = [len(scores[dim][0]) if batch else 0 for dim in range(len(scores))]
    candidates = []
    for uid, endpoint in alive.items():
        uid_layer, coords = split_uid(uid)
        if uid_layer == layer and len(coords) == len(grid) and all(0 <= c < g for c, g in zip(coords, grid)) \
                and not is_excluded(uid, endpoint):
            candidates.append((uid, coords, endpoint))
    results = []
    for row in range(batch):
        ranked = sorted(candidates, key=lambda c: (-uid_score(scores, row, c[1]), c[0]))
        results.append([(uid, endpoint) for uid, _, endpoint in ranked[:k]])
    return results
