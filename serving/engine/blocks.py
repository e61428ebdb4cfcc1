"""GGUF block formats served as they are: a ``.gguf`` model keeps its file's size in memory.

    # inferline.yaml
    models:
      smol-q4:
        source: models/smollm2-135m-instruct/model.gguf
        dtype: gguf          # what ``auto`` picks for a .gguf on a CPU with our kernels

``dtype: gguf`` reads the file's tensors (``serving/engine/gguf_file.py``, memory-mapped) and keeps every weight
in Q8_0, Q4_0 or Q4_1 as its rows of blocks of 32 (:class:`BlockWeight`): the linear layers, and the
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

Tensors in any other type (F32 norms, F16, the K-quants, ...) are de-quantized to float32 at load by
the ``gguf`` package and served as plain float32 weights (their names are logged). Q, K and V (and
gate and up) are fused into one weight where they share a format; otherwise they are de-quantized.

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
    """*weights* stacked along the outputs: still blocks where they share a format, else float32."""
    first = weights[0]
    if all(isinstance(w, BlockRows) and w.format == getattr(first, "format", None) for w in weights):
        return BlockRows(torch.cat([w.data for w in weights]), first.format, first.in_features)
    return torch.cat([dequantize_rows(w) if isinstance(w, BlockRows) else w for w in weights])


def dequantize_rows(weight: BlockRows) -> torch.Tensor:
    """A file's rows of blocks as float32 (the ``gguf`` package's de-quantization)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(weight.data.numpy(), GGMLQuantizationType[weight.format])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(weight.shape)


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
    widened: dict[str, list[str]] = {}
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
        else:
            if qtype != GGMLQuantizationType.F32:
                widened.setdefault(qtype.name, []).append(tensor.name)
            values = np.array(dequantize(tensor.data, qtype), dtype=np.float32)  # a copy, off the mapped file
            weight = torch.from_numpy(values.reshape(shape))
        if architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            order = unpermute_rows(shape[0], heads)
            weight = weight.take(order) if isinstance(weight, BlockRows) else weight[order].contiguous()
        state[name] = weight
    for qtype, names in widened.items():
        log.info("%s: %d tensors in %s have no block kernel here and are de-quantized to float32 (%s)",
                 path, len(names), qtype, ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
    if "model.embed_tokens.weight" not in state:
        raise EngineError(f"{path}: no token_embd.weight tensor: not a Llama-family GGUF file")
    return state, file.values.get("tokenizer.chat_template")
