"""Gating maths of the DMoE layer: structured scores, renormalisation over survivors, gradients into the gate."""
import logging
import time

import numpy as np
import pytest
import torch
from torch import nn

from dmoe.client.gating import LocalMixtureOfExperts, NoAliveExpertsError
from dmoe.client.moe import RemoteMixtureOfExperts, _bits, _from_bits, _zeros


class Scale(nn.Module):
    """A deterministic expert: multiplies by a per-expert constant (easy to reason about)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(float(factor)))

    def forward(self, x):
        return x * self.factor


def make_layer(dead=(), **kwargs):
    factors = iter(range(1, 100))
    layer = LocalMixtureOfExperts(4, (3, 2), "ffn0", expert_factory=lambda uid: Scale(next(factors)), **kwargs)
    if dead:
        # a layer whose listed experts never answer, as if their servers were gone
        run = layer._run_experts

        def run_with_dead(flat, chosen, *laps):
            out, alive = run(flat, chosen, *laps)
            for row, uids in enumerate(chosen):
                for slot, uid in enumerate(uids):
                    if uid in dead:
                        alive[row, slot] = False
            return out, alive

        layer._run_experts = run_with_dead
    return layer.double()


def reference(layer, x, dead=(), switch=False):
    """Brute force: an expert's score is the sum of its coordinates' scores; the top-k alive are mixed with a
    softmax over themselves, or (``switch``) each with its softmax probability over all six experts."""
    scores = layer.proj(x)
    s0, s1 = scores[:, :3], scores[:, 3:]
    out = []
    for row in range(len(x)):
        total = {f"ffn0.{i}.{j}": s0[row, i] + s1[row, j] for i in range(3) for j in range(2)}
        top = sorted(total, key=lambda uid: -float(total[uid].detach()))[: layer.k_best]
        top = [uid for uid in top if uid not in dead]
        if switch:
            probs = dict(zip(total, torch.softmax(torch.stack(list(total.values())), 0)))
            weights = [probs[uid] for uid in top]
        else:
            weights = torch.softmax(torch.stack([total[uid] for uid in top]), 0)
        out.append(sum(w * layer.experts[uid.replace(".", "_")](x[row]) for w, uid in zip(weights, top)))
    return torch.stack(out)


def test_expert_score_is_sum_of_coordinate_scores_and_top_k_are_mixed():
    torch.manual_seed(0)
    layer = make_layer(k_best=3)
    x = torch.randn(5, 4, dtype=torch.double)
    assert torch.allclose(layer(x), reference(layer, x))


def test_dead_expert_is_dropped_and_weights_renormalised():
    torch.manual_seed(1)
    dead = {"ffn0.0.0", "ffn0.1.1", "ffn0.2.0"}
    layer = make_layer(k_best=4, dead=dead)
    x = torch.randn(7, 4, dtype=torch.double)
    assert torch.allclose(layer(x), reference(layer, x, dead))


def test_gate_gradients_match_finite_differences():
    torch.manual_seed(2)
    layer = make_layer(k_best=3, dead={"ffn0.2.1"})
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    # top-k selection is piecewise constant; gradcheck's tiny steps stay inside one piece
    # the gate's weight is passed as an input so that gradcheck perturbs it (the layer uses the same tensor)
    assert torch.autograd.gradcheck(lambda inp, weight: layer(inp), (x, layer.proj.weight))
    layer(x).sum().backward()
    assert layer.proj.weight.grad is not None and layer.proj.weight.grad.abs().sum() > 0


def test_row_without_answers_raises_by_default_and_gives_zeros_when_allowed():
    everything = {f"ffn0.{i}.{j}" for i in range(3) for j in range(2)}
    x = torch.randn(2, 4, dtype=torch.double, requires_grad=True)
    with pytest.raises(NoAliveExpertsError, match="no answer"):
        make_layer(k_best=2, dead=everything)(x)
    layer = make_layer(k_best=2, dead=everything, allow_zero_outputs=True)
    out = layer(x)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.proj.weight.grad).all()


def test_sequence_inputs_are_routed_per_token():
    torch.manual_seed(3)
    layer = make_layer(k_best=2)
    x = torch.randn(2, 5, 4, dtype=torch.double)
    assert torch.allclose(layer(x), reference(layer, x.reshape(10, 4)).reshape(2, 5, 4))


@pytest.mark.parametrize("k_best, dead", [(1, ()), (2, ("ffn0.1.0", "ffn0.2.1"))])
def test_switch_weights_are_router_probabilities_over_the_whole_grid_not_renormalised(k_best, dead):
    torch.manual_seed(4)
    layer = make_layer(k_best=k_best, dead=set(dead), switch=True)
    x = torch.randn(9, 4, dtype=torch.double)
    assert torch.allclose(layer(x), reference(layer, x, dead, switch=True))


def test_switch_top1_gate_gradients_match_finite_differences():
    torch.manual_seed(5)
    layer = make_layer(k_best=1, switch=True)
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda inp, weight: layer(inp), (x, layer.proj.weight))
    assert torch.autograd.gradcheck(lambda inp, weight: (layer(inp), layer.balance_loss)[1], (x, layer.proj.weight))


def test_balance_loss_is_switch_formula_per_dimension_and_one_for_a_uniform_router():
    torch.manual_seed(6)
    layer = make_layer(k_best=2, switch=True)
    x = torch.randn(8, 4, dtype=torch.double)
    layer(x)
    scores = layer.proj(x)
    chosen = layer._choose([s.detach() for s in scores.split((3, 2), dim=-1)])
    expected = []
    for dim, (size, part) in enumerate(zip((3, 2), scores.split((3, 2), dim=-1))):
        coords = [int(uid.split(".")[1 + dim]) for row in chosen for uid in row]
        share = torch.tensor([coords.count(c) / len(coords) for c in range(size)], dtype=torch.double)
        expected.append(size * (share * torch.softmax(part, -1).mean(0)).sum())
    assert torch.allclose(layer.balance_loss, torch.stack(expected).mean())
    with torch.no_grad():
        layer.proj.weight.zero_(), layer.proj.bias.zero_()
    layer(x)  # a uniform router: P = 1/size whatever the shares, so each dimension's term is exactly 1
    assert torch.allclose(layer.balance_loss, torch.tensor(1.0, dtype=torch.double))


def test_the_balance_loss_under_autocast_counts_every_token_and_local_experts_may_answer_in_its_dtype():
    """Tokens were counted per coordinate in the scores' dtype: under bfloat16 autocast the count stopped at 256,
    and the loss of 4096 tokens was 0.125 where float32 gave 1.01; and a local expert ending in a Linear answered in
    bfloat16, which the layer refused to scatter into its float32 buffer (review 104)."""
    torch.manual_seed(8)
    layer = LocalMixtureOfExperts(4, (3, 2), "ffn0", k_best=1, switch=True, expert_factory=lambda uid: nn.Linear(4, 4))
    x = torch.randn(4096, 4)
    layer(x)
    exact = layer.balance_loss.item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.shape == x.shape
    assert layer.balance_loss.item() == pytest.approx(exact, rel=0.05)


def test_minimising_the_balance_loss_spreads_tokens_over_the_grid():
    torch.manual_seed(7)
    layer = make_layer(k_best=1, switch=True)
    with torch.no_grad():
        layer.proj.bias.copy_(torch.tensor([4.0, 0, 0, 4.0, 0]))  # nearly every token to expert ffn0.0.0
    x = torch.randn(64, 4, dtype=torch.double)
    optimizer = torch.optim.SGD(layer.proj.parameters(), lr=0.5)
    losses = []
    for _ in range(60):
        layer(x)
        losses.append(float(layer.balance_loss.detach()))
        optimizer.zero_grad()
        layer.balance_loss.backward()
        optimizer.step()
    used = {uid for row in layer._choose([s.detach() for s in layer.proj(x).split((3, 2), dim=-1)]) for uid in row}
    assert losses[0] > 1.8 and losses[-1] < 1.2, losses
    assert len(used) >= 4, used


@pytest.mark.parametrize("grid", [(3, 2), (6,)])
@pytest.mark.parametrize("switch", [False, True])
def test_an_empty_batch_gives_an_empty_output_and_a_zero_balance_loss(grid, switch):
    """A batch of 0 rows (e.g. a data loader's empty remainder) flows through forward and backward."""
    layer = LocalMixtureOfExperts(4, grid, "ffn0", k_best=2, switch=switch).double()
    x = torch.zeros(0, 4, dtype=torch.double, requires_grad=True)
    out = layer(x)
    assert out.shape == (0, 4)
    loss = out.sum() + (layer.balance_loss if switch else 0)
    if switch:
        assert float(layer.balance_loss.detach()) == 0.0
    loss.backward()
    assert x.grad.shape == (0, 4)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_remote_layers_row_copies_move_every_float_dtype_bit_for_bit(dtype):
    """Requests and answers are sliced and scattered as raw bits with numpy, which has no bfloat16."""
    x = torch.randn(5, 3).to(dtype)
    rows = np.array([4, 0, 2])
    assert torch.equal(_from_bits(_bits(x)[rows], dtype), x[rows])
    out = _zeros((5, 2, 3), dtype)
    assert out.dtype == dtype and torch.equal(out, torch.zeros(5, 2, 3, dtype=dtype))
    _bits(out)[rows, np.array([1, 0, 1])] = _bits(x[rows])
    assert torch.equal(out[4, 1], x[4]) and torch.equal(out[0, 0], x[0]) and torch.equal(out[2, 1], x[2])
    assert int((out != 0).any(-1).sum()) == 3  # nothing else was written


def test_the_in_process_layer_charges_its_experts_compute_to_wait_when_given_a_stage_clock():
    from dmoe.client.gating import CLIENT_STAGES
    from dmoe.timing import StageClock

    class Slow(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.05)
            return x

    layer = LocalMixtureOfExperts(4, (2, 2), "ffn0", k_best=2, expert_factory=lambda uid: Slow())
    layer.stage_clock = StageClock(CLIENT_STAGES)
    layer(torch.randn(3, 4))
    seconds = {stage: total for stage, (total, _) in layer.stage_clock.snapshot().items()}
    assert seconds["wait"] >= 0.05 * 2  # at least two experts were called, one after the other
    assert seconds["reroute"] < 0.05 and seconds["combine"] < 0.05


def test_one_expert_per_row_without_switch_gives_the_gate_no_gradient_and_says_so(caplog):
    """Renormalised over one expert, a row's weight is always 1: the gate never learns (switch=True is the way)."""
    with caplog.at_level(logging.WARNING, logger="dmoe.client.gating"):
        layer = LocalMixtureOfExperts(8, (4, 4), "ffn", k_best=1)
    assert "k_best=1 without switch=True" in caplog.text
    layer(torch.randn(6, 8)).pow(2).sum().backward()
    assert layer.proj.weight.grad.abs().max() == 0  # what the warning is about
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dmoe.client.gating"):
        switched = LocalMixtureOfExperts(8, (4, 4), "ffn", k_best=1, switch=True)
    switched(torch.randn(6, 8)).pow(2).sum().backward()
    assert switched.proj.weight.grad.abs().max() > 0 and not caplog.text


@pytest.mark.parametrize("kwargs, words", [
    (dict(in_features=0), "in_features"),
    (dict(grid=(0, 4)), "grid"),
    (dict(grid=()), "grid"),
    (dict(layer="a.b"), "layer name"),
    (dict(k_best=17), "k_best must be between 1 and the 16"),
    (dict(k_min=0), "k_min"),
    (dict(k_min=5), "k_min"),
    (dict(backward_k_min=5), "backward_k_min"),
    (dict(forward_timeout=0), "forward_timeout must be > 0"),
    (dict(backward_timeout=-1.0), "backward_timeout must be > 0"),
    (dict(timeout_after_k_min=-1.0), "timeout_after_k_min must be >= 0"),
    (dict(reroute_attempts=-1), "reroute_attempts"),
    (dict(compression="bogus"), "unknown compression"),
    (dict(dht=None), "dht is required"),
])
def test_the_remote_layer_refuses_nonsensical_arguments_at_construction(kwargs, words):
    args = dict(in_features=16, grid=(4, 4), layer="ffn0", dht=object(), k_best=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=words):
        RemoteMixtureOfExperts(args.pop("in_features"), args.pop("grid"), args.pop("layer"), args.pop("dht"), **args)


def test_the_local_layer_refuses_a_grid_or_layer_it_could_not_route():
    for grid, layer in (((0, 4), "ffn0"), ((4, 4), "a.b")):
        with pytest.raises(ValueError):
            LocalMixtureOfExperts(16, grid, layer, k_best=2)
