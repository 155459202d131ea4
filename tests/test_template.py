"""The test template (tests/template.py) starts a program as ``python`` would: the same output, exit status, argv,
``__name__``, environment and directory, threads joined and atexit run at the end, and signals delivered."""
from __future__ import annotations

import os
import signal
import subprocess
import textwrap

import pytest

from dmoe import launch
from tests.procs import Proc, processes
from tests.template import SWITCH, ForkedPopen

pytestmark = pytest.mark.skipif(os.environ.get(SWITCH) == "0", reason=f"{SWITCH}=0: programs start with python")

PROGRAM = textwrap.dedent("""
    import atexit, os, sys, threading, time
    print("argv", sys.argv[1:], "name", __name__, "path0", repr(sys.path[0]), "cwd", os.getcwd(), flush=True)
    print("env", os.environ.get("DMOE_TEMPLATE_PROBE"), "dmoe loaded", "dmoe.launch" in sys.modules, flush=True)
    atexit.register(lambda: print("atexit ran", flush=True))
    def late():
        time.sleep(0.3)
        sys.stdout.write("thread joined\\n")  # (one write: print's line and its end are two, between which another
        sys.stdout.flush()                   # thread's traceback line could land)
    thread = threading.Thread(target=late)
    thread.start()
    how = sys.argv[1]
    if how == "raise":
        raise ValueError("boom")
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "message":
        sys.exit("bye")
    if how == "wait":  # (the thread's line first: written while a traceback is, the two could share a line)
        thread.join()
        print("waiting", flush=True)
        time.sleep(60)
    sys.exit(int(how))
""")
ENV = {"OMP_NUM_THREADS": "1", "DMOE_TEMPLATE_PROBE": "probe"}


@pytest.mark.parametrize("how, send, status", [
    ("0", None, 0), ("3", None, 3), ("raise", None, 1), ("interrupt", None, -signal.SIGINT), ("message", None, 1),
    ("wait", signal.SIGINT, -signal.SIGINT), ("wait", signal.SIGTERM, -signal.SIGTERM),
    ("wait", signal.SIGKILL, -signal.SIGKILL)])
def test_a_forked_program_ends_as_the_same_program_started_with_python_does(how, send, status):
    results = []
    with processes() as procs:
        # the test suite's Proc forks it from the template; dmoe.launch's starts python
        for proc in (Proc(["-c", PROGRAM, how], ENV), launch.Proc(["-c", PROGRAM, how], ENV)):
            procs.append(proc)
            if send is not None:
                proc.wait_for("waiting", 60)
                proc.popen.send_signal(send)
            results.append((proc.popen.wait(60), proc.output))
            proc._reader.join(10)
        assert isinstance(procs[0].popen, ForkedPopen) and isinstance(procs[1].popen, subprocess.Popen)
    forked, started = results
    # the order of the traceback's lines and the thread's, and where a signal lands (its line), are chance
    results = [(code, sorted(line for line in lines if not line.startswith("  File "))) for code, lines in results]
    assert results[0] == results[1]
    assert forked[0] == status, forked
    lines = forked[1]
    assert lines[0] == f"argv ['{how}'] name __main__ path0 '' cwd {launch.ROOT}\n"
    assert lines[1] == "env probe dmoe loaded False\n"
    if send in (None, signal.SIGINT):  # (SIGINT: the traceback of a KeyboardInterrupt in the sleep, then exit)
        assert "thread joined\n" in lines and lines[-1] == "atexit ran\n", lines


def test_each_environment_has_a_template_of_its_own_and_interpreter_flags_start_python():
    """TQDM_DISABLE is read as tqdm loads, in the template (torch._dynamo imports tqdm): a program that sets it gets
    a template that loaded tqdm with it."""
    bar = ["-c", "from tqdm import tqdm; list(tqdm(range(3)))"]
    with processes() as procs:
        procs.append(plain := Proc(bar))
        procs.append(own := Proc(bar, env={"DMOE_TEMPLATE_PROBE": "other"}))  # dmoe's own: the same template
        procs.append(quiet := Proc(bar, env={"TQDM_DISABLE": "1"}))
        procs.append(flagged := Proc(["-u", *bar]))
        assert all(isinstance(proc.popen, ForkedPopen) for proc in (plain, own, quiet))
        assert isinstance(flagged.popen, subprocess.Popen)
        assert [proc.popen.wait(60) for proc in procs] == [0, 0, 0, 0]
        for proc in procs:
            proc._reader.join(10)
        assert all("3/3" in "".join(proc.output) for proc in (plain, own, flagged))
        assert quiet.output == []


def test_forked_programs_draw_their_own_seeds_as_programs_started_with_python_do():
    """torch seeds its generator afresh in every process, as random and numpy do: children of one template shared
    the template's seed (the same weights for every unseeded nn.Linear), and its multiprocessing authkey."""
    program = ["-c", "import multiprocessing, random, numpy, torch; print(torch.initial_seed(), random.random(), "
                     "numpy.random.random(), multiprocessing.current_process().authkey.hex())"]
    with processes() as procs:
        for _ in range(2):
            procs.append(Proc(program))
        assert [proc.popen.wait(60) for proc in procs] == [0, 0]
        for proc in procs:
            proc._reader.join(10)
    first, second = (proc.output[0].split() for proc in procs)
    assert all(a != b for a, b in zip(first, second)), (first, second)
