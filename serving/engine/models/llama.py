"""The Llama-family forward pass (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5) over a paged KV cache.

Weights are plain tensors, not ``nn.Module``s: the step runs thirty layers of
a handful of ops each, and module call overhead would be a visible share of a
small model's decode step on CPU. Q, K and V are one fused matmul, and so are
the MLP's gate and up projections.

On a CPU with oneDNN, float32 linear weights are packed at load time and each
matmul runs through oneDNN or, for a few rows, our small-batch kernel
(``serving/engine/cpu_linear.py``); :meth:`LlamaModel.prepare` measures where
one takes over from the other (``serving/engine/kernel_calibration.py``).

A GGUF file loaded with ``dtype: gguf`` keeps its Q8_0, Q4_0 and Q4_1 weights as blocks
(``serving/engine/blocks.py``): the linear layers, the embedding lookup and a tied LM head all read
the same packed blocks, through our block kernel at every batch size.

With ``int8=True`` every linear weight (and a copy of a tied LM head) is
quantized per output channel (``serving/engine/quant.py``); activations, the
KV cache and the embedding lookup stay in *dtype* (float32). On CPU the plain
int8 matrices that the small-batch kernel reads lie in one huge-page arena too.

With float32 activations on the CPU and our C++ kernels built, the small steps
between the matmuls run fused (``kernels/layer_ops.cpp``): RMSNorm with the
residual add before it, rotary embedding in place inside the qkv rows, and
SiLU-and-multiply. Same arithmetic as the torch ops, a fraction of their
dispatch cost at decode batch sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from serving.engine.attention import AttentionMetadata, paged_attention, write_kv
from serving.engine.blocks import BlockRows, BlockWeight, block_embedding, block_linear, concat, pack
from serving.engine.cpu_linear import (
    CpuLinear,
    CpuWeight,
    bucket_rows,
    build_onednn_kernels,
    in_one_arena,
    onednn_linear,
    pack_for_cpu,
    use_onednn,
)
from serving.engine.kernel_calibration import calibrate_burst, calibrate_small_rows
from serving.engine.kernels import cpu_ops
from serving.engine.quant import Int8Weight, int8_linear, quantize_weight


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The sizes the forward pass needs, read from an HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_config(cls, config) -> LlamaShape:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=num_heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
            max_position=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 has biases on q, k and v but says so only through its model type.
            attention_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
        )


#: A linear layer's weight as the forward's ``linear`` takes it: dense, oneDNN-packed (with or without its
#: panels), int8, or a GGUF file's blocks.
Weight = torch.Tensor | CpuWeight | Int8Weight | BlockWeight

#: The layer weights that go through ``linear`` (packed or quantized at load).
LINEARS = ("qkv", "o", "gate_up", "down")


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight
    down: Weight


Linear = Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]


def layer_linears(layers: Sequence[LayerWeights]) -> list[Weight]:
    """*layers*' matmul weights in step order."""
    return [getattr(layer, name) for layer in layers for name in LINEARS]


class LlamaModel:
    """Weights plus the forward pass; the KV cache belongs to the model runner."""

    def __init__(self, config, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 *, int8: bool = False):
        """*dtype* is the activations' and KV cache's; *int8* quantizes the linear weights. Weights in *state*
        that are a GGUF file's blocks (:class:`BlockRows`, ``serving/engine/blocks.py``) are served as blocks."""
        self.shape = shape = LlamaShape.from_config(config)
        self.dtype, self.device, self.is_int8 = dtype, device, int8
        self.is_blocks = any(isinstance(t, BlockRows) for t in state.values())
        #: The KV cache's dtype: the activations', except for a GGUF file's blocks on the CPU, which keep K and V
        #: in float16 as llama.cpp does (half the cache's memory and of what attention reads; the attention
        #: kernel widens them to float32).
        self.kv_dtype = torch.float16 if self.is_blocks and device.type == "cpu" else dtype
        self.embed: torch.Tensor | BlockWeight = pack(state["model.embed_tokens.weight"])
        self.norm = state["model.norm.weight"]
        # A tied LM head in blocks is the embedding's own packed weight: the kernel reads the same layout.
        self.lm_head: Weight = self.embed if shape.tie_word_embeddings else pack(state["lm_head.weight"])
        self.layers = [_layer(state, i, shape.attention_bias) for i in range(shape.num_layers)]
        self.linear: Linear = F.linear
        """The layers' matmuls; ``head_linear`` the LM head's (a CpuLinear of its own: its crossover differs)."""
        if self.is_blocks:
            for layer in self.layers:
                for name in LINEARS:
                    setattr(layer, name, pack(getattr(layer, name)))
            self.linear = block_linear
        elif int8:
            self._quantize()
        elif use_onednn(dtype, device):
            self._pack()
        self.head_linear: Linear = CpuLinear() if isinstance(self.linear, CpuLinear) else self.linear
        self.cos, self.sin = _rope_tables(config, shape, dtype, device)
        self._q_size = shape.num_heads * shape.head_dim
        self._kv_size = shape.num_kv_heads * shape.head_dim
        self.fused = cpu_ops() if device.type == "cpu" and dtype == torch.float32 else None
        """``torch.ops.inferline`` when the layer's small steps run fused (see the module docstring)."""

    def _pack(self) -> None:
        packed = iter(pack_for_cpu([*layer_linears(self.layers), self.lm_head], self.dtype, self.device))
        for layer in self.layers:
            for name in LINEARS:
                setattr(layer, name, next(packed))
        # A tied LM head's panels are a copy of their own: the embedding lookup keeps the plain matrix.
        self.lm_head = next(packed)
        self.linear = CpuLinear()

    def _quantize(self) -> None:
        for layer in self.layers:
            for name in LINEARS:
                setattr(layer, name, quantize_weight(getattr(layer, name), self.device))
        self.lm_head = quantize_weight(self.lm_head, self.device)  # its own copy: the embedding stays dense
        weights = [getattr(layer, name) for layer in self.layers for name in LINEARS] + [self.lm_head]
        if self.device.type == "cpu":
            # The plain int8 matrices a decode step streams, back to back in step order, as _pack's float32 ones.
            plain = iter(in_one_arena([w.int8 for w in weights], torch.int8, self.device))
            for layer in self.layers:
                for name in LINEARS:
                    setattr(layer, name, replace(getattr(layer, name), int8=next(plain)))
            self.lm_head = replace(self.lm_head, int8=next(plain))
        self.linear = int8_linear

    def prepare(self, max_rows: int, max_logits_rows: int) -> None:
        """Run each distinct linear shape once at every row bucket a step can reach (up to *max_rows*
        tokens, *max_logits_rows* rows of logits), so that oneDNN builds its kernels now: memory stays
        flat while serving and no request waits for a kernel to be generated. No-op off oneDNN."""
        if self.linear is not onednn_linear and not isinstance(self.linear, CpuLinear):
            return
        if isinstance(self.linear, CpuLinear) and isinstance(self.head_linear, CpuLinear):
            linears = layer_linears(self.layers)
            burst = calibrate_burst([*linears, self.lm_head])
            self.linear.burst = self.head_linear.burst = burst
            self.linear.small_rows = calibrate_small_rows(linears, max_rows, burst)
            self.head_linear.small_rows = calibrate_small_rows([self.lm_head], max_logits_rows, burst)
        layer = self.layers[0]
        weights = [(layer.qkv, layer.qkv_bias, max_rows, self.linear), (layer.o, None, max_rows, self.linear),
                   (layer.gate_up, None, max_rows, self.linear), (layer.down, None, max_rows, self.linear),
                   (self.lm_head, None, max_logits_rows, self.head_linear)]
        with torch.inference_mode():
            for weight, bias, limit, linear in weights:
                small_rows = linear.small_rows if isinstance(linear, CpuLinear) else 0
                build_onednn_kernels(weight, bias, limit, small_rows, self.dtype)

    def weight_bytes(self) -> int:
        """Bytes held by the weights the forward reads, as stored: packed copies (and the panels kept
        beside them for small batches) and int8 matrices with their scales count at their own size, and a
        tensor read twice (a tied LM head and the embedding, as loaded) once."""
        weights = [self.embed, self.norm, self.lm_head]
        weights += [getattr(layer, f.name) for layer in self.layers for f in fields(LayerWeights)]
        weights = [part for w in weights for part in ((w.packed, w.panels) if isinstance(w, CpuWeight) else (w,))]
        unique = {id(w): w for w in weights if w is not None}
        return sum(w.num_bytes if isinstance(w, Int8Weight | BlockWeight) else w.numel() * w.element_size()
                   for w in unique.values())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` for the selected token positions."""
        if self.fused is not None:
            return self._forward_fused(input_ids, positions, meta, k_caches, v_caches, logits_indices)
        shape, linear = self.shape, self.linear
        hidden = block_embedding(input_ids, self.embed)
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches, strict=True):
            x = _rms_norm(hidden, layer.input_norm, shape.rms_norm_eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split((self._q_size, self._kv_size, self._kv_size), dim=-1)
            q = _rope(q.view(-1, shape.num_heads, shape.head_dim), cos, sin)
            k = _rope(k.view(-1, shape.num_kv_heads, shape.head_dim), cos, sin)
            v = v.view(-1, shape.num_kv_heads, shape.head_dim)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta)
            hidden = hidden + linear(attn, layer.o, None)
            x = _rms_norm(hidden, layer.post_norm, shape.rms_norm_eps)
            gate, up = linear(x, layer.gate_up, None).chunk(2, dim=-1)
            hidden = hidden + linear(F.silu(gate) * up, layer.down, None)
        hidden = _rms_norm(hidden.index_select(0, logits_indices), self.norm, shape.rms_norm_eps)
        return self.head_linear(hidden, self.lm_head, None).float()

    def _onednn_rows(self, num_tokens: int) -> int:
        """The rows a step of *num_tokens* tokens runs at: oneDNN's bucket where it goes to oneDNN."""
        linear = self.linear
        if linear is onednn_linear or (isinstance(linear, CpuLinear)
                                        and not linear.takes_small(num_tokens, self.layers[0].qkv)):
            return bucket_rows(num_tokens)
        return num_tokens

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                       logits_indices: torch.Tensor) -> torch.Tensor:
        """``forward`` with the fused CPU kernels: the residual stream ``hidden`` is updated in place, and
        each RMSNorm takes the residual add before it (the previous matmul's output)."""
        ops, shape, linear, eps = self.fused, self.shape, self.linear, self.shape.rms_norm_eps
        q_size, kv_size, head_dim = self._q_size, self._kv_size, shape.head_dim
        num_tokens = input_ids.shape[0]
        num_rows = self._onednn_rows(num_tokens)
        if num_rows > num_tokens:
            # Pad the step once to oneDNN's row bucket (copies of the last token; their K/V are never
            # written and their rows never read), rather than each of the 120 matmul inputs: a pad is a
            # fill and a copy, and 120 of them are a visible share of a short step.
            input_ids = torch.cat((input_ids, input_ids[-1:].expand(num_rows - num_tokens)))
            positions = torch.cat((positions, positions[-1:].expand(num_rows - num_tokens)))
        hidden = block_embedding(input_ids, self.embed)
        x = ops.rms_norm(hidden, self.layers[0].input_norm, eps)
        for index, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches, strict=True)):
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            ops.rope_(qkv, positions, self.cos, self.sin, shape.num_heads, shape.num_kv_heads)
            q = qkv[:, :q_size].view(-1, shape.num_heads, head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(-1, shape.num_kv_heads, head_dim)
            v = qkv[:, q_size + kv_size:].view(-1, shape.num_kv_heads, head_dim)
            if num_rows > num_tokens:
                q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, num_rows)
            x = ops.add_rms_norm_(hidden, linear(attn, layer.o, None), layer.post_norm, eps)
            down = linear(ops.silu_mul(linear(x, layer.gate_up, None)), layer.down, None)
            if index + 1 < len(self.layers):
                x = ops.add_rms_norm_(hidden, down, self.layers[index + 1].input_norm, eps)
            else:
                hidden += down
        hidden = ops.rms_norm(hidden.index_select(0, logits_indices), self.norm, eps)
        return self.head_linear(hidden, self.lm_head, None)


def _layer(state: dict[str, torch.Tensor], index: int, bias: bool) -> LayerWeights:
    p = f"model.layers.{index}."
    qkv = concat([state.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
    qkv_bias = torch.cat([state.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if bias else None
    gate_up = concat([state.pop(p + "mlp.gate_proj.weight"), state.pop(p + "mlp.up_proj.weight")])
    return LayerWeights(
        input_norm=state.pop(p + "input_layernorm.weight"), qkv=qkv, qkv_bias=qkv_bias,
        o=state.pop(p + "self_attn.o_proj.weight"), post_norm=state.pop(p + "post_attention_layernorm.weight"),
        gate_up=gate_up, down=state.pop(p + "mlp.down_proj.weight"),
    )


def _rope_tables(config, shape: LlamaShape, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # The same arithmetic as transformers' rotary embedding, for every position at once.
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = shape.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    positions = torch.arange(shape.max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(device, dtype), (emb.sin() * scaling).to(device, dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm (normalize in float32, then scale), so that
    # greedy output matches it token for token; one fused op where it is exact.
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, H, D]`` with per-token ``cos``/``sin`` ``[T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
