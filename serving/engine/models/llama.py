"""The Llama-family forward pass (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5) over a paged KV cache.

Weights are plain tensors, not ``nn.Module``s: the step runs thirty layers of
a handful of ops each, and module call overhead would be a visible share of a
small model's decode step on CPU. Q, K and V are one fused matmul, and so are
the MLP's gate and up projections.

On CPU, float32 linear layers run through oneDNN with weights packed once at
load time instead of through ``F.linear`` (MKL), which does not pick its fast
kernels on AMD processors. Small batches instead go to our own kernel
(``kernels/small_linear.cpp``) over a second copy of each weight, its columns
in panels: decoding a few sequences, each matmul is a memory-bound pass over
the weights, and oneDNN's per-call OpenMP wake-up is a large share of the
step. How many rows "small" is depends on the machine, from a few to dozens
(docs/measurements.md), so start-up measures it on the model's own weights
(:func:`calibrate_small_rows`), from ``SMALL_ROWS`` up. The panel copies double
the linear weights' memory, so they are kept only for models whose linear
weights fit in ``PANEL_COPY_MAX_BYTES``; they lie back to back in one buffer on
huge pages, in the order a step reads them (``_in_one_arena``).

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

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from serving.engine import calibration
from serving.engine.attention import AttentionMetadata, paged_attention, write_kv
from serving.engine.blocks import BlockRows, BlockWeight, block_embedding, block_linear, concat, pack
from serving.engine.errors import EngineError
from serving.engine.kernels import cpu_ops
from serving.engine.memory import empty_on_huge_pages
from serving.engine.quant import Int8Weight, int8_linear, quantize_weight

log = logging.getLogger(__name__)


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

#: The batch size oneDNN packs weights for; measured best across batch 1 to 512.
_PACK_FOR_BATCH = 64


def _small_rows() -> int:
    """Rows up to this go to the small-batch kernel before start-up measures more (:func:`calibrate_small_rows`).

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


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


class CpuLinear:
    """The forward's ``linear`` over :class:`CpuWeight`: our small-batch kernel up to ``small_rows`` rows
    (where the weight keeps its panels), oneDNN above. ``small_rows`` starts at :data:`SMALL_ROWS` and
    :meth:`LlamaModel.prepare` measures it on the machine (:func:`calibrate_small_rows`)."""

    __slots__ = ("burst", "small_rows")

    def __init__(self) -> None:
        self.small_rows = SMALL_ROWS
        #: Whether up to one block of rows (decode) prefetches the next k-block itself (:func:`calibrate_burst`).
        self.burst = True

    def __call__(self, x: torch.Tensor, weight: CpuWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if self.takes_small(x.shape[0], weight):
            return torch.ops.inferline.panel_linear(x, weight.panels, weight.shape[0], bias, self.burst)
        return _onednn_linear(x, weight.packed, bias)

    def takes_small(self, rows: int, weight: CpuWeight) -> bool:
        """Whether *rows* rows against *weight* go to the small-batch kernel (else to oneDNN)."""
        return weight.panels is not None and rows <= self.small_rows


#: Row counts at which start-up times the small-batch kernel against oneDNN, in order; the kernel keeps
#: each while its pass over the model's layers is faster, and the first loss ends the scan.
CALIBRATION_ROWS = (4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 80, 96, 128)


def layer_linears(layers: Sequence[LayerWeights]) -> list[Weight]:
    """*layers*' matmul weights in step order."""
    return [getattr(layer, name) for layer in layers for name in LINEARS]


def calibrate_small_rows(weights: Sequence[Weight], max_rows: int, burst: bool = True) -> int:
    """The most rows for which our small-batch kernel beat oneDNN here, timed on *weights* (the layers'
    matmuls, :func:`layer_linears`; or the LM head alone, whose crossover is its own).

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


def _which(weights: Sequence[Weight]) -> str:
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


def has_panels(weights: Sequence[Weight]) -> bool:
    """Whether every one of *weights* keeps the panel copy the small-batch kernel reads."""
    return all(isinstance(w, CpuWeight) and w.panels is not None for w in weights)


def _scan_small_rows(weights: Sequence[Weight], max_rows: int, default: int, burst: bool = True) -> int:
    if not has_panels(weights):
        return default
    inputs = {w.shape[1]: torch.randn(CALIBRATION_ROWS[-1], w.shape[1]) for w in weights}
    ours_linear, onednn = _panels(burst), (lambda x, w: _onednn_linear(x, w.packed, None))

    def one_pass(rows: int, ours: bool) -> float:
        return _timed_pass(weights, inputs, rows, ours_linear if ours else onednn)

    def time_both(rows: int) -> tuple[float, float]:
        for w in {w.shape: w for w in weights}.values():  # oneDNN builds its kernel for a row count on first use
            _onednn_linear(inputs[w.shape[1]][:rows], w.packed, None)
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


def calibrate_burst(weights: Sequence[Weight]) -> bool:
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


def _measure_burst(weights: Sequence[Weight]) -> bool:
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


def _in_one_arena(weights: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
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
        pack = torch.ops.mkldnn._reorder_linear_weight
        weights = [*layer_linears(self.layers), self.lm_head]
        keep = cpu_ops() is not None and sum(w.numel() * w.element_size() for w in weights) <= PANEL_COPY_MAX_BYTES
        panels = iter(_in_one_arena(weights, self.dtype, self.device, panel_shape, torch.ops.inferline.pack_panels)
                      if keep else [None] * len(weights))
        for layer in self.layers:
            for name in LINEARS:
                setattr(layer, name, CpuWeight(pack(getattr(layer, name), _PACK_FOR_BATCH), next(panels)))
        # A tied LM head's panels are a copy of their own: the embedding lookup keeps the plain matrix.
        self.lm_head = CpuWeight(pack(self.lm_head, _PACK_FOR_BATCH), next(panels))
        self.linear = CpuLinear()

    def _quantize(self) -> None:
        for layer in self.layers:
            for name in LINEARS:
                setattr(layer, name, quantize_weight(getattr(layer, name), self.device))
        self.lm_head = quantize_weight(self.lm_head, self.device)  # its own copy: the embedding stays dense
        weights = [getattr(layer, name) for layer in self.layers for name in LINEARS] + [self.lm_head]
        if self.device.type == "cpu":
            # The plain int8 matrices a decode step streams, back to back in step order, as _pack's float32 ones.
            plain = iter(_in_one_arena([w.int8 for w in weights], torch.int8, self.device))
            for layer in self.layers:
                for name in LINEARS:
                    setattr(layer, name, replace(getattr(layer, name), int8=next(plain)))
            self.lm_head = replace(self.lm_head, int8=next(plain))
        self.linear = int8_linear

    def prepare(self, max_rows: int, max_logits_rows: int) -> None:
        """Run each distinct linear shape once at every row bucket a step can reach (up to *max_rows*
        tokens, *max_logits_rows* rows of logits), so that oneDNN builds its kernels now: memory stays
        flat while serving and no request waits for a kernel to be generated. No-op off oneDNN."""
        if self.linear is not _onednn_linear and not isinstance(self.linear, CpuLinear):
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
                packed, first = weight, 1
                if isinstance(weight, CpuWeight):  # rows the small-batch kernel takes never reach oneDNN
                    packed, first = weight.packed, 1 if weight.panels is None else linear.small_rows + 1
                x = torch.zeros(bucket_rows(limit), weight.shape[1], dtype=self.dtype)
                for rows in sorted({bucket_rows(n) for n in range(first, limit + 1)}):
                    _onednn_linear(x[:rows], packed, bias)

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
        if linear is _onednn_linear or (isinstance(linear, CpuLinear)
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
