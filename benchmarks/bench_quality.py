"""Training quality under latency and failures: the gated transformer LM with local vs remote experts.

Three runs of ``clients.train.train`` with the same seed, data, steps and client settings:

* ``local``: in-process experts (no network at all);
* ``remote``: the same experts on a local swarm of two ``dmoe-server`` processes, found through the DHT;
* ``remote-faulty``: the same swarm with ``--inject-latency-ms 200 --latency-jitter exponential --fail-rate 0.1``:
  every expert call waits an exponential 200 ms on average and 10% of them fail (see dmoe/server/faults.py).

Reported: the final validation loss of each run and the ratios remote/local and remote-faulty/local
(goals: within 3% and 8%).

Fairness. Expert parameters are trained the way a server trains them in all three runs, not by the client's
optimizer: a server steps each expert's own Adam (constant ``--expert-lr``, torch defaults otherwise) once per
backward call that reaches it, with the gradients of that call only, while the client's AdamW with warm-up and
cosine decay trains only the client's own parameters (embeddings, attention, gates, head). The local run wraps
each in-process expert in a :class:`dmoe.server.backend.ExpertBackend` (the class the servers use) whose
parameters are hidden from the client's optimizer and which steps in backward, exactly like a server. Aligning
the other way (servers following the client's schedule) would need a scheduler on the servers that the client
cannot drive. Initial weights match too: expert ``uid`` starts from ``expert_seed(seed, uid)`` everywhere.

    python benchmarks/bench_quality.py                   # small CPU preset, < 10 min on 2 cores
    python benchmarks/bench_quality.py --preset gpu      # larger model and more steps, for a GPU box
    python benchmarks/bench_quality.py --quick           # tiny (what the test suite runs)
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import sys
import time
from pathlib import Path

import torch
from torch import nn

from clients.train import TrainConfig, make_moe_factory, train
from dmoe.client.moe import LocalMixtureOfExperts
from dmoe.dht import DHT
from dmoe.directory import get_experts
from dmoe.launch import LocalSwarm, SwarmConfig
from dmoe.server.backend import ExpertBackend, expert_seed, make_optimizer
from dmoe.server.layers import create_expert, expert_class
from dmoe.uid import grid_uids

VARIANTS = ("local", "remote", "remote-faulty")
GOALS = {"remote": 1.03, "remote-faulty": 1.08}

PRESETS = {
    # about 2 round trips forward + 2 backward per step at 200 ms: the faulty run dominates the wall time
    "small": dict(steps=120, hidden=64, seq_len=64, batch_size=16, grid=(4, 4), k_best=4, warmup_steps=12,
                  eval_interval=40, eval_batches=4),
    "gpu": dict(steps=1000, hidden=256, seq_len=128, batch_size=32, grid=(8, 8), k_best=4, warmup_steps=100,
                eval_interval=250, eval_batches=16, device="cuda"),
    "tiny": dict(steps=6, hidden=32, seq_len=16, batch_size=4, grid=(2, 2), k_best=2, warmup_steps=2,
                 eval_interval=3, eval_batches=2),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--quick", action="store_true", help="the tiny preset with little latency")
    parser.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    parser.add_argument("--data", default=None, help="text file (default: the Shakespeare corpus)")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--latency-ms", type=float, default=200.0, help="mean latency of the faulty run")
    parser.add_argument("--fail-rate", type=float, default=0.1, help="failing expert calls in the faulty run")
    parser.add_argument("--expert-lr", type=float, default=1e-3, help="each expert's Adam lr (servers and local)")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--timeout-after-k-min", type=float, default=0.5,
                        help="seconds a forward waits for slower experts once each token has one answer")
    parser.add_argument("--backward-timeout", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the client and of each server")
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--tag", default=None, help="file name stem (default: quality_<preset>)")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.latency_ms = "tiny", 20.0
    if "local" not in args.variants:
        parser.error("argument --variants: must include local (ratios are relative to it)")
    return args


class _ServerStep(torch.autograd.Function):
    """Forward without autograd; backward recomputes, returns the input gradient and steps the expert, as a
    server's ``ExpertBackend.backward`` does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, backend: ExpertBackend) -> torch.Tensor:
        ctx.backend = backend
        ctx.save_for_backward(x)
        with torch.no_grad():
            return backend.module(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        return ctx.backend.backward(x, grad)[0], None


class ServerTrainedExpert(nn.Module):
    """An in-process expert trained by its own optimizer in backward; its parameters are not this module's, so
    the client's optimizer (and gradient clipping) never touches them, just as with a remote expert."""

    def __init__(self, backend: ExpertBackend):
        super().__init__()
        self._backend = (backend,)  # a tuple, so nn.Module does not register the expert's parameters

    @property
    def backend(self) -> ExpertBackend:
        return self._backend[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ServerStep.apply(x, self.backend)


def local_factory(config: TrainConfig, args: argparse.Namespace):
    def expert(uid: str) -> nn.Module:
        module = create_expert(config.expert_cls, config.hidden, seed=expert_seed(args.seed, uid)).to(config.device)
        with torch.random.fork_rng(devices=[]):  # the sample must not shift the client's initialisation
            sample = expert_class(config.expert_cls).sample(2, config.hidden)
        backend = ExpertBackend(uid, module, sample, make_optimizer("adam", module.parameters(), args.expert_lr))
        return ServerTrainedExpert(backend)

    return lambda i: LocalMixtureOfExperts(config.hidden, tuple(config.grid), f"ffn{i}", k_best=config.k_best,
                                           expert_factory=expert)


def wait_declared(initial_peers: str, layers: int, grid, timeout: float = 60.0) -> None:
    """Blocks until every expert is found in the DHT, so the first steps do not run without experts."""
    uids = [uid for i in range(layers) for uid in grid_uids(f"ffn{i}", grid)]
    with DHT(initial_peers=[initial_peers]) as dht:
        deadline = time.monotonic() + timeout
        while not all(get_experts(dht, uids)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"experts were not declared in the DHT within {timeout} s")
            time.sleep(0.2)


def run_variant(variant: str, args: argparse.Namespace, out_dir: Path) -> dict:
    preset = dict(PRESETS[args.preset])
    if args.steps:
        preset["steps"] = args.steps
    config = TrainConfig(
        data=args.data, data_dir=args.data_dir, seed=args.seed, threads=args.threads, out_dir=str(out_dir / variant),
        checkpoint_interval=10**9, sample_bytes=0, experts="local" if variant == "local" else "remote",
        timeout_after_k_min=args.timeout_after_k_min, backward_timeout=args.backward_timeout, **preset)
    started = time.monotonic()
    layers: list[nn.Module] = []

    def recorded(factory):
        def build(i: int) -> nn.Module:
            layers.append(factory(i))
            return layers[-1]
        return build

    if variant == "local":
        result = train(config, recorded(local_factory(config, args)))
    else:
        server_args = ["--optimizer", "adam", "--lr", str(args.expert_lr), "--seed", str(args.seed),
                       "--torch-threads", str(args.threads), "--log-level", "WARNING",
                       "--device", "cuda" if config.device.startswith("cuda") else "cpu"]
        if variant == "remote-faulty":
            server_args += ["--inject-latency-ms", str(args.latency_ms), "--latency-jitter", "exponential",
                            "--fail-rate", str(args.fail_rate), "--fault-seed", str(args.seed)]
        swarm_config = SwarmConfig(layers=[f"ffn{i}" for i in range(config.layers)], grid=tuple(config.grid),
                                   n_servers=args.servers, hidden_dim=config.hidden, threads_per_server=args.threads,
                                   server_args=server_args)
        with LocalSwarm(swarm_config) as swarm, contextlib.ExitStack() as resources:
            wait_declared(swarm.initial_peers, config.layers, config.grid)
            config.initial_peers = (swarm.initial_peers,)
            result = train(config, recorded(make_moe_factory(config, resources)))
    minutes = (time.monotonic() - started) / 60
    chosen = sum(layer.stats.experts_chosen for layer in layers)
    dropped = sum(layer.stats.experts_dropped for layer in layers)
    if not chosen:  # e.g. the client found no experts: the run trained a model without its mixture layers
        raise RuntimeError(f"{variant}: no expert was ever called; the comparison would measure nothing")
    return {"variant": variant, "val_loss": round(result["final_val_loss"], 5), "steps": result["step"],
            "minutes": round(minutes, 2), "history": result["history"], "expert_calls": chosen,
            "dropped_share": round(dropped / chosen, 4)}


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), tight_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row in rows:
        steps, losses = zip(*row["history"]["val"])
        ax.plot(steps, losses, "o-", label=f"{row['variant']} (final {row['val_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation cross-entropy (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    args = parse_args(argv)
    stem = args.tag or f"quality_{args.preset}"
    out_dir = args.results / stem
    rows = []
    for variant in VARIANTS:
        if variant in args.variants:
            rows.append(run_variant(variant, args, out_dir))
            print(f"{variant}: validation loss {rows[-1]['val_loss']:.4f} after {rows[-1]['steps']} steps "
                  f"({rows[-1]['minutes']:.1f} min, {rows[-1]['dropped_share']:.1%} of "
                  f"{rows[-1]['expert_calls']} expert calls dropped)", flush=True)
    base = rows[0]["val_loss"]
    for row in rows:
        row["ratio_to_local"] = round(row["val_loss"] / base, 4)
        row["goal"] = GOALS.get(row["variant"], "")
    args.results.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = args.results / f"{stem}.csv", args.results / f"{stem}.png"
    fields = ["variant", "val_loss", "ratio_to_local", "goal", "steps", "minutes", "expert_calls", "dropped_share"]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    p = PRESETS[args.preset]
    title = (f"preset {args.preset}: h={p['hidden']} grid={'x'.join(map(str, p['grid']))} k={p['k_best']} "
             f"steps={args.steps or p['steps']}; faulty: {args.latency_ms:.0f} ms exp., {args.fail_rate:.0%} fail")
    plot(rows, png_path, title)
    print(title)
    print(f"{'variant':>14} {'val loss':>9} {'/ local':>8} {'goal':>6} {'minutes':>8} {'dropped':>8}")
    for row in rows:
        goal = f"{row['goal']:.2f}" if row["goal"] else ""
        print(f"{row['variant']:>14} {row['val_loss']:9.4f} {row['ratio_to_local']:8.4f} {goal:>6} {row['minutes']:8.1f} "
              f"{row['dropped_share']:8.1%}")
    print(f"wrote {csv_path} and {png_path}")
    return {"rows": rows, "csv": csv_path, "png": png_path}


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main() and 0)
