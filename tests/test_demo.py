"""dmoe-demo (``make demo``): a resumed demo resumes its whole model, the experts on its servers too.

Each test runs the demo in this process on a tiny model: a real DHT node and one real expert server (child
processes), the trainer in process.
"""
from __future__ import annotations

import os
import random
import signal
import textwrap
import threading
import time

import pytest
import torch

from dmoe.cli import demo
from dmoe.server.checkpoints import lock_directory
from dmoe.trainer.loop import TrainConfig
from tests.procs import Proc, running

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    words = "the king queen sword crown night love death speak lord my thou art and of to a is".split()
    lines = [" ".join(rng.choice(words) for _ in range(7)) for _ in range(300)]
    path = tmp_path_factory.mktemp("text") / "verse.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_demo(text_file, out_dir, *flags: str) -> int:
    return demo.main(["--servers", "1", "--data", str(text_file), "--out-dir", str(out_dir), "--max-minutes", "0",
                      "--layers", "1", "--grid", "2", "2", "--k-best", "2", "--hidden", "16", "--heads", "2",
                      "--seq-len", "16", "--batch-size", "4", "--eval-batches", "1", "--eval-interval", "100",
                      "--sample-bytes", "0", "--threads", "1", *flags])


def ctrl_c_at_step(monkeypatch, at: int) -> None:
    """The demo's trainer gets a real Ctrl-C (SIGINT) once step ``at`` is done."""
    real_train = demo.train

    def train(config):
        return real_train(config, on_step=lambda step, model: step == at and signal.raise_signal(signal.SIGINT))

    monkeypatch.setattr(demo, "train", train)


def saved_experts(out_dir) -> dict:
    """uid -> what the demo's server checkpointed of that expert."""
    return torch.load(out_dir / "experts" / "server0" / "experts.pt", weights_only=True)["experts"]


def test_a_resumed_demo_resumes_the_experts_its_servers_checkpointed_on_ctrl_c(text_file, tmp_path, monkeypatch):
    out_dir = tmp_path / "demo"
    ctrl_c_at_step(monkeypatch, 2)
    assert run_demo(text_file, out_dir, "--steps", "4") == 130
    monkeypatch.undo()
    assert torch.load(out_dir / "checkpoint.pt", weights_only=True)["step"] == 2
    interrupted = saved_experts(out_dir)  # written by the server as the demo stopped it
    assert max(expert["updates"] for expert in interrupted.values()) == 2  # one update per step at most

    # resumed at its last step: nothing trains, so the servers save what they resumed
    assert run_demo(text_file, out_dir, "--steps", "2", "--resume") == 0
    resumed = saved_experts(out_dir)
    assert resumed.keys() == interrupted.keys()
    for uid, expert in resumed.items():
        assert expert["updates"] == interrupted[uid]["updates"], uid
        for name, tensor in expert["state"]["module"].items():
            torch.testing.assert_close(tensor, interrupted[uid]["state"]["module"][name], rtol=0, atol=0,
                                       msg=f"{uid} {name}")

    # without --resume the demo trains a new model: its experts start afresh too
    assert run_demo(text_file, out_dir, "--steps", "1") == 0
    assert max(expert["updates"] for expert in saved_experts(out_dir).values()) == 1


def test_a_second_demo_in_the_same_directory_is_refused_naming_the_flag(text_file, tmp_path, capsys):
    out_dir = tmp_path / "demo"
    with lock_directory(out_dir):  # what a running demo holds
        assert run_demo(text_file, out_dir, "--steps", "1") == 1
    error = capsys.readouterr().err
    assert error.startswith("dmoe-demo: --out-dir: ") and "in use by another demo" in error, error  # (was swarm_demo:)
    assert not (out_dir / "experts").exists()  # refused before any server started


def test_ctrl_c_on_a_collaborative_demo_lets_every_trainer_save_its_checkpoint(text_file, tmp_path):
    out_dir = tmp_path / "demo"
    flags = ["-m", "dmoe.cli.demo", "--trainers", "2", "--servers", "1", "--data", str(text_file), "--out-dir",
             str(out_dir), "--steps", "1000", "--layers", "1", "--grid", "2", "2", "--k-best", "2", "--hidden", "16",
             "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--eval-batches", "1", "--eval-interval", "2",
             "--checkpoint-interval", "1000", "--sample-bytes", "0", "--threads", "1", "--refresh-period", "0.25",
             "--progress-ttl", "3", "--matchmaking-time", "8", "--allreduce-timeout", "10"]
    with running(*flags) as proc:
        started: set[str] = set()
        while len(started) < 2:  # both trainers in their loop (one interrupted before it would save nothing)
            started.add(proc.wait_for(r"\[trainer (\d)\] step 2: validation", timeout=120).group(1))
        proc.interrupt()  # Ctrl-C reaches the demo only: its trainers run in sessions of their own
        assert proc.popen.wait(timeout=150) == 130, "".join(proc.output)
    steps = [torch.load(out_dir / f"trainer{i}" / "checkpoint.pt", weights_only=True)["step"] for i in range(2)]
    assert min(steps) >= 2, steps  # saved as they stopped: none was killed before it could


def help_lines(capsys, *flags: str) -> dict[str, str]:
    """``dmoe-demo --help``: each flag's entry as one line, by the flag (and the usage, as "usage")."""
    assert demo.main([*flags, "--help"]) == 0
    text = capsys.readouterr().out
    entries, flag = {"usage": " ".join(text.split("\n\n")[0].split())}, None
    for line in text.splitlines():
        if line.startswith("  -"):  # an entry: "  --flag METAVAR  help", the help perhaps on the next lines
            flag = line.split()[0].rstrip(",")
            entries[flag] = line.strip()
        elif flag is not None and line.startswith("   "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def test_help_shows_the_demos_own_defaults_and_the_flags_it_sets(capsys):
    """Review 49: --help printed dmoe-train's parser as it is: dmoe-train's name and defaults (runs/train, 400 steps,
    no time limit, local experts), where the demo writes to runs/demo and trains for 4 minutes."""
    lines = help_lines(capsys)
    assert lines["usage"].startswith("usage: dmoe-demo ") and "--servers" in lines["usage"], lines["usage"]
    assert lines["--out-dir"].endswith("(default: runs/demo)"), lines["--out-dir"]
    assert lines["--max-minutes"].endswith("(default: 4.0)") and lines["--steps"].endswith("(default: 400)")
    for flag in ("--experts", "--initial-peers"):
        assert "[set by the demo: " in lines[flag] and "(default:" not in lines[flag], lines[flag]
    assert lines["--servers"].endswith("(default: 2)") and lines["--trainers"].endswith("(default: 1)")
    lines = help_lines(capsys, "--trainers", "3")  # a collaboration's
    assert lines["--steps"].endswith("(default: 150)") and lines["--max-minutes"].endswith("(default: 0.0)")
    assert lines["--collaborate"].endswith("(default: demo)"), lines["--collaborate"]
    for flag in ("--data-shard", "--data-shards", "--wait-for-trainers", "--target-batch-size"):
        assert "[set by the demo: " in lines[flag], lines[flag]


def test_a_trainer_that_fails_stops_the_others_and_the_demo_says_which(tmp_path, monkeypatch, capsys):
    """Review 49: the demo went on waiting for the others, which waited for the failed one (up to 10 minutes with
    --wait-for-trainers), then trained without it. Stand-in trainers: one fails as the other waits for it."""
    ready = tmp_path / "waiting"
    waiting = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        def stop(signum, frame):
            print("stopped by the demo", flush=True)
            sys.exit(130)
        signal.signal(signal.SIGINT, stop)
        print("waiting for 2 trainers", flush=True)
        pathlib.Path({str(ready)!r}).touch()
        time.sleep(30)  # (a real trainer waits up to 600 s)
    """)
    failing = textwrap.dedent(f"""
        import pathlib, sys, time
        deadline = time.monotonic() + 60
        while not pathlib.Path({str(ready)!r}).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        print("dmoe-train: the averaging port is taken", flush=True)
        sys.exit(3)
    """)
    started: list[Proc] = []

    def stand_in(args, env=None):
        started.append(Proc(["-c", failing if args[args.index("--data-shard") + 1] == "0" else waiting], env))
        return started[-1]

    def trainer_args(i: int, initial_peers: str) -> list[str]:
        return ["--target-batch-size", "8", "--data-shard", str(i)]

    monkeypatch.setattr(demo, "Proc", stand_in)
    with running("-m", "dmoe.dht", "--port", "0") as dht:
        peer = dht.endpoint()
        begun = time.monotonic()
        assert demo.run_trainers(peer, trainer_args, 2, TrainConfig(steps=10)) == 1
        assert time.monotonic() - begun < 20  # not the 30 s the other waits
    assert started[1].popen.returncode == 130 and "stopped by the demo\n" in started[1].output, started[1].output
    out, err = capsys.readouterr()
    assert "[trainer 0] dmoe-train: the averaging port is taken" in out, out
    assert "dmoe-demo: trainer 0 exited with status 3 before it finished" in err, err
    assert "dmoe-demo: trainer 0 failed (exit status 3); the others were stopped" in err, err


def test_sigterm_stops_the_demo_as_ctrl_c_does(text_file, tmp_path):
    """SIGTERM (a scheduler's or a supervisor's stop) killed the demo where it stood: exit status -15, nothing said,
    its servers and trainers left to notice on their own. Now it stops as on Ctrl-C."""
    out_dir = tmp_path / "demo"
    flags = ["-m", "dmoe.cli.demo", "--servers", "1", "--data", str(text_file), "--out-dir", str(out_dir),
             "--steps", "100000", "--layers", "1", "--grid", "2", "2", "--k-best", "2", "--hidden", "16", "--heads",
             "2", "--seq-len", "16", "--batch-size", "4", "--eval-batches", "1", "--eval-interval", "1000",
             "--checkpoint-interval", "1000", "--sample-bytes", "0", "--threads", "1"]
    with running(*flags) as proc:
        proc.wait_for("swarm up in", timeout=120)
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=120) == 130, "".join(proc.output)
    assert "interrupted; the swarm has been shut down" in "".join(proc.output)


def parsed_demo(monkeypatch, text_file, tmp_path, *flags: str) -> dict:
    """Runs ``dmoe-demo`` up to its swarm, which a stand-in replaces: what the swarm would have been given."""
    given: dict = {}

    def stand_in(swarm_config, config, trainer_args, trainers):
        given.update(config=config, trainer_args=trainer_args, trainers=trainers)
        return 0

    monkeypatch.setattr(demo, "run_swarm", stand_in)
    assert demo.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), *flags]) == 0
    return given


def test_collaborate_is_accepted_as_the_help_offers_it(text_file, tmp_path, monkeypatch):
    """--collaborate was checked before the demo set --experts remote, so it was always refused, as needing
    --experts remote (which nobody had given)."""
    alone = parsed_demo(monkeypatch, text_file, tmp_path, "--collaborate", "myrun", "--target-batch-size", "16")
    assert alone["trainer_args"] is None and alone["config"].collaborate == "myrun"
    assert alone["config"].experts == "remote" and alone["config"].target_batch_size == 16
    three = parsed_demo(monkeypatch, text_file, tmp_path, "--trainers", "3", "--collaborate", "myrun")
    args = three["trainer_args"](1, "127.0.0.1:5000")
    assert args[args.index("--collaborate") + 1] == "myrun" and args[args.index("--initial-peers") + 1] == \
        "127.0.0.1:5000"
    assert args[args.index("--target-batch-size") + 1] == str(3 * three["config"].batch_size)


def test_the_demo_s_usage_errors_name_the_demo_and_say_what_a_config_file_sets(text_file, tmp_path, monkeypatch,
                                                                               capsys):
    """They were printed as dmoe-train's, and a config file holding one of the demo's own flags was refused as an
    unknown key of dmoe-train's."""
    monkeypatch.setattr(demo, "run_swarm", lambda *args: pytest.fail("the swarm started"))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), "--k-best", "99"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("dmoe-demo: error: --k-best 99 is more than")
    config = tmp_path / "demo.toml"
    config.write_text("servers = 3\nsteps = 2\n")
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--config", str(config), "--data", str(text_file), "--out-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"dmoe-demo: error: config {config}: key 'servers' is one of dmoe-demo's own flags, which a config file does "
        "not set (it sets dmoe-train's flags); give --servers on the command line")
    config.write_text("steps = 3\n")  # dmoe-train's flags it sets
    assert parsed_demo(monkeypatch, text_file, tmp_path, "--config", str(config), "--steps", "2")["config"].steps == 2
    assert parsed_demo(monkeypatch, text_file, tmp_path, "--config", str(config))["config"].steps == 3


class StandInSwarm:
    """What run_swarm sees of a LocalSwarm whose one server exits with ``status`` as it stops."""

    def __init__(self, status: int):
        self.status, self.server_statuses = status, []
        self.initial_peers, self.server_endpoints = "127.0.0.1:1", ["127.0.0.1:2"]
        self.servers = [Proc(["-c", "print('dmoe-server: error: the last checkpoint could not be written')"])]

    def start(self):
        return self

    def wait_declared(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.servers[0].popen.wait(30)
        self.server_statuses = [self.status]


@pytest.mark.parametrize("trainers", [1, 2])
def test_a_server_that_could_not_write_its_experts_last_checkpoint_fails_the_demo(monkeypatch, tmp_path, capsys,
                                                                                  trainers):
    """Review 96 D-med-1: the demo said so and exited 0, where dmoe-server (and --processes) exit 1."""
    monkeypatch.setattr(demo, "train", lambda config: {"interrupted": False, "final_val_perplexity": 9.0, "step": 3})
    monkeypatch.setattr(demo, "run_trainers", lambda *args: 0)
    swarm_config = demo.SwarmConfig(layers=("ffn0",), grid=(2, 2), n_servers=1, checkpoint_root=tmp_path)
    for status, expected in ((1, 1), (0, 0)):
        monkeypatch.setattr(demo, "LocalSwarm", lambda config: StandInSwarm(status))
        trainer_args = (lambda i, peers: []) if trainers > 1 else None
        assert demo.run_swarm(swarm_config, TrainConfig(layers=1, grid=(2, 2)), trainer_args, trainers) == expected
    assert "dmoe-demo: server 0 did not stop cleanly (exit status 1)" in capsys.readouterr().err


def test_a_resume_with_another_count_of_trainers_is_refused_and_experts_without_a_trainer_checkpoint_warned_of(
        text_file, tmp_path, monkeypatch, capsys):
    """Review 96 D-med-2: a --resume with another --trainers resumed the experts and started the dense part from
    step 0 (its checkpoints are elsewhere for each count), refused by nothing, and exited 0."""
    monkeypatch.setattr(demo, "LocalSwarm", lambda config: StandInSwarm(0))
    monkeypatch.setattr(demo, "run_trainers", lambda *args: 0)
    monkeypatch.setattr(demo, "train", lambda config: {"interrupted": False, "final_val_perplexity": 9.0, "step": 3})
    out_dir = tmp_path / "out"
    flags = ["--data", str(text_file), "--out-dir", str(out_dir), "--servers", "1"]
    assert demo.main([*flags, "--trainers", "2"]) == 0  # records its swarm (the stand-in's servers save nothing)
    (out_dir / "experts" / "server0").mkdir()
    (out_dir / "experts" / "server0" / "experts.pt").write_bytes(b"")  # what a server saved as the demo stopped
    capsys.readouterr()

    assert demo.main([*flags, "--resume"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("dmoe-demo: --resume: ") and "--trainers was 2, now 1" in error, error

    assert demo.main([*flags, "--trainers", "2", "--resume"]) == 0  # killed before the trainers' first checkpoint
    error = capsys.readouterr().err
    assert "dmoe-demo: warning: --resume: the experts resume from their checkpoints" in error, error
    assert f"no trainer checkpoint is at {out_dir.resolve() / 'trainer0' / 'checkpoint.pt'}, " in error, error

    for i in range(2):
        (out_dir / f"trainer{i}").mkdir(exist_ok=True)
        (out_dir / f"trainer{i}" / "checkpoint.pt").write_bytes(b"")
    assert demo.main([*flags, "--trainers", "2", "--resume"]) == 0
    assert "warning" not in capsys.readouterr().err
    (out_dir / "experts" / "swarm.json").write_text('{"servers": 1}\n')  # the record of an older demo
    assert demo.main([*flags, "--resume"]) == 0
    error = capsys.readouterr().err
    assert f"no trainer checkpoint is at {out_dir.resolve() / 'checkpoint.pt'}: " in error, error
    assert f"trainer checkpoints are at {out_dir.resolve() / 'trainer0' / 'checkpoint.pt'}, " in error, error


def test_a_server_that_fails_to_start_is_reported_by_its_error_line_not_its_last_line():
    """Review 96 D-low-3: the demo showed the last line of a multi-line error, which named neither file nor flag."""
    output = ["2026-11-28 09:16:16 INFO dmoe.dht.node: DHT node bound to UDP 127.0.0.1:1\n",
              "usage: dmoe-server [-h] [--experts EXPERTS]\n",
              "dmoe-server: error: argument --checkpoint-dir: /x/server1/experts.pt cannot be read (UnpicklingError: "
              "Weights only load failed.\n",
              "Please file an issue\n", "Unsupported operand 103\n", "\n",
              "Check the documentation of torch.load ...); move it away to start these experts from scratch\n"]
    assert demo.failure_lines(output) == ("dmoe-server: error: argument --checkpoint-dir: /x/server1/experts.pt "
                                          "cannot be read (UnpicklingError: Weights only load failed. / Please file an "
                                          "issue / Unsupported operand 103")
    assert demo.failure_lines(["Traceback (most recent call last):\n", "  ...\n", "RuntimeError: boom\n"]) == \
        "RuntimeError: boom"
    assert demo.failure_lines([f"dmoe-dht: error: {'x' * 900}\n"]) == f"dmoe-dht: error: {'x' * 483} ..."
    assert demo.failure_lines([]) == "(it printed nothing)"


def test_ctrl_c_on_a_collaboration_says_what_the_demo_waits_for_and_shows_the_trainers_stopping(tmp_path, monkeypatch,
                                                                                                capsys):
    """Review 96 D-low-5: after the first Ctrl-C the demo said nothing while its trainers saved (tens of seconds with
    an averaging round in flight), and a second Ctrl-C killed them unsaved. Stand-in trainers that save on SIGINT."""
    trainer = textwrap.dedent("""
        import pathlib, signal, sys, time
        def stop(signum, frame):
            print("stopping after the step in flight, then saving the checkpoint", flush=True)
            time.sleep(0.5)
            print("checkpoint saved", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGINT, stop)
        print("step 1", flush=True)
        pathlib.Path(sys.argv[1]).touch()
        time.sleep(60)
    """)
    ready = [tmp_path / f"trainer{i}" for i in range(2)]
    monkeypatch.setattr(demo, "Proc", lambda args, env=None: Proc(["-c", trainer, str(ready[int(args[-1])])], env))

    def ctrl_c_once_both_run() -> None:
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    with running("-m", "dmoe.dht", "--port", "0") as dht:
        peer = dht.endpoint()
        threading.Thread(target=ctrl_c_once_both_run, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            demo.run_trainers(peer, lambda i, peers: ["--target-batch-size", "8", "--data-shard", str(i)], 2,
                              TrainConfig(steps=10))
    out, err = capsys.readouterr()
    assert "dmoe-demo: interrupted: stopping 2 trainers, each after its step in flight and then saving its " \
           "checkpoint (up to 60 s; interrupt again to kill them unsaved)" in err, err
    for i in range(2):
        assert f"[trainer {i}] stopping after the step in flight, then saving the checkpoint\n" in out, out
        assert f"[trainer {i}] checkpoint saved\n" in out, out
