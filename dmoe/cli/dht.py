"""``dmoe-dht``: run a standalone DHT node (a bootstrap peer for servers and clients).

    python -m dmoe.dht --port 31337

Prints one line ``dmoe-dht listening on HOST:PORT`` once the node is up; pass that address to others as
``--initial-peers``. ``--num-nodes N`` runs N nodes on one event loop in this process (swarm tests and benchmarks on
few cores). What the first node stores is signed with the key in ``--identity PATH`` (created if absent) or an
ephemeral one. Stops cleanly on SIGINT, SIGTERM or SIGHUP (unless ignored: nohup, or a script's background job),
also while joining. Any flag may come from a TOML file (``--config``). Programs built on this one (``python -m
dmoe.directory``) add what their first node stores (:data:`Start`).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from typing import Awaitable, Callable, Sequence

from dmoe.cli.config import MAX_SECONDS, DefaultsHelpFormatter, add_config_argument, port_number
from dmoe.cli.config import parse_args as parse_with_config
from dmoe.cli.signals import ORPHAN_CHECK_PERIOD, orphaned, unignored_stop_signals
from dmoe.dht.config import DHTConfig
from dmoe.dht.node import DHTNode, parse_endpoint
from dmoe.dht.signing import Identity
from dmoe.endpoints import WILDCARD_HOSTS, bare_host, is_loopback_ip, join_host_port, machine_address, outbound_host

logger = logging.getLogger("dmoe.cli.dht")  # not __name__: that is __main__ when run as a program

#: What a program built on this one does once its nodes are up, before it says it is ready: it gets the first node
#: and may return a task that runs until shutdown (cancelled then).
Start = Callable[[DHTNode], Awaitable["asyncio.Task | None"]]
#: The config fields the program takes as flags: all but client_mode, as others join through this program's nodes,
#: and call_timeout, which only the blocking DHT facade uses.
FLAG_FIELDS = [field for field in dataclasses.fields(DHTConfig) if field.name not in ("client_mode", "call_timeout")]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: the flag fields that are durations in seconds: at most :data:`~dmoe.cli.config.MAX_SECONDS` (Python's waits
#: overflow past about 9.2e9 s)
SECONDS_FIELDS = ("rpc_timeout", "hedge_after", "dead_node_ttl", "default_expiration", "max_expiration",
                  "routing_refresh_period")


def _flag_bool(text: str) -> bool:
    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes")


def build_parser(prog: str = "dmoe-dht", description: str = __doc__.split("\n\n")[0]) -> argparse.ArgumentParser:
    """The node flags: where to listen, whom to join, the identity, and one flag per :class:`DHTConfig` field."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=DefaultsHelpFormatter)
    add_config_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (UDP)")
    parser.add_argument("--port", type=port_number, default=0, help="UDP port (0: any free port)")
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="HOST:PORT",
                        help="addresses of nodes already in the swarm (space- or comma-separated)")
    parser.add_argument("--num-nodes", type=int, default=1, help="run this many nodes in this process")
    parser.add_argument("--identity", default=None, metavar="PATH",
                        help="Ed25519 key file signing what the first node stores (created if absent; default: "
                             "ephemeral key)")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="logging level")
    for field in FLAG_FIELDS:
        kind = _flag_bool if isinstance(field.default, bool) else type(field.default)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default,
                            help=f"DHTConfig.{field.name}")
    return parser


def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
               ) -> argparse.Namespace:
    parser = parser or build_parser()
    args = parse_with_config(parser, argv)
    args.initial_peers = [peer for item in args.initial_peers for peer in item.split(",") if peer.strip()]
    if args.num_nodes < 1:
        parser.error("--num-nodes must be at least 1")
    for peer in args.initial_peers:
        try:
            parse_endpoint(peer)
        except ValueError as error:
            parser.error(f"argument --initial-peers: {error}")
    for field in FLAG_FIELDS:  # each flag alone first, so that the error names it (review 79: it named fields)
        value, flag = getattr(args, field.name), f"--{field.name.replace('_', '-')}"
        if value is field.default:
            continue
        try:
            DHTConfig(**{field.name: value})
        except ValueError as error:
            parser.error(f"argument {flag}: {error}" + ("" if "got" in str(error) else f" (got {value})"))
        if field.name in SECONDS_FIELDS and value > MAX_SECONDS:  # (DHTConfig refused nan, inf and negative ones)
            parser.error(f"argument {flag}: must be at most {MAX_SECONDS:.0f} seconds (a year), got {value}")
    try:
        DHTConfig(**{field.name: getattr(args, field.name) for field in FLAG_FIELDS})
    except ValueError as error:  # values fine alone and not together
        parser.error(f"DHT settings: {error}")
    return args


async def run(args: argparse.Namespace, start: Start | None = None, prog: str = "dmoe-dht") -> None:
    """Runs the nodes until SIGINT/SIGTERM (or until the launching process dies); ``start``: see :data:`Start`."""
    config = DHTConfig(**{field.name: getattr(args, field.name) for field in FLAG_FIELDS})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # an ignored one stays ignored, as in dmoe-server: SIGINT too, which stopped a DHT node started in a script's
    # background (SIGINT ignored) on a Ctrl-C meant for the script's foreground (review 96 D-low-4)
    for signum in unignored_stop_signals():
        loop.add_signal_handler(signum, stop.set)

    async def stop_when_orphaned() -> None:
        while not orphaned():
            await asyncio.sleep(ORPHAN_CHECK_PERIOD)
        logger.info("the launching process died")
        stop.set()

    watchdog = asyncio.ensure_future(stop_when_orphaned())
    try:
        identity = Identity.load_or_create(args.identity) if args.identity else None
    except (OSError, ValueError) as error:
        raise ValueError(f"--identity: {error}") from None
    nodes: list[DHTNode] = []
    started: asyncio.Task | None = None
    try:
        up = asyncio.ensure_future(bring_up(args, config, identity, nodes))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({up, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not up.done():  # a stop signal while joining (a slow or silent peer): no need to wait for it
            up.cancel()
            logger.info("stopped before the nodes were up")
            return
        stopped.cancel()
        addresses = up.result()
        if start is not None:
            started = await start(nodes[0])
        more = f" (and {len(addresses) - 1} more nodes: {' '.join(addresses[1:])})" if len(addresses) > 1 else ""
        print(f"{prog} listening on {addresses[0]}{more}", flush=True)
        ipv4 = ""  # an IPv6 wildcard takes IPv4 too (review 112 D6)
        if addresses[0].startswith("[") and bare_host(args.host) in WILDCARD_HOSTS and (machine := machine_address()):
            ipv4 = f" (from IPv4: {join_host_port(machine, addresses[0].rpartition(':')[2])})"
        logger.info("pass --initial-peers %s to join this swarm%s", addresses[0], ipv4)
        await stop.wait()
        logger.info("shutting down")
    finally:
        watchdog.cancel()
        if started is not None:
            started.cancel()
        for node in nodes:
            node.stop()


async def bring_up(args: argparse.Namespace, config: DHTConfig, identity: Identity | None,
                   nodes: list[DHTNode]) -> list[str]:
    """Starts ``args.num_nodes`` nodes (appended to ``nodes`` as they start) and joins them to the swarm; returns
    the addresses others reach them at. Raises ValueError naming the flag for an address it cannot listen on."""
    peers = [parse_endpoint(peer) for peer in args.initial_peers]
    addresses: list[str] = []
    for _ in range(args.num_nodes):
        node = DHTNode(config, identity=identity if not nodes else None)
        nodes.append(node)
        try:
            host, port = await node.listen(args.port if not addresses else 0, bare_host(args.host))
        except OSError as error:
            raise ValueError(f"--host {args.host} --port {args.port if not addresses else 0}: cannot listen there: "
                             f"{error}") from None
        # bound to every interface: others reach it at this machine's address (the next nodes here too: a
        # reply to a ping of 0.0.0.0 comes from another address, and is dropped as not the one asked)
        # (an IPv6 wildcard is shown at the IPv6 route's address: an IPv4 one was, review 112 D6)
        ipv6 = ":" in host
        shown = (outbound_host(peers) or machine_address(ipv6) or ("::1" if ipv6 else "127.0.0.1")
                 if host in WILDCARD_HOSTS else host)
        addresses.append(join_host_port(shown, port))
        if peers and not await node.bootstrap(peers):
            hint = ""
            if is_loopback_ip(host) and outbound_host(peers) is not None:
                hint = f" (this node listens on {host}, from where no other machine can be reached: --host 0.0.0.0)"
            raise ConnectionError(f"none of the initial peers {args.initial_peers} answered{hint}")
        peers = peers or [(shown, port)]
    return addresses


def serve(args: argparse.Namespace, start: Start | None = None, prog: str = "dmoe-dht") -> int:
    """Sets up logging and runs :func:`run`; returns the exit status (1, with the reason logged, when joining fails
    or a flag's value is refused)."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kademlia").setLevel(logging.WARNING)
    try:
        asyncio.run(run(args, start, prog))
    except (ConnectionError, ValueError) as error:
        logger.error("%s", error)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


def check_declaration_expiration(parser: argparse.ArgumentParser, refresh_period: float,
                                 expiration: float | None) -> float:
    """The expiration of a program's expert declarations (``--expiration``, by default 3 ``--refresh-period``s);
    a usage error naming the flag when it is beyond the DHT's ``max_expiration``: every node would refuse the
    declarations, and the experts would never be seen."""
    declared = 3 * refresh_period if expiration is None else expiration
    if declared > DHTConfig.max_expiration:
        flag = "--refresh-period (--expiration defaults to 3 periods)" if expiration is None else "--expiration"
        parser.error(f"argument {flag}: declarations expiring {declared:.0f} s after each refresh exceed the DHT's "
                     f"max_expiration of {DHTConfig.max_expiration:.0f} s, and every node would refuse them")
    return declared
