"""``dmoe-dht``: run a standalone DHT node (a bootstrap peer for servers and clients), optionally declaring experts.

    python -m dmoe.dht --port 31337
    python -m dmoe.dht --initial-peers 127.0.0.1:31337 --declare 'ffn0.[0:16].[0:4]' --endpoint 127.0.0.1:8000

Prints one line ``dmoe-dht listening on HOST:PORT`` once the node is up (and, with ``--declare``, once the
experts are declared); pass that address to others as ``--initial-peers``. Declarations are signed with the key
in ``--identity PATH`` (created if absent) or an ephemeral one. ``--num-nodes N`` runs N nodes on
one event loop in this process (swarm tests and benchmarks on few cores). Stops cleanly on SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from typing import Sequence

from dmoe.dht.config import DHTConfig
from dmoe.dht.experts import announce_forever, declare_experts
from dmoe.dht.node import DHTNode, parse_endpoint
from dmoe.dht.signing import Identity
from dmoe.signals import ORPHAN_CHECK_PERIOD, orphaned
from dmoe.uid import expand_pattern

log = logging.getLogger("dmoe.dht")


def _flag_bool(text: str) -> bool:
    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dmoe-dht", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (UDP)")
    parser.add_argument("--port", type=int, default=0, help="UDP port (0: any free port)")
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="HOST:PORT",
                        help="addresses of nodes already in the swarm (space- or comma-separated)")
    parser.add_argument("--num-nodes", type=int, default=1, help="run this many nodes in this process")
    parser.add_argument("--declare", default=None, metavar="PATTERN",
                        help="experts to declare, e.g. 'ffn0.[0:16].[0:4]' (declared by the first node)")
    parser.add_argument("--endpoint", default=None, help="endpoint to declare the experts at (HOST:PORT)")
    parser.add_argument("--refresh-period", type=float, default=20.0, help="seconds between re-declarations")
    parser.add_argument("--expiration", type=float, default=None,
                        help="seconds a declaration lives (default: 3 refresh periods)")
    parser.add_argument("--no-refresh", action="store_true", help="declare once and never refresh")
    parser.add_argument("--identity", default=None, metavar="PATH",
                        help="Ed25519 key file signing the declarations (created if absent; default: ephemeral key)")
    parser.add_argument("--log-level", default="INFO")
    for field in dataclasses.fields(DHTConfig):
        kind = _flag_bool if isinstance(field.default, bool) else type(field.default)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default,
                            help=f"DHTConfig.{field.name} (default {field.default})")
    args = parser.parse_args(argv)
    args.initial_peers = [peer for item in args.initial_peers for peer in item.split(",") if peer.strip()]
    if args.declare and not args.endpoint:
        parser.error("--declare needs --endpoint")
    if args.num_nodes < 1:
        parser.error("--num-nodes must be at least 1")
    return args


async def run(args: argparse.Namespace) -> None:
    config = DHTConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(DHTConfig)})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    async def stop_when_orphaned() -> None:
        while not orphaned():
            await asyncio.sleep(ORPHAN_CHECK_PERIOD)
        log.info("the launching process died")
        stop.set()

    watchdog = asyncio.ensure_future(stop_when_orphaned())
    identity = Identity.load_or_create(args.identity) if args.identity else None
    nodes: list[DHTNode] = []
    announcer: asyncio.Task | None = None
    try:
        peers = [parse_endpoint(peer) for peer in args.initial_peers]
        addresses = []
        for _ in range(args.num_nodes):
            node = DHTNode(config, identity=identity if not nodes else None)
            nodes.append(node)
            host, port = await node.listen(args.port if not addresses else 0, args.host)
            addresses.append(f"{host}:{port}")
            if peers and not await node.bootstrap(peers):
                raise ConnectionError(f"none of the initial peers {args.initial_peers} answered")
            peers = peers or [(host, port)]
        if args.declare:
            uids = expand_pattern(args.declare)
            expiration = 3 * args.refresh_period if args.expiration is None else args.expiration
            results = await declare_experts(nodes[0], uids, args.endpoint, expiration)
            log.info("declared %d of %d experts at %s for %.1fs", sum(results), len(uids), args.endpoint, expiration)
            if not args.no_refresh:
                async def refresh() -> None:
                    await asyncio.sleep(args.refresh_period)
                    await announce_forever(nodes[0], uids, args.endpoint, args.refresh_period, expiration)
                announcer = asyncio.ensure_future(refresh())
        more = f" (and {len(addresses) - 1} more nodes: {' '.join(addresses[1:])})" if len(addresses) > 1 else ""
        print(f"dmoe-dht listening on {addresses[0]}{more}", flush=True)
        log.info("pass --initial-peers %s to join this swarm", addresses[0])
        await stop.wait()
        log.info("shutting down")
    finally:
        watchdog.cancel()
        if announcer is not None:
            announcer.cancel()
        for node in nodes:
            node.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kademlia").setLevel(logging.WARNING)
    try:
        asyncio.run(run(args))
    except (ConnectionError, ValueError) as error:
        log.error("%s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
