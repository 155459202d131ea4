"""What the benchmarks' command lines share: where their files go, and what ``--quick`` (or ``--smoke``) means.

Files: every benchmark writes its CSVs (and PNGs, checkpoints) under the checkout's ``results/`` and reads or
fetches the Shakespeare corpus into the checkout's ``data/``, wherever it is started from; ``--results`` and
``--data-dir`` move them. Some scripts wrote into the current directory and others into the checkout, so a run
started elsewhere fetched the corpus a second time (review 103 D6).

Quick runs: ``--quick`` gives the small run's values to the options the command line leaves unset; it used to
overwrite them, so that ``--quick --steps 7`` ran 3 steps and said nothing (review 103 D4).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
#: where the benchmarks write their results (git-ignored)
RESULTS = ROOT / "results"
#: where the Shakespeare corpus is fetched and kept (git-ignored; dmoe-train's ``--data-dir data`` from the checkout)
DATA = ROOT / "data"


def parse_with_quick(parser: argparse.ArgumentParser, argv: Sequence[str] | None, quick: dict[str, Any],
                     flag: str = "quick") -> argparse.Namespace:
    """``parser``'s parse of ``argv`` where, if the ``flag`` option (a store_true) is given, ``quick`` (dest ->
    value) replaces the defaults: options given on the command line keep their values beside it."""
    known, _ = parser.parse_known_args(argv)
    if getattr(known, flag):
        parser.set_defaults(**quick)
    return parser.parse_args(argv)
