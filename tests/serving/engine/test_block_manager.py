"""BlockManager: the block pool, reference counts and the prefix cache."""

from __future__ import annotations

import pytest

from serving.engine import block_manager as block_manager_module
from serving.engine.block_manager import BlockManager
from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import Sequence


def make_seq(seq_id: int, token_ids: list[int], cache_salt: str = "") -> Sequence:
    return Sequence(seq_id, list(token_ids), len(token_ids), SamplingParams(), cache_salt=cache_salt)


def compute_all(manager: BlockManager, seq: Sequence) -> None:
    """What a step that computes every remaining token does to the block manager."""
    manager.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.commit(seq)


def cached_tokens_for(manager: BlockManager, token_ids: list[int], cache_salt: str = "") -> int:
    """Look ``token_ids`` up in the prefix cache without keeping the blocks."""
    probe = make_seq(999, token_ids, cache_salt)
    num_hit_tokens = manager.allocate_cached_prefix(probe)
    manager.free(probe)
    return num_hit_tokens


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4), (4, 1.5), (True, 4), ("8", 4)])
def test_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be a positive integer"):
        BlockManager(num_blocks, block_size)


def test_allocate_and_free_return_the_pool():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(1, list(range(10)))
    assert manager.blocks_needed(seq, 10) == 3
    manager.allocate(seq, 10)
    assert len(seq.block_table) == 3
    assert manager.num_used_blocks == 3
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(3 / 8)
    assert [manager.ref_count(b) for b in seq.block_table] == [1, 1, 1]
    seq.num_computed_tokens = 10
    assert manager.blocks_needed(seq, 2) == 0  # slots 10 and 11 are in the third block
    assert manager.blocks_needed(seq, 3) == 1
    manager.free(seq)
    assert seq.block_table == []
    assert manager.num_used_blocks == 0
    assert manager.num_free_blocks == 8


def test_allocate_raises_when_the_pool_is_short():
    manager = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(1, list(range(9)))
    assert not manager.can_allocate(seq, 9)
    with pytest.raises(RuntimeError, match="needs 3 blocks, 2 free"):
        manager.allocate(seq, 9)
    assert manager.can_allocate(seq, 8)


def test_fits_pool():
    manager = BlockManager(num_blocks=4, block_size=4)
    assert manager.fits_pool(16)
    assert not manager.fits_pool(17)


def test_prefix_hit_reuses_full_blocks_and_counts_tokens():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(1, list(range(10)))
    assert manager.allocate_cached_prefix(first) == 0
    compute_all(manager, first)
    assert len(first.block_hashes) == 2  # the third block holds 2 tokens: not cached
    second = make_seq(2, [*range(10), 50, 51])
    assert manager.allocate_cached_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert second.block_hashes == first.block_hashes
    assert second.num_computed_tokens == second.num_cached_tokens == 8
    assert [manager.ref_count(b) for b in second.block_table] == [2, 2]
    assert manager.num_prefix_query_tokens == 10 + 12
    assert manager.num_prefix_hit_tokens == 8


def test_never_reuses_all_tokens():
    manager = BlockManager(num_blocks=16, block_size=4)
    compute_all(manager, make_seq(1, list(range(8))))
    same = make_seq(2, list(range(8)))
    # Both blocks are cached, but the last token must go through the model to sample.
    assert manager.allocate_cached_prefix(same) == 4
    assert same.num_uncomputed_tokens == 4
    assert cached_tokens_for(manager, list(range(9))) == 8


def test_hits_are_chained_to_the_whole_prefix():
    manager = BlockManager(num_blocks=16, block_size=4)
    compute_all(manager, make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block after a different first block: its keys and values differ.
    assert cached_tokens_for(manager, [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert cached_tokens_for(manager, [1, 2, 3, 4, 5, 6, 7, 0, 9]) == 4


def test_salts_never_share():
    manager = BlockManager(num_blocks=16, block_size=4)
    compute_all(manager, make_seq(1, list(range(9)), cache_salt="tenant-a"))
    assert cached_tokens_for(manager, list(range(9)), cache_salt="tenant-b") == 0
    assert cached_tokens_for(manager, list(range(9))) == 0
    assert cached_tokens_for(manager, list(range(9)), cache_salt="tenant-a") == 8


def test_hash_collisions_are_verified(monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent_hash, token_ids: 42)
    manager = BlockManager(num_blocks=16, block_size=4)
    owner = make_seq(1, [1, 2, 3, 4, 1, 2, 3, 4, 9])
    compute_all(manager, owner)
    assert manager.num_cached_blocks == 1  # block 1 collided with block 0: kept private
    assert cached_tokens_for(manager, [9, 9, 9, 9, 9]) == 0  # same hash, other tokens
    # Block 1's hash maps to block 0: same tokens, but another parent (prefix).
    probe = make_seq(2, [1, 2, 3, 4, 1, 2, 3, 4, 9])
    assert manager.allocate_cached_prefix(probe) == 4
    assert probe.block_table == owner.block_table[:1]


def test_sharing_blocks_and_freeing_one_owner():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(1, list(range(13)))
    compute_all(manager, first)
    second = make_seq(2, list(range(13)))
    assert manager.allocate_cached_prefix(second) == 12
    compute_all(manager, second)
    shared = first.block_table[:3]
    assert second.block_table[:3] == shared
    assert second.block_table[3] != first.block_table[3]
    assert manager.num_used_blocks == 5
    manager.free(first)
    assert [manager.ref_count(b) for b in second.block_table] == [1, 1, 1, 1]
    assert manager.num_used_blocks == 4
    manager.free(second)
    assert manager.num_used_blocks == 0
    assert manager.num_cached_blocks == 3


def test_commit_registers_only_full_computed_blocks():
    manager = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(1, list(range(10)))
    manager.allocate(seq, 10)
    seq.num_computed_tokens = 6  # a prefill chunk: blocks 0 full, block 1 half computed
    manager.commit(seq)
    assert len(seq.block_hashes) == 1
    assert manager.num_cached_blocks == 1
    seq.num_computed_tokens = 10
    manager.commit(seq)
    assert len(seq.block_hashes) == 2
    manager.commit(seq)  # idempotent
    assert len(seq.block_hashes) == 2
    assert manager.num_cached_blocks == 2


def test_commit_keeps_the_first_copy_of_a_block_computed_twice():
    manager = BlockManager(num_blocks=16, block_size=4)
    # Both admitted before either committed: each computes its own copy.
    first, second = make_seq(1, list(range(9))), make_seq(2, list(range(9)))
    manager.allocate(first, 9)
    manager.allocate(second, 9)
    first.num_computed_tokens = second.num_computed_tokens = 9
    manager.commit(first)
    manager.commit(second)
    assert second.block_hashes == first.block_hashes
    assert manager.num_cached_blocks == 2
    first_block_ids = list(first.block_table)
    manager.free(first)
    manager.free(second)
    assert manager.num_used_blocks == 0
    assert manager.num_free_blocks == 16
    third = make_seq(3, list(range(9)))
    assert manager.allocate_cached_prefix(third) == 8
    assert third.block_table == first_block_ids[:2]  # the first copy, not the second


def test_free_blocks_are_reused_before_cached_ones():
    manager = BlockManager(num_blocks=4, block_size=2)
    cached = make_seq(1, [1, 2, 3, 4])
    compute_all(manager, cached)
    manager.free(cached)
    other = make_seq(2, [7, 8, 9, 10])
    manager.allocate(other, 4)
    assert manager.num_cached_blocks == 2
    assert cached_tokens_for(manager, [1, 2, 3, 4, 5]) == 4


def test_eviction_is_least_recently_freed_first_tail_before_head():
    manager = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq(1, [1, 2, 3, 4]), make_seq(2, [5, 6, 7, 8])
    compute_all(manager, a)
    compute_all(manager, b)
    manager.free(a)
    manager.free(b)  # evictable, oldest first: a's tail, a's head, b's tail, b's head
    filler = make_seq(3, [0, 0])
    manager.allocate(filler, 1)
    assert cached_tokens_for(manager, [1, 2, 3, 4, 0]) == 2
    # That look-up freed a's head again: now the most recently freed.
    manager.allocate(filler, 3)
    assert cached_tokens_for(manager, [5, 6, 7, 8, 0]) == 2
    assert cached_tokens_for(manager, [1, 2, 3, 4, 0]) == 2
    manager.allocate(filler, 5)
    assert cached_tokens_for(manager, [5, 6, 7, 8, 0]) == 0
    assert manager.num_cached_blocks == 1
    manager.free(filler)
    assert manager.num_used_blocks == 0


def test_retry_lookups_are_not_counted_twice():
    manager = BlockManager(num_blocks=8, block_size=4)
    compute_all(manager, make_seq(1, list(range(9))))
    seq = make_seq(2, list(range(9)))
    manager.allocate_cached_prefix(seq)
    manager.free(seq)
    manager.allocate_cached_prefix(seq, is_retry=True)
    assert (manager.num_prefix_query_tokens, manager.num_prefix_hit_tokens) == (9, 8)


def test_allocate_cached_prefix_needs_an_empty_block_table():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(1, list(range(9)))
    manager.allocate(seq, 9)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        manager.allocate_cached_prefix(seq)


def test_prefix_caching_off():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = make_seq(1, list(range(9)))
    compute_all(manager, first)
    assert first.block_hashes == []
    manager.free(first)
    second = make_seq(2, list(range(9)))
    assert manager.allocate_cached_prefix(second) == 0
    assert second.block_table == []
    assert manager.num_cached_blocks == 0
    assert manager.num_prefix_query_tokens == 0
    assert manager.num_free_blocks == 8
