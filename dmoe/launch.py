"""Starting dmoe programs as child processes and a whole local swarm, with readiness and clean shutdown.

Every dmoe program prints one line ``<program> listening on HOST:PORT`` to stdout when it serves. Callers wait
for that line instead of sleeping. :class:`LocalSwarm` is what the demo, the benchmarks and the end-to-end
tests start: one DHT bootstrap node and several expert servers on this machine, each a real process.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from dmoe.cli.signals import PARENT_ENV
from dmoe.dht import DHT
from dmoe.directory import get_experts
from dmoe.uid import grid_uids

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on (\S+:\d+)")
#: seconds between the stop signals :meth:`Proc.stop` sends a program that has not said it is ready yet
RESEND_PERIOD = 1.0


def announced(output: Sequence[str], kind: str = "listening on") -> list[str]:
    """Every endpoint in a dmoe program's ``kind`` line (``'listening on'``, ``'metrics on'``; not a log line saying
    the same): its first, then those a server of several processes (``dmoe-server --processes``) adds as
    ``(and N more processes: A B)``."""
    for line in output:
        match = re.match(rf"dmoe-[\w-]+ {kind} (\S+:\d+)(?: \(and \d+ more process(?:es)?: ([^)]*)\))?", line)
        if match:
            return [match.group(1), *(match.group(2) or "").split()]
    raise ValueError(f"no line says {kind!r}")


def _do_nothing(signum: int, frame: object) -> None:
    """A handler that stands in for SIG_IGN (see :func:`sigint_default_in_children`)."""


def children_take_sigint() -> bool:
    """Whether a child started now takes SIGINT as a stop: not where this process ignores SIGINT and, in a thread
    other than the main one, cannot keep its children from inheriting that (:func:`sigint_default_in_children`)."""
    return threading.current_thread() is threading.main_thread() or \
        signal.getsignal(signal.SIGINT) != signal.SIG_IGN


@contextlib.contextmanager
def sigint_default_in_children() -> Iterator[None]:
    """Children started meanwhile take SIGINT as they would by default, also where this process ignores it (a
    launcher started in the background of a script, which ignores SIGINT): :meth:`Proc.interrupt` stops programs
    with SIGINT, and dmoe's programs leave an ignored SIGINT ignored. exec resets a signal that has a handler to the
    default action, so a handler that does nothing stands in for SIG_IGN meanwhile; only from the main thread
    (elsewhere the children inherit what this process does)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, _do_nothing)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class Proc:
    """A child Python process whose stdout is read by a thread, so readiness lines can be awaited.

    The child runs in its own process group, so :meth:`kill` takes its children with it, and in the repository's
    root (so that ``-m dmoe...`` runs this checkout): a relative path in its arguments is taken from there. dmoe's
    programs stop by themselves within a second or two if this process dies without stopping them (see
    :func:`dmoe.cli.signals.orphaned`). ``ready``: the line the program prints once it handles its stop signal
    itself (:data:`LISTENING` for dmoe's servers and DHT nodes), which :meth:`stop` watches for; None for a program
    whose second stop signal means more than its first (a trainer's: stop at once).
    """

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, echo: bool = False,
                 ready: "re.Pattern[str] | str | None" = None):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        full_env.update(env or {})
        full_env[PARENT_ENV] = str(os.getpid())  # dmoe programs stop when this process dies without stopping them
        self.args = list(args)
        self.echo = echo
        self.ready = re.compile(ready) if isinstance(ready, str) else ready
        # a child that inherits an ignored SIGINT (started from a thread other than the main one of a process that
        # ignores it) is stopped with SIGTERM, which every dmoe program takes as a stop; SIGINT left it to SIGKILL
        # after the stop timeout, its last checkpoint unwritten (review 96 D-low-2)
        self.stop_signal = signal.SIGINT if children_take_sigint() else signal.SIGTERM
        self.popen = self._start(self.args, full_env)
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.output: list[str] = []
        self._endpoint: str | None = None
        self.interrupted = False  # the stop signal sent (by interrupt())
        self._heard = True  # no stop signal to send again (see stop())
        self._reader = threading.Thread(target=self._read, name=f"reader-{self.popen.pid}", daemon=True)
        self._reader.start()

    def _start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        """``python *args`` in a session of its own, its stdout and stderr one pipe of text lines."""
        with sigint_default_in_children():
            return subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
            )

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.output.append(line)
            self.lines.put(line)
            if self.echo:
                sys.stderr.write(line)
        self.lines.put(None)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_for(self, pattern: "re.Pattern[str] | str" = LISTENING, timeout: float = 60.0) -> "re.Match[str]":
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
                self.lines.put(None)  # later waits see the end too
                raise RuntimeError(f"{self.args} exited ({self.popen.wait()}) before {regex.pattern!r}:\n"
                                   f"{''.join(self.output)}")
            match = regex.search(line)
            if match:
                return match

    def endpoint(self, timeout: float = 60.0) -> str:
        """The address the program announced; waits for the announcement the first time only (lines are read
        once, so a second wait would block until the timeout)."""
        if self._endpoint is None:
            self._endpoint = self.wait_for(LISTENING, timeout).group(1)
        return self._endpoint

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash to simulate, or the last resort of cleanup."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def interrupt(self) -> None:
        """The stop signal (SIGINT, like Ctrl-C, to the process group; see ``stop_signal``): asks for a clean shutdown
        without waiting for it."""
        if not self.interrupted:  # sent before the program said it was ready: it may not have been heard
            self._heard = self.ready is None or self._announced()
        self.interrupted = True
        self._send_stop_signal()

    def _send_stop_signal(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self.stop_signal == signal.SIGINT:
                    os.killpg(self.popen.pid, signal.SIGINT)
                else:  # (to the program only: the children of dmoe-server --processes are their parent's to stop)
                    os.kill(self.popen.pid, self.stop_signal)

    def _announced(self) -> bool:
        return self.ready is not None and any(self.ready.search(line) for line in self.output)

    def stop(self, timeout: float = 10.0) -> int:
        """The stop signal (a clean shutdown, like Ctrl-C), then SIGKILL if it does not exit in ``timeout`` seconds.

        Sent once to a program that had said it was ready (its ``ready`` line) when it was sent first (here or by
        :meth:`interrupt`): a second SIGINT could land after the program left its signal handling, as it writes its
        last checkpoint or exits, and kill it there (a demo's server exited with status -2). Sent every
        :data:`RESEND_PERIOD` s to one that had not, until it says it is ready, and once more then: Python can drop a
        SIGINT that lands during the program's imports (raised inside importlib's callback, "Exception ignored"),
        and the program then served until it was killed at the timeout (review 96 D-low-2)."""
        if self.popen.poll() is None:
            if not self.interrupted:
                self.interrupt()
            deadline = time.monotonic() + timeout
            while True:
                try:
                    self.popen.wait(max(0.0, min(RESEND_PERIOD, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        self.kill()
                        break
                    if not self._heard:
                        self._heard = self._announced()  # (then this one is its last)
                        self._send_stop_signal()
        return self.popen.wait()


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """Collects started processes and kills whatever is left of them on exit, even on errors."""
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.alive:
                proc.kill()


@contextlib.contextmanager
def running(*args: str, env: dict[str, str] | None = None) -> Iterator[Proc]:
    """Starts ``python *args`` and kills it on exit."""
    with processes() as procs:
        proc = Proc(args, env)
        procs.append(proc)
        yield proc


@dataclass
class SwarmConfig:
    """A local swarm: one DHT bootstrap node and ``n_servers`` expert servers sharing every layer's grid."""

    layers: Sequence[str] = ("ffn0", "ffn1")
    grid: Sequence[int] = (4, 4)
    n_servers: int = 2
    hidden_dim: int = 128
    expert_cls: str = "ffn"
    host: str = "127.0.0.1"
    threads_per_server: int = 1
    # extra dmoe-server flags (optimizer, lr, refresh period, ...); a relative path in them is taken from the
    # repository's root, where the servers run
    server_args: Sequence[str] = ()
    echo: bool = False                       # copy the programs' output to stderr
    env: dict[str, str] = field(default_factory=dict)
    # server i checkpoints its experts in CHECKPOINT_ROOT/server{i} (--checkpoint-dir), so a swarm started again with
    # the same root, grid and servers resumes them; None: no checkpoints. Relative: to this process's working
    # directory as the config is made (made absolute then)
    checkpoint_root: str | os.PathLike | None = None
    stop_timeout: float = 10.0               # seconds a stopping server may take (its last checkpoint) before SIGKILL

    def __post_init__(self) -> None:
        # the servers run in the repository's root: a relative root was written under the checkout, and
        # checkpoint_dir() named another place (review 96 D-low-6)
        if self.checkpoint_root is not None:
            self.checkpoint_root = Path(self.checkpoint_root).absolute()


def split_grid(layers: Sequence[str], grid: Sequence[int], n_servers: int) -> list[str]:
    """One ``--experts`` pattern per server: the first grid axis of every layer is cut into contiguous slices."""
    if not 1 <= n_servers <= grid[0]:
        raise ValueError(f"cannot split a first grid axis of {grid[0]} between {n_servers} servers")
    rest = "".join(f".[0:{g}]" for g in grid[1:])
    bounds = [round(i * grid[0] / n_servers) for i in range(n_servers + 1)]
    return [",".join(f"{layer}.[{lo}:{hi}]{rest}" for layer in layers) for lo, hi in zip(bounds, bounds[1:])]


class LocalSwarm:
    """Starts (and owns) a DHT node and expert servers as child processes on this machine."""

    def __init__(self, config: SwarmConfig | None = None):
        self.config = config or SwarmConfig()
        self.dht: Proc | None = None
        self.servers: list[Proc] = []
        self.server_endpoints: list[str] = []
        self.server_statuses: list[int] = []  # set by close()
        self.initial_peers = ""

    def start(self, timeout: float = 120.0) -> "LocalSwarm":
        cfg = self.config
        env = {"OMP_NUM_THREADS": str(cfg.threads_per_server), **cfg.env}
        try:
            self.dht = Proc(["-m", "dmoe.dht", "--host", cfg.host, "--port", "0"], env, cfg.echo, LISTENING)
            self.initial_peers = self.dht.endpoint(timeout)
            for pattern in split_grid(cfg.layers, cfg.grid, cfg.n_servers):
                self.servers.append(Proc(self.server_command(pattern), env, cfg.echo, LISTENING))
            self.server_endpoints = [server.endpoint(timeout) for server in self.servers]
        except BaseException:
            self.close()
            raise
        logger.info("local swarm: DHT %s, servers %s", self.initial_peers, self.server_endpoints)
        return self

    def wait_declared(self, timeout: float = 60.0) -> None:
        """Blocks until every expert of the swarm is found in its DHT, so a client's first steps do not run
        without the experts that are still being declared."""
        uids = [uid for layer in self.config.layers for uid in grid_uids(layer, self.config.grid)]
        with DHT(initial_peers=[self.initial_peers], client_mode=True) as dht:
            deadline = time.monotonic() + timeout
            while not all(get_experts(dht, uids)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the swarm's experts were not all declared in the DHT within {timeout} s")
                time.sleep(0.2)

    def server_command(self, pattern: str) -> list[str]:
        cfg = self.config
        command = ["-m", "dmoe.cli.server", "--experts", pattern, "--expert-cls", cfg.expert_cls,
                   "--hidden-dim", str(cfg.hidden_dim), "--host", cfg.host, "--port", "0",
                   "--initial-peers", self.initial_peers, *cfg.server_args]
        directory = self.checkpoint_dir(pattern)
        return command if directory is None else [*command, "--checkpoint-dir", str(directory)]

    def checkpoint_dir(self, pattern: str) -> Path | None:
        """Where the server of ``pattern`` checkpoints its experts; None without ``checkpoint_root``."""
        cfg = self.config
        if cfg.checkpoint_root is None:
            return None
        return Path(cfg.checkpoint_root) / f"server{split_grid(cfg.layers, cfg.grid, cfg.n_servers).index(pattern)}"

    def restart_server(self, index: int, timeout: float = 120.0) -> str:
        """Starts server ``index`` again (after a kill) with the same experts; returns its new endpoint."""
        old = self.servers[index]
        if old.alive:
            old.kill()
        pattern = old.args[old.args.index("--experts") + 1]
        env = {"OMP_NUM_THREADS": str(self.config.threads_per_server), **self.config.env}
        self.servers[index] = Proc(self.server_command(pattern), env, self.config.echo, LISTENING)
        self.server_endpoints[index] = self.servers[index].endpoint(timeout)
        return self.server_endpoints[index]

    def close(self) -> None:
        """Stops servers first (they announce nothing more and write their last checkpoints), then the DHT; SIGKILL
        for anything stuck. ``server_statuses`` then holds each server's exit status (0: stopped cleanly)."""
        for proc in self.servers:
            proc.interrupt()
        try:
            for proc in self.servers:
                proc.stop(self.config.stop_timeout)
        finally:  # a second Ctrl-C while they write their last checkpoints: the rest are killed, the DHT node stopped
            for proc in self.servers:
                if proc.alive:
                    proc.kill()
            self.server_statuses = [proc.popen.wait() for proc in self.servers]
            if self.dht is not None:
                self.dht.stop()

    def __enter__(self) -> "LocalSwarm":
        return self.start() if self.dht is None else self

    def __exit__(self, *exc) -> None:
        self.close()
