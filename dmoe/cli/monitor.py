"""``dmoe-monitor``: a web page showing the swarm live, per layer grid: alive experts, their hosts, load and latency.

    dmoe-monitor --initial-peers HOST:PORT --layers ffn0 ffn1 --grid 4 4 --port 8080

Prints ``dmoe-monitor listening on HOST:PORT`` once the page is served (open ``http://HOST:PORT/``; the data it
draws is at ``/api/swarm``). Stops cleanly on Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from typing import Sequence

from dmoe.cli.config import DefaultsHelpFormatter, add_config_argument, parse_args, port_number, positive
from dmoe.cli.signals import StopSignals
from dmoe.dht import parse_endpoint
from dmoe.endpoints import host_at_fault, join_host_port
from dmoe.monitor import MonitorServer, SwarmMonitor
from dmoe.uid import is_valid_prefix

logger = logging.getLogger("dmoe.cli.monitor")  # not __name__: that is __main__ when run as a program




def _layer(text: str) -> str:
    if not is_valid_prefix(text) or "." in text:
        raise argparse.ArgumentTypeError(f"invalid layer name {text!r} (letters, digits, _ or -, no dots)")
    return text


#: the most grid cells (over all layers) the page shows: each is read from the DHT every period
MAX_CELLS = 1 << 16


def _peer(text: str) -> str:
    try:
        parse_endpoint(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``dmoe-monitor`` (each also a key of a ``--config`` TOML file)."""
    parser = argparse.ArgumentParser(prog="dmoe-monitor", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_config_argument(parser)
    parser.add_argument("--initial-peers", nargs="+", required=True, type=_peer, metavar="HOST:PORT",
                        help="any DHT node of the swarm (printed by dmoe-dht or dmoe-server)")
    parser.add_argument("--layers", nargs="+", default=["ffn0"], type=_layer, metavar="NAME", help="layers to show")
    parser.add_argument("--grid", nargs="+", type=positive(int), default=[4, 4], metavar="SIZE",
                        help="the grid of every layer, one size per dimension")
    parser.add_argument("--host", default="127.0.0.1", help="interface the page is served on (0.0.0.0: all)")
    parser.add_argument("--port", type=port_number, default=0, help="HTTP port of the page (0: any free port)")
    parser.add_argument("--period", type=positive(float), default=2.0,
                        help="seconds between reads of the DHT and the experts' counters")
    parser.add_argument("--info-timeout", type=positive(float), default=1.0,
                        help="seconds to wait for one expert's info answer before showing it unreachable")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), help="logging level")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the monitor until SIGINT/SIGTERM; returns the exit status."""
    parser = build_parser()
    args = parse_args(parser, argv)
    repeated = sorted({layer for layer in args.layers if args.layers.count(layer) > 1})
    if repeated:  # each copy counted every expert again
        parser.error(f"argument --layers: {', '.join(repeated)} given more than once")
    cells = math.prod(args.grid) * len(args.layers)
    if cells > MAX_CELLS:
        parser.error(f"argument --grid: {cells} cells to show, at most {MAX_CELLS} (the page reads every one each "
                     "period)")
    for flag in ("period", "info_timeout"):
        if not getattr(args, flag) < 86400:
            parser.error(f"argument --{flag.replace('_', '-')}: must be under a day, got {getattr(args, flag)}")
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kademlia").setLevel(logging.WARNING)
    # the page's port first: a bad --host or a port in use was refused only once the DHT node had joined, and with
    # unreachable --initial-peers as well, only those were named, after the join's timeout (review 112 D5)
    try:
        server = MonitorServer(None, args.host, args.port)
    except OSError as error:
        flag = "--host" if host_at_fault(error) else "--port"  # (a --host not of this machine blamed --port)
        parser.error(f"argument {flag}: cannot listen on {join_host_port(args.host, args.port)}: "
                     f"{error.strerror or error}")
    try:
        monitor = SwarmMonitor(args.initial_peers, args.layers, args.grid, period=args.period,
                               info_timeout=args.info_timeout)
    except ConnectionError as error:
        server.close()
        parser.error(f"argument --initial-peers: {error}")
    server.monitor = monitor
    with StopSignals() as stop, monitor, server:
        print(f"dmoe-monitor listening on {server.endpoint}", flush=True)
        logger.info("open http://%s/ to watch %s", server.endpoint, ", ".join(args.layers))
        signum = stop.wait()
        logger.info("%s received, shutting down", signal.Signals(signum).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
