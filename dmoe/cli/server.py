"""``dmoe-server``: host a grid of experts and train them with whatever gradients clients send.

Example: ``dmoe-server --experts 'ffn0.[0:4].[0:4]' --expert-cls ffn --hidden-dim 1024 --port 5000``.
Prints ``dmoe-server listening on HOST:PORT`` once it accepts calls; stops cleanly on Ctrl-C or SIGTERM.
Any flag may instead be a key of a TOML file given as ``--config server.toml`` (flags override it, see
:mod:`dmoe.cli.config`); ``--num-experts 4 --grid 4 4 --layer ffn0`` picks grid cells nobody serves yet;
``--metrics-port 0`` serves Prometheus metrics and prints ``dmoe-server metrics on HOST:PORT``;
``--replica-dir DIR`` keeps replicas of this server's experts on ``--replicas`` other servers, holds theirs, and
adopts the experts of servers that leave (see :mod:`dmoe.replicas`); ``--processes N`` deals the experts out
among N server processes, so that one Python interpreter does not hold a big GPU back (see
:mod:`dmoe.cli.server_processes`).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import signal
import sys
from functools import partial
from pathlib import Path
from typing import IO, Callable

import torch

from dmoe.cli.allocator import keep_freed_memory
from dmoe.cli.config import (DefaultsHelpFormatter, add_config_argument, check_thread_count, duration, non_negative,
                             parse_given, port_number, positive)
from dmoe.cli.dht import check_declaration_expiration
from dmoe.cli.signals import StopSignals
from dmoe.cli.sizes import check_trainable, check_width, parameter_bytes
from dmoe.dht import DHT, DHTConfig, Identity, parse_endpoint
from dmoe.dht.messages import VALUE_PATTERN
from dmoe.directory import Announcer, choose_experts, free_experts
from dmoe.endpoints import check_host, host_at_fault, join_host_port
from dmoe.experts import ExpertBuildError, create_expert, expert_class_names
from dmoe.replicas import ReplicaConfig, Replication
from dmoe.replicas.adoption import read_holders
from dmoe.server import ExpertServer, ServerConfig
from dmoe.server.backend import OPTIMIZERS
from dmoe.locking import InUse, lock_existing
from dmoe.server.checkpoints import (CheckpointDirectoryInUse, CheckpointMismatch, CheckpointNotWritten,
                                     CorruptCheckpoint, saved_uids)
from dmoe.server.faults import JITTERS, FaultConfig
from dmoe.server.profile import format_stages
from dmoe.server.runtime import AUTOCAST_DTYPES
from dmoe.server.server import PortUnavailable, check_device, resolve_device
from dmoe.uid import UIDError, expand_pattern, grid_uids, is_valid_prefix
from dmoe.wire import MAX_MESSAGE_BYTES
from dmoe.wire.codec import COMPRESSIONS

logger = logging.getLogger("dmoe.cli.server")  # not __name__: that is __main__ when run as a program
positive_int, positive_float = positive(int), positive(float)
#: the largest --max-message-bytes: gRPC's message limits are C ints
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1





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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmoe-server", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_config_argument(parser)
    parser.add_argument("--experts", default=None,
                        help="uids or a pattern, e.g. 'ffn0.[0:4].[0:4]' (or choose them with --num-experts)")
    parser.add_argument("--num-experts", type=positive_int, default=None,
                        help="instead of --experts: serve this many experts per --layer, in --grid cells nobody "
                             "serves yet (read from the DHT), e.g. --num-experts 4 --grid 4 4 --layer ffn0")
    parser.add_argument("--grid", type=positive_int, nargs="+", default=None, metavar="SIZE",
                        help="grid of each layer, one size per dimension (with --num-experts)")
    parser.add_argument("--layer", nargs="+", default=None, metavar="NAME",
                        help="layer name(s) whose grids to join (with --num-experts)")
    parser.add_argument("--expert-cls", default="ffn", help="registered expert class (built in: ffn, transformer, nop)")
    parser.add_argument("--expert-kwargs", type=json_object, default={}, help="JSON constructor arguments")
    parser.add_argument("--custom-module", action="append", default=[],
                        help="module or .py file registering extra expert classes (repeatable)")
    parser.add_argument("--hidden-dim", type=positive_int, default=1024, help="expert input/output width")
    parser.add_argument("--device", default=None, help="cuda, cpu, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--autocast", choices=sorted(AUTOCAST_DTYPES), default=None,
                        help="compute in this half precision under torch.autocast (default: full precision)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: all)")
    parser.add_argument("--port", type=port_number, default=0, help="gRPC port (0: any free port)")
    parser.add_argument("--max-batch-size", type=positive_int, default=4096,
                        help="most rows in one request and in one batch the runtime forms")
    parser.add_argument("--max-message-bytes", type=positive_int, default=MAX_MESSAGE_BYTES,
                        help="largest single gRPC message (at most 2**31-1 bytes); bigger payloads are streamed "
                             "in parts")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam", help="each expert's optimizer")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="the experts' learning rate")
    parser.add_argument("--clip-grad-norm", type=positive_float, default=None,
                        help="clip each expert's gradient norm to this before a step (default: no clipping)")
    parser.add_argument("--compression", choices=sorted(COMPRESSIONS), default="none",
                        help="response compression when a client asks for none")
    parser.add_argument("--seed", type=int, default=0, help="seed of the experts' initial weights")
    parser.add_argument("--torch-threads", type=positive_int, default=None,
                        help="torch intra-op threads in all (default: torch's, i.e. OMP_NUM_THREADS or the cores)")
    parser.add_argument("--workers", type=positive_int, default=None,
                        help="threads that compute, sharing out the torch threads (default: 2 on a CPU with 2+ "
                             "threads, 1 on a GPU)")
    parser.add_argument("--processes", type=positive_int, default=1,
                        help="server processes that deal out the experts among them, each with its own gRPC port, DHT "
                             "node and Python interpreter, so that one interpreter does not hold a big GPU back "
                             "(--port, --dht-port and --metrics-port, if not 0, count up from the given one; "
                             "--torch-threads (by default the cores) and --replica-budget-mb are shared out among "
                             "the processes, and --activation-cache-mb among those on one device)")
    parser.add_argument("--process-restarts", type=non_negative(int), default=3,
                        help="with --processes: how many times one process that dies (out of memory, say) is started "
                             "again within 10 minutes, from its last checkpoint, while the others serve on; one more "
                             "death stops the whole server with status 1 (0: the first does)")
    parser.add_argument("--overlap-copies", action=argparse.BooleanOptionalAction, default=False,
                        help="on a GPU, copy through pinned memory on a copy stream per worker and wait once per "
                             "batch (default: plain copies, faster on the GPUs measured; benchmarks/README.md)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                        help="on a GPU, replay each expert's forward and training step (forward again, backward, "
                             "optimizer step) as CUDA graphs, per bucket of batch sizes: one launch instead of one "
                             "per kernel (costs device memory per bucket; benchmarks/README.md, \"On a GPU\")")
    parser.add_argument("--shared-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="let clients on this host pass requests and answers through shared memory instead of "
                             "gRPC's transport (Linux; loopback clients only)")
    parser.add_argument("--profile", action="store_true",
                        help="time each stage of the server's path (decode, queue, batch, copies, compute, encode): "
                             "in the metrics as dmoe_stage_seconds_total, and printed at shutdown; on a GPU it "
                             "synchronises between stages, so not for speed runs")
    dht = parser.add_argument_group("DHT", "how the server announces its experts")
    dht.add_argument("--initial-peers", nargs="*", default=[],
                     help="HOST:PORT of any DHT node (printed by dmoe-dht); none: this server starts a new DHT")
    dht.add_argument("--dht-port", type=port_number, default=0, help="UDP port of the server's own DHT node")
    dht.add_argument("--announce-host", default=None,
                     help="host that clients and other servers are told to call this server's experts at, where "
                          "it is not --host (behind NAT, e.g. a cloud VM's public address; default: --host, or for "
                          "0.0.0.0 this machine's address toward its DHT peers); a host alone, without a port")
    dht.add_argument("--refresh-period", type=duration(), default=10.0,
                     help="seconds between re-declarations of the experts")
    dht.add_argument("--expiration", type=duration(), default=None,
                     help="seconds a declaration outlives its last refresh (default: 3 refresh periods)")
    dht.add_argument("--identity", default=None, metavar="PATH",
                     help="Ed25519 key file that signs the declarations and owns the uids (created if absent; "
                          "default: dht_identity.key in --checkpoint-dir, else in --replica-dir, else an ephemeral "
                          "key; with --processes each process has its own: PATH.process-I, or process-I/ in those "
                          "directories)")
    faults = parser.add_argument_group("fault injection", "experiments only: every expert call pays a delay, "
                                       "some fail (see dmoe/server/faults.py)")
    faults.add_argument("--inject-latency-ms", type=duration("ms", zero=True), default=0.0,
                        help="mean round-trip latency added to every forward/backward call")
    faults.add_argument("--latency-jitter", choices=JITTERS, default="none",
                        help="none: every call waits the mean; exponential: a random wait with that mean")
    faults.add_argument("--fail-rate", type=float, default=0.0,
                        help="share of calls in [0, 1] answered with an 'injected failure' error")
    faults.add_argument("--fault-seed", type=int, default=None, help="seed of the injected delays and failures")
    state = parser.add_argument_group("checkpoints and input checks")
    state.add_argument("--checkpoint-dir", default=None,
                       help="save experts (weights + optimizer) here; restarting with the same directory resumes them")
    state.add_argument("--checkpoint-interval", type=duration(), default=60.0,
                       help="seconds between checkpoints (one is also written on shutdown)")
    state.add_argument("--reject-nonfinite", action=argparse.BooleanOptionalAction, default=True,
                       help="refuse requests whose inputs or gradients hold NaN/Inf (INVALID_ARGUMENT)")
    state.add_argument("--max-abs-value", type=non_negative(float), default=1e6,
                       help="refuse requests whose inputs or gradients hold values of a larger magnitude, which "
                            "could blow up an expert's weights (INVALID_ARGUMENT; 0: no limit)")
    replicas = parser.add_argument_group("replicas", "copies of the experts on other servers, so that none of "
                                         "their training is lost when this server leaves (see dmoe/replicas)")
    replicas.add_argument("--replica-dir", default=None,
                          help="keep other servers' replicas here, push this server's, adopt the experts of servers "
                               "that left (default: no replicas)")
    replicas.add_argument("--replicas", type=non_negative(int), default=2,
                          help="servers each expert's snapshot is pushed to (0: push none, still hold and adopt)")
    replicas.add_argument("--replica-interval", type=duration(), default=60.0,
                          help="seconds between pushes (one also goes on shutdown); a SIGKILL loses at most about "
                               "this much training")
    replicas.add_argument("--replica-budget-mb", type=positive_float, default=1024.0,
                          help="MiB of other servers' replicas kept in --replica-dir (when full, the machine whose "
                               "replicas take the most gives way first)")
    replicas.add_argument("--replica-compression", choices=sorted(COMPRESSIONS), default="none",
                          help="wire compression of the snapshots' weights (none: exact); the optimizer's state "
                               "always goes exact (Adam's second moments would round to 0 and wreck the first step "
                               "after a restore or an adoption)")
    replicas.add_argument("--adoption-stagger", type=duration(zero=True), default=2.0,
                          help="seconds a holder of a replica waits per holder with a newer one before adopting "
                               "its empty cell")
    parser.add_argument("--activation-cache-mb", type=non_negative(float), default=512.0,
                        help="MiB of activations kept from a forward for its backward, which then skips recomputing "
                             "the forward, in the memory of the device the experts compute on (0: always recompute)")
    parser.add_argument("--max-queued-mb", type=positive_float, default=1024.0,
                        help="MiB of request inputs waiting for (or in) the experts' compute, or still arriving in "
                             "streamed calls, and of answers not yet taken by their clients, at most; requests "
                             "beyond it are refused (RESOURCE_EXHAUSTED: clients move on to other experts)")
    parser.add_argument("--max-stream-mb", type=positive_float, default=1024.0,
                        help="MiB one streamed request (a payload above --max-message-bytes, sent in parts) may carry "
                             "in all; a larger one is refused as its parts arrive")
    parser.add_argument("--max-stream-seconds", type=duration(), default=120.0,
                        help="seconds a streamed request has to arrive whole from its call's start; a slower one is "
                             "refused (DEADLINE_EXCEEDED) and the bytes it held are let go")
    parser.add_argument("--shutdown-grace", type=duration(zero=True), default=1.0,
                        help="seconds the calls in flight get to finish when the server stops (a backward still "
                             "computing past it is applied and checkpointed, but its caller is not answered)")
    parser.add_argument("--metrics-port", type=port_number, default=None,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; default: off)")
    parser.add_argument("--metrics-host", default=None,
                        help="interface of the metrics endpoint (default: --host; e.g. 127.0.0.1 keeps the "
                             "unauthenticated metrics off a public --host 0.0.0.0)")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="logging level")
    return parser


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: the two ways to say which experts a server serves: on the command line, either one overrides the config file's
EXPERT_CHOICES = ((frozenset({"experts"}), frozenset({"num_experts", "grid", "layer"})),)

#: the DHT key file a server keeps in its --checkpoint-dir (or --replica-dir) when no --identity is given
IDENTITY_FILE = "dht_identity.key"


def expert_uids(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str] | None:
    """The uids of ``--experts``; None with ``--num-experts`` (they are chosen from the DHT once joined)."""
    if (args.experts is None) == (args.num_experts is None):
        parser.error("argument --experts: give either --experts PATTERN or --num-experts N --grid ... --layer ...")
    if args.experts is not None:
        for flag in ("grid", "layer"):
            if getattr(args, flag) is not None:
                parser.error(f"argument --{flag}: only used with --num-experts")
        try:
            return expand_pattern(args.experts)
        except UIDError as error:
            parser.error(f"argument --experts: {error}")
    if not args.grid:
        parser.error("argument --grid: required with --num-experts, e.g. --grid 4 4")
    if not args.layer:
        parser.error("argument --layer: required with --num-experts, e.g. --layer ffn0")
    for layer in args.layer:
        if not is_valid_prefix(layer) or "." in layer:
            parser.error(f"argument --layer: invalid layer name {layer!r} (letters, digits, _ or -, no dots)")
    cells = 1
    for size in args.grid:
        cells *= size
    if args.num_experts > cells:
        parser.error(f"argument --num-experts: {args.num_experts} is more than the {cells} cells of --grid")
    return None


def saved_cells(directory: str | Path, args: argparse.Namespace, parser: argparse.ArgumentParser,
                count: int | None = None) -> list[str] | None:
    """With ``--num-experts``: the uids checkpointed in ``directory`` (None if none are), so that the same command
    resumes the same experts instead of choosing cells afresh; exits naming the flag if they do not fit ``--layer``
    and ``--grid``, or (``count``) are not that many."""
    try:
        uids = saved_uids(directory)
    except CorruptCheckpoint as error:
        parser.error(f"argument --checkpoint-dir: {error}")
    if uids is None:
        return None
    cells = {uid for layer in args.layer for uid in grid_uids(layer, args.grid)}
    outside = [uid for uid in uids if uid not in cells]
    if outside:
        parser.error(f"argument --checkpoint-dir: {directory} holds experts outside --layer {' '.join(args.layer)} "
                     f"--grid {' '.join(map(str, args.grid))}: {', '.join(outside[:5])}; start with the flags it was "
                     "written with, or another directory")
    if count is not None and len(uids) != count:
        parser.error(f"argument --num-experts: {directory} holds the checkpoints of {len(uids)} experts, not {count}; "
                     "start with the count it was written with, or another --checkpoint-dir")
    return uids


def fault_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> FaultConfig | None:
    """The fault flags as a FaultConfig (None when nothing is injected); argparse errors name the flag. (The type
    of --inject-latency-ms refuses a negative, infinite or longer than a year latency: inf was accepted, and the
    server then answered no call.)"""
    if not 0 <= args.fail_rate <= 1:
        parser.error(f"argument --fail-rate: must be in [0, 1], got {args.fail_rate}")
    if args.latency_jitter != "none" and args.inject_latency_ms == 0:
        parser.error("argument --latency-jitter: needs --inject-latency-ms > 0")
    if args.inject_latency_ms == 0 and args.fail_rate == 0:
        return None
    return FaultConfig(latency_ms=args.inject_latency_ms, jitter=args.latency_jitter, fail_rate=args.fail_rate,
                       seed=args.fault_seed)


def identity_path(args: argparse.Namespace) -> Path | None:
    """The server's key file: ``--identity``, else one in ``--checkpoint-dir``, else one in ``--replica-dir`` (the
    replicas are signed by it and the uids owned by it: a restart under a new key finds its own cells owned by its
    previous one, serves none of them, and can no longer push to holders of its replicas); None: an ephemeral key."""
    if args.identity:
        return Path(args.identity)
    directory = args.checkpoint_dir or args.replica_dir
    return Path(directory) / IDENTITY_FILE if directory else None


def join_dht(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Announcer:
    """The server's own DHT node, joined through ``--initial-peers``; exits naming the flag if none answers."""
    path = identity_path(args)
    try:
        if getattr(args, "identity_seed", None) is not None:  # a --processes child's, given by its parent
            identity = Identity.from_seed(args.identity_seed)
        else:
            identity = Identity.load_or_create(path) if path is not None else None
    except (OSError, ValueError) as error:
        parser.error(f"argument --identity: {error}")
    try:
        return Announcer.join(args.initial_peers, host=args.host, port=args.dht_port, identity=identity,
                              refresh_period=args.refresh_period, expiration=args.expiration,
                              announce_host=args.announce_host)
    except OSError as error:
        parser.error(dht_node_error(error, args.host, args.dht_port))


def dht_node_error(error: OSError, host: str, port: int) -> str:
    """The usage error for a DHT node that could not start, naming the flag at fault: ``--initial-peers`` when none
    of them answered (or joining timed out), ``--host`` for an address that is not this machine's (or no address),
    else ``--dht-port`` (taken, or not ours to bind); a taken port was reported as a bad ``--initial-peers``."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return f"argument --initial-peers: {error}"
    at_host = host_at_fault(error)
    flag = "--host" if at_host else "--dht-port"
    return f"argument {flag}: the DHT node cannot listen on {join_host_port(host, port)} (UDP): {error}"


def replica_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ReplicaConfig | None:
    """The replica flags as a ReplicaConfig (None without ``--replica-dir``)."""
    if args.replica_dir is None:
        return None
    return ReplicaConfig(directory=args.replica_dir, replicas=args.replicas, interval=args.replica_interval,
                         budget_mb=args.replica_budget_mb, compression=args.replica_compression,
                         stagger=args.adoption_stagger, layers=tuple(args.layer or ()))


def import_custom_modules(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for spec in args.custom_module:
        try:
            import_custom_module(spec)
        except Exception as error:
            parser.error(f"argument --custom-module: cannot import {spec!r}: {error}")


def check_announce_host(host: str | None, parser: argparse.ArgumentParser) -> None:
    """Refuses an ``--announce-host`` that no DHT node would store as the experts' endpoint (with any port): the
    server found out only once it had built its experts and bound its port, with a traceback; and one that is no
    host (:func:`~dmoe.endpoints.check_host`), which the server announced, for nobody to reach."""
    if not host:  # (empty: not given)
        return
    endpoint = join_host_port(host, 65535)
    limit = DHTConfig.max_value_bytes
    if len(endpoint.encode()) > limit or VALUE_PATTERN.fullmatch(endpoint) is None:
        parser.error(f"argument --announce-host: {host!r} cannot be announced: HOST:PORT must be printable ASCII "
                     f"without spaces, quotes or backslashes, of at most {limit} bytes")
    try:
        check_host(host)  # (review 99 D5: HOST:PORT was announced as [HOST:PORT]:PORT)
    except ValueError as error:
        parser.error(f"argument --announce-host: {error}")


#: flags that only do something with another: (flag's destination, what it needs, whether the args have it)
NEEDS: list[tuple[str, str, Callable[[argparse.Namespace], bool]]] = [
    *((dest, "--replica-dir", lambda args: args.replica_dir is not None)
      for dest in ("replicas", "replica_interval", "replica_budget_mb", "replica_compression", "adoption_stagger")),
    ("checkpoint_interval", "--checkpoint-dir", lambda args: args.checkpoint_dir is not None),
    ("metrics_host", "--metrics-port (without it no metrics endpoint is served)",
     lambda args: args.metrics_port is not None),
    ("latency_jitter", "--inject-latency-ms > 0", lambda args: args.inject_latency_ms > 0),
    ("fault_seed", "an injected fault: --inject-latency-ms or --fail-rate above 0",
     lambda args: args.inject_latency_ms > 0 or args.fail_rate > 0),
    ("process_restarts", "--processes N above 1 (it restarts the processes of a --processes server)",
     lambda args: args.processes > 1),
]


def flags_given(args: argparse.Namespace, parser: argparse.ArgumentParser) -> frozenset[str]:
    """For ``args`` parsed without :func:`~dmoe.cli.config.parse_given` (tests, programs that build the namespace):
    the flags whose value is not their default, as the best guess of those given."""
    return frozenset(action.dest for action in parser._actions
                     if action.option_strings and getattr(args, action.dest, None) != action.default)


def check_needs(args: argparse.Namespace, parser: argparse.ArgumentParser, given: frozenset[str]) -> None:
    """Exits naming the flag when one that was ``given`` does nothing without another (:data:`NEEDS`). Whether it
    was given, not whether its value differs from the default: a user who typed the default (--replicas 2,
    --checkpoint-interval 60) was not told that the flag did nothing (review 72)."""
    for dest, needs, present in NEEDS:
        if dest in given and not present(args):
            parser.error(f"argument --{dest.replace('_', '-')}: needs {needs}")


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser,
               given: frozenset[str] | None = None) -> list[str] | None:
    """Every check of the flags that needs no DHT and builds nothing: exits naming the flag on the first bad one.
    Imports ``--custom-module``s. Returns the uids of ``--experts`` (None with ``--num-experts``). ``given``: the
    flags given (:func:`~dmoe.cli.config.parse_given`); by default those whose value is not the default."""
    if given is None:
        given = flags_given(args, parser)
    for flag in ("checkpoint_dir", "replica_dir", "identity"):
        # an empty value (an unset shell variable) wrote into the current directory, under a new key at every
        # restart, as the key file went unnamed (review 92)
        if getattr(args, flag) is not None and not str(getattr(args, flag)).strip():
            parser.error(f"argument --{flag.replace('_', '-')}: must name a directory or file (leave it out for none)")
    import_custom_modules(args, parser)
    if args.expert_cls not in expert_class_names():
        parser.error(f"argument --expert-cls: unknown class {args.expert_cls!r}; "
                     f"registered: {', '.join(expert_class_names())}")
    uids = expert_uids(args, parser)
    try:
        device = resolve_device(args.device)
    except RuntimeError as error:
        parser.error(f"argument --device: {error}")
    try:
        check_device(device)
    except ValueError as error:
        parser.error(f"argument --device: {error}")
    for flag in ("torch_threads", "workers"):  # (review 100 D4: a segfault, or 21k threads, with no word)
        try:
            check_thread_count(f"--{flag.replace('_', '-')}", getattr(args, flag))
        except ValueError as error:
            parser.error(f"argument {error}")
    if args.cuda_graphs and (args.workers or 1) > 1:
        parser.error(f"argument --cuda-graphs: needs one compute worker per process, got --workers {args.workers} "
                     "(more processes with --processes instead)")
    for flag in ("cuda_graphs", "overlap_copies"):  # (each is ignored elsewhere)
        if getattr(args, flag) and device.type != "cuda":
            parser.error(f"argument --{flag.replace('_', '-')}: needs a CUDA device, and this server computes on "
                         f"{device.type}")
    if args.max_message_bytes > MAX_GRPC_MESSAGE_BYTES:  # gRPC takes its limits as C ints
        parser.error(f"argument --max-message-bytes: must be at most {MAX_GRPC_MESSAGE_BYTES}, got "
                     f"{args.max_message_bytes}")
    if args.max_stream_mb * 2**20 < 1024:
        parser.error(f"argument --max-stream-mb: {args.max_stream_mb} MiB is less than 1 KiB, which no streamed "
                     "request fits in")
    fault_config(args, parser)
    for peer in args.initial_peers:
        try:
            parse_endpoint(peer)
        except ValueError as error:
            parser.error(f"argument --initial-peers: {error}")
    check_announce_host(args.announce_host, parser)
    check_needs(args, parser, given)
    replica_config(args, parser)
    check_declaration_expiration(parser, args.refresh_period, args.expiration)  # (the server was invisible)
    count = len(uids) if uids is not None else args.num_experts * len(args.layer)
    check_expert_size(args, parser, device, count)
    if args.processes > count:
        parser.error(f"argument --processes: {args.processes} processes need at least as many experts, got {count}")
    for flag in ("port", "dht_port", "metrics_port"):  # the processes' ports count up from nonzero ones
        first = getattr(args, flag)
        last = (first or 0) + args.processes - 1 + (flag == "dht_port" and args.processes > 1)
        if first and last > 65535:
            parser.error(f"argument --{flag.replace('_', '-')}: {args.processes} processes count their ports up from "
                         f"{first} to {last}, beyond 65535")
    if device.type == "cuda" and args.processes == 1 and count >= 4:
        logger.info("one process serves these %d experts on the GPU: --processes 4 carried about twice the rows on an "
                    "H100 (benchmarks/README.md, \"On a GPU\")", count)
    return uids


def check_expert_size(args: argparse.Namespace, parser: argparse.ArgumentParser, device: torch.device,
                      count: int) -> None:
    """Exits naming the flag for a ``--hidden-dim`` above :data:`~dmoe.cli.sizes.MAX_WIDTH`, and for experts whose
    parameters and gradients alone exceed the memory of ``device`` (counted without building them; on a CPU all
    ``count`` of them, on a GPU one, as ``--processes`` may spread them over several): torch's sizes overflowed in
    some 40 lines of C++ frames blaming ``--expert-kwargs``, not given, or its allocator refused (review 100 D8)."""
    try:
        check_width("--hidden-dim", args.hidden_dim)
    except ValueError as error:
        parser.error(f"argument {error}")
    try:
        one = parameter_bytes(lambda: create_expert(args.expert_cls, args.hidden_dim, **args.expert_kwargs))
    except Exception:  # noqa: BLE001 - (the real build reports what the class refuses, naming the flag)
        return
    kwargs = f" --expert-kwargs {json.dumps(args.expert_kwargs)}" if args.expert_kwargs else ""
    held = count if device.type == "cpu" else 1
    try:
        check_trainable(f"{held} expert{'s' * (held > 1)} of --expert-cls {args.expert_cls} --hidden-dim "
                        f"{args.hidden_dim}{kwargs}", one * held, device)
    except ValueError as error:
        parser.error(f"argument {'--expert-kwargs' if kwargs else '--hidden-dim'}: {error}")


def server_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerConfig:
    config = ServerConfig(host=args.host, port=args.port, device=args.device, max_batch_size=args.max_batch_size,
                          autocast=args.autocast, response_compression=args.compression,
                          max_message_bytes=args.max_message_bytes, metrics_port=args.metrics_port,
                          metrics_host=args.metrics_host,
                          workers=args.workers, overlap_copies=args.overlap_copies, profile=args.profile,
                          cuda_graphs=args.cuda_graphs,
                          shared_memory=args.shared_memory)
    config.faults = fault_config(args, parser)
    config.checkpoint_dir, config.checkpoint_interval = args.checkpoint_dir, args.checkpoint_interval
    config.reject_nonfinite = args.reject_nonfinite
    config.max_abs_value = args.max_abs_value
    config.activation_cache_mb = args.activation_cache_mb
    config.max_queued_mb = args.max_queued_mb
    config.max_stream_bytes = int(args.max_stream_mb * 2**20)
    config.max_stream_seconds = args.max_stream_seconds
    config.shutdown_grace = args.shutdown_grace
    return config


def pick_cells(dht: DHT, args: argparse.Namespace, parser: argparse.ArgumentParser,
               who: str = "this server holds") -> list[str]:
    """The cells of ``--num-experts``: free ones (:func:`check_free_cells`); on a full grid, with ``--replica-dir``,
    served ones, for a standby that holds their replicas and adopts the cells that empty (it serves none that
    another server owns)."""
    # without --replica-dir, a cell whose expert others hold replicas of is left to them where others are free
    uids = free_experts(dht, args.layer, args.grid, args.num_experts,
                        avoid=partial(replicated, dht) if args.replica_dir is None else None)
    if args.replica_dir is None:
        held = replicated(dht, uids)
        if held:
            logger.warning("%d of the cells chosen are empty, but other servers hold replicas of their experts "
                           "(%s): no other cell is free, so these start fresh, and the training held in the "
                           "replicas is lost (--replica-dir would start them from the replicas)", len(held),
                           ", ".join(held[:8]))
    if uids or args.replica_dir is None:
        check_free_cells(uids, args, parser)
        return uids
    logger.warning("every cell of --layer %s is served already: %s their replicas, adopting the cells that empty "
                   "(serving none that another server owns)", " ".join(args.layer), who)
    return choose_experts(args.layer, args.grid, args.num_experts)


def replicated(dht: DHT, uids: list[str]) -> list[str]:
    """Those of ``uids`` whose experts some server announces a replica of. Such a cell's server just left (its
    declaration expired) and a holder is about to adopt the expert from its newest replica; a server without
    --replica-dir that took the cell started it fresh, and the holders, finding it served, never adopted: its
    training was lost (review 59)."""
    return [uid for uid, found in read_holders(dht, uids).items() if found] if uids else []


def check_free_cells(uids: list[str], args: argparse.Namespace, parser: argparse.ArgumentParser,
                     wanted: int | None = None) -> None:
    """Logs the cells ``--num-experts`` chose (``wanted`` of them, by default that many per layer), warns when fewer
    were free, and refuses none."""
    wanted = wanted or args.num_experts * len(args.layer)
    grids = f"the {' x '.join(map(str, args.grid))} grid{'s' * (len(args.layer) > 1)} of --layer {' '.join(args.layer)}"
    if not uids:
        parser.error(f"argument --num-experts: every cell of {grids} is served already (a served cell's uid is "
                     "its server's; this one could serve it to nobody): a larger --grid, another --layer, or "
                     "--replica-dir to hold the experts' replicas and adopt the cells that empty")
    if len(uids) < wanted:
        logger.warning("only %d free cells of %s for --num-experts (%d wanted): serving those", len(uids), grids,
                       wanted)
    logger.info("chose %d experts, free grid cells: %s", len(uids), ", ".join(uids))


def trade_taken_cells(server: ExpertServer, args: argparse.Namespace, parser: argparse.ArgumentParser,
                      rounds: int = 3) -> None:
    """The cells ``--num-experts`` chose (or resumed from a checkpoint) that the read-back after their first
    declaration finds owned by another key (:attr:`Announcer.first_taken`) are traded for cells still free, which
    are declared and read back in turn (``rounds`` times at most); exits with the error of a full grid when this
    server is left with none. Nothing reserved a cell between the read that chose it and its declaration: two
    servers started together took the same one, and the loser served it to nobody, for good, checkpointing it
    for every restart to resume (as one resumed a checkpointed cell that another took while it was down: review
    92 D1). A taken cell with no free one to trade for stops being served, and stays in the checkpoint (a restart
    must find as many experts as ``--num-experts`` asks for: it trades that cell then, if one is free)."""
    announcer = server.announcer
    dht = announcer.dht
    taken = [uid for uid in announcer.first_taken if uid in server.backends]
    for _ in range(rounds):
        if not taken:
            return
        lost, traded = [], {}
        for layer in args.layer:
            cells = set(grid_uids(layer, args.grid))
            gone = [uid for uid in taken if uid in cells]
            if not gone:
                continue
            free = [uid for uid in free_experts(dht, [layer], args.grid, len(gone), avoid=partial(replicated, dht))
                    if uid not in server.backends and uid not in taken]
            traded.update(zip(gone, free))
            lost.extend(gone[len(free):])
        if len(lost) == len(server.backends):  # none left to serve: as if the grid had been full when it chose
            checkpoints, server.checkpoints = server.checkpoints, None
            if checkpoints is not None:
                checkpoints.close(save=False)  # (a checkpoint it resumed stays as it was)
            server.close()
            logger.warning("%s: declared by another key as this server declared it, and no other cell is free",
                           ", ".join(lost))
            check_free_cells([], args, parser)
        for uid, new in traded.items():
            logger.warning("%s: declared by another key as this server declared it (another server chose it at the "
                           "same moment, or took it while this one was down): serving the free cell %s instead",
                           uid, new)
            backend = server.backend_factory(new)
            server.add_expert(new, backend)  # (declared at once)
            if server.checkpoints is not None:
                server.checkpoints.trade(uid, new, backend)
            server.remove_expert(uid)
        for uid in lost:
            logger.warning("%s: declared by another key as this server declared it, and no other cell is free: no "
                           "longer serving it (%d experts left)", uid, len(server.backends) - 1)
            server.remove_expert(uid)
        taken = [uid for uid in announcer.taken(list(traded.values())) if uid in server.backends]
    if taken:
        logger.warning("%s: still declared by other keys after %d trades: served to nobody", ", ".join(taken), rounds)


def metrics_error(error: OSError, args: argparse.Namespace) -> str:
    """The usage error for a metrics endpoint that could not listen (the port taken, the host unknown), which
    ended in a traceback."""
    host = args.metrics_host or args.host
    at_host = host_at_fault(error)
    flag = "--metrics-host" if at_host else "--metrics-port"
    return f"argument {flag}: the metrics endpoint cannot listen on {join_host_port(host, args.metrics_port)}: {error}"


def print_line(line: str) -> None:
    print(line, flush=True)


def lock_identity(args: argparse.Namespace, parser: argparse.ArgumentParser) -> IO[bytes] | None:
    """Takes the lock of the server's key file (:func:`identity_path`), held while it serves; exits naming the flag
    it comes from (``--identity``, else ``--checkpoint-dir`` or ``--replica-dir``) when another live server holds
    it. One key is one owner: two servers under it overwrite each other's uids without a word (a server whose
    --replica-dir was another's --checkpoint-dir loaded that one's key, the two directories' locks being separate
    files: review 75). None for an ephemeral key or one given by a ``--processes`` parent."""
    path = identity_path(args)
    if path is None or getattr(args, "identity_seed", None) is not None:
        return None
    flag = "--identity" if args.identity else "--checkpoint-dir" if args.checkpoint_dir else "--replica-dir"
    try:
        # on the key itself, created now if absent: a side file could not be made beside a key on a read-only mount
        Identity.load_or_create(path)
        return lock_existing(path, f"the DHT identity {path}", "server", "give each server its own --identity (or "
                             "--checkpoint-dir, or --replica-dir, where it keeps one by default)")
    except (InUse, OSError, ValueError) as error:
        parser.error(f"argument {flag}: {error}")


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser, uids: list[str] | None,
          report: Callable[[str], None] = print_line, *, machine: str | None = None) -> None:
    """Builds the server of checked ``args``, serves until SIGINT/SIGTERM (or the launcher's death), then stops
    cleanly. ``report`` gets the program's announcement lines (DHT node, metrics, listening) in that order.
    ``machine``: the replica token shared by the processes of a ``--processes`` server (see
    :class:`~dmoe.replicas.ReplicaConfig`)."""
    lock = lock_identity(args, parser)
    try:
        _serve(args, parser, uids, report, machine)
    finally:
        if lock is not None:
            lock.close()


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser, uids: list[str] | None,
           report: Callable[[str], None], machine: str | None) -> None:
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    config = server_config(args, parser)
    replicas = replica_config(args, parser)
    if replicas is not None and machine is not None:
        replicas = dataclasses.replace(replicas, machine=machine)
    announcer = None
    if uids is None or replicas is not None:  # the DHT first: to see which cells are free, to find replicas
        announcer = join_dht(args, parser)
    chosen = uids is None  # --num-experts: cells this server chose (or resumed), traded if taken once declared
    if uids is None and args.checkpoint_dir is not None:
        uids = saved_cells(args.checkpoint_dir, args, parser, args.num_experts * len(args.layer))
        if uids is not None:
            logger.info("resuming the %d experts checkpointed in %s: %s", len(uids), args.checkpoint_dir,
                        ", ".join(uids))
    if uids is None:
        uids = pick_cells(announcer.dht, args, parser)
    try:
        server = ExpertServer.create(uids, args.expert_cls, args.hidden_dim, cls_kwargs=args.expert_kwargs,
                                     optimizer=args.optimizer, lr=args.lr, clip_grad_norm=args.clip_grad_norm,
                                     seed=args.seed, config=config)
    except (CheckpointMismatch, CorruptCheckpoint, CheckpointDirectoryInUse, OSError) as error:  # in the constructor
        parser.error(f"argument --checkpoint-dir: {error}")
    except ExpertBuildError as error:  # arguments the class does not take, or values it refuses
        cause = error.__cause__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
        reason = reason.strip().splitlines()[0]  # (torch's messages go on with some 40 lines of C++ frames)
        if not args.expert_kwargs:  # (--expert-kwargs was named, given or not: review 100 D8)
            parser.error(f"argument --expert-cls: {args.expert_cls} (with --hidden-dim {args.hidden_dim}) builds no "
                         f"expert: {reason}")
        parser.error(f"argument --expert-kwargs: {json.dumps(args.expert_kwargs)} (with --expert-cls "
                     f"{args.expert_cls} --hidden-dim {args.hidden_dim}) builds no expert: {reason}")
    server.announcer = announcer or join_dht(args, parser)
    dht = server.announcer.dht
    report(f"dmoe-server DHT node at {dht.announced(dht.endpoint)} (others may pass it as --initial-peers)")
    if replicas is not None:
        try:
            replication = Replication(server, replicas)
        except OSError as error:
            parser.error(f"argument --replica-dir: {error}")
        try:
            replication.restore()  # before serving: the newest replica of each expert
        except Exception:  # noqa: BLE001 - (each expert's failure is caught in restore; this is what is left)
            # replicas are other servers' input: no replica, however made, may keep this server from serving
            # (review 78: one with a +inf step count killed it here)
            logger.exception("restoring the experts from their replicas failed: they start from their checkpoint "
                             "or fresh")

    try:
        server.start()
    except PortUnavailable as error:  # (start() closed what it had started)
        parser.error(f"argument --port: {error}")
    except OSError as error:
        if args.metrics_port is None or server.metrics.endpoint is not None:
            raise
        parser.error(metrics_error(error, args))
    if chosen and replicas is None:  # (with --replica-dir, a taken cell is dropped and adopted back as it empties)
        try:
            trade_taken_cells(server, args, parser)
        except BaseException:
            server.close()  # (nothing left running; a second close does nothing)
            raise
    with StopSignals() as stop, server:
        if server.metrics.endpoint is not None:
            report(f"dmoe-server metrics on {server.metrics.endpoint}")
        report(f"dmoe-server listening on {server.endpoint}")
        signum = stop.wait()
        logger.info("%s received, shutting down", signal.Signals(signum).name)
    if server.stages is not None:
        print(format_stages(server.stages.snapshot()), flush=True)
        usage = server.activations.usage() if server.activations is not None else {}
        for device, (_, peak) in sorted(usage.items()):
            print(f"kept activations on {device}: at most {peak / 2**20:.1f} MiB at once (--activation-cache-mb "
                  f"{server.config.activation_cache_mb:g})", flush=True)


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()  # before any thread starts: every training step would page-fault otherwise
    parser = build_parser()
    args, given = parse_given(parser, argv, alternatives=EXPERT_CHOICES)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uids = check_args(args, parser, given)
    from dmoe.cli.server_processes import check_checkpoint_layout, serve_in_processes  # it imports this module
    lock = check_checkpoint_layout(args, parser)  # (held until this process exits)
    if args.processes > 1:
        status = serve_in_processes(args, parser, uids)
        if lock is not None:
            lock.close()
        sys.exit(status)
    try:
        serve(args, parser, uids)
    except CheckpointNotWritten as error:  # (the server is stopped: every other step of its close ran)
        print(f"dmoe-server: error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
