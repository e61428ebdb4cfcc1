"""Int8 weights: symmetric, one scale per output channel, for every linear layer of a model.

    # inferline.yaml
    models:
      - name: smollm2-int8
        source: models/smollm2-135m-instruct
        dtype: int8

``dtype: int8`` loads float32 weights (from safetensors or a GGUF file) and
stores each linear weight (fused q/k/v, o, fused gate/up, down, and the LM
head, its own copy when tied to the embedding) as ``int8 * scale[:, None]``
with ``scale = max |row| / 127``. Activations, the KV cache, norms, biases and
the embedding lookup stay float32.

On CPU, batches of up to ``SMALL_ROWS`` rows (decoding a few sequences) go to
our own kernel (``kernels/small_linear.cpp``'s ``small_linear_int8``) over a
plain ``[out, in]`` int8 copy of each weight: each weight is converted to
float32 in a register and multiplied with float32 activations, so a decode step
streams a quarter of float32's bytes and keeps float32 activations (weight-only
quantization). Larger batches go to fbgemm's dynamic quantized linear
(``quantized::linear_dynamic``): it quantizes the activations to uint8 on the
fly and multiplies in integers (AVX512-VNNI), which is compute that a prefill
needs and a decode does not. fbgemm rather than ``torch._weight_int8pack_mm``
(int8 weight, float activations), which is slower than float32 itself, or
``torch._int_mm`` with our own per-row activation scales, which is slower than
fbgemm (the figures of both paths: docs/measurements.md).

Quantized activations cost more quality than the weights' rounding alone
(``bench/quality.py``'s perplexity, docs/engine.md "Precision"). Most of the
difference comes from the q/k/v input, which has a few large channels. There is
no SmoothQuant-style rescaling: its gain depends on the calibration text, and it
needs a pass at load.

Per-row activation ranges: fbgemm picks one range for the whole input tensor.
Used as is, one token with large activations coarsens every other token's, and
a row's result depends on the rest of the batch. With more than one row,
:func:`int8_linear` divides each row by its max ``|x|`` and appends a fixed row
holding +1 and -1, which pins the tensor's range to [-1, 1]: each row is
quantized against its own maximum, and its output is bit-identical whatever
else is in the batch (tested). The small-batch kernel's rows are independent of
each other by construction; a row there and the same row in a larger batch
(fbgemm) differ by fbgemm's activation rounding. Without the kernel a single
row goes to fbgemm as it is: its range is already its own.

The engine as a whole is not bit-for-bit batch-invariant in int8: batched
decode attention (padded SDPA groups) differs from single decode in the last
bits, as in float32, but int8's rounding turns more of those differences into
another greedy token than float32's does.

fbgemm's quantized ops are deprecated upstream. Where they are missing (for
the batches the kernel does not take), and on CUDA, the weight is dequantized
at each matmul (``F.linear`` on ``int8.to(x.dtype)``, scaled after): correct,
with int8's weight memory, but no faster than float32 (untested on a GPU so far).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.engine.kernels import cpu_ops


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """One linear layer's weight ``[out, in]`` as int8 with a float32 scale per output channel."""

    int8: torch.Tensor | None
    """``[out, in]`` int8, plain: the small-batch kernel's and the dequantizing path's matrix; None when
    fbgemm's packed copy is the only one."""
    scale: torch.Tensor
    """``[out]`` float32: ``weight ≈ int8 * scale[:, None]``."""
    packed: object | None
    """fbgemm's packed weight (CPU), or None."""
    range_row: torch.Tensor | None
    """``[1, in]`` float32 +1, -1, then zeros: appended to fbgemm's input to pin its range to [-1, 1]."""

    @property
    def in_features(self) -> int:
        return self.range_row.shape[1] if self.int8 is None else self.int8.shape[1]

    @property
    def num_bytes(self) -> int:
        """Bytes of the int8 matrices (the plain one and fbgemm's packed copy, each counted at the
        matrix's size: the packed copy's per-channel offsets and padding are not exposed) and the scales."""
        copies = (self.int8 is not None) + (self.packed is not None)
        return self.scale.numel() * (copies * self.in_features + self.scale.element_size())


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: ``(q, scale)`` with ``weight ≈ q * scale[:, None]``.

    ``q`` is in [-127, 127]; the error of each element is at most ``scale / 2`` of its row.
    """
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``q * scale[:, None]``."""
    return q.float() * scale[:, None]


def has_fbgemm(device: torch.device) -> bool:
    """Whether fbgemm's dynamic quantized linear serves int8 on *device*."""
    return (device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_dynamic"))


def has_small_kernel(device: torch.device) -> bool:
    """Whether the small-batch int8 kernel (float32 activations, CPU) is built."""
    return device.type == "cpu" and cpu_ops() is not None


def quantize_weight(weight: torch.Tensor, device: torch.device) -> Int8Weight:
    """*weight* ``[out, in]`` (any float dtype) as an :class:`Int8Weight` for :func:`int8_linear`: the plain
    int8 matrix where the small-batch kernel or the dequantizing path reads it, fbgemm's packed one where
    fbgemm serves (both on a CPU with our kernels built)."""
    q, scale = quantize_per_channel(weight)
    if not has_fbgemm(device):
        return Int8Weight(q.to(device), scale.to(device), None, None)
    plain = q if has_small_kernel(device) else None
    with warnings.catch_warnings():
        # Quantized tensors are deprecated upstream; fbgemm's prepack takes nothing else.
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(
            q, scale.double(), torch.zeros_like(scale, dtype=torch.int64), 0)
        packed = torch.ops.quantized.linear_prepack(qweight, None)
    range_row = torch.zeros(1, weight.shape[1])
    range_row[0, :2] = torch.tensor([1.0, -1.0])
    return Int8Weight(plain, scale, packed, range_row)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]`` float32."""
    if weight.int8 is not None and x.shape[0] <= SMALL_ROWS and x.dtype == torch.float32 and x.is_cpu:
        ops = cpu_ops()
        if ops is not None:
            return ops.small_linear_int8(x, weight.int8, weight.scale, bias)
    if weight.packed is None:
        out = F.linear(x, weight.int8.to(x.dtype)) * weight.scale
        return out if bias is None else out + bias
    if x.shape[0] == 1:  # one row: fbgemm's per-tensor range is already the row's own
        out = torch.ops.quantized.linear_dynamic(x, weight.packed, _REDUCE_RANGE)
        return out if bias is None else out.add_(bias)
    absmax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_min_(_TINY)
    rows = torch.cat((x / absmax, weight.range_row))
    out = torch.ops.quantized.linear_dynamic(rows, weight.packed, _REDUCE_RANGE)[:-1]
    return out.mul_(absmax) if bias is None else torch.addcmul(bias, out, absmax)


_TINY = torch.finfo(torch.float32).tiny

#: Rows up to this go to the small-batch kernel when it is built; more go to fbgemm, which catches up
#: within a few rows on an AVX-512 machine with VNNI (docs/measurements.md). Not tuned for AVX2-only
#: machines, where fbgemm has no VNNI and the kernel half the lanes.
SMALL_ROWS = 3

#: fbgemm's 7-bit activation range guards against int16 overflow on CPUs without VNNI.
_REDUCE_RANGE = not torch.cpu._is_vnni_supported()
