"""Expert modules as the registry builds them."""
from __future__ import annotations

import torch

from dmoe.experts import create_expert


def test_a_seeded_expert_is_reproducible_and_leaves_every_generator_as_it_was(monkeypatch):
    """torch.manual_seed seeds the CUDA devices too (lazily, without a GPU as well), and fork_rng(devices=[])
    restores only the CPU generator: every seeded build left a GPU process's CUDA randomness (dropout) at that
    expert's seed instead of the process's own."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: seeded.append(seed))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = create_expert("ffn", 8, seed=5)
    assert torch.equal(torch.rand(3), expected)  # the CPU generator is where it was
    second = create_expert("ffn", 8, seed=5)
    torch.testing.assert_close(first.state_dict(), second.state_dict())
    assert seeded == [123, 123]  # the test's own seeds only
