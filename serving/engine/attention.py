"""Attention over the paged KV cache, for a ragged batch of prefill chunks and decodes.

The KV cache of one layer is a tensor of *slots* ``[num_blocks * block_size,
num_kv_heads, head_dim]``; slot ``b * block_size + i`` holds token ``i`` of block
``b``. A step's new keys and values are written to their slots first, then:

* decoding sequences (one new token each) attend in a few batched SDPA calls,
  one per group of similar context lengths (the runner sorts decodes by
  length, so padding stays small): each group's context slots are gathered
  into a padded ``[B, max_ctx]`` batch with a padding mask; the grouped query
  heads of one KV head ride along as the query length, so no KV head is ever
  copied per query head;
* each prefill chunk attends on its own: a chunk with no earlier context uses
  its fresh keys directly under a causal mask, a later chunk gathers its
  context from the cache and uses an offset causal mask.

On the CPU in float32, with our C++ kernel built (``kernels/``), every token goes
to ``paged_attention`` instead, which reads K and V in place from the blocks
(``KernelGroups``): no gather, no padding, and several-token groups as
register-blocked matrix products. The torch path above stays for the GPU, other
dtypes and machines without a compiler, and gives the same results.

The gather indices, masks and kernel groups are built once per step
(``AttentionMetadata``) and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.engine.kernels import cpu_ops


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's prefill chunk inside the step's flattened token batch."""

    start: int
    """Index of the chunk's first token in the step's token batch."""
    num_tokens: int
    num_context: int
    """Tokens already in the cache before this chunk."""
    context_slots: torch.Tensor | None
    """Slots of all ``num_context + num_tokens`` keys, when ``num_context > 0``."""
    mask: torch.Tensor | None
    """Additive offset-causal mask ``[group * num_tokens, num_context + num_tokens]`` (0 or -inf,
    repeated for the query heads sharing a KV head), when ``num_context > 0``."""


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences of similar context length, a contiguous slice of the token batch."""

    start: int
    num_seqs: int
    slots: torch.Tensor
    """``[num_seqs * max_context]``: each sequence's context slots, padded, flattened."""
    mask: torch.Tensor | None
    """``[num_seqs, 1, 1, max_context]``: True where a slot is real; None when nothing is padding."""


@dataclass(slots=True)
class KernelGroups:
    """Query groups for the C++ kernel (see kernels/paged_attention.cpp), all int64.

    Group ``i`` is ``size[i]`` consecutive tokens from ``token[i]`` of sequence
    ``seq[i]`` (a row of ``block_tables``); its first token sees ``length[i]``
    positions and each later one a position more.
    """

    block_tables: torch.Tensor
    """``[num_seqs, max_blocks]``, padded with block 0 past each table's end (never read)."""
    token: torch.Tensor
    size: torch.Tensor
    seq: torch.Tensor
    length: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Everything a layer needs to attend for one step, built once per step."""

    slot_mapping: torch.Tensor
    """``[num_tokens]``: the cache slot each new token's key and value go to."""
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    kernel: KernelGroups | None = None
    """Tokens the C++ kernel attends (then neither in ``decode_groups`` nor in ``prefills``)."""
    block_size: int = 16


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values ``[T, Hkv, D]`` in their slots."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))  # a float16 cache under float32 activations
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, num_rows: int | None = None) -> torch.Tensor:
    """Attention output ``[T, Hq * D]`` for queries ``q`` ``[T, Hq, D]``.

    ``k`` and ``v`` are this step's fresh keys and values (already written to
    the cache), used directly by chunks that have no earlier context. With
    *num_rows* > T the output has that many rows, the extra ones zero (a step
    padded to the next matmul's row bucket).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    out = torch.empty(max(num_rows or 0, num_tokens), num_heads * head_dim, dtype=q.dtype, device=q.device)
    if out.shape[0] > num_tokens:
        out[num_tokens:].zero_()
    if meta.kernel is not None:
        g = meta.kernel
        cpu_ops().paged_attention(out, q, k_cache, v_cache, g.block_tables, g.token, g.size, g.seq, g.length,
                                  meta.block_size, head_dim ** -0.5)
    for group in meta.decode_groups:
        _decode(q, k_cache, v_cache, group, out, num_kv_heads)
    for chunk in meta.prefills:
        _prefill(q, k, v, k_cache, v_cache, chunk, out)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
            out: torch.Tensor, num_kv_heads: int) -> None:
    _, num_heads, head_dim = q.shape
    rows, count = slice(group.start, group.start + group.num_seqs), group.num_seqs
    # [B, Hq, D] -> [B, Hkv, G, D]: query heads h = kv * G + g share KV head kv (HF's repeat_kv).
    q_dec = q[rows].view(count, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # index_select on flat slots: several times faster than advanced indexing with a 2-D index.
    keys = k_cache.index_select(0, group.slots).to(q.dtype).view(count, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, group.slots).to(q.dtype).view(count, -1, num_kv_heads, head_dim).transpose(1, 2)
    attn = F.scaled_dot_product_attention(q_dec, keys, values, attn_mask=group.mask)
    out[rows] = attn.reshape(count, num_heads * head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, chunk: PrefillChunk, out: torch.Tensor) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    rows, n = slice(chunk.start, chunk.start + chunk.num_tokens), chunk.num_tokens
    if chunk.num_context == 0:
        # 4-D inputs: with 3-D ones SDPA takes its slow reference path on CPU.
        attn = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                                              v[rows].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        out[rows] = attn[0].transpose(0, 1).reshape(n, num_heads * head_dim)
        return
    keys = k_cache.index_select(0, chunk.context_slots).to(q.dtype).transpose(0, 1)  # [Hkv, ctx, D]
    values = v_cache.index_select(0, chunk.context_slots).to(q.dtype).transpose(0, 1)
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    # The query heads of one KV head ride along in the query dimension, as in
    # _decode: with an explicit mask, SDPA's enable_gqa path falls back to a
    # slow reference implementation on CPU.
    q_g = q[rows].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n,
                                                                                      head_dim)
    attn = F.scaled_dot_product_attention(q_g[None], keys[None], values[None], attn_mask=chunk.mask[None, None])
    out[rows] = attn.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads * head_dim)
