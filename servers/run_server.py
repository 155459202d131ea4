"""``dmoe-server``: host a grid of experts and train them with whatever gradients clients send.

Example: ``dmoe-server --experts 'ffn0.[0:4].[0:4]' --expert-cls ffn --hidden-dim 1024 --port 5000``.
Prints ``dmoe-server listening on HOST:PORT`` once it accepts calls; stops cleanly on Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import signal
import socket
import sys
from pathlib import Path

import torch

from dmoe.dht import parse_endpoint
from dmoe.server import ExpertServer, ServerConfig, expert_class_names
from dmoe.server.dht_announcer import DHTAnnouncer
from dmoe.server.server import resolve_device
from dmoe.server.backend import OPTIMIZERS
from dmoe.server.runtime import AUTOCAST_DTYPES
from dmoe.uid import UIDError, expand_pattern
from dmoe.wire import MAX_MESSAGE_BYTES
from dmoe.wire.codec import COMPRESSIONS

logger = logging.getLogger("dmoe-server")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0: any free port), got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"num_heads\": 8}'")
    return value


def import_custom_module(spec: str) -> None:
    """Imports a module (dotted name or .py path) so that its ``@register_expert_class`` classes exist."""
    if spec.endswith(".py"):
        path = Path(spec)
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None or not path.exists():
            raise ImportError(f"cannot import {spec}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)


class StopSignals:
    """Waits in the main thread for SIGINT or SIGTERM, whichever thread of the process the kernel hands it to.

    An Event set from a Python signal handler is not enough: when the signal lands on a gRPC or torch thread, the
    main thread blocked in ``Event.wait()`` is never interrupted, so the handler never runs. The C-level handler
    writes to the wakeup fd no matter which thread caught the signal, and reading that fd wakes the main thread.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> "StopSignals":
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self.received: list[int] = []
        self._old_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._old_handlers = {s: signal.signal(s, lambda signum, _: self.received.append(signum))
                              for s in self.SIGNALS}
        return self

    def wait(self) -> int:
        """Blocks until a stop signal arrives; returns its number."""
        while not self.received:
            self._reader.recv(64)  # the Python handler has run by the time the next line executes
        return self.received[0]

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self._old_fd)
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._reader.close()
        self._writer.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmoe-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", required=True, help="uids or a pattern, e.g. 'ffn0.[0:4].[0:4]'")
    parser.add_argument("--expert-cls", default="ffn", help="registered expert class (built in: ffn, transformer, nop)")
    parser.add_argument("--expert-kwargs", type=json_object, default={}, help="JSON constructor arguments")
    parser.add_argument("--custom-module", action="append", default=[],
                        help="module or .py file registering extra expert classes (repeatable)")
    parser.add_argument("--hidden-dim", type=positive_int, default=1024)
    parser.add_argument("--device", default=None, help="cuda, cpu, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--autocast", choices=sorted(AUTOCAST_DTYPES), default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=0)
    parser.add_argument("--max-batch-size", type=positive_int, default=4096)
    parser.add_argument("--max-message-bytes", type=positive_int, default=MAX_MESSAGE_BYTES)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--clip-grad-norm", type=positive_float, default=None)
    parser.add_argument("--compression", choices=sorted(COMPRESSIONS), default="none",
                        help="response compression when a client asks for none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=positive_int, default=None, help="torch intra-op threads")
    dht = parser.add_argument_group("DHT", "how the server announces its experts")
    dht.add_argument("--initial-peers", nargs="*", default=[],
                     help="HOST:PORT of any DHT node (printed by dmoe-dht); none: this server starts a new DHT")
    dht.add_argument("--dht-port", type=port_number, default=0, help="UDP port of the server's own DHT node")
    dht.add_argument("--announce-host", default=None,
                     help="host others should call (e.g. a public address behind NAT); default: --host")
    dht.add_argument("--refresh-period", type=positive_float, default=10.0,
                     help="seconds between re-declarations of the experts")
    dht.add_argument("--expiration", type=positive_float, default=None,
                     help="seconds a declaration outlives its last refresh (default: 3 refresh periods)")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for spec in args.custom_module:
        try:
            import_custom_module(spec)
        except Exception as error:
            parser.error(f"argument --custom-module: cannot import {spec!r}: {error}")
    if args.expert_cls not in expert_class_names():
        parser.error(f"argument --expert-cls: unknown class {args.expert_cls!r}; "
                     f"registered: {', '.join(expert_class_names())}")
    try:
        uids = expand_pattern(args.experts)
    except UIDError as error:
        parser.error(f"argument --experts: {error}")
    try:
        device = resolve_device(args.device)
    except RuntimeError as error:
        parser.error(f"argument --device: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda was asked for but torch sees no CUDA device")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    config = ServerConfig(host=args.host, port=args.port, device=args.device, max_batch_size=args.max_batch_size,
                          autocast=args.autocast, response_compression=args.compression,
                          max_message_bytes=args.max_message_bytes)
    for peer in args.initial_peers:
        try:
            parse_endpoint(peer)
        except ValueError as error:
            parser.error(f"argument --initial-peers: {error}")
    try:
        server = ExpertServer.create(uids, args.expert_cls, args.hidden_dim, cls_kwargs=args.expert_kwargs,
                                     optimizer=args.optimizer, lr=args.lr, clip_grad_norm=args.clip_grad_norm,
                                     seed=args.seed, config=config)
    except TypeError as error:  # constructor arguments the class does not take
        parser.error(f"argument --expert-kwargs: {error}")
    server.announcer = DHTAnnouncer(args.initial_peers, host=args.host, port=args.dht_port,
                                    refresh_period=args.refresh_period, expiration=args.expiration,
                                    announce_host=args.announce_host)
    print(f"dmoe-server DHT node at {server.announcer.dht.endpoint} (others may pass it as --initial-peers)",
          flush=True)

    with StopSignals() as stop, server:
        print(f"dmoe-server listening on {server.endpoint}", flush=True)
        signum = stop.wait()
        logger.info("%s received, shutting down", signal.Signals(signum).name)


if __name__ == "__main__":
    main()
