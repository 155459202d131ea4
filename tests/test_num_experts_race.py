"""Review 92 D1: ``--num-experts`` servers started at the same moment chose the same free cell (nothing reserves one
between the DHT read and the first declaration); the loser only logged a warning and served, for good, a cell no
client reached (and checkpointed it, for every restart to resume), even on a grid with no other cell, which must be
refused. Now the cells are read back after their first declaration: one another key owns is traded for a free cell,
or, with none free, the server exits with the error of a full grid."""
from __future__ import annotations

import re

from dmoe.dht import DHT
from dmoe.directory.lookups import alive_experts
from dmoe.server.checkpoints import saved_uids
from dmoe import launch
from tests.procs import Proc, processes

HIDDEN = 8
SETTLED = r"listening on \S+:\d+|dmoe-server: error"


class Started(Proc):
    """A program started with python, not forked from the test's template: the two servers then spend their
    seconds of imports side by side, and read the DHT together (forked, the first often declared before the
    second read, as one volunteer's script that starts two seldom does)."""

    def _start(self, args: list[str], env: dict[str, str]):
        return launch.Proc._start(self, args, env)


def start_two(procs: list[Proc], layer: str, grid: int) -> tuple[str, list[Proc]]:
    """A DHT node, then two ``--num-experts 1`` servers of a ``grid``-cell ``layer`` started at once."""
    procs.append(node := Proc(["-m", "dmoe.cli.dht", "--host", "127.0.0.1"]))
    peer = node.endpoint(timeout=60)
    flags = ["-m", "dmoe.cli.server", "--hidden-dim", str(HIDDEN), "--expert-cls", "nop", "--num-experts", "1",
             "--grid", str(grid), "--layer", layer, "--initial-peers", peer, "--refresh-period", "2"]
    servers = [Started(flags), Started(flags)]  # (back to back: both read the DHT before either declares)
    procs.extend(servers)
    for server in servers:  # each serves, or exits with an error
        try:
            server.wait_for(SETTLED, timeout=120)
        except RuntimeError:  # exited without either line: shown by the assertions below
            pass
    return peer, servers


def test_two_servers_started_at_once_on_one_free_cell_one_serves_it_the_other_is_refused():
    with processes() as procs:
        _, servers = start_two(procs, "race1", 1)
        outputs = ["".join(server.output) for server in servers]
        exited = [server for server in servers if server.popen.poll() is not None or "dmoe-server: error" in
                  "".join(server.output)]
        assert len(exited) == 1, "\n----\n".join(outputs)  # before: both served it, the loser to nobody
        loser, = exited
        winner, = [server for server in servers if server is not loser]
        assert loser.popen.wait(30) == 2, "".join(loser.output)
        loser._reader.join(timeout=10)
        output = "".join(loser.output)
        assert "argument --num-experts: every cell of the 1 grid of --layer race1 is served already" in output, output
        assert "listening on" not in output, output
        assert winner.alive and "listening on" in "".join(winner.output)


def test_two_servers_started_at_once_on_two_free_cells_serve_one_each():
    with processes() as procs:
        peer, servers = start_two(procs, "race2", 2)
        outputs = "\n----\n".join("".join(server.output) for server in servers)
        assert all(server.alive for server in servers), outputs
        endpoints = {re.search(r"listening on (\S+:\d+)", "".join(server.output)).group(1) for server in servers}
        with DHT([peer]) as client:
            alive = alive_experts(client, "race2", (2,))
        # before: both took the same cell when they chose it together (in 2 tries of 3), one serving it to nobody,
        # and the other cell stayed empty
        assert sorted(alive) == ["race2.0", "race2.1"] and set(alive.values()) == endpoints, (alive, outputs)


def resumed_where_another_serves(procs: list[Proc], tmp_path, layer: str, grid: int) -> tuple[str, Proc, Proc, str]:
    """A ``--num-experts 1`` server's checkpointed cell, taken by another server (``--experts`` it) in a swarm
    where the first then restarts with the same command: the race made certain (the other key declared first)."""
    flags = ["-m", "dmoe.cli.server", "--hidden-dim", str(HIDDEN), "--expert-cls", "nop", "--num-experts", "1",
             "--grid", str(grid), "--layer", layer, "--refresh-period", "2", "--checkpoint-dir", str(tmp_path)]
    procs.append(alone := Proc(flags))  # (a swarm of its own)
    alone.endpoint(timeout=120)
    alone.popen.terminate()
    assert alone.popen.wait(60) == 0, "".join(alone.output)
    cell, = saved_uids(tmp_path)
    procs.append(node := Proc(["-m", "dmoe.cli.dht", "--host", "127.0.0.1"]))
    peer = node.endpoint(timeout=60)
    procs.append(other := Proc(["-m", "dmoe.cli.server", "--hidden-dim", str(HIDDEN), "--expert-cls", "nop",
                                "--experts", cell, "--initial-peers", peer, "--refresh-period", "2"]))
    other.endpoint(timeout=120)
    procs.append(again := Proc([*flags, "--initial-peers", peer]))
    try:
        again.wait_for(SETTLED, timeout=120)
    except RuntimeError:
        pass
    return peer, other, again, cell


def test_a_resumed_cell_another_server_took_is_refused_on_a_full_grid(tmp_path):
    with processes() as procs:
        _, other, again, cell = resumed_where_another_serves(procs, tmp_path, "resume1", 1)
        assert again.popen.wait(30) == 2, "".join(again.output)  # before: it served the cell, to nobody
        again._reader.join(timeout=10)
        output = "".join(again.output)
        assert "argument --num-experts: every cell of the 1 grid of --layer resume1 is served already" in output
        assert other.alive
    assert saved_uids(tmp_path) == [cell]  # its checkpoint as it was


def test_a_resumed_cell_another_server_took_is_traded_for_a_free_one(tmp_path):
    with processes() as procs:
        peer, other, again, cell = resumed_where_another_serves(procs, tmp_path, "resume2", 2)
        output = "".join(again.output)
        assert again.alive and "listening on" in output, output
        free, = {"resume2.0", "resume2.1"} - {cell}
        assert f"{cell}: declared by another key" in output and f"serving the free cell {free} instead" in output
        with DHT([peer]) as client:
            alive = alive_experts(client, "resume2", (2,))
        endpoint = re.search(r"listening on (\S+:\d+)", output).group(1)
        assert alive == {cell: other.endpoint(), free: endpoint}, (alive, output)  # before: free was empty
        again.popen.terminate()
        assert again.popen.wait(60) == 0, "".join(again.output)
    assert saved_uids(tmp_path) == [free]  # a restart resumes the cell it serves, not the taken one
