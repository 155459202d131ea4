"""beam_search against brute force on an in-memory stand-in for the DHT's prefix records."""
from __future__ import annotations

import itertools
import random
from typing import Mapping, Sequence

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dmoe.client.beam_search import PrefixCache, beam_search, brute_force_top_k
from dmoe.uid import join_uid, strict_prefixes


class FakeDHT:
    """Prefix records as a declaring server would leave them, counting the look-ups made."""

    def __init__(self, alive: Mapping[str, str]):
        self.records: dict[str, dict[int, str]] = {}
        for uid, endpoint in alive.items():
            for prefix, coord in strict_prefixes(uid):
                self.records.setdefault(prefix, {})[coord] = endpoint
        self.calls: list[list[str]] = []

    def get_alive_continuations(self, prefixes: Sequence[str], experts_under: Sequence[str] = ()
                                ) -> dict[str, dict[int, str]]:
        self.calls.append(list(prefixes))
        return {prefix: dict(self.records.get(prefix, {})) for prefix in prefixes}


@st.composite
def problems(draw):
    grid = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    uids = [join_uid("ffn", c) for c in itertools.product(*(range(g) for g in grid))]
    alive = draw(st.lists(st.sampled_from(uids), unique=True, max_size=len(uids)))
    excluded = draw(st.lists(st.sampled_from(uids), unique=True, max_size=3))
    batch = draw(st.integers(1, 3))
    # small integer scores make ties common, which is where an inexact search would show
    scores = [torch.tensor(draw(st.lists(st.lists(st.integers(-3, 3).map(float), min_size=g, max_size=g),
                                         min_size=batch, max_size=batch))) for g in grid]
    k = draw(st.integers(1, 6))
    return grid, {uid: f"host:{i}" for i, uid in enumerate(alive)}, set(excluded), scores, k


@settings(max_examples=300, deadline=None)
@given(problems())
def test_beam_search_equals_brute_force_with_ties_dead_and_excluded_experts(problem):
    grid, alive, excluded, scores, k = problem
    expected = brute_force_top_k(alive, "ffn", scores, k, exclude=excluded)
    assert beam_search(FakeDHT(alive), "ffn", scores, k, exclude=excluded) == expected
    assert beam_search(FakeDHT(alive), "ffn", scores, k, exclude=lambda uid, endpoint: uid in excluded, lookahead=1) == expected
    assert beam_search(FakeDHT(alive), "ffn", scores, k, exclude=excluded, speculate=False) == expected


@settings(max_examples=100, deadline=None)
@given(problems(), st.data())
def test_beam_search_stays_exact_with_dead_claimed_prefixes(problem, data):
    """Shared claims of coordinates with no expert below (anyone may write them into a grid's inner records): the
    rows that meet only such dead prefixes in a round look up twice as many in the next (review 85)."""
    grid, alive, excluded, scores, k = problem
    fake = FakeDHT(alive)
    inner = [join_uid("ffn", c) for depth in range(1, len(grid) - 1)
             for c in itertools.product(*(range(g) for g in grid[:depth]))]
    for prefix in ["ffn"] * (len(grid) > 1) + inner:  # (the last prefixes' records list experts: owned entries)
        for coord in data.draw(st.lists(st.integers(0, grid[prefix.count(".")] - 1), unique=True)):
            fake.records.setdefault(prefix, {}).setdefault(coord, "6.6.6.6:1")
    expected = brute_force_top_k(alive, "ffn", scores, k, exclude=excluded)
    assert beam_search(fake, "ffn", scores, k, exclude=excluded, lookahead=1) == expected


@pytest.mark.parametrize("batch", [1, 4])
def test_dead_claimed_prefixes_cost_rounds_that_grow_with_their_log_not_their_number(batch):
    """Review 85: one peer claiming every coordinate of a 256x256 layer's record (256 shared entries, no expert
    under them) made a batch-1 search take 36 rounds of look-ups here (4 dead prefixes a round, k=4) where 3 did
    without them, and a batch-4 one 19 where 2 did. A row's lookahead doubles after a round that found only dead
    prefixes: 8 and 7 rounds."""
    rng = random.Random(0)
    uids = [join_uid("ffn0", (i, j)) for i in rng.sample(range(256), 8) for j in rng.sample(range(256), 8)]
    alive = {uid: "10.0.0.1:8000" for uid in uids}
    scores = [torch.randn(batch, 256, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    fake = FakeDHT(alive)
    for coord in range(256):
        fake.records["ffn0"].setdefault(coord, "6.6.6.6:1")
    assert beam_search(fake, "ffn0", scores, 4, cache=PrefixCache()) == brute_force_top_k(alive, "ffn0", scores, 4)
    looked_up = [prefix for call in fake.calls for prefix in call]
    assert len(looked_up) == len(set(looked_up)), "a prefix was looked up twice in one search"
    assert len(fake.calls) <= 10, f"{len(fake.calls)} sequential rounds of look-ups"


def test_beam_search_on_a_sparse_64x64_grid_with_random_scores_is_exact_and_batched():
    rng = random.Random(0)
    uids = [join_uid("ffn0", (i, j)) for i in range(64) for j in range(64)]
    alive = {uid: f"10.0.0.{rng.randrange(256)}:8000" for uid in rng.sample(uids, 1000)}
    scores = [torch.randn(32, 64, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    fake = FakeDHT(alive)
    assert beam_search(fake, "ffn0", scores, 4) == brute_force_top_k(alive, "ffn0", scores, 4)
    looked_up = [prefix for call in fake.calls for prefix in call]
    assert len(looked_up) == len(set(looked_up)), "a prefix was looked up twice in one search"
    assert len(fake.calls) <= 6, f"{len(fake.calls)} sequential rounds of look-ups"


def test_speculative_lookups_make_a_cold_search_of_a_full_grid_one_round_and_stay_exact_when_guesses_die():
    uids = [join_uid("ffn0", (i, j)) for i in range(64) for j in range(64)]
    scores = [torch.randn(16, 64, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
    full = FakeDHT({uid: "10.0.0.1:8000" for uid in uids})
    plain = FakeDHT(full_alive := {uid: "10.0.0.1:8000" for uid in uids})
    expected = brute_force_top_k(full_alive, "ffn0", scores, 4)
    exact = FakeDHT(full_alive)
    assert beam_search(full, "ffn0", scores, 4) == expected
    assert beam_search(plain, "ffn0", scores, 4, speculate=False) == expected
    assert beam_search(exact, "ffn0", scores, 4, spare=0) == expected
    assert len(full.calls) == 1 and len(plain.calls) == 2 and len(exact.calls) == 1
    # with no spare, a full grid's cold search fetches exactly the prefixes its answer runs through
    needed = {"ffn0"} | {uid.rsplit(".", 1)[0] for row in expected for uid, _ in row}
    assert sorted(exact.calls[0]) == sorted(needed), "speculation fetched other prefixes than the answer needs"
    assert set(full.calls[0]) >= needed
    assert len(needed) < len(full.calls[0]) <= len(plain.calls[0] + plain.calls[1])
    # 50 alive experts of 4096: most guesses are dead prefixes, looked up once, and the result stays exact
    rng = random.Random(1)
    sparse = {uid: "10.0.0.2:8000" for uid in rng.sample(uids, 50)}
    fake = FakeDHT(sparse)
    assert beam_search(fake, "ffn0", scores, 4) == brute_force_top_k(sparse, "ffn0", scores, 4)
    looked_up = [prefix for call in fake.calls for prefix in call]
    assert len(looked_up) == len(set(looked_up))


def test_spare_planned_experts_keep_searches_of_a_grid_with_a_tenth_missing_to_one_round():
    """Guessing only the prefixes of each row's top k took a second round whenever one of them was missing; the k
    best children of every prefix did so in ~40% of 16-row searches of a grid missing 10% of its experts."""
    rng = random.Random(2)
    uids = [join_uid("ffn0", (i, j)) for i in range(64) for j in range(64)]
    rounds = {None: [], 0: []}
    for search in range(20):
        alive = {uid: "10.0.0.3:8000" for uid in uids if rng.random() < 0.9}
        scores = [torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + 2 * search + d)) for d in (0, 1)]
        expected = brute_force_top_k(alive, "ffn0", scores, 4)
        for spare in rounds:
            fake = FakeDHT(alive)
            assert beam_search(fake, "ffn0", scores, 4, spare=spare) == expected
            rounds[spare].append(len(fake.calls))
    assert sum(rounds[None]) <= 22, f"default spare: {rounds[None]} rounds"
    assert sum(rounds[0]) >= 30, "without spares a missing planned expert should cost rounds: the scenario is wrong"


def test_prefix_cache_spares_lookups_and_remembers_dead_prefixes_until_ttl():
    now = [0.0]
    cache = PrefixCache(ttl=5.0, negative_ttl=1.0, clock=lambda: now[0])
    alive = {"ffn.0.1": "a:1", "ffn.2.2": "b:2"}
    fake = FakeDHT(alive)
    fake.records["ffn"][1] = "gone:0"  # the parent still lists 'ffn.1', whose own record has expired
    scores = [torch.tensor([[0.0, 5.0, 9.0]]), torch.tensor([[0.0, 1.0, 2.0]])]
    first = beam_search(fake, "ffn", scores, 2, cache=cache)
    assert first == brute_force_top_k(alive, "ffn", scores, 2)
    assert cache.get("ffn.1") == {}, "the dead prefix was not cached"
    calls = len(fake.calls)
    assert beam_search(fake, "ffn", scores, 2, cache=cache) == first
    assert len(fake.calls) == calls, "cached prefixes were looked up again"
    fake.records["ffn.1"] = {0: "c:3"}  # an expert appears under the dead prefix
    now[0] = 0.5
    assert ("ffn.1.0", "c:3") not in beam_search(fake, "ffn", scores, 3, cache=cache)[0]
    now[0] = 1.5  # past the negative TTL, within the positive one
    assert ("ffn.1.0", "c:3") in beam_search(fake, "ffn", scores, 3, cache=cache)[0]


def test_beam_search_rejects_mismatched_scores():
    with pytest.raises(ValueError):
        beam_search(FakeDHT({}), "ffn", [torch.zeros(2, 3), torch.zeros(3, 3)], 1)
    with pytest.raises(ValueError):
        beam_search(FakeDHT({}), "ffn.0", [torch.zeros(2, 3)], 1)
    assert beam_search(FakeDHT({}), "ffn", [torch.zeros(2, 3)], 3) == [[], []]


@pytest.mark.parametrize("kind", ["ties", "rounding"])
def test_beam_search_equals_brute_force_on_larger_grids_where_siblings_tie_in_bound(kind):
    """Children of an expanded prefix reach its row's heap one at a time, best bound first: siblings tied in bound
    (equal scores, or float64 sums that round alike, e.g. 2**53 + 1 == 2**53) must still come out as the heap
    would order them, and none may be skipped."""
    rng = random.Random(3)
    for case in range(60):
        grid = [rng.randint(2, 12) for _ in range(rng.choice([2, 3]))]
        uids = [join_uid("ffn", c) for c in itertools.product(*(range(g) for g in grid))]
        fraction_alive = rng.choice([1.0, 0.7, 0.2])
        alive = {uid: f"host:{rng.randrange(4)}" for uid in uids if rng.random() < fraction_alive}
        batch = rng.randint(1, 4)
        if kind == "ties":
            values, dtype = [-1.0, 0.0, 0.0, 1.0, 2.0], torch.float32
        else:
            values, dtype = [2.0 ** 53, 2.0 ** 53 + 2, 0.0, 1.0, 2.0, 3.0, -1.0], torch.float64
        scores = [torch.tensor([[rng.choice(values) for _ in range(g)] for _ in range(batch)], dtype=dtype)
                  for g in grid]
        excluded = set(rng.sample(sorted(alive), min(3, len(alive))))
        k = rng.randint(1, 8)
        expected = brute_force_top_k(alive, "ffn", scores, k, exclude=excluded)
        for kwargs in ({}, {"lookahead": 1, "spare": 0}, {"speculate": False}):
            fake = FakeDHT(alive)
            assert beam_search(fake, "ffn", scores, k, exclude=excluded, **kwargs) == expected, (case, kwargs)
            looked_up = [prefix for call in fake.calls for prefix in call]
            assert len(looked_up) == len(set(looked_up)), "a prefix was looked up twice in one search"


@pytest.mark.parametrize("dtype, scores_9_10, best_last", [(torch.float32, (1.0, 1.0), 1.0),
                                                           (torch.float64, (1.0, 0.0), 2.0 ** 53)],
                         ids=["equal scores", "sums that round alike"])
def test_siblings_tied_in_bound_are_looked_up_in_name_order_as_the_heap_breaks_ties(dtype, scores_9_10, best_last):
    """'ffn.10' sorts before 'ffn.9': with equal bounds it is expanded, hence looked up, first."""
    alive = {join_uid("ffn", (i, j)): "host:0" for i in range(12) for j in range(2)}
    first = [-10.0] * 12
    first[9], first[10] = scores_9_10
    scores = [torch.tensor([first], dtype=dtype), torch.tensor([[best_last, 0.0]], dtype=dtype)]
    expected = brute_force_top_k(alive, "ffn", scores, 1)
    assert expected == [[("ffn.10.0", "host:0")]]
    fake = FakeDHT(alive)
    assert beam_search(fake, "ffn", scores, 1, lookahead=1, speculate=False) == expected
    assert fake.calls == [["ffn"], ["ffn.10"], ["ffn.9"]]
    fake = FakeDHT(alive)
    assert beam_search(fake, "ffn", scores, 1, lookahead=2, speculate=False) == expected
    assert fake.calls == [["ffn"], ["ffn.10", "ffn.9"]]


@settings(max_examples=300, deadline=None)
@given(problems(), st.booleans())
def test_a_cached_search_of_a_small_grid_scores_every_alive_expert_and_equals_brute_force(problem, warm):
    """With a cache, grids of at most DENSE_MAX_PREFIXES prefix records are searched densely: same answer."""
    grid, alive, excluded, scores, k = problem
    scores = [s.repeat(32, 1) for s in scores]  # >= 32 rows: at most 125 experts is <= DENSE_EXPERTS_PER_ROW a row
    expected = brute_force_top_k(alive, "ffn", scores, k, exclude=excluded)
    cache = PrefixCache()
    if warm:
        assert beam_search(FakeDHT(alive), "ffn", scores, k, cache=cache) == brute_force_top_k(alive, "ffn", scores, k)
    fake = FakeDHT(alive)
    assert beam_search(fake, "ffn", scores, k, exclude=excluded, cache=cache) == expected
    assert len(fake.calls) == (0 if warm else 1), "a cached tree was looked up again, or a cold one in rounds"
    looked_up = [prefix for call in fake.calls for prefix in call]
    assert len(looked_up) == len(set(looked_up))
    # the per-row search reads the same warm cache: the same answer, and nothing looked up
    fake.calls.clear()
    assert beam_search(fake, "ffn", scores, k, exclude=excluded, cache=cache, dense=False) == expected
    assert fake.calls == []


def test_a_warm_cache_spares_the_per_row_search_of_a_large_grid_every_look_up():
    rng = random.Random(5)
    alive = {join_uid("ffn0", (i, j)): "host:0" for i in range(64) for j in range(64) if rng.random() < 0.5}
    scores = [torch.randn(64, 64, generator=torch.Generator().manual_seed(s)) for s in (9, 10)]
    cache, fake = PrefixCache(), FakeDHT(alive)
    expected = brute_force_top_k(alive, "ffn0", scores, 4)
    assert beam_search(fake, "ffn0", scores, 4, cache=cache) == expected
    fake.calls.clear()
    assert beam_search(fake, "ffn0", scores, 4, cache=cache) == expected
    assert fake.calls == [], "prefixes in the cache were looked up again"


def test_the_dense_search_reads_a_cold_tree_in_one_round_and_only_below_records_it_does_not_know():
    alive = {join_uid("ffn0", (i, j)): f"host:{i}" for i in range(4) for j in range(4) if (i, j) != (2, 1)}
    del alive["ffn0.3.0"], alive["ffn0.3.1"], alive["ffn0.3.2"], alive["ffn0.3.3"]  # ffn0.3 is dead
    scores = [torch.randn(256, 4, generator=torch.Generator().manual_seed(s)) for s in (5, 6)]
    cache, fake = PrefixCache(), FakeDHT(alive)
    assert beam_search(fake, "ffn0", scores, 4, cache=cache) == brute_force_top_k(alive, "ffn0", scores, 4)
    assert fake.calls == [["ffn0", "ffn0.0", "ffn0.1", "ffn0.2", "ffn0.3"]]
    assert cache.get("ffn0.3") == {}
    # the layer's record expired alone: it is looked up again, and so are the children it lists that are not cached
    cache._entries.pop("ffn0")
    cache._entries.pop("ffn0.1")
    fake.calls.clear()
    assert beam_search(fake, "ffn0", scores, 4, cache=cache) == brute_force_top_k(alive, "ffn0", scores, 4)
    assert fake.calls == [["ffn0", "ffn0.1"]]


@pytest.mark.parametrize("case", ["nan scores", "grid too large"])
def test_searches_the_dense_way_cannot_take_fall_back_to_the_per_row_search(case):
    if case == "nan scores":
        alive = {join_uid("ffn", (i, j)): "host:0" for i in range(3) for j in range(3)}
        scores = [torch.tensor([[0.0, 1.0, float("nan")], [2.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0]] * 2)]
        expected = beam_search(FakeDHT(alive), "ffn", scores, 2)  # no cache: the per-row search
    else:  # 1 + 64 prefix records
        rng = random.Random(4)
        alive = {join_uid("ffn", (i, j)): "host:0" for i in range(64) for j in range(64) if rng.random() < 0.2}
        scores = [torch.randn(8, 64, generator=torch.Generator().manual_seed(s)) for s in (7, 8)]
        expected = brute_force_top_k(alive, "ffn", scores, 4)
    fake = FakeDHT(alive)  # (speculate=False: the per-row search then looks up the layer's record alone first)
    assert beam_search(fake, "ffn", scores, 2 if case == "nan scores" else 4, cache=PrefixCache(),
                       speculate=False) == expected
    if case == "grid too large":
        assert fake.calls[0] == ["ffn"], "a grid over DENSE_MAX_PREFIXES records was read whole"
