"""Running a benchmark of benchmarks/ as its own program for the smoke tests, and reading what it wrote.

Started with python, a benchmark and every server, trainer and peer it starts spent 2-4 s of CPU importing torch (and
``torch._dynamo``, which the first optimizer imports) and a second unloading it: most of the smoke tests' time on the
suite's shared 2-core machine. So :func:`run_benchmark` forks ``python -m tests.benchmark_runs SCRIPT ARGS`` from the
test's template (:mod:`tests.template`, as the tests' own programs are), which forks itself, while it has one thread,
into the template of the programs the benchmark starts through :class:`dmoe.launch.Proc`, then runs the script as
``python SCRIPT ARGS`` would (its ``__main__``, ``sys.argv`` and ``sys.path[0]``, its stdout, its exit status; its
stderr goes to a file of its own). ``DMOE_TEST_FORK=0`` starts them all with python. Programs a benchmark starts
otherwise (``subprocess``, ``multiprocessing``: the throughput benchmark's workers, the quality benchmark's runs) start
with python, and so do the programs of the demo and the launchers (tests/test_demo.py, tests/test_launch.py), which
exercise the entry points as a shell starts them.

The smoke tests are split in two files (tests/test_benchmarks_smoke.py, tests/test_benchmarks_training_smoke.py) of
about equal time, so that the suite's workers, which run each file on one worker, end together.
"""
from __future__ import annotations

import csv
import os
import runpy
import sys
import tempfile
from pathlib import Path

from dmoe import launch
from tests import template
from tests.procs import ROOT, Proc, kill_tree, processes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_benchmark(script: str, *args: str, timeout: float = 240) -> str:
    """Runs ``benchmarks/script`` as its own program (as a user would, but for where it and its programs are forked
    from, see the module's doc) and returns its stdout. One that overruns ``timeout`` is killed with every process
    it started (they run in sessions of their own, out of its process group). No progress bars: the stderr shown on
    a failure is the benchmark's messages, and trainers started with ``TQDM_DISABLE`` share their template with the
    servers."""
    with tempfile.TemporaryDirectory() as work, processes() as procs:
        stderr = Path(work) / "stderr"
        procs.append(proc := Proc(["-m", "tests.benchmark_runs", script, *args],
                                  env={"TQDM_DISABLE": "1", STDERR: str(stderr),
                                       FORKS: os.environ.get(template.SWITCH, "1")}))
        try:
            status = proc.popen.wait(timeout)
        except BaseException:
            kill_tree(proc.popen.pid)
            raise
        proc._reader.join(timeout=10)
        stdout, errors = "".join(proc.output), stderr.read_text() if stderr.exists() else ""
    assert status == 0, f"exit status {status}:\n" + stdout[-3000:] + errors[-3000:]
    return stdout


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def last_line_fields(stdout: str) -> dict[str, str]:
    """The ``name=value`` pairs of a benchmark's last line of output, its figures."""
    return dict(item.split("=") for item in stdout.strip().splitlines()[-1].split())


#: variables :func:`run_benchmark` sets for :func:`main`: the file for the benchmark's stderr, and whether to fork its
#: programs (the test process's ``DMOE_TEST_FORK``)
STDERR, FORKS = "DMOE_BENCHMARK_STDERR", "DMOE_BENCHMARK_FORKS"


def forking(python_start):
    """A :meth:`dmoe.launch.Proc._start` that forks programs from this process's templates, or starts them with
    ``python_start`` where they must start with python (see :func:`tests.template.start`)."""
    def start(proc: launch.Proc, args: list[str], env: dict[str, str]):
        return template.start(args, env, launch.PARENT_ENV) or python_start(proc, args, env)
    return start


def main(argv: list[str]) -> None:
    """``python -m tests.benchmark_runs SCRIPT ARGS``: benchmarks/SCRIPT with ARGS, as ``python`` runs a script, its
    stderr to the file ``$DMOE_BENCHMARK_STDERR`` names, its :class:`dmoe.launch.Proc` programs forked from templates
    unless ``$DMOE_BENCHMARK_FORKS`` is 0."""
    stderr = os.open(os.environ.pop(STDERR), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(stderr, 2)  # (a program forked from the test's template has one pipe for stdout and stderr)
    os.close(stderr)
    # (the test's template tells its programs to start theirs with python: these fork, unless the test's did not)
    os.environ[template.SWITCH] = os.environ.pop(FORKS)
    template.fork_here()
    script = str(ROOT / "benchmarks" / argv[0])
    launch.Proc._start = forking(launch.Proc._start)  # (this process runs the benchmark only)
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
