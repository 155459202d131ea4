"""Beam search's CPU time per forward: the default search (dense for a small grid) against the per-row search.

A trainer runs one beam search per DMoE layer per forward, on its own CPU, before any expert is called; on a GPU
trainer that time is not hidden behind compute. Both searches here read a warm :class:`dmoe.PrefixCache` (the
layer's steady state: no look-ups) over a full grid, with the gate's scores of ``--batches`` rows, and must give
the same answer (checked on every search). The default search is dense where the grid has at most
``DENSE_MAX_PREFIXES`` prefix records and ``DENSE_EXPERTS_PER_ROW`` experts per row, else per row; grids of more
records are timed per row only.

    python benchmarks/bench_beam_search.py                      # grids 4x4, 8x8, 16x16; batches 16 64 256 1024
    python benchmarks/bench_beam_search.py --grids 4x4 --batches 256 --repeats 5
    python benchmarks/bench_beam_search.py --grids 64x64             # too large to be dense: the per-row search alone
"""
from __future__ import annotations

import argparse
import csv
import itertools
import statistics
import time
from pathlib import Path

import torch

from dmoe.client.beam_search import DENSE_MAX_PREFIXES, PrefixCache, beam_search, prefix_records
from dmoe.uid import join_uid, strict_prefixes
from options import RESULTS  # benchmarks/


class Records:
    """Prefix records of a full grid in memory (a DHT's, without the network): what a warm cache holds."""

    def __init__(self, layer: str, grid: list[int]):
        self.records: dict[str, dict[int, str]] = {}
        for coords in itertools.product(*(range(size) for size in grid)):
            for prefix, coord in strict_prefixes(join_uid(layer, coords)):
                self.records.setdefault(prefix, {})[coord] = f"127.0.0.1:{8000 + coords[0]}"

    def get_alive_continuations(self, prefixes, experts_under=()):
        return {prefix: dict(self.records.get(prefix, {})) for prefix in prefixes}


def timed(search, repeats: int) -> tuple[float, list]:
    """The median seconds of ``repeats`` searches, and the last answer."""
    times, answer = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        answer = search()
        times.append(time.perf_counter() - started)
    return statistics.median(times), answer


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grids", nargs="+", default=["4x4", "8x8", "16x16"], help="grids as AxB[xC]")
    parser.add_argument("--batches", nargs="+", type=int, default=[16, 64, 256, 1024])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9, help="searches timed per case (the median is printed)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="directory for the CSV")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"beam search top-{args.k} over a full grid, warm prefix cache, median of {args.repeats} searches, "
          "1 torch thread")
    print(f"{'grid':>8} {'records':>8} {'batch':>6} {'per-row ms':>11} {'default ms':>11} {'speed-up':>9}")
    for grid_name in args.grids:
        grid = [int(size) for size in grid_name.split("x")]
        source = Records("ffn0", grid)
        for batch in args.batches:
            generator = torch.Generator().manual_seed(batch)
            scores = [torch.randn(batch, size, generator=generator) for size in grid]
            cache = PrefixCache(ttl=3600)
            beam_search(source, "ffn0", scores, args.k, cache=cache)  # warms the cache
            per_row, expected = timed(lambda: beam_search(source, "ffn0", scores, args.k, cache=cache, dense=False),
                                      args.repeats)
            if prefix_records(grid) > DENSE_MAX_PREFIXES:  # the per-row search only
                rows.append(dict(grid=grid_name, records=prefix_records(grid), batch=batch, per_row_ms=1e3 * per_row,
                                 default_ms=None, speedup=None))
                print(f"{grid_name:>8} {prefix_records(grid):>8} {batch:>6} {1e3 * per_row:>11.2f} {'-':>11} {'-':>9}")
                continue
            default, answer = timed(lambda: beam_search(source, "ffn0", scores, args.k, cache=cache), args.repeats)
            if answer != expected:
                raise SystemExit(f"the searches disagree on grid {grid_name} at batch {batch}")
            rows.append(dict(grid=grid_name, records=prefix_records(grid), batch=batch, per_row_ms=1e3 * per_row,
                             default_ms=1e3 * default, speedup=per_row / default))
            r = rows[-1]
            print(f"{grid_name:>8} {r['records']:>8} {batch:>6} {r['per_row_ms']:>11.2f} {r['default_ms']:>11.2f} "
                  f"{r['speedup']:>8.1f}x")
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / "bench_beam_search.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
