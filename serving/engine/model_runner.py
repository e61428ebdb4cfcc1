"""One batched forward per step over a ragged batch of prefill chunks and decodes.

The runner owns the KV cache (preallocated once, never resized) and turns the
scheduler's choice into tensors: the flattened new tokens, their positions and
cache slots, and the attention metadata every layer reuses. Decode tokens are
placed first, sorted by context length, so that each group of similar
lengths is one contiguous slice of the batch and pads little.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from serving.engine.attention import AttentionMetadata, DecodeGroup, KernelGroups, PrefillChunk
from serving.engine.kernels import cpu_ops
from serving.engine.memory import zeros_on_huge_pages
from serving.engine.models.llama import LlamaModel

if TYPE_CHECKING:
    from serving.engine.scheduler import ScheduledSeq


def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
    """Bytes of K and V one block holds across all layers."""
    shape = model.shape
    element = torch.tensor([], dtype=model.kv_dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * element


class ModelRunner:
    """Holds the model and its paged KV cache; runs one step's forward."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        self.model = model
        self.block_size = block_size
        shape, device = model.shape, model.device
        num_slots = num_blocks * block_size
        cache_shape = (num_slots, shape.num_kv_heads, shape.head_dim)
        self.k_caches = [zeros_on_huge_pages(cache_shape, model.kv_dtype, device) for _ in range(shape.num_layers)]
        self.v_caches = [zeros_on_huge_pages(cache_shape, model.kv_dtype, device) for _ in range(shape.num_layers)]
        self.use_kernel = (device.type == "cpu" and model.dtype == torch.float32 and shape.head_dim in (64, 128)
                           and cpu_ops() is not None)
        """Every token's attention goes to the C++ kernel (see attention.py)."""

    @torch.inference_mode()
    def run(self, scheduled: Seq[ScheduledSeq]) -> torch.Tensor:
        """Logits ``[num_rows, vocab]``, in batch order: a row per item that samples, plus one per guess.

        The batch order is decodes first, then prefill chunks; :meth:`order`
        gives it so the caller can match rows to sequences.
        """
        items = self.order(scheduled)
        input_ids, positions, slots, logits_rows = _flatten(items, self.block_size)
        device = self.model.device

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        meta = self._metadata(items, index(slots))
        return self.model.forward(index(input_ids), index(positions), meta, self.k_caches, self.v_caches,
                                  index(logits_rows))

    @staticmethod
    def order(scheduled: Seq[ScheduledSeq]) -> list[ScheduledSeq]:
        """Decodes (one new token after some context), shortest context first, then prefill chunks."""
        decodes = sorted((s for s in scheduled if _is_decode(s)), key=lambda s: s.seq.num_computed_tokens)
        return decodes + [s for s in scheduled if not _is_decode(s)]

    def _metadata(self, items: list[ScheduledSeq], slot_mapping: torch.Tensor) -> AttentionMetadata:
        if self.use_kernel:
            return self._kernel_metadata(items, slot_mapping)
        decodes = [s for s in items if _is_decode(s)]
        groups, start = [], 0
        for size in _group_sizes([s.seq.num_computed_tokens + 1 for s in decodes]):
            groups.append(DecodeGroup(start, size, *self._decode_slots(decodes[start:start + size])))
            start += size
        prefills = []
        for item in items[len(decodes):]:
            prefills.append(self._chunk(item, start))
            start += item.num_new_tokens
        return AttentionMetadata(slot_mapping, groups, prefills, block_size=self.block_size)

    def _kernel_metadata(self, items: list[ScheduledSeq], slot_mapping: torch.Tensor) -> AttentionMetadata:
        """Every item goes to the kernel, in query groups of at most ``KERNEL_GROUP`` tokens (more work
        items to share out between threads): decodes, chunks after context and fresh prompts alike, which
        it runs faster than gather + SDPA at every size measured (bench/attention.py)."""
        token: list[int] = []
        size: list[int] = []
        seq: list[int] = []
        length: list[int] = []
        start = 0
        for row, item in enumerate(items):
            num_new, num_context = item.num_new_tokens, item.seq.num_computed_tokens
            for offset in range(0, num_new, KERNEL_GROUP):
                token.append(start + offset)
                size.append(min(KERNEL_GROUP, num_new - offset))
                seq.append(row)
                length.append(num_context + offset + 1)
            start += num_new
        tables = [item.seq.block_table for item in items]
        width = max(len(t) for t in tables)
        device = self.model.device

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)
        kernel = KernelGroups(padded, index(token), index(size), index(seq), index(length))
        return AttentionMetadata(slot_mapping, [], [], kernel, self.block_size)

    def _decode_slots(self, decodes: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Built with tensor ops, not per-token Python: this runs for up to
        # max_num_seqs sequences of up to max_model_len tokens every step.
        device, bs = self.model.device, self.block_size
        context = torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes])
        num_blocks = (int(context.max()) + bs - 1) // bs
        tables = torch.zeros(len(decodes), num_blocks, dtype=torch.int64)
        for row, item in enumerate(decodes):
            table = item.seq.block_table[:num_blocks]
            tables[row, :len(table)] = torch.tensor(table, dtype=torch.int64)
        slots = (tables[:, :, None] * bs + torch.arange(bs)).view(len(decodes), -1)
        max_context = int(context.max())
        flat = slots[:, :max_context].reshape(-1).to(device)
        if int(context.min()) == max_context:
            return flat, None  # no padding: SDPA without a mask is faster
        mask = torch.arange(max_context)[None, :] < context[:, None]
        return flat, mask[:, None, None, :].to(device)

    def _chunk(self, item: ScheduledSeq, start: int) -> PrefillChunk:
        num_context, num_new = item.seq.num_computed_tokens, item.num_new_tokens
        if num_context == 0:
            return PrefillChunk(start, num_new, 0, None, None)
        device, total = self.model.device, num_context + num_new
        slots = torch.tensor(_slots(item.seq.block_table, 0, total, self.block_size), dtype=torch.int64,
                             device=device)
        query_pos = torch.arange(num_context, total, device=device)[:, None]
        hidden = torch.arange(total, device=device)[None, :] > query_pos
        mask = torch.zeros(num_new, total, dtype=self.model.dtype, device=device).masked_fill_(hidden, float("-inf"))
        shape = self.model.shape
        return PrefillChunk(start, num_new, num_context, slots, mask.repeat(shape.num_heads // shape.num_kv_heads, 1))


#: Tokens per kernel query group: each group re-reads its context once, so larger groups read less, and
#: smaller ones give the threads more items to share.
KERNEL_GROUP = 16

#: A decode group ends where padding would exceed this share of its gathered slots.
_MAX_PADDING = 0.25
#: ...but never below this many sequences: each group costs an SDPA call per layer.
_MIN_GROUP = 8


def _group_sizes(contexts: list[int]) -> list[int]:
    """Split sorted context lengths into runs that pad little (gather and attention cost)."""
    sizes: list[int] = []
    first = 0
    for index in range(1, len(contexts) + 1):
        end_here = index == len(contexts)
        if not end_here and index - first >= _MIN_GROUP:
            padded = (index - first + 1) * contexts[index]
            end_here = sum(contexts[first:index + 1]) < (1 - _MAX_PADDING) * padded
        if end_here:
            sizes.append(index - first)
            first = index
    return sizes


def _is_decode(item: ScheduledSeq) -> bool:
    return item.num_new_tokens == 1 and item.seq.num_computed_tokens > 0


def _flatten(items: list[ScheduledSeq], block_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    for item in items:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        input_ids += seq.token_ids[start:end - len(item.guesses)]
        input_ids += item.guesses
        positions += range(start, end)
        slots += _slots(seq.block_table, start, end, block_size)
        if item.samples:  # a verified decode: a row for its last token and one per guess
            logits_rows.extend(range(len(input_ids) - 1 - len(item.guesses), len(input_ids)))
    return input_ids, positions, slots, logits_rows


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
