"""The small-batch linear kernel (kernels/small_linear.cpp: float32 over panels) and where the model uses it."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from serving.engine import calibration, cpu_linear, kernel_calibration
from serving.engine.cpu_linear import SMALL_ROWS, CpuLinear, CpuWeight, bucket_rows, has_panels, use_onednn
from serving.engine.errors import EngineError
from serving.engine.kernel_calibration import CALIBRATION_ROWS, calibrate_burst, calibrate_small_rows, scan_rows
from serving.engine.models import llama


def panels_of(ops, weight: torch.Tensor) -> torch.Tensor:
    width = ops.panel_width()
    panels = torch.full((-(-weight.shape[0] // width), weight.shape[1], width), float("nan"))
    ops.pack_panels(panels, weight)
    return panels


def dense_of(weight: CpuWeight) -> torch.Tensor:
    """The ``[out, in]`` matrix that *weight*'s panels hold."""
    return weight.panels.transpose(1, 2).reshape(-1, weight.shape[1])[:weight.shape[0]]


def small_linear(ops, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return ops.panel_linear(x, panels_of(ops, weight), weight.shape[0], bias)


def test_panels_hold_the_weight_column_by_column_padded_with_zeros(ops):
    width = ops.panel_width()
    assert width in (24, 48)  # 3 vectors of 16 floats with AVX-512, else of 8 (AVX2, or two SSE registers)
    weight = torch.randn(width + 5, 7)
    panels = panels_of(ops, weight)  # filled with NaN first: every element must be written
    assert panels.shape == (2, 7, width)
    torch.testing.assert_close(panels[0], weight[:width].T)
    torch.testing.assert_close(panels[1, :, :5], weight[width:].T)
    assert (panels[1, :, 5:] == 0).all()


# Rows across one and several register blocks and their remainders (blocks of 4 or 8 rows); in_features
# across one and several k-blocks of 64, and not a multiple of the vector width; out_features across
# whole and padded panels.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17, 27, 64, 70])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (1000, 100), (50, 130), (7, 16), (3, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_computes_a_linear_layer(ops, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    out = small_linear(ops, x, weight, bias)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    """No measurement known yet: an empty calibration cache file of this test's own, nothing in memory."""
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(calibration.ENV, str(path))
    calibration.forget()
    yield path
    calibration.forget()  # what this test measured, with its counting wrappers, is not the session's


@pytest.fixture
def panel_model(loaded_model):
    """The test model, where its linear layers keep panels for the small-batch kernel (else skipped)."""
    model = loaded_model.model
    if not isinstance(model.linear, CpuLinear) or not has_panels([model.layers[0].qkv, model.lm_head]):
        pytest.skip("the model keeps no panels here")
    return model


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_leaving_the_prefetch_to_the_hardware_changes_no_result(ops, rows):
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 576, generator=generator), torch.randn(1000, 576, generator=generator)
    panels = panels_of(ops, weight)
    assert torch.equal(ops.panel_linear(x, panels, 1000, None, False), ops.panel_linear(x, panels, 1000, None))


def test_start_up_measures_whether_decode_prefetches_and_it_can_be_set(panel_model, monkeypatch, empty_cache):
    model = panel_model
    monkeypatch.delenv("INFERLINE_PANEL_BURST", raising=False)
    weights = llama.layer_linears(model.layers)
    asked: list[bool] = []
    real = torch.ops.inferline.panel_linear

    class Ops:  # counts the passes each way, runs the real kernel
        @staticmethod
        def panel_linear(x, panels, n, bias, burst=True):
            asked.append(burst)
            return real(x, panels, n, bias, burst)

    monkeypatch.setattr(torch.ops, "inferline", Ops)
    chosen = calibrate_burst(weights)
    assert isinstance(chosen, bool) and asked.count(True) == asked.count(False) == 5 * len(weights)
    asked.clear()
    assert calibrate_burst(weights) == chosen and not asked  # once per process and shape
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("INFERLINE_PANEL_BURST", value)
        assert calibrate_burst(weights) is expected
    monkeypatch.setenv("INFERLINE_PANEL_BURST", "yes")
    with pytest.raises(EngineError, match=r"INFERLINE_PANEL_BURST must be 1 .* got 'yes'"):
        calibrate_burst(weights)


def test_rows_may_be_a_slice_of_a_wider_tensor(ops):
    wide = torch.randn(2, 3, 64)[:, 1]  # rows 192 floats apart, each contiguous
    weight = torch.randn(40, 64)
    torch.testing.assert_close(small_linear(ops, wide, weight, None), F.linear(wide, weight), rtol=1e-5, atol=1e-5)


def test_many_threads_at_once_each_get_their_own_answer(ops):
    # One caller at a time uses the pool; the others run on their own threads (the try-lock path).
    weight = torch.randn(3072, 576)
    panels = panels_of(ops, weight)
    inputs = [torch.randn(2 + 5 * i, 576) for i in range(6)]
    expected = [F.linear(x, weight) for x in inputs]
    results: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(inputs))}

    def work(i: int) -> None:
        for _ in range(50):
            results[i].append(ops.panel_linear(inputs[i], panels, 3072, None))

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
    panels = panels_of(ops, weight)
    with pytest.raises(RuntimeError, match="panels must be a contiguous float32"):
        ops.panel_linear(x, panels.transpose(1, 2).contiguous().transpose(1, 2), 4, None)
    with pytest.raises(RuntimeError, match="panels hold k = 8, x has 9"):
        ops.panel_linear(torch.randn(1, 9), panels, 4, None)
    with pytest.raises(RuntimeError, match="cannot hold n = 100"):
        ops.panel_linear(x, panels, 100, None)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ops.panel_linear(x.double(), panels, 4, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.panel_linear(x, panels, 4, torch.randn(5))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.pack_panels(torch.empty(2, 8, ops.panel_width()), weight)
    assert ops.small_linear_threads() == max(1, min(torch.get_num_threads(), 16))


def test_small_batches_take_the_kernel_and_larger_ones_onednn(loaded_model, ops, monkeypatch):
    model = loaded_model.model
    if not isinstance(model.linear, CpuLinear):
        pytest.skip("the model does not run on oneDNN here")
    seen: list[int] = []
    real = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear", lambda x, w, b: seen.append(x.shape[0]) or real(x, w, b))
    monkeypatch.setattr(model.linear, "small_rows", 5)
    layer = model.layers[0]
    assert isinstance(layer.qkv, CpuWeight) and layer.qkv.panels is not None
    with torch.inference_mode():
        for rows in range(1, 7):
            x = torch.randn(rows, model.shape.hidden_size)
            out = model.linear(x, layer.qkv, layer.qkv_bias)
            torch.testing.assert_close(out, F.linear(x, dense_of(layer.qkv), layer.qkv_bias), rtol=1e-4, atol=1e-4)
    assert seen == [6]  # only the batch above small_rows went to oneDNN


def test_models_past_the_copy_budget_keep_only_the_packed_weights(monkeypatch):
    from tests.serving.engine.model import DEVICE, MODEL

    if DEVICE != "cpu" or not use_onednn(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN packing is a CPU float32 path")
    monkeypatch.setattr(cpu_linear, "PANEL_COPY_MAX_BYTES", 0)
    from serving.engine.models import load_model

    model = load_model(str(MODEL), "float32", "cpu").model
    assert all(getattr(layer, name).panels is None for layer in model.layers for name in llama.LINEARS)
    assert model.lm_head.panels is None
    with torch.inference_mode():
        x = torch.randn(1, model.shape.hidden_size)
        weight = model.layers[0].o
        assert model.linear(x, weight, None).shape == (1, model.shape.hidden_size)
    # Every matmul goes to oneDNN, whatever the limit: a step is padded once to its row bucket, at the
    # embedding, rather than at each matmul.
    model.linear.small_rows = 64
    assert model._onednn_rows(17) == bucket_rows(17) == 18


def test_start_up_builds_no_onednn_kernels_for_rows_the_small_kernel_takes(panel_model, monkeypatch):
    model = panel_model
    seen: list[int] = []
    real = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear", lambda x, w, b: seen.append(x.shape[0]) or real(x, w, b))
    monkeypatch.setenv("INFERLINE_SMALL_ROWS", "6")  # the limit as set, not measured
    for linear in (model.linear, model.head_linear):  # restored after prepare sets them
        monkeypatch.setattr(linear, "small_rows", linear.small_rows)
        monkeypatch.setattr(linear, "burst", linear.burst)
    model.prepare(40, 8)
    assert model.linear.small_rows == 6
    assert min(seen) == 7
    assert sorted(set(seen)) == sorted({bucket_rows(n) for n in range(7, 41)})


def test_start_up_measures_the_small_batch_limit_on_the_model(panel_model, monkeypatch, empty_cache):
    model = panel_model
    monkeypatch.delenv("INFERLINE_SMALL_ROWS", raising=False)
    timed: list[int] = []
    real = kernel_calibration.onednn_linear
    monkeypatch.setattr(kernel_calibration, "onednn_linear", lambda x, w, b: timed.append(x.shape[0]) or real(x, w, b))
    weights = llama.layer_linears(model.layers)
    limit = calibrate_small_rows(weights, 40)
    assert limit == SMALL_ROWS or limit in CALIBRATION_ROWS
    assert SMALL_ROWS <= limit <= 40
    assert set(timed) <= {r for r in CALIBRATION_ROWS if SMALL_ROWS < r <= 40}
    assert set(timed)  # at least the first row count above SMALL_ROWS was timed
    timed.clear()
    assert calibrate_small_rows(weights, 40) == limit and not timed  # once per process and shape
    calibration.forget()  # a new process on this machine: the cache file answers, nothing is timed
    assert calibrate_small_rows(weights, 40) == limit and not timed
    monkeypatch.setenv(calibration.ENV, "off")  # measured at every start
    calibration.forget()
    assert calibrate_small_rows(weights, 40) in (SMALL_ROWS, *CALIBRATION_ROWS) and timed


def test_the_lm_head_has_a_limit_of_its_own(panel_model, monkeypatch):
    """The LM head (49152 x 576 for SmolLM2) crosses over to oneDNN at its own row count, not the
    layers': start-up measures it alone, and a step's logits go by that limit."""
    model = panel_model
    asked: list[tuple[int, int]] = []

    def calibrate(weights, max_rows, burst):
        asked.append((len(weights), max_rows))
        return 2 if len(weights) == 1 else 40

    monkeypatch.setattr(llama, "calibrate_small_rows", calibrate)
    for linear in (model.linear, model.head_linear):  # restored after prepare sets them
        monkeypatch.setattr(linear, "small_rows", linear.small_rows)
        monkeypatch.setattr(linear, "burst", linear.burst)
    model.prepare(40, 8)
    assert asked == [(len(llama.layer_linears(model.layers)), 40), (1, 8)]
    assert (model.linear.small_rows, model.head_linear.small_rows) == (40, 2)
    seen: list[tuple[int, int]] = []
    real = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear", lambda x, w, b: seen.append(tuple(w.shape)) or real(x, w, b))
    with torch.inference_mode():
        x = torch.randn(3, model.shape.hidden_size)
        logits = model.head_linear(x, model.lm_head, None)
        model.linear(x, model.layers[0].o, None)
    assert seen == [tuple(model.lm_head.shape)]  # 3 rows: the LM head on oneDNN, the layer on ours
    torch.testing.assert_close(logits, F.linear(x, dense_of(model.lm_head)), rtol=1e-4, atol=1e-4)


def test_the_scan_keeps_the_kernel_up_to_its_first_loss():
    asked: list[int] = []

    def timings(win_up_to: int):
        def time_both(rows: int) -> tuple[float, float]:
            asked.append(rows)
            return (1.0, 2.0) if rows <= win_up_to else (2.0, 1.0)
        return time_both

    # A loss is timed twice before it ends the scan.
    assert scan_rows(timings(24), 512, 3) == 24 and asked == [4, 6, 8, 12, 16, 20, 24, 28, 28]
    asked.clear()
    assert scan_rows(timings(0), 512, 3) == 3 and asked == [4, 4]  # oneDNN already wins at 4 rows
    asked.clear()
    assert scan_rows(timings(1000), 16, 3) == 16 and asked[-1] == 16  # never past the step's rows
    asked.clear()
    assert scan_rows(timings(1000), 512, 8) == 128 and asked[0] == 12  # starts above the default
    tie = scan_rows(lambda rows: (1.0, 1.0), 512, 3)
    assert tie == 3  # ties keep oneDNN


def test_a_burst_on_one_pass_or_a_tie_does_not_end_the_scan():
    asked: list[int] = []
    burst = iter([True])

    def time_both(rows: int) -> tuple[float, float]:
        asked.append(rows)
        if rows == 6:
            return 1.03, 1.0  # a tie: passed over, not kept
        if rows == 12 and next(burst, False):
            return 3.0, 1.0  # other work on the machine during this pass: timed again, ours wins
        return (1.0, 2.0) if rows <= 40 else (1.2, 1.0)

    assert scan_rows(time_both, 512, 4) == 40
    assert asked == [6, 8, 12, 12, 16, 20, 24, 28, 32, 40, 48, 48]
    asked.clear()
    # A tie at the end is not kept either: the last clear win is the limit.
    assert scan_rows(lambda rows: (asked.append(rows), (1.0, 2.0) if rows <= 8 else (1.04, 1.0))[1],
                           16, 3) == 8 and asked == [4, 6, 8, 12, 16]


def test_the_limit_can_be_set(loaded_model, monkeypatch):
    monkeypatch.setenv("INFERLINE_SMALL_ROWS", "0")
    assert calibrate_small_rows(llama.layer_linears(loaded_model.model.layers), 512) == 0
    monkeypatch.setenv("INFERLINE_SMALL_ROWS", "12")
    assert calibrate_small_rows(llama.layer_linears(loaded_model.model.layers), 512) == 12
    for bad in ("twelve", "-1", "1.5"):
        monkeypatch.setenv("INFERLINE_SMALL_ROWS", bad)
        with pytest.raises(EngineError, match=f"INFERLINE_SMALL_ROWS must be a whole number.*{re.escape(repr(bad))}"):
            calibrate_small_rows(llama.layer_linears(loaded_model.model.layers), 512)


def test_weights_without_panels_keep_the_default():
    packed_only = CpuWeight(torch.zeros(4, 4), None)
    layer = llama.LayerWeights(torch.ones(4), packed_only, None, packed_only, torch.ones(4), packed_only,
                               packed_only)
    assert kernel_calibration._scan_small_rows(llama.layer_linears([layer]), 512, 3) == 3


@pytest.mark.parametrize(("flags", "rows"), [("flags\t: fpu sse avx2 fma avx512f avx512bw", 3),
                                             ("flags\t: fpu sse avx2 fma", 8)])
def test_the_small_batch_limit_follows_the_vector_unit(monkeypatch, flags, rows):
    # oneDNN's AVX-512 kernels win from 4 rows on; without AVX-512 ours stays ahead to 8 (cpu_linear._small_rows).
    from serving.engine import kernels

    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    assert cpu_linear._small_rows() == rows


def test_a_profile_records_the_row_limits_its_engine_measured(loaded_model):
    """`inferline profile` writes the limits beside the step times: a plan is of an engine that chose so."""
    from serving.capacity.step_profile import small_rows_of

    model = loaded_model.model
    if not isinstance(model.linear, CpuLinear):
        pytest.skip("the model does not run on oneDNN here")
    assert small_rows_of(model) == {"small_rows": model.linear.small_rows,
                                    "head_small_rows": model.head_linear.small_rows}
    assert small_rows_of(object()) == {}  # another path (cuda, bfloat16): nothing to record
