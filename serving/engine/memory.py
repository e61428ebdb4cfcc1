"""Large CPU buffers on huge pages: the KV pool and the weights' plain copies.

Both are read at memory speed every step: the weights front to back (540 MB for SmolLM2-135M at
batch-1 decode), the KV pool in 12 KB pieces spread over tens of MB (a sequence's blocks lie
anywhere in it). With 4 KB pages nearly every piece also misses the TLB; on 2 MB pages both read
faster (docs/measurements.md).
"""

from __future__ import annotations

import math
import mmap

import torch

_HUGE_PAGE = 2 << 20


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor whose memory the kernel is asked to back with 2 MB pages (Linux, CPU), for the caller to fill.

    The memory is a fresh private anonymous mapping (a shared one gets no transparent huge pages),
    advised before its first touch (malloc may hand back pages already touched, which stay small).
    Such a mapping reads as zeros and takes memory page by page as it is first written. Huge pages
    come where transparent huge pages are ``madvise`` or ``always``; elsewhere, off Linux, below
    4 MB or on a GPU it is plain ``torch.empty``.
    """
    num_bytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE") or num_bytes < 2 * _HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``empty_on_huge_pages`` zeroed, so that all of it is resident from the start, as with ``torch.zeros``."""
    return empty_on_huge_pages(shape, dtype, device).zero_()
