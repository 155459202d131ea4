"""Starting the test suite's dmoe programs by forking a process that imported torch once, instead of a fresh ``python``.

A fresh interpreter spends about 2 s of CPU importing torch and as much again importing ``torch._dynamo``, which
torch's optimizers import the first time one is made: 4-5 s for every server and trainer a test starts, most of
the suite's CPU on a 2-core machine. One *template* process per test process imports those libraries and nothing of
dmoe, then forks a child for each program the tests start.

Each child is still a real program in a process of its own: its own pid, session, ports and output pipe; it imports
dmoe afresh and runs ``-m module``, a script or ``-c`` code as ``__main__``, and exits with the status ``python``
would give it (threads joined, ``atexit`` run, -2 after an uncaught KeyboardInterrupt, -N when killed by signal N).
What differs: after its threads are joined and its atexit callbacks run, it leaves without the interpreter's
final clean-up (objects still alive finalised, files left open flushed: a second of CPU per program with torch's
module graph; the demo's, benchmarks' and launchers' programs, started with python, still go through it); its
parent is the template, which reaps it and reports its status (and which ``PARENT_ENV`` names, so
a program still stops when the test process dies: the template exits with it); it shares the template's hash seed
(its random generators, torch's too, and its multiprocessing authkey are drawn afresh; it inherits the
template's atexit callbacks, loggers and warning filters: those of the libraries it preloaded). A program whose
environment differs from the template's in any variable but dmoe's and pytest's own (``DMOE_*``, ``PYTEST_*``)
gets a template of its own (up to four per test process, then python), as the preloaded libraries may have read any
other as they loaded (``OMP_NUM_THREADS``, ``TQDM_DISABLE``, ...); one that passes interpreter flags, a script that
does not exist, or a DHT node (no torch: :data:`WITHOUT_TORCH`) is started with ``python`` as before, and
``DMOE_TEST_FORK=0`` turns the
template off. A program forked from the template may fork itself into a template of its own (:func:`fork_here`), as
the benchmarks under test do (tests/benchmark_runs.py). The programs' own entry points (``python -m dmoe.cli.server`` from a shell, the console scripts) are
still exercised by the tests that start them through ``subprocess`` or :mod:`dmoe.launch` (the demo, benchmarks,
launchers).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
SWITCH = "DMOE_TEST_FORK"  # "0": start every program with python
# a program's environment may differ from the template's in dmoe's and pytest's variables only (pytest names the test
# that runs), which the preloaded libraries do not read: any other could have been read as they loaded (TQDM_DISABLE
# by tqdm, which torch._dynamo imports)
OWN_PREFIXES = ("DMOE_", "PYTEST_")
# what torch writes into os.environ (its default) as it imports torch._dynamo, which the first optimizer does: programs
# started before and after that would otherwise differ in it and need a template each (seconds of CPU)
SET_BY_TORCH = ("TORCHINDUCTOR_CACHE_DIR",)
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "numpy", "grpc", "google.protobuf.message",
           "cryptography.hazmat.primitives.asymmetric.ed25519")
MAX_MESSAGE = 1 << 20
# programs that import no torch start with python: they start in a fraction of a second anyway, and forked from the
# template they would hold torch loaded (whose clean-up at exit, before the template skipped it, made a DHT node's
# stop take 1.2 s instead of 0.06)
WITHOUT_TORCH = ("dmoe.dht", "dmoe.cli.dht", "dmoe.directory")


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items()
            if not key.startswith(OWN_PREFIXES) and key not in SET_BY_TORCH}


class ForkedPopen:
    """The parts of :class:`subprocess.Popen` that :class:`dmoe.launch.Proc` and the tests use, for a child of the
    template (whose exit status the template sends here, as only a parent can wait for a child)."""

    def __init__(self, args: Sequence[str], pid: int, stdout, template: "Template"):
        self.args, self.pid, self.stdout, self.stdin, self.stderr = list(args), pid, stdout, None, None
        self.returncode: int | None = None
        self._template = template

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._template.changed:
            if not self._template.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Template:
    """A template process of this test process for programs of one environment (but dmoe's variables), and the
    children it forked; started on first use, stopped at exit. ``start`` answers None where a program must start
    with python instead."""

    def __init__(self, env: dict[str, str], forked: socket.socket | None = None) -> None:
        """``forked``: this process's end of the socket of a template it forked of itself (:func:`fork_here`)."""
        self.changed = threading.Condition()
        self._lock = threading.Lock()  # one request (and its answer) at a time
        self._started: int | None = None  # pid of the answer to the request in flight
        self._children: dict[int, ForkedPopen] = {}
        self._exited: dict[int, int] = {}  # statuses that came before their start was answered
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._env = _startup_env(env)
        self._failed = False
        self._forked = forked

    def start(self, args: Sequence[str], env: dict[str, str], parent_env: str) -> ForkedPopen | None:
        with self._lock:
            if self._failed or (self._socket is None and not self._launch()):
                return None
            read, write = os.pipe()
            try:
                with open(os.devnull, "rb") as devnull:
                    request = json.dumps({"args": list(args), "env": env, "cwd": str(ROOT), "parent_env": parent_env})
                    with self.changed:
                        self._started = None
                    try:
                        socket.send_fds(self._socket, [request.encode()], [devnull.fileno(), write])
                    except OSError:  # the template is gone (its reader saw it too): python from now on
                        self._failed = True
                        return None
                with self.changed:
                    if not self.changed.wait_for(lambda: self._started is not None or self._socket is None, 60):
                        raise RuntimeError("the test template did not answer in 60 s")
                    if self._socket is None:
                        raise RuntimeError("the test template exited")
                    pid = self._started
                    child = ForkedPopen(args, pid, open(read, "r"), self)  # text as Popen(text=True) reads it
                    read = -1
                    self._children[pid] = child
                    if pid in self._exited:
                        child.returncode = self._exited.pop(pid)
                    return child
            finally:
                os.close(write)
                if read >= 0:
                    os.close(read)

    def _launch(self) -> bool:
        """Starts the template process; False (and python from then on) if it fails."""
        from dmoe.launch import sigint_default_in_children

        if self._forked is not None:  # (it exits with this process, which holds the other end of its socket)
            ours = self._forked
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if self._forked is None:
                with sigint_default_in_children():
                    self._process = subprocess.Popen(
                        [sys.executable, "-m", "tests.template", str(theirs.fileno())], cwd=ROOT, env=self._env,
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        pass_fds=[theirs.fileno()], start_new_session=True)
                theirs.close()
            ours.settimeout(120)
            ready = json.loads(ours.recv(MAX_MESSAGE) or b"{}")
            ours.settimeout(None)
            if ready.get("threads") != 1:  # a fork of a process of several threads inherits one of them only
                raise RuntimeError(f"the template has {ready.get('threads')} threads")
        except (OSError, ValueError, RuntimeError) as error:
            sys.stderr.write(f"tests/template.py: starting programs with python ({error})\n")
            ours.close()
            self._failed = True
            self.close()
            return False
        self._socket = ours
        threading.Thread(target=self._read, args=(ours,), name="template-reader", daemon=True).start()
        atexit.register(self.close)
        return True

    def _read(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self.changed:
                if not data:  # the template is gone: its children cannot be waited for any more
                    self._socket = None
                    self._failed = True
                    for child in self._children.values():
                        if child.returncode is None:
                            child.returncode = -signal.SIGKILL
                    self.changed.notify_all()
                    return
                message = json.loads(data)
                if "started" in message:
                    self._started = message["started"]
                else:
                    pid, status = message["exited"], message["status"]
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._exited[pid] = status
                    else:
                        child.returncode = status
                self.changed.notify_all()

    def close(self) -> None:
        """Stops the template; the children it forked were the tests' to stop (they stop once it is gone)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


MAX_TEMPLATES = 4  # environments with a template of their own in one test process; others start with python
_templates: dict[tuple[tuple[str, str], ...], Template] = {}
_templates_lock = threading.Lock()


def fork_here() -> None:
    """Forks this process into the template of the programs it starts in its own environment, instead of starting one
    with python: for a program forked from a test's template (a benchmark under test), which has loaded what a
    template loads, so that its own is ready at once. Call it while this process has one thread (a fork of a process
    with more holds the locks its other threads held, forever); it does nothing otherwise, nor with the switch off."""
    if os.environ.get(SWITCH, "1") == "0" or not os.path.isdir("/proc/self/task") \
            or len(os.listdir("/proc/self/task")) != 1:
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:  # the template: a session of its own, none of this process's output
        forked = os.getpid()
        try:
            ours.close()
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            serve(theirs.fileno())
        except BaseException:
            if os.getpid() != forked:  # the end of a program it forked (SystemExit, ...): the interpreter's to
                raise                  # handle, as in any template
            os._exit(1)
        os._exit(0)
    theirs.close()
    env = dict(os.environ)
    with _templates_lock:
        _templates[tuple(sorted(_startup_env(env).items()))] = Template(env, forked=ours)


def _forkable(args: Sequence[str]) -> bool:
    """``-m`` a module that imports torch, ``-c`` code, or a script that exists: no interpreter flags."""
    if args[:1] == ["-m"]:
        return len(args) >= 2 and args[1] not in WITHOUT_TORCH
    if args[:1] == ["-c"]:
        return len(args) >= 2
    return bool(args) and args[0].endswith(".py") and (ROOT / args[0]).is_file()


def start(args: Sequence[str], env: dict[str, str], parent_env: str) -> ForkedPopen | None:
    """``python *args`` forked from this test process's template for ``env``; None where it must start with python
    (interpreter flags, a program without torch, the switch off, too many environments, no template)."""
    if os.environ.get(SWITCH, "1") == "0" or not hasattr(socket, "send_fds") or not _forkable(args):
        return None
    key = tuple(sorted(_startup_env(env).items()))
    with _templates_lock:
        if key not in _templates and len(_templates) < MAX_TEMPLATES:
            _templates[key] = Template(env)
        template = _templates.get(key)
    return template.start(args, env, parent_env) if template is not None else None


# ----------------------------------------------------------------------------------------------------- the template


def _run_as_main(args: list[str]) -> None:
    """What ``python *args`` runs once started. What the program raises (SystemExit, an error, KeyboardInterrupt) is
    left to the interpreter, which ends the process as it ends ``python``'s: the status, the traceback, threads
    joined, atexit run, -2 after an uncaught KeyboardInterrupt (see :func:`_child` for what it skips)."""
    import importlib.machinery
    import runpy
    import types

    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(args[1], alter_argv=True)  # what python -m runs
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        path = os.path.join(os.getcwd(), args[0])  # (python gives a script's __main__ this path: absolute)
        main.__file__, main.__cached__ = path, None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.realpath(path))
        with open(path, "rb") as script:
            source = script.read()
        exec(compile(source, path, "exec"), main.__dict__)


def _without_template_frames(hook):
    """``hook`` shown a traceback that starts where the program does, as ``python``'s would (the template's own
    frames, and the runpy frames that started the template, cut)."""
    def excepthook(kind, error, trace):
        start, frame = trace, trace
        while frame is not None:
            if frame.tb_frame.f_code.co_filename == __file__:
                start = frame.tb_next
            frame = frame.tb_next
        hook(kind, error.with_traceback(start), start)
    return excepthook


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: its own session and output, the environment and directory asked for, fresh random
    seeds, then the program, whose end (a return, or anything it raises) goes to the interpreter as ``python``'s
    would, until :func:`leave` ends the process: never back into the template's loop."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as python sets it where SIGINT is not ignored
        stdin, output = fds
        os.dup2(stdin, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(stdin)
        os.close(output)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[request["parent_env"]] = str(os.getppid())  # the template: it exits when the test process does
        os.environ[SWITCH] = "0"  # what it starts for itself is its own child, as a launcher's are
        import multiprocessing
        import random
        import tempfile

        import numpy
        import torch

        tempfile.tempdir = None
        random.seed()
        numpy.random.seed()
        torch.seed()
        multiprocessing.current_process().authkey = os.urandom(32)  # (a fresh process draws its own)
        sys.excepthook = _without_template_frames(sys.excepthook)
    except BaseException:  # noqa: BLE001 - a failure here is the template's: reported, and never back into its loop
        import traceback

        traceback.print_exc()
        os._exit(1)
    status: list[int | None] = [0]  # the status python would exit with (None: by SIGINT, as after an uncaught ^C)

    def leave() -> None:
        """Registered first, so run last: the interpreter has joined the threads and run the program's atexit
        callbacks (and handled a SIGINT meanwhile as python does); what is left is its clean-up of torch's module
        graph, a second of CPU per program that python-started ones pay too but which changes nothing outside."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if status[0] is None:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(status[0])

    atexit.register(leave)
    try:
        _run_as_main(request["args"])
    except SystemExit as exiting:  # the interpreter prints a message that is not a number
        code = exiting.code
        status[0] = 0 if code is None else code if isinstance(code, int) else 1
        raise
    except KeyboardInterrupt:
        status[0] = None
        raise
    except BaseException:
        status[0] = 1
        raise
    raise SystemExit(0)  # the program returned: the interpreter ends this process with status 0


def serve(fd: int) -> None:
    """The template: preloads, then forks a child per request and reports each child's exit status, until the test
    process closes its end of the socket."""
    import importlib

    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        importlib.import_module(name)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_write)
    sock.send(json.dumps({"threads": len(os.listdir("/proc/self/task"))}).encode())
    while True:
        ready, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in ready:
            while True:
                try:
                    os.read(wake_read, 4096)
                except BlockingIOError:
                    break
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                sock.send(json.dumps({"exited": pid, "status": os.waitstatus_to_exitcode(status)}).encode())
        if sock in ready:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            if not data:
                return
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                os.close(wake_read)
                os.close(wake_write)
                _child(request, fds)
            for received in fds:
                os.close(received)
            sock.send(json.dumps({"started": pid}).encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
