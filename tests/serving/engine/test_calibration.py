"""Start-up measurements kept between processes (serving/engine/calibration.py)."""

from __future__ import annotations

import json
import logging

import pytest

from serving.engine import calibration, kernels
from serving.engine.cpu_linear import CpuLinear, has_panels


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(calibration.ENV, str(path))
    calibration.forget()
    yield path
    calibration.forget()


def counting(value):
    calls: list[int] = []

    def measure():
        calls.append(1)
        return value
    return measure, calls


def test_measured_once_then_read_back_by_the_next_process(cache):
    measure, calls = counting(24)
    assert calibration.remembered("small_rows", ((576, 576),), measure) == (24, None)  # measured
    assert calibration.remembered("small_rows", ((576, 576),), measure) == (24, None)  # this process's
    calibration.forget()  # another process on this machine
    assert calibration.remembered("small_rows", ((576, 576),), measure) == (24, cache)
    assert len(calls) == 1
    (entry,) = json.loads(cache.read_text())["entries"].values()
    assert entry["value"] == 24 and entry["question"] == "small_rows" and entry["measured"].endswith("Z")
    assert entry["cpu"] == kernels.cpu_model() != ""


def test_another_question_shape_build_or_machine_measures_afresh(cache, monkeypatch):
    measure, calls = counting(True)
    calibration.remembered("burst", ((576, 576), 2), measure)
    calibration.remembered("small_rows", ((576, 576), 2), measure)  # another question
    calibration.remembered("burst", ((576, 576), 1), measure)  # another thread count
    calibration.remembered("burst", ((1536, 576), 2), measure)  # another shape
    calibration.forget()
    monkeypatch.setattr(calibration, "build_key", lambda: "another-build")  # new sources, torch or instruction set
    calibration.remembered("burst", ((576, 576), 2), measure)
    calibration.forget()
    monkeypatch.setattr(calibration, "cpu_model", lambda: "Another CPU")
    calibration.remembered("burst", ((576, 576), 2), measure)
    assert len(calls) == 6 and len(json.loads(cache.read_text())["entries"]) == 6


def test_off_measures_at_every_start_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.ENV, "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    calibration.forget()
    measure, calls = counting(8)
    assert calibration.cache_file() is None
    calibration.remembered("small_rows", (1,), measure)
    calibration.forget()
    calibration.remembered("small_rows", (1,), measure)
    assert len(calls) == 2 and not list(tmp_path.rglob("*.json"))
    calibration.forget()


def test_default_file_under_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(calibration.ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert calibration.cache_file() == tmp_path / ".cache" / "inferline" / "calibration.json"


def test_a_damaged_file_is_measured_over_and_one_that_cannot_be_written_is_only_logged(cache, caplog, tmp_path,
                                                                                       monkeypatch):
    cache.write_text("{not json")
    measure, calls = counting(12)
    with caplog.at_level(logging.WARNING, logger="serving.engine.calibration"):
        assert calibration.remembered("small_rows", (1,), measure) == (12, None)
    assert "unreadable" in caplog.text and json.loads(cache.read_text())["version"] == 1
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(calibration.ENV, str(blocked / "calibration.json"))  # its folder is a file
    calibration.forget()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="serving.engine.calibration"):
        assert calibration.remembered("small_rows", (1,), measure) == (12, None)
    assert "could not be written" in caplog.text and f"{calibration.ENV}=off" in caplog.text
    assert len(calls) == 2


@pytest.mark.slow
def test_a_second_start_of_the_real_model_reads_its_limits_back(loaded_model, cache, monkeypatch, caplog):
    """The real model's prepare measures on the first start and reads the file on the next, logging where
    the limits came from, and chooses the same kernels."""
    model = loaded_model.model
    if not isinstance(model.linear, CpuLinear) or not has_panels([model.layers[0].qkv]):
        pytest.skip("the model keeps no panels here")
    for name in ("INFERLINE_SMALL_ROWS", "INFERLINE_PANEL_BURST"):
        monkeypatch.delenv(name, raising=False)
    for linear in (model.linear, model.head_linear):  # restored after prepare sets them
        monkeypatch.setattr(linear, "small_rows", linear.small_rows)
        monkeypatch.setattr(linear, "burst", linear.burst)
    with caplog.at_level(logging.INFO, logger="serving.engine.kernel_calibration"):
        model.prepare(40, 8)
    first = (model.linear.small_rows, model.head_linear.small_rows, model.linear.burst)
    assert "measured against oneDNN at start-up" in caplog.text
    calibration.forget()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="serving.engine.kernel_calibration"):
        model.prepare(40, 8)
    assert (model.linear.small_rows, model.head_linear.small_rows, model.linear.burst) == first
    assert f"at an earlier start-up here, kept in {cache}" in caplog.text
    assert "measured against oneDNN at start-up" not in caplog.text
    assert len(json.loads(cache.read_text())["entries"]) == 3  # the burst, the layers' limit, the LM head's
