"""A volunteer swarm in miniature: servers leave for good (SIGKILL) and new empty ones join while the demo model trains.

Two runs of the demo model on the demo's Shakespeare corpus (or ``--data FILE``; dmoe/trainer's gated transformer
LM with 2 layers of 4x4 ffn experts; by default at ``--hidden 64 --seq-len 32 --batch-size 8``, smaller than the
demo's, so that 6 servers and the trainer share two cores) against expert servers started with ``--replica-dir``
(replicas on ``--replicas`` other servers, pushed every ``--replica-interval`` seconds):

* churn: ``--servers`` servers (each a slice of every layer's grid) and ``--minutes`` of training. Every server
  lives an exponentially distributed lifetime (mean ``--mean-lifetime`` seconds), then is killed with SIGKILL,
  unless that would leave fewer than ``--min-alive``; each kill brings a new server a random while later, started
  empty-handed the way a new volunteer would (``--num-experts 1 --grid 4 4 --layer ffn0 ffn1``: a free cell if any,
  else it serves none of the taken cells and holds and adopts replicas). Nothing is ever restarted.
* calm: the same swarm without kills, trained for as many steps as the churn run made.

Measured:
* updates lost per expert: for every expert of a killed server, the optimizer steps it had applied just before the
  kill (its ``info``) minus those of the replica it was adopted from (the adopter's ``{layer}/adopted`` record),
  all of them if it came back fresh; compared with one push interval's worth of its steps (its rate over the
  seconds before the kill times ``--replica-interval``). Goal: at most one interval's worth.
* empty cells: the directory is read every half second; a cell is empty while no server declares it or the server
  declaring it is one the benchmark killed (its declaration outlives it by up to the expiration). Goal: none empty
  longer than the declarations' expiration + 10 s.
* final validation loss of the churn run over the calm run's. Goal: within 5%.

The last line reads ``max_updates_lost=... longest_empty_cell_s=... loss_ratio=...``.

    python benchmarks/bench_churn.py                      # 6 servers, 10 minutes of churn
    python benchmarks/bench_churn.py --smoke              # 2 servers, one kill, 3 s of training: does it run at all
"""
from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dmoe.dht import DHT  # noqa: E402
from dmoe.launch import Proc  # noqa: E402
from dmoe.replicas.records import adopted_key, adoptions, directory_entries  # noqa: E402
from dmoe.trainer.data import TextData, shakespeare  # noqa: E402
from dmoe.trainer.loop import TrainConfig, batch_generator, evaluate, learning_rate, make_moe_factory  # noqa: E402
from dmoe.trainer.model import GatedTransformerLM  # noqa: E402
from dmoe.uid import grid_uids  # noqa: E402
from dmoe.wire import ChannelPool, dmoe_pb2  # noqa: E402
from options import DATA, parse_with_quick  # noqa: E402  (benchmarks/)

LAYERS, GRID = ("ffn0", "ffn1"), (4, 4)
CELLS = [uid for layer in LAYERS for uid in grid_uids(layer, GRID)]


@dataclass
class Server:
    proc: Proc
    dies_at: float          # monotonic
    endpoint: str | None = None
    joined: bool = False    # started empty-handed during the run


@dataclass
class Kill:
    at: float                          # time.time()
    endpoint: str
    before: dict[str, int]             # uid -> updates just before the kill
    rates: dict[str, float]            # uid -> updates per second since the oldest sample 1 s or more before
    lost: dict[str, int] = field(default_factory=dict)   # resolved: uid -> updates lost
    fresh: list[str] = field(default_factory=list)       # came back with no replica (all lost)


def info_updates(endpoint: str, uid: str, timeout: float = 2.0) -> int | None:
    try:
        return ChannelPool.default().stub(endpoint).info(dmoe_pb2.ExpertUID(uid=uid), timeout=timeout).updates
    except Exception:  # noqa: BLE001 - a dead or busy server: no figure
        return None


class Swarm:
    """The DHT nodes and expert servers of one run, the churn that kills and adds servers, and the watch that
    measures empty cells and updates."""

    def __init__(self, args, workdir: Path, churn: bool, seed: int):
        self.args, self.workdir, self.churn = args, workdir, churn
        self.rng = random.Random(seed)
        self.servers: list[Server] = []
        self.kills: list[Kill] = []
        self.joins = 0
        self.empty_since: dict[str, float] = {}
        self.longest_empty = 0.0
        self.empty_spells: list[float] = []
        self.history: dict[str, deque] = {uid: deque(maxlen=64) for uid in CELLS}  # (monotonic, updates)
        self.stop = threading.Event()
        self.training = threading.Event()  # set by the trainer once its first step is done
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.dht_procs: list[Proc] = []
        self.peers: list[str] = []
        self.client: DHT | None = None

    # ---- processes ----
    def server_command(self, *placement: str) -> list[str]:
        a = self.args
        directory = self.workdir / f"replicas{len(self.servers)}"
        return ["-m", "dmoe.cli.server", *placement, "--expert-cls", "ffn", "--hidden-dim", str(a.hidden),
                "--initial-peers", *self.peers, "--refresh-period", str(a.refresh_period),
                "--expiration", str(a.expiration), "--replica-dir", str(directory), "--replicas", str(a.replicas),
                "--replica-interval", str(a.replica_interval), "--torch-threads", "1", "--log-level", "WARNING",
                *self.expert_args]

    def start(self, expert_args: list[str]) -> None:
        self.expert_args = expert_args
        env = {"OMP_NUM_THREADS": "1"}
        self.dht_procs.append(Proc(["-m", "dmoe.dht", "--port", "0", "--log-level", "WARNING"], env))
        self.peers = [self.dht_procs[0].endpoint()]
        for _ in range(2):
            self.dht_procs.append(Proc(["-m", "dmoe.dht", "--initial-peers", self.peers[0], "--log-level",
                                        "WARNING"], env))
        self.peers += [proc.endpoint() for proc in self.dht_procs[1:]]
        slices = [CELLS[i::self.args.servers] for i in range(self.args.servers)]  # round robin over both layers
        now = time.monotonic()
        for uids in slices:
            proc = Proc(self.server_command("--experts", ",".join(uids)), env)
            self.servers.append(Server(proc, now + self.lifetime()))
        for server in self.servers:
            server.endpoint = server.proc.endpoint(180)
        self.client = DHT(initial_peers=self.peers, client_mode=True)
        deadline = time.monotonic() + 120
        while not all(entry is not None for entry in directory_entries(self.client, CELLS).values()):
            if time.monotonic() > deadline:
                raise TimeoutError("the swarm's experts were not all declared within 120 s")
            time.sleep(0.5)
        self._threads = [threading.Thread(target=self._watch, name="watch", daemon=True)]
        if self.churn:
            self._threads.append(threading.Thread(target=self._churn, name="churn", daemon=True))
        for thread in self._threads:
            thread.start()

    def lifetime(self) -> float:
        return self.rng.expovariate(1 / self.args.mean_lifetime) if self.churn else math.inf

    def alive(self) -> list[Server]:
        return [server for server in self.servers if server.proc.alive]

    def _churn(self) -> None:
        joins: list[float] = []
        # lifetimes count from the trainer's first step, not from the processes' start: building the model and its
        # first searches took a loaded smoke run's whole training time, and its kill came before any step (review
        # 103 D2)
        while not self.training.wait(0.5):
            if self.stop.is_set():
                return
        started = time.monotonic()
        for server in self.servers:
            server.dies_at = started + self.lifetime()
        self.servers[0].dies_at = started + self.args.first_kill  # a run that kills at all
        while not self.stop.wait(0.5):
            now = time.monotonic()
            for server in self.alive():
                if now >= server.dies_at and server.endpoint is not None:
                    if len(self.alive()) > self.args.min_alive:
                        self.kill(server)
                        joins.append(now + self.rng.uniform(*self.args.join_delay))
                    else:
                        server.dies_at = now + self.rng.expovariate(1 / self.args.mean_lifetime)
            for due in [t for t in joins if now >= t]:
                joins.remove(due)
                self.join()

    def kill(self, server: Server) -> None:
        entries = directory_entries(self.client, CELLS)
        owned = [uid for uid, entry in entries.items() if entry is not None and entry.value == server.endpoint]
        before = {uid: updates for uid in owned if (updates := info_updates(server.endpoint, uid)) is not None}
        now = time.monotonic()
        rates = {}
        for uid in before:
            # the oldest sample kept, if 1 s old: a --smoke run's kill comes 2 s into training, before any 5 s old
            # sample, and its "push intervals' worth" was always empty
            old = [(t, u) for t, u in self.history[uid] if now - t >= 1]
            if old:
                t0, u0 = old[0]
                rates[uid] = max(0.0, (before[uid] - u0) / (now - t0))
        server.proc.kill()
        with self._lock:
            self.kills.append(Kill(time.time(), server.endpoint, before, rates))
        print(f"churn: killed {server.endpoint} serving {len(owned)} experts ({len(self.alive())} servers alive)",
              file=sys.stderr, flush=True)

    def join(self) -> None:
        proc = Proc(self.server_command("--num-experts", "1", "--grid", *map(str, GRID), "--layer", *LAYERS),
                    {"OMP_NUM_THREADS": "1"})
        server = Server(proc, time.monotonic() + self.lifetime(), joined=True)
        self.servers.append(server)

        def wait() -> None:
            try:
                server.endpoint = proc.endpoint(180)
                with self._lock:
                    self.joins += 1  # counted once it serves
                print(f"churn: joined {server.endpoint}", file=sys.stderr, flush=True)
            except (TimeoutError, RuntimeError) as error:
                if self.stop.is_set():  # the run ended while it was starting: stopped, not failed
                    print("churn: a joining server was stopped before it was listening", file=sys.stderr, flush=True)
                else:
                    print(f"churn: a joining server failed to start: {str(error)[-300:]}", file=sys.stderr,
                          flush=True)
        threading.Thread(target=wait, daemon=True).start()

    # ---- measuring ----
    def _watch(self) -> None:
        pool = ThreadPoolExecutor(8)
        last_sample = 0.0
        while not self.stop.wait(0.5):
            try:
                entries = directory_entries(self.client, CELLS)
            except Exception:  # noqa: BLE001 - a missed look-up is not an empty cell
                continue
            now = time.monotonic()
            dead = {kill.endpoint for kill in self.kills}
            for uid, entry in entries.items():
                if entry is None or entry.value in dead:  # nobody serves it (a dead server's record may linger)
                    self.empty_since.setdefault(uid, now)
                elif uid in self.empty_since:
                    spell = now - self.empty_since.pop(uid)
                    self.empty_spells.append(spell)
                    self.longest_empty = max(self.longest_empty, spell)
            if now - last_sample >= 2.0:
                last_sample = now
                served = [(uid, entry.value) for uid, entry in entries.items() if entry is not None]
                counts = pool.map(lambda item: info_updates(item[1], item[0]), served)
                for (uid, _), updates in zip(served, counts):
                    if updates is not None:
                        self.history[uid].append((now, updates))
                self._resolve(entries)
        pool.shutdown(wait=False)

    def _resolve(self, entries) -> None:
        """Settles the fate of the experts of earlier kills: adopted (updates of the replica), or back fresh."""
        pending = [(kill, uid) for kill in self.kills for uid in kill.before
                   if uid not in kill.lost and uid not in kill.fresh]
        if not pending:
            return
        try:
            records = self.client.get_many([adopted_key(layer) for layer in LAYERS])
        except Exception:  # noqa: BLE001
            return
        adopted = {a.uid: a for layer in LAYERS for a in adoptions(layer, records[adopted_key(layer)])}
        for kill, uid in pending:
            record = adopted.get(uid)
            if record is not None and record.at >= kill.at - 1:
                kill.lost[uid] = max(0, kill.before[uid] - record.updates)
            elif entries[uid] is not None and entries[uid].value != kill.endpoint \
                    and time.time() - kill.at > self.args.expiration + 20:
                kill.fresh.append(uid)  # served again, and no adoption noted for it: started fresh

    def finish(self) -> None:
        """Stops churning; cells still empty count with their spell so far."""
        self.stop.set()
        for thread in self._threads:
            thread.join(30)
        now = time.monotonic()
        for since in self.empty_since.values():
            self.longest_empty = max(self.longest_empty, now - since)

    def close(self) -> None:
        self.stop.set()
        for server in self.servers:
            server.proc.interrupt()
        for server in self.servers:
            server.proc.stop()
        for proc in self.dht_procs:
            proc.stop()
        if self.client is not None:
            self.client.close()


def train_run(args, data: TextData, peers: list[str], *, minutes: float | None, steps: int | None,
              first_step: threading.Event | None = None) -> dict:
    """The trainer's loop (dmoe.trainer.loop) for ``minutes`` or ``steps``, whichever is given; the learning rate is
    constant after warm-up, so runs of different lengths train alike step for step. The minutes count from the end
    of the first step (then ``first_step`` is set): the model's construction and its first call's searches took all
    of a loaded smoke run's 3 s, which then trained 0 steps (review 103 D2)."""
    config = TrainConfig(experts="remote", initial_peers=tuple(peers), hidden=args.hidden, seq_len=args.seq_len,
                         batch_size=args.batch_size, layers=len(LAYERS), grid=GRID, steps=10**9, lr=3e-3,
                         warmup_steps=50, eval_batches=8, forward_timeout=5, backward_timeout=5,
                         timeout_after_k_min=0.5, seed=args.seed)
    torch.manual_seed(args.seed)
    started, step, losses = None, 0, []
    with contextlib.ExitStack() as resources:
        model = GatedTransformerLM(config.model_config(), make_moe_factory(config, resources))
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        while (steps is None or step < steps) and (minutes is None or started is None
                                                   or time.monotonic() - started < 60 * minutes):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, config)
            inputs, targets = data.batch("train", config.batch_size, config.seq_len,
                                         batch_generator(config.seed, step))
            _, loss = model(inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            step += 1
            losses.append(loss.item())
            if started is None:
                started = time.monotonic()
                if first_step is not None:
                    first_step.set()
            if step % 100 == 0:
                print(f"  step {step}: loss {sum(losses[-100:]) / 100:.3f}", file=sys.stderr, flush=True)
        seconds = time.monotonic() - started if started is not None else 0.0
        val = evaluate(model, data, config)
        chosen, dropped = model.moe_counters()
    return {"steps": step, "seconds": seconds, "val_loss": val, "dropped_share": dropped / chosen if chosen else 0}


def run(args, data: TextData, workdir: Path, churn: bool, steps: int | None) -> tuple[dict, Swarm]:
    expert_args = TrainConfig(seed=args.seed).expert_server_args()
    swarm = Swarm(args, workdir / ("churn" if churn else "calm"), churn, args.seed)
    try:
        swarm.start(expert_args)
        result = train_run(args, data, swarm.peers, minutes=args.minutes if churn else None, steps=steps,
                           first_step=swarm.training)
        if churn:  # the fates of the last kills' experts settle within an expiration or so
            deadline = time.monotonic() + args.expiration + 30
            while any(len(k.lost) + len(k.fresh) < len(k.before) for k in swarm.kills) \
                    and time.monotonic() < deadline:
                time.sleep(1)
        swarm.finish()
    finally:
        swarm.close()
    return result, swarm


def training_failures(churn_steps: int, calm_steps: int) -> list[str]:
    """What makes the runs' figures empty, even in a smoke run: a churn run of no step (its "updates lost 0" and
    loss ratio 1.000 compared two untrained models, review 103 D2), a calm run of fewer steps than the churn run's."""
    failures = []
    if churn_steps < 1:
        failures.append("the churn run made no training step")
    if calm_steps < churn_steps:
        failures.append(f"the calm run made {calm_steps} of the {churn_steps} steps asked")
    return failures


def goal_failures(kills: int, fresh: int, unresolved: int, worth: list[float], longest_empty: float,
                  expiration: float, ratio: float, churn_steps: int, calm_steps: int) -> list[str]:
    """The goals missed: the runs' training (:func:`training_failures`), ``kills`` servers killed (none: nothing was
    tested), ``fresh`` experts back with no replica and ``unresolved`` ones, ``worth``: each adopted expert's lost
    updates in push intervals' worth (at most 1), ``longest_empty``: the longest spell of an empty cell in seconds
    (at most ``expiration`` + 10), ``ratio``: the churn run's final validation loss over the calm run's (at most
    1.05; NaN misses)."""
    failures = training_failures(churn_steps, calm_steps)
    if not kills:
        failures.append("no server was killed")
    if fresh or unresolved or max(worth, default=0) > 1:
        failures.append("training lost beyond one push interval")
    if longest_empty > expiration + 10:
        failures.append("a cell stayed empty too long")
    if not ratio <= 1.05:
        failures.append("loss ratio above 1.05")
    return failures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of training under churn")
    parser.add_argument("--servers", type=int, default=6, help="expert servers at the start")
    parser.add_argument("--min-alive", type=int, default=3, help="never kill a server when this few are alive")
    parser.add_argument("--mean-lifetime", type=float, default=180.0, help="mean seconds a server lives")
    parser.add_argument("--first-kill", type=float, default=60.0, help="seconds until the first kill")
    parser.add_argument("--join-delay", type=float, nargs=2, default=(10.0, 60.0), metavar=("MIN", "MAX"),
                        help="a new server joins this many seconds after each kill (uniform)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-interval", type=float, default=10.0)
    parser.add_argument("--refresh-period", type=float, default=2.0)
    parser.add_argument("--expiration", type=float, default=6.0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=None,
                        help="a text file to train on (default: the demo's Shakespeare corpus; --smoke: a tiny verse)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 servers, 3 s of training with one early kill and one server joining; goals are "
                             "reported, not enforced, except that both runs train; flags given with it keep their "
                             "values")
    # one kill early on, one server joining after it, a short calm run (2 servers: the fewest that show an adoption;
    # each server more cost the test suite seconds of CPU to start, twice); declarations of half the default's life,
    # so that the killed server's experts are adopted, and the run ends, seconds sooner
    args = parse_with_quick(parser, argv, dict(servers=2, min_alive=1, minutes=0.05, first_kill=2.0, mean_lifetime=1e6,
                                               join_delay=(0.5, 1.0), replica_interval=2.0, hidden=16, seq_len=16,
                                               refresh_period=1.0, expiration=3.0),
                            flag="smoke")
    if args.min_alive >= args.servers:
        parser.error("--min-alive must be below --servers")
    return args


def main() -> None:
    args = parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.data is not None:
            corpus = args.data
        elif args.smoke:
            from tests.test_chaos import verse

            corpus = verse(Path(tmp) / "verse.txt")
        else:
            corpus = shakespeare(DATA)
        data = TextData.from_file(corpus, 0.05, args.seq_len + 1)
        churned, swarm = run(args, data, Path(tmp), churn=True, steps=None)
        print(f"churn: {churned['steps']} steps in {churned['seconds']:.0f}s, val loss {churned['val_loss']:.3f}, "
              f"dropped {churned['dropped_share']:.1%} of chosen experts", flush=True)
        calm, _ = run(args, data, Path(tmp), churn=False, steps=churned["steps"])
        print(f"calm:  {calm['steps']} steps in {calm['seconds']:.0f}s, val loss {calm['val_loss']:.3f}", flush=True)

    lost = [(uid, n, kill) for kill in swarm.kills for uid, n in kill.lost.items()]
    fresh = [uid for kill in swarm.kills for uid in kill.fresh]
    unresolved = sum(len(k.before) - len(k.lost) - len(k.fresh) for k in swarm.kills)
    worth = [n / (kill.rates[uid] * args.replica_interval) for uid, n, kill in lost if kill.rates.get(uid)]
    for kill in swarm.kills:
        print(f"  kill of {kill.endpoint} at {time.strftime('%H:%M:%S', time.localtime(kill.at))}: "
              f"{len(kill.before)} experts, updates lost {sorted(kill.lost.values())}"
              + (f", back fresh: {kill.fresh}" if kill.fresh else ""))
    max_lost = max((n for _, n, _ in lost), default=0)
    if fresh:  # everything they had trained is gone
        max_lost = max([max_lost] + [kill.before[uid] for kill in swarm.kills for uid in kill.fresh])
    ratio = churned["val_loss"] / calm["val_loss"]
    print(f"{len(swarm.kills)} kills, {swarm.joins} joins, {len(lost)} experts adopted from replicas, "
          f"{len(fresh)} back with no replica, {unresolved} unresolved")
    print(f"updates lost per adopted expert: max {max((n for _, n, _ in lost), default=0)}, mean "
          f"{sum(n for _, n, _ in lost) / max(len(lost), 1):.1f}; in push intervals' worth: "
          + (f"max {max(worth):.2f} (goal <= 1)" if worth else "none measured (no update rate before a kill)"))
    print(f"empty cells: {len(swarm.empty_spells)} spells, longest {swarm.longest_empty:.1f}s (goal <= "
          f"{args.expiration + 10:.0f}s = expiration + 10 s)")
    print(f"final validation loss churn/calm: {ratio:.3f} (goal <= 1.05)")
    failures = goal_failures(len(swarm.kills), len(fresh), unresolved, worth, swarm.longest_empty, args.expiration,
                             ratio, churned["steps"], calm["steps"])
    print("goals met" if not failures else "goals missed: " + "; ".join(failures))
    print(f"max_updates_lost={max_lost} longest_empty_cell_s={swarm.longest_empty:.1f} loss_ratio={ratio:.3f}")
    # a smoke run reports its goals, but one that trained nothing did not run at all
    sys.exit(1 if (failures and not args.smoke) or training_failures(churned["steps"], calm["steps"]) else 0)


if __name__ == "__main__":
    main()
