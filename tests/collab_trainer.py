"""A trainer of a collaboration for tests: ``dmoe-train`` (the real loop, :func:`dmoe.trainer.loop.train`) that also
saves the client's parameters after every change, and a hostile peer.

    python -m tests.collab_trainer --save-dir DIR [--go FILE] [dmoe-train flags]
    python -m tests.collab_trainer --hostile --initial-peers HOST:PORT --collaborate RUN [...]

Trainer: prints ``ready`` once imported, waits for the file ``--go`` (so that trainers started together begin
together, not in the order their imports finished), trains, saves ``DIR/step<s>.pt`` (the client's parameters)
whenever they change, and prints ``result {json}``: the final step and validation loss, and the backward calls its
mixture layers sent to experts (``expert_backward_calls``, ``expert_backward_failures``).

Hostile (``--hostile``): publishes bad progress records in the run and serves a state of the wrong shapes, then
prints ``hostile ready`` and runs until killed: trainer 1001 claims 10**9 samples; 1002 is stamped an hour in the
future; 1003 claims step 10**6 with no state server behind it; 1004 claims step 10**6 and serves a state of another
model (``--hostile-hidden``).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch


def trainer(args: argparse.Namespace, rest: list[str]) -> int:
    from dmoe.cli.train import parse_config
    from dmoe.trainer.loop import train

    config = parse_config(rest)
    save_dir = Path(args.save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    print("ready", flush=True)
    if args.go:
        while not Path(args.go).exists():
            time.sleep(0.05)
    seen = {}

    def save(step: int, model: torch.nn.Module) -> None:
        seen["model"] = model
        torch.save([p.detach().clone() for p in model.parameters()], save_dir / f"step{step}.pt")
        print(f"saved step {step}", flush=True)

    result = train(config, on_step=save)
    model = seen.get("model")
    stats = [block.moe.stats for block in model.blocks] if model is not None else []
    print("result " + json.dumps({
        "step": result["step"], "final_val_loss": result["final_val_loss"],
        "expert_backward_calls": sum(s.backward_calls for s in stats),
        "expert_backward_failures": sum(s.backward_failures for s in stats)}), flush=True)
    return 0


def hostile(args: argparse.Namespace) -> int:
    from dmoe import DHT
    from dmoe.collab.progress import ACCUMULATING, Progress, progress_key
    from dmoe.collab.state_sync import StateServer, StateServicer, TrainingState, encode_state
    from dmoe.trainer.model import GatedTransformerLM, ModelConfig

    model = GatedTransformerLM(ModelConfig(seq_len=args.seq_len, hidden=args.hostile_hidden, n_layers=1, n_heads=2,
                                           grid=(2, 2), k_best=2),
                               lambda i: torch.nn.Linear(args.hostile_hidden, args.hostile_hidden))
    opt = torch.optim.AdamW(model.parameters())
    state = encode_state(TrainingState.capture(10**6, "0badc0de", 3, list(model.parameters()), opt), args.collaborate)
    with DHT([args.initial_peers], client_mode=True) as dht, \
            StateServer(StateServicer(args.collaborate, lambda: state)) as server:
        key = progress_key(args.collaborate)
        print("hostile ready", flush=True)
        while True:
            now = time.time()
            records = {
                1001: Progress(0, 10**9, 1.0, now, None, ACCUMULATING, "0badc0de", 0),
                1002: Progress(0, 1, 1.0, now + 3600, None, ACCUMULATING, "0badc0de", 0),
                1003: Progress(10**6, 1, 1.0, now, "127.0.0.1:9", ACCUMULATING, "0badc0de", 3),
                1004: Progress(10**6, 1, 1.0, now, server.endpoint, ACCUMULATING, "0badc0de", 3),
            }
            dht.store_many({key: {pid: (p.encode(), now + 5) for pid, p in records.items()}})
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--save-dir")
    parser.add_argument("--go")
    parser.add_argument("--hostile", action="store_true")
    parser.add_argument("--hostile-hidden", type=int, default=24)
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("dmoe.dht", "dmoe.averaging", "dmoe.client"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.hostile:
        extra = argparse.ArgumentParser()
        extra.add_argument("--initial-peers", required=True)
        extra.add_argument("--collaborate", required=True)
        extra.add_argument("--seq-len", type=int, default=16)
        args = argparse.Namespace(**vars(args), **vars(extra.parse_args(rest)))
        return hostile(args)
    return trainer(args, rest)


if __name__ == "__main__":
    sys.exit(main())
