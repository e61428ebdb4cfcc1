"""How the runner groups decodes of similar context length (no model needed)."""

from __future__ import annotations

from serving.engine.model_runner import _group_sizes


def test_groups_cover_every_decode_in_order():
    contexts = list(range(64, 768, 11))
    sizes = _group_sizes(contexts)
    assert sum(sizes) == len(contexts)
    start = 0
    for size in sizes[:-1]:
        group = contexts[start:start + size]
        assert size >= 8  # fewer would cost more attention calls than the padding saves
        if size > 8:  # grown past the minimum only while padding stayed within bounds
            assert sum(group) >= 0.75 * size * max(group)
        start += size


def test_uniform_and_tiny_batches_stay_one_group():
    assert _group_sizes([100] * 32) == [32]
    assert _group_sizes([5, 900]) == [2]  # too few to be worth a second attention call
    assert _group_sizes([]) == []


def test_two_clusters_split():
    assert _group_sizes([64] * 10 + [700] * 10) == [10, 10]
