"""What of the CUDA graphs (dmoe/server/cuda_graphs.py) can be checked without a GPU: the buckets, which training
steps can be captured, and the refusals off a GPU. The graphs themselves are checked against the eager expert on
real hardware in tests/test_cuda.py."""
from __future__ import annotations

import pytest
import torch

from dmoe.experts import create_expert
from dmoe.server.activations import ActivationCache, KeptForward
from dmoe.server.backend import ExpertBackend, make_optimizer
from dmoe.server.cuda_graphs import MIN_ROWS, ExpertGraphs, bucket_rows, training_step_support
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


def test_discarding_a_kept_forward_frees_its_bytes_and_counts_no_hit_nor_miss():
    cache = ActivationCache(1 << 20)
    cache.put("e", b"a", KeptForward.inputs_only([torch.zeros(4, 8)]))
    assert cache.nbytes == 128
    cache.discard("e", b"a")
    cache.discard("e", b"never kept")
    assert cache.nbytes == 0 and len(cache) == 0 and cache.hits == cache.misses == 0
