"""What of the CUDA graphs (dmoe/server/cuda_graphs.py) can be checked without a GPU: the buckets, which training
steps can be captured, and the refusals off a GPU. The graphs themselves are checked against the eager expert on
real hardware in tests/test_cuda.py."""
from __future__ import annotations

import pytest
import torch

from dmoe.experts import create_expert
from dmoe.server.activations import ActivationCache, KeptForward
from dmoe.server.backend import ExpertBackend, make_optimizer
from dmoe.server.cuda_graphs import (MIN_ROWS, ExpertGraphs, bucket_rows, fill_padded, finiteness_flag,
                                     training_step, training_step_support)
from dmoe.server.runtime import Runtime
from dmoe.server.server import ExpertServer, ServerConfig


def test_rows_are_padded_to_the_next_power_of_two_and_at_least_the_smallest_bucket():
    assert [bucket_rows(n) for n in (1, 5, MIN_ROWS, MIN_ROWS + 1, 33, 64, 65, 4096)] == [
        MIN_ROWS, MIN_ROWS, MIN_ROWS, 2 * MIN_ROWS, 64, 64, 128, 4096]


def test_only_fused_adam_without_a_scheduler_has_its_training_step_captured():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert training_step_support(torch.optim.Adam(params, fused=True)) is None
    assert training_step_support(None) is None  # nothing to step: the backward alone
    assert "not fused Adam" in training_step_support(torch.optim.Adam(params))
    assert "not fused Adam" in training_step_support(torch.optim.SGD(params, lr=0.1))
    assert "not fused Adam" in training_step_support(torch.optim.AdamW(params, fused=True))
    adam = torch.optim.Adam(params, fused=True)
    assert "scheduler" in training_step_support(adam, torch.optim.lr_scheduler.StepLR(adam, 1))


def test_graphs_are_refused_off_a_gpu_and_a_parameter_free_expert_stays_eager():
    module = create_expert("ffn", 8, seed=0)
    with pytest.raises(ValueError, match="CUDA device"):
        ExpertGraphs(module, None, [(8,)], [torch.float32], [torch.float32])
    backend = ExpertBackend("e", module, [torch.randn(2, 8)], make_optimizer("adam", module.parameters(), 0.1))
    with pytest.raises(ValueError, match="CUDA device"):
        backend.use_cuda_graphs(64)
    nop = ExpertBackend("n", create_expert("nop", 8, seed=0), [torch.randn(2, 8)])
    nop.use_cuda_graphs(64)
    assert nop.graphs is None
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        ExpertServer.create("a.0", "ffn", 8, config=ServerConfig(device="cpu", cuda_graphs=True))
    with pytest.raises(ValueError, match="cuda_graphs needs one compute worker"):
        ExpertServer.create("a.0", "ffn", 8, config=ServerConfig(device="cpu", cuda_graphs=True, workers=2))


def test_discarding_a_kept_forward_frees_its_bytes_and_counts_no_hit_nor_miss():
    cache = ActivationCache(1 << 20)
    cache.put("e", b"a", KeptForward.inputs_only([torch.zeros(4, 8)]))
    assert cache.nbytes == 128
    cache.discard("e", b"a")
    cache.discard("e", b"never kept")
    assert cache.nbytes == 0 and len(cache) == 0 and cache.hits == cache.misses == 0


def twin_experts(hidden: int = 16):
    """Two equal ffn experts with fused Adam (which takes found_inf), eps large enough that the sign of a gradient
    near zero, which the two paths' sums may flip in its last bit, does not decide a first step."""
    twins = []
    for _ in range(2):
        module = create_expert("ffn", hidden, seed=1)
        twins.append((module, torch.optim.Adam(module.parameters(), lr=0.01, eps=1e-3, fused=True)))
    return twins


def test_the_recorded_training_step_run_eagerly_trains_as_the_eager_backward_does():
    """What a graph records (the forward again, the backward, the finiteness check into found_inf, clipping and
    fused Adam's step) is the eager path's step: it runs on a CPU as well, where no graph can check it."""
    (module, adam), (reference, reference_adam) = twin_experts()
    backend = ExpertBackend("e", reference, [torch.randn(2, 16)], reference_adam, clip_grad_norm=0.5)
    found_inf = finiteness_flag("cpu")
    generator = torch.Generator().manual_seed(0)
    for rows in (3, 8, 5, 8):
        x, grad = torch.randn(rows, 16, generator=generator), torch.randn(rows, 16, generator=generator)
        (mine,) = training_step(module, adam, [x], [grad], found_inf, clip_grad_norm=0.5)
        (theirs,) = backend.backward(x, grad)
        assert found_inf.item() == 0
        torch.testing.assert_close(mine, theirs)
    assert backend.updates == 4
    for (name, a), b in zip(module.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    for p, q in zip(module.parameters(), reference.parameters()):
        assert adam.state[p]["step"].item() == reference_adam.state[q]["step"].item() == 4


def test_a_non_finite_gradient_sets_found_inf_and_leaves_weights_and_adam_state_alone():
    (module, adam), _ = twin_experts()
    found_inf = finiteness_flag("cpu")
    x = torch.randn(4, 16)
    training_step(module, adam, [x], [torch.randn(4, 16)], found_inf)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    state = {name: {k: v.clone() for k, v in adam.state[p].items()} for name, p in module.named_parameters()}
    bad = torch.randn(4, 16)
    bad[1, 2] = float("nan")
    training_step(module, adam, [x], [bad], found_inf)
    assert found_inf.item() == 1
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name
    for name, p in module.named_parameters():
        for key, value in adam.state[p].items():
            assert torch.equal(value, state[name][key]), (name, key)
    training_step(module, adam, [x], [torch.randn(4, 16)], found_inf)  # found_inf is reset by each step
    assert found_inf.item() == 0 and not torch.equal(module.state_dict()["ffn.0.weight"], before["ffn.0.weight"])


def test_padding_rows_with_zero_gradients_changes_neither_the_real_rows_nor_the_step():
    """A graph computes a bucket's rows: the batch, then rows of earlier batches whose output gradients are zero."""
    (padded, padded_adam), (plain, plain_adam) = twin_experts()
    x, grad = torch.randn(5, 16), torch.randn(5, 16)
    stale = torch.randn(11, 16) * 3
    (padded_grads,) = training_step(padded, padded_adam, [torch.cat([x, stale])],
                                    [torch.cat([grad, torch.zeros(11, 16)])], finiteness_flag("cpu"),
                                    clip_grad_norm=1.0)
    (plain_grads,) = training_step(plain, plain_adam, [x], [grad], finiteness_flag("cpu"), clip_grad_norm=1.0)
    torch.testing.assert_close(padded_grads[:5], plain_grads)
    for (name, a), b in zip(padded.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_padding_repeats_the_batch_s_first_row_and_gradients_pad_with_zeros():
    buffer = torch.full((8, 3), 7.0)
    rows = torch.arange(9.0).reshape(3, 3)
    fill_padded(buffer, rows)
    assert torch.equal(buffer[:3], rows) and torch.equal(buffer[3:], rows[:1].expand(5, 3))
    fill_padded(buffer, rows[:2] + 1, zeros=True)
    assert torch.equal(buffer[:2], rows[:2] + 1) and not buffer[2:].any()
    fill_padded(buffer, torch.ones(8, 3))  # a full bucket: nothing to pad
    assert torch.equal(buffer, torch.ones(8, 3))


def test_a_row_that_overflows_in_the_expert_spoils_its_own_batch_and_not_the_next_ones_in_its_bucket():
    """Review 45: with earlier batches' rows left in the padding, a finite row that overflows inside the expert
    made every later, smaller batch of its bucket skip its step (0 * inf in the padding's backward)."""
    (module, adam), _ = twin_experts()
    inputs, grads, found_inf = torch.zeros(16, 16), torch.zeros(16, 16), finiteness_flag("cpu")
    bad = torch.randn(16, 16)
    bad[15, 3] = 1e30  # finite, and accepted by a server with --max-abs-value 0; its squares overflow in LayerNorm
    fill_padded(inputs, bad)
    fill_padded(grads, torch.randn(16, 16), zeros=True)
    training_step(module, adam, [inputs], [grads], found_inf)
    assert found_inf.item() == 1  # as eagerly: this batch's step is skipped
    for _ in range(3):
        fill_padded(inputs, torch.randn(8, 16))
        fill_padded(grads, torch.randn(8, 16), zeros=True)
        training_step(module, adam, [inputs], [grads], found_inf)
        assert found_inf.item() == 0


class _FailingLaps:
    def lap(self, stage: str) -> None:
        if stage == "compute":
            raise RuntimeError("the device failed while we waited for it")


class _FailingClock:
    def laps(self, device) -> _FailingLaps:
        return _FailingLaps()


def test_an_error_while_timing_a_computed_batch_does_not_run_the_batch_again():
    """Review 45: the profile's wait for the device sat outside the guard that keeps a computed batch (a backward
    whose optimizer step is applied) from running again, task by task."""
    calls = []

    def process(x: torch.Tensor) -> list[torch.Tensor]:
        calls.append(len(x))
        return [x * 2]

    with Runtime(workers=1, stages=_FailingClock()) as runtime:
        pool = runtime.create_pool("e.backward", process, max_batch_size=8)
        with runtime.paused():
            futures = [runtime.submit(pool, torch.ones(2, 3)), runtime.submit(pool, torch.ones(1, 3))]
        for future in futures:
            with pytest.raises(RuntimeError, match="the device failed"):
                future.result(10)
    assert calls == [3]  # once, as one batch: not again for each task
