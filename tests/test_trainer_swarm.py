"""The trainer against a real local swarm (a DHT node and an expert server as processes): what it asks the swarm
before and while it trains (review 112 D1: a --hidden other than the servers' --hidden-dim had every request
refused, and the run trained a dense-only model to the end, exit status 0).
"""
from __future__ import annotations

import contextlib

import pytest

from dmoe.cli import train as train_program
from dmoe.client.moe import RemoteMixtureOfExperts
from dmoe.launch import LocalSwarm, SwarmConfig
from dmoe.trainer.loop import ExpertsOfAnotherWidth, ExpertWidthCheck, TrainConfig, train
from dmoe.trainer.model import GatedTransformerLM
from tests.procs import running
from tests.test_trainer import text_file, tiny  # noqa: F401

SWARM_WIDTH = 32


def test_dmoe_train_with_another_hidden_than_the_swarms_experts_is_refused_naming_the_flag(text_file, tmp_path,
                                                                                           capsys):
    swarm_config = SwarmConfig(layers=("ffn0",), grid=(2, 2), n_servers=1, hidden_dim=SWARM_WIDTH,
                               server_args=["--torch-threads", "1"])
    with LocalSwarm(swarm_config) as swarm:
        swarm.wait_declared()
        with pytest.raises(SystemExit) as exited:
            train_program.main(["--data", str(text_file), "--out-dir", str(tmp_path / "run"), "--experts", "remote",
                                "--initial-peers", swarm.initial_peers, "--hidden", "16", "--heads", "2",
                                "--layers", "1", "--seq-len", "16", "--grid", "2", "2", "--k-best", "2",
                                "--steps", "3", "--sample-bytes", "0", "--threads", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.rstrip("\n").split("\n")[-1] == (
        "dmoe-train: error: --hidden 16: the swarm's ffn0 experts take 32-wide rows (their servers' --hidden-dim)")
    assert "dropped from this call" not in err  # refused before any step asked an expert
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_experts_of_another_width_that_join_after_the_trainer_are_refused_once_found(text_file, tmp_path):
    """The trainer may start before the servers: the layers find no expert to ask before step 0, and the first
    step that finds some asks one."""
    config = tiny(text_file, tmp_path, hidden=16, layers=1, steps=100_000, max_minutes=1.0, eval_interval=100_000,
                  checkpoint_interval=100_000, experts="remote", forward_timeout=5, timeout_after_k_min=0.5)
    with running("-m", "dmoe.dht", "--port", "0") as dht, contextlib.ExitStack() as servers:
        config.initial_peers = (dht.endpoint(),)

        def server_after_the_first_step(step: int, model) -> None:
            if step == 1:  # (its experts are declared as it starts: later steps find them)
                server = servers.enter_context(running(
                    "-m", "dmoe.cli.server", "--experts", "ffn0.[0:2].[0:2]", "--hidden-dim", str(SWARM_WIDTH),
                    "--host", "127.0.0.1", "--port", "0", "--initial-peers", dht.endpoint(), "--torch-threads", "1"))
                server.endpoint()

        with pytest.raises(ValueError, match="--hidden 16: the swarm's ffn0 experts take 32-wide rows"):
            train(config, on_step=server_after_the_first_step)


def schema(width: int) -> dict:
    return {"inputs": [((width,), "float32")]}


@pytest.mark.parametrize("answers, refused", [
    ([], False),  # none answers yet: asked again after a step that chose experts
    ([schema(32), schema(16)], False),  # one server of another width (misconfigured, or hostile) stops no trainer
    ([schema(32), schema(32)], True),
])
def test_a_layer_is_refused_only_when_none_of_the_experts_that_answer_takes_its_width(answers, refused):
    config = TrainConfig(hidden=16, heads=2, layers=1, grid=(2, 2), k_best=2, experts="remote",
                         initial_peers=("127.0.0.1:1",))
    model = GatedTransformerLM(config.model_config(), lambda i: RemoteMixtureOfExperts(16, (2, 2), f"ffn{i}",
                                                                                     dht=object(), k_best=2))
    model.blocks[0].moe.expert_schemas = lambda timeout: iter(answers)
    check = ExpertWidthCheck(model, config)
    with pytest.raises(ExpertsOfAnotherWidth) if refused else contextlib.nullcontext():
        check(before_steps=True)
        assert len(check.unchecked) == (not answers)
