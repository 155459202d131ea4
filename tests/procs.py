"""Starting real dmoe programs in separate processes for tests, and always stopping them.

Programs announce readiness with one line on stdout (``... listening on HOST:PORT``); tests wait for that
line instead of sleeping, and every process is killed on exit from the context, even when a test fails.
"""
from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on (\S+:\d+)")


class Proc:
    """A child process whose stdout is read by a thread, so readiness lines can be awaited."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        full_env.update(env or {})
        self.args = list(args)
        self.popen = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, start_new_session=True,
        )
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: re.Pattern[str] | str = LISTENING, timeout: float = 60.0) -> re.Match[str]:
        """Blocks until a stdout line matches ``pattern``; raises with the output so far if it never does."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.args} did not print {regex.pattern!r} in {timeout}s:\n{''.join(self.output)}")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.args} exited ({self.popen.wait()}) before {regex.pattern!r}:\n{''.join(self.output)}")
            match = regex.search(line)
            if match:
                return match

    def endpoint(self, timeout: float = 60.0) -> str:
        return self.wait_for(LISTENING, timeout).group(1)

    def kill(self) -> None:
        """SIGKILL the whole process group: the crash a test wants to simulate, or the last resort of cleanup."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def stop(self, timeout: float = 10.0) -> int:
        """SIGINT (a clean shutdown, like Ctrl-C), then SIGKILL if it does not exit in time."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGINT)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.popen.wait()


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """Collects started processes and kills whatever is left of them on exit."""
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.popen.poll() is None:
                proc.kill()


@contextlib.contextmanager
def running(*args: str, env: dict[str, str] | None = None) -> Iterator[Proc]:
    """Starts ``python *args`` and kills it on exit."""
    with processes() as procs:
        proc = Proc(args, env)
        procs.append(proc)
        yield proc
