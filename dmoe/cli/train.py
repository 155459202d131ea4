"""``dmoe-train``: train a gated transformer language model whose feed-forward experts live in the swarm.

    dmoe-train                                          # in-process experts, Shakespeare, a few minutes
    dmoe-train --experts remote --initial-peers HOST:PORT
    dmoe-train --data my.txt --steps 2000 --resume      # any text file; continue from the last checkpoint
                                                        # (--fresh starts over it; neither: an existing one is refused)
    dmoe-train --experts remote --initial-peers HOST:PORT --collaborate RUN_ID --target-batch-size 4096
                                                        # one volunteer trainer of a collaboration (DeDLOC)

Every field of :class:`~dmoe.trainer.loop.TrainConfig` is a flag (``batch_size`` -> ``--batch-size``) and a key of
a ``--config`` TOML file (flags override the file). The loop itself is :func:`dmoe.trainer.loop.train`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Callable

from dmoe.cli.allocator import keep_freed_memory
from dmoe.cli.config import DefaultsHelpFormatter, add_config_argument, command_line_values, parse_given
from dmoe.cli.signals import InterruptingSignals
from dmoe.client.gating import NoAliveExpertsError, TooFewGradients
from dmoe.collab.progress import RecordTooLong
from dmoe.endpoints import PortUnavailable
from dmoe.server.runtime import is_out_of_memory
from dmoe.trainer.data import DataError, DownloadError
from dmoe.trainer.loop import (CheckpointExists, CheckpointInUse, CorruptCheckpoint, Diverged, ExpertsFailed,
                             ExpertsOfAnotherWidth, ModelTooLarge, ResumeMismatch, TrainConfig, first_line, train)


EPILOG = ("Collaborative training (one model, many volunteer trainers): every trainer runs "
          "'dmoe-train --experts remote --initial-peers HOST:PORT --collaborate RUN_ID --target-batch-size N' with "
          "the same model flags and --seed; it averages its gradients with the others every N samples over all "
          "trainers and applies the same step. Add --data-shard I --data-shards K to train on slice I of the text, "
          "--averaging-host PUBLIC_IP (and --averaging-port, --state-port) so the others can reach this trainer, or "
          "--averaging-client-mode behind NAT. A trainer that joins later downloads the state from a live one.")


def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field; booleans get --flag / --no-flag, tuples take several values."""
    parser = argparse.ArgumentParser(prog="dmoe-train", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter,
                                     epilog=EPILOG)
    add_config_argument(parser)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag, kind, meta = "--" + f.name.replace("_", "-"), hints[f.name], f.metadata
        options = {"default": f.default, "help": meta["help"]}
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
            continue
        args = [a for a in typing.get_args(kind) if a is not type(None) and a is not Ellipsis]
        if typing.get_origin(kind) is tuple:
            options["nargs"] = "+"
        base = args[0] if args else kind
        parser.add_argument(flag, type=meta["parse"] or base, choices=meta["choices"], **options)
    return parser


def parse_config(argv: list[str] | None = None, defaults: dict | None = None, prog: str | None = None,
                 settle: Callable[[TrainConfig], None] | None = None,
                 reserved: dict[str, str] | None = None) -> TrainConfig:
    """The flags (and ``--config`` file) as a checked TrainConfig. For a program built on dmoe-train's flags (the
    demo): ``defaults``, its own defaults, which a config file and the command line override, in that order;
    ``prog``, its name in error messages; ``settle(config)``, what it sets itself, applied before the check (the
    demo's remote experts: a --collaborate checked before them was refused as needing --experts remote);
    ``reserved``, the flags it sets itself whatever is given (destination -> what it sets them to), each refused
    when given: they were accepted and silently overridden (review 90)."""
    parser = build_parser()
    if prog is not None:
        parser.prog = prog
    if defaults:
        parser.set_defaults(**defaults)
    args, given = parse_given(parser, argv)
    for name, what in (reserved or {}).items():
        if name in given:
            where = "" if name in command_line_values(parser, argv) else " (in the --config file)"
            parser.error(f"{flag_name(name)}{where} is set by {parser.prog} itself ({what}); leave it out")
    config = TrainConfig(**{name: tuple(v) if isinstance(v, list) else v for name, v in vars(args).items()})
    if settle is not None:
        settle(config)
    try:
        config.validate()
        check_modes(config, given)
    except ValueError as e:
        parser.error(str(e))
    return config


#: flags read only by a collaboration (:meth:`TrainConfig.collaboration_settings` and the wait before the loop)
COLLABORATION_FLAGS = ("target_batch_size", "averaging_host", "averaging_announce_host", "averaging_port",
                       "state_port", "averaging_client_mode", "matchmaking_time", "allreduce_timeout",
                       "averaging_compression", "bandwidth", "wait_for_trainers", "refresh_period", "progress_ttl")
#: flags read only by the remote mixture layers (``--experts remote``)
REMOTE_EXPERT_FLAGS = ("k_min", "forward_timeout", "backward_timeout", "timeout_after_k_min", "backward_k_min",
                       "max_abs_value", "allow_zero_outputs")
#: flags read only by in-process experts (``--experts local``), or by the servers a program starts with them
#: (dmoe-demo: :attr:`TrainConfig.expert_flags_reach_servers`)
LOCAL_EXPERT_FLAGS = ("expert_cls", "expert_optimizer", "expert_lr", "expert_clip_grad_norm")
#: what a server is started with instead of each of them
SERVER_FLAGS = {"expert_cls": "--expert-cls", "expert_optimizer": "--optimizer", "expert_lr": "--lr",
                "expert_clip_grad_norm": "--clip-grad-norm"}
#: set in the environment of a dmoe-train process whose remote experts' servers were started with its --expert-*
#: flags (dmoe-demo's collaborating trainers): those flags then do something, and are accepted
EXPERT_FLAGS_REACH_SERVERS_ENV = "DMOE_EXPERT_FLAGS_REACH_SERVERS"


def flag_name(name: str) -> str:
    """The flag of a TrainConfig field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def check_modes(config: TrainConfig, given: frozenset[str]) -> None:
    """Raises ValueError naming a flag that was ``given`` (on the command line or in the config file) and that the
    run would ignore: a collaboration's flag without ``--collaborate``, a remote expert's with ``--experts local``,
    ``--balance-coef`` without ``--switch``, an in-process expert's with ``--experts remote`` (unless the program
    starts the servers with them, :attr:`TrainConfig.expert_flags_reach_servers`: the demo). They were accepted and
    did nothing (reviews 72, 90). Given, not set to another value than the default: a program built on these flags
    (the demo) sets some itself."""
    if config.collaborate is None:
        for name in COLLABORATION_FLAGS:
            if name in given:
                raise ValueError(f"{flag_name(name)} is only used with --collaborate RUN_ID (this trainer trains "
                                 "alone)")
    if config.experts != "remote":
        for name in REMOTE_EXPERT_FLAGS:
            if name in given:
                raise ValueError(f"{flag_name(name)} is only used with --experts remote (these experts are in-process)")
    elif not config.expert_flags_take_effect():
        for name in LOCAL_EXPERT_FLAGS:
            if name in given:
                role = "built" if name == "expert_cls" else "trained"
                raise ValueError(f"{flag_name(name)} is only used with --experts local (remote experts are {role} by "
                                 f"their servers: dmoe-server's {SERVER_FLAGS[name]} sets that)")
    if "balance_coef" in given and not config.switch:
        raise ValueError("--balance-coef is only used with --switch (the load-balancing loss of Switch gating)")


def expert_flags_reach_servers(config: TrainConfig) -> None:
    """``parse_config``'s ``settle`` for a trainer whose remote experts' servers were started with its --expert-*
    flags (:data:`EXPERT_FLAGS_REACH_SERVERS_ENV`)."""
    config.expert_flags_reach_servers = True


#: the flag that sets the port of each server a trainer listens with (:attr:`PortUnavailable.service`)
PORT_FLAGS = {"averager": "--averaging-port", "state server": "--state-port"}


def port_error(error: PortUnavailable) -> str | None:
    """The usage error for a trainer's averager or state server that could not listen, naming the flag of its port
    (it ended in a traceback, or in a line that named no flag); None for another server."""
    flag = PORT_FLAGS.get(error.service)
    return None if flag is None else f"argument {flag}: {error}"


#: what ends a training with a one-line message, no traceback (here and in dmoe-demo, which missed some: review 82):
#: no corpus (or one too short), no DHT peer, a checkpoint of another model, damaged or in use by another trainer, a
#: state endpoint too long to publish, a run that diverged, or experts that failed as --no-allow-zero-outputs or
#: --backward-k-min ask (the loop saved the last complete step and names the flag: review 90), a model the memory
#: free cannot hold (review 100 D8), a checkpoint a run without --resume or --fresh would write over (review 108 D1)
TRAINING_ERRORS = (DownloadError, DataError, OSError, ResumeMismatch, CorruptCheckpoint, CheckpointInUse, RecordTooLong,
                   Diverged, ExpertsFailed, NoAliveExpertsError, TooFewGradients, ModelTooLarge, CheckpointExists)


def out_of_memory_message(error: BaseException, config: TrainConfig) -> str | None:
    """The one line for an out-of-memory that ended a step or a validation (the loop saved the last complete step
    first), naming the flags that size the activations; None for another error. It ended in a traceback naming no
    flag: only the parameters are checked up front (review 108 D2)."""
    if not is_out_of_memory(error):
        return None
    return (f"out of memory on --device {config.device} with --batch-size {config.batch_size} x --seq-len "
            f"{config.seq_len} (attention grows with the square of --seq-len): give a smaller --batch-size or "
            f"--seq-len ({first_line(error)})")


def main(argv: list[str] | None = None) -> None:
    """Exits 0 when the run ended, 130 when a stop signal (Ctrl-C, SIGTERM, SIGHUP; or the death of the program
    that launched it, see :func:`dmoe.cli.signals.orphaned`) ended it early (after saving the checkpoint, which
    ``--resume`` continues): a scheduler must not take a stopped run for a finished one; 1 when it diverged (the
    loss stayed NaN or infinite; the last good checkpoint is kept) or failed (an error in a step, a closed output
    aside: the last complete step is saved first, unless the error cut its update)."""
    keep_freed_memory()
    config = parse_config(argv, settle=expert_flags_reach_servers
                          if os.environ.get(EXPERT_FLAGS_REACH_SERVERS_ENV) == "1" else None)
    stepped: list[int] = []  # (steps taken: a stop signal after them came while the trainer closed)
    try:
        # SIGTERM and SIGHUP stop it as Ctrl-C does from the start, not only in the loop (which defers them to the
        # end of its step): joining the DHT, downloading a joiner's state and --wait-for-trainers (up to 10 minutes)
        # were killed where they stood, with status 143 or 129, no message, and nothing closed (review 72)
        with InterruptingSignals():
            result = train(config, on_step=lambda step, model: stepped.append(step))
    except PortUnavailable as e:  # an --averaging-port or --state-port taken: a usage error, as dmoe-server's --port
        message = port_error(e)
        if message is None:
            raise SystemExit(f"dmoe-train: {e}") from None
        build_parser().error(message)
    except ExpertsOfAnotherWidth as e:  # a --hidden the swarm's servers do not take: a usage error, found once the
        build_parser().error(str(e))  # trainer has asked an expert (review 112 D1)
    except TRAINING_ERRORS as e:
        raise SystemExit(f"dmoe-train: {e}")
    except Exception as e:  # noqa: BLE001 - only an out-of-memory is turned into a line; anything else is a bug
        message = out_of_memory_message(e, config)
        if message is None:
            raise
        raise SystemExit(f"dmoe-train: {message}") from None
    except KeyboardInterrupt:  # a stop signal outside the loop (which saves and returns): joining, waiting for
        # trainers; or after it, while the trainer closed its DHT node and connections (its checkpoint written)
        print("dmoe-train: interrupted " + ("while closing, after its last checkpoint" if stepped
                                            else "before training began"), file=sys.stderr)
        raise SystemExit(130) from None
    if result["interrupted"]:
        raise SystemExit(130)


if __name__ == "__main__":
    main()
