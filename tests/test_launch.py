"""dmoe.launch: programs started for a local swarm never outlive the process that started them."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import textwrap
import threading
import time

import pytest

from dmoe import launch
from dmoe.cli.signals import ORPHAN_CHECK_PERIOD
from dmoe.launch import LocalSwarm, SwarmConfig
from tests.procs import Proc, processes, running

# a launcher that starts a DHT node and an expert server, reports their pids, then waits to be killed
LAUNCHER = textwrap.dedent("""
    import time
    from dmoe.launch import Proc
    dht = Proc(["-m", "dmoe.dht", "--port", "0", "--log-level", "WARNING"])
    server = Proc(["-m", "dmoe.cli.server", "--experts", "orphan.[0:2]", "--expert-cls", "nop", "--hidden-dim", "4",
                   "--device", "cpu", "--torch-threads", "1", "--initial-peers", dht.endpoint()])
    server.endpoint(120)
    print("children", dht.popen.pid, server.popen.pid, flush=True)
    time.sleep(600)
""")


def exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (the children are not ours to wait for)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_dht_node_and_server_stop_when_their_launcher_is_killed():
    children: list[int] = []
    try:
        with running("-c", LAUNCHER) as launcher:
            children = [int(pid) for pid in launcher.wait_for(re.compile(r"children (\d+) (\d+)"), 180).groups()]
            assert not any(exited(pid) for pid in children)
            launcher.kill()  # SIGKILL: the launcher runs no cleanup at all
        deadline = time.monotonic() + 30 * ORPHAN_CHECK_PERIOD
        while not all(exited(pid) for pid in children):
            assert time.monotonic() < deadline, f"still running after their launcher died: {children}"
            time.sleep(0.1)
    finally:
        for pid in children:
            if not exited(pid):
                with contextlib.suppress(ProcessLookupError):  # it may exit between the check and the kill
                    os.kill(pid, signal.SIGKILL)


def test_a_second_ctrl_c_while_the_servers_stop_kills_them_and_still_stops_the_dht_node():
    """The demo waits up to a minute for its servers' last checkpoints; a Ctrl-C meanwhile left the DHT node (in a
    session of its own, out of the terminal's reach) running for good, and no server's status recorded."""
    swarm = LocalSwarm(SwarmConfig(stop_timeout=60.0))
    swarm.dht = Proc(["-c", "import time; print('up', flush=True); time.sleep(60)"])
    # a server still writing its last checkpoint: deaf to the first SIGINT
    swarm.servers = [Proc(["-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                           "print('up', flush=True); time.sleep(60)"])]
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))  # the user's second Ctrl-C
    try:
        for proc in (swarm.dht, *swarm.servers):
            proc.wait_for("up")
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            swarm.close()
        assert not swarm.dht.alive and not swarm.servers[0].alive
        assert swarm.server_statuses == [-signal.SIGKILL]
    finally:
        timer.cancel()
        for proc in (swarm.dht, *swarm.servers):
            proc.kill()


def test_a_launcher_that_ignores_ctrl_c_starts_programs_that_a_sigint_still_stops():
    """Proc stops programs with SIGINT, and dmoe's programs leave an ignored SIGINT ignored (the children of
    dmoe-server --processes are started so): a launcher started in a script's background, which ignores SIGINT,
    passed that on to them, and its swarm's servers were killed after their stop timeout instead of stopping."""
    launcher = textwrap.dedent("""
        import signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from dmoe.launch import Proc
        child = Proc(["-c", "import signal; print('child ignores', signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"])
        print(child.wait_for("child ignores .*").group(0), flush=True)
        print("launcher ignores", signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)
    """)
    with running("-c", launcher) as proc:
        proc.wait_for("launcher ignores", timeout=60)
        assert proc.popen.wait(30) == 0
    assert "child ignores False\n" in proc.output and "launcher ignores True\n" in proc.output, proc.output


# a program that drops its first two SIGINTs, as Python drops one that lands during its imports, and then says it is
# ready and stops on the next
DROPS_TWO_SIGINTS = textwrap.dedent("""
    import signal, sys, time
    dropped = []
    signal.signal(signal.SIGINT, lambda signum, frame: dropped.append(signum))
    print("starting", flush=True)
    while len(dropped) < 2:
        time.sleep(0.01)
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(0))
    print("dmoe-test listening on 127.0.0.1:1", flush=True)
    time.sleep(60)
""")
# a program that is ready at once and takes 2 s to stop (its last checkpoint); its status: the SIGINTs it got
COUNTS_SIGINTS = textwrap.dedent("""
    import signal, sys, time
    got = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    print("dmoe-test listening on 127.0.0.1:1", flush=True)
    while not got:
        time.sleep(0.01)
    time.sleep(2)
    sys.exit(len(got))
""")


def test_a_stop_signal_lost_while_a_program_starts_is_sent_again_until_it_is_ready_and_once_then():
    """Review 96 D-low-2: Python can drop a SIGINT during a program's imports; Proc.stop never sent another, and a
    swarm closed as it started (a Ctrl-C, a server that failed) waited out the stop timeout, then SIGKILLed a server
    that had gone on to serve."""
    with processes() as procs:
        procs.append(proc := launch.Proc(["-c", DROPS_TWO_SIGINTS], ready=launch.LISTENING))
        proc.wait_for("starting")
        started = time.monotonic()
        assert proc.stop(timeout=20) == 0, proc.output
        assert time.monotonic() - started < 10
        # one that said it was ready gets one: a second could land as it writes its last checkpoint
        procs.append(proc := launch.Proc(["-c", COUNTS_SIGINTS], ready=launch.LISTENING))
        proc.wait_for(launch.LISTENING)
        assert proc.stop(timeout=20) == 1


def test_a_launcher_thread_that_cannot_give_its_children_sigint_back_stops_them_with_sigterm():
    """Review 96 D-low-2: a launcher thread other than the main one, in a process that ignores SIGINT, starts
    children that ignore it too (only the main thread can set a handler meanwhile): Proc.stop's SIGINT went unheard,
    and they were SIGKILLed after the stop timeout, their last checkpoints unwritten."""
    launcher = textwrap.dedent("""
        import signal, threading, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from dmoe.launch import Proc
        def run():
            child = Proc(["-c", "import signal, sys, time; "
                          "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
                          "print('child ignores', signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True); "
                          "time.sleep(60)"])
            print(child.wait_for("child ignores .*").group(0), flush=True)
            started = time.monotonic()
            print("stopped with", child.stop(timeout=20), "in", round(time.monotonic() - started), "s", flush=True)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    """)
    with running("-c", launcher) as proc:
        proc.wait_for("stopped with", timeout=60)
        assert proc.popen.wait(30) == 0
    assert "child ignores True\n" in proc.output and "stopped with 0 in 0 s\n" in proc.output, proc.output


def test_a_relative_checkpoint_root_is_taken_from_the_callers_directory_not_the_repositorys(tmp_path, monkeypatch):
    """Review 96 D-low-6: the servers run in the repository's root, and wrote a relative root under the checkout,
    while checkpoint_dir() named the caller's."""
    monkeypatch.chdir(tmp_path)
    swarm = LocalSwarm(SwarmConfig(n_servers=2, checkpoint_root="ckpt"))
    monkeypatch.chdir(launch.ROOT)  # (taken when the config was made)
    pattern = launch.split_grid(swarm.config.layers, swarm.config.grid, 2)[1]
    expected = tmp_path.resolve() / "ckpt" / "server1"
    assert swarm.checkpoint_dir(pattern) == expected
    command = swarm.server_command(pattern)
    assert command[command.index("--checkpoint-dir") + 1] == str(expected)
