"""The small-batch linear kernel (kernels/small_linear.cpp) and where the model uses it."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from serving.engine.models import llama


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (1000, 100), (7, 16), (3, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_computes_a_linear_layer(ops, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    out = ops.small_linear(x, weight, bias)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


def test_rows_may_be_a_slice_of_a_wider_tensor(ops):
    wide = torch.randn(2, 3, 64)[:, 1]  # rows 192 floats apart, each contiguous
    weight = torch.randn(40, 64)
    torch.testing.assert_close(ops.small_linear(wide, weight, None), F.linear(wide, weight), rtol=1e-5, atol=1e-5)


def test_many_threads_at_once_each_get_their_own_answer(ops):
    # One caller at a time uses the pool; the others run on their own threads (the try-lock path).
    weight = torch.randn(3072, 576)
    inputs = [torch.randn(2, 576) for _ in range(6)]
    expected = [F.linear(x, weight) for x in inputs]
    results: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(inputs))}

    def work(i: int) -> None:
        for _ in range(50):
            results[i].append(ops.small_linear(inputs[i], weight, None))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, outs in results.items():
        assert len(outs) == 50
        for out in outs:
            torch.testing.assert_close(out, expected[i], rtol=1e-5, atol=1e-4)


def test_it_refuses_what_it_cannot_run(ops):
    x, weight = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32"):
        ops.small_linear(x, weight.t().contiguous().t(), None)
    with pytest.raises(RuntimeError, match="with k = 8"):
        ops.small_linear(x, torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ops.small_linear(x.double(), weight, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.small_linear(x, weight, torch.randn(5))
    assert ops.small_linear_threads() == max(1, min(torch.get_num_threads(), 16))


def test_small_batches_take_the_kernel_and_larger_ones_onednn(loaded_model, ops, monkeypatch):
    model = loaded_model.model
    if model.linear is not llama._cpu_linear:
        pytest.skip("the model does not run on oneDNN here")
    seen: list[int] = []
    real = llama._onednn_linear
    monkeypatch.setattr(llama, "_onednn_linear", lambda x, w, b: seen.append(x.shape[0]) or real(x, w, b))
    layer = model.layers[0]
    assert isinstance(layer.qkv, llama.CpuWeight) and layer.qkv.dense is not None
    with torch.inference_mode():
        for rows in range(1, llama.SMALL_ROWS + 2):
            x = torch.randn(rows, model.shape.hidden_size)
            out = model.linear(x, layer.qkv, layer.qkv_bias)
            torch.testing.assert_close(out, F.linear(x, layer.qkv.dense, layer.qkv_bias), rtol=1e-4, atol=1e-4)
    assert seen == [llama.SMALL_ROWS + 1]  # only the batch above SMALL_ROWS went to oneDNN
    # A tied LM head's plain copy is the embedding itself, not a third copy.
    assert model.lm_head.dense is model.embed


def test_models_past_the_copy_budget_keep_only_the_packed_weights(monkeypatch):
    from tests.serving.engine.conftest import DEVICE, MODEL

    if DEVICE != "cpu" or not llama.use_onednn(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN packing is a CPU float32 path")
    monkeypatch.setattr(llama, "DENSE_COPY_MAX_BYTES", 0)
    from serving.engine.models import load_model

    model = load_model(str(MODEL), "float32", "cpu").model
    assert all(getattr(layer, name).dense is None for layer in model.layers for name in llama.LINEARS)
    assert model.lm_head.dense is None
    with torch.inference_mode():
        x = torch.randn(1, model.shape.hidden_size)
        weight = model.layers[0].o
        assert model.linear(x, weight, None).shape == (1, model.shape.hidden_size)


def test_start_up_builds_no_onednn_kernels_for_rows_the_small_kernel_takes(loaded_model, monkeypatch):
    model = loaded_model.model
    if model.linear is not llama._cpu_linear or model.layers[0].qkv.dense is None:
        pytest.skip("the model keeps no plain copies here")
    seen: list[int] = []
    real = llama._onednn_linear
    monkeypatch.setattr(llama, "_onednn_linear", lambda x, w, b: seen.append(x.shape[0]) or real(x, w, b))
    model.prepare(40, 8)
    assert min(seen) == llama.SMALL_ROWS + 1
    assert sorted(set(seen)) == sorted({llama.bucket_rows(n) for n in range(llama.SMALL_ROWS + 1, 41)})


@pytest.mark.parametrize(("flags", "rows"), [("flags\t: fpu sse avx2 fma avx512f avx512bw", 3),
                                             ("flags\t: fpu sse avx2 fma", 8)])
def test_the_small_batch_limit_follows_the_vector_unit(monkeypatch, flags, rows):
    # oneDNN's AVX-512 kernels win from 4 rows on; without AVX-512 ours stays ahead to 8 (llama._small_rows).
    from serving.engine import kernels

    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    assert llama._small_rows() == rows
