"""``python -m dmoe.directory``: DHT nodes (as ``dmoe-dht`` runs them) whose first node declares experts served
elsewhere and keeps them declared: swarms of declarers for tests and benchmarks, without expert servers.

    python -m dmoe.directory --initial-peers 127.0.0.1:31337 --declare 'ffn0.[0:16].[0:4]' --endpoint 127.0.0.1:8000

Takes every ``dmoe-dht`` flag. Prints ``dmoe-directory listening on HOST:PORT`` once the experts are declared.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Sequence

from dmoe.cli.config import duration
from dmoe.cli.dht import build_parser, check_declaration_expiration, parse_args, serve
from dmoe.dht.node import DHTNode
from dmoe.directory.announcer import announce_forever
from dmoe.directory.declarations import declare
from dmoe.uid import expand_pattern

logger = logging.getLogger("dmoe.directory")  # this module's __name__ is __main__ when run as a program
PROG = "dmoe-directory"


def parse_directory_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--declare", required=True, metavar="PATTERN",
                        help="experts to declare, e.g. 'ffn0.[0:16].[0:4]' (declared by the first node)")
    parser.add_argument("--endpoint", required=True, help="endpoint to declare the experts at (HOST:PORT)")
    parser.add_argument("--refresh-period", type=duration(), default=20.0, help="seconds between declarations")
    parser.add_argument("--expiration", type=duration(), default=None,
                        help="seconds a declaration lives (default: 3 refresh periods)")
    parser.add_argument("--no-refresh", action="store_true", help="declare once and never again")
    args = parse_args(argv, parser)
    check_declaration_expiration(parser, args.refresh_period, args.expiration)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_directory_args(argv)

    async def start(node: DHTNode) -> asyncio.Task | None:
        uids = expand_pattern(args.declare)
        expiration = 3 * args.refresh_period if args.expiration is None else args.expiration
        results = await declare(node, uids, args.endpoint, expiration)
        logger.info("declared %d of %d experts at %s for %.1fs", sum(results), len(uids), args.endpoint, expiration)
        if args.no_refresh:
            return None
        return asyncio.ensure_future(announce_forever(node, uids, args.endpoint, args.refresh_period, expiration,
                                                      declared=all(results)))

    return serve(args, start, PROG)


if __name__ == "__main__":
    sys.exit(main())
