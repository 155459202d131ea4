"""Expert uids, prefixes and patterns: what names a place on a grid and what does not."""
from __future__ import annotations

import pytest

from dmoe import LocalMixtureOfExperts
from dmoe.uid import MAX_PATTERN_UIDS, UIDError, expand_pattern, grid_uids, is_valid_prefix, is_valid_uid, split_uid


@pytest.mark.parametrize("uid", ["ffn0.3", "ffn0.0.17", "a_b-c.999999999"])
def test_valid_uids(uid):
    assert is_valid_uid(uid) and is_valid_prefix(uid)


@pytest.mark.parametrize("uid", ["ffn0", "ffn0.3\n", "ffn0.03", "ffn0.1234567890", "ffn0.٣", "ffn0.-1", "0ffn.1",
                                 " ffn0.1", "ffn0.1.", "ffn0..1"])
def test_invalid_uids(uid):
    """A trailing newline passed (``$`` matches before one): a server held ``ffn0.3\\n`` and declared ``ffn0.3``."""
    assert not is_valid_uid(uid)
    with pytest.raises(UIDError):
        split_uid(uid)


@pytest.mark.parametrize("prefix", ["ffn0\n", "ffn0.3\n", "ffn0.٣", ""])
def test_invalid_prefixes_and_layer_names(prefix):
    assert not is_valid_prefix(prefix)
    with pytest.raises(ValueError):
        grid_uids(prefix, (2,))


def test_a_layer_name_with_a_newline_is_refused_when_the_layer_is_built():
    """It was accepted, and every forward then failed with UIDError."""
    with pytest.raises(ValueError):
        LocalMixtureOfExperts(4, (2,), "ffn0\n", k_best=1)


@pytest.mark.parametrize("pattern, words", [
    ("ffn0.1234567890", "coordinate 1234567890 of axis 0 is above 999999999"),
    ("ffn0.[0:1000000000]", f"names more than {MAX_PATTERN_UIDS} experts"),  # refused before it is expanded
    ("ffn0.[0:2048].[0:1024]", f"names more than {MAX_PATTERN_UIDS} experts"),
    ("ffn0.٣", "is not N, [A:B] or *"),
    ("ffn0.[3:3]", "empty range"),
])
def test_patterns_that_name_no_valid_uids_or_too_many_are_refused(pattern, words):
    with pytest.raises(UIDError, match=words.replace("[", r"\[").replace("]", r"\]")):
        expand_pattern(pattern)


def test_patterns_expand_in_order_without_duplicates():
    assert expand_pattern("ffn0.[0:2].*, ffn0.1.2, x.7", grid=(2, 3)) == [
        "ffn0.0.0", "ffn0.0.1", "ffn0.0.2", "ffn0.1.0", "ffn0.1.1", "ffn0.1.2", "x.7"]
    assert all(is_valid_uid(uid) for uid in expand_pattern("ffn0.[999999998:1000000000]"))

