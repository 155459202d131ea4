"""The training loop of ``dmoe-train``: a gated transformer LM whose feed-forward experts live in the swarm.

:class:`TrainConfig` holds every setting (each field is a ``dmoe-train`` flag, see :mod:`dmoe.cli.train`);
:func:`train` runs the loop with progress bar, validation, checkpoints and the loss curve.

The client's AdamW (warm-up, cosine decay, clipping) trains only the client's own parameters (embeddings,
attention, gates, head). Every expert is trained as a server trains it: by its own optimizer
(``--expert-optimizer``, constant ``--expert-lr``, ``--expert-clip-grad-norm``), stepped once per backward that
reaches it. ``--experts local`` builds such experts in process, so a local run differs from a remote one only by
the network; for a remote swarm to match it, start its servers with :meth:`TrainConfig.expert_server_args`
(``--optimizer adam --lr 0.003 --seed 0`` by default), as ``make demo`` does. Checkpoints hold the client's
parameters and optimizer, and in-process experts with their optimizers; remote experts are checkpointed by their
servers (``dmoe-server --checkpoint-dir``).

``--collaborate RUN_ID`` trains one model together with every other trainer of that run (DeDLOC, see
:mod:`dmoe.collab`): the client's optimizer is wrapped in a :class:`~dmoe.collab.CollaborativeOptimizer`, a step
is one global step of the collaboration (``--target-batch-size`` samples over all trainers, whose averaged
gradients every trainer applies alike), and each trainer reads its own slice of the text (``--data-shard I
--data-shards N``). A trainer that joins late or resumes downloads the current state from a live one.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from dmoe.cli.config import MAX_THREADS, duration, non_negative, port_number, positive
from dmoe.cli.signals import DeferredInterrupt, InterruptingSignals, orphaned
from dmoe.cli.sizes import check_trainable, check_width, parameter_bytes
from dmoe.collab.config import check_run_id
from dmoe.dht.node import listen_host, parse_endpoint
from dmoe.endpoints import check_host, is_loopback_ip
from dmoe.experts import create_expert, expert_class_names, mixture_input_problem
from dmoe.locking import InUse, lock_file
from dmoe.server.backend import OPTIMIZERS, all_finite
from dmoe.server.checkpoints import _first_os_error as first_os_error
from dmoe.server.checkpoints import _fsync_directory as fsync_directory
from dmoe.server.in_process import ExpertOptimizerConfig, InProcessExpert, in_process_experts
from dmoe.server.runtime import is_out_of_memory
from dmoe.server.server import check_device
from dmoe.trainer.data import SHAKESPEARE_FILE, VOCAB_SIZE, TextData, shakespeare
from dmoe.trainer.model import GatedTransformerLM, ModelConfig, MoEFactory


#: said, after the signal's name, at a stop signal during a checkpoint's write after the loop
SAVE_NOTICE = "stopping once the checkpoint is written (Ctrl-C again: stop at once, leaving the last one as it was)"
#: steps in a row whose loss or gradient is not finite (each skipped) after which the run stops as diverged
MAX_NONFINITE_STEPS = 10

#: said, after the signal's name, at the loop's first stop signal (:class:`~dmoe.cli.signals.DeferredInterrupt`)
STOP_NOTICE = "stopping after the step in flight, then saving the checkpoint (Ctrl-C again: stop at once)"


def _option(default, help: str, parse=None, choices=None):
    return field(default=default, metadata={"help": help, "parse": parse, "choices": choices})


@dataclass
class TrainConfig:
    # data
    data: str | None = _option(None, "train on this text file instead of the Shakespeare corpus")
    data_dir: str = _option("data", "where the Shakespeare corpus is downloaded and cached")
    val_fraction: float = _option(0.05, "the tail of the text held out for validation", positive(float))
    # model
    seq_len: int = _option(64, "context length in bytes", positive(int))
    hidden: int = _option(128, "model width", positive(int))
    layers: int = _option(2, "transformer blocks, each with its own expert grid ffn{i}", positive(int))
    heads: int = _option(4, "attention heads", positive(int))
    dropout: float = _option(0.0, "dropout on the client's layers", non_negative(float))
    grid: tuple[int, ...] = _option((4, 4), "expert grid of each layer, e.g. --grid 4 4", positive(int))
    k_best: int = _option(4, "experts mixed per token", positive(int))
    switch: bool = _option(False, "Switch-style gating (use with --k-best 1): a token's expert weighs its router "
                                  "probability over the whole grid, and a load-balancing loss is added")
    balance_coef: float = _option(0.1, "weight of the load-balancing loss with --switch", non_negative(float))
    # experts
    experts: str = _option("local", "in-process experts or experts found through the DHT", choices=("local", "remote"))
    initial_peers: tuple[str, ...] = _option((), "HOST:PORT of DHT peers (with --experts remote)")
    expert_cls: str = _option("ffn", "expert type of in-process experts (with --experts local)")
    expert_optimizer: str = _option("adam", "each expert's own optimizer, stepped once per backward that reaches it "
                                            "(in-process experts; make demo passes it to its servers)",
                                    choices=tuple(OPTIMIZERS))
    expert_lr: float = _option(3e-3, "the experts' constant learning rate (servers: --lr)", positive(float))
    expert_clip_grad_norm: float = _option(0.0, "clip each expert's gradient norm before its step (0: off; servers: "
                                                "--clip-grad-norm)", non_negative(float))
    k_min: int = _option(1, "answers each token waits for before the timeout_after_k_min grace", positive(int))
    forward_timeout: float = _option(10.0, "seconds to wait for experts' forward answers", duration())
    backward_timeout: float = _option(10.0, "seconds to wait for experts' backward answers", duration())
    timeout_after_k_min: float = _option(1.0, "extra seconds for slower experts once k_min answered",
                                        duration(zero=True))
    allow_zero_outputs: bool = _option(True, "a token whose experts all failed skips the layer instead of raising")
    backward_k_min: int = _option(0, "backward raises for a token with fewer expert gradients than this, or than "
                                     "the experts that answered its forward if fewer (0: never, so a server that "
                                     "dies between forward and backward only costs its gradients)",
                                  non_negative(int))
    max_abs_value: float = _option(1e6, "drop and ban an expert whose answer (outputs, or input gradients) holds a "
                                        "value of a larger magnitude (0: no limit; the servers' --max-abs-value "
                                        "bounds what they accept)", non_negative(float))
    # optimisation
    steps: int = _option(400, "optimizer steps in total (a resumed run continues up to this step)", positive(int))
    batch_size: int = _option(16, "windows per batch", positive(int))
    lr: float = _option(3e-3, "peak learning rate of the client's AdamW", positive(float))
    warmup_steps: int = _option(50, "linear warm-up steps, then cosine decay to lr / 10", non_negative(int))
    weight_decay: float = _option(0.0, "AdamW weight decay", non_negative(float))
    grad_clip: float = _option(1.0, "clip the client's gradient norm (0: off)", non_negative(float))
    # bookkeeping
    eval_interval: int = _option(100, "steps between validation passes", positive(int))
    eval_batches: int = _option(8, "batches per validation pass", positive(int))
    checkpoint_interval: int = _option(100, "steps between checkpoints", positive(int))
    out_dir: str = _option("runs/train", "where the checkpoint and loss curve are written")
    checkpoint: str | None = _option(None, "checkpoint file (default: OUT_DIR/checkpoint.pt)")
    resume: bool = _option(False, "continue from the checkpoint if there is one")
    fresh: bool = _option(False, "start from step 0 over an existing checkpoint (without it or --resume, an existing "
                                 "checkpoint is refused)")
    max_minutes: float = _option(0.0, "stop after this many minutes of this run (a resumed run counts afresh; 0: "
                                 "no limit)", duration("min", zero=True))
    sample_bytes: int = _option(200, "bytes of text to sample at the end (0: none)", non_negative(int))
    data_shard: int = _option(0, "train on this slice of the training text (0-based; with --data-shards)",
                              non_negative(int))
    data_shards: int = _option(1, "cut the training text into this many contiguous slices (one per trainer of a "
                                  "collaboration); validation always uses the whole held-out tail", positive(int))
    # collaboration (DeDLOC): one model, many trainers
    collaborate: str | None = _option(None, "RUN_ID: train one model with every trainer of this run: gradients of "
                                            "the client's parameters are averaged every --target-batch-size samples "
                                            "(needs --experts remote; --steps counts global steps)")
    target_batch_size: int = _option(0, "samples per global step, over all trainers (with --collaborate)",
                                     non_negative(int))
    averaging_host: str = _option("127.0.0.1", "address this trainer's averager and state server listen on, "
                                               "reachable by the other trainers (with --collaborate)")
    averaging_announce_host: str | None = _option(
        None, "address the other trainers are told for this trainer's averager and state server, where it is not "
              "--averaging-host (behind NAT, e.g. a cloud VM's public address; default: --averaging-host, or for "
              "0.0.0.0 this machine's address toward its DHT peers)")
    averaging_port: int = _option(0, "port of the averager (0: any free one)", port_number)
    state_port: int = _option(0, "port that serves this trainer's state to joiners (0: any free one)", port_number)
    averaging_client_mode: bool = _option(False, "accept no connections (behind NAT): average by sending only, "
                                                 "download the state but serve none")
    matchmaking_time: float = _option(5.0, "seconds the averaging group waits for trainers counted but late",
                                      duration())
    allreduce_timeout: float = _option(30.0, "seconds a member of the averaging group may take to deliver",
                                       duration())
    averaging_compression: str = _option("none", "compression of averaged gradients on the wire",
                                         choices=("none", "float16", "uint8"))
    bandwidth: float = _option(1.0, "this trainer's bandwidth relative to the others': its share of the "
                                    "averaging work", positive(float))
    wait_for_trainers: int = _option(0, "before the first step, wait (up to 10 minutes) until this many trainers "
                                        "of the collaboration are there, this one included", non_negative(int))
    refresh_period: float = _option(1.0, "seconds between publications of this trainer's progress",
                                    duration())
    progress_ttl: float = _option(10.0, "seconds a dead trainer's progress keeps being counted", duration())
    seed: int = _option(0, "seed for initialisation and batch order (trainers of one collaboration: the same)")
    device: str = _option("cpu", "torch device of the client's layers")
    threads: int = _option(0, "torch CPU threads (0: torch's default)", non_negative(int))

    #: not a flag: True where the ``--expert-*`` flags reach remote experts too, because the program that runs this
    #: trainer started their servers with :meth:`expert_server_args` (dmoe-demo). Plain ``dmoe-train --experts
    #: remote`` refuses those flags, and a resume announces their changes only where they take effect (review 90)
    expert_flags_reach_servers = False

    def expert_flags_take_effect(self) -> bool:
        """Whether ``--expert-optimizer``, ``--expert-lr``, ``--expert-clip-grad-norm`` and ``--expert-cls`` train
        (and build) this run's experts: in-process ones, or the demo's servers'."""
        return self.experts == "local" or self.expert_flags_reach_servers

    def validate(self) -> None:
        """Raises ValueError naming the flag when options do not fit together."""
        for f in dataclasses.fields(self):  # inf or nan would train NaN to the end, or wait for ever
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
        if self.threads > MAX_THREADS:  # (torch crashed on 100000)
            raise ValueError(f"--threads {self.threads} is absurd (at most {MAX_THREADS}; this machine has "
                             f"{os.cpu_count()} cores, and 0 lets torch choose)")
        if not self.dropout < 1:
            raise ValueError(f"--dropout must be below 1, got {self.dropout}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be in 0..{2**32 - 1}, got {self.seed}")
        if self.data == "":
            raise ValueError("--data must name a text file (leave it out for the Shakespeare corpus)")
        if self.checkpoint == "":  # (it meant the default OUT_DIR/checkpoint.pt, unsaid)
            raise ValueError("--checkpoint must name a file (leave it out for OUT_DIR/checkpoint.pt)")
        for name in ("out_dir", "data_dir"):  # an unset shell variable: the checkpoint, its lock and the curve went
            # into the current directory, and a --resume resumed whatever checkpoint.pt was there (review 100 D10)
            if not getattr(self, name).strip():  # ("the default": the demo's --out-dir is not dmoe-train's)
                raise ValueError(f"--{name.replace('_', '-')} must name a directory (leave it out for the default)")
        if self.resume and self.fresh:
            raise ValueError("--resume and --fresh contradict each other: give one (--resume continues the checkpoint, "
                             "--fresh starts afresh over it)")
        if self.expert_cls not in expert_class_names():
            raise ValueError(f"--expert-cls: unknown class {self.expert_cls!r}; registered: "
                             f"{', '.join(expert_class_names())}")
        problem = mixture_input_problem(self.expert_cls, self.hidden) if self.expert_flags_take_effect() else None
        if problem is not None:  # (the demo's servers refused every call of its layers, and it ended with status 0)
            raise ValueError(f"--expert-cls {self.expert_cls}: {problem}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"--device: {error}") from None
        try:
            check_device(device)
        except ValueError as error:
            raise ValueError(f"--device {self.device}: {error}") from None
        if self.initial_peers and self.experts != "remote":
            raise ValueError("--initial-peers is only used with --experts remote (these experts are in-process)")
        for peer in self.initial_peers:
            try:
                parse_endpoint(peer)
            except ValueError as error:
                raise ValueError(f"--initial-peers: {error}") from None
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")
        check_width("--hidden", self.hidden)
        if self.k_best > math.prod(self.grid):
            raise ValueError(f"--k-best {self.k_best} is more than the {math.prod(self.grid)} experts of --grid")
        if self.k_best == 1 and not self.switch:
            raise ValueError("--k-best 1 needs --switch: with one expert per token its renormalised weight is always "
                             "1, and the gate would never learn")
        if self.k_min > self.k_best:
            raise ValueError(f"--k-min {self.k_min} is more than --k-best {self.k_best}")
        if self.backward_k_min > self.k_best:
            raise ValueError(f"--backward-k-min {self.backward_k_min} is more than --k-best {self.k_best}")
        if self.experts == "remote" and not self.initial_peers:
            raise ValueError("--initial-peers HOST:PORT is required with --experts remote")
        if self.val_fraction >= 1:
            raise ValueError(f"--val-fraction must be below 1, got {self.val_fraction}")
        if self.data_shard >= self.data_shards:
            raise ValueError(f"--data-shard {self.data_shard} must be below --data-shards {self.data_shards}")
        self._check_model_fits()
        if self.collaborate is not None:
            if self.experts != "remote":
                raise ValueError("--collaborate needs --experts remote: in-process experts would differ between "
                                 "the trainers")
            if not self.target_batch_size:
                raise ValueError("--target-batch-size is required with --collaborate")
            check_run_id(self.collaborate)
            if self.averaging_port and self.averaging_port == self.state_port and not self.averaging_client_mode:
                raise ValueError(f"--averaging-port and --state-port must differ (the averager and the state server "
                                 f"each listen on their own port), both are {self.state_port}")
            if self.averaging_announce_host:  # (review 99 D5: HOST:PORT was announced as [HOST:PORT]:PORT)
                try:
                    check_host(self.averaging_announce_host)
                except ValueError as error:
                    raise ValueError(f"--averaging-announce-host: {error}") from None
            self._check_averaging_host()

    def sizes(self) -> str:
        """The flags that size the model, as given: what an error about its size names."""
        grid = f" --grid {' '.join(map(str, self.grid))}" if self.experts == "local" else ""
        return f"--hidden {self.hidden} --layers {self.layers} --seq-len {self.seq_len}{grid}"

    def _check_model_fits(self) -> None:
        """Refuses a model whose parameters (the client's and the in-process experts') and their gradients alone
        exceed the memory of ``--device``, counted without building it: torch's allocator ended the run in a
        traceback naming no flag (review 100 D8)."""
        try:
            client = parameter_bytes(lambda: GatedTransformerLM(self.model_config(), lambda i: torch.nn.Identity()))
        except (RuntimeError, TypeError, OverflowError, ValueError) as error:  # sizes torch cannot represent
            raise ValueError(f"the model of {self.sizes()} is too large to build: {first_line(error)}") from None
        experts = 0
        if self.experts == "local":
            try:
                one = parameter_bytes(lambda: create_expert(self.expert_cls, self.hidden))
            except Exception:  # noqa: BLE001 - (the expert's real build says what is wrong with it)
                one = 0
            experts = one * math.prod(self.grid) * self.layers
        check_trainable(f"the model of {self.sizes()}", client + experts, torch.device(self.device))

    def _check_averaging_host(self) -> None:
        """Trainers on other machines must reach this one's averager and state server: a loopback address would be
        announced to them, and every round with this trainer would fail on it."""
        if self.averaging_client_mode or self.averaging_announce_host or not is_loopback_ip(self.averaging_host):
            return
        try:
            peers = [parse_endpoint(peer) for peer in self.initial_peers]
        except ValueError as error:
            raise ValueError(f"--initial-peers: {error}") from None
        if not is_loopback_ip(listen_host(peers)):  # the peers are not all on this host
            raise ValueError(f"--averaging-host {self.averaging_host} cannot be reached by trainers on other machines "
                             f"(--initial-peers {' '.join(self.initial_peers)} are not all on this host): give this "
                             "machine's address that they can reach (or 0.0.0.0, with --averaging-announce-host "
                             "behind NAT), or --averaging-client-mode to serve nothing")

    def collaboration_settings(self) -> dict:
        """Keyword arguments of :class:`~dmoe.collab.CollaborativeOptimizer` for ``--collaborate``."""
        return dict(
            target_batch_size=self.target_batch_size, grad_clip=self.grad_clip, state_host=self.averaging_host,
            state_port=self.state_port, refresh_period=self.refresh_period, progress_ttl=self.progress_ttl,
            host=self.averaging_host, port=self.averaging_port, client_mode=self.averaging_client_mode,
            announce_host=self.averaging_announce_host, state_announce_host=self.averaging_announce_host,
            matchmaking_time=self.matchmaking_time, allreduce_timeout=self.allreduce_timeout,
            compression=self.averaging_compression, bandwidth=self.bandwidth)

    def expert_optimizer_config(self) -> ExpertOptimizerConfig:
        """How every expert is trained: in process (``--experts local``) and on the servers ``make demo`` starts."""
        return ExpertOptimizerConfig(self.expert_optimizer, self.expert_lr, self.expert_clip_grad_norm or None)

    def expert_server_args(self) -> list[str]:
        """The ``dmoe-server`` flags under which remote experts train, and start, as ``--experts local`` ones do."""
        return [*self.expert_optimizer_config().server_args(), "--seed", str(self.seed)]

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=VOCAB_SIZE, seq_len=self.seq_len, hidden=self.hidden, n_layers=self.layers,
                           n_heads=self.heads, dropout=self.dropout, grid=tuple(self.grid), k_best=self.k_best)


def train(config: TrainConfig, moe_factory: MoEFactory | None = None,
          on_step: Callable[[int, GatedTransformerLM], None] | None = None) -> dict:
    """Runs the training loop; returns final_val_loss, final_val_perplexity, step, history, interrupted and the
    paths of the checkpoint and the loss curve. ``moe_factory(layer_index)`` overrides the mixture layers;
    ``on_step(step, model)`` is called whenever the client's parameters changed (an optimizer step, or with
    ``--collaborate`` a state downloaded from another trainer).

    Ctrl-C, SIGTERM or SIGHUP (in the main thread) lets the step in flight finish, then saves it and stops. A KeyboardInterrupt that
    stops a step half-way (a second Ctrl-C) leaves the checkpoint file as it was: the model, the optimizers and the
    step counter would each be at another step, so no label would fit."""
    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out_dir = Path(config.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file named as the directory: "[Errno 17] File exists", naming no flag (review 108 D3)
        raise OSError(f"--out-dir: cannot make the directory {out_dir}: {error.strerror or error}") from None
    checkpoint_path = Path(config.checkpoint or out_dir / "checkpoint.pt")
    check_checkpoint_path(checkpoint_path, "--checkpoint" if config.checkpoint else "--out-dir")
    data = TextData.from_file(config.data or shakespeare(config.data_dir), config.val_fraction, config.seq_len + 1)
    if config.data_shards > 1:
        data = data.shard(config.data_shard, config.data_shards, config.seq_len + 1)
    # a failed write to stdout or stderr (a closed terminal or pipe) drops the output instead of ending the run
    with unread_output_dropped(), contextlib.ExitStack() as resources:  # closes the DHT node, remote layers and
        # collaboration, also on Ctrl-C
        lock = lock_checkpoint(checkpoint_path)  # before reading it: another trainer's save could replace it
        if lock is not None:
            resources.callback(lock.close)
        if not config.resume and not config.fresh:
            refuse_existing_checkpoint(checkpoint_path)
        dht = None
        if config.collaborate is not None:  # one DHT node for the experts and the collaboration
            from dmoe.dht import DHT

            dht = DHT(initial_peers=list(config.initial_peers), client_mode=True)
            resources.callback(dht.close)
        if moe_factory is None:
            moe_factory = make_moe_factory(config, resources) if dht is None else \
                make_moe_factory(config, resources, dht=dht)
        try:
            model = GatedTransformerLM(config.model_config(), moe_factory)
            model.to(config.device)
        except Exception as error:  # (one that fits the device's memory in all, but not what is free of it)
            if not is_out_of_memory(error):
                raise
            raise ModelTooLarge(f"the model of {config.sizes()} does not fit in the memory of --device "
                                f"{config.device}: {first_line(error)}") from None
        # before the join of a collaboration, which may wait for the others for minutes
        check_width = ExpertWidthCheck(model, config) if config.experts == "remote" else None
        if check_width is not None:
            check_width(before_steps=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        resumed = load_checkpoint(checkpoint_path, model, optimizer, config) if config.resume else Progress()
        step, history, minibatch = resumed.step, resumed.history, resumed.minibatches
        saved = resumed.step if config.resume and checkpoint_path.exists() else None  # the step the file holds
        collab = None
        if config.collaborate is not None:  # a joiner downloads the collaboration's state here
            from dmoe.collab import CollaborativeOptimizer

            collab = CollaborativeOptimizer(optimizer, dht, config.collaborate, step=step,
                                            **config.collaboration_settings())
            resources.callback(collab.shutdown)
            if config.wait_for_trainers > 1:
                tqdm.write(f"waiting for {config.wait_for_trainers} trainers of {config.collaborate!r} ...")
                collab.wait_for_trainers(config.wait_for_trainers, timeout=600, stop=orphaned)
            if orphaned():  # the launcher died meanwhile: the loop stops at once and saves; nobody reads the output
                silence_output()
            if collab.local_step != step:
                step = collab.local_step
                if on_step is not None:
                    on_step(step, model)
        tqdm.write(f"{data.source}: {len(data.train):,} training / {len(data.val):,} validation bytes; "
                   f"{sum(p.numel() for p in model.parameters()):,} client parameters; {config.experts} experts"
                   + (f"; collaboration {config.collaborate!r} at step {step}" if collab is not None else ""))

        # ---- the loop ----
        started, interrupted = time.monotonic(), False  # this run's start: --max-minutes counts from it
        origin = started - resumed.seconds  # the start of the training this checkpoint holds, stops left out
        rng = rng_state(config.device)  # at the last step boundary: dropout draws from it, and a checkpoint keeps it
        # True from the first change a step makes to what a checkpoint holds (in-process experts step in backward)
        # until its step is counted: a checkpoint written in between would be labelled with one step and hold part
        # of the next, so none is. Remote experts step on their servers, in their checkpoints: the first change to
        # this one is the optimizer's step, and a second Ctrl-C in a remote backward (most of a step's time) threw
        # away every complete step since the last checkpoint (review 82). A collaboration's step is mostly waiting:
        # only its update counts (CollaborativeOptimizer.updating, review 90)
        half_done = False
        experts_step_in_backward = config.experts == "local"
        saving = cut_save = False  # a periodic checkpoint's write in progress; one cut short by a second signal
        validation_due = checkpoint_due = False  # an interval's, at a step that was skipped
        nonfinite = 0  # steps skipped in a row for a loss or gradient that is not finite

        def save() -> bool:
            """Writes the checkpoint of ``step``; False (with a warning) where a weight is not finite, the client's
            or an in-process expert's (theirs are no parameters of the model: review 90)."""
            nonlocal saved
            if not weights_finite(model):
                tqdm.write(f"warning: the model's weights are not finite at step {step}: {left_as_it_was()}")
                return False
            try:
                save_checkpoint(checkpoint_path, model, optimizer, config,
                                Progress(step, history, time.monotonic() - origin, minibatch), rng)
            except CheckpointNotWritten as error:  # (what the file still holds: review 100 D3)
                raise CheckpointNotWritten(f"{error}; {left_as_it_was()}") from error
            saved = step
            return True

        def left_as_it_was() -> str:
            return "the checkpoint is left as it was (" + (f"step {saved}" if saved is not None else "none written") \
                + ")"

        def save_to_the_end() -> bool:
            """save() that a first stop signal does not cut (it marks the run stopped); a second one abandons the
            write, leaving the file as it was. False then."""
            nonlocal interrupted
            with DeferredInterrupt(SAVE_NOTICE) as during:
                try:
                    save()
                except KeyboardInterrupt:
                    tqdm.write(f"interrupted while saving step {step}: {left_as_it_was()}")
                    interrupted = True
                    return False
            interrupted = interrupted or during.requested
            return True

        def stopped_unsaved(why: str) -> dict:
            tqdm.write(f"{why}: {left_as_it_was()}")
            plot_path = plot_losses(history, out_dir / "loss.png")
            return {"final_val_loss": math.nan, "final_val_perplexity": math.nan, "step": step,
                    "history": history, "interrupted": True, "checkpoint": checkpoint_path, "plot": plot_path}

        def fail(error: Exception) -> Exception:
            """What to raise for ``error`` (not Diverged), which ended the loop or its final validation, once the
            last complete step is saved, unless ``error`` cut a step's update or the checkpoint's write (review 90:
            a mixture layer's error, an out-of-memory... ended the run with every step since the last checkpoint
            lost)."""
            if isinstance(error, CheckpointNotWritten):  # (its message says what the file holds)
                said = None
            elif saving:
                said = f"while saving step {step}: {left_as_it_was()}"
            elif half_done or (collab is not None and collab.updating):
                said = f"in the middle of step {step + 1}: {left_as_it_was()}"
            elif saved == step:
                said = f"after step {step}: the checkpoint holds step {step} (--resume goes on from there)"
            else:
                try:
                    written = save_to_the_end() and saved == step
                except CheckpointNotWritten as unsaved:  # said, and ``error`` is still what ended the run
                    tqdm.write(str(unsaved))
                    written = False
                # (not written and not finite: save() said so)
                said = f"after step {step}: the checkpoint holds step {step} (--resume goes on from there)" \
                    if written else None
            failed = experts_failed(error, step, saved)
            if failed is None and said is not None:  # (its message says where the checkpoint is)
                tqdm.write(f"{type(error).__name__} {said}")
            return failed or error

        # SIGTERM and SIGHUP are stops as Ctrl-C is: the loop defers them to the end of its step, a checkpoint's
        # write to its end, and anything else ends at once (KeyboardInterrupt)
        with InterruptingSignals():
            bar = tqdm(total=config.steps, initial=step, unit="step", dynamic_ncols=True)
            # deferred until the last checkpoint's write has begun, not only in the loop: a first signal that landed
            # while the bar closed, before the save, ended the run unsaved (review 90)
            with DeferredInterrupt(STOP_NOTICE) as stop:  # a first Ctrl-C/SIGTERM/SIGHUP ends the step, then stops
                failure: Exception | None = None
                try:
                    if step == 0:
                        report_validation(model, data, config, step, history, origin)
                    meter = IntervalMeter(model)
                    while step < config.steps and not over_time(started, config) and not stop.requested:
                        if orphaned():  # the launcher (dmoe-demo) died: stop as on SIGHUP rather than train unwatched
                            silence_output()
                            stop.requested, stop.signum = True, signal.SIGHUP
                            break
                        # alone, step s's batch depends only on (seed, s), so a resumed run sees the batches it would
                        # have seen; in a collaboration a step takes a varying number of this trainer's batches
                        generator = batch_generator(config.seed, step) if collab is None else \
                            batch_generator(config.seed + 7919 * (1 + config.data_shard), minibatch)
                        batch = data.batch("train", config.batch_size, config.seq_len, generator)
                        inputs, targets = (t.to(config.device) for t in batch)
                        _, loss = model(inputs, targets)
                        balance = model.balance_loss() if config.switch else None
                        optimizer.zero_grad(set_to_none=True)
                        half_done = experts_step_in_backward
                        (loss + config.balance_coef * balance if balance is not None else loss).backward()
                        # a step of a loss or gradient that is not finite would make the weights NaN (in-process experts
                        # skip such steps themselves): it is skipped, and too many in a row stop the run
                        finite = bool(torch.isfinite(loss)) and (balance is None or bool(torch.isfinite(balance)))
                        if finite and collab is None and config.grad_clip:
                            finite = bool(torch.isfinite(
                                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)))
                        elif finite:  # (a collaboration clips the averaged gradient)
                            finite = all_finite([p.grad for p in model.parameters() if p.grad is not None])
                        if not finite:
                            optimizer.zero_grad(set_to_none=True)
                            nonfinite += 1
                            tqdm.write(f"warning: step {step + 1}: the loss or its gradient is not finite; step skipped "
                                       f"({nonfinite} in a row)")
                            if nonfinite >= MAX_NONFINITE_STEPS:
                                raise Diverged(f"the loss or its gradient was not finite for {nonfinite} steps in a "
                                               f"row (to step {step + 1}): the run diverged; {left_as_it_was()}; "
                                               "resume with a lower --lr or --expert-lr")
                            rng = rng_state(config.device)
                            half_done = False
                            if collab is not None:
                                minibatch += 1
                                continue
                            step, minibatch = step + 1, minibatch + 1  # the batch is spent: the next step draws the next
                            bar.update(1)
                            # a skipped step on an interval skipped its validation or checkpoint, and a whole
                            # interval went unsaved (review 82): they are due at the next step taken (none, in a run
                            # that diverged: its checkpoint stays the last good one)
                            validation_due |= crossed(step - 1, step, config.eval_interval)
                            checkpoint_due |= crossed(step - 1, step, config.checkpoint_interval)
                            continue
                        nonfinite = 0
                        for group in optimizer.param_groups:  # (a step abandoned before changes nothing)
                            group["lr"] = learning_rate(step, config)
                        if collab is None:  # (clipped above, with --grad-clip)
                            half_done = True
                            optimizer.step()
                            new_step = step + 1
                        else:  # clipping and the step happen on the collaboration's averaged gradient
                            try:
                                collab.step(inputs.shape[0])
                            except BaseException:
                                # most of collab.step waits (for reports, partners, the all-reduce), which changes
                                # nothing: only a cut update is half a step (review 90: a second signal in the wait
                                # left the checkpoint steps behind). An update done before the wait is counted
                                half_done = half_done or collab.updating
                                if not half_done and collab.local_step != step:
                                    history["train"].append((collab.local_step, loss.item()))
                                    step, minibatch = collab.local_step, minibatch + 1
                                    rng = rng_state(config.device)
                                    if on_step is not None:
                                        on_step(step, model)
                                raise
                            new_step = collab.local_step
                        history["train"].append((new_step, loss.item()))
                        previous, step, minibatch = step, new_step, minibatch + 1
                        rng = rng_state(config.device)
                        half_done = False
                        if check_width is not None and check_width.unchecked:  # (servers come after the trainer)
                            check_width()
                        meter.add(model, loss.item(), inputs.numel(), balance.item() if balance is not None else None)
                        bar.update(step - previous)
                        postfix = meter.postfix()
                        if collab is not None:
                            postfix.update(collaboration_postfix(collab))
                        bar.set_postfix(postfix, refresh=False)
                        if step == previous:
                            continue
                        if on_step is not None:
                            on_step(step, model)
                        if (crossed(previous, step, config.eval_interval) or validation_due) and step < config.steps:
                            report_validation(model, data, config, step, history, origin)
                            meter.restart(model)  # validation time is not training throughput
                        validation_due = False
                        if crossed(previous, step, config.checkpoint_interval) or checkpoint_due:
                            checkpoint_due = False
                            saving = True
                            save()
                            saving = False
                except KeyboardInterrupt:  # a second Ctrl-C, or one where DeferredInterrupt could not take it
                    interrupted = True
                    if saving:  # it cut a checkpoint's write: stop as a cut final write does, without writing again
                        cut_save = True
                except Exception as error:  # (Diverged too) handled once the bar is closed
                    failure = error
                try:
                    bar.close()
                except KeyboardInterrupt:  # a second signal: what it cuts is the bar's last drawing
                    interrupted = True
                interrupted = interrupted or stop.requested
                if isinstance(failure, Diverged):  # its checkpoint stays the last good one
                    raise failure
                if failure is not None:
                    raise fail(failure)
                # ---- the end: checkpoint, final validation, curve, sample ----
                if cut_save:  # the second signal meant "stop at once": not the same write again and a validation
                    return stopped_unsaved(f"interrupted while saving step {step}")  # (review 82)
                if half_done:
                    return stopped_unsaved(f"interrupted in the middle of step {step + 1}")
                if interrupted:  # saved before anything is written (nobody may read it: review 90), in case a second
                    if not save_to_the_end():  # Ctrl-C follows
                        plot_path = plot_losses(history, out_dir / "loss.png")
                        return {"final_val_loss": math.nan, "final_val_perplexity": math.nan, "step": step,
                                "history": history, "interrupted": True, "checkpoint": checkpoint_path,
                                "plot": plot_path}
                    tqdm.write(f"interrupted at step {step}" + (": checkpoint written" if saved == step else ""))

                # from here a stop signal cuts short what is left (the final validation, the wait for the other
                # trainers, the sample), except a checkpoint's write; between those, the loop's deferral takes it
                val_loss, plot_path, cut_after, validated = math.nan, out_dir / "loss.png", False, False
                try:
                    with InterruptingSignals():
                        if collab is not None and not interrupted:
                            # no trainer still training the experts, and one model at the last step (a trainer whose
                            # last averaging failed takes the canonical one here): every trainer then validates the
                            # same model
                            if not collab.finish():
                                tqdm.write(f"collaboration {config.collaborate!r}: the other trainers did not all "
                                           f"reach step {step} on this trainer's model in time; this model may differ "
                                           f"from theirs (see the warning above)")
                            tqdm.write(f"collaboration {config.collaborate!r}: {collab.steps_applied} steps applied "
                                       f"here, {collab.steps_downloaded} states downloaded")
                        if not history["val"] or history["val"][-1][0] != step:
                            report_validation(model, data, config, step, history, origin)
                        val_loss, validated = history["val"][-1][1], True
                except KeyboardInterrupt:
                    if collab is not None and collab.updating:  # in finish(), taking another trainer's state
                        return stopped_unsaved(f"interrupted while taking the collaboration's state at step {step}")
                    cut_after, interrupted = not interrupted, True
                except Exception as error:  # the final validation's mixture layer, say
                    raise fail(error)
                if save_to_the_end() and cut_after:
                    tqdm.write(f"interrupted at step {step}, after the training"
                               + (": checkpoint written" if saved == step else ""))
                try:
                    with InterruptingSignals():
                        plot_path = plot_losses(history, plot_path)
                        interrupted = interrupted or stop.requested
                        # (NaN is the loss of a validation a stop signal cut: "loss nan" read as a run that
                        # diverged, review 112 D2)
                        measured = f"loss {val_loss:.3f} perplexity {perplexity(val_loss):.2f}" if validated else \
                            "skipped (interrupted)"
                        print(f"final validation {measured} (step {step}, {(time.monotonic() - origin) / 60:.1f} min)")
                        print(f"loss curve: {plot_path}; checkpoint: {checkpoint_path}"
                              + ("; resume with --resume" if interrupted else ""))
                        if config.sample_bytes and not interrupted:
                            print("sample:\n" + sample(model, config))
                except KeyboardInterrupt:  # after the checkpoint: the curve or the sample cut short
                    interrupted = True
            interrupted = interrupted or stop.requested
    return {"final_val_loss": val_loss, "final_val_perplexity": perplexity(val_loss), "step": step,
            "history": history, "interrupted": interrupted, "checkpoint": checkpoint_path, "plot": plot_path}


def perplexity(loss: float) -> float:
    """``exp(loss)``; inf where that overflows (a diverging run's loss above about 709)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def silence_output(fds: Sequence[int] = (1, 2)) -> None:
    """Points stdout and stderr (the descriptors ``fds``) at /dev/null: once the launcher is gone, nobody reads
    them, and a write to the pipe it held would raise BrokenPipeError in the middle of saving."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in fds:
            os.dup2(null, fd)
        os.close(null)


class UnreadDropped:
    """``sys.stdout`` or ``sys.stderr`` while :func:`train` runs: a write or flush to it that fails (OSError: EPIPE
    of a pipe whose reader is gone, as ``| head -1`` or a ``| tee`` stopped by the same Ctrl-C leave it; EIO of a
    terminal that hung up) means that nobody reads it any more. Its descriptor is then pointed at /dev/null and
    nothing more is written to it, and the run goes on: the error ended ``dmoe-train`` (status 1) with nothing
    saved, also while it stopped on the SIGHUP of a closed terminal to save (review 90)."""

    def __init__(self, stream):
        self.stream, self.unread = stream, False

    def write(self, text: str) -> int:
        if not self.unread:
            try:
                return self.stream.write(text)
            except OSError:
                self._unread()
        return len(text)

    def flush(self) -> None:
        if not self.unread:
            try:
                self.stream.flush()
            except OSError:
                self._unread()

    def _unread(self) -> None:
        self.unread = True
        with contextlib.suppress(OSError, ValueError):  # (a stream of no descriptor: a test's capture)
            silence_output((self.stream.fileno(),))

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def unread_output_dropped():
    """Puts :class:`UnreadDropped` in front of ``sys.stdout`` and ``sys.stderr``, and gives them back at the end."""
    streams = sys.stdout, sys.stderr
    guards = tuple(None if stream is None else UnreadDropped(stream) for stream in streams)
    sys.stdout, sys.stderr = (guard or stream for guard, stream in zip(guards, streams))
    try:
        yield
    finally:
        if sys.stdout is guards[0]:
            sys.stdout = streams[0]
        if sys.stderr is guards[1]:
            sys.stderr = streams[1]


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every weight a checkpoint of ``model`` holds is finite: its parameters, and those of its in-process
    experts, which are no parameters of the model (:class:`~dmoe.server.in_process.InProcessExpert`): one of them
    gone infinite by an update of finite gradients was kept as "the last good checkpoint" (review 90)."""
    tensors = list(model.parameters())
    for module in model.modules():
        if isinstance(module, InProcessExpert):
            tensors.extend(module.backend.module.parameters())
    with torch.no_grad():
        return all(bool(torch.isfinite(t).all()) for t in tensors)


class ExpertsFailed(RuntimeError):
    """A step's mixture layer raised as ``--no-allow-zero-outputs`` or ``--backward-k-min`` ask: the message names
    the flag, and what the checkpoint holds (the last complete step, saved before)."""


def experts_failed(error: BaseException, step: int, saved: int | None) -> ExpertsFailed | None:
    """``error`` as :class:`ExpertsFailed` when a flag made a mixture layer raise it; None for any other error."""
    if "dmoe.client" not in sys.modules:  # (the only source of these errors: imported when a layer was)
        return None
    from dmoe.client.gating import NoAliveExpertsError, TooFewGradients

    if isinstance(error, NoAliveExpertsError):
        why = str(error).replace("pass allow_zero_outputs=True to use zeros", "--allow-zero-outputs uses zeros")
        flag = "--no-allow-zero-outputs"
    elif isinstance(error, TooFewGradients):
        why, flag = str(error).replace("backward_k_min=", "--backward-k-min "), "--backward-k-min"
    else:
        return None
    failed = ExpertsFailed(f"the experts failed after step {step} ({flag}): {why}; "
                           + (f"the checkpoint holds step {saved}" if saved is not None else "no checkpoint written"))
    failed.__cause__ = error
    return failed


def crossed(previous: int, step: int, interval: int) -> bool:
    """Whether a multiple of ``interval`` lies in ``(previous, step]`` (a collaboration's step may jump ahead)."""
    return step // interval > previous // interval


def collaboration_postfix(collab) -> dict[str, str]:
    """The progress bar's view of the collaboration: trainers, samples toward the next step, time to it."""
    view = collab.collaboration
    eta = view.eta
    return {"trainers": str(view.num_trainers),
            "batch": f"{int(view.samples_estimate)}/{view.target_batch_size}",
            "next": f"{eta:.0f}s" if math.isfinite(eta) else "?"}


def make_moe_factory(config: TrainConfig, resources: contextlib.ExitStack, dht=None) -> MoEFactory:
    """One mixture layer per block, experts ``ffn{i}.*.*``; the DHT client node (unless ``dht`` is given) and any
    layer with ``close()`` are registered on ``resources``. Imported lazily: the model and data code do not need
    the network stack."""
    common = dict(in_features=config.hidden, grid=tuple(config.grid), k_best=config.k_best, switch=config.switch)
    if config.experts == "local":
        from dmoe.client.gating import LocalMixtureOfExperts

        # trained as a server trains them (their own optimizer, stepped in backward), so that local and remote
        # runs differ only by the network
        experts = in_process_experts(config.expert_cls, config.hidden, config.expert_optimizer_config(),
                                     seed=config.seed, device=config.device)
        return lambda i: LocalMixtureOfExperts(layer=f"ffn{i}", expert_factory=experts, **common)

    from dmoe.client.moe import RemoteMixtureOfExperts
    from dmoe.dht import DHT

    from dmoe.client.bans import Bans

    if dht is None:
        dht = DHT(initial_peers=list(config.initial_peers), client_mode=True)  # asks, never answers (behind NAT)
        resources.callback(dht.close)
    bans = Bans()  # shared: a server found dead by one layer is avoided by every layer at once

    def remote_layer(i: int) -> torch.nn.Module:
        layer = RemoteMixtureOfExperts(
            layer=f"ffn{i}", dht=dht, k_min=config.k_min, forward_timeout=config.forward_timeout,
            backward_k_min=config.backward_k_min, backward_timeout=config.backward_timeout,
            timeout_after_k_min=config.timeout_after_k_min, max_abs_value=config.max_abs_value,
            allow_zero_outputs=config.allow_zero_outputs, bans=bans, **common)
        if callable(getattr(layer, "close", None)):
            resources.callback(layer.close)
        return layer

    return remote_layer


class ExpertsOfAnotherWidth(ValueError):
    """The swarm's experts take rows of another width than ``--hidden`` (their servers' ``--hidden-dim``)."""


class ExpertWidthCheck:
    """Asks experts of each remote mixture layer of ``model`` what rows they take, and raises
    :class:`ExpertsOfAnotherWidth` for a ``--hidden`` they would refuse: every expert refused every request as
    invalid, which drops it from that call only, so a mistyped ``--hidden`` trained a dense-only model step after
    step, exited 0, and printed dozens of warnings a step (review 112 D1). A layer is refused only when none of the
    experts that answer (up to ``--k-best``) takes ``--hidden``-wide rows: one server of another width, misconfigured
    or hostile, does not stop a trainer. A layer none of whose experts answers yet (a trainer started before the
    servers) is asked again after each step in which it chose experts."""

    def __init__(self, model: GatedTransformerLM, config: TrainConfig):
        from dmoe.client.moe import RemoteMixtureOfExperts

        self.hidden, self.timeout = config.hidden, config.forward_timeout
        self.unchecked = [block.moe for block in model.blocks if isinstance(block.moe, RemoteMixtureOfExperts)]

    def __call__(self, before_steps: bool = False) -> None:
        """Checks each layer not checked yet: all of them ``before_steps``, later those that chose experts."""
        for layer in list(self.unchecked):
            if not before_steps and not layer.stats.experts_chosen:
                continue  # (no expert found by its forwards: nothing to ask yet)
            other: list[list[tuple[int, ...]]] = []  # the inputs of each expert that takes other rows
            for schema in layer.expert_schemas(timeout=self.timeout):
                inputs = [tuple(shape) for shape, _ in schema["inputs"]]
                if inputs == [(self.hidden,)]:
                    self.unchecked.remove(layer)
                    break
                other.append(inputs)
            else:
                if not other:
                    continue  # (none answered: asked again later)
                inputs = other[0]
                takes = f"{inputs[0][0]}-wide rows" if len(inputs) == 1 and len(inputs[0]) == 1 else \
                    "inputs of shape " + (" and ".join(str(list(shape)) for shape in inputs) or "[]")
                raise ExpertsOfAnotherWidth(f"--hidden {self.hidden}: the swarm's {layer.layer} experts take {takes} "
                                            "(their servers' --hidden-dim)")


@dataclass
class StepFigures:
    """What one training step (or, in a collaboration, one batch) adds to the progress bar."""

    loss: float
    tokens: int
    seconds: float
    chosen: int        # experts the mixtures chose in its forward and backward passes
    dropped: int       # of those, the ones that did not answer
    balance: float | None = None


class IntervalMeter:
    """Mean loss, tokens per second and the share of chosen experts that were dropped over the last ``window`` steps
    since the last restart (with --switch also the mean load-balancing loss: 1 is perfectly even).

    The window slides, so that a failure stays on the bar for ``window`` steps: tqdm draws only some steps (at most
    one per 0.1 s), and a window emptied every ``window`` steps could show a dropped server for one step, undrawn.
    """

    def __init__(self, model: GatedTransformerLM, window: int = 10):
        self.window = window
        # mixtures that count their experts (the remote ones): none chosen in a step means none was found
        self.counted = any(getattr(block.moe, "stats", None) is not None for block in getattr(model, "blocks", ()))
        self.warned = False
        self.restart(model)

    def restart(self, model: GatedTransformerLM) -> None:
        """Forgets the steps so far (after a validation: its time is not training throughput)."""
        self.steps: collections.deque[StepFigures] = collections.deque(maxlen=self.window)
        self.since, self.counters = time.perf_counter(), model.moe_counters()

    def add(self, model: GatedTransformerLM, loss: float, tokens: int, balance: float | None = None) -> None:
        now, counters = time.perf_counter(), model.moe_counters()
        chosen, dropped = (after - before for after, before in zip(counters, self.counters))
        self.steps.append(StepFigures(loss, tokens, now - self.since, chosen, dropped, balance))
        self.since, self.counters = now, counters
        if self.counted and not chosen and not self.warned:
            self.warned = True
            tqdm.write("warning: no expert of any mixture layer was found in the DHT this step: the model trains "
                       "without its experts (check --initial-peers, --grid, --layers and that the servers run)")

    def postfix(self) -> dict[str, str]:
        steps = self.steps
        chosen, dropped = sum(s.chosen for s in steps), sum(s.dropped for s in steps)
        shown = {"loss": f"{sum(s.loss for s in steps) / max(len(steps), 1):.3f}",
                 "tok/s": f"{sum(s.tokens for s in steps) / max(sum(s.seconds for s in steps), 1e-9):,.0f}",
                 "dropped": f"{dropped / chosen:.1%}" if chosen else ("no experts" if self.counted else "n/a")}
        balances = [s.balance for s in steps if s.balance is not None]
        if balances:
            shown["balance"] = f"{sum(balances) / len(balances):.2f}"
        return shown


def batch_generator(seed: int, step: int) -> torch.Generator:
    """Step ``step``'s batch depends only on (seed, step), so a resumed run sees the batches it would have seen."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def learning_rate(step: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(config.steps - config.warmup_steps, 1)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def over_time(started: float, config: TrainConfig) -> bool:
    return bool(config.max_minutes) and time.monotonic() - started > 60 * config.max_minutes


def evaluation_windows(data: TextData, config: TrainConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``eval_batches`` batches of ``batch_size`` validation windows (inputs, targets) :func:`evaluate` scores:
    the same every time, drawn from one stream seeded by ``seed`` (so 4 batches of 8 are 1 batch of 32's windows)."""
    windows = torch.Generator().manual_seed(config.seed + 1)
    for _ in range(config.eval_batches):
        yield data.batch("val", config.batch_size, config.seq_len, windows)


@torch.no_grad()
def evaluate(model: GatedTransformerLM, data: TextData, config: TrainConfig) -> float:
    """Mean loss over the validation windows of :func:`evaluation_windows` (equal batches: the plain mean). Without
    autograd around the model's calls: no_grad on the generator of windows held only while its own code ran, so each
    validation forward built a graph, and remote experts kept its inputs for a backward that never came (review
    104)."""
    model.eval()
    losses = [model(inputs.to(config.device), targets.to(config.device))[1].item()
              for inputs, targets in evaluation_windows(data, config)]
    model.train()
    return sum(losses) / len(losses)


def report_validation(model, data, config, step: int, history: dict, origin: float) -> None:
    """Appends (step, loss) to history["val"] and (step, seconds of training so far) to history["val_seconds"];
    ``origin`` is the ``time.monotonic()`` at which the training began, moved on by the time between a stop and its
    resume."""
    loss = evaluate(model, data, config)
    history["val"].append((step, loss))
    history.setdefault("val_seconds", []).append((step, time.monotonic() - origin))
    tqdm.write(f"step {step}: validation loss {loss:.3f} perplexity {perplexity(loss):.2f}")


@dataclass
class Progress:
    """What a checkpoint keeps of a run besides its weights, so that a resumed run goes on counting from there."""

    step: int = 0
    #: "train" and "val": (step, loss); "val_seconds": (step, seconds of training when that validation ran)
    history: dict[str, list[tuple]] = field(default_factory=lambda: {"train": [], "val": [], "val_seconds": []})
    seconds: float = 0.0  # of training (validation included), over every run that resumed this checkpoint
    minibatches: int = 0  # batches drawn: in a collaboration, this trainer's batch order goes on from there


class CheckpointInUse(InUse):
    """Another trainer (a live process) holds the checkpoint file."""


def check_checkpoint_path(path: Path, flag: str) -> None:
    """Raises OSError naming ``flag`` when no checkpoint can be written at ``path``, before anything is trained: the
    first save (after --checkpoint-interval steps, 100 by default) found a directory there, and those steps were
    lost. Also makes its directory, as the save would."""
    if path.is_dir():
        raise IsADirectoryError(f"{flag}: {path} is a directory; name the checkpoint file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"{flag}: cannot make the directory of {path}: {error.strerror or error}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag}: {path.parent} is not writable, so {path.name} cannot be saved there")


class CheckpointExists(ValueError):
    """A checkpoint is where a run without --resume or --fresh would write its own."""


def refuse_existing_checkpoint(path: Path) -> None:
    """Raises CheckpointExists naming the flags when a checkpoint is at ``path``: a run without --resume (forgotten,
    or a scheduler relaunching the first command line) started from step 0 and wrote over it at its first save, or
    its stop, without a word: hours of weights and optimizer state lost to one missing flag (review 108 D1)."""
    if not path.exists():
        return
    try:
        step = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]
        holds = f"holds step {int(step)}"
    except Exception:  # noqa: BLE001 - damaged, or not a checkpoint: still not to be written over unasked
        holds = "exists"
    raise CheckpointExists(f"{path} {holds}: pass --resume to continue it, or --fresh to start afresh over it, or "
                           "give another --out-dir / --checkpoint")


def lock_checkpoint(path: Path):
    """The exclusive lock on the checkpoint ``path`` (on ``PATH.lock``), held while a trainer runs: two trainers
    given one checkpoint would each resume from it and write over the other's steps (and each other's temporary
    file). Raises CheckpointInUse naming the holder's pid."""
    return lock_file(path.with_name(path.name + ".lock"), f"checkpoint {path}", "trainer",
                     "give each trainer its own --checkpoint or --out-dir", CheckpointInUse)


def rng_state(device: str) -> dict[str, torch.Tensor]:
    """torch's RNG states that a step draws from: the CPU's and, training on CUDA, the GPU's (dropout on the
    device draws from the device's generator), so that a resumed run draws what it would have drawn."""
    state = {"torch_rng": torch.get_rng_state()}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state(torch.device(device))
    return state


def save_checkpoint(path: Path, model, optimizer, config: TrainConfig, progress: Progress,
                    rng: dict[str, torch.Tensor] | None = None) -> None:
    """Written to a temporary file, fsynced and renamed (and the directory fsynced), so a crash or a power loss
    never leaves a half-written checkpoint. ``rng``: torch's
    RNG states at the step boundary the checkpoint is labelled with (:func:`rng_state`; default: now)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": progress.step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "history": progress.history, "seconds": progress.seconds, "minibatches": progress.minibatches,
             **(rng_state(config.device) if rng is None else rng), "config": dataclasses.asdict(config),
             "text": text_record(config)}
    tmp = path.with_name(path.name + ".tmp")
    try:  # fsynced before the rename, as the servers' checkpoints are: a power loss leaves the old file or the new
        with open(tmp, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException as error:  # a full disk, or a second Ctrl-C: no partial temp file left behind
        tmp.unlink(missing_ok=True)
        cause = first_os_error(error)
        if isinstance(error, Exception) and isinstance(cause, OSError):
            # a full disk's OSError comes wrapped in torch's zip-writer RuntimeError ("unexpected pos ..."), which
            # ended dmoe-train in a two-part traceback naming neither the file nor the cause (review 100 D3)
            raise CheckpointNotWritten(f"step {progress.step}'s checkpoint cannot be written to {path}: "
                                       f"{cause.strerror or cause}") from error
        raise
    fsync_directory(path.parent)


class CheckpointNotWritten(OSError):
    """A checkpoint could not be written (a full disk, an I/O error): the file is left as it was. An OSError, so
    that dmoe-train and dmoe-demo end in its one line."""


class ModelTooLarge(MemoryError):
    """The model could not be built for want of memory (review 100 D8: a traceback, naming no flag)."""


def first_line(error: BaseException) -> str:
    """``error``'s message up to its first line break: torch's own messages go on with C++ frames."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


class ResumeMismatch(ValueError):
    """The checkpoint to resume from was saved for another model than the one the flags describe."""


class Diverged(RuntimeError):
    """The loss or its gradients stayed non-finite for :data:`MAX_NONFINITE_STEPS` steps in a row."""


class CorruptCheckpoint(ValueError):
    """The checkpoint to resume from cannot be read (empty, truncated, or not a dmoe-train checkpoint)."""


#: what a dmoe-train checkpoint holds, at least
CHECKPOINT_KEYS = ("step", "model", "optimizer", "history", "torch_rng", "config")
#: settings that may change on resume and take effect (each step sets the client's learning rate anyway)
CHANGEABLE = ("lr", "weight_decay", "expert_lr", "expert_clip_grad_norm", "grad_clip")
#: of those, the experts' own: they take effect only where the --expert-* flags reach the experts
#: (:meth:`TrainConfig.expert_flags_take_effect`); a remote trainer said they did, and they changed nothing (review 90)
EXPERT_SETTINGS = ("expert_lr", "expert_clip_grad_norm")
#: the learning-rate schedule's length: a resume with another reshapes the schedule (the rate jumped 6x, unsaid)
SCHEDULE = ("steps", "warmup_steps")
#: which part of the text trains (the validation tail is always the whole held-out tail, see ``TextData.shard``)
SPLIT = ("val_fraction", "data_shard", "data_shards")
#: what picks the validation windows, besides the text and --val-fraction: a finished run resumed with others is
#: validated again, not given its stored figure (measured on other windows) as the final one (review 90)
VALIDATION = ("val_fraction", "eval_batches", "batch_size", "seed")


def text_path(config: TrainConfig | dict) -> Path:
    """The text file a run of ``config`` (a TrainConfig, or a checkpoint's dict of one) reads: ``--data``, or the
    Shakespeare corpus cached in ``--data-dir``."""
    values = dataclasses.asdict(config) if isinstance(config, TrainConfig) else config
    return Path(values["data"]) if values.get("data") else Path(values.get("data_dir") or "data") / SHAKESPEARE_FILE


def text_record(config: TrainConfig) -> dict:
    """What a checkpoint keeps of the text it was trained on, for a resume to compare: its file (absolute) and
    size in bytes (None where it cannot be read)."""
    path = text_path(config)
    try:
        size = path.stat().st_size
    except OSError:
        size = None
    return {"path": str(path.resolve()), "bytes": size}


def load_checkpoint(path: Path, model, optimizer, config: TrainConfig) -> Progress:
    """Loads the weights and optimizer state saved in ``path`` into ``model`` and ``optimizer``, and torch's RNG
    state; returns the progress saved with them (none if there is no checkpoint yet)."""
    if not path.exists():
        tqdm.write(f"no checkpoint at {path}: starting from step 0")
        return Progress()
    try:
        state = torch.load(path, map_location=config.device, weights_only=True)
    except Exception as error:  # noqa: BLE001 - empty, truncated, or some other file: torch raises many kinds
        raise CorruptCheckpoint(f"--resume: {path} cannot be read ({type(error).__name__}: "
                                f"{str(error).splitlines()[0] if str(error) else 'no details'}); move it away to start "
                                "afresh, or give another --checkpoint / --out-dir") from None
    if not isinstance(state, dict) or not all(key in state for key in CHECKPOINT_KEYS) \
            or not isinstance(state["config"], dict):
        raise CorruptCheckpoint(f"--resume: {path} is not a dmoe-train checkpoint; move it away to start afresh, or "
                                "give another --checkpoint / --out-dir")
    saved = state["config"]
    # the gating too: --switch routes by the router's probability over the whole grid (and adds the balance loss),
    # its gate's weights were learnt for the other routing
    compared = ("seq_len", "hidden", "layers", "heads", "grid", "k_best", "switch", "experts")
    if config.expert_flags_take_effect():  # (remote experts are what their servers host, whatever this flag was)
        compared += ("expert_cls",)
    if config.experts == "local":  # the checkpoint holds the in-process experts' optimizer states
        compared += ("expert_optimizer",)
    changed = [f"--{name.replace('_', '-')} was {saved[name]!r}, now {getattr(config, name)!r}"
               for name in compared
               if name in saved and _as_tuple(saved[name]) != _as_tuple(getattr(config, name))]
    if changed:
        raise ResumeMismatch(f"--resume: {path} was saved with a different model: " + "; ".join(changed)
                             + " (resume with those flags, or give another --out-dir / --checkpoint)")
    model.load_state_dict(state["model"])  # in-process experts keep the --expert-lr given now (ExpertBackend)
    optimizer.load_state_dict(state["optimizer"])
    for group in optimizer.param_groups:  # the saved state carries the old settings: the flags given now win
        group["weight_decay"] = config.weight_decay
        group["lr"] = learning_rate(state["step"], config)
    for name in CHANGEABLE:
        if name in EXPERT_SETTINGS and not config.expert_flags_take_effect():
            continue  # (a remote trainer's experts train on their servers, by the servers' flags)
        if name in saved and saved[name] != getattr(config, name):
            tqdm.write(f"resuming with --{name.replace('_', '-')} {getattr(config, name)!r} (the checkpoint was "
                       f"trained with {saved[name]!r})")
    announce_schedule(saved, state["step"], config)
    text_changed = announce_text(state, saved, config)
    torch.set_rng_state(state["torch_rng"].cpu())
    if "cuda_rng" in state and torch.device(config.device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"].cpu(), torch.device(config.device))
    history = Progress().history
    history.update({name: [tuple(point) for point in points] for name, points in state["history"].items()})
    forget_stale_validation(history, state["step"], saved, config, text_changed)
    tqdm.write(f"resumed from {path} at step {state['step']}")
    # checkpoints written before these were kept: their time and batches are unknown, so counted from 0
    return Progress(state["step"], history, float(state.get("seconds", 0.0)), int(state.get("minibatches", 0)))


def announce_schedule(saved: dict, step: int, config: TrainConfig) -> None:
    """Says so when a resume with another ``--steps`` or ``--warmup-steps`` (to extend a finished run, say) moves the
    learning rate: the cosine schedule is stretched over the new length, and the rate jumped (6x for a 400-step run
    resumed with --steps 800) without a word (review 90). Nothing when no step is left to take."""
    changed = [name for name in SCHEDULE if name in saved and saved[name] != getattr(config, name)]
    if not changed or step >= config.steps:
        return
    before = learning_rate(step, dataclasses.replace(
        config, **{name: saved[name] for name in (*SCHEDULE, "lr") if name in saved}))
    flags = " ".join(f"--{name.replace('_', '-')} {getattr(config, name)}" for name in changed)
    was = ", ".join(f"{saved[name]}" for name in changed)
    tqdm.write(f"resuming with {flags} (the checkpoint was trained with {was}): the learning rate goes from "
               f"{before:.3g} to {learning_rate(step, config):.3g} at step {step + 1} (warm-up and cosine decay now "
               f"span {config.steps} steps)")


def announce_text(state: dict, saved: dict, config: TrainConfig) -> bool:
    """Says so when a resume trains or validates on other text than the checkpoint's: another file (or the same one
    changed), another ``--val-fraction`` (a larger one validates on text the checkpoint was trained on), another
    slice (``--data-shard(s)``): none was compared, nor said (review 90). Whether the text itself differs.
    Checkpoints written before the file's record was kept are compared by their flags."""
    record = state.get("text") if isinstance(state.get("text"), dict) else {}
    now = text_path(config).resolve()
    then = record.get("path") or str(text_path(saved).resolve())
    changed = False
    if then != str(now):
        tqdm.write(f"resuming on another text: {now} (the checkpoint was trained on {then})")
        changed = True
    elif record.get("bytes") is not None:
        size = text_record(config)["bytes"]
        if size != record["bytes"]:
            tqdm.write(f"resuming on {now}, which changed since the checkpoint: {size:,} bytes, it was trained on "
                       f"{record['bytes']:,}")
            changed = True
    for name in SPLIT:
        if name in saved and saved[name] != getattr(config, name):
            grown = name == "val_fraction" and not changed and config.val_fraction > saved[name]
            tqdm.write(f"resuming with --{name.replace('_', '-')} {getattr(config, name)!r} (the checkpoint was "
                       f"trained with {saved[name]!r})"
                       + (": the validation tail now holds text the checkpoint was trained on" if grown else ""))
    return changed


def forget_stale_validation(history: dict, step: int, saved: dict, config: TrainConfig, text_changed: bool) -> None:
    """Drops the checkpoint's last validation figure when it was measured at its own step on other text or windows
    and no step is left to take: the run's final validation then measures the model again, where it reprinted the
    stored figure as the final one (review 90). (With steps left, the figure stays on the loss curve: the final
    validation comes later anyway.)"""
    changed = [f"--{name.replace('_', '-')}" for name in VALIDATION if name in saved and
               saved[name] != getattr(config, name)] + (["the text"] if text_changed else [])
    if not changed or step < config.steps or not history["val"] or history["val"][-1][0] != step:
        return
    history["val"].pop()
    if history.get("val_seconds") and history["val_seconds"][-1][0] == step:
        history["val_seconds"].pop()
    tqdm.write(f"validating step {step} again: {', '.join(changed)} changed since the checkpoint's validation")


def _as_tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def running_mean(values: Sequence[float]) -> tuple[np.ndarray, int]:
    """The mean of each value and the ones before it in a window of a fiftieth of them, and that window; from
    cumulative sums: a sum per point took minutes at the end of a long run (20 s for 300,000 steps, review 82)."""
    window = max(1, len(values) // 50)
    sums = np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts), window


def plot_losses(history: dict, path: Path) -> Path:
    """Per-step training loss (faint), its running mean, and the validation points; written as PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), tight_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if history["train"]:
        steps, losses = zip(*history["train"])
        running, window = running_mean(losses)
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8)
        ax.plot(steps, running, color="tab:blue", label=f"train (mean of {window} steps)")
    if history["val"]:
        steps, losses = zip(*history["val"])
        ax.plot(steps, losses, "o-", color="tab:orange", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    return path


@torch.no_grad()
def sample(model: GatedTransformerLM, config: TrainConfig) -> str:
    model.eval()
    start = torch.tensor([[ord("\n")]], device=config.device)
    tokens = model.generate(start, config.sample_bytes, generator=torch.Generator(config.device).manual_seed(config.seed))
    model.train()
    return bytes(tokens[0, 1:].tolist()).decode("utf-8", errors="replace")
