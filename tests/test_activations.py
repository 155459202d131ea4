"""Activations kept between a forward and its backward: the cache's bounds, that a kept graph gives exactly what
recomputing gives, and the whole path through a real server process and the DMoE layer."""
from __future__ import annotations

import copy
import gc
import importlib
import re
import time
import weakref

import pytest
import torch

from dmoe.client import RemoteExpert, RemoteExpertError, backward_future, forward_future
from dmoe.client.moe import RemoteMixtureOfExperts
from dmoe.client.remote_expert import _call
from dmoe.dht import DHT
from dmoe.directory import get_experts
from dmoe.experts import create_expert, expert_class
from dmoe.launch import LocalSwarm, SwarmConfig
from dmoe.server import ExpertBackend
from dmoe.server.backend import make_optimizer
from dmoe.server.activations import ENTRY_OVERHEAD_BYTES, MIN_ENTRIES, ActivationCache, KeptForward
from dmoe.uid import grid_uids
from tests.procs import running
from tests.test_endpoints import needs_ipv6
from tests.test_metrics import scrape, scrape_once, value

HIDDEN = 8


def kept(nbytes: int, versions=(0,), age: float = 0.0) -> KeptForward:
    return KeptForward((torch.zeros(1),), (torch.zeros(1),), versions, nbytes, created=time.monotonic() - age)


# ---- the cache's bookkeeping ----------------------------------------------------------------------------------

def test_the_cache_holds_at_most_one_entry_per_kib_of_its_budget():
    """Review 48: a forward of one small row costs ~0.9 KB of objects beyond its bytes; with no bound on entries a
    32 MiB budget of h=16 forwards made the server grow by 465 MiB."""
    cache = ActivationCache(max_bytes=1 << 20)
    assert cache.max_entries == (1 << 20) // ENTRY_OVERHEAD_BYTES
    for i in range(cache.max_entries + 500):
        assert cache.put("e.0", i.to_bytes(4, "big"), KeptForward.inputs_only([torch.zeros(1)]))
    assert len(cache) == cache.max_entries and cache.evicted == 500
    assert cache.inputs("e.0", (499).to_bytes(4, "big")) is None  # the oldest went first
    assert ActivationCache(max_bytes=100).max_entries == MIN_ENTRIES


def test_graphs_made_stale_by_a_step_are_found_through_their_expert_s_index_whatever_left_before():
    cache = ActivationCache(max_bytes=1000)
    for aid in (b"a", b"b", b"c", b"d"):
        cache.put("e.0", aid, kept(10))
    cache.put("e.1", b"a", kept(10))
    cache.put("e.0", b"i", KeptForward.inputs_only([torch.zeros(1)]))
    assert cache.take("e.0", b"a", (0,), [torch.zeros(1)]) is not None
    cache.discard("e.0", b"b")
    cache.put("e.0", b"c", KeptForward.inputs_only([torch.zeros(1)]))  # replaced by one without a graph
    cache.drop_graphs("e.0")
    assert cache.invalidated == 1  # only d: a was taken, b discarded, c replaced, i never had a graph
    assert cache.take("e.0", b"d", (0,), [torch.zeros(1)]) is None  # its inputs only, now
    assert cache.take("e.1", b"a", (0,), [torch.zeros(1)]) is not None  # another expert's graph stays
    cache.drop_graphs("e.0")
    assert cache.invalidated == 1

def test_a_kept_forward_is_taken_once_and_only_with_the_same_parameter_versions():
    cache = ActivationCache(max_bytes=1000)
    assert cache.put("e.0", b"a", kept(10, versions=(1, 2)))
    assert cache.put("e.0", b"b", kept(10, versions=(1, 2)))
    assert cache.put("e.0", b"c", kept(10, versions=(1, 2)))
    same = [torch.zeros(1)]
    assert cache.take("e.0", b"a", (1, 2), same) is not None
    assert cache.take("e.0", b"a", (1, 2), same) is None               # consumed
    assert cache.take("e.1", b"b", (1, 2), same) is None               # another expert's id space
    assert cache.take("e.0", b"b", (1, 3), same) is None               # the weights changed since: stale
    assert cache.take("e.0", b"c", (1, 2), [torch.ones(1)]) is None    # not the inputs it was computed from
    assert (cache.hits, cache.misses, cache.invalidated, len(cache), cache.nbytes) == (1, 4, 1, 0, 0)


def test_the_byte_budget_evicts_the_oldest_and_refuses_what_can_never_fit():
    cache = ActivationCache(max_bytes=100)
    for activation_id in (b"1", b"2", b"3"):
        assert cache.put("e.0", activation_id, kept(40))
    assert cache.nbytes == 80 and cache.evicted == 1
    assert cache.take("e.0", b"1", (0,), [torch.zeros(1)]) is None
    assert cache.take("e.0", b"3", (0,), [torch.zeros(1)]) is not None
    assert not cache.put("e.0", b"big", kept(101))
    assert cache.nbytes == 40
    assert cache.usage() == {"cpu": (40, 80)}  # held now, and the most held at once (room was made before)


def test_a_machine_keeping_forwards_it_never_takes_back_evicts_its_own_not_another_machines():
    """A client that floods the cache (forwards with ids, no backward) made every other client's backward resend its
    inputs and recompute: the oldest entries went first, whoever kept them."""
    cache = ActivationCache(max_bytes=10_000)
    assert cache.put("e.0", ("honest", b"h1"), kept(1000)) and cache.put("e.1", ("honest", b"h2"), kept(1000))
    for i in range(50):
        assert cache.put("e.0", ("flood", b"%d" % i), kept(1000))
    assert cache.inputs("e.0", ("honest", b"h1")) is not None and cache.inputs("e.1", ("honest", b"h2")) is not None
    assert cache.inputs("e.0", ("flood", b"0")) is None and cache.inputs("e.0", ("flood", b"49")) is not None
    assert cache.nbytes <= cache.max_bytes and cache.evicted == 42  # 10 entries of 1000 bytes fit
    # the lighter machine grows at the heavier's expense until they weigh alike, then evicts its own oldest
    for i in range(10):
        assert cache.put("e.0", ("honest", b"n%d" % i), kept(1000))
    weights = cache.machines()
    assert weights["honest"] == weights["flood"] == 5 * (1000 + ENTRY_OVERHEAD_BYTES), weights
    assert cache.inputs("e.0", ("honest", b"h1")) is None  # its own oldest went
    # by entries too (a flood of small forwards), and an id means the same to one machine only
    small = ActivationCache(max_bytes=100 * ENTRY_OVERHEAD_BYTES)
    small.put("e.0", ("a", b"x"), kept(1))
    for i in range(3 * small.max_entries):
        small.put("e.0", ("b", b"%d" % i), kept(1))
    assert small.inputs("e.0", ("a", b"x")) is not None and small.inputs("e.0", ("b", b"x")) is None
    assert len(small) == small.max_entries and len(small._heaviest) <= 2 * len(small.machines()) + 65
    # what each machine weighs is forgotten with its last entry, whichever way it left
    assert small.take("e.0", ("a", b"x"), (0,), [torch.zeros(1)]) is not None
    small.drop_graphs("e.0")
    assert set(small.machines()) == {"b"}
    small.clear()
    assert small.machines() == {} and cache.release() and cache.machines() == {}


def test_bytes_are_counted_per_device_with_each_devices_peak():
    """A GPU server's kept forwards are in GPU memory: counted apart from any in host memory ("meta" stands in for
    the GPU here), each with the most it held, and all of them against the one budget."""
    cache = ActivationCache(max_bytes=100)
    on_device = KeptForward((torch.zeros(1, device="meta"),), None, (), 30)
    assert cache.put("e.0", b"a", on_device) and cache.put("e.0", b"b", kept(20))
    assert cache.put("e.1", b"c", KeptForward((torch.zeros(1, device="meta"),), None, (), 50))
    assert cache.usage() == {"meta": (80, 80), "cpu": (20, 20)} and cache.nbytes == 100
    assert cache.put("e.0", b"d", kept(10))  # evicts the oldest, on the other device
    assert cache.usage() == {"meta": (50, 80), "cpu": (30, 30)} and cache.evicted == 1
    cache.drop_graphs("e.0")  # its graphs go, their 4-byte inputs stay
    assert cache.usage() == {"meta": (50, 80), "cpu": (8, 30)}
    cache.clear()
    assert cache.usage() == {"meta": (0, 80), "cpu": (0, 30)} and cache.nbytes == 0


def test_forwards_older_than_the_ttl_are_dropped():
    cache = ActivationCache(max_bytes=100, ttl=10)
    cache.put("e.0", b"old", kept(10, age=11))
    cache.put("e.0", b"new", kept(10))
    assert len(cache) == 1 and cache.evicted == 1
    assert cache.take("e.0", b"new", (0,), [torch.zeros(1)]) is not None


def test_an_optimizer_step_drops_only_that_experts_graphs_and_keeps_their_inputs():
    cache = ActivationCache(max_bytes=100)
    cache.put("e.0", b"a", kept(10))
    cache.put("e.1", b"b", kept(10))
    cache.drop_graphs("e.0")
    assert (len(cache), cache.nbytes, cache.invalidated) == (2, 10 + 4, 1)  # e.0 now holds its 4-byte input
    assert cache.usage() == {"cpu": (14, 20)}
    assert cache.inputs("e.0", b"a") is not None and cache.inputs("e.0", b"zzz") is None
    assert cache.take("e.0", b"a", (0,), [torch.zeros(1)]) is None  # no graph left: recompute


# ---- a backend with a cache gives exactly what recomputing gives ------------------------------------------------

def twin_backends(name: str = "ffn", **kwargs) -> tuple[ExpertBackend, ExpertBackend, ActivationCache]:
    """Two backends with the same weights and Adam state: one keeps activations, one always recomputes."""
    cache = ActivationCache(max_bytes=1 << 30)

    def build(activations):
        module = create_expert(name, HIDDEN, seed=0, **kwargs)
        return ExpertBackend("e.0", module, expert_class(name).sample(2, HIDDEN),
                             torch.optim.Adam(module.parameters(), lr=0.01), activations=activations)

    return build(cache), build(None), cache


def assert_same_weights(a: ExpertBackend, b: ExpertBackend) -> None:
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("name,kwargs", [("ffn", {}), ("transformer", {"num_heads": 2})])
def test_backward_from_a_kept_forward_equals_recomputing_bit_for_bit(name, kwargs):
    cached, plain, cache = twin_backends(name, **kwargs)
    for step in range(3):
        x = torch.randn(4, *cached.inputs_schema[0].shape)
        y_cached = cached.forward(x, segments=[(b"k%d" % step, 4)])
        torch.testing.assert_close(y_cached, plain.forward(x), rtol=0, atol=0)
        grad = torch.randn_like(y_cached[0])
        torch.testing.assert_close(cached.backward(x, grad, segments=[(b"k%d" % step, 4)]), plain.backward(x, grad),
                                   rtol=0, atol=0)
        assert_same_weights(cached, plain)
    assert (cache.hits, cache.misses, len(cache)) == (3, 0, 0)


def test_a_backward_batch_mixing_kept_and_unkept_requests_steps_once_like_recomputing():
    cached, plain, cache = twin_backends()
    x, grad = torch.randn(9, HIDDEN), torch.randn(9, HIDDEN)
    cached.forward(x[:2], segments=[(b"a", 2)])
    cached.forward(x[5:], segments=[(b"c", 4)])
    segments = [(b"a", 2), (b"never-kept", 3), (b"c", 4)]
    torch.testing.assert_close(cached.backward(x, grad, segments=segments), plain.backward(x, grad),
                               rtol=1e-5, atol=1e-6)  # one batch vs pieces: float sums associate differently
    for p, q in zip(cached.module.parameters(), plain.module.parameters()):  # (seen 2e-7 apart on 1 of 72)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert (cache.hits, cache.misses) == (2, 1)


def test_a_step_between_forward_and_backward_or_other_inputs_fall_back_to_recomputing():
    cached, plain, cache = twin_backends()
    x, grad, other = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    cached.forward(x, segments=[(b"first", 3)])
    cached.forward(x, segments=[(b"second", 3)])
    cached.forward(x, segments=[(b"third", 3)])
    # the step of this backward makes the two other kept graphs stale (they saved the old weights)
    torch.testing.assert_close(cached.backward(x, grad, segments=[(b"first", 3)]), plain.backward(x, grad))
    torch.testing.assert_close(cached.backward(x, grad, segments=[(b"second", 3)]), plain.backward(x, grad))
    assert cache.invalidated == 2 and len(cache) == 1  # the third's inputs stay held, its graph is gone
    cached.forward(x, segments=[(b"fourth", 3)])
    torch.testing.assert_close(cached.backward(other, grad, segments=[(b"fourth", 3)]), plain.backward(other, grad))
    assert_same_weights(cached, plain)
    assert (cache.hits, cache.misses) == (1, 2)


def fused_backend(cache: ActivationCache, scale: float = 1.0) -> ExpertBackend:
    """An ffn "e.0" with the server's optimizer (fused Adam: its steps bump no ``Tensor._version``), its weights
    times ``scale`` loaded as a restore or a replica's ``load_into`` loads them."""
    module = create_expert("ffn", HIDDEN, seed=0)
    backend = ExpertBackend("e.0", module, expert_class("ffn").sample(2, HIDDEN),
                            make_optimizer("adam", list(module.parameters()), 0.01), activations=cache)
    state = backend.state_dict()
    state["module"] = {key: value * scale for key, value in state["module"].items()}
    backend.load_state_dict(state)
    return backend


def input_grad(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """What recomputing gives: ``x``'s gradient through ``module`` as it is now (a copy: its .grad untouched)."""
    x = x.clone().requires_grad_()
    copy.deepcopy(module)(x).backward(grad)
    return x.grad


def test_another_backend_of_the_same_uid_never_backwards_through_a_graph_kept_by_the_first():
    """Review 84: a kept graph was told valid by its parameters' ``_version``, which fused optimizers never bump;
    two backends of one uid, each loaded once, have equal versions whatever their weights. A uid removed from a
    server and served again (replicas' adoption) then ran its backward through the old module's graph: the answer
    was the old weights' input gradient, and the new expert's step had no gradient."""
    cache = ActivationCache(max_bytes=1 << 30)
    old, new = fused_backend(cache), fused_backend(cache, scale=0.5)
    x, grad = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    old.forward(x, segments=[(b"a", 4)])
    want = input_grad(new.module, x, grad)
    before = [p.detach().clone() for p in new.module.parameters()]
    torch.testing.assert_close(new.backward(x, grad, segments=[(b"a", 4)])[0], want)
    assert (cache.hits, cache.misses, cache.invalidated) == (0, 1, 1)
    assert all(not torch.equal(p, q) for p, q in zip(new.module.parameters(), before))  # its own gradient stepped


def test_a_fused_optimizer_step_that_fails_makes_the_kept_graphs_stale(monkeypatch, caplog):
    """Review 84: ``_step`` dropped the kept graphs only when the failed step had bumped a ``_version``, which a
    fused step never does: a step that moved the weights and then raised left graphs of the old weights in use."""
    cache = ActivationCache(max_bytes=1 << 30)
    backend = fused_backend(cache)
    x, grad = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    backend.forward(x, segments=[(b"kept", 4)])
    step = backend.optimizer.step

    def step_then_fail(*args, **kwargs):
        step(*args, **kwargs)  # the weights moved, then something failed (out of memory, say)
        raise RuntimeError("failed after the update")

    monkeypatch.setattr(backend.optimizer, "step", step_then_fail)
    with pytest.raises(RuntimeError, match="failed after the update"):
        backend.backward(torch.randn(2, HIDDEN), torch.randn(2, HIDDEN))
    monkeypatch.setattr(backend.optimizer, "step", step)
    want = input_grad(backend.module, x, grad)
    torch.testing.assert_close(backend.backward(x, grad, segments=[(b"kept", 4)])[0], want)
    assert (cache.hits, cache.misses, cache.invalidated) == (0, 1, 1)
    assert "the optimizer step failed" in caplog.text


def test_a_shared_batch_holds_only_inputs_and_a_graphs_size_excludes_the_weights():
    cached, _, cache = twin_backends()
    cached.forward(torch.randn(4, HIDDEN))
    assert len(cache) == 0
    x = torch.randn(4, HIDDEN)
    cached.forward(x, segments=[(b"a", 1), (None, 1), (b"b", 2)])  # three requests in one batch: no graphs
    torch.testing.assert_close(cache.inputs("e.0", b"b")[0], x[2:])
    assert len(cache) == 2 and cache.nbytes == 3 * HIDDEN * 4
    cache.clear()
    cached.forward(torch.randn(2, HIDDEN), segments=[(b"two", 2)])
    two = cache.nbytes
    cached.forward(torch.randn(4, HIDDEN), segments=[(b"four", 4)])
    assert two > 0 and cache.nbytes - two == 2 * two  # saved activations grow with rows: no weights counted
    disabled = ActivationCache(max_bytes=0)
    cached.activations = disabled
    cached.forward(torch.randn(2, HIDDEN), segments=[(b"x", 2)])
    assert len(disabled) == 0


def test_inputs_kept_from_a_shared_batch_pin_exactly_the_bytes_the_cache_counts():
    cached, _, cache = twin_backends()
    x = torch.randn(6, HIDDEN)
    cached.forward(x, segments=[(b"a", 1), (None, 2), (b"b", 3)])
    held = [cache.inputs("e.0", aid)[0] for aid in (b"a", b"b")]
    torch.testing.assert_close(held, [x[:1], x[3:]])
    assert [t.untyped_storage().nbytes() for t in held] == [1 * HIDDEN * 4, 3 * HIDDEN * 4]
    assert cache.nbytes == 4 * HIDDEN * 4
    alone = torch.randn(2, HIDDEN)
    cached.forward(alone, segments=[(b"alone", 2)])  # a request alone in its batch is kept as it came: no copy
    assert cache.inputs("e.0", b"alone")[0].data_ptr() == alone.data_ptr()


def held_storages(kept: KeptForward, params) -> dict[int, int]:
    """data pointer -> bytes of every storage a kept forward holds: its inputs, its outputs and what its graph saved
    (found by walking the graph), less the parameters'."""
    found = list(kept.inputs) + list(kept.outputs or ())
    nodes, seen = [y.grad_fn for y in kept.outputs or () if y.grad_fn is not None], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += [value for name in dir(node) if name.startswith("_saved_")
                  and isinstance(value := getattr(node, name), torch.Tensor)]
        nodes += [next_node for next_node, _ in node.next_functions]
    weights = {p.untyped_storage().data_ptr() for p in params}
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found
            if t.untyped_storage().data_ptr() not in weights}


@pytest.mark.parametrize("name", ["up8", "ffn", "nop"])
def test_a_kept_graph_counts_its_outputs_once_and_the_cache_stays_within_its_budget(name):
    """Review 66: a kept graph's outputs were left out of its size, so an up-projection expert (outputs 8x its
    inputs, autograd saving only the inputs) kept 5.6x the budget. The size is now the distinct storages held (an
    output that is the input itself, as ``nop``'s, counts once)."""
    importlib.import_module("tests.custom_experts")  # registers "up8"

    hidden, rows = 64, 256
    module = create_expert(name, hidden, seed=0)
    params = list(module.parameters())
    cache = ActivationCache(max_bytes=2 * 2**20)
    backend = ExpertBackend("e.0", module, expert_class(name).sample(2, hidden),
                            torch.optim.SGD(params, lr=0.1) if params else None, activations=cache)
    for i in range(20):
        backend.forward(torch.randn(rows, hidden), segments=[(bytes([i]), rows)])
    assert len(cache) >= 1
    held = {}
    for entry in cache._entries.values():
        assert entry.outputs is not None
        storages = held_storages(entry, params)
        assert entry.nbytes == sum(storages.values()), name
        held.update(storages)
    assert cache.nbytes == sum(held.values()) <= cache.max_bytes
    if name == "up8":  # the input and the output: nothing else is saved
        assert len(cache) == cache.max_bytes // (rows * hidden * 4 * 9)
    if name == "nop":
        assert cache.nbytes == len(cache) * rows * hidden * 4


# ---- through a real server process ---------------------------------------------------------------------------

def test_server_process_uses_kept_activations_gives_the_same_training_and_refuses_long_ids():
    args = ("-m", "dmoe.cli.server", "--experts", "e.[0:2]", "--hidden-dim", str(HIDDEN), "--metrics-port", "0")
    with running(*args) as keeping, running(*args, "--activation-cache-mb", "0") as recomputing:
        metrics = keeping.wait_for(r"dmoe-server metrics on (\S+:\d+)").group(1)
        experts = [RemoteExpert("e.0", proc.endpoint(), timeout=30) for proc in (keeping, recomputing)]
        torch.manual_seed(0)
        for _ in range(3):
            x = torch.randn(5, HIDDEN, requires_grad=True)
            outputs, grads = [], []
            for expert in experts:
                x.grad = None
                y = expert(x)
                y.pow(2).sum().backward()
                outputs.append(y)
                grads.append(x.grad)
            torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
            torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
        with torch.no_grad():  # inference: no backward will come, so nothing is kept
            experts[0](torch.randn(5, HIDDEN))
        endpoint = experts[0].endpoint
        with pytest.raises(RemoteExpertError, match="activation_id has 65 bytes"):
            forward_future(endpoint, "e.0", [torch.randn(2, HIDDEN)], activation_id=b"x" * 65).result(30)
        # the gradients alone, for an id the server never saw: refused, so the client sends the inputs too
        x, grad = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
        with pytest.raises(RemoteExpertError, match="FAILED_PRECONDITION.*holds no inputs for this activation_id"):
            _call("backward", endpoint, "e.1", [grad], timeout=30, compression=0, channels=None, unary_limit=2**20,
                  activation_id=b"unknown").result(30)
        backward_future(endpoint, "e.1", [x], [grad], activation_id=b"unknown").result(30)  # retried with inputs
        forward_future(endpoint, "e.1", [x], activation_id=b"two rows").result(30)
        with pytest.raises(RemoteExpertError, match="grad_output 0 has 3 rows, but the forward with this "):
            _call("backward", endpoint, "e.1", [torch.randn(3, HIDDEN)], timeout=30, compression=0, channels=None,
                  unary_limit=2**20, activation_id=b"two rows").result(30)
        with pytest.raises(RemoteExpertError, match=r"INVALID_ARGUMENT: grad_output 0: expected shape \[\*, 8\]"):
            _call("backward", endpoint, "e.1", [torch.randn(2, 3)], timeout=30, compression=0, channels=None,
                  unary_limit=2**20, activation_id=b"two rows").result(30)
        backward_future(endpoint, "e.1", [x], [grad], activation_id=b"two rows").result(30)
        samples = scrape(metrics)
    assert value(samples, "dmoe_activation_cache_total", result="hit") == 4
    assert value(samples, "dmoe_activation_cache_total", result="miss") == 1
    # everything kept was taken by its backward: nothing held now, but some was (in host memory, on a CPU server)
    assert value(samples, "dmoe_activation_cache_bytes", device="cpu") == 0
    assert value(samples, "dmoe_activation_cache_peak_bytes", device="cpu") >= 2 * 5 * HIDDEN * 4


def test_a_uid_removed_and_served_again_drops_its_kept_forwards_and_frees_the_old_weights():
    """Review 84: remove_expert left the uid's kept forwards in the server's cache, holding the removed module's
    weights (device memory on a GPU) until the TTL, and a backend later served under that uid (an adoption) ran
    the backward of a forward kept before through the old module: a wrong answer, and no gradient for its step."""
    from dmoe.server import ExpertServer, ServerConfig

    with ExpertServer.create("e.0", "ffn", HIDDEN, config=ServerConfig(device="cpu", workers=1)) as server:
        x, grad = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
        forward_future(server.endpoint, "e.0", [x], activation_id=b"k" * 16).result(30)  # alone: its graph kept
        assert len(server.activations) == 1
        removed = weakref.ref(next(server.remove_expert("e.0").module.parameters()))
        assert len(server.activations) == 0
        deadline = time.monotonic() + 30  # (a worker may still hold the last batch's backend a moment)
        while gc.collect() is not None and removed() is not None:
            assert time.monotonic() < deadline, "the removed expert's weights are still referenced"
            time.sleep(0.05)
        backend = server.backend_factory("e.0")
        state = backend.state_dict()  # served again from a replica: other weights, loaded
        state["module"] = {key: value * 0.5 for key, value in state["module"].items()}
        backend.load_state_dict(state)
        server.add_expert("e.0", backend, announce=False)
        want = input_grad(backend.module, x, grad)
        with pytest.raises(RemoteExpertError, match="FAILED_PRECONDITION.*holds no inputs for this activation_id"):
            _call("backward", server.endpoint, "e.0", [grad], timeout=30, compression=0, channels=None,
                  unary_limit=2**20, activation_id=b"k" * 16).result(30)
        before = [p.detach().clone() for p in backend.module.parameters()]
        answer = backward_future(server.endpoint, "e.0", [x], [grad], activation_id=b"k" * 16).result(30)[0]
        torch.testing.assert_close(answer, want)
        assert server.activations.hits == 0 and backend.updates == 1
        assert all(not torch.equal(p, q) for p, q in zip(backend.module.parameters(), before))


def test_a_forward_queued_before_its_expert_was_removed_keeps_nothing_of_the_removed_expert():
    """Review 95 D3: remove_expert forgot the uid's kept forwards at once, but a forward with an activation id queued
    before it ran after it and kept its graph: the removed expert's weights stayed alive, uncounted, until the TTL."""
    from dmoe.server import ExpertServer, ServerConfig

    with ExpertServer.create("e.[0:2]", "ffn", HIDDEN, config=ServerConfig(device="cpu", workers=1)) as server:
        with server.runtime.paused():
            queued = forward_future(server.endpoint, "e.1", [torch.randn(4, HIDDEN)], activation_id=b"k" * 16)
            deadline = time.monotonic() + 30
            while not len(server.servicer.experts["e.1"].forward_pool):
                assert time.monotonic() < deadline, "the forward was never queued"
                time.sleep(0.01)
            removed = weakref.ref(next(server.remove_expert("e.1").module.parameters()))
        assert queued.result(30)[0].shape == (4, HIDDEN)  # queued before the removal: it still runs
        assert len(server.activations) == 0
        deadline = time.monotonic() + 30  # (a worker may still hold the last batch's backend a moment)
        while gc.collect() is not None and removed() is not None:
            assert time.monotonic() < deadline, "the removed expert's weights are still referenced"
            time.sleep(0.05)


def test_a_forward_running_as_its_expert_is_removed_keeps_nothing():
    """Review 95 D3: the same when the removal comes while the forward computes, after it looked at its cache."""
    cached, _, cache = twin_backends()
    compute = cached.module.forward

    def removed_meanwhile(*inputs):  # what remove_expert does, from another thread, while the batch runs
        cached.activations = None
        cache.forget(cached.name)
        return compute(*inputs)

    cached.module.forward = removed_meanwhile
    cached.forward(torch.randn(4, HIDDEN), segments=[(b"k", 4)])  # (alone: it keeps its graph)
    assert len(cache) == 0 and cache.nbytes == 0


@needs_ipv6  # (without it, one host cannot be two machines)
def test_a_client_flooding_a_servers_cache_leaves_another_machines_kept_forward_in_place():
    """Over IPv4 and IPv6 loopback one host is two machines to the server: the flood over one must not make the
    other's backward send its inputs again (it did: the oldest kept forward went first, whoever kept it)."""
    with running("-m", "dmoe.cli.server", "--experts", "e.0", "--hidden-dim", str(HIDDEN), "--host", "::",
                 "--activation-cache-mb", "1") as server:
        port = server.endpoint().rsplit(":", 1)[1]
        honest, flood = f"127.0.0.1:{port}", f"[::1]:{port}"
        x, grad = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
        forward_future(honest, "e.0", [x], activation_id=b"honest").result(30)
        for i in range(12):  # each keeps 1024 rows' inputs, outputs and saved activations: 12 of them fill 1 MiB
            forward_future(flood, "e.0", [torch.randn(1024, HIDDEN)], activation_id=b"flood%d" % i).result(30)
        # an id names a kept forward for its own machine only
        with pytest.raises(RemoteExpertError, match="FAILED_PRECONDITION.*holds no inputs for this activation_id"):
            _call("backward", flood, "e.0", [grad], timeout=30, compression=0, channels=None, unary_limit=2**20,
                  activation_id=b"honest").result(30)
        # the gradients alone: answered from the inputs the server kept since the honest client's forward
        _call("backward", honest, "e.0", [grad], timeout=30, compression=0, channels=None, unary_limit=2**20,
              activation_id=b"honest").result(30)


def test_out_of_device_memory_drops_the_kept_activations_answers_resource_exhausted_and_the_server_serves_on():
    """The server's experts on a stand-in for a small GPU (tests/custom_experts.py: more than 64 rows raise
    torch.OutOfMemoryError, as CUDA does): what it kept is given up first, the call that cannot fit even then gets a
    clear status, and everything else goes on."""
    with running("-m", "dmoe.cli.server", "--experts", "s.0", "--expert-cls", "small_device", "--custom-module",
                 "tests/custom_experts.py", "--hidden-dim", str(HIDDEN), "--metrics-port", "0") as proc:
        metrics = proc.wait_for(r"dmoe-server metrics on (\S+:\d+)").group(1)
        endpoint = proc.endpoint()
        x, grad = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
        kept = forward_future(endpoint, "s.0", [x], activation_id=b"kept").result(30)[0]
        assert value(scrape(metrics), "dmoe_activation_cache_bytes", device="cpu") >= x.nbytes
        with pytest.raises(RemoteExpertError, match="RESOURCE_EXHAUSTED: forward of s.0: the server's device ran "
                                                    "out of memory .*100 rows do not fit"):
            forward_future(endpoint, "s.0", [torch.randn(100, HIDDEN)]).result(30)
        proc.wait_for(r"s.0.forward ran out of memory on cpu with 100 rows: freed 0.000488 MiB of kept activations, "
                      r"running it again")
        samples = scrape_once(metrics, "dmoe_requests_total", 1, expert="s.0", method="forward",
                              code="RESOURCE_EXHAUSTED")
        torch.testing.assert_close(forward_future(endpoint, "s.0", [x]).result(30)[0], kept, rtol=0, atol=0)
        # the inputs kept for the backward went too: its gradients alone are refused, and sent with them it works
        with pytest.raises(RemoteExpertError, match="FAILED_PRECONDITION.*holds no inputs for this activation_id"):
            _call("backward", endpoint, "s.0", [grad], timeout=30, compression=0, channels=None, unary_limit=2**20,
                  activation_id=b"kept").result(30)
        backward_future(endpoint, "s.0", [x], [grad], activation_id=b"kept").result(30)
    assert value(samples, "dmoe_activation_cache_total", result="released") == 1
    assert value(samples, "dmoe_activation_cache_bytes", device="cpu") == 0
    assert value(samples, "dmoe_requests_total", expert="s.0", method="forward", code="RESOURCE_EXHAUSTED") == 1
    assert value(samples, "dmoe_batch_errors_total", expert="s.0", method="forward") == 2  # run, and run again


def test_an_idle_server_expires_its_kept_forwards_and_stops_sweeping_on_close():
    """Review 66: the cache expired entries only when a forward or backward came, so the forwards kept by trainers
    that went away stayed held (on a GPU, device memory) until the next request: forever on a quiet server."""
    from dmoe.server import ExpertServer, ServerConfig

    ttl = 0.5
    config = ServerConfig(device="cpu", activation_cache_mb=16, activation_ttl=ttl, workers=1)
    with ExpertServer.create("e.[0:2]", "ffn", HIDDEN, config=config) as server:
        for i in range(6):
            forward_future(server.endpoint, f"e.{i % 2}", [torch.randn(4, HIDDEN)],
                           activation_id=bytes([i]) * 16).result(30)
        last = time.monotonic()
        cache = server.activations
        assert len(cache) == 6 and cache.nbytes > 0  # nothing expired yet
        time.sleep(max(0.0, last + 2 * ttl - time.monotonic()))  # silence: no request calls put or take
        assert len(cache) == 0 and cache.nbytes == 0 and cache.usage() == {"cpu": (0, cache.peak["cpu"])}
        assert cache.evicted == 6 and server._sweep is not None
    assert server._sweep is None


@pytest.mark.parametrize("error", ["allocator", "memory"])
def test_a_cpu_allocation_failure_frees_the_kept_activations_and_answers_resource_exhausted(error):
    """Review 66: a CPU reports a failed allocation as a plain RuntimeError ("DefaultCPUAllocator: can't allocate
    memory"), or Python as MemoryError, never as torch.OutOfMemoryError: a CPU server out of memory kept its
    activations and answered INTERNAL. Now the runtime frees them and runs the batch again, and a request that does
    not fit even then gets RESOURCE_EXHAUSTED ("send fewer rows")."""
    from dmoe.server import ExpertServer, ServerConfig

    importlib.import_module("tests.custom_experts")  # registers "small_cpu"
    config = ServerConfig(device="cpu", workers=1, activation_cache_mb=16)
    with ExpertServer.create("c.0", "small_cpu", HIDDEN, config=config) as server:
        module, cache = server.backends["c.0"].module, server.activations
        module.error = error
        x = torch.randn(8, HIDDEN)
        kept = forward_future(server.endpoint, "c.0", [x], activation_id=b"k" * 16).result(30)[0]
        assert len(cache) == 1
        module.failures = 1  # the next call fails once: it fits once the kept activations are freed
        torch.testing.assert_close(forward_future(server.endpoint, "c.0", [x]).result(30)[0], kept, rtol=0, atol=0)
        assert server.runtime.out_of_memory == 1 and cache.released == 1 and len(cache) == 0 and cache.nbytes == 0
        with pytest.raises(RemoteExpertError, match="RESOURCE_EXHAUSTED: forward of c.0: the server's device ran "
                                                    "out of memory"):
            forward_future(server.endpoint, "c.0", [torch.randn(100, HIDDEN)]).result(30)
        assert server.runtime.out_of_memory == 2
        torch.testing.assert_close(forward_future(server.endpoint, "c.0", [x]).result(30)[0], kept, rtol=0, atol=0)


def test_the_dmoe_layer_backward_uses_the_activations_its_forward_kept():
    grid = (2, 2)
    config = SwarmConfig(layers=("ffn0",), grid=grid, n_servers=1, hidden_dim=HIDDEN,
                         server_args=("--metrics-port", "0", "--refresh-period", "1"))
    with LocalSwarm(config) as swarm, DHT(initial_peers=[swarm.initial_peers]) as dht:
        output = "".join(swarm.servers[0].output)
        metrics = re.search(r"dmoe-server metrics on (\S+:\d+)", output).group(1)
        deadline = time.monotonic() + 60
        while not all(get_experts(dht, grid_uids("ffn0", grid))):
            assert time.monotonic() < deadline, "experts were not declared in 60 s"
            time.sleep(0.1)
        layer = RemoteMixtureOfExperts(HIDDEN, grid, "ffn0", dht, k_best=2, k_min=2)
        for _ in range(2):
            layer(torch.randn(16, HIDDEN)).sum().backward()
        samples = scrape(metrics)
    assert layer.stats.experts_dropped == 0 and layer.stats.backward_failures == 0
    assert value(samples, "dmoe_activation_cache_total", result="hit") == layer.stats.backward_calls > 0
    assert value(samples, "dmoe_activation_cache_total", result="miss") == 0
