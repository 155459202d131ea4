"""dmoe-train's and dmoe-demo's flags where they do nothing, and what a --resume says (review 90, items 4, 9, 10, 11).

Fast: flags are parsed, checkpoints written and read directly (a tiny model, no training) or by two runs of a few
steps on stand-in mixture layers; the demo is run up to its swarm, which a stand-in replaces. No network.
"""
from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dmoe.cli import demo
from dmoe.cli import train as train_program
from dmoe.cli.train import parse_config
from dmoe.launch import Proc, SwarmConfig
from dmoe.trainer import loop as trainer
from dmoe.trainer.loop import Progress, TrainConfig, learning_rate, load_checkpoint, save_checkpoint, train

torch.set_num_threads(1)
REMOTE = ["--experts", "remote", "--initial-peers", "127.0.0.1:5000"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    words = "the king queen sword crown night love death speak lord my thou art and of to a is".split()
    path = tmp_path_factory.mktemp("text") / "verse.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(7)) for _ in range(600)) + "\n")
    return path


def usage_error(argv: list[str], capsys) -> str:
    """The last line dmoe-train's parse printed when it refused ``argv`` (status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def parsed_demo(monkeypatch, text_file, tmp_path, *flags: str) -> dict:
    """Runs ``dmoe-demo`` up to its swarm, which a stand-in replaces: what the swarm would have been given."""
    given: dict = {}

    def stand_in(swarm_config, config, trainer_args, trainers):
        given.update(swarm_config=swarm_config, config=config, trainer_args=trainer_args, trainers=trainers)
        return 0

    monkeypatch.setattr(demo, "run_swarm", stand_in)
    assert demo.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), *flags]) == 0
    return given


# ---- item 4: the in-process experts' flags with --experts remote ----

@pytest.mark.parametrize("flag, value, server_flag", [
    ("--expert-lr", "0.5", "--lr"), ("--expert-optimizer", "sgd", "--optimizer"),
    ("--expert-clip-grad-norm", "1", "--clip-grad-norm"), ("--expert-cls", "nop", "--expert-cls")])
def test_dmoe_train_refuses_the_in_process_experts_flags_with_remote_experts(flag, value, server_flag, tmp_path,
                                                                            capsys):
    """They were accepted and ignored (the servers train remote experts by their own flags)."""
    line = usage_error([*REMOTE, flag, value], capsys)
    assert line.startswith(f"dmoe-train: error: {flag} is only used with --experts local") and server_flag in line
    config_file = tmp_path / "c.toml"
    typed = value if flag in ("--expert-optimizer", "--expert-cls") else float(value)
    config_file.write_text(f"{flag[2:]} = {json.dumps(typed)}\n")
    assert flag in usage_error([*REMOTE, "--config", str(config_file)], capsys)
    parse_config(["--experts", "local", flag, value])  # where they train the experts
    parse_config(REMOTE)  # (their defaults, not given: nothing to refuse)


def test_the_demo_and_its_collaborating_trainers_accept_them_for_the_servers_they_start(text_file, tmp_path,
                                                                                       monkeypatch):
    given = parsed_demo(monkeypatch, text_file, tmp_path, "--expert-lr", "0.01", "--expert-optimizer", "sgd")
    assert given["config"].expert_flags_reach_servers
    assert "--lr" in given["swarm_config"].server_args and "0.01" in given["swarm_config"].server_args
    # the trainers of a collaboration are dmoe-train processes given the user's flags, in the demo's environment
    env = train_program.EXPERT_FLAGS_REACH_SERVERS_ENV
    assert demo.TRAINER_ENV[env] == "1"
    three = parsed_demo(monkeypatch, text_file, tmp_path, "--trainers", "3", "--expert-lr", "0.01")
    argv = three["trainer_args"](1, "127.0.0.1:5000")
    ran = []
    monkeypatch.setattr(train_program, "train", lambda config, on_step: ran.append(config) or {"interrupted": False})
    monkeypatch.setenv(env, "1")
    train_program.main(argv)
    assert ran[0].expert_lr == 0.01 and ran[0].experts == "remote" and ran[0].expert_flags_reach_servers
    monkeypatch.delenv(env)
    with pytest.raises(SystemExit):  # the same flags to a plain dmoe-train
        train_program.main(argv)


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)


def checkpoint(tmp_path, config: TrainConfig, step: int, history: dict | None = None,
               drop: tuple[str, ...] = ()) -> Path:
    """A checkpoint of ``config`` at ``step`` (without the keys ``drop``: an older checkpoint's layout)."""
    path = tmp_path / "checkpoint.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    model = TinyModel()
    progress = Progress(step, history or {"train": [], "val": [], "val_seconds": []})
    save_checkpoint(path, model, torch.optim.AdamW(model.parameters()), config, progress)
    if drop:
        state = torch.load(path, weights_only=True)
        for key in drop:
            del state[key]
        torch.save(state, path)
    return path


def resume(path: Path, config: TrainConfig, capsys) -> tuple[Progress, list[str]]:
    """Loads ``path`` as ``config`` would resume it: its progress and what it said."""
    model = TinyModel()
    capsys.readouterr()
    progress = load_checkpoint(path, model, torch.optim.AdamW(model.parameters()), config)
    return progress, capsys.readouterr().out.splitlines()


def settings(text_file, tmp_path, **overrides) -> TrainConfig:
    return TrainConfig(**{"data": str(text_file), "out_dir": str(tmp_path), "experts": "remote",
                          "initial_peers": ("127.0.0.1:5000",), **overrides})


def test_a_remote_trainer_resumed_says_nothing_of_the_experts_settings_that_its_servers_set(text_file, tmp_path,
                                                                                           capsys):
    """It said "resuming with --expert-lr ..." as if it took effect, and refused another --expert-cls as "a
    different model", though neither reaches a remote expert."""
    path = checkpoint(tmp_path, settings(text_file, tmp_path, expert_lr=0.5, expert_clip_grad_norm=1.0,
                                         expert_cls="transformer"), 2)
    _, said = resume(path, settings(text_file, tmp_path), capsys)
    assert not [line for line in said if "expert" in line], said
    demo_config = settings(text_file, tmp_path, expert_lr=0.1, expert_cls="transformer")
    demo_config.expert_flags_reach_servers = True  # the demo: its servers were started with them
    _, said = resume(path, demo_config, capsys)
    assert "resuming with --expert-lr 0.1 (the checkpoint was trained with 0.5)" in said
    assert "resuming with --expert-clip-grad-norm 0.0 (the checkpoint was trained with 1.0)" in said
    demo_config.expert_cls = "ffn"
    with pytest.raises(trainer.ResumeMismatch, match="--expert-cls was 'transformer', now 'ffn'"):
        resume(path, demo_config, capsys)


# ---- item 11: --checkpoint '', --steps on resume, the data split ----

def test_an_empty_checkpoint_path_is_refused_as_an_empty_data_path_is(tmp_path, capsys):
    """It meant OUT_DIR/checkpoint.pt, unsaid."""
    assert usage_error(["--checkpoint", ""], capsys).startswith("dmoe-train: error: --checkpoint must name a file")
    config_file = tmp_path / "c.toml"
    config_file.write_text('checkpoint = ""\n')
    assert "--checkpoint must name a file" in usage_error(["--config", str(config_file)], capsys)


@pytest.mark.parametrize("flag", ["--out-dir", "--data-dir"])
def test_an_empty_directory_flag_is_refused_as_an_empty_checkpoint_path_is(flag, tmp_path, capsys):
    """--out-dir "" (an unset shell variable) wrote the checkpoint, its lock and the loss curve into the current
    directory, and a --resume resumed whatever checkpoint.pt was there (review 100 D10)."""
    said = f"dmoe-train: error: {flag} must name a directory (leave it out for the default)"
    assert usage_error([flag, ""], capsys) == said
    config_file = tmp_path / "c.toml"
    config_file.write_text(f'{flag[2:]} = " "\n')
    assert usage_error(["--config", str(config_file)], capsys) == said


def test_an_empty_config_path_is_refused_naming_the_flag(capsys):
    """It read as "config : cannot read it: No such file or directory"."""
    assert usage_error(["--config", ""], capsys) == \
        "dmoe-train: error: argument --config: must name a TOML file (leave it out for none)"


def test_a_resume_with_more_steps_says_how_the_learning_rate_moves(text_file, tmp_path, capsys):
    """A finished 400-step run resumed with --steps 800: the cosine schedule is stretched, and the rate jumped 6x
    without a word."""
    path = checkpoint(tmp_path, settings(text_file, tmp_path, steps=400), 400)
    _, said = resume(path, settings(text_file, tmp_path, steps=800), capsys)
    before = learning_rate(400, settings(text_file, tmp_path, steps=400))
    after = learning_rate(400, settings(text_file, tmp_path, steps=800))
    assert after > 5 * before
    assert (f"resuming with --steps 800 (the checkpoint was trained with 400): the learning rate goes from "
            f"{before:.3g} to {after:.3g} at step 401 (warm-up and cosine decay now span 800 steps)") in said, said
    _, said = resume(path, settings(text_file, tmp_path, steps=400), capsys)  # the same: nothing said
    assert not [line for line in said if "learning rate" in line]
    _, said = resume(path, settings(text_file, tmp_path, steps=300), capsys)  # no step left: no rate to speak of
    assert not [line for line in said if "learning rate" in line]


def test_a_resume_on_another_split_of_the_text_says_so(text_file, tmp_path, capsys):
    """--data, --val-fraction and --data-shard(s) were neither compared nor announced: a larger --val-fraction
    validated on text the checkpoint was trained on."""
    path = checkpoint(tmp_path, settings(text_file, tmp_path), 2)
    _, said = resume(path, settings(text_file, tmp_path, val_fraction=0.3), capsys)
    assert ("resuming with --val-fraction 0.3 (the checkpoint was trained with 0.05): the validation tail now holds "
            "text the checkpoint was trained on") in said
    _, said = resume(path, settings(text_file, tmp_path, data_shard=1, data_shards=2), capsys)
    assert "resuming with --data-shard 1 (the checkpoint was trained with 0)" in said
    assert "resuming with --data-shards 2 (the checkpoint was trained with 1)" in said
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text())
    _, said = resume(path, settings(other, tmp_path), capsys)
    assert f"resuming on another text: {other.resolve()} (the checkpoint was trained on {text_file.resolve()})" in said
    saved_with_other = checkpoint(tmp_path / "other", settings(other, tmp_path), 2)
    other.write_text(text_file.read_text() + "more\n")
    _, said = resume(saved_with_other, settings(other, tmp_path), capsys)
    assert any(line.startswith(f"resuming on {other.resolve()}, which changed since the checkpoint") for line in said)
    _, said = resume(path, settings(text_file, tmp_path), capsys)  # the same split: nothing said
    assert said == [f"resumed from {path} at step 2"]


def test_a_checkpoint_written_before_the_text_was_recorded_still_resumes(text_file, tmp_path, capsys):
    path = checkpoint(tmp_path, settings(text_file, tmp_path), 2, drop=("text",))
    progress, said = resume(path, settings(text_file, tmp_path), capsys)
    assert progress.step == 2 and said == [f"resumed from {path} at step 2"]
    _, said = resume(path, settings(text_file, tmp_path, val_fraction=0.3), capsys)  # (compared by its flags)
    assert any(line.startswith("resuming with --val-fraction 0.3") for line in said)


class StandInMixture(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.ffn = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + self.ffn(x)


def test_a_finished_run_resumed_with_other_validation_flags_is_validated_again(text_file, tmp_path, capsys):
    """It reprinted the figure stored at its step, measured on other windows, as the final validation loss."""
    def run(**overrides):
        config = TrainConfig(**{**dict(data=str(text_file), out_dir=str(tmp_path / "run"), seq_len=16, hidden=16,
                                       layers=1, heads=2, grid=(2, 2), k_best=2, batch_size=4, steps=3, warmup_steps=1,
                                       eval_interval=100, eval_batches=1, checkpoint_interval=1000, sample_bytes=0,
                                       threads=1), **overrides})
        return train(config, lambda i: StandInMixture(config.hidden))

    first = run()
    capsys.readouterr()
    again = run(resume=True, eval_batches=6)
    assert "validating step 3 again: --eval-batches changed since the checkpoint's validation" in \
        capsys.readouterr().out
    assert again["final_val_loss"] != first["final_val_loss"]
    assert [step for step, _ in again["history"]["val"]] == [0, 3]  # replaced, not doubled
    same = run(resume=True, eval_batches=6)  # now validated with these flags: its figure is kept
    assert same["final_val_loss"] == again["final_val_loss"]


# ---- items 9, 10, 11: dmoe-demo ----

@pytest.mark.parametrize("flags, refused", [
    (["--experts", "local"], "--experts"),
    (["--initial-peers", "10.0.0.1:31337"], "--initial-peers"),
    (["--trainers", "2", "--data-shard", "1"], "--data-shard"),  # was refused as "must be below --data-shards 1"
    (["--trainers", "2", "--data-shards", "4"], "--data-shards"),
    (["--trainers", "2", "--wait-for-trainers", "5"], "--wait-for-trainers"),
])
def test_the_demo_refuses_the_dmoe_train_flags_it_sets_itself(flags, refused, text_file, tmp_path, monkeypatch,
                                                              capsys):
    """They were accepted and silently overridden."""
    monkeypatch.setattr(demo, "run_swarm", lambda *args: pytest.fail("the swarm started"))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"dmoe-demo: error: {refused} is set by dmoe-demo itself"), line


@pytest.mark.parametrize("flags", [["--trainers", "3"], ["--collaborate", "solo", "--target-batch-size", "64"]])
def test_the_demo_refuses_averaging_client_mode_for_its_trainers_on_one_machine(flags, text_file, tmp_path,
                                                                                monkeypatch, capsys):
    """With every trainer in client mode none owns a part of the averaging or serves the state: each stepped alone,
    and the end waited a minute for a state nobody served (review 112 D2)."""
    monkeypatch.setattr(demo, "run_swarm", lambda *args: pytest.fail("the swarm started"))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), "--averaging-client-mode", *flags])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("dmoe-demo: error: argument --averaging-client-mode: the demo's trainers all run on this "
                           "machine"), line


@pytest.mark.parametrize("text, flags, said", [
    (None, [], "--data {path}: cannot read it: No such file or directory"),
    ("", [], "{path} has 0 bytes: its validation tail (0 bytes, 0.05 of it held out for validation) is too short"),
    ("x" * 300, ["--trainers", "3", "--val-fraction", "0.5"],
     "slice 0 of 3 of {path} holds 50 bytes: too short for windows of 64 tokens"),
], ids=["missing", "empty", "slices"])
def test_the_demo_reads_its_data_before_it_starts_its_swarm(text, flags, said, tmp_path, monkeypatch, capsys):
    """An empty --data was told by each trainer after the swarm's 16 s of start-up (review 112 D4)."""
    monkeypatch.setattr(demo, "run_swarm", lambda *args: pytest.fail("the swarm started"))
    path = tmp_path / "text.txt"
    if text is not None:
        path.write_text(text)
    assert demo.main(["--data", str(path), "--out-dir", str(tmp_path / "out"), *flags]) == 1
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"dmoe-demo: {said.format(path=path)}"), line


def test_the_demo_still_takes_a_slice_of_the_text_for_its_one_trainer(text_file, tmp_path, monkeypatch):
    config = parsed_demo(monkeypatch, text_file, tmp_path, "--data-shard", "1", "--data-shards", "2")["config"]
    assert (config.data_shard, config.data_shards) == (1, 2)


@pytest.mark.parametrize("spelled", [["--conf", "c.toml"], ["--confi=c.toml"], ["--config", "c.toml"],
                                     ["--config=c.toml"]])
def test_the_collaboration_s_trainers_get_the_config_file_however_argparse_took_it(spelled, tmp_path, monkeypatch):
    """--conf (an abbreviation argparse accepts) stayed relative, and the trainers, which run from the repository's
    root, did not find the file."""
    monkeypatch.chdir(tmp_path)
    out = demo.absolute_config(["--data", "c.toml", *spelled, "--steps", "2"])
    assert out[:2] == ["--data", "c.toml"] and out[-2:] == ["--steps", "2"]
    assert str(tmp_path / "c.toml") in " ".join(out), out


def fake_swarm(monkeypatch, start):
    """LocalSwarm replaced by one whose ``start(self)`` is ``start``."""
    class FakeSwarm:
        def __init__(self, config):
            self.config, self.dht, self.servers, self.server_statuses = config, None, [], []
            self.initial_peers, self.server_endpoints = "127.0.0.1:1", ["127.0.0.1:2"]

        def start(self):
            start(self)
            return self

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def wait_declared(self):
            pass

    monkeypatch.setattr(demo, "LocalSwarm", FakeSwarm)


def test_a_server_that_does_not_start_is_one_line_its_last(tmp_path, monkeypatch, capsys):
    """The demo printed the server's whole output: 40 lines of usage above its error."""
    usage = "\n".join(["usage: dmoe-server [-h]"] + [f"   [--flag{i}]" for i in range(40)]
                      + ["dmoe-server: error: argument --checkpoint-dir: it holds other experts"])

    def start(swarm):
        swarm.servers.append(Proc(["-c", f"import sys; print({usage!r}); sys.exit(2)"]))
        swarm.servers[0].wait_for("listening on")

    fake_swarm(monkeypatch, start)
    config = TrainConfig(experts="remote", initial_peers=("127.0.0.1:1",))
    swarm_config = SwarmConfig(layers=("ffn0",), grid=(2, 2), n_servers=1, checkpoint_root=tmp_path / "experts")
    assert demo.run_swarm(swarm_config, config, None, 1) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("dmoe-demo: the swarm did not start: server 0 exited with status 2: dmoe-server: error: "
                       "argument --checkpoint-dir: it holds other experts (--verbose shows its whole output)"), err
    assert len(err) == 1 and not (tmp_path / "experts" / demo.SWARM_FILE).exists()


def test_a_demo_whose_final_validation_was_cut_says_it_was_skipped_not_nan(text_file, tmp_path, monkeypatch, capsys):
    """It said "validation perplexity nan", which read as a run that diverged (review 112 D2)."""
    fake_swarm(monkeypatch, lambda swarm: None)
    monkeypatch.setattr(demo, "train", lambda config: {"interrupted": True, "final_val_loss": float("nan"),
                                                       "final_val_perplexity": float("nan"), "step": 3})
    assert demo.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out")]) == 130
    out = capsys.readouterr().out
    assert "demo interrupted: final validation skipped after 3 steps; shutting the swarm down" in out, out
    assert "nan" not in out


def test_a_demo_resumed_with_another_swarm_is_refused_naming_the_flag(text_file, tmp_path, monkeypatch, capsys):
    """A --resume with another --servers ended in 40 lines of a server's usage naming --checkpoint-dir."""
    out_dir = tmp_path / "out"
    fake_swarm(monkeypatch, lambda swarm: None)
    monkeypatch.setattr(demo, "train", lambda config: {"interrupted": False, "final_val_perplexity": 1.0, "step": 1})
    flags = ["--data", str(text_file), "--out-dir", str(out_dir), "--grid", "4", "4"]
    assert demo.main([*flags, "--servers", "2"]) == 0
    record = json.loads((out_dir / "experts" / demo.SWARM_FILE).read_text())
    assert record == {"servers": 2, "layers": 2, "grid": [4, 4], "hidden": 128, "expert_cls": "ffn", "trainers": 1}
    for i in range(2):  # what its servers wrote as they stopped
        (out_dir / "experts" / f"server{i}").mkdir(parents=True)
        (out_dir / "experts" / f"server{i}" / "experts.pt").write_bytes(b"experts")
    capsys.readouterr()
    monkeypatch.setattr(demo, "run_swarm", lambda *args: pytest.fail("the swarm started"))
    assert demo.main([*flags, "--servers", "1", "--resume"]) == 1
    assert capsys.readouterr().err == (
        f"dmoe-demo: --resume: the experts checkpointed in {(out_dir / 'experts').resolve()} were trained by another "
        "swarm: --servers was 2, now 1 (resume with the flags the demo was started with, or leave out --resume to "
        "start afresh)\n")
    assert demo.main([*flags[:-3], "--grid", "4", "2", "--servers", "2", "--resume"]) == 1
    assert "--grid was 4 4, now 4 2" in capsys.readouterr().err
    resumed = parsed_demo(monkeypatch, text_file, tmp_path, "--grid", "4", "4", "--servers", "2", "--resume")
    assert resumed["config"].resume  # the same swarm: resumed
    (out_dir / "experts" / demo.SWARM_FILE).unlink()  # a demo's directory from before the record: not refused here
    assert parsed_demo(monkeypatch, text_file, tmp_path, "--grid", "4", "4", "--servers", "1", "--resume")
    # started afresh: the experts and their swarm's record are forgotten
    parsed_demo(monkeypatch, text_file, tmp_path, "--grid", "4", "4", "--servers", "1")
    assert not list((out_dir / "experts").glob("server*/experts.pt"))


def test_the_demo_without_resume_starts_its_trainers_afresh_over_their_checkpoints(text_file, tmp_path, monkeypatch):
    """dmoe-train refuses to write over a checkpoint without --resume or --fresh (review 108 D1); the demo says that
    without --resume it starts afresh: its trainer (in process, or each of a collaboration's) is given --fresh."""
    one = parsed_demo(monkeypatch, text_file, tmp_path)["config"]
    assert one.fresh and not one.resume
    assert not parsed_demo(monkeypatch, text_file, tmp_path, "--resume")["config"].fresh
    assert "--fresh" in parsed_demo(monkeypatch, text_file, tmp_path, "--trainers", "2")["trainer_args"](1, "h:1")
    resumed = parsed_demo(monkeypatch, text_file, tmp_path, "--trainers", "2", "--resume")["trainer_args"](1, "h:1")
    assert "--fresh" not in resumed and "--resume" in resumed


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# ---- review 100 D2: an expert class that takes no [rows, hidden] ----

def test_an_expert_class_that_takes_no_rows_of_hidden_is_refused_by_dmoe_train_and_the_demo(text_file, tmp_path,
                                                                                           monkeypatch, capsys):
    """``--expert-cls transformer`` took the rows a mixture layer sends for one sequence: dmoe-train trained a model
    whose tokens saw later tokens and other samples; the demo's servers refused every call and it ended with 0."""
    line = usage_error(["--experts", "local", "--expert-cls", "transformer"], capsys)
    assert line.startswith("dmoe-train: error: --expert-cls transformer: expert class 'transformer' takes "
                           "[2, 32, 128] float32") and "one [rows, 128] tensor" in line, line
    monkeypatch.setattr(demo, "run_swarm", lambda *args: pytest.fail("the swarm started"))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), "--expert-cls", "transformer"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("dmoe-demo: error: --expert-cls transformer: ")
    parse_config(["--experts", "local", "--expert-cls", "nop"])


def test_in_process_experts_refuse_a_class_that_does_not_take_or_answer_rows_of_hidden():
    from dmoe.server.in_process import ExpertOptimizerConfig, in_process_experts
    importlib.import_module("tests.custom_experts")  # registers "widen" (answers rows twice as wide)

    with pytest.raises(ValueError, match="expert class 'transformer' takes"):
        in_process_experts("transformer", 8, ExpertOptimizerConfig())
    build = in_process_experts("widen", 8, ExpertOptimizerConfig())
    with pytest.raises(ValueError, match=r"expert class 'widen' answers rows of \[\[16\]\]"):
        build("ffn0.0")
    assert in_process_experts("ffn", 8, ExpertOptimizerConfig())("ffn0.0")(torch.randn(3, 8)).shape == (3, 8)


def test_an_out_of_memory_of_the_demo_s_trainer_is_one_line_naming_the_batch_flags(text_file, tmp_path, monkeypatch,
                                                                                  capsys):
    """As dmoe-train's (review 108 D2): the demo's one trainer runs in its process, and its out-of-memory ended the
    demo in a traceback naming no flag."""
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 22.35 GiB.")

    monkeypatch.setattr(demo, "run_swarm", out_of_memory)
    assert demo.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), "--batch-size", "4"]) == 1
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("dmoe-demo: out of memory on --device cpu with --batch-size 4 x --seq-len"), line
