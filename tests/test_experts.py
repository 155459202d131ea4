"""Expert modules as the registry builds them."""
from __future__ import annotations

import importlib

import pytest
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


def test_arguments_an_expert_class_refuses_raise_one_error_that_names_them():
    """Programs report it as a bad --expert-kwargs; any other failure while a server is built is not that flag's."""
    from dmoe.experts import ExpertBuildError

    for kwargs in ({"expansion": -1}, {"dropout": 2.0}, {"no_such_argument": 1}):
        with pytest.raises(ExpertBuildError, match="expert class 'ffn' with hidden_dim=8") as error:
            create_expert("ffn", 8, **kwargs)
        assert error.value.__cause__ is not None
    assert isinstance(ExpertBuildError("x"), ValueError)


def test_unseeded_experts_draw_from_the_process_generator_and_differ():
    first, second = create_expert("ffn", 8), create_expert("ffn", 8)
    assert not torch.equal(first.state_dict()["ffn.0.weight"], second.state_dict()["ffn.0.weight"])


@pytest.mark.parametrize("cls, rows, answer", [("one_row", 2, [1, 8]), ("two_rows", 3, [2, 8])])
def test_an_expert_class_whose_output_does_not_keep_the_batch_is_refused_when_built_naming_it(cls, rows, answer):
    """Review 100 D9: it was announced, and every call of it failed on the callers' side of the swarm."""
    from dmoe.experts import ExpertBuildError
    from dmoe.server import ExpertServer, ServerConfig
    importlib.import_module("tests.custom_experts")  # registers both

    with pytest.raises(ExpertBuildError) as error:
        ExpertServer.create("x.0", cls, 8, config=ServerConfig(device="cpu"))
    assert f"expert class {cls!r} answers a batch of {rows} rows with output 0 of shape {answer}" in str(error.value)
