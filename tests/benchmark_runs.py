"""Running a benchmark of benchmarks/ as its own program for the smoke tests, and reading what it wrote.

The smoke tests are split in two files (tests/test_benchmarks_smoke.py, tests/test_benchmarks_training_smoke.py) of
about equal time, so that the suite's workers, which run each file on one worker, end together.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys

from tests.procs import ROOT, kill_tree

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_benchmark(script: str, *args: str, timeout: float = 240) -> str:
    """Runs ``benchmarks/script`` as its own program (as a user would) and returns its stdout. One that overruns
    ``timeout`` is killed with every process it started (they run in sessions of their own, out of its process
    group)."""
    with subprocess.Popen([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={"OMP_NUM_THREADS": "1", **os.environ}) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            kill_tree(proc.pid)
            raise
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def last_line_fields(stdout: str) -> dict[str, str]:
    """The ``name=value`` pairs of a benchmark's last line of output, its figures."""
    return dict(item.split("=") for item in stdout.strip().splitlines()[-1].split())
