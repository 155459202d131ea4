"""``dmoe-server --processes N``: one server's experts dealt out among N server processes on this machine.

Why: a server process runs its gRPC handlers, decoding, validation and encoding in one Python interpreter, and on
a GPU that interpreter, not the GPU, bounds what the server carries (benchmarks/README.md, "On a GPU"). N processes
bring N interpreters to one GPU (or to many CPU cores); clients already send one call per server at once, so a
step's calls to the N processes run side by side.

The launching process (the parent) runs one DHT node, joined through ``--initial-peers`` (or starting a new DHT),
and picks the free cells of ``--num-experts`` through it; every child is a whole server
(:func:`dmoe.cli.server.serve`) joined through the parent's node, with every ``N``-th expert. Each child gets its
own gRPC port, DHT node, metrics endpoint and DHT identity (``PATH.process-I`` beside ``--identity PATH``), and,
under ``--checkpoint-dir``/``--replica-dir``, its own ``process-I`` subdirectory (holding its identity by default).
The children share a machine token (:class:`~dmoe.replicas.ReplicaConfig`): none pushes its replicas to a sibling,
which would leave with the machine, and no server puts two replicas of an expert on this machine. On a machine with
several GPUs, ``--device cuda`` (or none) puts child I on GPU I modulo their count; ``--device cuda:0`` keeps them
all on one. The server's resources stay the server's: the children share ``--torch-threads`` (by default the cores)
and ``--replica-budget-mb``, and those on one device share its ``--activation-cache-mb``. The parent prints the
program's usual lines once every child serves: ``dmoe-server listening on A (and N-1 more processes: B C ...)``.

The parent owns the children: SIGINT/SIGTERM (or the death of its own launcher) stops them cleanly (each writes its
last checkpoint and pushes its replicas). A child that dies after it served (the kernel's out-of-memory killer, an
abort in gRPC's core) is started again with the same flags and experts, from its last checkpoint under
``--checkpoint-dir`` (or from the seeds without one), while the others serve on: volunteers seldom run a
supervisor, and stopping every process for one would stop experts that never failed. Beyond
``--process-restarts`` restarts of one child in :data:`RESTART_WINDOW` seconds, its next death stops the others and
the parent with status 1, for a supervisor to restart the whole server. A child outlives no parent: it stops when
the parent dies without stopping it (:func:`dmoe.cli.signals.orphaned`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing
import os
import secrets
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Callable, Iterator

import torch

from dmoe.cli.allocator import keep_freed_memory
from dmoe.cli.server import (build_parser, dht_node_error, import_custom_modules, pick_cells, saved_cells,
                             serve)
from dmoe.cli.signals import PARENT_ENV, StopSignals
from dmoe.dht import DHT, Identity
from dmoe.directory import free_experts
from dmoe.server.checkpoints import FILENAME as CHECKPOINT_FILENAME
from dmoe.server.checkpoints import CheckpointDirectoryInUse, lock_directory, write_atomically
from dmoe.uid import split_uid

logger = logging.getLogger("dmoe.cli.server")

#: a child's subdirectory of --checkpoint-dir and --replica-dir
SUBDIRECTORY = "process-{}"
#: seconds a child gets to stop cleanly (last checkpoint, replica pushes) before it is killed
STOP_TIMEOUT = 120.0
#: seconds between the parent's checks that every child still runs
CHECK_PERIOD = 0.5
#: seconds over which a child's restarts are counted against --process-restarts
RESTART_WINDOW = 600.0
#: where a server of several processes records their count in --checkpoint-dir
LAYOUT_FILE = "processes.json"


def check_checkpoint_layout(args: argparse.Namespace, parser: argparse.ArgumentParser) -> IO[str] | None:
    """Refuses a ``--checkpoint-dir`` written by a server of another process count: its experts were dealt out
    otherwise, and starting anyway would start some of them from scratch (and write checkpoints that mix the two
    layouts). A server of several processes records its count in ``DIR/processes.json`` before any child starts
    (a count under which no child ever wrote a checkpoint binds nothing), and holds the directory's lock
    (:func:`~dmoe.server.checkpoints.lock_directory`), which it returns to keep for as long as it runs; each child
    locks its own ``process-I`` subdirectory."""
    if args.checkpoint_dir is None:
        return None
    directory = Path(args.checkpoint_dir)
    lock = None
    if args.processes > 1:  # (one process: its server's checkpoints lock the directory)
        try:
            lock = lock_directory(directory)  # creates it
        except (CheckpointDirectoryInUse, OSError) as error:
            parser.error(f"argument --checkpoint-dir: {error}")
    try:
        _check_layout(directory, args, parser)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    return lock


def _check_layout(directory: Path, args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    layout = directory / LAYOUT_FILE
    saved = 1 if (directory / CHECKPOINT_FILENAME).exists() else None  # None: nothing written here yet
    if layout.exists() and any(directory.glob(f"{SUBDIRECTORY.format('*')}/{CHECKPOINT_FILENAME}")):
        try:
            saved = json.loads(layout.read_text())["processes"]
            if not isinstance(saved, int) or saved < 2:
                raise ValueError(f"not a count of processes: {saved!r}")
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"argument --checkpoint-dir: {layout} cannot be read ({error}); it says how many processes "
                         f"wrote the checkpoints here")
    if saved is not None and saved != args.processes:
        hint = f"--processes {saved}" if saved > 1 else "no --processes"
        parser.error(f"argument --checkpoint-dir: {directory} holds the checkpoints of a server of {saved} "
                     f"process{'es' * (saved > 1)}: start it with {hint} (the experts are dealt out by the count)")
    if args.processes > 1 and saved is None:
        try:  # fsynced: lost to a power loss, it would let a restart without --processes start fresh experts
            write_atomically(layout, (json.dumps({"processes": args.processes}) + "\n").encode())
        except OSError as error:
            parser.error(f"argument --checkpoint-dir: {error}")


def check_port_ranges(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Process I listens on --port + I and serves its metrics on --metrics-port + I (both TCP): exits naming both
    flags when those ranges overlap. A child's metrics endpoint took a sibling's gRPC port, and one of them died ~20 s
    later blaming "another process", at a port the user never typed (review 96 D-low-1)."""
    port, metrics_port = args.port, args.metrics_port
    if port and metrics_port and abs(port - metrics_port) < args.processes:
        parser.error(f"argument --metrics-port: process I listens on --port + I and serves its metrics on "
                     f"--metrics-port + I, so --port and --metrics-port must be at least --processes "
                     f"({args.processes}) apart, got {port} and {metrics_port}")


def deal_cells(args: argparse.Namespace, parser: argparse.ArgumentParser, dht: DHT) -> list[list[str]]:
    """Each child's uids with ``--num-experts``: those its checkpoint holds (so the same command resumes the same
    experts), and for children with none, free cells other than those."""
    count, total = args.processes, args.num_experts * len(args.layer)
    sizes = [len(range(index, total, count)) for index in range(count)]
    saved = [saved_cells(Path(args.checkpoint_dir) / SUBDIRECTORY.format(index), args, parser, sizes[index])
             if args.checkpoint_dir is not None else None for index in range(count)]
    kept = [uid for uids in saved if uids is not None for uid in uids]
    if kept:
        logger.info("resuming the %d experts checkpointed in %s", len(kept), args.checkpoint_dir)
    if len(set(kept)) != len(kept):
        parser.error(f"argument --checkpoint-dir: the process-I subdirectories of {args.checkpoint_dir} hold "
                     "checkpoints of one expert twice")
    if all(uids is not None for uids in saved):
        return saved  # type: ignore[return-value]
    if not kept:  # every layer's experts spread over the processes
        uids = pick_cells(dht, args, parser, "these processes hold")
        if len(uids) < count:
            parser.error(f"argument --processes: {count} processes need as many free cells, and only {len(uids)} "
                         f"of the grids of --layer {' '.join(args.layer)} are free")
        return [uids[index::count] for index in range(count)]
    # --num-experts is a count per layer: each layer is asked for what its kept cells lack, and a child without a
    # checkpoint gets the layers of its share as the first start dealt them (of the cells listed layer after layer,
    # the one at position p is of layer p // num_experts). All taken from the first layer, the fresh cells could
    # leave another layer with no expert at all (review 99 D1).
    fresh: dict[str, list[str]] = {}
    for layer in args.layer:
        lacking = args.num_experts - sum(split_uid(uid)[0] == layer for uid in kept)  # (kept: no uid twice)
        # (num_experts asked for: room for the kept cells, which the directory may show free, left out here)
        chosen = free_experts(dht, [layer], args.grid, min(math.prod(args.grid), args.num_experts))
        fresh[layer] = [uid for uid in chosen if uid not in kept][:max(0, lacking)]
    chosen = [uid for uids in fresh.values() for uid in uids]
    if chosen:
        logger.info("chose %d more experts, free grid cells: %s", len(chosen), ", ".join(chosen))
    dealt = [uids if uids is not None else [] for uids in saved]
    new = [index for index, uids in enumerate(saved) if uids is None]
    for index in new:
        for position in range(index, total, count):
            cells = fresh[args.layer[position // args.num_experts]]
            dealt[index] += cells[:1]
            del cells[:1]
    leftover = [uid for uids in fresh.values() for uid in uids]  # (only where the kept cells were dealt otherwise)
    for index in new:
        missing = sizes[index] - len(dealt[index])
        dealt[index] += leftover[:missing]
        del leftover[:missing]
        if not dealt[index]:
            parser.error(f"argument --num-experts: process {index} holds no checkpoint, and no cell of the "
                         f"grids of --layer {' '.join(args.layer)} is left free for it")
    return dealt


def child_args(args: argparse.Namespace, index: int, dht_endpoint: str,
               key: Identity | None = None) -> argparse.Namespace:
    """The flags of child ``index``: ports counted up, the parent's DHT node as its peer, its own subdirectories.
    ``key``: the identity of a child with no identity file otherwise (no --identity, --checkpoint-dir or
    --replica-dir), the parent's for its lifetime, so that a child started again owns its uids at once (under a new
    key it would wait out the dead child's declarations, review 58). It reaches the child in its arguments, through
    the spawn pipe: a key file on disk would outlive a parent that is killed."""
    child = argparse.Namespace(**vars(args))
    child.processes, child.experts, child.num_experts = 1, None, None
    for flag in ("port", "dht_port", "metrics_port"):
        if getattr(args, flag):
            setattr(child, flag, getattr(args, flag) + index + (flag == "dht_port"))  # the parent's node has dht_port
    # the parent's node (at its loopback form when bound to every interface: a ping of 0.0.0.0 is answered from
    # another address, and dropped), then the swarm's own peers, which so learn the child at its real address
    child.initial_peers = [dht_endpoint, *(args.initial_peers or ())]
    for flag in ("checkpoint_dir", "replica_dir"):  # the default identity (in the checkpoint directory) too
        if getattr(args, flag) is not None:
            setattr(child, flag, str(Path(getattr(args, flag)) / SUBDIRECTORY.format(index)))
    if args.identity is not None:  # one each: an identity owns entries its siblings would overwrite (replicas)
        child.identity = f"{args.identity}.process-{index}"
    elif key is not None and args.checkpoint_dir is None and args.replica_dir is None:
        child.identity_seed = key.seed
    # --torch-threads (by default the cores) is the server's in all, as for one process: shared out, at least one each
    child.torch_threads = max(1, (args.torch_threads or torch.get_num_threads()) // args.processes)
    gpus = torch.cuda.device_count() if args.device in (None, "auto", "cuda") and torch.cuda.is_available() else 0
    if gpus > 1:
        child.device = f"cuda:{index % gpus}"  # the GPUs shared out too; cuda:0 keeps one
    # the memory budgets are the server's, as a volunteer sizes them: the kept activations of the processes that
    # share a device share its budget, and the replicas of all of them share the disk's
    sharing = len(range(index % gpus, args.processes, gpus)) if gpus > 1 else args.processes
    child.activation_cache_mb = args.activation_cache_mb / sharing
    if args.replica_dir is not None:
        child.replica_budget_mb = args.replica_budget_mb / args.processes
    child.max_queued_mb = args.max_queued_mb / args.processes  # host memory, all of them together
    return child


@contextlib.contextmanager
def terminal_signals_ignored() -> Iterator[None]:
    """SIGINT and SIGHUP ignored in this process meanwhile, so that a child started then (spawn: a fresh
    interpreter, which inherits ignored signals through exec) ignores them from its first instruction. Ctrl-C and a
    closed terminal reach the whole process group, and the parent stops the children: a child that took Ctrl-C for
    its own raised KeyboardInterrupt, a traceback, while it imported torch. (A signal in that moment is lost to the
    parent too: the user presses Ctrl-C again.)"""
    signums = [signal.SIGINT, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_child(args: argparse.Namespace, uids: list[str], parent_pid: int, lines: Connection, machine: str) -> None:
    """A child's whole life (the target of its process): a server of ``uids`` whose announcement lines go to the
    parent, which prints them once every child serves; ``machine``: the token its replicas' hosts are told apart by."""
    keep_freed_memory()
    # Ctrl-C and a closed terminal reach the whole group: the parent stops the children (with SIGTERM). Ignored
    # since the child's start (terminal_signals_ignored), and so left alone by StopSignals in serve()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.environ[PARENT_ENV] = str(parent_pid)  # stop if the parent dies without stopping this process
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    import_custom_modules(args, parser)  # again: this is a new interpreter
    serve(args, parser, uids, report=lines.send, machine=machine)


def announcement(lines: list[list[str]], kind: str) -> str | None:
    """The parent's one line of ``kind`` (``'listening on'``, ``'metrics on'``) for the children's lines."""
    endpoints = [line.split(f"{kind} ", 1)[1].split()[0] for child in lines for line in child if f" {kind} " in line]
    if not endpoints:
        return None
    more = ""
    if len(endpoints) > 1:
        more = f" (and {len(endpoints) - 1} more process{'es' * (len(endpoints) > 2)}: {' '.join(endpoints[1:])})"
    return f"dmoe-server {kind} {endpoints[0]}{more}"


def serve_in_processes(args: argparse.Namespace, parser: argparse.ArgumentParser, uids: list[str] | None) -> int:
    """Runs ``args.processes`` children until a stop signal or a child's death; returns the exit status."""
    count = args.processes
    check_port_ranges(args, parser)  # (before the DHT node and any child start)
    machine = secrets.token_hex(8)  # the children's replicas go to other machines, one per machine
    try:
        dht = DHT(initial_peers=args.initial_peers, host=args.host, port=args.dht_port)
    except OSError as error:
        parser.error(dht_node_error(error, args.host, args.dht_port))
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    children: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
    status = 0
    keys = [Identity() for _ in range(count)]  # the children's, when they have no key file of their own
    try:
        dealt = deal_cells(args, parser, dht) if uids is None else [uids[index::count] for index in range(count)]
        shared = dht.announced(dht.endpoint)
        print(f"dmoe-server DHT node at {shared} (others may pass it as --initial-peers)", flush=True)

        def start(index: int) -> tuple[multiprocessing.process.BaseProcess, Connection]:
            receiver, sender = context.Pipe(duplex=False)
            child = context.Process(target=run_child, name=f"dmoe-server-{index}",
                                    args=(child_args(args, index, dht.endpoint, keys[index]), dealt[index], os.getpid(),
                                          sender, machine))
            with terminal_signals_ignored():
                child.start()
            sender.close()
            return child, receiver

        with StopSignals() as stop:
            status = 1
            try:
                for index in range(count):
                    children.append(start(index))
                status = wait_ready(children, stop)
                if status is None:
                    status = watch(children, stop, start, args.process_restarts)
            finally:  # still under StopSignals: a second Ctrl-C does not kill the parent while the children stop
                if not stop_children([child for child, _ in children]) and status == 0:
                    status = 1  # (a child's last checkpoint failed, or it was killed before writing it)
    finally:
        dht.close()
    return status


def wait_ready(children: list[tuple[multiprocessing.process.BaseProcess, Connection]],
               stop: StopSignals) -> int | None:
    """Collects each child's lines until all listen, then prints the program's lines and returns None. A child
    that exits first (it printed why) ends the wait with its status, a stop signal with 0."""
    lines: list[list[str]] = [[] for _ in children]
    while not all(any(" listening on " in line for line in got) for got in lines):
        for (child, receiver), got in zip(children, lines):
            while receiver.poll():
                try:
                    got.append(receiver.recv())
                except EOFError:
                    break
            if not child.is_alive() and not any(" listening on " in line for line in got):
                logger.error("server process %s exited (status %s) before it served", child.name, child.exitcode)
                return child.exitcode or 1
        if stop.wait(timeout=0.1) is not None:
            return 0
    for kind in ("metrics on", "listening on"):
        line = announcement(lines, kind)
        if line is not None:
            print(line, flush=True)
    return None


def watch(children: list[tuple[multiprocessing.process.BaseProcess, Connection]], stop: StopSignals,
          start: Callable[[int], tuple[multiprocessing.process.BaseProcess, Connection]] | None = None,
          restarts: int = 0) -> int:
    """Waits for a stop signal (status 0), starting a child that died again (``start(index)``) up to ``restarts``
    times in :data:`RESTART_WINDOW` s; one more death ends the wait with status 1. ``children`` is updated in place,
    so that the caller stops the children running at the end."""
    started: list[list[float]] = [[] for _ in children]  # the times each child was started again
    while True:
        signum = stop.wait(timeout=CHECK_PERIOD)
        if signum is not None:
            logger.info("%s received, stopping %d server processes", signal.Signals(signum).name, len(children))
            return 0
        for index, (child, receiver) in enumerate(children):
            while receiver.poll():  # a child started again says where it serves now
                try:
                    line = receiver.recv()
                except EOFError:
                    break
                if " listening on " in line and started[index]:
                    logger.warning("server process %s serves again: %s", child.name, line.strip())
            if child.is_alive():
                continue
            now = time.monotonic()
            started[index] = [at for at in started[index] if now - at < RESTART_WINDOW]
            if start is None or len(started[index]) >= restarts:
                logger.error("server process %s exited (status %s)%s: stopping the others", child.name,
                             child.exitcode, f" after {len(started[index])} restarts in {RESTART_WINDOW:.0f} s"
                             if started[index] else "")
                return 1
            started[index].append(now)
            logger.error("server process %s exited (status %s): starting it again with its experts, from their last "
                         "checkpoint if any (%d of %d restarts in %.0f s); the others serve on", child.name,
                         child.exitcode, len(started[index]), restarts, RESTART_WINDOW)
            receiver.close()
            children[index] = start(index)


def stop_children(children: list[multiprocessing.process.BaseProcess]) -> bool:
    """SIGTERM to every child still running (a clean stop), then SIGKILL to any not gone in ``STOP_TIMEOUT`` s.
    Returns whether each of them stopped cleanly (status 0): a child whose last checkpoint could not be written exits
    1, as a server of one process does, and the program must say so by its status too (it exited 0: review 75)."""
    running = [child for child in children if child.is_alive() and child.pid is not None]
    for child in running:
        os.kill(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    clean = True
    for child in running:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            logger.error("server process %s did not stop in %.0f s: killing it (its experts' last checkpoint is "
                         "not written)", child.name, STOP_TIMEOUT)
            child.kill()
            child.join()
            clean = False
        elif child.exitcode not in (0, -signal.SIGTERM):  # (-SIGTERM: stopped before it served, nothing to save)
            logger.error("server process %s stopped with status %s (its log says why)", child.name, child.exitcode)
            clean = False
    return clean
