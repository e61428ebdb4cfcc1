"""GGUF block formats served as they are: a ``.gguf`` model keeps its file's size in memory.

    # inferline.yaml
    models:
      smol-q4:
        source: models/smollm2-135m-instruct/model.gguf
        dtype: gguf          # what ``auto`` picks for a .gguf on a CPU with our kernels

``dtype: gguf`` reads the file's tensors (``serving/engine/gguf_file.py``, memory-mapped) and keeps every weight
in Q8_0, Q4_0 or Q4_1 as its rows of blocks of 32 (:class:`BlockWeight`; other types below): the linear layers, and the
token embedding, whose rows are widened when looked up and which also serves as a tied LM head. Our
kernel (``kernels/block_linear.cpp``) takes every batch, decode and prefill: it widens each block's
quants to float32 in registers and multiplies float32 activations with them, the block's scale applied
once to the sums; above 8 rows it widens each weight once per call into L1 and multiplies it there in
register blocks, at about float32 oneDNN's prefill speed (docs/measurements.md, "GGUF blocks").
At load the blocks are regrouped (:meth:`BlockRows.pack`, same bytes) so that a vector lane holds one
output. Activations and norms stay float32: the products are the float32 reference's on the
de-quantized weights, so the only loss is the file's own rounding (and the KV cache's: float16, as
llama.cpp keeps it; ``LlamaModel.kv_dtype``). llama.cpp also rounds activations to 8 bits for these
formats; we do not.

Other quantized types stay in blocks too (:func:`kernel_blocks`, logged by type at load): Q4_K's
sub-blocks of 32 become Q4_1 blocks, the same nibbles with their scale ``d * sc`` and minimum
``-dmin * m`` rounded to fp16 (at most 2^-11 of each term; 20 bytes a block where Q4_K takes 18);
Q5_0 becomes Q8_0 with the file's own scales, exactly (34 bytes for 22); any other (Q5_1, Q5_K,
Q6_K, Q2_K, Q3_K, the IQ types) is re-quantized to Q8_0 from its values, which adds at most 1/254
of each block's largest weight, an eighth of a 6-bit step. That is what a Q4_K_M file needs: its
Q4_K and Q6_K tensors, and for a small model like the bundled one the Q5_0 and Q8_0 that llama.cpp
writes where a row is not a multiple of 256. Unquantized tensors (F32 norms, F16, BF16) are widened
to float32 (their names are logged). Q, K and V (and gate and up) are fused into one weight: in
their format where they share one, else all in Q8_0 (:func:`concat`).

For the ``llama`` architecture, llama.cpp's converter stores Q and K with their rotary halves
interleaved (``permute`` in convert_hf_to_gguf.py); their rows are put back in Hugging Face's order at
load, as transformers does (other architectures, Qwen2's, are stored in order).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from serving.engine.errors import EngineError
from serving.engine.gguf_file import GGUFFile
from serving.engine.kernels import cpu_ops

log = logging.getLogger(__name__)

#: The formats with a kernel: ggml's type number, and bytes per block of 32.
FORMATS = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
BLOCK = 32


@dataclass(frozen=True, slots=True)
class BlockRows:
    """A ``[out, in]`` weight as the file stores it: ``data`` ``[out, in / 32 * block_bytes]`` uint8, a row of
    blocks per output. Rows can be reordered and stacked; :meth:`pack` makes the kernel's layout."""

    data: torch.Tensor
    format: str
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.in_features))

    def take(self, order: torch.Tensor) -> BlockRows:
        return BlockRows(self.data[order].contiguous(), self.format, self.in_features)

    def pack(self) -> BlockWeight:
        code = FORMATS[self.format][0]
        packed = torch.ops.inferline.block_pack(self.data, code, self.in_features)
        return BlockWeight(packed, self.format, self.data.shape[0], self.in_features)


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """A ``[out, in]`` weight in the kernel's layout (``kernels/block_linear.cpp``: groups of outputs, the same
    bytes as the file's blocks regrouped), for :func:`block_linear` and :func:`block_embedding`."""

    packed: torch.Tensor
    format: str
    out_features: int
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def code(self) -> int:
        return FORMATS[self.format][0]

    @property
    def num_bytes(self) -> int:
        return self.packed.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]``."""
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows *ids* (int64) of the weight, float32 ``[len(ids), in]``."""
        return torch.ops.inferline.block_rows(self.packed, self.code, self.out_features, self.in_features, ids)


def block_linear(x: torch.Tensor, weight: BlockWeight | torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a :class:`BlockWeight` (or a plain float32 weight: a file's other types)."""
    if not isinstance(weight, BlockWeight):
        return F.linear(x, weight, bias)
    return torch.ops.inferline.block_linear(x.contiguous(), weight.packed, weight.code, weight.out_features,
                                            weight.in_features, bias)


def block_embedding(ids: torch.Tensor, weight: BlockWeight | torch.Tensor) -> torch.Tensor:
    """The rows *ids* of an embedding table, widened to float32 when it is in blocks."""
    if isinstance(weight, BlockWeight):
        return weight.rows(ids)
    return F.embedding(ids, weight)


def concat(weights: list[BlockRows | torch.Tensor]) -> BlockRows | torch.Tensor:
    """*weights* stacked along the outputs: in their format where they share one, in Q8_0 where they are blocks of
    different formats (a Q4 weight re-quantized, a 4-bit step is 16 8-bit ones), else float32."""
    first = weights[0]
    if all(isinstance(w, BlockRows) and w.format == first.format for w in weights):
        return BlockRows(torch.cat([w.data for w in weights]), first.format, first.in_features)
    if all(isinstance(w, BlockRows) for w in weights):
        weights = [w if w.format == "Q8_0" else requantize_q8_0(dequantize_rows(w).numpy()) for w in weights]
        return concat(weights)
    return torch.cat([dequantize_rows(w) if isinstance(w, BlockRows) else w for w in weights])


def dequantize_rows(weight: BlockRows) -> torch.Tensor:
    """A file's rows of blocks as float32 (the ``gguf`` package's de-quantization)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(weight.data.numpy(), GGMLQuantizationType[weight.format])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(weight.shape)


def requantize_q8_0(values: np.ndarray) -> BlockRows:
    """Float32 ``[out, in]`` values as Q8_0 rows (ggml's rounding: each block's largest magnitude to 127)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    data = quantize(np.ascontiguousarray(values, dtype=np.float32), GGMLQuantizationType.Q8_0)
    return BlockRows(torch.from_numpy(data), "Q8_0", values.shape[1])


def q4_k_as_q4_1(data: np.ndarray, shape: list[int]) -> BlockRows | None:
    """Q4_K rows as Q4_1 rows: each super-block of 256 is 8 sub-blocks of 32 with a 6-bit scale and minimum
    under the super-block's fp16 ``d`` and ``dmin``; each becomes a Q4_1 block with the same 4-bit quants, scale
    ``d * sc`` and minimum ``-dmin * m`` in fp16. None where a product does not fit fp16."""
    from gguf.quants import Q4_K

    supers = data.reshape(-1, 144)  # d, dmin (fp16), 12 bytes of 6-bit scales and minimums, 128 bytes of quants
    count = supers.shape[0]
    d = supers[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = supers[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(supers[:, 4:16].copy())
    with np.errstate(over="ignore"):
        scale = (d * sc.astype(np.float32)).astype(np.float16)
        minimum = (-(dmin * m.astype(np.float32))).astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(minimum).all()):
        return None
    # Quant byte j of a 64-weight pair of sub-blocks holds weight j (low nibble) and weight 32 + j (high).
    quants = supers[:, 16:].reshape(count, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    quants = (quants & 0x0F).reshape(count, 8, 32)
    out = np.empty((count, 8, 20), dtype=np.uint8)
    out[..., 0:2] = scale.view(np.uint8).reshape(count, 8, 2)
    out[..., 2:4] = minimum.view(np.uint8).reshape(count, 8, 2)
    out[..., 4:] = quants[..., :16] | (quants[..., 16:] << 4)  # Q4_1: byte j holds weights j and 16 + j
    return BlockRows(torch.from_numpy(out.reshape(shape[0], -1)), "Q4_1", shape[1])


def q5_0_as_q8_0(data: np.ndarray, shape: list[int]) -> BlockRows:
    """Q5_0 rows as Q8_0 rows, exactly: a Q5_0 weight is ``d * (q - 16)`` with q of 5 bits, so ``q - 16`` is
    the int8 quant under the same fp16 scale."""
    raw = data.reshape(-1, 22)  # d (fp16), 32 high bits (bit j: weight j's), 16 bytes of low nibbles
    high = np.unpackbits(raw[:, 2:6], axis=1, bitorder="little")  # [blocks, 32], weight order
    low = np.concatenate([raw[:, 6:] & 0x0F, raw[:, 6:] >> 4], axis=1)  # byte j: weights j and 16 + j
    quants = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8)
    out = np.concatenate([raw[:, 0:2], quants.view(np.uint8)], axis=1)
    return BlockRows(torch.from_numpy(out.reshape(shape[0], -1)), "Q8_0", shape[1])


def kernel_blocks(data: np.ndarray, qtype: str, shape: list[int]) -> tuple[BlockRows, str]:
    """A 2-D tensor of a quantized type without a kernel as rows in a format with one, and how (for the log)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if qtype == "Q4_K":
        rows = q4_k_as_q4_1(data, shape)
        if rows is not None:
            return rows, "as Q4_1 (the same quants, scales rounded to fp16)"
    if qtype == "Q5_0":
        return q5_0_as_q8_0(data, shape), "as Q8_0 (the same quants and scales)"
    values = np.asarray(dequantize(data, GGMLQuantizationType[qtype]), dtype=np.float32).reshape(shape)
    return requantize_q8_0(values), "re-quantized to Q8_0"


def is_quantized(qtype: int) -> bool:
    """Whether ggml type *qtype* stores blocks (Q4_K, IQ2_XS, ...) rather than single numbers (F32, F16, BF16)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0] > 1


def pack(weight: BlockRows | torch.Tensor) -> BlockWeight | torch.Tensor:
    return weight.pack() if isinstance(weight, BlockRows) else weight


def check_kernels(device: torch.device) -> None:
    """Refuse ``dtype: gguf`` where the kernels cannot run (not a CPU, or not built)."""
    if device.type != "cpu":
        raise EngineError("dtype gguf runs on the CPU only (our block kernels); use dtype float32 or bfloat16 "
                          "on a GPU, which de-quantizes the file at load")
    if cpu_ops() is None:
        from serving.engine.kernels import disabled_reason

        raise EngineError(f"dtype gguf needs our C++ CPU kernels, which are unavailable ({disabled_reason()}); "
                          "use dtype float32, which de-quantizes the file at load")


# GGUF tensor names to Hugging Face's, for the Llama family.
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of the Llama family, or None (not one the forward reads)."""
    if name in _NAMES:
        return _NAMES[name]
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def unpermute_rows(rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary ``permute`` of a Q or K weight of *rows* rows."""
    dim = rows // num_heads // 2
    return torch.arange(rows).reshape(num_heads, dim, 2).transpose(1, 2).reshape(rows)


def chat_template(path: Path) -> str | None:
    """The chat template a GGUF file carries (``tokenizer.chat_template``), which transformers' GGUF
    tokenizer leaves out."""
    return GGUFFile(path, ["tokenizer.chat_template"]).values.get("tokenizer.chat_template")


def read_gguf(path: Path, num_heads: int, num_kv_heads: int) -> tuple[dict[str, BlockRows | torch.Tensor], str | None]:
    """Every tensor the forward reads, by its Hugging Face name (blocks where the format has a kernel, float32
    otherwise; Q and K rows in Hugging Face's order), and the file's chat template."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    file = GGUFFile(path, ["tokenizer.chat_template"])
    architecture = file.values.get("general.architecture")
    state: dict[str, BlockRows | torch.Tensor] = {}
    converted: dict[tuple[str, str], list[str]] = {}
    for tensor in file.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        qtype = GGMLQuantizationType(tensor.type)
        shape = list(tensor.shape)
        if qtype.name in FORMATS and len(shape) == 2 and shape[1] % BLOCK == 0:
            with warnings.catch_warnings():  # a read-only view of the mapped file, never written: packed at load
                warnings.simplefilter("ignore", UserWarning)
                weight: BlockRows | torch.Tensor = BlockRows(torch.from_numpy(tensor.data), qtype.name, shape[1])
        elif is_quantized(qtype) and len(shape) == 2 and shape[1] % BLOCK == 0:
            weight, how = kernel_blocks(tensor.data, qtype.name, shape)
            converted.setdefault((qtype.name, how), []).append(tensor.name)
        else:
            if qtype != GGMLQuantizationType.F32:
                converted.setdefault((qtype.name, "de-quantized to float32 (no block kernel)"), []).append(
                    tensor.name)
            values = np.array(dequantize(tensor.data, qtype), dtype=np.float32)  # a copy, off the mapped file
            weight = torch.from_numpy(values.reshape(shape))
        if architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            order = unpermute_rows(shape[0], heads)
            weight = weight.take(order) if isinstance(weight, BlockRows) else weight[order].contiguous()
        state[name] = weight
    for (qtype, how), names in converted.items():
        log.info("%s: %d tensors in %s served %s (%s)", path, len(names), qtype, how,
                 ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
    if "model.embed_tokens.weight" not in state:
        raise EngineError(f"{path}: no token_embd.weight tensor: not a Llama-family GGUF file")
    return state, file.values.get("tokenizer.chat_template")
