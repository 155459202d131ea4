"""``dmoe-server --processes N``: a server's experts dealt out among N real server processes, owned by one parent."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from dmoe import launch
from dmoe.cli import server as server_program
from dmoe.cli.server_processes import (announcement, check_port_ranges, child_args, deal_cells,
                                        terminal_signals_ignored)
from dmoe.cli.signals import StopSignals
from dmoe.client.remote_expert import backward_future, forward_future
from dmoe.dht import DHT
from dmoe.directory import get_experts
from dmoe.experts import create_expert, expert_seed
from dmoe.server.checkpoints import FILENAME as CHECKPOINT_FILENAME
from dmoe.server.checkpoints import FORMAT as CHECKPOINT_FORMAT
from dmoe.server.checkpoints import Checkpoints
from dmoe.uid import expand_pattern
from tests.procs import Proc, children_by_parent, processes

HIDDEN = 8


def server_args(*flags: str) -> list[str]:
    return ["-m", "dmoe.cli.server", "--hidden-dim", str(HIDDEN), "--log-level", "WARNING", *flags]


def announced(proc: Proc, kind: str) -> list[str]:
    """The endpoints of the program's one ``kind`` line, checked against the exact line's format."""
    (line,) = [line for line in proc.output if f" {kind} " in line]
    endpoints = launch.announced([line], kind)
    more = f" (and {len(endpoints) - 1} more process{'es' if len(endpoints) > 2 else ''}: {' '.join(endpoints[1:])})"
    assert line == f"dmoe-server {kind} {endpoints[0]}{more if len(endpoints) > 1 else ''}\n"
    return endpoints


def server_children(pid: int) -> list[int]:
    """The server processes a parent started (not multiprocessing's resource tracker), from /proc."""
    found = []
    for child in children_by_parent().get(pid, ()):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in command:
            found.append(child)
    return sorted(found)


def wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() and "Z" != state(pid) for pid in pids):
        assert time.monotonic() < deadline, f"server processes {pids} still run"
        time.sleep(0.1)


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_experts_are_dealt_out_among_the_processes_and_a_dead_one_is_started_again_while_the_others_serve(tmp_path):
    uids = expand_pattern("ffn.[0:2].[0:2]")
    replica_flags = ("--replica-interval", "0.5", "--refresh-period", "0.5")
    with processes() as procs:
        # another machine's 2-process server first, so that this one's first replica pushes know both its hosts;
        # bound to every interface, as volunteers' are (its processes join its node at that node's loopback form)
        procs.append(elsewhere := Proc(server_args("--experts", "ffn.9.[0:2]", "--processes", "2", "--replica-dir",
                                                   str(tmp_path / "elsewhere"), "--host", "0.0.0.0",
                                                   *replica_flags)))
        elsewhere.endpoint(timeout=120)
        peer = re.search(r"DHT node at (\S+)", "".join(elsewhere.output)).group(1)
        procs.append(proc := Proc(server_args("--experts", "ffn.[0:2].[0:2]", "--processes", "2",
                                              "--metrics-port", "0", "--replica-dir", str(tmp_path / "here"),
                                              "--initial-peers", peer, "--process-restarts", "1",
                                              *replica_flags)))
        endpoint = proc.endpoint(timeout=120)
        endpoints = announced(proc, "listening on")
        assert endpoints[0] == endpoint and len(set(endpoints)) == 2
        assert len(announced(proc, "metrics on")) == 2
        dht_node = re.search(r"DHT node at (\S+)", "".join(proc.output)).group(1)  # printed before the rest
        with DHT(initial_peers=[dht_node], client_mode=True) as dht:
            deadline = time.monotonic() + 30
            while not all(found := get_experts(dht, uids)):
                assert time.monotonic() < deadline, f"not all declared: {dict(zip(uids, found))}"
                time.sleep(0.1)
        assert [found.count(e) for e in endpoints] == [2, 2] and found[0::2] == [endpoints[0]] * 2  # every second
        x, grad = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
        for uid, at in zip(uids, found):  # each answers where the DHT says, as the expert the seed makes
            expected = create_expert("ffn", HIDDEN, seed=expert_seed(0, uid))(x).detach()
            torch.testing.assert_close(forward_future(at, uid, [x]).result(30)[0], expected)
            assert backward_future(at, uid, [x], [grad]).result(30)[0].shape == x.shape

        # replicas leave the machine, one per machine: the other server's 2 processes are this one's only other
        # hosts, and each expert's replica goes to one of them (R=2 would put one on each, or one on a sibling here,
        # if hosts were told apart by key); the other server's replicas come here (to either process: this one
        # joined after its first pushes), and no process holds a sibling's
        def held(where: str) -> list[str]:
            return sorted(path.stem for path in (tmp_path / where).glob("process-*/*.replica"))

        deadline = time.monotonic() + 60
        while set(held("elsewhere")) != set(uids) or set(held("here")) != {"ffn.9.0", "ffn.9.1"}:
            assert time.monotonic() < deadline, (held("elsewhere"), held("here"))
            time.sleep(0.2)
        time.sleep(1.5)  # three more push rounds: a second replica on one machine would have come by now
        assert held("elsewhere") == uids, held("elsewhere")
        children = server_children(proc.popen.pid)
        assert len(children) == 2
        trained = {uid: forward_future(at, uid, [x]).result(30)[0] for uid, at in zip(uids[1::2], found[1::2])}
        # a crash of one (the OOM killer, say): it is started again with its experts while the other serves on
        os.kill(children[1], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not any("serves again" in line for line in proc.output):
            assert proc.popen.poll() is None and time.monotonic() < deadline, proc.output[-5:]
            time.sleep(0.1)
        again = server_children(proc.popen.pid)
        assert len(again) == 2 and again[0] == children[0] and children[1] not in again
        assert forward_future(found[0], uids[0], [x]).result(30)[0].shape == x.shape  # the other's, meanwhile
        with DHT(initial_peers=[dht_node], client_mode=True) as dht:
            deadline = time.monotonic() + 60
            while (now := get_experts(dht, uids[1::2])) == found[1::2] or None in now:  # declared at the new port
                assert time.monotonic() < deadline, now
                time.sleep(0.1)
        for uid, at in zip(uids[1::2], now):  # as trained: restored from their replicas on the other server
            torch.testing.assert_close(forward_future(at, uid, [x]).result(30)[0], trained[uid])
        # beyond --process-restarts (1) in 10 minutes, the next death stops the whole server, for a supervisor
        os.kill(again[1], signal.SIGKILL)
        assert proc.popen.wait(60) == 1
        wait_gone(again)
        assert any("after 1 restarts" in line and "stopping the others" in line for line in proc.output)


def test_a_restart_resumes_each_process_from_its_checkpoint_and_another_count_is_refused(tmp_path, capsys):
    """Stopped by Ctrl-C, which is the parent's to handle (review 49: the children took SIGINT, which reaches the
    whole process group, for their own, and each stopped by itself as the parent stopped it): the parent stops them
    with SIGTERM, and each writes its last checkpoint; started again with them, each resumes its experts. (Ctrl-C
    while the children start: the test below.)"""
    flags = ("--experts", "ck.[0:4]", "--checkpoint-dir", str(tmp_path), "--optimizer", "sgd", "--lr", "0.1")
    x, grad = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    with processes() as procs:
        procs.append(proc := Proc(server_args(*flags, "--processes", "2", "--log-level", "INFO")))
        proc.endpoint(timeout=120)
        first, second = announced(proc, "listening on")
        for uid, at in (("ck.0", first), ("ck.1", second)):  # a trained step on an expert of each process
            backward_future(at, uid, [x], [grad]).result(30)
        children = server_children(proc.popen.pid)
        proc.interrupt()  # Ctrl-C, as the terminal sends it: to the whole group
        assert proc.popen.wait(60) == 0  # each child wrote its last checkpoint
        wait_gone(children)
        proc._reader.join(timeout=10)
        output = "".join(proc.output)
        assert output.count("SIGINT received") == 1, output  # the parent's; it stopped the children with SIGTERM
        assert "SIGINT received, stopping 2 server processes" in output and \
            output.count("SIGTERM received, shutting down") == 2, output
    saved = {index: Checkpoints(tmp_path / f"process-{index}", {}).read() for index in (0, 1)}
    assert sorted(saved[0]["experts"]) == ["ck.0", "ck.2"] and sorted(saved[1]["experts"]) == ["ck.1", "ck.3"]

    for count in ("1", "3"):  # another process count would deal the experts out otherwise: refused, in this process
        with pytest.raises(SystemExit) as exit_info:
            server_program.main(["--hidden-dim", str(HIDDEN), *flags, "--processes", count])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert "--checkpoint-dir" in error and "start it with --processes 2" in error, error
    assert sorted(path.name for path in tmp_path.iterdir()) == [".lock", "process-0", "process-1", "processes.json"]

    with processes() as procs:
        procs.append(proc := Proc(server_args(*flags, "--processes", "2")))
        proc.endpoint(timeout=120)
        first, second = announced(proc, "listening on")
        for uid, at in (("ck.0", first), ("ck.1", second), ("ck.2", first)):  # trained ones resumed, not reset
            module = create_expert("ffn", HIDDEN, seed=expert_seed(0, uid))
            state = saved[0 if at == first else 1]["experts"][uid]["state"]["module"]
            module.load_state_dict(state)
            fresh = create_expert("ffn", HIDDEN, seed=expert_seed(0, uid))(x).detach()
            answer = forward_future(at, uid, [x]).result(30)[0]
            torch.testing.assert_close(answer, module(x).detach())
            assert (uid == "ck.2") == torch.equal(answer, fresh)
        children = server_children(proc.popen.pid)
        proc.popen.kill()  # the parent dies without stopping them: its children stop on their own
        wait_gone(children)


@pytest.mark.parametrize("flags", [
    ["--experts", "ffn.[0:2]", "--processes", "3"],
    ["--experts", "ffn.0", "--processes", "0"],
    ["--num-experts", "2", "--grid", "4", "--layer", "ffn", "--processes", "3"],
])
def test_more_processes_than_experts_are_refused_naming_the_flag(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        server_program.main(flags)
    assert exit_info.value.code == 2
    assert "--processes" in capsys.readouterr().err


@pytest.mark.parametrize("metrics_offset", [1, -2, 0])
def test_overlapping_port_and_metrics_port_ranges_are_refused_naming_both_flags(metrics_offset, capsys):
    """Review 96 D-low-1: process 0's metrics endpoint took process 1's gRPC port, which died ~20 s later blaming
    "another process"."""
    port = 40000
    with pytest.raises(SystemExit) as exit_info:
        server_program.main(["--experts", "ffn.[0:3]", "--processes", "3", "--port", str(port), "--metrics-port",
                             str(port + metrics_offset)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("dmoe-server: error: argument --metrics-port: ") and "--port and --metrics-port must be " \
        f"at least --processes (3) apart, got {port} and {port + metrics_offset}" in error, error
    args = server_program.build_parser().parse_args(["--experts", "ffn.[0:3]", "--processes", "3", "--port",
                                                     str(port), "--metrics-port", str(port + 3)])
    check_port_ranges(args, server_program.build_parser())  # (no overlap: nothing said)


def test_a_checkpoint_of_one_process_is_not_dealt_out_among_several(tmp_path, capsys):
    (tmp_path / "experts.pt").write_bytes(b"")  # only its presence counts: the check comes before any read
    with pytest.raises(SystemExit) as exit_info:
        server_program.main(["--experts", "ffn.[0:4]", "--checkpoint-dir", str(tmp_path), "--processes", "2"])
    assert exit_info.value.code == 2
    assert "server of 1 process: start it with no --processes" in capsys.readouterr().err
    assert not (tmp_path / "processes.json").exists()


@pytest.mark.parametrize("processes, per_layer, kept", [
    (2, 1, {0: ["ffn0.0.0"]}),  # the restart's fresh cell was ffn0's: ffn1 had no expert at all
    (2, 1, {1: ["ffn1.3.3"]}),
    (3, 2, {0: ["ffn0.0.0", "ffn1.0.0"]}),  # child 1's share is of ffn0, child 2's of ffn1
    (3, 2, {1: ["ffn0.1.1"]}),
])
def test_a_restart_where_some_processes_lost_their_checkpoints_keeps_num_experts_in_every_layer(
        tmp_path, processes, per_layer, kept):
    """Review 99 D1: --num-experts is a count per layer, and a process without a checkpoint (it died before its
    first, or its directory was lost) took its fresh cells from the first layer alone."""
    for index, uids in kept.items():
        (tmp_path / f"process-{index}").mkdir()
        torch.save({"format": CHECKPOINT_FORMAT, "experts": {uid: {} for uid in uids}},
                   tmp_path / f"process-{index}" / CHECKPOINT_FILENAME)
    parser = server_program.build_parser()
    args = parser.parse_args(["--num-experts", str(per_layer), "--layer", "ffn0", "ffn1", "--grid", "4", "4",
                              "--processes", str(processes), "--checkpoint-dir", str(tmp_path)])
    with DHT() as dht:  # an empty directory: this server's processes are all down, restarting
        dealt = deal_cells(args, parser, dht)
    total = 2 * per_layer
    assert [len(uids) for uids in dealt] == [len(range(index, total, processes)) for index in range(processes)]
    assert all(dealt[index] == uids for index, uids in kept.items())
    cells = [uid for uids in dealt for uid in uids]
    assert len(set(cells)) == total
    assert sorted(uid.split(".")[0] for uid in cells) == ["ffn0"] * per_layer + ["ffn1"] * per_layer, dealt


def test_the_program_line_names_every_process_once():
    lines = [["dmoe-server DHT node at 127.0.0.1:1 (others ...)", f"dmoe-server listening on 127.0.0.1:{port}"]
             for port in (5000, 5001, 5002)]
    assert announcement(lines, "listening on") == \
        "dmoe-server listening on 127.0.0.1:5000 (and 2 more processes: 127.0.0.1:5001 127.0.0.1:5002)"
    assert announcement(lines[:2], "listening on") == \
        "dmoe-server listening on 127.0.0.1:5000 (and 1 more process: 127.0.0.1:5001)"
    assert announcement(lines[:1], "listening on") == "dmoe-server listening on 127.0.0.1:5000"
    assert announcement(lines, "metrics on") is None
    assert launch.announced([announcement(lines, "listening on")]) == [f"127.0.0.1:{p}" for p in (5000, 5001, 5002)]


def test_the_servers_threads_and_memory_budgets_are_shared_out_among_its_processes(monkeypatch, tmp_path):
    flags = ["--experts", "ffn.[0:4]", "--processes", "3", "--device", "cpu", "--activation-cache-mb", "600",
             "--torch-threads", "7"]
    args = server_program.build_parser().parse_args([*flags, "--replica-dir", str(tmp_path), "--replica-budget-mb",
                                                     "300"])
    children = [child_args(args, index, "127.0.0.1:1") for index in range(3)]
    assert [child.activation_cache_mb for child in children] == [200, 200, 200]  # one device: its budget in 3
    assert [child.replica_budget_mb for child in children] == [100, 100, 100]  # one disk
    assert [child.torch_threads for child in children] == [2, 2, 2]  # the threads asked for, in all
    assert [child.processes for child in children] == [1, 1, 1] and args.activation_cache_mb == 600

    # a machine with two GPUs (simulated: this one may have none): processes 0 and 2 share cuda:0's budget
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args.device = "cuda"
    children = [child_args(args, index, "127.0.0.1:1") for index in range(3)]
    assert [child.device for child in children] == ["cuda:0", "cuda:1", "cuda:0"]
    assert [child.activation_cache_mb for child in children] == [300, 600, 300]
    assert [child.replica_budget_mb for child in children] == [100, 100, 100]
    args.device = "cuda:0"  # all on one GPU
    children = [child_args(args, index, "127.0.0.1:1") for index in range(3)]
    assert [(c.device, c.activation_cache_mb) for c in children] == [("cuda:0", 200)] * 3
    args = server_program.build_parser().parse_args(flags)  # no replicas: the budget's flag stays unset
    assert child_args(args, 0, "127.0.0.1:1").replica_budget_mb == args.replica_budget_mb
    args.torch_threads, args.processes = 2, 3  # fewer threads than processes: one each
    assert child_args(args, 0, "127.0.0.1:1").torch_threads == 1


def loaded_torch(pid: int) -> bool:
    """Whether the process has mapped torch's libraries: it is inside ``import torch``, or past it."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def ignores(pid: int, signum: int) -> bool:
    """Whether the process ignores ``signum`` (SIG_IGN), from /proc."""
    (mask,) = [line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("SigIgn:")]
    return bool(int(mask, 16) >> (signum - 1) & 1)


def test_a_process_whose_last_checkpoint_fails_makes_the_program_exit_1_as_one_process_does(tmp_path):
    """Review 75: a server of one process exits 1 when its last checkpoint cannot be written (the only word that
    training since the last periodic checkpoint is lost); with --processes the program exited 0 however its
    processes ended."""
    with processes() as procs:
        procs.append(proc := Proc(server_args("--experts", "ffn.[0:2]", "--processes", "2", "--checkpoint-dir",
                                              str(tmp_path), "--checkpoint-interval", "3600")))
        proc.wait_for("^dmoe-server listening on", timeout=120)
        (tmp_path / "process-0" / "experts.pt").unlink(missing_ok=True)
        (tmp_path / "process-0" / "experts.pt").mkdir()  # the last checkpoint cannot be put in place
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(120) == 1
        assert re.search(r"server process dmoe-server-0 stopped with status 1", "".join(proc.output))


def test_ctrl_c_is_the_parents_to_handle_also_while_the_children_start():
    """Review 49: the children took SIGINT (Ctrl-C reaches the whole process group) for their own: each stopped by
    itself as the parent stopped it, and one still importing torch printed a KeyboardInterrupt traceback (unless
    the parent's SIGTERM killed it first). (Ctrl-C once they serve: the restart test above, which stops its first
    server so.)"""
    with processes() as procs:
        procs.append(proc := Proc(server_args("--experts", "ffn.[0:2]", "--processes", "2", "--log-level", "INFO")))
        proc.wait_for("DHT node at", timeout=120)
        deadline = time.monotonic() + 60
        while len(children := server_children(proc.popen.pid)) < 2 or not all(map(loaded_torch, children)):
            assert time.monotonic() < deadline, "the server processes did not start"
            time.sleep(0.02)
        # (the children import torch for a second or more: as inherited from the start, not set in run_child)
        assert all(ignores(child, signal.SIGINT) and ignores(child, signal.SIGHUP) for child in children)
        proc.interrupt()  # Ctrl-C, as the terminal sends it: to the whole group, while the children import torch
        assert proc.popen.wait(60) == 0
        wait_gone(children)
        output = "".join(proc.output)
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output


def test_stop_signals_leave_an_ignored_signal_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert stop.wait(timeout=0.2) is None
            signal.raise_signal(signal.SIGTERM)  # what the parent stops its children with
            assert stop.wait(timeout=5) == signal.SIGTERM
        with terminal_signals_ignored():  # (what the parent starts its children in)
            assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    hangup = signal.getsignal(signal.SIGHUP)
    with StopSignals(), terminal_signals_ignored():
        pass
    assert signal.getsignal(signal.SIGINT) is previous and signal.getsignal(signal.SIGHUP) == hangup


def test_a_process_started_again_without_key_files_keeps_its_key_and_declares_at_once(tmp_path):
    """Review 58: with no --identity, --checkpoint-dir or --replica-dir, a child started again drew a new key, and
    its uids stayed the dead child's (pointing at its dead endpoint) until those declarations expired. The parent
    keeps those keys in memory: key files in a temporary directory stayed on disk when the parent was killed."""
    uids = expand_pattern("ffn.[0:4]")
    (temporary := tmp_path / "tmp").mkdir()
    with processes() as procs:
        procs.append(proc := Proc(server_args("--experts", "ffn.[0:4]", "--processes", "2", "--refresh-period", "1",
                                              "--expiration", "300"), env={"TMPDIR": str(temporary)}))
        proc.endpoint(timeout=120)
        dht_node = re.search(r"DHT node at (\S+)", "".join(proc.output)).group(1)
        with DHT(initial_peers=[dht_node], client_mode=True) as dht:
            deadline = time.monotonic() + 30
            while not all(before := get_experts(dht, uids)):
                assert time.monotonic() < deadline, before
                time.sleep(0.1)
            os.kill(server_children(proc.popen.pid)[1], signal.SIGKILL)
            deadline = time.monotonic() + 60  # far less than the dead child's declarations last (300 s)
            while (now := get_experts(dht, uids[1::2])) == before[1::2] or None in now:
                assert time.monotonic() < deadline, (now, proc.output[-5:])
                time.sleep(0.2)
        assert now[0] != before[1] and forward_future(now[0], uids[1], [torch.randn(2, HIDDEN)]).result(30) is not None
        children = server_children(proc.popen.pid)
        proc.popen.kill()  # the OOM killer, say: no clean-up of the parent's runs
        proc.popen.wait(30)
        wait_gone(children)  # they stop when their parent dies
    assert not [path for path in temporary.rglob("*") if path.is_file() and path.stat().st_size == 32]
