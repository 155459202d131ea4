"""The main job (``make demo``): a whole swarm on this machine, and a client training against it.

Starts a DHT bootstrap node and ``--servers`` expert servers (each a real process hosting a slice of every
layer's grid, announced in the DHT), then trains the gated transformer LM with remote experts for a few minutes,
prints the validation perplexity and shuts everything down, also on Ctrl-C.

    python -m clients.swarm_demo                       # Shakespeare, 2 servers, 2 layers of 4x4 ffn experts
    python -m clients.swarm_demo --servers 3 --max-minutes 10 --hidden 256

    python -m clients.swarm_demo --trainers 3          # a collaboration: three trainers, one model (DeDLOC)

Every ``dmoe-train`` flag works here too (``--steps``, ``--grid``, ``--data``, ``--collaborate``, ...); ``--experts``
and ``--initial-peers`` are set by the demo, and refused if given (with ``--trainers N`` also ``--data-shard``,
``--data-shards`` and ``--wait-for-trainers``); the ``--expert-*`` flags train its servers' experts. A ``--config``
file sets dmoe-train's flags, as dmoe-train's does; the demo's own flags (``--servers``, ``--server-threads``,
``--trainers``, ``--verbose``) go on the command line. Across machines, the same pieces are three commands:
``dmoe-dht``, ``dmoe-server --initial-peers ...`` on each volunteer, ``dmoe-train --experts remote --initial-peers ...``;
and with ``--collaborate RUN_ID --target-batch-size N`` on each volunteer trainer, four.

With ``--trainers N`` (N > 1) the demo starts N ``dmoe-train --collaborate`` processes instead of training in
process, each on its own slice of the text (``--data-shard i --data-shards N``), all in one collaboration with a
target batch of N batches (``--target-batch-size`` overrides it). It shows one bar for the collaboration (read from
the trainers' progress records in the DHT) and each trainer's validation lines, then every trainer's final
validation perplexity: the same, since they hold the same model. A collaboration runs a fixed ``--steps`` (150
unless given; ``--max-minutes`` would stop each trainer at its own step). A trainer that fails (exits with an error
before its final validation) stops the others and the demo (status 1), which says which one it was.

``--resume`` resumes the whole model: the trainer (or each trainer) from its checkpoint in ``--out-dir``, and the
experts from their servers' checkpoints, which each server keeps in ``OUT_DIR/experts/server{i}`` and writes when
the demo ends (also on Ctrl-C), beside a record of the swarm that trained them (``swarm.json``: ``--servers``,
``--layers``, ``--grid``, ``--hidden``, ``--expert-cls``, ``--trainers``): a ``--resume`` with another is refused,
naming the flag.
Without ``--resume`` both start afresh. A demo holds its ``--out-dir``: a second one given the same directory is
refused.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import re
import sys
import time
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from dmoe.cli.allocator import keep_freed_memory
from dmoe.cli.config import ConfigError, read_toml
from dmoe.cli.signals import InterruptingSignals
from dmoe.cli.train import (EXPERT_FLAGS_REACH_SERVERS_ENV, TRAINING_ERRORS, build_parser,
                            expert_flags_reach_servers, out_of_memory_message, parse_config, port_error)
from dmoe.endpoints import PortUnavailable
from dmoe.launch import LocalSwarm, Proc, SwarmConfig, processes
from dmoe.server.checkpoints import FILENAME as EXPERTS_FILE
from dmoe.server.checkpoints import CheckpointDirectoryInUse, lock_directory
from dmoe.trainer.data import DataError, DownloadError, TextData, shakespeare
from dmoe.trainer.loop import TrainConfig, train

PROG = "dmoe-demo"
MAX_TRAINERS = 16
RUN_ID = "demo"
#: the --initial-peers the flags are checked with: the swarm's DHT node is known once it is up (run_swarm sets it)
PENDING_PEER = "127.0.0.1:1"
FINAL = re.compile(r"final validation loss (\S+) perplexity (\S+) \(step (\d+)")
EXPERTS_DIR = "experts"  # in --out-dir: server{i}/, the --checkpoint-dir of server i
SERVER_STOP_SECONDS = 60.0  # a stopping server writes its experts' last checkpoint: not to be cut short
TRAINER_STOP_SECONDS = 60.0  # a trainer's step in flight may wait out an averaging round with trainers that stop too
#: the environment of a collaboration's trainers: no bars (the demo shows one), and their --expert-* flags are
#: accepted as reaching the experts (the demo started its servers with them; plain dmoe-train --experts remote
#: refuses them)
TRAINER_ENV = {"TQDM_DISABLE": "1", EXPERT_FLAGS_REACH_SERVERS_ENV: "1"}
#: in OUT_DIR/experts: the shape of the swarm whose servers checkpointed the experts there (its --servers, --grid, ...)
SWARM_FILE = "swarm.json"
DESCRIPTION = ("Checkpoints: the trainer's in --out-dir, each expert server's in OUT_DIR/experts/server{i} (written "
               "when the demo ends, also on Ctrl-C); --resume resumes both, so the experts go on with the trainer "
               "(give the flags the demo was started with); without it both start afresh. One demo at a time per "
               "--out-dir.")


def add_demo_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The demo's own flags (the rest are dmoe-train's)."""
    parser.add_argument("--servers", type=int, default=2, help="expert servers to start (each hosts a slice)")
    parser.add_argument("--server-threads", type=int, default=1, help="torch threads per expert server")
    parser.add_argument("--verbose", action="store_true", help="show the servers' and DHT node's logs")
    parser.add_argument("--trainers", type=int, default=1,
                        help=f"trainer processes training one model together (--collaborate; 1 to {MAX_TRAINERS}); "
                             "1: train in this process")


def demo_defaults(trainers: int) -> dict[str, object]:
    """The demo's own defaults of dmoe-train's flags, which a --config file and the command line override."""
    return {**({"steps": 150} if trainers > 1 else {"max_minutes": 4.0}), "out_dir": "runs/demo"}


def demo_settings(trainers: int) -> Callable[[TrainConfig], None]:
    """What the demo sets of dmoe-train's flags itself, before they are checked (``parse_config``'s ``settle``):
    its servers' remote experts, and for a collaboration of ``trainers`` its run id and target batch unless given.
    Checked with dmoe-train's default --experts local, --collaborate was always refused."""
    def settle(config: TrainConfig) -> None:
        config.experts, config.initial_peers = "remote", (PENDING_PEER,)
        config.expert_flags_reach_servers = True  # (its servers start with the --expert-* flags)
        # without --resume the demo starts afresh, as documented, its trainers' checkpoints too (review 108 D1)
        config.fresh = config.fresh or not config.resume
        if trainers > 1:
            config.collaborate = config.collaborate or RUN_ID
            config.target_batch_size = config.target_batch_size or trainers * config.batch_size
    return settle


def set_by_demo(trainers: int) -> dict[str, str]:
    """dmoe-train's flags the demo sets itself, whatever is given (destination -> to what): each one given is
    refused (``parse_config``'s ``reserved``); they were accepted and silently overridden (review 90)."""
    flags = {"experts": "remote, the experts of its own servers", "initial_peers": "its own DHT node"}
    if trainers > 1:
        flags.update({"data_shard": "trainer i trains on slice i", "data_shards": "--trainers",
                      "wait_for_trainers": "--trainers"})
    return flags


def check_config_keys(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Exits naming the key when ``--config`` sets one of the demo's own flags: the file holds dmoe-train's flags
    (the collaboration's trainers read it too), and it was refused as an unknown key of dmoe-train."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv)[0].config
    if path is None:
        return
    try:
        keys = read_toml(path)
    except ConfigError:
        return  # parse_config says why, naming the file
    own = {action.dest for action in parser._actions if action.option_strings}
    for key in keys:
        if key.replace("-", "_") in own:
            flag = "--" + key.replace("_", "-")
            parser.error(f"config {path}: key {key!r} is one of {PROG}'s own flags, which a config file does not set "
                         f"(it sets dmoe-train's flags); give {flag} on the command line")


def help_parser(trainers: int) -> argparse.ArgumentParser:
    """What ``dmoe-demo --help`` prints: dmoe-train's flags with the demo's defaults (for this many ``--trainers``)
    and the demo's own flags, with the flags the demo sets marked so. It printed dmoe-train's parser as it is, with
    dmoe-train's defaults (runs/train, 400 steps, local experts), where users looked for the demo's checkpoint."""
    parser = build_parser()
    summary = __doc__.split("\n\n")[0].replace("``", "")
    parser.prog, parser.description, parser.epilog = PROG, f"{summary} {DESCRIPTION}", None
    parser.set_defaults(**demo_defaults(trainers), **({"collaborate": RUN_ID} if trainers > 1 else {}))
    add_demo_arguments(parser.add_argument_group("the demo's own flags"))
    reserved = set_by_demo(trainers)
    if trainers > 1:
        reserved["target_batch_size"] = "--trainers batches of --batch-size, unless given"
    for action in parser._actions:
        if action.dest in reserved:
            action.help = f"{action.help} [set by the demo: {reserved[action.dest]}]"
            action.default = argparse.SUPPRESS  # (what the demo gives is in the help)
        elif action.dest == "out_dir" and trainers > 1:
            action.help = f"{action.help} [trainer i's in OUT_DIR/trainer{{i}}]"
    return parser


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()
    demo = argparse.ArgumentParser(prog=PROG, add_help=False, description=DESCRIPTION)
    add_demo_arguments(demo)
    args, rest = demo.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        help_parser(args.trainers).print_help()
        return 0
    if not 1 <= args.trainers <= MAX_TRAINERS:
        demo.error(f"argument --trainers: must be between 1 and {MAX_TRAINERS}, got {args.trainers}")
    if args.server_threads < 1:
        demo.error(f"argument --server-threads: must be at least 1, got {args.server_threads}")
    collaborative = args.trainers > 1
    check_config_keys(demo, rest)
    config = parse_config(rest, defaults=demo_defaults(args.trainers), prog=PROG, settle=demo_settings(args.trainers),
                          reserved=set_by_demo(args.trainers))
    if not 1 <= args.servers <= config.grid[0]:
        demo.error(f"argument --servers: must be between 1 and the first grid dimension ({config.grid[0]})")
    if config.averaging_client_mode:  # every trainer in client mode: none owns a part of the averaging or serves the
        # state, so each stepped alone and finish() waited a minute for a state nobody served (review 112 D2)
        demo.error("argument --averaging-client-mode: the demo's trainers all run on this machine and reach each "
                   "other; with every trainer in client mode none could average or serve the state: leave it out")
    if config.data is not None:
        try:
            check_data(config, args.trainers)
        except DataError as error:
            print(f"{PROG}: {error}", file=sys.stderr)
            return 1
    if collaborative:
        check_trainer_ports(demo, config, args.trainers)
        try:
            trainer_args = collaborative_args(rest, config, args.trainers)
        except (DownloadError, OSError) as error:
            print(f"{PROG}: {error}", file=sys.stderr)
            return 1
        # a flag that does not fit fails here, not later (checked as the trainers check it: TRAINER_ENV)
        parse_config(trainer_args(0, PENDING_PEER), prog=PROG, settle=expert_flags_reach_servers)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    out_dir = Path(config.out_dir)
    experts_root = (out_dir / EXPERTS_DIR).resolve()  # the servers run in the repository's root
    try:
        # the trainer's checkpoint and the servers' go together: one demo at a time in a directory
        run_lock = lock_directory(out_dir, holder_kind="demo")
        if not config.resume:
            forget_experts(experts_root)
    except (CheckpointDirectoryInUse, OSError) as error:
        print(f"{PROG}: --out-dir: {error}", file=sys.stderr)
        return 1
    swarm_config = SwarmConfig(
        layers=tuple(f"ffn{i}" for i in range(config.layers)), grid=tuple(config.grid), n_servers=args.servers,
        hidden_dim=config.hidden, expert_cls=config.expert_cls, threads_per_server=args.server_threads,
        echo=args.verbose, checkpoint_root=experts_root, stop_timeout=SERVER_STOP_SECONDS,
        # the experts train (and start) as --experts local ones would: one source of truth, the trainer's flags
        server_args=(*config.expert_server_args(), "--refresh-period", "5",
                     "--log-level", "INFO" if args.verbose else "WARNING"),
    )
    if config.resume:
        mismatch = swarm_mismatch(experts_root, swarm_shape(swarm_config, args.trainers))
        if mismatch is not None:
            print(f"{PROG}: {mismatch}", file=sys.stderr)
            if run_lock is not None:
                run_lock.close()
            return 1
        warn_of_missing_experts(out_dir, experts_root, args.servers)
        warn_of_missing_trainers(out_dir, experts_root, trainer_checkpoints(config, args.trainers))
    try:
        # SIGTERM and SIGHUP stop the demo as Ctrl-C does (its swarm and trainers stopped, their checkpoints
        # written); by default they killed it where it stood, and its children stopped on their own, unreported
        with InterruptingSignals():
            return run_swarm(swarm_config, config, trainer_args if collaborative else None, args.trainers)
    except KeyboardInterrupt:
        print("interrupted; the swarm has been shut down", file=sys.stderr)
        return 130
    except PortUnavailable as error:  # (--trainers 1 --collaborate: the trainer is this process)
        message = port_error(error)
        print(f"{PROG}: {'error: ' + message if message else error}", file=sys.stderr)
        return 2 if message else 1
    except TRAINING_ERRORS as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 - only an out-of-memory of its trainer is one line (review 108 D2)
        message = out_of_memory_message(error, config)
        if message is None:
            raise
        print(f"{PROG}: {message}", file=sys.stderr)
        return 1
    finally:
        if run_lock is not None:
            run_lock.close()


def check_data(config: TrainConfig, trainers: int) -> None:
    """Reads --data and cuts it as the trainers will (raising :class:`DataError`) before the swarm starts: a file
    missing, empty or too short was told by the trainers after the swarm's start-up, 16 s (review 112 D4)."""
    data = TextData.from_file(config.data, config.val_fraction, config.seq_len + 1)
    if trainers > 1:  # trainer i trains on slice i
        for i in range(trainers):
            data.shard(i, trainers, config.seq_len + 1)
    elif config.data_shards > 1:
        data.shard(config.data_shard, config.data_shards, config.seq_len + 1)


def check_trainer_ports(parser: argparse.ArgumentParser, config: TrainConfig, trainers: int) -> None:
    """Trainer i listens on --averaging-port + i and --state-port + i where they are not 0: exits naming the flags
    if those ranges overlap (a trainer's averager would take another's state port: it died with a traceback) or
    run past 65535. (The demo's DHT node and servers take free ports: they collide with none.)"""
    ports = {"--averaging-port": config.averaging_port, "--state-port": config.state_port}
    for flag, first in ports.items():
        if first and first + trainers - 1 > 65535:
            parser.error(f"argument {flag}: {trainers} trainers count their ports up from {first} to "
                         f"{first + trainers - 1}, beyond 65535")
    averaging, state = ports.values()
    if averaging and state and abs(averaging - state) < trainers:
        parser.error(f"argument --state-port: trainer i listens on --averaging-port + i and --state-port + i, so "
                     f"--averaging-port and --state-port must be at least --trainers ({trainers}) apart, got "
                     f"{averaging} and {state}")


def warn_of_missing_experts(out_dir: Path, experts_root: Path, servers: int) -> None:
    """Says so when a trainer resumes and some server has no checkpoint of its experts: they start from their initial
    weights under a trained dense part (the machine died before the servers' first checkpoint, or the directory
    was moved), and the servers' own notice is below the demo's log level: the loss jumped without a word (review 82)."""
    if not any(out_dir.glob("**/checkpoint.pt")):
        return  # nothing to resume: everything starts afresh
    missing = [str(experts_root / f"server{i}" / EXPERTS_FILE) for i in range(servers)
               if not (experts_root / f"server{i}" / EXPERTS_FILE).exists()]
    if missing:
        print(f"{PROG}: warning: --resume: no checkpoint of the experts at {', '.join(missing)}: those experts start "
              f"from their initial weights while the trainer resumes from its checkpoint", file=sys.stderr)


def trainer_checkpoints(config: TrainConfig, trainers: int) -> list[Path]:
    """Where the trainer keeps its checkpoint, or each trainer of a collaboration of ``trainers`` (absolute: the
    trainers run from the repository's root)."""
    out_dir = Path(config.out_dir).resolve()
    checkpoint = Path(config.checkpoint).resolve() if config.checkpoint is not None else None
    if trainers == 1:
        return [checkpoint or out_dir / "checkpoint.pt"]
    if checkpoint is not None:
        return [checkpoint.with_name(f"{checkpoint.stem}.trainer{i}{checkpoint.suffix}") for i in range(trainers)]
    return [out_dir / f"trainer{i}" / "checkpoint.pt" for i in range(trainers)]


def warn_of_missing_trainers(out_dir: Path, experts_root: Path, checkpoints: list[Path]) -> None:
    """Says so when ``--resume`` finds the experts' checkpoints and no trainer checkpoint where this demo's trainers
    look (``checkpoints``): the dense part starts from step 0 against trained experts (the demo was killed before
    the trainer's first checkpoint, which its servers outlived long enough to save theirs), and the trainer's one
    "no checkpoint at" line was all that said it (review 96 D-med-2). Names any other trainer checkpoint found in
    ``out_dir`` (another ``--trainers`` keeps them elsewhere)."""
    if not any(experts_root.glob(f"server*/{EXPERTS_FILE}")) or any(path.exists() for path in checkpoints):
        return
    others = sorted(str(path.resolve()) for path in out_dir.glob("**/checkpoint.pt")
                    if path.resolve() not in checkpoints)
    where = ""
    if others:
        shown = ", ".join(others[:3]) + " ..." * (len(others) > 3)
        where = f"; trainer checkpoints are at {shown} (another --trainers?)"
    print(f"{PROG}: warning: --resume: the experts resume from their checkpoints in {experts_root}, but no trainer "
          f"checkpoint is at {', '.join(map(str, checkpoints))}: the dense part starts from step 0 against trained "
          f"experts{where} (leave out --resume to start both afresh)", file=sys.stderr)


def forget_experts(root: Path) -> None:
    """Removes the experts the servers checkpointed under ``root``, so that a demo started without ``--resume``
    trains new ones with its new trainer. Each server directory is locked meanwhile: a server still stopping (of a
    demo that was killed) could write its checkpoint again after the removal (raises CheckpointDirectoryInUse)."""
    for directory in sorted(root.glob("server*")):
        if (directory / EXPERTS_FILE).exists():
            lock = lock_directory(directory)
            try:
                (directory / EXPERTS_FILE).unlink()
            finally:
                if lock is not None:
                    lock.close()
    (root / SWARM_FILE).unlink(missing_ok=True)  # (written again once the new swarm is up)


def run_swarm(swarm_config: SwarmConfig, config: TrainConfig, trainer_args, trainers: int) -> int:
    """Starts the swarm, trains against it (in this process, or ``trainers`` processes with ``trainer_args``), and
    stops it, its servers writing their experts' last checkpoints; the demo's exit status."""
    started = time.monotonic()
    print(f"starting a local swarm: 1 DHT node, {swarm_config.n_servers} expert servers, "
          f"{config.layers} layers x {'x'.join(map(str, config.grid))} {config.expert_cls} experts ...", flush=True)
    swarm = LocalSwarm(swarm_config)
    try:
        swarm.start()
    except (RuntimeError, TimeoutError) as error:  # e.g. a server whose checkpoint holds other experts
        print(f"{PROG}: the swarm did not start: {start_failure(swarm, error)}", file=sys.stderr)
        return 1
    if swarm_config.checkpoint_root is not None:  # its servers took (or made) the experts' checkpoints there
        record_swarm(Path(swarm_config.checkpoint_root), swarm_shape(swarm_config, trainers))
    try:
        with swarm:
            print(f"swarm up in {time.monotonic() - started:.1f}s: DHT at {swarm.initial_peers}, "
                  f"servers at {', '.join(swarm.server_endpoints)}", flush=True)
            swarm.wait_declared()
            if trainer_args is not None:
                status = run_trainers(swarm.initial_peers, trainer_args, trainers, config)
            else:
                config.initial_peers = (swarm.initial_peers,)
                result = train(config)
                skipped = result["interrupted"] and math.isnan(result["final_val_loss"])  # (a cut validation's NaN)
                measured = "final validation skipped" if skipped else \
                    f"validation perplexity {result['final_val_perplexity']:.2f}"
                print(f"demo {'interrupted' if result['interrupted'] else 'done'}: {measured} after {result['step']} "
                      f"steps; shutting the swarm down (the servers checkpoint their experts in "
                      f"{swarm_config.checkpoint_root})", flush=True)
                if result["interrupted"]:
                    raise KeyboardInterrupt
                status = 0
    finally:
        for i, server_status in enumerate(swarm.server_statuses):
            if server_status != 0:  # with what it said last: the demo shows no server output unless --verbose
                last = "".join(swarm.servers[i].output[-5:]).rstrip() or "(nothing)"
                print(f"{PROG}: server {i} did not stop cleanly (exit status {server_status}): its experts' "
                      f"checkpoint in {swarm_config.checkpoint_root} may be older than the trainer's; its last "
                      f"lines:\n{last}", file=sys.stderr)
    # a server whose experts' last checkpoint was not written fails the run, as it fails dmoe-server and
    # dmoe-server --processes: the demo exited 0, and a later --resume paired the trainer with older experts
    # (review 96 D-med-1)
    if status == 0 and any(swarm.server_statuses):
        return 1
    return status


def start_failure(swarm: LocalSwarm, error: Exception) -> str:
    """Which program of ``swarm`` did not start, and what it said of why (:func:`failure_lines`; the whole output
    came first, a server's 40 lines of usage, review 90); ``error`` as it is where it names none."""
    for name, proc in [("its DHT node", swarm.dht), *((f"server {i}", p) for i, p in enumerate(swarm.servers))]:
        if proc is None or not str(error).startswith(str(proc.args)):
            continue
        what = "did not start in time" if isinstance(error, TimeoutError) else \
            f"exited with status {proc.popen.poll()}"
        return f"{name} {what}: {failure_lines(proc.output)} (--verbose shows its whole output)"
    return str(error)


#: a dmoe program's error line (argparse's form, which they use for their own errors too)
ERROR_LINE = re.compile(r"dmoe-[\w-]+: error: ")
#: at most this many lines of a program's error, each cut at :data:`FAILURE_LINE_CHARS` characters
FAILURE_LINES = 3
FAILURE_LINE_CHARS = 500


def failure_lines(output: list[str]) -> str:
    """What a program that failed said of why: its last error line (``dmoe-server: error: ...``, which names the
    flag and the file) and the lines that continue it, bounded; else its last line. The last line alone was the
    tail of a multi-line error, naming neither the file nor the flag (review 96 D-low-3)."""
    lines = [line.strip() for line in output if line.strip()]
    if not lines:
        return "(it printed nothing)"
    starts = [i for i, line in enumerate(lines) if ERROR_LINE.match(line)]
    shown = lines[starts[-1]:][:FAILURE_LINES] if starts else lines[-1:]
    return " / ".join(line if len(line) <= FAILURE_LINE_CHARS else line[:FAILURE_LINE_CHARS] + " ..."
                      for line in shown)


#: the flag of each entry of a swarm's shape (:func:`swarm_shape`)
SHAPE_FLAGS = {"servers": "--servers", "layers": "--layers", "grid": "--grid", "hidden": "--hidden",
               "expert_cls": "--expert-cls", "trainers": "--trainers"}


def swarm_shape(swarm_config: SwarmConfig, trainers: int) -> dict:
    """What the experts its servers checkpoint depend on: a resume with another finds other experts (or others'
    slices) in the servers' checkpoints. With them the count of trainers, which keep their checkpoints elsewhere
    for each count: a resume with another resumed the experts and started the dense part from step 0, and wrote a
    second run's trainer checkpoints beside the first's (review 96 D-med-2)."""
    return {"servers": swarm_config.n_servers, "layers": len(swarm_config.layers), "grid": list(swarm_config.grid),
            "hidden": swarm_config.hidden_dim, "expert_cls": swarm_config.expert_cls, "trainers": trainers}


def record_swarm(root: Path, shape: dict) -> None:
    """Writes ``shape`` beside the experts in ``root`` (:data:`SWARM_FILE`), for a ``--resume`` to compare."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (SWARM_FILE + ".tmp")
    tmp.write_text(json.dumps(shape) + "\n")
    os.replace(tmp, root / SWARM_FILE)


def swarm_mismatch(root: Path, shape: dict) -> str | None:
    """Why the experts checkpointed in ``root`` cannot be resumed by a swarm of ``shape``, naming the flags that
    differ from the swarm that checkpointed them; None if they can, or if there are none to resume (or no record
    of their swarm: a demo before the record was kept). A server then refused its checkpoint with 40 lines of its
    usage, naming --checkpoint-dir, a flag the user never gave (review 90)."""
    if not any(root.glob(f"server*/{EXPERTS_FILE}")):
        return None
    try:
        recorded = json.loads((root / SWARM_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict):
        return None
    changed = [f"{flag} was {_shown(recorded[key])}, now {_shown(shape[key])}" for key, flag in SHAPE_FLAGS.items()
               if key in recorded and recorded[key] != shape[key]]
    if not changed:
        return None
    return (f"--resume: the experts checkpointed in {root} were trained by another swarm: {'; '.join(changed)} "
            "(resume with the flags the demo was started with, or leave out --resume to start afresh)")


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def collaborative_args(rest: list[str], config: TrainConfig, trainers: int):
    """``trainer_args(i, initial_peers)``: the ``dmoe-train`` flags of trainer ``i`` (paths made absolute: the
    trainers run from the repository's root)."""
    if config.data is None:
        data = ["--data", str(shakespeare(config.data_dir).resolve())]  # downloaded once, not by N trainers at once
    else:
        data = ["--data", str(Path(config.data).resolve())]
    target = config.target_batch_size or trainers * config.batch_size
    out_dir = Path(config.out_dir).resolve()
    rest = absolute_config(rest)
    checkpoints = trainer_checkpoints(config, trainers)

    def trainer_args(i: int, initial_peers: str) -> list[str]:
        # what each trainer needs its own of: ports counted up from fixed ones, a checkpoint file
        own = []
        for flag, port in (("--averaging-port", config.averaging_port), ("--state-port", config.state_port)):
            if port:
                own += [flag, str(port + i)]
        if config.checkpoint is not None:
            own += ["--checkpoint", str(checkpoints[i])]
        return [*rest, *data, "--steps", str(config.steps), "--max-minutes", str(config.max_minutes),
                "--experts", "remote", "--initial-peers", initial_peers,
                "--collaborate", config.collaborate or RUN_ID, "--target-batch-size", str(target),
                "--data-shard", str(i), "--data-shards", str(trainers), "--wait-for-trainers", str(trainers),
                "--out-dir", str(out_dir / f"trainer{i}"), *own, *(["--sample-bytes", "0"] if i else []),
                *([] if config.resume else ["--fresh"])]  # (the demo starts afresh without --resume: review 108 D1)

    return trainer_args


def absolute_config(argv: list[str]) -> list[str]:
    """``argv`` (dmoe-train's flags) with the path of ``--config`` made absolute, however argparse took it:
    ``--config X``, ``--config=X`` or an abbreviation (``--conf X``, which stayed relative, and the trainers, which
    run from the repository's root, did not find it: review 90)."""
    options = build_parser()._option_string_actions

    def dest(name: str) -> str | None:
        """The destination argparse gives the option ``name`` (one it abbreviates included); None if none."""
        if name in options:
            return options[name].dest
        found = {options[option].dest for option in options if option.startswith(name)}
        return found.pop() if len(found) == 1 else None

    out, i = list(argv), 0
    while i < len(out):
        name, equals, value = out[i].partition("=")
        if name.startswith("--") and len(name) > 2 and dest(name) == "config":
            if equals:
                out[i] = f"{name}={Path(value).resolve()}"
            elif i + 1 < len(out):
                out[i + 1] = str(Path(out[i + 1]).resolve())
                i += 1
        i += 1
    return out


def stop_trainers(procs: list[Proc], relay: Callable[[], None] = lambda: None) -> None:
    """SIGINT, not the SIGKILL of processes(): each trainer finishes its step in flight and saves its checkpoint
    (SIGKILL for those still running after :data:`TRAINER_STOP_SECONDS`). ``relay`` shows their lines meanwhile."""
    for proc in procs:
        proc.interrupt()
    deadline = time.monotonic() + TRAINER_STOP_SECONDS
    while any(proc.alive for proc in procs) and time.monotonic() < deadline:
        relay()
        time.sleep(0.2)
    for proc in procs:
        proc.stop(0.0)  # (what is still running)
    relay()


def failed_trainer(procs: list[Proc], ended: set[int], finals: dict[int, re.Match]) -> tuple[int, int] | None:
    """(index, exit status) of a trainer that exited with an error before its final validation, whose output has
    all been read (``ended``); None if none did."""
    for i in sorted(ended):
        status = procs[i].popen.poll()
        if status not in (None, 0) and i not in finals:
            return i, status
    return None


def run_trainers(initial_peers: str, trainer_args, trainers: int, config: TrainConfig) -> int:
    """Runs the collaboration's trainers to the end: one bar for the collaboration, their validation lines, then
    each one's final validation perplexity. A trainer that fails stops the others (which would wait for it, up to
    --wait-for-trainers' 10 minutes, then train without it) and the demo, which says which one failed."""
    from dmoe.collab import CollaborationConfig, ProgressTracker
    from dmoe.dht import DHT

    run_id = config.collaborate or RUN_ID
    finals: dict[int, re.Match] = {}
    ended: set[int] = set()  # the trainers whose output has all been read
    failure: tuple[int, int] | None = None
    with processes() as procs, DHT([initial_peers], client_mode=True) as dht:

        def relay() -> None:
            """Shows the trainers' new lines, and notes each one's final validation and end of output."""
            for i, proc in enumerate(procs):
                while True:
                    try:
                        line = proc.lines.get_nowait()
                    except queue.Empty:
                        break
                    if line is None:
                        ended.add(i)
                        continue
                    found = FINAL.search(line)
                    if found:
                        finals[i] = found
                    if line.strip() and "resumed from" not in line:
                        tqdm.write(f"[trainer {i}] {line.rstrip()}")

        target = int(trainer_args(0, initial_peers)[trainer_args(0, initial_peers).index("--target-batch-size") + 1])
        observer = ProgressTracker(dht, run_id, CollaborationConfig(target, refresh_period=1.0))
        bar = tqdm(total=config.steps, unit="step", desc=f"{trainers} trainers", dynamic_ncols=True)
        try:  # (the trainers started in it: a Ctrl-C as soon as they run stops them as it says)
            for i in range(trainers):
                procs.append(Proc(["-m", "dmoe.cli.train", *trainer_args(i, initial_peers)], env=TRAINER_ENV))
            while any(proc.alive for proc in procs) or any(not proc.lines.empty() for proc in procs):
                relay()
                view = observer.state()
                step = min(view.top_step, bar.total)  # a progress record may claim any step: the bar stays in range
                if step > bar.n:
                    bar.update(step - bar.n)
                eta = view.eta
                bar.set_postfix({"trainers": view.num_trainers,
                                 "batch": f"{view.samples_accumulated}/{target}",
                                 "next": f"{eta:.0f}s" if math.isfinite(eta) else "?"}, refresh=False)
                failure = failed_trainer(procs, ended, finals)
                if failure is not None:
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:  # (the trainers run in sessions of their own: the terminal's Ctrl-C is ours only)
            # said here, and the trainers' lines shown as they stop: nothing was, for as long as an averaging round
            # in flight takes, and a second Ctrl-C killed them unsaved (review 96 D-low-5)
            running = sum(proc.alive for proc in procs)
            tqdm.write(f"{PROG}: interrupted: stopping {running} trainers, each after its step in flight and then "
                       f"saving its checkpoint (up to {TRAINER_STOP_SECONDS:.0f} s; interrupt again to kill them "
                       "unsaved)", file=sys.stderr)
            stop_trainers(procs, relay)
            raise
        finally:
            bar.close()
            observer.close()
        if failure is not None:  # (a Ctrl-C meanwhile: processes() kills them)
            print(f"{PROG}: trainer {failure[0]} exited with status {failure[1]} before it finished (its last "
                  "lines are above): stopping the other trainers", file=sys.stderr, flush=True)
            stop_trainers(procs, relay)
    for i in range(trainers):
        if i in finals:
            loss, perplexity, step = finals[i].groups()
            print(f"trainer {i}: validation perplexity {float(perplexity):.2f} (loss {float(loss):.4f}) at step {step}")
    if failure is not None:
        print(f"{PROG}: trainer {failure[0]} failed (exit status {failure[1]}); the others were stopped",
              file=sys.stderr)
        return 1
    failed = [i for i, proc in enumerate(procs) if proc.popen.returncode != 0 or i not in finals]
    if failed:
        print(f"{PROG}: trainers {failed} did not finish", file=sys.stderr)
        return 1
    print(f"demo done: {trainers} trainers, one model; shutting the swarm down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
