"""Throughput of one expert server against the in-process limit of the same work.

N client processes send batches to M experts hosted by one ``dmoe-server`` process, in three modes:
``fwd``; ``fwd+bwd`` (the backward sends the inputs again and the server recomputes the forward); and
``fwd+bwd cached``, how the DMoE layer really calls (the forward carries an activation id, the backward only the
gradients and the id, and the server reuses the kept graph: no recompute).

The limit is the same work without the network: the server's own ``ExpertBackend`` with an activation cache,
run one request at a time in a process with the server's torch thread count, optimizer and batch sizes (the
server's ``--max-batch-size`` equals the batch size, so it cannot merge requests into larger batches; the
``server formed`` column reads the server's metrics to show the rows per batch it really ran, and the cache hits).
Both sides are warmed up first, and both count whole requests: the remote rate is the samples of all requests
over the span from the first start to the last finish, the limit's over its loop's duration. Remote and limit
measurements alternate (``--rounds``) because a shared machine's speed drifts.

Three ratios are printed. ``ratio``: samples per wall-clock second, remote over limit (at most 1 up to
measurement noise: the remote side does the limit's work plus the network's). ``cpu ratio``: samples per
CPU-second, where the remote side pays for the server process *and* the client processes, and the limit for
its own process. ``server cpu``: the same with the server process alone (all of them with ``--server-processes``),
i.e. what a dedicated server pays when its clients run elsewhere. ``range``: the lowest and highest of the
rounds' ratios, each round's remote rate over the same round's limit (the rounds are paired; ``ratio`` is the ratio
of the rounds' mean rates).

What the server did is read from its metrics, not from the flags: ``via shm`` is the share of its calls in the
measured rounds that came through shared memory (requests under 64 KiB go through gRPC: a warning names the cases
where shared memory was asked for and none did); with ``--cuda-graphs`` each case prints the graphs captured, the
forward and training-step replays and the experts whose graphs were turned off, and warns when a case with
backwards replayed no training step (the server then trained eagerly). The limit never uses graphs: with
``--cuda-graphs`` the ratios compare the server with CUDA graphs against an eager limit.

    python benchmarks/bench_throughput.py --preset quick        # a few minutes on a shared 2-core machine
    python benchmarks/bench_throughput.py --preset compute      # ffn h=1024, batches 64..2048, all modes
    python benchmarks/bench_throughput.py --preset overhead     # nop, batch 1, many clients: requests/s
    python benchmarks/bench_throughput.py --preset transport    # compute's traffic (h=1024, batches 256..2048), nop
    python benchmarks/bench_throughput.py --preset compute --device cuda   # server and limit on the GPU
    python benchmarks/bench_throughput.py --preset compute --device cuda --autocast bf16   # both under autocast
    python benchmarks/bench_throughput.py --preset compute --device cuda --overlap-copies   # server: pinned copies
    python benchmarks/bench_throughput.py --preset compute --device cuda --compression float16   # half the bytes
    python benchmarks/bench_throughput.py --preset smoke        # seconds; what the test suite runs
    python benchmarks/bench_throughput.py --preset compute --profile   # and the server's stages per case
    python benchmarks/bench_throughput.py --preset transport --no-shared-memory   # every byte through gRPC
    python benchmarks/bench_throughput.py --preset sizes --shared-memory-min-bytes 0  # 4 KiB-1 MiB, one at a time
    python benchmarks/bench_throughput.py --preset transport --server-processes 4   # the experts in 4 processes

``transport`` sends what ``compute`` sends to experts that return their inputs (``nop``): its remote rows/s are
the most the server's path (gRPC, decoding, copies, encoding) carries with no compute at all, the ceiling of
``compute``'s remote rate; its limit (a no-op in process) means nothing.

``--profile`` starts the server with ``--profile`` (dmoe/server/profile.py) and prints, after each case, the time
of each stage of the server's path over the measured rounds, per event and per client request. On a GPU the
profiled server synchronises between stages: its rates are not the unprofiled ones.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from options import RESULTS  # noqa: E402 (benchmarks/)
from server_counts import (count_samples, difference, format_share, graphs_summary,  # noqa: E402 (benchmarks/)
                           graphs_warning, shared_memory_warning, shared_share)

CACHED = "fwd+bwd cached"  # forward with an activation id, backward with the id: the server reuses the kept graph
MODES = ("fwd+bwd", CACHED, "fwd")


@dataclass
class Case:
    expert_cls: str
    hidden_dim: int
    batch: int
    mode: str           # one of MODES
    clients: int
    inflight: int       # concurrent requests per client process
    experts: int


def preset_cases(name: str) -> list[Case]:
    compute_batches = {"quick": (64, 256, 2048), "compute": (64, 256, 1024, 2048), "full": (64, 256, 1024, 2048)}
    cases = []
    if name in compute_batches:
        for batch in compute_batches[name]:
            for mode in MODES:
                cases.append(Case("ffn", 1024, batch, mode, clients=2, inflight=2, experts=4))
    if name == "transport":  # the compute preset's traffic with no compute: the server path's own ceiling
        return [Case("nop", 1024, batch, mode, clients=2, inflight=2, experts=4)
                for batch in (256, 1024, 2048) for mode in MODES]
    if name == "sizes":  # one forward at a time of 4 KiB to 1 MiB: where the shared-memory path starts to pay
        return [Case("nop", 1024, batch, "fwd", clients=1, inflight=1, experts=1) for batch in (1, 4, 16, 64, 256)]
    if name == "smoke":  # what the test suite runs (with --clients 1 --inflight 2): every mode once, in seconds
        return [Case("ffn", 32, 16, mode, clients=2, inflight=1, experts=2) for mode in MODES]
    if name in ("quick", "overhead", "full"):
        for mode in ("fwd+bwd", "fwd"):
            cases.append(Case("nop", 16, 1, mode, clients=8, inflight=2, experts=4))
        if name != "quick":
            cases.append(Case("ffn", 16, 1, "fwd+bwd", clients=8, inflight=2, experts=4))
    if not cases:
        raise SystemExit(f"unknown preset {name!r}")
    return cases


# ---- worker processes: `client` sends requests, `limit` does the same work in-process -------------------------

def make_inputs(case: dict):
    import torch

    from dmoe.experts import expert_class
    torch.manual_seed(0)
    x = expert_class(case["expert_cls"]).sample(case["batch"], case["hidden_dim"])[0]
    return x, torch.randn_like(x)


#: a client worker's channel pools, by whether they use shared memory
_POOLS: dict = {}


def run_client(cmd: dict) -> dict:
    """Sends requests from ``inflight`` threads.

    ``phase == "warmup"``: each thread makes ``warmup_requests`` untimed requests (first calls open channels and
    fill the server's allocator caches). ``phase == "measure"``: every thread starts at ``start_at`` and keeps
    starting requests until ``duration`` has passed; every request is counted whole, and the result carries the
    first start and the last finish, so the rate is completed samples over that span (no window cuts a request).
    """
    from dmoe.client import backward_future, forward_future
    from dmoe.client.remote_expert import new_activation_id
    from dmoe.wire import ChannelPool
    x, grad = make_inputs(cmd)
    uids, endpoints, mode = cmd["uids"], cmd["endpoints"], cmd["mode"]
    pool_key = (cmd.get("shared_memory", True), cmd.get("shared_memory_min_bytes"))
    if pool_key not in _POOLS:  # one per worker process, kept across commands (channels stay open)
        shared_memory, min_bytes = pool_key
        _POOLS[pool_key] = ChannelPool(shared_memory=shared_memory, **(
            {} if min_bytes is None else {"shared_memory_min_bytes": min_bytes}))
    channels = _POOLS[pool_key]

    def request(uid: str) -> None:
        activation_id = new_activation_id() if mode == CACHED else None
        compression = cmd.get("compression", "none")
        forward_future(endpoints[uid], uid, [x], activation_id=activation_id, compression=compression,
                       channels=channels).result()
        if mode != "fwd":  # with an id only the gradients travel back, and the server reuses the kept graph
            backward_future(endpoints[uid], uid, [x], [grad], activation_id=activation_id, compression=compression,
                            channels=channels).result()

    inflight = cmd["inflight"]
    if cmd["phase"] == "warmup":
        threads = [threading.Thread(target=lambda slot=slot: [request(uids[(slot + j) % len(uids)])
                                                              for j in range(cmd["warmup_requests"])])
                   for slot in range(inflight)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return {}

    end = cmd["start_at"] + cmd["duration"]
    finishes, counts = [0.0] * inflight, [0] * inflight

    def loop(slot: int) -> None:
        # each thread of each client calls an expert of its own while there are enough: an optimizer step of an
        # expert drops the graphs other requests kept for it, which would make the cached mode recompute
        uid = uids[(cmd["client_index"] * inflight + slot) % len(uids)]
        while time.time() < end:
            request(uid)
            counts[slot] += 1
            finishes[slot] = time.time()

    time.sleep(max(0.0, cmd["start_at"] - time.time()))
    first_start, cpu = time.time(), time.process_time()
    threads = [threading.Thread(target=loop, args=(slot,)) for slot in range(inflight)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"requests": sum(counts), "samples": sum(counts) * cmd["batch"], "first_start": first_start,
            "last_finish": max(finishes), "cpu": time.process_time() - cpu}


class LimitWorker:
    """The server's work without the network: the server's own ``ExpertBackend`` (with an activation cache
    like the server's), one request at a time, with the server's batch sizes, optimizer and thread count.

    Backends persist per (class, hidden) so weights and optimizer state evolve as on a server.
    """

    def __init__(self):
        self.backends = {}

    def run(self, cmd: dict) -> dict:
        import torch

        from dmoe.experts import create_expert, expert_class
        from dmoe.server import ExpertBackend, make_optimizer
        from dmoe.server.activations import ActivationCache
        from dmoe.server.runtime import AUTOCAST_DTYPES
        key = (cmd["expert_cls"], cmd["hidden_dim"])
        if key not in self.backends:
            backends = []
            cache = ActivationCache(int(cmd["activation_cache_mb"] * 2**20))
            for i in range(cmd["experts"]):
                module = create_expert(cmd["expert_cls"], cmd["hidden_dim"], seed=i).to(cmd["device"])
                sample = expert_class(cmd["expert_cls"]).sample(2, cmd["hidden_dim"])
                backends.append(ExpertBackend(f"b.{i}", module, sample,
                                              make_optimizer(cmd["optimizer"], module.parameters(), cmd["lr"]),
                                              activations=cache))
            self.backends[key] = backends
        backends = self.backends[key]
        x, grad = make_inputs(cmd)
        x, grad = x.to(cmd["device"], copy=True), grad.to(cmd["device"], copy=True)
        # on a GPU, a request is done when its results exist, as the server's are once copied into a reply
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        rows = x.shape[0]

        # as the server's runtime runs each batch's forward or backward (both context managers can be re-entered)
        autocast = (torch.autocast(x.device.type, dtype=AUTOCAST_DTYPES[cmd["autocast"]]) if cmd.get("autocast")
                    else contextlib.nullcontext())

        def request(backend) -> None:
            with autocast:
                compute(backend)
            sync()

        def compute(backend) -> None:
            if cmd["mode"] == CACHED:  # what the server runs for a forward with an id and its backward
                segments = [(os.urandom(16), rows)]
                backend.forward(x, segments=segments)
                backend.backward(x, grad, segments=segments)
            else:
                backend.forward(x)
                if cmd["mode"] == "fwd+bwd":
                    backend.backward(x, grad)  # recomputes the forward, as the server does without an id

        if cmd["phase"] == "warmup":
            for j in range(cmd["warmup_requests"] * cmd["inflight"] * cmd["clients"]):
                request(backends[j % len(backends)])
            return {}
        done, i = 0, 0
        cpu = time.process_time()
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < cmd["duration"]:
            request(backends[i % len(backends)])
            i += 1
            done += 1
        del torch
        return {"requests": done, "samples": done * cmd["batch"], "seconds": elapsed,
                "cpu": time.process_time() - cpu}


def worker_main(role: str) -> None:
    """Reads one JSON command per stdin line, answers one JSON line each; stops at end of input.

    The work runs in one non-main thread, as on the server (its runtime thread): on an oversubscribed machine,
    torch's OpenMP regions started from the main thread were measured up to 20x slower than from another thread.
    The allocator settings are those of dmoe-server (dmoe.cli.allocator), so the limit is not slowed by page faults
    the server no longer takes.
    """
    from dmoe.cli.allocator import keep_freed_memory

    keep_freed_memory()
    import torch
    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
    limit = LimitWorker()

    def serve() -> None:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            result = run_client(cmd) if role == "client" else limit.run(cmd)
            print(json.dumps(result), flush=True)

    thread = threading.Thread(target=serve, name=f"bench-{role}")
    thread.start()
    thread.join()


# ---- the conductor ----------------------------------------------------------------------------------------------

class Worker:
    def __init__(self, role: str, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "BENCH_TORCH_THREADS": str(threads),
               "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen([sys.executable, __file__, "--worker", role], cwd=ROOT, env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1)

    def send(self, cmd: dict) -> None:
        self.popen.stdin.write(json.dumps(cmd) + "\n")

    def receive(self) -> dict:
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited with {self.popen.wait()}")
        return json.loads(line)

    def end_input(self) -> None:
        """Closes its input: it exits once done with the commands it has."""
        if not self.popen.stdin.closed:
            self.popen.stdin.close()

    def close(self) -> None:
        if self.popen.poll() is None:
            self.end_input()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all its threads) and of its running children (a server's processes,
    ``--processes``), from /proc."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(entry.name) == pid or int(fields[1]) == pid:
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def server_key_of(case: Case) -> tuple:
    """What a case's server is started with: cases of the same key share a server."""
    return case.expert_cls, case.hidden_dim, case.batch, case.experts


def start_server(case: Case, args: argparse.Namespace):
    from dmoe.launch import Proc
    return Proc(["-m", "dmoe.cli.server", "--experts", f"bench.[0:{case.experts}]", "--expert-cls", case.expert_cls,
                 "--hidden-dim", str(case.hidden_dim), "--max-batch-size", str(case.batch), "--device", args.device,
                 "--torch-threads", str(args.torch_threads), "--optimizer", args.optimizer, "--lr", str(args.lr),
                 "--activation-cache-mb", str(args.activation_cache_mb), "--metrics-port", "0",
                 "--log-level", "WARNING", "--processes", str(args.server_processes),
                 *(("--autocast", args.autocast) if args.autocast else ()),
                 "--overlap-copies" if args.overlap_copies else "--no-overlap-copies",
                 *(("--cuda-graphs",) if args.cuda_graphs else ()),
                 "--shared-memory" if args.shared_memory else "--no-shared-memory",
                 *(("--profile",) if args.profile else ())],
                env={"OMP_NUM_THREADS": str(args.torch_threads)})


def server_counters(metrics_endpoints: list[str]) -> dict[str, float]:
    """Rows and batches the server's runtime ran per method, and activation-cache hits, from its metrics (those of
    all its processes); and its CUDA graphs' and gRPC calls' counters (benchmarks/server_counts.py)."""
    from dmoe.server.metrics import read_metrics

    samples = [sample for endpoint in metrics_endpoints for sample in read_metrics(endpoint, timeout=10)]
    counters = count_samples(samples)
    for sample in samples:
        if sample.name in ("dmoe_batch_rows_sum", "dmoe_batch_rows_count"):
            name = f"{sample.labels.get('method', '?')}_{sample.name.rsplit('_', 1)[1]}"
            counters[name] = counters.get(name, 0.0) + sample.value
        elif sample.name == "dmoe_activation_cache_total" and sample.labels.get("result") in ("hit", "miss"):
            counters[sample.labels["result"]] = counters.get(sample.labels["result"], 0.0) + sample.value
    return counters


def formed_batches(before: dict[str, float], after: dict[str, float]) -> str:
    """``forward 256x12 backward 256x12``: rows per batch the server formed (and how many) between two reads."""
    parts = []
    for method in ("forward", "backward"):
        count = after.get(f"{method}_count", 0) - before.get(f"{method}_count", 0)
        if count:
            rows = (after.get(f"{method}_sum", 0) - before.get(f"{method}_sum", 0)) / count
            parts.append(f"{method} {rows:.0f}x{count:.0f}")
    hits = after.get("hit", 0) - before.get("hit", 0)
    if hits:
        parts.append(f"cache hits {hits:.0f}")
    return " ".join(parts)


def paired_ratios(remote_rates: list[float], limit_rates: list[float]) -> list[float]:
    """Each round's remote rate over the same round's limit (a round measures the limit, then the remote side)."""
    assert len(remote_rates) == len(limit_rates), "the rounds are paired"
    return [remote / limit for remote, limit in zip(remote_rates, limit_rates)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="quick",
                        choices=["quick", "compute", "transport", "overhead", "full", "smoke", "sizes"])
    parser.add_argument("--duration", type=float, default=None, help="seconds per measurement (default by preset)")
    parser.add_argument("--warmup-requests", type=int, default=2,
                        help="untimed requests per client thread (and as many for the limit) before each case")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved limit/remote measurements per case")
    # One by default: on this shared 2-core machine two OpenMP threads stall whenever another process runs,
    # and both sides' figures then swing by 3x from one second to the next. Use all cores on an idle machine.
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads of the server and of the in-process limit (default 1)")
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "adam"])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--activation-cache-mb", type=float, default=512.0,
                        help="the server's activation cache (its processes share it), and the limit's")
    parser.add_argument("--device", default="cpu", help="where the server and the limit compute (cpu, cuda)")
    parser.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                        help="the server's --autocast; the limit runs the same forwards and backwards under it")
    parser.add_argument("--overlap-copies", action=argparse.BooleanOptionalAction, default=False,
                        help="the server's --overlap-copies (GPU only: pinned copies on a copy stream per worker)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                        help="the server's --cuda-graphs (GPU only: each expert's forward and training step replayed "
                             "as CUDA graphs)")
    parser.add_argument("--compression", choices=["none", "float16", "uint8"], default="none",
                        help="the clients' wire compression of requests, also asked of the answers (the limit has "
                             "no wire: fewer bytes per row is what this measures)")
    parser.add_argument("--shared-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="the clients' and server's shared-memory path (client and server on one host, the "
                             "default); --no-shared-memory: every byte through gRPC's transport")
    parser.add_argument("--shared-memory-min-bytes", type=int, default=None,
                        help="the clients' smallest request through shared memory (default: the library's, "
                             "dmoe.wire.shared_memory.MIN_BYTES)")
    parser.add_argument("--server-processes", type=int, default=1,
                        help="the server's --processes: its experts dealt out among this many server processes")
    parser.add_argument("--clients", type=int, default=None,
                        help="client processes of every case (default: the preset's; a GPU host's cores can run "
                             "more, so that the clients' Python is not what is measured)")
    parser.add_argument("--inflight", type=int, default=None,
                        help="concurrent requests per client process of every case (default: the preset's)")
    parser.add_argument("--profile", action="store_true",
                        help="run the server with --profile and print its stage times after each case")
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory for the CSV")
    parser.add_argument("--worker", choices=["client", "limit"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker)

    from dmoe.launch import announced
    cases = preset_cases(args.preset)
    for flag in ("clients", "inflight"):
        if getattr(args, flag) is not None:
            if getattr(args, flag) < 1:
                parser.error(f"--{flag} must be at least 1")
            cases = [dataclasses.replace(case, **{flag: getattr(args, flag)}) for case in cases]
    duration = args.duration or {"quick": 2.0, "smoke": 0.5}.get(args.preset, 4.0)
    n_clients = max(case.clients for case in cases)
    print(f"preset {args.preset}: {len(cases)} cases, {duration:g} s each, server/limit torch threads "
          f"{args.torch_threads}, {args.optimizer}, {os.cpu_count()} cores, device {args.device}, "
          f"autocast {args.autocast or 'off'}, wire compression {args.compression}"
          f"{', server copies pinned on copy streams' if args.overlap_copies else ''}"
          f"{', server asked for CUDA graphs (the limit computes eagerly)' if args.cuda_graphs else ''}"
          f", {'shared memory asked for (the share used: via shm)' if args.shared_memory else 'payload through gRPC'}"
          f"{f', {args.server_processes} server processes' if args.server_processes > 1 else ''}"
          f", {n_clients} client processes x {max(case.inflight for case in cases)} requests in flight", flush=True)
    clients = [Worker("client", 1) for _ in range(n_clients)]
    limit = Worker("limit", args.torch_threads)
    rows = []
    shares: dict[str, float | None] = {}  # per case: the share of the server's calls through shared memory
    graph_warnings: list[str] = []
    # the first case's server starts beside the workers, not after them: each process spends seconds importing torch
    server, server_key, listening = start_server(cases[0], args), server_key_of(cases[0]), None
    try:
        for worker in [*clients, limit]:
            worker.receive()
        header = (f"{'expert':>10} {'mode':>14} {'batch':>6} {'clients':>7} {'remote/s':>10} {'limit/s':>10} "
                  f"{'range':>12} {'ratio':>6} {'cpu ratio':>9} {'server cpu':>10} {'via shm':>7}  server formed")
        print(header, flush=True)
        for case in cases:
            key = server_key_of(case)
            if key != server_key:
                server.stop()
                server, server_key, listening = start_server(case, args), key, None
            if listening is None:  # this case's server was just started: its addresses, once it listens
                server.endpoint(timeout=120)
                listening, metrics = announced(server.output), announced(server.output, "metrics on")
                uids = [f"bench.{i}" for i in range(case.experts)]  # dealt out: the i-th to process i % N
                endpoints = {uid: listening[i % len(listening)] for i, uid in enumerate(uids)}
            cmd = {**asdict(case), "optimizer": args.optimizer, "lr": args.lr, "duration": duration,
                   "device": args.device, "activation_cache_mb": args.activation_cache_mb, "autocast": args.autocast,
                   "compression": args.compression, "shared_memory": args.shared_memory,
                   "shared_memory_min_bytes": args.shared_memory_min_bytes,
                   "warmup_requests": args.warmup_requests, "endpoints": endpoints, "uids": uids}
            limit.send({**cmd, "phase": "warmup"})
            limit.receive()
            for worker in clients[:case.clients]:
                worker.send({**cmd, "phase": "warmup"})
            for worker in clients[:case.clients]:
                worker.receive()
            limit_rates, remote_rates, remote_requests, measured_requests = [], [], [], 0
            limit_work, remote_work = [0.0, 0.0], [0.0, 0.0]  # (samples, cpu seconds)
            server_work = 0.0  # cpu seconds of the server process alone
            counters_before = server_counters(metrics)
            stages_before = None
            if args.profile:
                from dmoe.server.profile import format_stages, read_all_stages, stage_difference
                stages_before = read_all_stages(metrics)
            for _ in range(args.rounds):  # interleaved, so drifts of a shared machine hit both sides alike
                limit.send({**cmd, "phase": "measure"})
                measured = limit.receive()
                limit_rates.append(measured["samples"] / measured["seconds"])
                limit_work = [limit_work[0] + measured["samples"], limit_work[1] + measured["cpu"]]
                server_cpu = process_cpu_seconds(server.popen.pid)
                start_at = time.time() + 0.2
                for index, worker in enumerate(clients[:case.clients]):
                    worker.send({**cmd, "phase": "measure", "start_at": start_at, "client_index": index})
                remote = [worker.receive() for worker in clients[:case.clients]]
                span = max(r["last_finish"] for r in remote) - min(r["first_start"] for r in remote)
                remote_work[0] += sum(r["samples"] for r in remote)
                server_cpu = process_cpu_seconds(server.popen.pid) - server_cpu
                server_work += server_cpu
                remote_work[1] += server_cpu + sum(r["cpu"] for r in remote)
                remote_rates.append(sum(r["samples"] for r in remote) / span)
                remote_requests.append(sum(r["requests"] for r in remote) / span)
                measured_requests += sum(r["requests"] for r in remote)
            counters_after = server_counters(metrics)
            formed = formed_batches(counters_before, counters_after)
            served = difference(counters_after, counters_before)  # in the measured rounds
            share = shared_share(served)
            ratios = paired_ratios(remote_rates, limit_rates)
            remote_rate = sum(remote_rates) / len(remote_rates)
            limit_rate = sum(limit_rates) / len(limit_rates)
            row = {**asdict(case), "device": args.device, "autocast": args.autocast or "",
                   "compression": args.compression, "shared_memory": args.shared_memory,
                   "overlap_copies": args.overlap_copies, "cuda_graphs": args.cuda_graphs,
                   "server_processes": args.server_processes,
                   "duration_s": duration, "rounds": args.rounds,
                   "torch_threads": args.torch_threads, "optimizer": args.optimizer,
                   "remote_samples_per_s": round(remote_rate, 1),
                   "remote_requests_per_s": round(sum(remote_requests) / len(remote_requests), 1),
                   "limit_samples_per_s": round(limit_rate, 1),
                   "limit_per_round": " ".join(f"{r:.0f}" for r in limit_rates),
                   "remote_per_round": " ".join(f"{r:.0f}" for r in remote_rates),
                   "ratio": round(remote_rate / limit_rate, 3),
                   "ratio_per_round": " ".join(f"{r:.3f}" for r in ratios),
                   "remote_samples_per_cpu_s": round(remote_work[0] / remote_work[1], 1),
                   "limit_samples_per_cpu_s": round(limit_work[0] / limit_work[1], 1),
                   "cpu_ratio": round((remote_work[0] / remote_work[1]) / (limit_work[0] / limit_work[1]), 3),
                   "server_samples_per_cpu_s": round(remote_work[0] / server_work, 1),
                   "server_cpu_ratio": round((remote_work[0] / server_work) / (limit_work[0] / limit_work[1]), 3),
                   "shared_memory_share": "" if share is None else round(share, 4),
                   "server_formed": formed}
            graphs = {**served, "graph_captures": counters_after["graph_captures"]}  # captures since it started
            if args.cuda_graphs:
                row.update(graph_captures=int(graphs["graph_captures"]),
                           graph_forward_replays=int(graphs["graph_forward_replays"]),
                           graph_train_replays=int(graphs["graph_train_replays"]), graphs_off=int(graphs["graphs_off"]))
            rows.append(row)
            name = f"{case.expert_cls}{case.hidden_dim}"
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"  # the rounds' own ratios, each round paired
            shares[f"{name} {case.mode} batch {case.batch}"] = share
            print(f"{name:>10} {case.mode:>14} {case.batch:>6} {case.clients:>7} {remote_rate:>10.1f} "
                  f"{limit_rate:>10.1f} {spread:>12} {remote_rate / limit_rate:>6.2f} {row['cpu_ratio']:>9.2f} "
                  f"{row['server_cpu_ratio']:>10.2f} {format_share(share):>7}  {formed}", flush=True)
            if args.cuda_graphs:
                print(f"{'':>10} the server's CUDA graphs (captures since it started, replays in the measured "
                      f"rounds): {graphs_summary(graphs)}", flush=True)
                warning = graphs_warning(graphs, asked=True, trained=case.mode != "fwd")
                if warning:
                    graph_warnings.append(f"{name} {case.mode} batch {case.batch}")
                    print(warning, flush=True)
            if stages_before is not None:
                print(format_stages(stage_difference(read_all_stages(metrics), stages_before), per=measured_requests,
                                    unit="request"), flush=True)
    finally:  # the processes exit side by side (each takes a second or more of CPU to unload torch)
        server.interrupt()
        for worker in [*clients, limit]:
            worker.end_input()
        for worker in [*clients, limit]:
            worker.close()
        server.stop()
    print("range: the lowest and highest of the rounds' ratios (each round's remote rate over the same round's "
          "limit); via shm: the share of the server's calls in the measured rounds that came through shared memory")
    if args.cuda_graphs:
        print("ratios above: the server with CUDA graphs against the limit computing eagerly (the same ExpertBackend "
              "without graphs)")
        if graph_warnings:
            print(f"WARNING: --cuda-graphs was asked for, but not all of the server's graphs replayed in "
                  f"{len(graph_warnings)} case(s): {', '.join(graph_warnings)} (see the warnings above)")
    warning = shared_memory_warning(shares, args.shared_memory)
    if warning:
        print(warning)
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"throughput_{args.preset}_{args.device}_{time.strftime('%Y%m%d-%H%M%S')}.csv"
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
