"""A volunteer's server keeps its experts across restarts and refuses setups that would lose them: the same
``--num-experts`` command resumes the same cells, one checkpoint directory serves one server, a closed terminal
(SIGHUP) still writes the last checkpoint, a port in use or out of range is a CLI error naming the flag."""
from __future__ import annotations

import re
import signal

import pytest

from dmoe.cli import server as server_program
from dmoe.cli.server_processes import LAYOUT_FILE, check_checkpoint_layout
from dmoe.server.checkpoints import saved_uids
from tests.procs import Proc, exit_output, processes

HIDDEN = 8


def server_args(*flags: str) -> list[str]:
    return ["-m", "dmoe.cli.server", "--hidden-dim", str(HIDDEN), "--expert-cls", "nop", *flags]


def stopped(proc: Proc, signum: int = signal.SIGTERM, timeout: float = 60) -> str:
    """Sends ``signum`` and returns the program's whole output once it exited with status 0."""
    proc.popen.send_signal(signum)
    assert proc.popen.wait(timeout) == 0, "".join(proc.output)
    proc._reader.join(timeout=10)
    return "".join(proc.output)


def refused(*flags: str, timeout: float = 120) -> str:
    """The output of a server program that must exit with status 2 (an argparse error); killed if it does not."""
    return exit_output(server_args(*flags), 2, timeout)


def refused_here(capsys, *flags: str) -> str:
    """What the server program prints as it refuses ``flags`` with status 2 (an argparse error), run in this process
    (a program of its own costs seconds of imports): only for refusals that come before it starts anything (a DHT
    node, a thread, a lock it would keep)."""
    with pytest.raises(SystemExit) as exit_info:
        server_program.main(server_args(*flags)[2:])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("processes_flag", [(), ("--processes", "2")])
def test_the_same_num_experts_command_resumes_the_same_cells(tmp_path, processes_flag):
    flags = ("--num-experts", "2", "--grid", "8", "--layer", "ffn", "--checkpoint-dir", str(tmp_path),
             *processes_flag)
    with processes() as procs:
        procs.append(first := Proc(server_args(*flags)))
        first.endpoint(timeout=120)
        stopped(first)
    directories = [tmp_path] if not processes_flag else [tmp_path / "process-0", tmp_path / "process-1"]
    cells = [saved_uids(directory) for directory in directories]
    assert sum(len(uids) for uids in cells) == 2, cells
    with processes() as procs:  # 8 cells: a fresh choice would rarely be the same 2 (and dealt the same way)
        procs.append(again := Proc(server_args(*flags)))
        again.endpoint(timeout=120)
        output = stopped(again)
    assert "resuming the 2 experts checkpointed" in output, output
    assert [saved_uids(directory) for directory in directories] == cells


def test_a_serving_servers_directory_key_and_port_are_refused_and_a_closed_terminal_stops_it(tmp_path, capsys):
    """One server's resources, each refused to a second server naming its flag while the first serves: its
    --checkpoint-dir (with --processes too), its DHT identity (review 75: a server whose --replica-dir was another's
    --checkpoint-dir took both of its locks, separate files, but loaded that one's key: two servers under one key
    overwrote each other's uids without a word; also given as --identity), its --port. Then a closed terminal
    (SIGHUP) stops it with its last checkpoint, of its own experts, not a refused one's, and its key is free again.
    (One server for all: each check was a test that started the same server.)"""
    with processes() as procs:
        procs.append(first := Proc(server_args("--experts", "a.[0:2]", "--checkpoint-dir", str(tmp_path))))
        port = re.search(r":(\d+)$", first.endpoint(timeout=120)).group(1)
        peer = re.search(r"DHT node at (\S+)", "".join(first.output)).group(1)
        output = refused_here(capsys, "--experts", "b.[0:2]", "--checkpoint-dir", str(tmp_path))
        assert "argument --checkpoint-dir" in output and "in use by another server" in output, output
        output = refused_here(capsys, "--experts", "b.[0:2]", "--checkpoint-dir", str(tmp_path), "--processes", "2")
        assert "argument --checkpoint-dir" in output and "in use by another server" in output, output

        output = refused_here(capsys, "--experts", "b.[0:2]", "--replica-dir", str(tmp_path), "--initial-peers", peer)
        assert "argument --replica-dir: the DHT identity" in output and "in use by another server" in output, output
        # the lock is on the key itself: nothing to create beside a key on a read-only mount (review 76)
        assert sorted(path.name for path in tmp_path.glob("dht_identity*")) == ["dht_identity.key"]
        output = refused_here(capsys, "--experts", "b.[0:2]", "--identity", str(tmp_path / "dht_identity.key"))
        assert "argument --identity" in output, output

        output = refused("--experts", "b.[0:2]", "--port", port)  # (a program: it starts a DHT node first)
        assert "argument --port" in output and "could not listen" in output, output
        assert first.alive
        output = stopped(first, signal.SIGHUP)
    assert "SIGHUP received" in output and "final checkpoint written" in output, output
    assert saved_uids(tmp_path) == ["a.0", "a.1"]  # the first server's experts, not a refused one's
    with processes() as procs:  # and once it stopped, the key is free again
        procs.append(again := Proc(server_args("--experts", "b.[0:2]", "--identity",
                                               str(tmp_path / "dht_identity.key"))))
        again.endpoint(timeout=120)
        stopped(again)


def test_num_experts_takes_free_cells_only_and_refuses_a_full_grid_but_to_a_replica_holder(tmp_path, capsys):
    """Review 56: with no cell free, --num-experts took served ones, whose uids their servers own: the server served
    an expert nobody was sent to and logged an error every refresh."""
    with processes() as procs:
        procs.append(full := Proc(server_args("--experts", "ffn7.[0:2].[0:2]")))
        full.endpoint(timeout=120)
        peer = re.search(r"DHT node at (\S+)", "".join(full.output)).group(1)
        grid = ("--grid", "2", "2", "--layer", "ffn7", "--initial-peers", peer)
        # one process: refused once its DHT node looked (a program: it does not close that node as it refuses);
        # processes: refused by the parent, which closes its node as it refuses, before any child starts
        for output in (refused("--num-experts", "1", *grid),
                       refused_here(capsys, "--num-experts", "2", "--processes", "2", *grid)):
            assert "argument --num-experts: every cell of the 2 x 2 grid of --layer ffn7 is served" in output, output
        # with --replica-dir it starts as a standby: it holds replicas and adopts the cells that empty (review 58:
        # with --processes it was refused, telling the user to give the --replica-dir given)
        for flags, says in ((("--num-experts", "1"), "this server holds"), (("--num-experts", "2", "--processes",
                                                                              "2"), "these processes hold")):
            procs.append(standby := Proc(server_args(*flags, *grid, "--replica-dir", str(tmp_path / flags[-1]))))
            standby.endpoint(timeout=120)
            output = stopped(standby)
            assert f"every cell of --layer ffn7 is served already: {says} their replicas" in output, output
        assert full.alive


@pytest.mark.parametrize("flags, words", [
    (("--processes", "2", "--port", "65535"), "argument --port: 2 processes count their ports up from 65535"),
    (("--processes", "2", "--dht-port", "65534"), "argument --dht-port"),
    (("--processes", "2", "--metrics-port", "65535"), "argument --metrics-port"),
    (("--checkpoint-interval", "5"), "argument --checkpoint-interval: needs --checkpoint-dir"),
    (("--checkpoint-interval", "inf", "--checkpoint-dir", "unused"), "argument --checkpoint-interval: must be finite"),
    (("--cuda-graphs", "--device", "cpu"), "argument --cuda-graphs: needs a CUDA device, and this server computes on cpu"),
    (("--cuda-graphs", "--workers", "2"), "argument --cuda-graphs: needs one compute worker per process"),
    (("--max-stream-mb", "inf"), "argument --max-stream-mb: must be finite"),
    (("--max-stream-seconds", "inf"), "argument --max-stream-seconds: must be finite"),
    (("--max-stream-mb", "1e-9"), "argument --max-stream-mb: 1e-09 MiB is less than 1 KiB"),
])
def test_flags_that_would_fail_later_are_refused_at_once(flags, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        server_program.main(["--experts", "a.[0:2]", "--hidden-dim", str(HIDDEN), *flags])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_checkpoint_directory_that_is_a_file_is_refused_with_processes_too(tmp_path, capsys):
    path = tmp_path / "a-file"
    path.write_text("x")
    for count in ("1", "2"):
        with pytest.raises(SystemExit):
            server_program.main(["--experts", "a.[0:2]", "--hidden-dim", str(HIDDEN), "--processes", count,
                                 "--checkpoint-dir", str(path)])
        assert "argument --checkpoint-dir" in capsys.readouterr().err


def test_a_process_count_under_which_nothing_was_checkpointed_binds_nothing(tmp_path):
    parser = server_program.build_parser()

    def layout(count: str):
        return check_checkpoint_layout(parser.parse_args(["--experts", "a.[0:4]", "--processes", count,
                                                          "--checkpoint-dir", str(tmp_path)]), parser)
    layout("2").close()  # a first start that failed before any child wrote a checkpoint
    layout("3").close()  # is not held against another count
    assert '"processes": 3' in (tmp_path / LAYOUT_FILE).read_text()
    (tmp_path / "process-0").mkdir()
    (tmp_path / "process-0" / "experts.pt").write_bytes(b"written by a child")
    with pytest.raises(SystemExit):
        layout("2")
    lock = layout("3")
    assert lock is not None
    lock.close()


def test_num_experts_without_replicas_leaves_cells_whose_experts_others_hold_to_them(caplog):
    """Review 59: a cell whose server just left looks free while its replicas' holders wait to adopt it; a server
    without --replica-dir that took it started the expert fresh, and the holders, finding it served, never adopted
    it: its training was lost. Such cells go last now."""
    import time

    from dmoe.dht import DHT, Identity
    from dmoe.replicas.records import Holder, replicas_key, server_subkey

    cells = [f"ffn8.{i}.{j}" for i in range(2) for j in range(2)]
    with processes() as procs:
        procs.append(node := Proc(["-m", "dmoe.dht", "--port", "0"]))
        peer = node.endpoint()
        with DHT(initial_peers=[peer], identity=(holder := Identity())) as dht:
            def announce(uids):  # as a holder's Adopter announces its replicas
                subkey, expires = server_subkey(holder.public_key), time.time() + 300
                assert all(all(stored.values()) for stored in dht.store_many({
                    replicas_key(uid): {subkey: (Holder("127.0.0.1:9", 5, "ab" * 4, b"").value(), expires)}
                    for uid in uids}).values())

            announce(cells[:3])
            parser = server_program.build_parser()
            args = parser.parse_args(["--num-experts", "1", "--grid", "2", "2", "--layer", "ffn8"])
            # random among the free cells: the one nobody holds, every time (a 4^-8 chance on the old code)
            assert [server_program.pick_cells(dht, args, parser) for _ in range(8)] == [[cells[3]]] * 8
            announce(cells[3:])
            with caplog.at_level("WARNING", logger="dmoe.cli.server"):
                (chosen,) = server_program.pick_cells(dht, args, parser)  # no other cell: one of them all the same
            assert chosen in cells and "other servers hold replicas of their experts" in caplog.text
