"""Float32 linear layers on the CPU: which kernel runs a matmul, and each kernel's copy of the weights.

They run through oneDNN with weights packed once at load time instead of through ``F.linear`` (MKL), which
does not pick its fast kernels on AMD processors. Small batches instead go to our own kernel
(``kernels/small_linear.cpp``) over a second copy of each weight, its columns in panels: decoding a few
sequences, each matmul is a memory-bound pass over the weights, and oneDNN's per-call OpenMP wake-up is a
large share of the step. How many rows "small" is depends on the machine, from a few to dozens
(docs/measurements.md), so start-up measures it on the model's own weights, from :data:`SMALL_ROWS` up
(``kernel_calibration.py``). The panel copies double the linear weights' memory, so they are kept only for
models whose linear weights fit in :data:`PANEL_COPY_MAX_BYTES`; they lie back to back in one buffer on huge
pages, in the order a step reads them (:func:`in_one_arena`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from serving.engine.kernels import cpu_ops
from serving.engine.memory import empty_on_huge_pages


@dataclass(frozen=True, slots=True)
class CpuWeight:
    """A float32 linear weight on the CPU: oneDNN's packed layout for batches, and for small batches
    the small-batch kernel's panels (``[ceil(out / width), in, width]``, see ``kernels/small_linear.cpp``;
    :class:`CpuLinear`; None: not kept, oneDNN takes every batch)."""

    packed: torch.Tensor
    panels: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.packed.shape


#: The batch size oneDNN packs weights for; measured best across batch 1 to 512.
_PACK_FOR_BATCH = 64


def _small_rows() -> int:
    """Rows up to this go to the small-batch kernel before start-up measures more
    (:func:`~serving.engine.kernel_calibration.calibrate_small_rows`).

    3 with AVX-512, where oneDNN catches up with ours at 4 rows. 8 with AVX2 only, where oneDNN's
    small-batch kernels are slower and ours stays ahead to 8 rows; it covers a speculative decode's
    verify step (a sequence and its 4 guesses) there. The timings: docs/measurements.md.
    """
    from serving.engine.kernels import cpu_flags

    return 3 if "avx512f" in cpu_flags().split() else 8


SMALL_ROWS = _small_rows()
#: The panel copies for the small-batch kernel are kept while all linear weights together stay under
#: this (models up to about 500M parameters in float32); larger models run every batch through oneDNN.
PANEL_COPY_MAX_BYTES = 2 << 30


def use_onednn(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def bucket_rows(rows: int) -> int:
    """*rows* rounded up to one of a few sizes: exact to 16, then 8 sizes per doubling (at most 12.5%
    more rows). oneDNN (and torch's ideep over it) builds and caches a kernel, with its scratch memory,
    for every row count it sees; a step's token count takes any value up to the batch budget, so
    without buckets the caches, and the server's memory, grow with every new count until they reach
    their capacity."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN at *x*'s row bucket, *weight* packed for oneDNN (as in
    :func:`pack_for_cpu`)."""
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


class CpuLinear:
    """A model's ``linear`` over :class:`CpuWeight`: our small-batch kernel up to ``small_rows`` rows
    (where the weight keeps its panels), oneDNN above. ``small_rows`` starts at :data:`SMALL_ROWS`; the
    model's start-up measures it on the machine
    (:func:`~serving.engine.kernel_calibration.calibrate_small_rows`)."""

    __slots__ = ("burst", "small_rows")

    def __init__(self) -> None:
        self.small_rows = SMALL_ROWS
        #: Whether up to one block of rows (decode) prefetches the next k-block itself
        #: (:func:`~serving.engine.kernel_calibration.calibrate_burst`).
        self.burst = True

    def __call__(self, x: torch.Tensor, weight: CpuWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if self.takes_small(x.shape[0], weight):
            return torch.ops.inferline.panel_linear(x, weight.panels, weight.shape[0], bias, self.burst)
        return onednn_linear(x, weight.packed, bias)

    def takes_small(self, rows: int, weight: CpuWeight) -> bool:
        """Whether *rows* rows against *weight* go to the small-batch kernel (else to oneDNN)."""
        return weight.panels is not None and rows <= self.small_rows


def has_panels(weights: Sequence[object]) -> bool:
    """Whether every one of *weights* keeps the panel copy the small-batch kernel reads."""
    return all(isinstance(w, CpuWeight) and w.panels is not None for w in weights)


def pack_for_cpu(weights: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> list[CpuWeight]:
    """*weights* (float32 ``[out, in]``, in the order a step reads them) as :class:`CpuWeight`: packed for
    oneDNN, with panels for the small-batch kernel where our kernels are built and all of them together fit in
    :data:`PANEL_COPY_MAX_BYTES`."""
    pack = torch.ops.mkldnn._reorder_linear_weight
    keep = cpu_ops() is not None and sum(w.numel() * w.element_size() for w in weights) <= PANEL_COPY_MAX_BYTES
    panels = (in_one_arena(weights, dtype, device, panel_shape, torch.ops.inferline.pack_panels)
              if keep else [None] * len(weights))
    return [CpuWeight(pack(w, _PACK_FOR_BATCH), p) for w, p in zip(weights, panels, strict=True)]


def build_onednn_kernels(weight: torch.Tensor | CpuWeight, bias: torch.Tensor | None, max_rows: int,
                         small_rows: int, dtype: torch.dtype) -> None:
    """Run *weight* once at every row bucket up to *max_rows* rows that reaches oneDNN (above *small_rows*
    where it keeps panels), so that oneDNN builds those kernels now: memory stays flat while serving and no
    request waits for a kernel to be generated."""
    packed, first = weight, 1
    if isinstance(weight, CpuWeight):  # rows the small-batch kernel takes never reach oneDNN
        packed, first = weight.packed, 1 if weight.panels is None else small_rows + 1
    x = torch.zeros(bucket_rows(max_rows), weight.shape[1], dtype=dtype)
    for rows in sorted({bucket_rows(n) for n in range(first, max_rows + 1)}):
        onednn_linear(x[:rows], packed, bias)


def in_one_arena(weights: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
                 shape: Callable[[torch.Size], tuple[int, ...]] = tuple,
                 fill: Callable[[torch.Tensor, torch.Tensor], Any] = torch.Tensor.copy_) -> list[torch.Tensor]:
    """Copies of *weights*, in this order, back to back in one buffer on huge pages (serving/engine/memory.py):
    a decode step streams them front to back. Each copy has ``shape(weight.shape)`` and is written by
    ``fill(copy, weight)`` (default: a plain copy; every element must be written)."""
    shapes = [shape(w.shape) for w in weights]
    arena = empty_on_huge_pages((sum(math.prod(s) for s in shapes),), dtype, device)
    copies, offset = [], 0
    for weight, copy_shape in zip(weights, shapes, strict=True):
        copy = arena[offset:offset + math.prod(copy_shape)].view(copy_shape)
        fill(copy, weight)
        copies.append(copy)
        offset += copy.numel()
    return copies


def panel_shape(shape: torch.Size) -> tuple[int, int, int]:
    """The small-batch kernel's panels for a ``[out, in]`` weight."""
    width = torch.ops.inferline.panel_width()
    return -(-shape[0] // width), shape[1], width
