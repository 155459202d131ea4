"""Starting real dmoe programs in separate processes for tests, and always stopping them.

The machinery lives in :mod:`dmoe.launch`; tests only add a default of one torch thread per child process, so
that several servers and DHT nodes share the CI machine's two cores without oversubscribing them.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Iterator, Sequence

from dmoe import launch
from dmoe.launch import LISTENING, ROOT, processes  # noqa: F401  (re-exported for tests)
from tests import template


def _test_env(env: dict[str, str] | None) -> dict[str, str]:
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}


class Proc(launch.Proc):
    """A dmoe program started for a test: forked from the test process's template (:mod:`tests.template`, which
    imported torch once) where it can be, else with python."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None):
        super().__init__(args, _test_env(env))

    def _start(self, args: list[str], env: dict[str, str]):
        return template.start(args, env, launch.PARENT_ENV) or super()._start(args, env)


def exit_output(args: Sequence[str], status: int = 2, timeout: float = 120) -> str:
    """Runs ``python *args`` to its end and returns its whole output, failing (with that output) unless it exited
    with ``status`` within ``timeout`` seconds; a program that does not exit is killed all the same."""
    with processes() as procs:
        procs.append(proc := Proc(args))
        try:
            code = proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        proc._reader.join(timeout=10)
        output = "".join(proc.output)
        assert code == status, f"exit status {code} (not {status}) of {' '.join(args)}:\n{output[-3000:]}"
        return output


def children_by_parent() -> dict[int, list[int]]:
    """Every running process's children, by parent pid, from /proc (those in sessions of their own too)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs."""
    children, found, todo = children_by_parent(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILLs ``pid`` and every process it started (gone ones are skipped): the parent first, so that it cannot
    start another meanwhile (``dmoe-server --processes`` restarts a child that dies)."""
    for victim in [pid, *descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def running(*args: str, env: dict[str, str] | None = None) -> Iterator[launch.Proc]:
    """Starts ``python *args`` (one torch thread unless ``env`` says otherwise) and kills it on exit."""
    with processes() as procs:
        procs.append(proc := Proc(args, env))
        yield proc
