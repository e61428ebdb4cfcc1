"""The C++ kernels' thread pool (serving/engine/kernels/pool.h), through its test op ``pool_trace``."""

from __future__ import annotations

import pytest

# 70,000 chunks is past what a contiguous share's 16-bit bounds hold: that job goes out from the ticket.
CHUNKS = [0, 1, 2, 3, 7, 64, 1000, 70_000]


@pytest.mark.parametrize("chunks", CHUNKS)
def test_every_chunk_runs_exactly_once(ops, chunks):
    for _ in range(20 if chunks < 10_000 else 2):
        runs, _by_caller = ops.pool_trace(chunks, 200).tolist()
        assert runs == [1] * chunks


@pytest.mark.parametrize("chunks", [2, 5, 64, 121, 1024])
def test_the_caller_takes_the_first_share_from_its_front(ops, chunks):
    threads = ops.small_linear_threads()
    first_end = chunks // min(threads, chunks)  # share i is [i * chunks // shares, (i + 1) * chunks // shares)
    prefixes = []
    for _ in range(30):
        runs, by_caller = ops.pool_trace(chunks, 2000).tolist()
        assert runs == [1] * chunks
        first = by_caller[:first_end]
        # The caller ran a prefix of its share; helpers may have taken its tail from the back.
        taken = first.index(0) if 0 in first else first_end
        assert first[taken:] == [0] * (first_end - taken)
        prefixes.append(taken)
        if threads == 1:
            assert by_caller == [1] * chunks
    # A caller descheduled right after posting the job can find its whole share taken (an empty prefix,
    # which the check above allows); it cannot be so every time.
    assert max(prefixes) >= 1
