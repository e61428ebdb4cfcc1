"""Paged attention: the C++ kernel against the torch path on the same ragged batch (no model needed)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from serving.engine import model_runner as mr
from serving.engine.attention import paged_attention, write_kv
from serving.engine.model_runner import ModelRunner
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import ScheduledSeq
from serving.engine.sequence import Sequence

BLOCK_SIZE = 16


def fake_model(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype = torch.float32):
    shape = SimpleNamespace(num_layers=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return SimpleNamespace(shape=shape, dtype=torch.float32, kv_dtype=kv_dtype, device=torch.device("cpu"))


def batch(rng: random.Random, num_blocks: int, work: list[tuple[int, int]],
          block_size: int = BLOCK_SIZE) -> list[ScheduledSeq]:
    """Sequences with (context, new tokens) each, their blocks scattered over the pool."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    items = []
    for seq_id, (num_context, num_new) in enumerate(work):
        total = num_context + num_new
        seq = Sequence(seq_id, [rng.randrange(1000) for _ in range(total)], total, SamplingParams())
        seq.block_table = [free.pop() for _ in range(-(-total // block_size))]
        seq.num_computed_tokens = num_context
        items.append(ScheduledSeq(seq, num_new))
    return items


def attend(runner: ModelRunner, items: list[ScheduledSeq], q, k, v, use_kernel: bool) -> torch.Tensor:
    block_size = runner.block_size
    runner.use_kernel = use_kernel
    ordered = runner.order(items)
    slots = [s for item in ordered for s in mr._slots(item.seq.block_table, item.seq.num_computed_tokens,
                                                       item.seq.num_computed_tokens + item.num_new_tokens,
                                                       block_size)]
    meta = runner._metadata(ordered, torch.tensor(slots))
    write_kv(runner.k_caches[0], runner.v_caches[0], k, v, meta.slot_mapping)
    if use_kernel:
        assert meta.kernel is not None and not meta.decode_groups and not meta.prefills
    return paged_attention(q, k, v, runner.k_caches[0], runner.v_caches[0], meta)


# (14, 2): seven query heads a KV head, 112 query rows a 16-token group: the softmax's passes over the
# score columns come out uneven (4 + 4 + 4 + 2 vectors with AVX2).
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 64, 16), (9, 3, 64, 8), (6, 2, 128, 32),
                          (14, 2, 64, 16)])
def test_kernel_matches_the_torch_path_on_a_ragged_batch(ops, num_heads, num_kv_heads, head_dim, block_size,
                                                         kv_dtype):
    """Float32 or float16 caches (dtype gguf's): the kernel widens float16 rows as the torch path converts them."""
    rng = random.Random(num_heads)
    # Decodes of every length class, a 1-token context, speculative-like short chunks (2 tokens: 2 rows
    # where a KV head has one query head), a prefix-cache tail of 37 tokens after 1,000, a long chunk after
    # context, fresh prompts of a group, part of one and several, and a chunk that starts mid-block.
    work = [(c, 1) for c in (1, 15, 16, 17, 63, 200, 511, 777)] + [(40, 5), (9, 2), (1000, 37), (300, 80), (0, 29),
                                                                   (0, 16), (0, 3), (0, 70), (21, 33)]
    num_blocks = 6400 // block_size
    runner = ModelRunner(fake_model(num_heads, num_kv_heads, head_dim, kv_dtype), num_blocks, block_size)
    assert runner.k_caches[0].dtype == kv_dtype
    for cache in (*runner.k_caches, *runner.v_caches):
        cache.normal_()
    items = batch(rng, num_blocks, work, block_size)
    num_tokens = sum(n for _, n in work)
    q = torch.randn(num_tokens, num_heads, head_dim)
    # This step's keys and values as the cache holds them: the torch path reads a fresh prompt's from k and v.
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(kv_dtype).float()
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(kv_dtype).float()
    expected = attend(runner, items, q, k, v, use_kernel=False)
    got = attend(runner, items, q, k, v, use_kernel=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


def test_kernel_agrees_with_sdpa_over_a_gathered_context(ops):
    """One decode over scattered blocks against SDPA on the same keys laid out contiguously."""
    torch.manual_seed(0)
    num_slots, length = 64 * BLOCK_SIZE, 250
    k_cache, v_cache = torch.randn(num_slots, 2, 64), torch.randn(num_slots, 2, 64)
    table = torch.randperm(64)[: -(-length // BLOCK_SIZE)]
    slots = (table[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(-1)[:length]
    q = torch.randn(1, 6, 64)
    out = torch.empty(1, 6 * 64)
    one = torch.tensor([1])
    ops.paged_attention(out, q, k_cache, v_cache, table[None].contiguous(), torch.tensor([0]), one,
                        torch.tensor([0]), torch.tensor([length]), BLOCK_SIZE, 64 ** -0.5)
    keys, values = k_cache[slots].transpose(0, 1)[None], v_cache[slots].transpose(0, 1)[None]
    expected = F.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True).reshape(1, -1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


def test_kernel_refuses_what_it_cannot_run(ops):
    out, q = torch.empty(1, 4 * 32), torch.randn(1, 4, 32)
    cache = torch.zeros(16, 2, 32)
    index = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        ops.paged_attention(out, q, cache, cache, index[None], index, index + 1, index, index + 1, 16, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        ops.paged_attention(out, q.double(), cache, cache, index[None], index, index + 1, index, index + 1, 16, 1.0)
    with pytest.raises(RuntimeError, match="both be float32 or both float16"):
        ops.paged_attention(out, q, cache, cache.half(), index[None], index, index + 1, index, index + 1, 16, 1.0)
