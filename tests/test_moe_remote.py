"""The DMoE layer against a real local swarm: batching per expert, same maths as in-process, dead servers,
and the trainer surviving a server killed in the middle of training."""
import contextlib
import logging
import re
import time
import urllib.request
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest
import torch

from dmoe.client import failures
from dmoe.client.bans import BanConfig
from dmoe.client.failures import MAX_CHUNKS, REFUSALS_TO_BAN
from dmoe.client.gating import LocalMixtureOfExperts, NoAliveExpertsError
from dmoe.client.moe import RemoteMixtureOfExperts
from dmoe.client.remote_expert import RemoteExpertError, expert_info
from dmoe.dht import DHT
from dmoe.directory import get_experts
from dmoe.experts import create_expert, expert_seed
from dmoe.launch import LocalSwarm, SwarmConfig
from dmoe.uid import grid_uids
from procs import Proc, processes

HIDDEN = 16
GRID = (4, 4)
UIDS = grid_uids("ffn0", GRID)


def wait_until_declared(dht: DHT, uids, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        endpoints = get_experts(dht, uids)
        if all(endpoints):
            return endpoints
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sum(map(bool, endpoints))} of {len(uids)} experts declared")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def swarm():
    config = SwarmConfig(layers=("ffn0",), grid=GRID, n_servers=2, hidden_dim=HIDDEN,
                         server_args=("--optimizer", "sgd", "--lr", "0.1", "--refresh-period", "1",
                                      "--metrics-port", "0"))
    with LocalSwarm(config) as swarm, DHT(initial_peers=[swarm.initial_peers]) as dht:
        wait_until_declared(dht, UIDS)
        yield swarm, dht


CUSTOM = ["--custom-module", "tests/custom_experts.py"]
#: the servers of the tests below that are about a server of their own kind (one that refuses, answers slowly or
#: wrongly), each test in a layer of its own (a 4 x 4 grid): layer -> [(experts pattern, the server's extra flags)]
ZOO = {
    "widen0": [("widen0.[2:4].[0:4]", ["--expert-cls", "widen", *CUSTOM])],
    "double0": [("double0.[2:4].[0:4]", ["--expert-cls", "double", *CUSTOM])],
    "reroute0": [("reroute0.[0:2].[0:4]", ["--inject-latency-ms", "30000"]),
                 ("reroute0.[2:4].[0:4]", ["--inject-latency-ms", "30000"])],
    "strict0": [("strict0.0.[0:4]", ["--max-abs-value", "100"])],
    "scaled0": [("scaled0.[0:4].[0:4]", ["--max-abs-value", "1000", "--optimizer", "sgd", "--lr", "1e-30"])],
    "slow0": [("slow0.[2:4].[0:4]", ["--inject-latency-ms", "1500"])],
    "huge0": [("huge0.2.[0:4]", ["--expert-cls", "huge", *CUSTOM]),
              ("huge0.3.[0:4]", ["--expert-cls", "huge_grad", *CUSTOM])],
    "batched0": [("batched0.[0:4].[0:4]", ["--max-batch-size", "64", "--optimizer", "sgd", "--lr", "1e-30"])],
}
#: the rest of those layers' grids: ordinary ffn experts (dmoe-server's defaults), all on one server
ORDINARY = ["widen0.[0:2].[0:4]", "double0.[0:2].[0:4]", "strict0.[1:4].[0:4]", "slow0.[0:2].[0:4]",
            "huge0.[0:2].[0:4]"]


def start_server(peer: str, pattern: str, *flags: str) -> Proc:
    return Proc(["-m", "dmoe.cli.server", "--experts", pattern, "--hidden-dim", str(HIDDEN), "--host", "127.0.0.1",
                 "--port", "0", "--initial-peers", peer, *flags])


@pytest.fixture(scope="module")
def zoo(swarm):
    """The servers of :data:`ZOO` and of :data:`ORDINARY` on the swarm's DHT, started once for the module (a server
    start costs seconds of CPU; they were started per test, each test with the ordinary half of its grid on a server
    of its own). None of them is stopped before the module ends: a DHT node that dies stays in the others' routing
    tables, and look-ups that meet it wait for it (the tests that kill a server have a swarm of their own). Yields
    the swarm's DHT client node and ``layer -> the endpoints of its ZOO servers``."""
    local_swarm, dht = swarm
    with processes() as procs:
        procs.append(start_server(local_swarm.initial_peers, ",".join(ORDINARY)))
        started = {layer: [start_server(local_swarm.initial_peers, pattern, *flags) for pattern, flags in servers]
                   for layer, servers in ZOO.items()}
        procs += [proc for servers in started.values() for proc in servers]
        endpoints = {layer: [proc.endpoint() for proc in servers] for layer, servers in started.items()}
        procs[0].endpoint()
        wait_until_declared(dht, [uid for layer in ZOO for uid in grid_uids(layer, GRID)])
        yield dht, endpoints


def forward_counts(endpoints, uids=UIDS) -> dict[str, int]:
    return {uid: expert_info(endpoint, uid, timeout=10)["forward_calls"] for uid, endpoint in zip(uids, endpoints)}


@contextlib.contextmanager
def servers_with_flags(*servers: tuple[str, list[str]], hidden: int = HIDDEN, uids=UIDS):
    """A DHT node and one dmoe-server per ``(experts pattern, extra flags)``; yields (dht, endpoints, procs)."""
    with processes() as procs:
        boot = Proc(["-m", "dmoe.dht", "--host", "127.0.0.1", "--port", "0"])
        procs.append(boot)
        peer = boot.endpoint()
        for pattern, flags in servers:
            procs.append(Proc(["-m", "dmoe.cli.server", "--experts", pattern, "--hidden-dim", str(hidden),
                               "--host", "127.0.0.1", "--port", "0", "--initial-peers", peer, *flags]))
        endpoints = [proc.endpoint() for proc in procs[1:]]
        with DHT(initial_peers=[peer]) as dht:
            wait_until_declared(dht, uids)
            yield dht, endpoints, procs[1:]


def test_rows_routed_to_one_expert_travel_in_one_request(swarm):
    _, dht = swarm
    endpoints = get_experts(dht, UIDS)
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn0", dht, k_best=4)
    before = forward_counts(endpoints)
    layer(torch.randn(64, HIDDEN))
    calls = {uid: n - before[uid] for uid, n in forward_counts(endpoints).items()}
    # 64 rows x 4 experts = 256 (row, expert) pairs, but each chosen expert got exactly one request
    assert set(calls.values()) <= {0, 1}
    assert sum(calls.values()) == layer.stats.experts_chosen > 4
    assert layer.stats.experts_dropped == 0



@pytest.mark.parametrize("k_best, switch", [(3, False), (1, True)])
def test_remote_layer_computes_the_same_mixture_as_in_process_experts(swarm, k_best, switch):
    _, dht = swarm
    torch.manual_seed(0)
    # the servers' experts are seeded per uid (seed 0): rebuild the same weights here
    local = LocalMixtureOfExperts(HIDDEN, GRID, "ffn0", k_best=k_best, switch=switch, expert_factory=lambda uid:
                                  create_expert("ffn", HIDDEN, seed=expert_seed(0, uid)))
    remote = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn0", dht, k_best=k_best, k_min=k_best, switch=switch)
    remote.proj.load_state_dict(local.proj.state_dict())
    x = torch.randn(8, 5, HIDDEN)  # [batch, seq, hidden]: routed per token
    with torch.no_grad():  # forward only: a backward would change the servers' weights for later tests
        assert torch.allclose(remote(x), local(x), atol=1e-5)
    if switch:
        assert torch.allclose(remote.balance_loss, local.balance_loss)


def test_gradients_reach_the_gate_and_the_inputs_and_experts_train(swarm):
    _, dht = swarm
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn0", dht, k_best=2)
    x = torch.randn(32, HIDDEN, requires_grad=True)
    with torch.no_grad():
        before = layer(x)
    layer(x).pow(2).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert layer.proj.weight.grad is not None and layer.proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        after = layer(x)
    assert not torch.allclose(before, after)  # the servers applied SGD steps
    assert layer.stats.backward_calls > 0 and layer.stats.backward_failures == 0


def grpc_calls(swarm) -> dict[tuple[int, str], float]:
    """(server index, rpc) -> gRPC calls that server received, from its metrics endpoint."""
    counts = {}
    for i, server in enumerate(swarm.servers):
        metrics = re.search(r"dmoe-server metrics on (\S+:\d+)", "".join(server.output)).group(1)
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if match := re.fullmatch(r'dmoe_grpc_calls_total\{rpc="(\w+)"\} (\S+)', line):
                    counts[i, match.group(1)] = float(match.group(2))
    return counts


def test_a_forward_and_a_backward_cost_one_call_per_server(swarm):
    # (after the tests that need the servers' initial weights: backward trains the experts)
    local_swarm, dht = swarm
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn0", dht, k_best=4)
    layer(torch.randn(64, HIDDEN)).sum().backward()  # warm: the beam search's cache, the channels
    before = grpc_calls(local_swarm)
    layer(torch.randn(64, HIDDEN)).sum().backward()
    after = grpc_calls(local_swarm)
    calls = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    # 64 rows x 4 experts over 16 experts on 2 servers: each server got one forward_batch and one backward_batch
    assert calls == {(0, "forward_batch"): 1, (1, "forward_batch"): 1, (0, "backward_batch"): 1,
                     (1, "backward_batch"): 1}, calls

def test_killed_server_loses_no_rows_and_is_avoided_afterwards():
    config = SwarmConfig(layers=("ffn0",), grid=GRID, n_servers=2, hidden_dim=HIDDEN,
                         server_args=("--refresh-period", "30"))  # records outlive the kill: bans must do the work
    with LocalSwarm(config) as swarm, DHT(initial_peers=[swarm.initial_peers]) as dht:
        wait_until_declared(dht, UIDS)
        layer = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn0", dht, k_best=4, allow_zero_outputs=False)
        x = torch.randn(64, HIDDEN, requires_grad=True)
        layer(x).sum().backward()
        swarm.servers[0].kill()
        out = layer(x)  # rows whose experts all died are re-routed within this call: nothing raises
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
        first_drops = layer.stats.experts_dropped
        assert first_drops > 0
        layer(x)
        assert layer.stats.experts_dropped == first_drops  # the dead server is banned: not chosen again


@pytest.mark.parametrize("bad_cls", ["widen", "double"])
def test_answers_of_the_wrong_shape_or_dtype_are_dropped_and_their_experts_avoided(zoo, bad_cls):
    dht, _ = zoo
    layer_name = f"{bad_cls}0"  # rows 0-1 ordinary experts, rows 2-3 of the bad class
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, layer_name, dht, k_best=4)
    x = torch.randn(64, HIDDEN, requires_grad=True)
    out = layer(x)  # rows whose experts all answered too wide are re-routed to the others
    out.sum().backward()
    assert out.shape == (64, HIDDEN) and torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert out.dtype == x.grad.dtype == torch.float32  # no float64 answer made it into the mixture
    assert layer.stats.backward_failures == 0  # nor into the gradients sent to the healthy server
    dropped = layer.stats.experts_dropped
    assert dropped > 0
    layer(x)
    assert layer.stats.experts_dropped == dropped  # the widening experts are banned: not chosen again


def test_half_precision_inputs_travel_as_float32_and_come_back_in_their_dtype(swarm):
    _, dht = swarm
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn0", dht, k_best=2, k_min=2)
    x = torch.randn(16, HIDDEN)
    with torch.no_grad():
        exact = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a client under mixed precision
            half = layer(x.bfloat16())
    assert half.dtype == torch.bfloat16 and layer.stats.experts_dropped == 0
    torch.testing.assert_close(half.float(), exact, atol=0.1, rtol=0.05)
    x16 = x.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x16)
    out.float().sum().backward()
    assert x16.grad.dtype == torch.bfloat16 and torch.isfinite(x16.grad.float()).all()
    assert layer.stats.backward_failures == 0


def test_rows_of_another_width_than_the_experts_fail_with_the_servers_reason(swarm):
    _, dht = swarm
    layer = RemoteMixtureOfExperts(2 * HIDDEN, GRID, "ffn0", dht, k_best=2, reroute_attempts=0)
    with pytest.raises(NoAliveExpertsError, match=r"refused the requests as invalid.*expected shape \[\*, 16\]"):
        layer(torch.randn(4, 2 * HIDDEN))


def test_rerouted_rows_wait_only_for_what_is_left_of_the_forward_timeout(zoo):
    dht, _ = zoo  # two servers of 30 s latency: the reroute goes to the other one
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "reroute0", dht, k_best=1, forward_timeout=1.5,
                                   reroute_attempts=1, allow_zero_outputs=True)
    started = time.monotonic()
    with torch.no_grad():
        layer(torch.randn(1, HIDDEN))
    elapsed = time.monotonic() - started
    assert layer.stats.experts_dropped >= 1
    assert elapsed < 2.4, elapsed  # a second full timeout for the reroute would take 3 s


def test_a_refusal_as_invalid_drops_the_expert_from_that_call_and_bans_it_only_when_it_keeps_refusing(zoo, caplog):
    """INVALID_ARGUMENT is usually the caller's own mistake, and one ban book serves every layer of a trainer: a
    refused call must not make the layers avoid healthy experts. Rows the strict server refuses are rerouted within
    the call, and the next call with acceptable rows uses its experts again. An expert that refuses forwards the
    others answer three times in a row is the server's own strictness: it is banned, and no longer asked."""
    uids = grid_uids("strict0", GRID)
    strict = [uid for uid in uids if uid.startswith("strict0.0.")]
    dht, _ = zoo  # row 0 on a strict server (--max-abs-value 100); rows 1-3 ordinary (1e6, the default)
    endpoints = wait_until_declared(dht, uids)
    torch.manual_seed(0)
    # a ban would outlast the test; each reroute passes over the experts refused so far in the call
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "strict0", dht, k_best=1, reroute_attempts=len(strict) + 1,
                                   ban_config=BanConfig(initial_backoff=60.0))
    with torch.no_grad():
        layer.proj.bias.zero_()  # rows scaled by a positive factor choose the same experts
    x = torch.randn(64, HIDDEN)
    caplog.set_level(logging.WARNING, logger="dmoe.client.failures")
    with torch.no_grad():
        out = layer(1000 * x)  # above the strict server's --max-abs-value: its experts refuse these rows
    refusals = [r.getMessage() for r in caplog.records if "above this server's limit 100" in r.getMessage()]
    assert refusals and all(any(uid in message for uid in strict) for message in refusals)
    assert out.shape == (64, HIDDEN) and torch.isfinite(out).all()  # every refused row found another
    assert layer.stats.experts_dropped == len(refusals)  # still counted as failures
    assert len(layer.bans) == 0
    before = forward_counts(endpoints, uids)
    with torch.no_grad():
        layer(x)
    after = forward_counts(endpoints, uids)
    assert layer.stats.experts_dropped == len(refusals)
    assert sum(after[uid] - before[uid] for uid in strict) > 0  # the strict server's experts serve again

    caplog.clear()
    for _ in range(REFUSALS_TO_BAN):
        with torch.no_grad():
            layer(1000 * x)
    refusing = {uid for uid in strict for r in caplog.records if uid in r.getMessage() and "limit 100" in
                r.getMessage()}
    banned = {uid for uid in strict if layer.bans.is_banned(uid)}
    assert refusing and banned == refusing, (refusing, banned)
    assert any(f"refused {REFUSALS_TO_BAN} forwards in a row that other experts answered: banned" in
               r.getMessage() for r in caplog.records)
    before, dropped = forward_counts(endpoints, uids), layer.stats.experts_dropped
    with torch.no_grad():
        out = layer(1000 * x)
    after = forward_counts(endpoints, uids)
    assert all(after[uid] == before[uid] for uid in banned)  # not asked any more
    assert layer.stats.experts_dropped == dropped and torch.isfinite(out).all()


def test_non_finite_output_gradients_reach_no_server_and_grad_scaler_skips_the_step(swarm, caplog):
    """An AMP overflow (here in one row) must not be sent (servers refuse NaN and Inf, and must not step on them);
    the input gradients are NaN, so that GradScaler skips the step as it would for a local layer, and the next step
    goes on with no expert banned."""
    local_swarm, dht = swarm
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn0", dht, k_best=2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, HIDDEN, requires_grad=True)
    with torch.no_grad():
        expected = layer(x)
    gate = layer.proj.weight.detach().clone()
    overflow = torch.ones(16, 1)
    overflow[3] = float("inf")
    out = layer(x)
    calls = grpc_calls(local_swarm)
    caplog.set_level(logging.WARNING, logger="dmoe.client.moe")
    scaler.scale((out * overflow).sum()).backward()  # no exception
    sent = {key: n - calls.get(key, 0) for key, n in grpc_calls(local_swarm).items() if "backward" in key[1]}
    assert not any(sent.values()), sent
    # every row, where the gate's path alone would leave all but row 3 finite: none of their gradients was sent
    assert torch.isnan(x.grad).all()
    assert "non-finite" in caplog.text and "not sent" in caplog.text and "overflow" in caplog.text
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(layer.proj.weight, gate) and scaler.get_scale() < 65536.0  # the step was skipped
    assert len(layer.bans) == 0 and layer.stats.backward_failures == 0 and layer.stats.nonfinite_backwards == 1
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)  # no server took a step
    x.grad = None
    layer(x).sum().backward()  # the next step is an ordinary one
    assert torch.isfinite(x.grad).all() and layer.stats.experts_dropped == 0 and layer.stats.backward_failures == 0


def test_a_layer_given_the_grad_scaler_sends_its_experts_unscaled_gradients(zoo):
    """Under AMP the loss, and so every gradient reaching the layer, is multiplied by the scaler's scale (65536 at
    first). The caller's optimizer steps only after ``scaler.unscale_``; the experts step at once on what they get,
    so they must get it unscaled: here a server refusing values above 1000 refuses the scaled gradients."""
    dht, _ = zoo  # one server of --max-abs-value 1000, SGD at lr 1e-30
    torch.manual_seed(0)
    # (backward_k_min=1: the refusals below then raise, which is how this test sees them)
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "scaled0", dht, k_best=2, backward_k_min=1)
    x = torch.randn(8, HIDDEN, requires_grad=True)
    layer(x).sum().backward()  # an lr of 1e-30 moves no weight: the same experts answer every backward
    expected, x.grad = x.grad, None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with pytest.raises(RuntimeError, match="fewer than backward_k_min"):
        scaler.scale(layer(x).sum()).backward()  # scaled gradients: every expert refuses them
    assert len(layer.bans) == 0
    x.grad, layer.grad_scaler = None, scaler
    scaler.scale(layer(x).sum()).backward()
    assert layer.stats.backward_failures > 0  # (the refusals above) ...
    failures = layer.stats.backward_failures
    torch.testing.assert_close(x.grad / 2.0 ** 16, expected)  # input gradients scaled, as the scaler expects
    x.grad = None
    scaler.scale(layer(x).sum()).backward()
    assert layer.stats.backward_failures == failures  # ... and none since the layer has the scaler


WIDE = 256  # rows of 1 KiB: each expert's request is a padded (aligned) buffer, each server's call over 64 KiB


@pytest.fixture(scope="module")
def wide_swarm():
    # SGD steps of lr 1e-30 change no float32 weight: every case below compares with the experts' initial weights
    config = SwarmConfig(layers=("ffn0",), grid=GRID, n_servers=2, hidden_dim=WIDE,
                         server_args=("--optimizer", "sgd", "--lr", "1e-30"))
    with LocalSwarm(config) as swarm, DHT(initial_peers=[swarm.initial_peers]) as dht:
        wait_until_declared(dht, UIDS)
        yield swarm, dht


@pytest.mark.parametrize("shared_memory, compression, tolerance", [
    (True, "none", 1e-5), (False, "none", 1e-5), (True, "float16", 1e-2), (False, "uint8", 5e-2)])
def test_each_expert_gets_its_rows_and_gradients_and_its_answers_land_in_their_rows_and_slots(
        wide_swarm, shared_memory, compression, tolerance):
    """Rows are gathered straight into each request (shared memory or gRPC's message, compressed or not) and
    answers scattered into their (row, slot): outputs and input gradients match in-process experts'."""
    from dmoe.wire import ChannelPool
    from dmoe.wire.codec import parse_compression
    _, dht = wide_swarm
    torch.manual_seed(0)
    local = LocalMixtureOfExperts(WIDE, GRID, "ffn0", k_best=4, expert_factory=lambda uid:
                                  create_expert("ffn", WIDE, seed=expert_seed(0, uid)))
    with ChannelPool(shared_memory=shared_memory) as channels:
        # (every expert must answer: a loaded CI machine may take longer than the default 10 s to)
        remote = RemoteMixtureOfExperts(WIDE, GRID, "ffn0", dht, k_best=4, k_min=4, channels=channels,
                                        compression=parse_compression(compression), forward_timeout=60,
                                        backward_timeout=60)
        remote.proj.load_state_dict(local.proj.state_dict())
        x = torch.randn(64, WIDE)
        x_local, x_remote = x.clone().requires_grad_(), x.clone().requires_grad_()
        grad_out = torch.randn(64, WIDE)
        out_local, out_remote = local(x_local), remote(x_remote)
        (out_local * grad_out).sum().backward()
        (out_remote * grad_out).sum().backward()
        assert remote.stats.experts_dropped == 0 and remote.stats.backward_failures == 0
        assert torch.allclose(out_remote, out_local, atol=tolerance, rtol=tolerance)
        assert torch.allclose(x_remote.grad, x_local.grad, atol=tolerance, rtol=tolerance)
        # (the test is about both paths: the payload went through shared memory exactly when asked to)
        assert (channels.segments.idle() > 0) == shared_memory


def test_a_server_slower_than_the_k_min_grace_is_dropped_from_forwards_and_banned_only_when_it_keeps_being_cut(
        zoo, monkeypatch):
    """Review 65: a call cut by timeout_after_k_min banned its whole server as down at once, with a doubling
    backoff, so a server slower than the fastest by more than the grace for a moment was banned at its first late
    answer. Cut by the grace, it is dropped from that forward only; cut in CUTS_TO_BAN forwards in a row, none of
    its experts answering, it is banned as too slow for the layer (else a server that hangs cost every forward the
    whole grace)."""
    from dmoe.client import failures
    from dmoe.client.failures import CUTS_TO_BAN

    dht, servers = zoo  # rows 0-1 ordinary, rows 2-3 slow (1.5 s)
    (slow,) = servers["slow0"]
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "slow0", dht, k_best=4, k_min=1, timeout_after_k_min=0.2,
                                   forward_timeout=20.0, allow_zero_outputs=True)
    with torch.no_grad():  # every row: slow0.1.0, slow0.2.0, slow0.1.1 and slow0.2.1 (two experts on each server)
        layer.proj.weight.zero_()
        layer.proj.bias.copy_(torch.tensor([0, 5, 5, 0, 3, 2, 1, 0.]))

    def forward() -> tuple[int, int]:
        chosen, dropped = layer.stats.experts_chosen, layer.stats.experts_dropped
        with torch.no_grad():
            assert torch.isfinite(layer(torch.randn(8, HIDDEN))).all()
        return layer.stats.experts_chosen - chosen, layer.stats.experts_dropped - dropped

    monkeypatch.setattr(failures, "CUT_MEMORY", 0.0)  # cuts however far apart are no streak ...
    for _ in range(CUTS_TO_BAN):
        assert forward() == (4, 2) and len(layer.bans) == 0
    monkeypatch.setattr(failures, "CUT_MEMORY", 60.0)  # ... those close together are
    layer.policy.cut_streaks.clear()
    for _ in range(CUTS_TO_BAN - 1):
        assert forward() == (4, 2)  # the slow server's experts chosen, and cut by the grace from this forward
        assert len(layer.bans) == 0 and not layer.bans.is_banned("slow0.2.0", slow)
    layer.policy.timeout_after_k_min = None  # a grace that allows it: its answers are used, and its streak ends
    assert forward() == (4, 0) and not layer.policy.cut_streaks
    layer.policy.timeout_after_k_min = 0.2
    for _ in range(CUTS_TO_BAN - 1):
        assert forward() == (4, 2) and len(layer.bans) == 0
    assert forward() == (4, 2)  # cut in CUTS_TO_BAN forwards in a row: banned as too slow for this layer
    assert layer.bans.is_banned("slow0.2.0", slow) and layer.bans.is_banned("slow0.2.1", slow)
    chosen, dropped = forward()  # re-routed: the fast server's experts only, no grace waited for
    assert dropped == 0 and not layer.bans.is_banned("slow0.1.0")


def test_an_expert_answering_finite_but_huge_values_is_dropped_and_banned_and_the_loss_stays_finite(zoo):
    """Review 65: answers of 1e30 passed every check (shape, dtype, NaN/Inf); the next LayerNorm made the loss NaN,
    no expert got a gradient, and nobody was blamed. Above the layer's max_abs_value (by default the servers' own
    --max-abs-value, 1e6), outputs and input gradients are malformed: the expert is dropped and banned."""
    dht, servers = zoo  # rows 0-1 ordinary, row 2 huge, row 3 huge_grad
    huge, huge_grad = servers["huge0"]
    torch.manual_seed(0)
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "huge0", dht, k_best=4, k_min=4, allow_zero_outputs=True,
                                   backward_k_min=0)

    def step(first_coordinate_bias: list[float]) -> torch.Tensor:
        with torch.no_grad():  # every row: huge0.1.0, huge0.{c}.0, huge0.1.1, huge0.{c}.1 for the c biased to 5
            layer.proj.weight.zero_()
            layer.proj.bias.copy_(torch.tensor([*first_coordinate_bias, 3, 2, 1, 0.]))
        x = torch.randn(16, HIDDEN, requires_grad=True)
        loss = torch.nn.functional.layer_norm(x + layer(x), (HIDDEN,)).pow(2).mean()
        loss.backward()
        assert torch.isfinite(loss)
        return x.grad

    grad = step([0, 5, 5, 0])  # huge outputs from huge0.2.*
    assert layer.stats.experts_dropped == 2 and layer.stats.backward_failures == 0
    assert layer.bans.is_banned("huge0.2.0", huge) and layer.bans.is_banned("huge0.2.1", huge)
    assert torch.isfinite(grad).all() and grad.abs().max() < 1e3
    grad = step([0, 5, 0, 5])  # ordinary outputs from huge0.3.*, huge input gradients
    assert layer.stats.experts_dropped == 2  # its forwards were fine ...
    assert layer.stats.backward_failures == 2  # ... its backwards were not
    assert layer.bans.is_banned("huge0.3.0", huge_grad) and layer.bans.is_banned("huge0.3.1", huge_grad)
    assert torch.isfinite(grad).all() and grad.abs().max() < 1e3
    assert not layer.bans.is_banned("huge0.1.0") and not layer.bans.is_banned("huge0.1.1")


def test_rows_beyond_a_servers_max_batch_size_go_as_several_requests_with_the_in_process_layers_results(zoo):
    """Review 65: the layer sent all of an expert's rows in one request; a server whose --max-batch-size is below
    them refused it (RESOURCE_EXHAUSTED) and the healthy expert was dropped and banned, every step. The refusal
    names the limit: the rows are cut into requests the server takes and sent again in the same forward, later
    forwards cut them at once, and each backward goes with its forward's requests (their activation ids)."""
    # SGD steps of lr 1e-30 change no float32 weight: both forwards compare with the experts' initial weights
    dht, servers = zoo  # one server of --max-batch-size 64, SGD at lr 1e-30
    (endpoint,) = servers["batched0"]
    torch.manual_seed(0)
    local = LocalMixtureOfExperts(HIDDEN, GRID, "batched0", k_best=2, expert_factory=lambda uid:
                                  create_expert("ffn", HIDDEN, seed=expert_seed(0, uid)))
    remote = RemoteMixtureOfExperts(HIDDEN, GRID, "batched0", dht, k_best=2, k_min=2, forward_timeout=60,
                                    backward_timeout=60)
    with torch.no_grad():  # every row: batched0.1.0 and batched0.1.1, 200 rows each
        local.proj.weight.mul_(1e-3)
        local.proj.bias.copy_(torch.tensor([0, 50, 0, 0, 30, 20, 0, 0.]))
    remote.proj.load_state_dict(local.proj.state_dict())
    for _ in range(2):  # the first forward learns the limit from the refusal, the second cuts the rows at once
        x = torch.randn(200, HIDDEN)
        x_local, x_remote = x.clone().requires_grad_(), x.clone().requires_grad_()
        grad_out = torch.randn(200, HIDDEN)
        out_local, out_remote = local(x_local), remote(x_remote)
        (out_local * grad_out).sum().backward()
        (out_remote * grad_out).sum().backward()
        assert remote.stats.experts_dropped == 0 and remote.stats.backward_failures == 0
        assert len(remote.bans) == 0 and remote.stats.rows_without_expert == 0
        torch.testing.assert_close(out_remote, out_local, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x_remote.grad, x_local.grad, atol=1e-5, rtol=1e-5)
    assert remote.policy.known_batch_limits() == {endpoint: 64}
    assert remote.stats.experts_chosen == 4  # two experts a forward, however many requests they took
    calls = {uid: expert_info(endpoint, uid, timeout=10) for uid in ("batched0.1.0", "batched0.1.1")}
    # per expert: 1 refused + 4 requests, then 4 requests; a backward for each of the 8 requests answered
    assert all(info["backward_calls"] == 8 for info in calls.values()), calls


def test_backward_k_min_counts_against_the_experts_that_answered_the_rows_forward_if_fewer(zoo):
    """Review 85 (documented, not changed): backward raises for a row with fewer expert gradients than
    backward_k_min, or than the experts that answered its forward where fewer did. A row that k_min let through
    with one answer passes backward_k_min=2 with that expert's gradient; a row two experts answered, one of whose
    gradients is dropped, makes backward raise."""
    dht, _ = zoo  # huge0: rows 0-1 ordinary, row 2 huge outputs, row 3 huge input gradients
    torch.manual_seed(0)
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "huge0", dht, k_best=2, k_min=1, backward_k_min=2)

    def step(first_coordinate_bias: list[float]) -> None:
        with torch.no_grad():  # every row: huge0.1.0 and huge0.{c}.0 for the c biased to 4
            layer.proj.weight.zero_()
            layer.proj.bias.copy_(torch.tensor([*first_coordinate_bias, 3, 0, 0, 0.]))
        x = torch.randn(16, HIDDEN, requires_grad=True)
        layer(x).pow(2).mean().backward()
        assert torch.isfinite(x.grad).all()

    step([0, 5, 4, 0])  # huge0.2.0's answers are dropped: one answer a row forward, and one gradient back
    assert layer.stats.experts_dropped == 1 and layer.stats.backward_failures == 0
    with pytest.raises(RuntimeError, match="16 rows got fewer than backward_k_min=2"):
        step([0, 5, 0, 4])  # two answers a row forward; huge0.3.0's input gradients are dropped
    assert layer.stats.backward_failures == 1


def _batched_layer(dht: DHT) -> RemoteMixtureOfExperts:
    """A layer of the batched0 grid (its server's --max-batch-size is 64) routing every row to batched0.1.0 and
    batched0.1.1."""
    layer = RemoteMixtureOfExperts(HIDDEN, GRID, "batched0", dht, k_best=2, k_min=2, forward_timeout=60)
    with torch.no_grad():
        layer.proj.weight.zero_()
        layer.proj.bias.copy_(torch.tensor([0, 50, 0, 0, 30, 20, 0, 0.]))
    return layer


def _teach(layer: RemoteMixtureOfExperts, endpoint: str, limit: int, rows: int) -> None:
    """The layer learns ``limit`` as the server's max_batch_size, as from its refusal of ``rows`` rows."""
    refusal = Future()
    refusal.set_exception(RemoteExpertError("batched0.1.0", endpoint, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"batch of {rows} rows exceeds this server's max_batch_size {limit}"))
    assert layer.policy.learn_batch_limit("batched0.1.0", endpoint, refusal, rows, time_left=5.0) == limit


def _requests(endpoint: str, forward) -> int:
    """How many forward requests the experts batched0.1.0 and batched0.1.1 answered during ``forward()``."""
    uids = ["batched0.1.0", "batched0.1.1"]
    before = forward_counts([endpoint] * 2, uids)
    forward()
    return sum(forward_counts([endpoint] * 2, uids).values()) - sum(before.values())


def test_a_learnt_max_batch_size_never_cuts_an_experts_rows_into_more_than_max_chunks_requests(zoo):
    """Review 85: MAX_CHUNKS guarded only the forward that learnt a limit. A server that once refused 2 rows
    naming "max_batch_size 1" got a request per row from every later forward (1000 for 1000 rows). Rows that
    would take more than MAX_CHUNKS requests go uncut: here the server, whose limit is 64 now, refuses them naming
    that, and they go as requests of 64."""
    dht, servers = zoo
    (endpoint,) = servers["batched0"]
    layer = _batched_layer(dht)
    _teach(layer, endpoint, limit=1, rows=2)
    rows = MAX_CHUNKS + 1
    with torch.no_grad():
        requests = _requests(endpoint, lambda: layer(torch.randn(rows, HIDDEN)))
    assert requests == 2 * -(-rows // 64), requests  # not 2 * rows
    assert layer.stats.experts_dropped == 0 and len(layer.bans) == 0
    assert layer.policy.known_batch_limits() == {endpoint: 64}


def test_a_learnt_max_batch_size_is_forgotten_after_a_while_so_a_larger_one_is_learnt(zoo, monkeypatch):
    """Review 85: a limit, once learnt, cut every later request to that endpoint, also after its server restarted
    with a larger --max-batch-size. An hour later the rows go uncut again and the server's refusal teaches its limit
    now (64 rows, not the 8 learnt)."""
    dht, servers = zoo
    (endpoint,) = servers["batched0"]
    layer = _batched_layer(dht)
    _teach(layer, endpoint, limit=8, rows=200)
    later = SimpleNamespace(monotonic=lambda: time.monotonic() + 3600.0)
    monkeypatch.setattr(failures, "time", later)  # (the failure policy's clock only)
    with torch.no_grad():
        requests = _requests(endpoint, lambda: layer(torch.randn(200, HIDDEN)))
    assert requests == 2 * 4, requests  # 4 requests of at most 64 rows per expert, not 25 of 8
    assert layer.stats.experts_dropped == 0 and len(layer.bans) == 0
    assert layer.policy.known_batch_limits() == {endpoint: 64}


class _NoInputGradient(torch.nn.Module):
    """An in-process expert whose rows get no gradient through it: what a server dead by the backward gives."""

    def __init__(self, expert: torch.nn.Module):
        super().__init__()
        self.expert = expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(x.detach())


def test_a_server_dying_between_forward_and_backward_costs_its_gradients_only_by_default():
    """Review 65: with the library's default backward_k_min=1, loss.backward() raised for rows whose experts were
    all on the dead server, after the surviving servers' experts had stepped on the batch, and the caller's step
    was lost. The default is 0 now (as dmoe-train has it): the input gradients come from the survivors (and the
    gate) alone."""
    with servers_with_flags(("ffn0.[0:2].[0:4]", []), ("ffn0.[2:4].[0:4]", [])) as (dht, _, servers):
        torch.manual_seed(0)
        dead = {uid for uid in UIDS if uid.split(".")[1] in ("2", "3")}
        local = LocalMixtureOfExperts(HIDDEN, GRID, "ffn0", k_best=2, expert_factory=lambda uid: (
            _NoInputGradient if uid in dead else lambda expert: expert)(create_expert("ffn", HIDDEN,
                                                                                      seed=expert_seed(0, uid))))
        remote = RemoteMixtureOfExperts(HIDDEN, GRID, "ffn0", dht, k_best=2, k_min=2, forward_timeout=60)
        remote.proj.load_state_dict(local.proj.state_dict())
        x = torch.randn(64, HIDDEN)
        x_local, x_remote = x.clone().requires_grad_(), x.clone().requires_grad_()
        grad_out = torch.randn(64, HIDDEN)
        out_local, out_remote = local(x_local), remote(x_remote)
        assert remote.stats.experts_dropped == 0
        servers[1].kill()
        servers[1].popen.wait(30)
        (out_local * grad_out).sum().backward()
        (out_remote * grad_out).sum().backward()  # nothing raises
        assert remote.stats.backward_failures > 0
        assert remote.proj.weight.grad is not None  # the caller's step is not lost
        torch.testing.assert_close(x_remote.grad, x_local.grad, atol=1e-5, rtol=1e-5)
