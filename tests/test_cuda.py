"""The GPU paths on real hardware: expert servers computing on CUDA (full precision and autocast), and a client
whose layer and inputs live on the GPU. Skipped where torch sees no CUDA device (CI has none); the rest of the
suite runs its servers on CUDA too on such a machine, since ``--device`` defaults to cuda when available."""
from __future__ import annotations

import time

import pytest
import torch

from dmoe.client import RemoteExpert, backward_future, expert_info, forward_future
from dmoe.client.gating import LocalMixtureOfExperts
from dmoe.client.moe import RemoteMixtureOfExperts
from dmoe.dht import DHT
from dmoe.directory import get_experts
from dmoe.experts import create_expert, expert_seed
from dmoe.launch import LocalSwarm, SwarmConfig, announced
from dmoe.server.runtime import Runtime
from dmoe.server.transfer import CudaTransfers, make_transfers
from dmoe.uid import grid_uids
from tests.procs import running

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

HIDDEN = 64


def server_args(*extra: str) -> tuple[str, ...]:
    return ("-m", "dmoe.cli.server", "--experts", "ffn.[0:2]", "--expert-cls", "ffn", "--hidden-dim",
            str(HIDDEN), "--optimizer", "sgd", "--lr", "0.1", "--seed", "3", *extra)


def local_copy(uid: str, device: str = "cpu") -> torch.nn.Module:
    return create_expert("ffn", HIDDEN, seed=expert_seed(3, uid)).to(device)


@pytest.mark.parametrize("copies", [(), ("--workers", "2"), ("--overlap-copies",),
                                    ("--overlap-copies", "--workers", "2")],
                         ids=["plain-copies", "two-workers", "pinned-copy-stream", "pinned-two-workers"])
def test_a_cuda_server_computes_what_the_cpu_module_computes_and_trains(copies):
    with running(*server_args("--device", "cuda", *copies)) as proc:
        endpoint = proc.endpoint()
        assert expert_info(endpoint, "ffn.0")["device"].startswith("cuda")
        local = local_copy("ffn.0")
        x, grad = torch.randn(33, HIDDEN), torch.randn(33, HIDDEN)
        expert = RemoteExpert("ffn.0", endpoint, timeout=60)
        x_remote = x.clone().requires_grad_()
        output = expert(x_remote)
        assert output.device.type == "cpu" and output.dtype == torch.float32
        x_local = x.clone().requires_grad_()
        expected = local(x_local)
        torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)
        output.backward(grad)  # gradient-only backward: the server kept this forward's activations on the GPU
        expected.backward(grad)
        torch.testing.assert_close(x_remote.grad, x_local.grad, atol=1e-4, rtol=1e-4)
        torch.optim.SGD(local.parameters(), lr=0.1).step()
        with torch.no_grad():
            torch.testing.assert_close(expert(x), local(x), atol=1e-4, rtol=1e-4)


def test_a_cuda_server_of_two_processes_computes_in_each_what_the_cpu_module_computes():
    with running(*server_args("--device", "cuda", "--processes", "2")) as proc:
        proc.endpoint(timeout=120)
        endpoints = announced(proc.output)
        assert len(endpoints) == 2
        x = torch.randn(8, HIDDEN)
        for uid, endpoint in zip(("ffn.0", "ffn.1"), endpoints):  # every second expert in each process
            assert expert_info(endpoint, uid)["device"].startswith("cuda")
            torch.testing.assert_close(forward_future(endpoint, uid, [x]).result(60)[0], local_copy(uid)(x).detach(),
                                       atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("autocast", ["bf16", "fp16"])
def test_an_autocast_cuda_server_answers_float32_close_to_full_precision(autocast):
    with running(*server_args("--device", "cuda", "--autocast", autocast)) as proc:
        endpoint, local = proc.endpoint(), local_copy("ffn.1")
        x, grad = torch.randn(16, HIDDEN), torch.randn(16, HIDDEN)
        output = forward_future(endpoint, "ffn.1", [x]).result(60)[0]
        assert output.dtype == torch.float32 and torch.isfinite(output).all()
        torch.testing.assert_close(output, local(x).detach(), atol=0.05, rtol=0.05)
        x_local = x.clone().requires_grad_()
        local(x_local).backward(grad)
        grad_x = backward_future(endpoint, "ffn.1", [x], [grad]).result(60)[0]
        assert grad_x.dtype == torch.float32
        torch.testing.assert_close(grad_x, x_local.grad, atol=0.05, rtol=0.05)


def test_a_layer_on_the_gpu_mixes_cuda_served_experts_like_in_process_gpu_experts():
    grid = (2, 4)
    config = SwarmConfig(layers=("ffn0",), grid=grid, n_servers=2, hidden_dim=HIDDEN,
                         server_args=("--device", "cuda", "--refresh-period", "1"))
    with LocalSwarm(config) as swarm, DHT(initial_peers=[swarm.initial_peers]) as dht:
        uids = grid_uids("ffn0", grid)
        deadline = time.monotonic() + 60
        while not all(get_experts(dht, uids)):
            assert time.monotonic() < deadline, "experts were not declared in 60 s"
            time.sleep(0.1)
        torch.manual_seed(0)
        local = LocalMixtureOfExperts(HIDDEN, grid, "ffn0", k_best=3, expert_factory=lambda uid: create_expert(
            "ffn", HIDDEN, seed=expert_seed(0, uid))).cuda()
        remote = RemoteMixtureOfExperts(HIDDEN, grid, "ffn0", dht, k_best=3, k_min=3).cuda()
        remote.proj.load_state_dict(local.proj.state_dict())
        x = torch.randn(4, 6, HIDDEN, device="cuda", requires_grad=True)
        output = remote(x)
        assert output.device.type == "cuda"
        with torch.no_grad():
            torch.testing.assert_close(output, local(x), atol=1e-4, rtol=1e-4)
        output.pow(2).sum().backward()
        assert x.grad.device.type == "cuda" and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
        assert remote.proj.weight.grad.device.type == "cuda"
        assert remote.stats.experts_dropped == 0 and remote.stats.backward_failures == 0


def test_cuda_transfers_join_host_requests_in_pinned_memory_and_hand_back_pinned_outputs():
    device = torch.device("cuda")
    transfers = make_transfers(device, overlap=True)
    assert isinstance(transfers, CudaTransfers)
    host = [(torch.randn(3, 8), torch.randn(3, 2)), (torch.randn(5, 8), torch.randn(5, 2))]
    joined = transfers.inputs(host)
    assert all(x.device.type == "cuda" for x in joined)
    torch.testing.assert_close(joined[0].cpu(), torch.cat([r[0] for r in host]))
    torch.testing.assert_close(joined[1].cpu(), torch.cat([r[1] for r in host]))
    kept = torch.randn(2, 8, device=device)  # an input the server kept on the device, batched with a fresh one
    mixed = transfers.inputs([(kept,), (host[0][0],)])
    torch.testing.assert_close(mixed[0].cpu(), torch.cat([kept.cpu(), host[0][0]]))
    outputs = transfers.outputs([joined[0] * 2, joined[1].sum(dim=1, keepdim=True)])
    assert all(y.device.type == "cpu" and y.is_pinned() for y in outputs)
    torch.testing.assert_close(outputs[0], torch.cat([r[0] for r in host]) * 2)


def test_two_cuda_workers_with_their_own_copy_streams_answer_many_concurrent_requests_correctly():
    weight = torch.randn(64, 64)
    on_device = weight.cuda()
    with Runtime("cuda", workers=2, overlap_copies=True) as runtime:
        pools = [runtime.create_pool(f"p{i}", lambda x: (torch.tanh(x @ on_device),), max_batch_size=256)
                 for i in range(4)]
        xs = [torch.randn(1 + i % 7, 64) for i in range(200)]
        futures = [runtime.submit(pools[i % 4], x) for i, x in enumerate(xs)]
        for x, future in zip(xs, futures):
            torch.testing.assert_close(future.result(60)[0], torch.tanh(x @ weight), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradients_on_the_gpu_are_checked_in_one_fused_call_and_a_nan_skips_the_step(dtype):
    from dmoe.server.backend import ExpertBackend, all_finite, make_optimizer

    device = torch.device("cuda")
    big = torch.full((4, 1000), 60000.0, dtype=dtype, device=device)  # finite, summing past float16's range
    assert all_finite([big, torch.zeros(0, dtype=dtype, device=device)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = big.clone()
        broken[3, 999] = bad
        assert not all_finite([big, broken])
    module = local_copy("ffn.0", "cuda").to(dtype)
    backend = ExpertBackend("e", module, [torch.randn(2, HIDDEN, device=device, dtype=dtype)],
                            make_optimizer("adam", module.parameters(), 0.1))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    x = torch.randn(3, HIDDEN, device=device, dtype=dtype)
    backend.backward(x, torch.full((3, HIDDEN), float("nan"), device=device, dtype=dtype))
    assert backend.skipped_steps == 1 and backend.updates == 0
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name
    backend.backward(x, torch.randn(3, HIDDEN, device=device, dtype=dtype))  # a finite gradient still trains
    assert backend.skipped_steps == 1 and backend.updates == 1
    assert not torch.equal(module.state_dict()["ffn.0.weight"], before["ffn.0.weight"])


def test_a_checkpoint_keeps_the_gpu_s_random_state_too(tmp_path):
    """Dropout on the GPU draws from the GPU's generator: a resumed run must draw what the stopped one would have."""
    from dmoe.trainer.loop import Progress, TrainConfig, load_checkpoint, rng_state, save_checkpoint

    config = TrainConfig(device="cuda", out_dir=str(tmp_path))
    model = torch.nn.Linear(4, 4).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    torch.cuda.manual_seed(5)
    assert "cuda_rng" in rng_state("cuda")
    save_checkpoint(tmp_path / "checkpoint.pt", model, optimizer, config, Progress(step=1))
    expected = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(6)
    load_checkpoint(tmp_path / "checkpoint.pt", model, optimizer, config)
    assert torch.equal(torch.rand(8, device="cuda"), expected)


def graphed_and_eager_pair(optimizer: str = "adam", **kwargs):
    """Two backends of one expert on the GPU, the first replaying CUDA graphs, the second eager."""
    from dmoe.server.activations import ActivationCache
    from dmoe.server.backend import ExpertBackend, make_optimizer

    pair = []
    for _ in range(2):
        module = local_copy("ffn.0", "cuda")
        # Adam with a large eps: its first steps are about lr times the gradient's sign, and the two paths' sums
        # (padded batches, other kernels) differ in the last bits, which flips the sign of gradients near zero
        chosen = (torch.optim.Adam(module.parameters(), lr=0.01, eps=1e-3, fused=True) if optimizer == "adam"
                  else make_optimizer(optimizer, module.parameters(), 0.01))
        pair.append(ExpertBackend("ffn.0", module, [torch.randn(2, HIDDEN, device="cuda")], chosen,
                                  activations=ActivationCache(1 << 26), **kwargs))
    pair[0].use_cuda_graphs(max_rows=64)
    return pair


def test_cuda_graphs_compute_and_train_as_the_eager_expert_does():
    """Batches of varied sizes (buckets of 16, 32 and 64 rows, and one past max_rows): the graphed expert answers
    and steps as the eager one, once its buckets are captured too."""
    graphed, eager = graphed_and_eager_pair(clip_grad_norm=1.0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    sizes = [5, 16, 20, 5, 20, 11, 20, 33, 64, 7, 20, 40, 90, 33, 33, 12]
    for step, rows in enumerate(sizes):
        x = torch.randn(rows, HIDDEN, device="cuda", generator=generator)
        grad = torch.randn(rows, HIDDEN, device="cuda", generator=generator)
        aid = bytes([step])
        outputs = [backend.forward(x, segments=[(aid, rows)])[0].clone() for backend in (graphed, eager)]
        torch.testing.assert_close(outputs[0], outputs[1], atol=2e-4, rtol=2e-4)
        assert graphed.activations.inputs("ffn.0", aid) is not None  # held for the backward, without a graph
        grads = [backend.backward(x, grad, segments=[(aid, rows)])[0].clone() for backend in (graphed, eager)]
        torch.testing.assert_close(grads[0], grads[1], atol=2e-4, rtol=2e-4)
        assert graphed.activations.inputs("ffn.0", aid) is None
    graphs = graphed.graphs
    assert graphs is not None and graphs.captures >= 4 and graphs.replays >= 8, (graphs.captures, graphs.replays)
    assert graphs.replays_by_kind["train"] >= 4 and graphs.switch.off is None, (graphs.replays_by_kind,
                                                                                graphs.switch.off)
    assert graphed.updates == eager.updates == len(sizes) and graphed.skipped_steps == 0
    for (name, mine), theirs in zip(graphed.module.state_dict().items(), eager.module.state_dict().values()):
        torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=2e-4, msg=name)
    assert all(p.grad is None for p in graphed.module.parameters())


def test_a_graphed_training_step_skips_a_non_finite_gradient_on_the_device():
    graphed, _ = graphed_and_eager_pair()
    x = torch.randn(20, HIDDEN, device="cuda")
    for _ in range(4):  # two eager runs, then the capture, then a replay
        graphed.backward(x, torch.randn(20, HIDDEN, device="cuda"))
    assert graphed.graphs.captures == 1 and graphed.updates == 4
    before = {k: v.clone() for k, v in graphed.module.state_dict().items()}
    steps = [graphed.optimizer.state[p]["step"].item() for p in graphed.module.parameters()]
    bad = torch.randn(20, HIDDEN, device="cuda")
    bad[3, 5] = float("inf")
    graphed.backward(x, bad)
    assert graphed.skipped_steps == 1 and graphed.updates == 4
    for name, value in graphed.module.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert [graphed.optimizer.state[p]["step"].item() for p in graphed.module.parameters()] == steps
    graphed.backward(x, torch.randn(20, HIDDEN, device="cuda"))
    assert graphed.updates == 5 and not torch.equal(graphed.module.state_dict()["ffn.0.weight"],
                                                    before["ffn.0.weight"])


def test_a_graphed_batch_of_several_requests_with_a_non_finite_gradient_is_run_again_request_by_request():
    """Review 66: a replayed step skipped on the device for a batch of several requests raises NonFiniteBatch (the
    runtime then runs each request alone) instead of dropping every request's gradients; nothing is applied."""
    from dmoe.server.backend import NonFiniteBatch

    graphed, _ = graphed_and_eager_pair()
    x = torch.randn(20, HIDDEN, device="cuda")
    for _ in range(4):  # two eager runs, then the capture, then a replay
        graphed.backward(x, torch.randn(20, HIDDEN, device="cuda"))
    assert graphed.graphs.captures == 1 and graphed.updates == 4
    before = {k: v.clone() for k, v in graphed.module.state_dict().items()}
    steps = [graphed.optimizer.state[p]["step"].item() for p in graphed.module.parameters()]
    replays = graphed.graphs.replays_by_kind["train"]
    bad = torch.randn(20, HIDDEN, device="cuda")
    bad[13, 5] = float("nan")  # in the second request
    with pytest.raises(NonFiniteBatch):
        graphed.backward(x, bad, segments=[(None, 10), (None, 10)])
    assert graphed.graphs.replays_by_kind["train"] == replays + 1
    assert graphed.skipped_steps == 0 and graphed.updates == 4
    for name, value in graphed.module.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert [graphed.optimizer.state[p]["step"].item() for p in graphed.module.parameters()] == steps


def test_cuda_graphs_leave_sgd_s_training_step_eager_and_reset_on_a_loaded_state():
    graphed, eager = graphed_and_eager_pair("sgd")
    assert "not fused Adam" in graphed.graphs.train_off
    x, grad = torch.randn(20, HIDDEN, device="cuda"), torch.randn(20, HIDDEN, device="cuda")
    for _ in range(4):
        for backend in (graphed, eager):
            backend.forward(x)
            backend.backward(x, grad)
    assert graphed.graphs.captures == 1  # the forward's bucket alone
    torch.testing.assert_close(graphed.module.state_dict()["ffn.0.weight"], eager.module.state_dict()["ffn.0.weight"])
    graphed.load_state_dict(eager.state_dict())
    assert not graphed.graphs._graphs


@pytest.mark.parametrize("autocast", [(), ("--autocast", "bf16")], ids=["fp32", "bf16"])
def test_a_cuda_graphs_server_trains_with_adam_as_the_cpu_module_does(autocast):
    # small steps: Adam's first steps are about lr times the gradient's sign, which the GPU's and the CPU's sums
    # flip for gradients near zero (and bf16's errors are larger)
    lr, tolerance = (1e-4, 0.05) if autocast else (1e-4, 1e-3)
    with running(*server_args("--device", "cuda", "--cuda-graphs", "--optimizer", "adam", "--lr", str(lr),
                              *autocast)) as proc:
        expert = RemoteExpert("ffn.0", proc.endpoint(), timeout=60)
        local = local_copy("ffn.0")
        optimizer = torch.optim.Adam(local.parameters(), lr=lr)
        for _ in range(6):  # past the eager runs: the last steps replay the graphs
            x, grad = torch.randn(24, HIDDEN), torch.randn(24, HIDDEN)
            x_remote, x_local = x.clone().requires_grad_(), x.clone().requires_grad_()
            output, expected = expert(x_remote), local(x_local)
            torch.testing.assert_close(output, expected, atol=tolerance, rtol=tolerance)
            output.backward(grad)
            expected.backward(grad)
            torch.testing.assert_close(x_remote.grad, x_local.grad, atol=tolerance, rtol=tolerance)
            optimizer.step()
            optimizer.zero_grad()


class _ReadsOnTheHost(torch.nn.Module):
    """An expert that reads a value on the host in its forward: something a CUDA graph cannot record."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.linear(x) * (1.0 if x.abs().max().item() < 1e6 else 0.0)


def test_a_failed_capture_turns_graphs_off_for_the_process_and_leaves_the_stream_as_it_was():
    from dmoe.server.backend import ExpertBackend, make_optimizer
    from dmoe.server.cuda_graphs import GraphSwitch

    switch = GraphSwitch()
    module = _ReadsOnTheHost().cuda()
    backend = ExpertBackend("host", module, [torch.randn(2, HIDDEN, device="cuda")],
                            make_optimizer("adam", module.parameters(), 0.01))
    backend.use_cuda_graphs(64, switch)
    other, _ = graphed_and_eager_pair()
    other.graphs.switch = switch
    stream = torch.cuda.current_stream()
    x = torch.randn(20, HIDDEN, device="cuda")
    for _ in range(4):
        with torch.no_grad():
            torch.testing.assert_close(backend.forward(x)[0], module(x))
    assert switch.off is not None and "host" in switch.off
    assert torch.cuda.current_stream() == stream
    assert backend.graphs.captures == 0 and not other.graphs.trains
    for _ in range(4):
        other.forward(x)
    assert other.graphs.captures == 0  # off for every expert of the process
