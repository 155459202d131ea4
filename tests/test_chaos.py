"""Chaos under training: an expert server and a DHT node die (SIGKILL) mid-training; training goes on.

A small version of benchmarks/bench_chaos.py: the trainer (dmoe/trainer) runs against a local swarm of real
processes; when it has made a given number of forward passes, one server and one DHT node are killed, and later
the server is started again. Training must finish without raising, its loss must fall, and the progress bar must
show the experts that were dropped.
"""
from __future__ import annotations

import contextlib
import random
import re
import threading

import torch

from dmoe.launch import LocalSwarm, SwarmConfig
from dmoe.trainer.loop import TrainConfig, make_moe_factory, train
from tests.procs import Proc, processes

HIDDEN = 32


def verse(path) -> str:
    rng = random.Random(0)
    words = "the king queen sword crown night love death speak lord my thou art and of to a is".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 9))).capitalize() + rng.choice(".,;!?")
             for _ in range(1500)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


class ForwardCounter:
    """Counts the mixture layers' forward passes; runs a callback inline once, and wakes whoever waits."""

    def __init__(self):
        self.count = 0
        self._cond = threading.Condition()
        self.inline: tuple[int, object] | None = None  # (count, callback) run in the training thread

    def hook(self, *_):
        with self._cond:
            self.count += 1
            self._cond.notify_all()
        if self.inline is not None and self.count == self.inline[0]:
            self.inline[1]()

    def wait_for(self, count: int, stop: threading.Event) -> bool:
        with self._cond:
            while self.count < count and not stop.is_set():
                self._cond.wait(0.5)
            return not stop.is_set()


def test_training_survives_a_killed_server_and_dht_node(tmp_path, capsys):
    swarm_config = SwarmConfig(layers=("ffn0", "ffn1"), grid=(4, 4), n_servers=2, hidden_dim=HIDDEN,
                               server_args=["--refresh-period", "1", "--optimizer", "adam", "--lr", "3e-3",
                                            "--torch-threads", "1"])
    config = TrainConfig(data=verse(tmp_path / "verse.txt"), out_dir=str(tmp_path / "run"), seq_len=32,
                         hidden=HIDDEN, layers=2, heads=2, grid=(4, 4), k_best=4, batch_size=8, steps=80, lr=1e-2,
                         warmup_steps=5, eval_interval=40, eval_batches=2, checkpoint_interval=1000,
                         sample_bytes=0, threads=1, experts="remote", forward_timeout=5, backward_timeout=5,
                         timeout_after_k_min=0.5)
    counter, stop, events = ForwardCounter(), threading.Event(), []
    with LocalSwarm(swarm_config) as swarm, processes() as procs, contextlib.ExitStack() as resources:
        procs.append(extra_dht := Proc(["-m", "dmoe.dht", "--initial-peers", swarm.initial_peers]))
        config.initial_peers = (extra_dht.endpoint(),)  # the trainer joins through the node that will die
        base = make_moe_factory(config, resources)

        def factory(i: int) -> torch.nn.Module:
            layer = base(i)
            layer.register_forward_hook(counter.hook)
            return layer

        def kill() -> None:
            # inline, right after block 0's mixture ran: block 1's forward is the first call to meet the dead
            # server, so its experts are dropped in forward (a kill before a backward would only cost gradients)
            swarm.servers[1].kill()
            extra_dht.kill()
            events.append(("killed", counter.count))

        counter.inline = (2 * 20 + 1, kill)  # two mixture layers per step (validation adds a few passes)

        def chaos() -> None:
            if counter.wait_for(2 * 45, stop):
                swarm.restart_server(1)
                events.append(("restarted", counter.count))

        chaos_thread = threading.Thread(target=chaos)
        chaos_thread.start()
        try:
            result = train(config, moe_factory=factory)
        finally:
            stop.set()
            chaos_thread.join()
    assert [name for name, _ in events] == ["killed", "restarted"], events
    assert result["step"] == config.steps and not result["interrupted"]
    first_val, last_val = result["history"]["val"][0][1], result["final_val_loss"]
    assert last_val < first_val - 0.5, (first_val, last_val)
    after_kill = dict(result["history"]["val"])[40]  # the kill came at step 20, the restart at step 45
    assert last_val < after_kill - 0.1, result["history"]["val"]  # still learning after the kill (~0.4 lower)
    err = capsys.readouterr().err
    shares = [float(share) for share in re.findall(r"dropped=([\d.]+)%", err)]
    assert shares and max(shares) > 0, "the progress bar never showed dropped experts"
