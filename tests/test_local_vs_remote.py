"""``dmoe-train --experts local`` is the same training as a remote swarm, less the network.

A one-server swarm (real DHT node and server processes) started with the trainer's ``expert_server_args()`` and
the in-process experts of ``--experts local`` must give the same loss curve, step by step, with the same seeds:
same initial expert weights, same optimizer, same steps. Any difference in how experts are trained (the client's
optimizer instead of the expert's own, another learning rate, a schedule) shows up within a few steps.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from dmoe.launch import LocalSwarm, SwarmConfig
from dmoe.trainer.loop import TrainConfig, make_moe_factory, train

torch.set_num_threads(1)


@pytest.fixture
def text_file(tmp_path):
    words = "the king queen sword crown night love death speak lord my thou art and of to a is".split()
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(len(words), (7,), generator=generator).tolist())
             for _ in range(400)]
    path = tmp_path / "verse.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def config_for(text_file, tmp_path, experts: str) -> TrainConfig:
    return TrainConfig(data=str(text_file), out_dir=str(tmp_path / experts), experts=experts, seq_len=16, hidden=32,
                       layers=1, heads=2, grid=(2, 2), k_best=2, batch_size=8, steps=8, warmup_steps=2,
                       eval_interval=4, eval_batches=2, checkpoint_interval=10**6, sample_bytes=0, threads=1,
                       expert_lr=0.01, seed=3, forward_timeout=60, backward_timeout=60, timeout_after_k_min=30)


def test_local_experts_train_exactly_as_a_one_server_swarm(text_file, tmp_path):
    local_config = config_for(text_file, tmp_path, "local")
    local = train(local_config)

    remote_config = config_for(text_file, tmp_path, "remote")
    swarm_config = SwarmConfig(layers=("ffn0",), grid=remote_config.grid, n_servers=1,
                               hidden_dim=remote_config.hidden, threads_per_server=1,
                               server_args=[*remote_config.expert_server_args(), "--torch-threads", "1"])
    layers = []
    with LocalSwarm(swarm_config) as swarm, contextlib.ExitStack() as resources:
        swarm.wait_declared()
        remote_config.initial_peers = (swarm.initial_peers,)
        factory = make_moe_factory(remote_config, resources)
        remote = train(remote_config, lambda i: layers.append(factory(i)) or layers[-1])
    assert layers[0].stats.experts_dropped == 0, layers[0].stats  # no expert lost: the same work both ways

    local_losses = [loss for _, loss in local["history"]["train"]]
    remote_losses = [loss for _, loss in remote["history"]["train"]]
    assert len(local_losses) == len(remote_losses) == 8
    assert local_losses[-1] < local_losses[0]  # the experts trained at all
    torch.testing.assert_close(remote_losses, local_losses, rtol=1e-4, atol=0)
    torch.testing.assert_close([v for _, v in remote["history"]["val"]], [v for _, v in local["history"]["val"]],
                               rtol=1e-4, atol=0)
