"""Throughput of one expert server against the in-process limit of the same work.

N client processes send batches (forward, or forward + backward) to M experts hosted by one ``dmoe-server``
process. The limit is the same work without RPC, in a process with the server's torch thread count: forward,
then the backward request's recomputed forward + backward + optimizer step, with the same batch sizes (the
server's max_batch_size equals the batch size, so it never merges requests into larger batches). Remote and
limit measurements alternate (``--rounds``) because this machine is shared and its speed drifts; a request
straddling a window edge is credited in proportion to its time inside the window.

Three ratios are printed. ``ratio``: samples per wall-clock second, remote over limit. ``cpu ratio``: samples
per CPU-second, where the remote side pays for the server process *and* the client processes, and the limit
for its own process; it shows the cost of the RPC path even when other tenants of the machine make wall-clock
figures swing. ``server cpu``: the same with the server process alone, i.e. what a dedicated server pays when
its clients run elsewhere.

    python benchmarks/bench_throughput.py --preset quick        # ~3 minutes on a shared 2-core machine
    python benchmarks/bench_throughput.py --preset compute      # ffn h=1024, batches 64..2048, both modes
    python benchmarks/bench_throughput.py --preset overhead     # nop, batch 1, many clients: requests/s
    python benchmarks/bench_throughput.py --preset compute --device cuda   # server and limit on the GPU
"""
from __future__ import annotations

import argparse
import csv
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


@dataclass
class Case:
    expert_cls: str
    hidden_dim: int
    batch: int
    mode: str           # "fwd" or "fwd+bwd"
    clients: int
    inflight: int       # concurrent requests per client process
    experts: int


def preset_cases(name: str) -> list[Case]:
    compute_batches = {"quick": (64, 256, 2048), "compute": (64, 256, 1024, 2048), "full": (64, 256, 1024, 2048)}
    cases = []
    if name in compute_batches:
        for batch in compute_batches[name]:
            for mode in ("fwd+bwd", "fwd"):
                cases.append(Case("ffn", 1024, batch, mode, clients=2, inflight=2, experts=4))
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

    from dmoe.server.layers import expert_class
    torch.manual_seed(0)
    x = expert_class(case["expert_cls"]).sample(case["batch"], case["hidden_dim"])[0]
    return x, torch.randn_like(x)


def run_client(cmd: dict) -> dict:
    """Sends requests from ``inflight`` threads until the window ends; credits each request's samples to the
    window in proportion to the part of the request's duration that fell inside it (long requests straddle
    window edges, and counting only whole requests would quantise the result)."""
    from dmoe.client import backward_future, forward_future
    x, grad = make_inputs(cmd)
    uids, endpoint = cmd["uids"], cmd["endpoint"]
    begin = cmd["start_at"] + cmd["warmup"]
    end = begin + cmd["duration"]
    credit = [0.0] * cmd["inflight"]
    requests = [0] * cmd["inflight"]
    completed = [0] * cmd["inflight"]

    def loop(slot: int) -> None:
        i = slot
        while (started := time.time()) < end:
            uid = uids[i % len(uids)]
            i += cmd["inflight"]
            forward_future(endpoint, uid, [x]).result()
            if cmd["mode"] == "fwd+bwd":
                backward_future(endpoint, uid, [x], [grad]).result()
            finished = time.time()
            inside = max(0.0, min(finished, end) - max(started, begin))
            credit[slot] += cmd["batch"] * inside / (finished - started)
            requests[slot] += inside / (finished - started)
            completed[slot] += cmd["batch"]

    time.sleep(max(0.0, cmd["start_at"] - time.time()))
    cpu = time.process_time()
    threads = [threading.Thread(target=loop, args=(slot,)) for slot in range(cmd["inflight"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"requests": sum(requests), "samples": sum(credit), "completed": sum(completed),
            "cpu": time.process_time() - cpu}


class LimitWorker:
    """Holds one backend per (class, hidden, expert) so weights and optimizer state persist like on a server."""

    def __init__(self):
        self.backends = {}

    def run(self, cmd: dict) -> dict:
        import torch

        from dmoe.server import ExpertBackend, create_expert, make_optimizer
        from dmoe.server.layers import expert_class
        key = (cmd["expert_cls"], cmd["hidden_dim"])
        if key not in self.backends:
            backends = []
            for i in range(cmd["experts"]):
                module = create_expert(cmd["expert_cls"], cmd["hidden_dim"], seed=i).to(cmd["device"])
                sample = expert_class(cmd["expert_cls"]).sample(2, cmd["hidden_dim"])
                backends.append(ExpertBackend(f"b.{i}", module, sample,
                                              make_optimizer(cmd["optimizer"], module.parameters(), cmd["lr"])))
            self.backends[key] = backends
        backends = self.backends[key]
        x, grad = make_inputs(cmd)
        x, grad = x.to(cmd["device"], copy=True), grad.to(cmd["device"], copy=True)
        # on a GPU, a request is done when its results exist, as the server's are once copied into a reply
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        done, i = 0, 0
        cpu = time.process_time()
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < cmd["duration"]:
            backend = backends[i % len(backends)]
            i += 1
            backend.forward(x)
            if cmd["mode"] == "fwd+bwd":
                backend.backward(x, grad)
            sync()
            done += 1
        del torch
        return {"requests": done, "samples": done * cmd["batch"], "seconds": elapsed,
                "cpu": time.process_time() - cpu}


def worker_main(role: str) -> None:
    """Reads one JSON command per stdin line, answers one JSON line each; stops at end of input.

    The work runs in one non-main thread, as on the server (its runtime thread): on an oversubscribed machine,
    torch's OpenMP regions started from the main thread were measured up to 20x slower than from another thread.
    The allocator settings are those of dmoe-server (dmoe.allocator), so the limit is not slowed by page faults
    the server no longer takes.
    """
    from dmoe.allocator import keep_freed_memory

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

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.stdin.close()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(case: Case, threads: int, optimizer: str, lr: float, device: str):
    from dmoe.launch import Proc
    return Proc(["-m", "servers.run_server", "--experts", f"bench.[0:{case.experts}]", "--expert-cls", case.expert_cls,
                 "--hidden-dim", str(case.hidden_dim), "--max-batch-size", str(case.batch), "--device", device,
                 "--torch-threads", str(threads), "--optimizer", optimizer, "--lr", str(lr), "--log-level", "WARNING"],
                env={"OMP_NUM_THREADS": str(threads)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="quick", choices=["quick", "compute", "overhead", "full"])
    parser.add_argument("--duration", type=float, default=None, help="seconds per measurement (default by preset)")
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved limit/remote measurements per case")
    # One by default: on this shared 2-core machine two OpenMP threads stall whenever another process runs,
    # and both sides' figures then swing by 3x from one second to the next. Use all cores on an idle machine.
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads of the server and of the in-process limit (default 1)")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--device", default="cpu", help="where the server and the limit compute (cpu, cuda)")
    parser.add_argument("--results", type=Path, default=ROOT / "results", help="directory for the CSV")
    parser.add_argument("--worker", choices=["client", "limit"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker)

    cases = preset_cases(args.preset)
    duration = args.duration or (2.0 if args.preset == "quick" else 4.0)
    n_clients = max(case.clients for case in cases)
    print(f"preset {args.preset}: {len(cases)} cases, {duration:.0f}s each, server/limit torch threads "
          f"{args.torch_threads}, {os.cpu_count()} cores, device {args.device}", flush=True)
    clients = [Worker("client", 1) for _ in range(n_clients)]
    limit = Worker("limit", args.torch_threads)
    rows = []
    server, server_key = None, None
    try:
        for worker in [*clients, limit]:
            worker.receive()
        header = (f"{'expert':>10} {'mode':>8} {'batch':>6} {'clients':>7} {'remote/s':>10} {'limit/s':>10} "
                  f"{'range':>12} {'ratio':>6} {'cpu ratio':>9} {'server cpu':>10}")
        print(header, flush=True)
        for case in cases:
            key = (case.expert_cls, case.hidden_dim, case.batch, case.experts)
            if key != server_key:
                if server is not None:
                    server.stop()
                server, server_key = start_server(case, args.torch_threads, args.optimizer, args.lr,
                                                         args.device), key
                endpoint = server.endpoint(timeout=120)
            cmd = {**asdict(case), "optimizer": args.optimizer, "lr": args.lr, "duration": duration,
                   "device": args.device}
            uids = [f"bench.{i}" for i in range(case.experts)]
            limit_rates, remote_rates, remote_requests = [], [], []
            limit_work, remote_work = [0.0, 0.0], [0.0, 0.0]  # (samples, cpu seconds)
            server_work = 0.0  # cpu seconds of the server process alone
            for _ in range(args.rounds):  # interleaved, so drifts of a shared machine hit both sides alike
                limit.send(cmd)
                measured = limit.receive()
                limit_rates.append(measured["samples"] / measured["seconds"])
                limit_work = [limit_work[0] + measured["samples"], limit_work[1] + measured["cpu"]]
                server_cpu = process_cpu_seconds(server.popen.pid)
                start_at = time.time() + 0.2
                for worker in clients[:case.clients]:
                    worker.send({**cmd, "endpoint": endpoint, "uids": uids, "start_at": start_at,
                                 "warmup": args.warmup})
                remote = [worker.receive() for worker in clients[:case.clients]]
                remote_work[0] += sum(r["completed"] for r in remote)
                server_cpu = process_cpu_seconds(server.popen.pid) - server_cpu
                server_work += server_cpu
                remote_work[1] += server_cpu + sum(r["cpu"] for r in remote)
                remote_rates.append(sum(r["samples"] for r in remote) / duration)
                remote_requests.append(sum(r["requests"] for r in remote) / duration)
            remote_rate = sum(remote_rates) / len(remote_rates)
            limit_rate = sum(limit_rates) / len(limit_rates)
            row = {**asdict(case), "device": args.device, "duration_s": duration, "rounds": args.rounds,
                   "torch_threads": args.torch_threads,
                   "remote_samples_per_s": round(remote_rate, 1),
                   "remote_requests_per_s": round(sum(remote_requests) / len(remote_requests), 1),
                   "limit_samples_per_s": round(limit_rate, 1),
                   "limit_per_round": " ".join(f"{r:.0f}" for r in limit_rates),
                   "remote_per_round": " ".join(f"{r:.0f}" for r in remote_rates),
                   "ratio": round(remote_rate / limit_rate, 3),
                   "remote_samples_per_cpu_s": round(remote_work[0] / remote_work[1], 1),
                   "limit_samples_per_cpu_s": round(limit_work[0] / limit_work[1], 1),
                   "cpu_ratio": round((remote_work[0] / remote_work[1]) / (limit_work[0] / limit_work[1]), 3),
                   "server_cpu_ratio": round((remote_work[0] / server_work) / (limit_work[0] / limit_work[1]), 3)}
            rows.append(row)
            name = f"{case.expert_cls}{case.hidden_dim}"
            spread = f"{min(remote_rates) / max(limit_rates):.2f}-{max(remote_rates) / min(limit_rates):.2f}"
            print(f"{name:>10} {case.mode:>8} {case.batch:>6} {case.clients:>7} {remote_rate:>10.1f} "
                  f"{limit_rate:>10.1f} {spread:>12} {remote_rate / limit_rate:>6.2f} {row['cpu_ratio']:>9.2f} "
                  f"{row['server_cpu_ratio']:>10.2f}", flush=True)
    finally:
        for worker in [*clients, limit]:
            worker.close()
        if server is not None:
            server.stop()
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"throughput_{args.preset}_{args.device}_{time.strftime('%Y%m%d-%H%M%S')}.csv"
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
