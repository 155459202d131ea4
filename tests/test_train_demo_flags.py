"""dmoe-train's and dmoe-demo's flags where they do nothing, and what a --resume says (review 90).

Fast: flags are parsed, checkpoints written and read directly (a tiny model, no training) or by two runs of a few
steps on stand-in mixture layers; the demo is run up to its swarm, which a stand-in replaces. No network.
"""
from __future__ import annotations

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
from dmoe.trainer import loop as trainer
from dmoe.trainer.loop import Progress, TrainConfig, load_checkpoint, save_checkpoint

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
    ("--expert-clip-grad-norm", "1", "--clip-grad-norm"), ("--expert-cls", "transformer", "--expert-cls")])
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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
