"""Int8 weights: symmetric, one scale per output channel, for every linear layer of a model.

    # inferline.yaml
    models:
      smollm2-int8:
        source: models/smollm2-135m-instruct
        dtype: int8

``dtype: int8`` loads float32 weights (from safetensors or a GGUF file) and
stores each linear weight (fused q/k/v, o, fused gate/up, down, and the LM
head, its own copy when tied to the embedding) as ``int8 * scale[:, None]``
with ``scale = max |row| / 127``. Activations, the KV cache, norms, biases and
the embedding lookup stay float32: weight-only quantization, in prefill as in
decode, so the only loss is the weights' rounding (``bench/quality.py``).

On CPU, batches of up to ``KERNEL_ROWS`` rows (decode, small prefill chunks)
go to our own kernel (``kernels/small_linear.cpp``'s ``small_linear_int8``):
each int8 weight vector is widened to float32 in registers and multiplied with
float32 activations, so a decode step streams a quarter of float32's bytes.
Larger batches (prefill) dequantize the weight at each matmul (``F.linear`` on
``int8.to(float32)``, the scale applied to the result), which costs a pass
over the weight on top of the matmul's work; without the kernel (or on CUDA)
every batch does. A row's result never depends on the other rows of its batch.
Activations are never quantized: an 8-bit activation path (fbgemm) cost far
more quality than the weights' rounding (docs/engine.md, "Precision").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.engine.kernels import cpu_ops


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """One linear layer's weight ``[out, in]`` as int8 with a float32 scale per output channel."""

    int8: torch.Tensor
    """``[out, in]`` int8."""
    scale: torch.Tensor
    """``[out]`` float32: ``weight ≈ int8 * scale[:, None]``."""

    @property
    def in_features(self) -> int:
        return self.int8.shape[1]

    @property
    def num_bytes(self) -> int:
        """Bytes of the int8 matrix and the scales."""
        return self.int8.numel() + self.scale.numel() * self.scale.element_size()


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


def has_small_kernel(device: torch.device) -> bool:
    """Whether the small-batch int8 kernel (float32 activations, CPU) is built."""
    return device.type == "cpu" and cpu_ops() is not None


def quantize_weight(weight: torch.Tensor, device: torch.device) -> Int8Weight:
    """*weight* ``[out, in]`` (any float dtype) as an :class:`Int8Weight` for :func:`int8_linear`."""
    q, scale = quantize_per_channel(weight)
    return Int8Weight(q.to(device), scale.to(device))


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]``, activations in their own dtype (weight-only)."""
    if x.shape[0] <= KERNEL_ROWS and x.dtype == torch.float32 and x.is_cpu:
        ops = cpu_ops()
        if ops is not None:
            return ops.small_linear_int8(x, weight.int8, weight.scale, bias)
    out = F.linear(x, weight.int8.to(x.dtype)) * weight.scale
    return out if bias is None else out + bias


#: Rows up to this go to the kernel when it is built, more to a dequantized matmul: where the kernel
#: stops being ahead on the layers' shapes (docs/measurements.md, "int8").
KERNEL_ROWS = 32
