"""Starting the test suite's dmoe programs by forking a process that imported torch once, instead of a fresh ``python``.

A fresh interpreter spends about 2 s of CPU importing torch and as much again importing ``torch._dynamo``, which
torch's optimizers import the first time one is made: 4-5 s for every server and trainer a test starts, most of
the suite's CPU on a 2-core machine. One *template* process per test process imports those libraries and nothing of
dmoe, then forks a child for each program the tests start.

Each child is still a real program in a process of its own: its own pid, session, ports and output pipe; it imports
dmoe afresh and runs ``-m module``, a script or ``-c`` code as ``__main__``, and exits with the status ``python``
would give it (threads joined, ``atexit`` run, -2 after an uncaught KeyboardInterrupt, -N when killed by signal N).
What differs: its parent is the template, which reaps it and reports its status (and which ``PARENT_ENV`` names, so
a program still stops when the test process dies: the template exits with it); it shares the template's hash seed
(its random generators are seeded afresh). A program whose environment differs from the template's in any variable
but dmoe's and pytest's own (``DMOE_*``, ``PYTEST_*``) gets a template of its own (up to four per test process,
then python), as the preloaded libraries may have read any other as they loaded (``OMP_NUM_THREADS``,
``TQDM_DISABLE``, ...); one that passes interpreter flags is started with ``python`` as before, and
``DMOE_TEST_FORK=0`` turns the
template off. The programs' own entry points (``python -m dmoe.cli.server`` from a shell, the console scripts) are
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
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "numpy", "grpc", "google.protobuf.message",
           "cryptography.hazmat.primitives.asymmetric.ed25519")
MAX_MESSAGE = 1 << 20


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if not key.startswith(OWN_PREFIXES)}


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

    def __init__(self, env: dict[str, str]) -> None:
        self.changed = threading.Condition()
        self._lock = threading.Lock()  # one request (and its answer) at a time
        self._started: int | None = None  # pid of the answer to the request in flight
        self._children: dict[int, ForkedPopen] = {}
        self._exited: dict[int, int] = {}  # statuses that came before their start was answered
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._env = _startup_env(env)
        self._failed = False

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

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
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


def start(args: Sequence[str], env: dict[str, str], parent_env: str) -> ForkedPopen | None:
    """``python *args`` forked from this test process's template for ``env``; None where it must start with python
    (interpreter flags, the switch off, too many environments, no template)."""
    if os.environ.get(SWITCH, "1") == "0" or not hasattr(socket, "send_fds") or \
            not (len(args) >= 2 and args[0] in ("-m", "-c") or args and args[0].endswith(".py")):
        return None
    key = tuple(sorted(_startup_env(env).items()))
    with _templates_lock:
        if key not in _templates and len(_templates) < MAX_TEMPLATES:
            _templates[key] = Template(env)
        template = _templates.get(key)
    return template.start(args, env, parent_env) if template is not None else None


# ----------------------------------------------------------------------------------------------------- the template


def _run_as_main(args: list[str]) -> int:
    """What ``python *args`` does once started, and the status it exits with."""
    import runpy
    import types

    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    interrupted = False
    try:
        try:
            if args[0] == "-m":
                sys.argv = [args[1], *args[2:]]
                sys.path[0] = os.getcwd()
                runpy._run_module_as_main(args[1], alter_argv=True)  # what python -m runs
            elif args[0] == "-c":
                sys.argv = ["-c", *args[2:]]
                sys.path[0] = ""
                exec(compile(args[1], "<string>", "exec"), main.__dict__)
            else:
                sys.argv = list(args)
                sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
                main.__file__ = args[0]
                with open(args[0], "rb") as script:
                    exec(compile(script.read(), args[0], "exec"), main.__dict__)
            code = 0
        except SystemExit as exiting:
            code = _exit_code(exiting.code)
        except BaseException as error:  # noqa: BLE001 - reported as python reports it
            trace = error.__traceback__
            while trace is not None and trace.tb_frame.f_code.co_filename == __file__:  # the template's frames
                trace = trace.tb_next
            sys.excepthook(type(error), error.with_traceback(trace), trace)
            code, interrupted = 1, isinstance(error, KeyboardInterrupt)
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter joins threads at exit
        atexit._run_exitfuncs()
    except SystemExit as exiting:  # raised while threads were joined
        code = _exit_code(exiting.code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # python ends by SIGINT itself after an uncaught KeyboardInterrupt (status -2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: its own session and output, the environment and directory asked for, then the program."""
    import random

    code = 1
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
        import tempfile

        tempfile.tempdir = None
        random.seed()
        import numpy

        numpy.random.seed()
        code = _run_as_main(request["args"])
    except BaseException:  # noqa: BLE001 - whatever happens, this process must not return into the template's loop
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


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
