"""Huge-page buffers (serving/engine/memory.py): the KV pool and the weights' arena."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serving.engine.memory import empty_on_huge_pages, zeros_on_huge_pages

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_page_kb(address: int) -> int | None:
    """AnonHugePages of the mapping of this process that holds ``address`` (kB)."""
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                mapping = low <= address < high
            elif mapping and head == "AnonHugePages:":
                return int(line.split()[1])
    return None


@pytest.mark.skipif(not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages here")
def test_the_kv_cache_lies_on_huge_pages():
    cache = zeros_on_huge_pages(((16 << 20) // (3 * 64 * 4), 3, 64), torch.float32, torch.device("cpu"))
    assert cache.count_nonzero() == 0
    huge_kb = _huge_page_kb(cache.data_ptr() + cache.numel() * 2) or 0
    # At least one 2 MB page. The kernel may still give small pages when its memory is fragmented.
    assert huge_kb >= 2048, f"{huge_kb} kB on huge pages: is the machine's memory fragmented? (/proc/buddyinfo)"


def test_small_or_gpu_buffers_are_plain_tensors():
    small = zeros_on_huge_pages((8, 8), torch.float32, torch.device("cpu"))
    assert small.shape == (8, 8) and small.count_nonzero() == 0
    assert empty_on_huge_pages((8, 8), torch.float32, torch.device("cpu")).shape == (8, 8)


def test_an_empty_buffer_holds_what_is_written():
    buffer = empty_on_huge_pages((3 << 20,), torch.float32, torch.device("cpu"))  # 12 MB: the mapped path
    values = torch.arange(buffer.numel(), dtype=torch.float32)
    buffer.copy_(values)
    assert torch.equal(buffer, values)
