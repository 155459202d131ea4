"""Collaborative training between real processes: trainers (``dmoe-train --collaborate``, the real loop, in
``tests/collab_trainer.py``) against a one-server swarm (DHT node and expert server processes) on tiny data.

Claims: three trainers hold equal dense parameters after every global step, agree on the step and all train the
experts; a trainer killed mid-step does not stop the others, and one that joins later downloads their state and
then steps with them; bad progress records and a state of another model are refused with a logged message while
training goes on.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import torch

from dmoe.client.remote_expert import expert_info
from dmoe.launch import LocalSwarm, SwarmConfig
from dmoe.uid import grid_uids
from tests.procs import Proc, processes

STEPS = 6
TARGET = 24  # samples per global step: two batches of 4 from each of three trainers


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    words = "the king queen sword crown night love death speak lord my thou art and of to a is".split()
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(len(words), (7,), generator=generator).tolist())
             for _ in range(600)]
    path = tmp_path_factory.mktemp("collab_text") / "verse.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def swarm() -> Iterator[LocalSwarm]:
    config = SwarmConfig(layers=("ffn0",), grid=(2, 2), n_servers=1, hidden_dim=16, env={"OMP_NUM_THREADS": "1"},
                         server_args=("--optimizer", "adam", "--lr", "0.003", "--seed", "3", "--refresh-period", "5",
                                      "--log-level", "WARNING"))
    with LocalSwarm(config) as started:
        started.wait_declared()
        yield started


def trainer_flags(swarm: LocalSwarm, text_file: Path, run: str, shard: int, shards: int, steps: int) -> list[str]:
    return ["--data", str(text_file), "--experts", "remote", "--initial-peers", swarm.initial_peers,
            "--seq-len", "16", "--hidden", "16", "--heads", "2", "--layers", "1", "--grid", "2", "2", "--k-best", "2",
            "--batch-size", "4", "--warmup-steps", "2", "--steps", str(steps), "--eval-interval", "1000",
            "--eval-batches", "2", "--checkpoint-interval", "1000000", "--sample-bytes", "0", "--threads", "1",
            "--seed", "3", "--forward-timeout", "30", "--backward-timeout", "30", "--timeout-after-k-min", "10",
            "--collaborate", run, "--target-batch-size", str(TARGET), "--data-shard", str(shard),
            "--data-shards", str(shards), "--refresh-period", "0.25", "--progress-ttl", "3",
            # a trainer more than the matchmaking time late to a round falls behind and downloads the state, which
            # the tests count as a failure: on a 2-core CI machine running other test files beside, 4 s was not
            # always enough (2 of 8 full suites in one session)
            "--matchmaking-time", "8", "--allreduce-timeout", "10"]


def start_trainer(procs: list, out: Path, name: str, flags: Sequence[str], go: Path | None = None) -> Proc:
    extra = ["--go", str(go)] if go is not None else []
    proc = Proc(["-m", "tests.collab_trainer", "--save-dir", str(out / name), "--out-dir", str(out / name), *extra,
                 *flags], env={"TQDM_DISABLE": "1"})
    proc.log_path = out / f"{name}.log"
    procs.append(proc)
    return proc


def keep_log(proc: Proc) -> None:
    """Writes what a trainer printed next to its files, for a failure's post-mortem."""
    proc.log_path.write_text(output(proc))


def start_together(procs: list, out: Path, flags_by_name: dict[str, list[str]]) -> dict[str, Proc]:
    """Starts the trainers and lets them train once every one of them is imported and waiting (then each waits
    in the collaboration for the others, ``--wait-for-trainers``)."""
    go = out / "go"
    together = ["--wait-for-trainers", str(len(flags_by_name))]
    started = {name: start_trainer(procs, out, name, [*flags, *together], go) for name, flags in flags_by_name.items()}
    for proc in started.values():
        proc.wait_for("^ready", timeout=120)
    go.touch()
    return started


def result_of(proc: Proc, timeout: float = 180.0) -> dict:
    """The trainer's result line, once it exited cleanly."""
    try:
        found = proc.wait_for("^result ", timeout)
    finally:
        keep_log(proc)
    result = json.loads(found.string[len("result "):])
    assert proc.popen.wait(60) == 0, output(proc)
    return result


def saved(out: Path, name: str) -> dict[int, list[torch.Tensor]]:
    return {int(re.fullmatch(r"step(\d+)\.pt", f.name).group(1)): torch.load(f, weights_only=True)
            for f in (out / name).glob("step*.pt")}


def assert_equal_parameters(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=f"{what}: parameter {i}")


def server_backward_calls(swarm: LocalSwarm) -> int:
    return sum(expert_info(swarm.server_endpoints[0], uid, timeout=30)["backward_calls"]
               for uid in grid_uids("ffn0", (2, 2)))


def output(proc: Proc) -> str:
    return "".join(proc.output)


def test_three_trainers_hold_equal_parameters_after_every_step_and_all_train_the_experts(swarm, text_file, tmp_path):
    before = server_backward_calls(swarm)
    with processes() as procs:
        trainers = start_together(procs, tmp_path, {f"t{i}": trainer_flags(swarm, text_file, "three", i, 3, STEPS)
                                                    for i in range(3)})
        results = {name: result_of(proc) for name, proc in trainers.items()}
    for name, proc in trainers.items():
        assert results[name]["step"] == STEPS, output(proc)
    states = {name: saved(tmp_path, name) for name in trainers}
    # every trainer went through every step (nobody fell behind and had to download) with the same parameters
    for step in range(1, STEPS + 1):
        for name in ("t1", "t2"):
            assert_equal_parameters(states[name][step], states["t0"][step], f"step {step}, {name} against t0")
    downloaded = {name: output(proc) for name, proc in trainers.items() if "downloaded the state" in output(proc)}
    assert not downloaded, downloaded  # the logs of any that fell behind: why it missed a step
    losses = [r["final_val_loss"] for r in results.values()]
    assert max(losses) - min(losses) < 1e-4, losses
    # the experts were trained by all three: each one's backward calls reached them, and they are all the server got
    assert all(r["expert_backward_calls"] > 0 and r["expert_backward_failures"] == 0 for r in results.values())
    assert server_backward_calls(swarm) - before == sum(r["expert_backward_calls"] for r in results.values())


def test_a_killed_trainer_stops_nobody_and_a_joiner_downloads_the_state_then_steps_with_the_others(
        swarm, text_file, tmp_path):
    steps = 24
    with processes() as procs:
        # the joiner's process starts now (imports take seconds) but joins only once the others are at step 4
        join = tmp_path / "join"
        joiner = start_trainer(procs, tmp_path, "joiner", trainer_flags(swarm, text_file, "kill", 2, 3, steps), join)
        trainers = start_together(procs, tmp_path, {f"t{i}": trainer_flags(swarm, text_file, "kill", i, 3, steps)
                                                    for i in range(3)})
        trainers["t2"].wait_for("^saved step 2$", timeout=120)
        trainers["t2"].kill()  # SIGKILL while it accumulates toward step 3, its record still counted
        trainers["t0"].wait_for("^saved step 4$", timeout=120)
        join.touch()
        joined = joiner.wait_for(r"downloaded the state at step (\d+) from trainer", timeout=120)
        results = {name: result_of(proc) for name, proc in [("t0", trainers["t0"]), ("t1", trainers["t1"]),
                                                            ("joiner", joiner)]}
    assert all(r["step"] == steps for r in results.values()), results
    states = {name: saved(tmp_path, name) for name in results}
    # a survivor left out of a group (it read the joiner's record later than the leader did) loses its samples and
    # downloads the next step's state: every step both survivors hold, they hold alike
    common = sorted(set(states["t0"]) & set(states["t1"]))
    assert steps in common and len(common) >= steps // 2, common
    for step in common:
        assert_equal_parameters(states["t1"][step], states["t0"][step], f"step {step}, t1 against t0")
    first = int(joined.group(1))
    assert 4 <= first < steps
    joined_steps = sorted(s for s in states["joiner"] if s > first)
    # it contributed: at least one step averaged by the two survivors and the joiner
    assert re.search(r"step \d+: averaged \d+ samples of 3 trainers", output(joiner)), output(joiner)
    for step in joined_steps:
        assert_equal_parameters(states["joiner"][step], states["t0"][step], f"step {step}, the joiner against t0")
    losses = [r["final_val_loss"] for r in results.values()]
    assert max(losses) - min(losses) < 1e-4, losses


def test_bad_progress_records_and_a_state_of_another_model_are_refused_and_training_goes_on(
        swarm, text_file, tmp_path):
    steps = 5
    with processes() as procs:
        hostile = Proc(["-m", "tests.collab_trainer", "--hostile", "--initial-peers", swarm.initial_peers,
                        "--collaborate", "hostile"])
        procs.append(hostile)
        hostile.wait_for("^hostile ready", timeout=120)
        trainers = start_together(procs, tmp_path, {f"t{i}": trainer_flags(swarm, text_file, "hostile", i, 2, steps)
                                                    for i in range(2)})
        results = {name: result_of(proc) for name, proc in trainers.items()}
        assert hostile.alive  # it kept publishing to the end
    for name, proc in trainers.items():
        text = output(proc)
        assert results[name]["step"] == steps, text
        assert "refused the progress record of trainer 1001: it claims 1000000000 samples toward step 0" in text
        # stamped an hour ahead when published; read up to a few seconds later, so 3600 s or a little less
        future = re.search(r"refused the progress record of trainer 1002: it is stamped (\d+) s in the future", text)
        assert future and 3500 <= int(future.group(1)) <= 3600, text
        assert re.search(r"ignoring trainer 1003 for \d+ s: its state at 127\.0\.0\.1:9 was refused: .*UNAVAILABLE",
                         text), text
        assert re.search(r"ignoring trainer 1004 for \d+ s: its state at \S+ was refused: parameter 0 has shape "
                         r"\[256, 24\] in the state, \[256, 16\] here", text), text
        assert "downloaded the state" not in text
    states = {name: saved(tmp_path, name) for name in trainers}
    for step in range(1, steps + 1):
        assert_equal_parameters(states["t1"][step], states["t0"][step], f"step {step}, t1 against t0")



def test_a_trainer_waiting_for_the_others_stops_when_its_launcher_dies(swarm, text_file, tmp_path):
    """Only the training loop checked for a dead launcher: a trainer of dmoe-demo --trainers N whose demo died
    while it waited for the others (--wait-for-trainers) waited out its 10 minutes first."""
    from tests.test_trainer import assert_an_orphan_stops

    assert_an_orphan_stops([*trainer_flags(swarm, text_file, "orphan", 0, 1, 4), "--wait-for-trainers", "2",
                            "--out-dir", str(tmp_path / "run")], "waiting for 2 trainers", "went on waiting")


@pytest.mark.parametrize("value", ["0", "17", "three"])
def test_the_demo_refuses_a_bad_number_of_trainers_naming_the_flag(value, capsys):
    from dmoe.cli.demo import main

    with pytest.raises(SystemExit) as exited:
        main(["--trainers", value])
    assert exited.value.code == 2
    assert "argument --trainers" in capsys.readouterr().err


def test_the_demo_gives_each_trainer_its_slice_and_one_collaboration(text_file, tmp_path):
    from dmoe.cli.demo import collaborative_args
    from dmoe.cli.train import parse_config

    rest = ["--data", str(text_file), "--batch-size", "8", "--out-dir", str(tmp_path)]
    trainer_args = collaborative_args(rest, parse_config(rest), 3)
    configs = [parse_config(trainer_args(i, "127.0.0.1:5000")) for i in range(3)]
    assert [(c.data_shard, c.data_shards) for c in configs] == [(0, 3), (1, 3), (2, 3)]
    assert {(c.collaborate, c.target_batch_size, c.wait_for_trainers, c.experts) for c in configs} == {
        ("demo", 24, 3, "remote")}
    assert len({c.out_dir for c in configs}) == 3


def test_the_demo_gives_each_trainer_its_own_ports_and_checkpoint_and_reads_its_config_anywhere(
        text_file, tmp_path, monkeypatch):
    from dmoe.cli.demo import collaborative_args, demo_settings
    from dmoe.cli.train import parse_config

    (tmp_path / "demo.toml").write_text("batch-size = 4\nsteps = 7\n")
    monkeypatch.chdir(tmp_path)  # the trainers run elsewhere (the repository's root): the path must still hold
    rest = ["--data", str(text_file), "--config", "demo.toml", "--averaging-port", "5100", "--state-port", "5200",
            "--checkpoint", "ck.pt"]
    # as the demo parses them: it settles --collaborate itself, which the ports need (they are refused without it)
    config = parse_config(rest, defaults={"steps": 150}, settle=demo_settings(2))
    assert config.steps == 7  # the file's, not the demo's default
    trainer_args = collaborative_args(rest, config, 2)
    monkeypatch.chdir("/")
    configs = [parse_config(trainer_args(i, "127.0.0.1:5000")) for i in range(2)]
    assert [(c.averaging_port, c.state_port) for c in configs] == [(5100, 5200), (5101, 5201)]
    assert [c.checkpoint for c in configs] == [str(tmp_path / "ck.trainer0.pt"), str(tmp_path / "ck.trainer1.pt")]
    assert {(c.batch_size, c.steps) for c in configs} == {(4, 7)}


@pytest.mark.parametrize("ports, words", [
    # trainer 1's averager took trainer 0's state port: it died with a traceback (RuntimeError: Failed to bind)
    (("--averaging-port", "45200", "--state-port", "45201"), "argument --state-port: trainer i listens on "
     "--averaging-port + i and --state-port + i, so --averaging-port and --state-port must be at least --trainers "
     "(3) apart, got 45200 and 45201"),
    (("--averaging-port", "45202", "--state-port", "45200"), "must be at least --trainers (3) apart"),
    (("--state-port", "65534"), "argument --state-port: 3 trainers count their ports up from 65534 to 65536, "
                                "beyond 65535"),
])
def test_the_demo_refuses_fixed_trainer_ports_that_overlap_before_starting_anything(ports, words, capsys):
    from dmoe.cli.demo import main

    with pytest.raises(SystemExit) as exited:
        main(["--trainers", "3", *ports])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    line = err.rstrip().split("\n")[-1]
    assert "Traceback" not in err and line.startswith("dmoe-demo: error: argument --") and words in line, err


def test_fixed_trainer_ports_far_enough_apart_pass_the_demos_check():
    import argparse

    from dmoe.cli.demo import check_trainer_ports
    from dmoe.cli.train import parse_config

    class Refuses(argparse.ArgumentParser):
        def error(self, message):
            raise AssertionError(message)

    base = ["--experts", "remote", "--initial-peers", "127.0.0.1:1", "--collaborate", "r", "--target-batch-size", "8"]
    # (--averaging-client-mode, whose trainers listen on nothing, is refused by the demo itself: review 112 D2)
    for ports in (["--averaging-port", "45200", "--state-port", "45203"], ["--averaging-port", "45203",
                  "--state-port", "45200"], ["--averaging-port", "45200"], ["--averaging-port", "65533"]):
        check_trainer_ports(Refuses(), parse_config([*base, *ports]), 3)


def test_a_trainer_whose_port_is_taken_says_which_flag_in_one_line(text_file, tmp_path, capsys):
    """A taken --averaging-port ended dmoe-train in a traceback (RuntimeError: Failed to bind to address ...), and a
    taken --state-port in a line that named no flag; now both are usage errors naming the flag and the address, as
    dmoe-server's --port is. The same port for both is refused before anything starts."""
    import socket

    from dmoe.cli import train
    from tests.procs import running

    flags = ["--data", str(text_file), "--experts", "remote", "--collaborate", "taken", "--target-batch-size", "8",
             "--seq-len", "16", "--hidden", "16", "--heads", "2", "--layers", "1", "--grid", "2", "2", "--k-best", "2",
             "--threads", "1", "--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exited:
        train.main([*flags, "--initial-peers", "127.0.0.1:1", "--averaging-port", "45200", "--state-port", "45200"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(
        "dmoe-train: error: --averaging-port and --state-port must differ (the averager and the state server each "
        "listen on their own port), both are 45200")
    with running("-m", "dmoe.dht", "--port", "0") as dht, socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        for flag, service in (("--averaging-port", "averager"), ("--state-port", "state server")):
            with pytest.raises(SystemExit) as exited:
                train.main([*flags, "--initial-peers", dht.endpoint(), flag, str(port)])
            assert exited.value.code == 2
            err = capsys.readouterr().err
            assert "Traceback" not in err, err
            assert err.rstrip().split("\n")[-1] == (
                f"dmoe-train: error: argument {flag}: the {service} could not listen on 127.0.0.1:{port}: another "
                "process listens there, or the host is not an address of this machine"), err


def test_a_demo_training_in_process_whose_averaging_port_is_taken_names_the_flag(tmp_path, monkeypatch, capsys):
    """--trainers 1 --collaborate: the trainer is the demo's own process, whose OSError line named no flag."""
    from dmoe.cli import demo
    from dmoe.endpoints import PortUnavailable

    def taken(*args):
        raise PortUnavailable.at("averager", "127.0.0.1:45200")

    monkeypatch.setattr(demo, "run_swarm", taken)
    assert demo.main(["--out-dir", str(tmp_path), "--collaborate", "r", "--target-batch-size", "8",
                      "--averaging-port", "45200"]) == 2  # (--experts, --initial-peers: the demo's, refused)
    assert capsys.readouterr().err.rstrip() == (
        "dmoe-demo: error: argument --averaging-port: the averager could not listen on 127.0.0.1:45200: another "
        "process listens there, or the host is not an address of this machine")
