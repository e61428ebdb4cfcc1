"""KV-cache blocks: a fixed pool with reference counts and a hash-based prefix cache.

Plain Python (no torch): the model runner owns the tensors, this class only
decides which block ids a sequence's tokens live in. A block is ``block_size``
token slots; a sequence's ``block_table`` lists its blocks in token order.

Prefix cache: once every token of a full block has been computed, the block is
registered under a hash chained to its parent block's hash, so a hit on block i
implies the whole prefix up to i matched. The chain starts from the sequence's
``cache_salt``, so tenants with different salts never share blocks. Freed
blocks that are registered stay cached (and can be hit again) until the pool
needs them; they are evicted least recently freed first.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from serving.engine.sequence import Sequence


def root_hash(cache_salt: str) -> int:
    """The parent hash of a sequence's first block; differs per salt (tenant)."""
    return hash(("inferline", cache_salt))


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: its tokens chained to its parent's hash."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    """Set while the prefix cache maps ``hash`` to this block; None otherwise."""
    parent_hash: int = 0
    token_ids: tuple[int, ...] = ()
    """Kept with the hash so a hit is verified, not trusted (hash collisions)."""


class BlockManager:
    """Hands out KV-cache block ids to sequences and keeps the prefix cache.

    Every block is in exactly one state: in use (``ref_count > 0``, possibly
    shared by sequences with a common cached prefix), free and never hashed, or
    free and cached (evictable, in least-recently-freed order).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(block_id) for block_id in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))
        """Free blocks holding nothing the cache knows: reused before cached ones."""
        self._cached_free_ids: OrderedDict[int, None] = OrderedDict()
        """Free blocks still registered in the prefix cache, least recently freed first."""
        self._hash_to_block_id: dict[int, int] = {}
        self.num_prefix_query_tokens = 0
        """Tokens of sequences looked up in the prefix cache (monotonic)."""
        self.num_prefix_hit_tokens = 0
        """Of those, tokens served from the cache (monotonic)."""

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: never-hashed plus evictable cached ones."""
        return len(self._free_ids) + len(self._cached_free_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self._num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or not."""
        return len(self._hash_to_block_id)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self._num_blocks

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold ``block_id`` (for metrics and invariant checks)."""
        return self._blocks[block_id].ref_count

    def fits_pool(self, num_tokens_total: int) -> bool:
        """Whether a sequence of this many tokens could ever fit, alone, in the pool."""
        return math.ceil(num_tokens_total / self._block_size) <= self._num_blocks

    def allocate_cached_prefix(self, seq: Sequence, *, is_retry: bool = False) -> int:
        """Give ``seq`` the cached blocks of its longest cached run of leading full blocks.

        At least one token is always left to compute (the forward that samples
        the next token needs it), so at most ``(num_tokens - 1) // block_size``
        blocks are reused. Sets ``num_computed_tokens`` and ``num_cached_tokens``
        and returns the number of tokens served from the cache.
        ``is_retry`` (the scheduler undid an earlier attempt for this sequence)
        keeps the hit-rate counters from counting the same request again.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks; free it first")
        if not self.enable_prefix_caching:
            return 0
        block_ids, hashes = self._match_prefix(seq)
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._cached_free_ids[block_id]
            block.ref_count += 1
        seq.block_table.extend(block_ids)
        seq.block_hashes.extend(hashes)
        num_hit_tokens = len(block_ids) * self._block_size
        seq.num_computed_tokens = num_hit_tokens
        seq.num_cached_tokens = num_hit_tokens
        if not is_retry:
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += num_hit_tokens
        return num_hit_tokens

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        size = self._block_size
        parent_hash = root_hash(seq.cache_salt)
        block_ids: list[int] = []
        hashes: list[int] = []
        for i in range((seq.num_tokens - 1) // size):
            token_ids = tuple(seq.token_ids[i * size:(i + 1) * size])
            block_hash = hash_block(parent_hash, token_ids)
            block_id = self._hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.parent_hash != parent_hash or block.token_ids != token_ids:
                break  # a hash collision: the cached block holds other tokens
            block_ids.append(block_id)
            hashes.append(block_hash)
            parent_hash = block_hash
        return block_ids, hashes

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Give *child* the first *num_blocks* blocks of *parent* (full blocks of computed tokens that
        the two share), one more reference each; the child computes everything after them."""
        if child.block_table:
            raise RuntimeError(f"sequence {child.seq_id} already holds blocks; free it first")
        if num_blocks * self._block_size > parent.num_computed_tokens:
            raise RuntimeError(f"sequence {parent.seq_id} has not computed {num_blocks} blocks to share")
        for block_id in parent.block_table[:num_blocks]:
            self._blocks[block_id].ref_count += 1
        child.block_table.extend(parent.block_table[:num_blocks])
        child.block_hashes.extend(parent.block_hashes[:num_blocks])
        child.num_computed_tokens = num_blocks * self._block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold its computed tokens plus ``num_new_tokens``."""
        num_slots = seq.num_computed_tokens + num_new_tokens
        return max(0, math.ceil(num_slots / self._block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append fresh blocks to ``seq.block_table`` for ``num_new_tokens`` more tokens.

        Raises RuntimeError when the pool is short; callers check :meth:`can_allocate`.
        """
        num_needed = self.blocks_needed(seq, num_new_tokens)
        if num_needed > self.num_free_blocks:
            raise RuntimeError(
                f"sequence {seq.seq_id} needs {num_needed} blocks, {self.num_free_blocks} free")
        for _ in range(num_needed):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        # Never-hashed blocks first: every cached block kept is a possible future hit.
        if self._free_ids:
            block_id = self._free_ids.popleft()
        else:
            block_id, _ = self._cached_free_ids.popitem(last=False)
            block = self._blocks[block_id]
            del self._hash_to_block_id[block.hash]
            block.hash, block.parent_hash, block.token_ids = None, 0, ()
        self._blocks[block_id].ref_count = 1
        return block_id

    def commit(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full of computed tokens.

        Appends their hashes to ``seq.block_hashes``. When the cache already maps
        a hash to another block (two sequences computed the same prefix at once),
        the first block stays the cached one and this sequence's copy stays
        private: it is freed as a never-hashed block. Remapping would either
        strand the old block (hashed but unreachable) or need its refcounts
        moved; keeping the first costs one duplicate block until ``free``.
        """
        if not self.enable_prefix_caching:
            return
        size = self._block_size
        num_full = min(seq.num_computed_tokens // size, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            parent_hash = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.cache_salt)
            token_ids = tuple(seq.token_ids[i * size:(i + 1) * size])
            block_hash = hash_block(parent_hash, token_ids)
            seq.block_hashes.append(block_hash)
            if block_hash in self._hash_to_block_id:
                continue
            block = self._blocks[seq.block_table[i]]
            block.hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
            self._hash_to_block_id[block_hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references to its blocks; clears its block table and hashes.

        Tail blocks are released first so that, among this sequence's cached
        blocks, the end of the prefix is evicted before its head (a head block
        is useful to more future requests, and without it the tail cannot hit).
        """
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} of sequence {seq.seq_id} is already free")
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is None:
                self._free_ids.append(block_id)
            else:
                self._cached_free_ids[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
