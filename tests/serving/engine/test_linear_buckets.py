"""The oneDNN linear's row buckets: few sizes, little padding, the same numbers as an unpadded matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.engine import cpu_linear
from serving.engine.cpu_linear import bucket_rows, onednn_linear, use_onednn


def test_buckets_cover_every_count_with_little_padding():
    sizes = [bucket_rows(n) for n in range(1, 4097)]
    assert all(size >= n for n, size in zip(range(1, 4097), sizes, strict=True))
    assert sizes == sorted(sizes)
    assert [bucket_rows(n) for n in range(1, 17)] == list(range(1, 17))
    assert max(size / n for n, size in zip(range(1, 4097), sizes, strict=True)) <= 1.125
    assert len(set(sizes[:512])) == 56  # the kernels oneDNN builds for a 512-token step budget
    assert all(bucket_rows(size) == size for size in set(sizes))


@pytest.mark.skipif(not use_onednn(torch.float32, torch.device("cpu")), reason="oneDNN is not available")
@pytest.mark.parametrize("rows", [1, 17, 45, 129, 300])
def test_a_padded_linear_returns_the_rows_asked_for(rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    x = torch.randn(rows, 64)
    out = onednn_linear(x, packed, bias)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def test_the_engine_prepares_every_bucket_at_start(monkeypatch):
    from serving.engine.models import llama

    seen: list[tuple[int, int]] = []
    model = llama.LlamaModel.__new__(llama.LlamaModel)
    if not use_onednn(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN is not available")
    weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(32, 16), 64)
    model.layers = [llama.LayerWeights(input_norm=None, qkv=weight, qkv_bias=None, o=weight, post_norm=None,
                                       gate_up=weight, down=weight)]
    model.lm_head, model.linear, model.dtype = weight, onednn_linear, torch.float32
    model.head_linear = onednn_linear
    real = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear",
                        lambda x, w, b: seen.append((x.shape[0], w.shape[0])) or real(x, w, b))
    model.prepare(100, 20)
    rows = sorted({r for r, _ in seen})
    assert rows == sorted({bucket_rows(n) for n in range(1, 101)})
    assert len(seen) == 4 * len(rows) + len({bucket_rows(n) for n in range(1, 21)})
