"""The main job (``make demo``): a whole swarm on this machine, and a client training against it.

Starts a DHT bootstrap node and ``--servers`` expert servers (each a real process hosting a slice of every
layer's grid, announced in the DHT), then trains the gated transformer LM with remote experts for a few minutes,
prints the validation perplexity and shuts everything down, also on Ctrl-C.

    python -m clients.swarm_demo                       # Shakespeare, 2 servers, 2 layers of 4x4 ffn experts
    python -m clients.swarm_demo --servers 3 --max-minutes 10 --hidden 256

Every ``dmoe-train`` flag works here too (``--steps``, ``--grid``, ``--data``, ...); ``--experts`` and
``--initial-peers`` are set by the demo. Across machines, the same pieces are three commands:
``dmoe-dht``, ``dmoe-server --initial-peers ...`` on each volunteer, ``dmoe-train --experts remote --initial-peers ...``.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from dmoe.cli.allocator import keep_freed_memory
from dmoe.cli.train import build_parser, parse_config
from dmoe.launch import LocalSwarm, SwarmConfig
from dmoe.trainer.data import DownloadError
from dmoe.trainer.loop import train


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()
    demo = argparse.ArgumentParser(add_help=False)
    demo.add_argument("--servers", type=int, default=2, help="expert servers to start (each hosts a slice)")
    demo.add_argument("--server-threads", type=int, default=1, help="torch threads per expert server")
    demo.add_argument("--verbose", action="store_true", help="show the servers' and DHT node's logs")
    args, rest = demo.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        demo.print_help()
        build_parser().print_help()
        return 0
    config = parse_config(["--max-minutes", "4", "--out-dir", "runs/demo", *rest])
    config.experts = "remote"  # with the swarm's DHT node as the initial peer, once it is up
    if not 1 <= args.servers <= config.grid[0]:
        demo.error(f"argument --servers: must be between 1 and the first grid dimension ({config.grid[0]})")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    swarm_config = SwarmConfig(
        layers=tuple(f"ffn{i}" for i in range(config.layers)), grid=tuple(config.grid), n_servers=args.servers,
        hidden_dim=config.hidden, threads_per_server=args.server_threads, echo=args.verbose,
        # the experts train (and start) as --experts local ones would: one source of truth, the trainer's flags
        server_args=(*config.expert_server_args(), "--refresh-period", "5",
                     "--log-level", "INFO" if args.verbose else "WARNING"),
    )
    started = time.monotonic()
    print(f"starting a local swarm: 1 DHT node, {args.servers} expert servers, "
          f"{config.layers} layers x {'x'.join(map(str, config.grid))} {config.expert_cls} experts ...", flush=True)
    try:
        with LocalSwarm(swarm_config) as swarm:
            print(f"swarm up in {time.monotonic() - started:.1f}s: DHT at {swarm.initial_peers}, "
                  f"servers at {', '.join(swarm.server_endpoints)}", flush=True)
            swarm.wait_declared()
            config.initial_peers = (swarm.initial_peers,)
            result = train(config)
            print(f"demo done: validation perplexity {result['final_val_perplexity']:.2f} after {result['step']} "
                  f"steps; shutting the swarm down", flush=True)
    except KeyboardInterrupt:
        print("interrupted; the swarm has been shut down", file=sys.stderr)
        return 130
    except (DownloadError, FileNotFoundError) as error:
        print(f"swarm_demo: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
