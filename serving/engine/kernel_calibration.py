"""What start-up measures to choose between the CPU linear kernels (``cpu_linear.py``) on this machine.

Two choices depend on the machine more than on its instruction set (docs/measurements.md): up to how many
rows our small-batch kernel beats oneDNN (:func:`calibrate_small_rows`, for a model's layers and for its LM
head apart), and whether decode's matmuls prefetch the weights' next block themselves or leave it to the
hardware (:func:`calibrate_burst`). Each is timed on the model's own weights, once per machine, thread count
and model shape. This module measures; ``calibration.py`` keeps the answers between processes, so that a
restart reads them back instead of measuring again. ``INFERLINE_SMALL_ROWS`` and ``INFERLINE_PANEL_BURST``
set them instead.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from serving.engine import calibration
from serving.engine.cpu_linear import SMALL_ROWS, CpuWeight, has_panels, onednn_linear
from serving.engine.errors import EngineError

log = logging.getLogger(__name__)

#: Row counts at which start-up times the small-batch kernel against oneDNN, in order; the kernel keeps
#: each while its pass over the model's layers is faster, and the first loss ends the scan.
CALIBRATION_ROWS = (4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 80, 96, 128)


def calibrate_small_rows(weights: Sequence[CpuWeight], max_rows: int, burst: bool = True) -> int:
    """The most rows for which our small-batch kernel beat oneDNN here, timed on *weights* (the layers'
    matmuls, :func:`~serving.engine.models.llama.layer_linears`; or the LM head alone, whose crossover is its
    own).

    The crossover is the machine's, not the instruction set's: two AVX-512 machines put it at a few rows and at
    dozens, and the LM head's can differ from the layers' (docs/measurements.md). Each candidate is a pass over
    *weights* (cold, as in a step), both paths interleaved, best of two; the scan starts above ``SMALL_ROWS``
    and stops where ours is clearly slower (:func:`scan_rows`). Our kernel is timed with *burst* as the engine
    will run it (:func:`calibrate_burst`, measured first). Measured once per machine, thread count and model
    shape, and kept between processes (``serving/engine/calibration.py``).
    ``INFERLINE_SMALL_ROWS`` sets the limit instead (0: oneDNN only).
    """
    override = os.environ.get("INFERLINE_SMALL_ROWS", "").strip()
    if override:
        if not override.isdigit():
            raise EngineError(f"INFERLINE_SMALL_ROWS must be a whole number of rows (0: oneDNN only), "
                              f"got {override!r}")
        return int(override)
    key = (tuple(w.shape for w in weights), torch.get_num_threads(), min(max_rows, CALIBRATION_ROWS[-1]), burst)
    limit, kept_in = calibration.remembered("small_rows", key,
                                            lambda: _scan_small_rows(weights, max_rows, SMALL_ROWS, burst))
    if kept_in:
        log.info("small-batch kernel up to %d rows for %s (measured against oneDNN at an earlier start-up here, "
                 "kept in %s)", limit, _which(weights), kept_in)
    return limit


def _which(weights: Sequence[CpuWeight]) -> str:
    return "the layers" if len(weights) > 1 else f"the {weights[0].shape[0]} x {weights[0].shape[1]} matmul"


def _timed_pass(weights: Sequence[Any], inputs: dict[int, torch.Tensor], rows: int,
                linear: Callable[[torch.Tensor, Any], Any]) -> float:
    """Seconds for ``linear(x, w)`` over *weights* in order, x the first *rows* rows of *inputs* for w's width:
    a pass over the weights from memory (cold, as in a step), as the start-up calibrations time it."""
    start = time.perf_counter()
    for w in weights:
        linear(inputs[w.shape[1]][:rows], w)
    return time.perf_counter() - start


def _panels(burst: bool) -> Callable[[torch.Tensor, Any], Any]:
    return lambda x, w: torch.ops.inferline.panel_linear(x, w.panels, w.shape[0], None, burst)


def _scan_small_rows(weights: Sequence[CpuWeight], max_rows: int, default: int, burst: bool = True) -> int:
    if not has_panels(weights):
        return default
    inputs = {w.shape[1]: torch.randn(CALIBRATION_ROWS[-1], w.shape[1]) for w in weights}
    ours_linear, onednn = _panels(burst), (lambda x, w: onednn_linear(x, w.packed, None))

    def one_pass(rows: int, ours: bool) -> float:
        return _timed_pass(weights, inputs, rows, ours_linear if ours else onednn)

    def time_both(rows: int) -> tuple[float, float]:
        for w in {w.shape: w for w in weights}.values():  # oneDNN builds its kernel for a row count on first use
            onednn_linear(inputs[w.shape[1]][:rows], w.packed, None)
        ours = theirs = float("inf")
        for _ in range(2):
            ours, theirs = min(ours, one_pass(rows, True)), min(theirs, one_pass(rows, False))
        return ours, theirs

    with torch.inference_mode():
        limit = scan_rows(time_both, max_rows, default)
    log.info("small-batch kernel up to %d rows for %s (measured against oneDNN at start-up)", limit, _which(weights))
    return limit


#: Within this fraction of oneDNN's time, a row count is a tie: it neither ends the scan nor is kept.
SCAN_TIE = 0.05
#: Going without the decode matmuls' own prefetch must be this much faster to be chosen (:func:`calibrate_burst`).
BURST_MARGIN = 0.02


def calibrate_burst(weights: Sequence[CpuWeight]) -> bool:
    """Whether a decode step's matmuls (one row, one block of rows) stream *weights* faster asking for the
    next k-block themselves (the burst, ``small_linear.cpp``) than leaving it to the hardware prefetchers.

    Machine-dependent: on some machines the hardware prefetchers alone stream the weights faster
    (docs/measurements.md). Timed as the row limit is: passes over *weights*, both ways interleaved, best of
    five; the burst stays unless going without is more than :data:`BURST_MARGIN` faster. Once per machine,
    thread count and model shape, kept between processes (``serving/engine/calibration.py``);
    ``INFERLINE_PANEL_BURST`` (1 or 0) sets it instead.
    """
    override = os.environ.get("INFERLINE_PANEL_BURST", "").strip()
    if override:
        if override not in ("0", "1"):
            raise EngineError(f"INFERLINE_PANEL_BURST must be 1 (prefetch) or 0 (the hardware's), got {override!r}")
        return override == "1"
    if not has_panels(weights):
        return True
    key = (tuple(w.shape for w in weights), torch.get_num_threads())
    burst, kept_in = calibration.remembered("burst", key, lambda: _measure_burst(weights))
    if kept_in:
        log.info("decode matmuls: %s (measured at an earlier start-up here, kept in %s)", _burst_name(burst), kept_in)
    return burst


def _burst_name(burst: bool) -> str:
    return "the kernel prefetches" if burst else "hardware prefetch"


def _measure_burst(weights: Sequence[CpuWeight]) -> bool:
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    with torch.inference_mode():
        with_burst = without = float("inf")
        for _ in range(5):
            with_burst = min(with_burst, _timed_pass(weights, inputs, 1, _panels(True)))
            without = min(without, _timed_pass(weights, inputs, 1, _panels(False)))
    burst = not without * (1 + BURST_MARGIN) < with_burst
    log.info("decode matmuls: %s (a pass over the weights at 1 row: %.1f ms with the kernel's prefetch, "
             "%.1f ms without)", _burst_name(burst), with_burst * 1e3, without * 1e3)
    return burst


def scan_rows(time_both: Callable[[int], tuple[float, float]], max_rows: int, default: int) -> int:
    """The last of :data:`CALIBRATION_ROWS` above *default* and up to *max_rows* where ``time_both(rows)``
    (ours, oneDNN's) is in our favour, before the first where ours is clearly slower; *default* if none is.

    Clearly slower is more than :data:`SCAN_TIE` slower, twice: a loss is timed again (each side's best of the
    two) before it ends the scan, and a tie is passed over. A shared machine's bursts land on a pass now and
    then, and oneDNN's time is not monotone in the rows: if the first loss ended it, one slowed pass or a dip in
    oneDNN's time could end a scan early, scans in one process would disagree, and a server and the profile
    planning for it would choose different kernels for the same steps (bench/plan_vs_load.py;
    docs/measurements.md).
    """
    limit = default
    for rows in CALIBRATION_ROWS:
        if rows <= default:
            continue
        if rows > max_rows:
            break
        ours, theirs = time_both(rows)
        if ours > theirs * (1 + SCAN_TIE):
            again = time_both(rows)
            ours, theirs = min(ours, again[0]), min(theirs, again[1])
            if ours > theirs * (1 + SCAN_TIE):
                break
        if ours < theirs:
            limit = rows
    return limit
