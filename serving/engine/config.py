"""Engine options: one slotted dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """How one engine runs one model."""

    model: str
    """A local HF folder (config.json, tokenizer, safetensors) or a .gguf file."""
    dtype: str = "float32"
    """float32 | bfloat16 | int8 (int8 weights, float32 activations and KV cache; see quant.py).
    auto is resolved before the engine sees it: bfloat16 on a CUDA device that supports it, else float32."""
    device: str = "cpu"
    """cpu | cuda (auto is resolved before the engine sees it)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_blocks: int | None = None
    """KV-cache blocks in the pool; None: as many as ``kv_cache_bytes`` holds."""
    kv_cache_bytes: int = 1 << 30
    """Memory budget of the KV pool when ``num_blocks`` is None."""
    max_num_seqs: int = 64
    """Most sequences in the running batch."""
    max_num_batched_tokens: int = 512
    """Token budget per step (chunked prefill): prefill chunks plus decodes."""
    max_waiting: int = 256
    """Most requests waiting for admission; beyond it submit raises EngineOverloaded."""
    max_model_len: int | None = None
    """Longest prompt plus output; None: the model's own limit."""
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    """torch intra-op threads on CPU; None: torch's default."""
    speculative: str | None = None
    """Speculative decoding: None (off) | ngram (prompt lookup) | draft (``draft_model``). See speculative.py."""
    num_speculative_tokens: int = 4
    """Tokens guessed per step for each decoding sequence."""
    speculative_max_batch: int = 4
    """Speculation pauses while more sequences than this are running: a large batch gains little from it."""
    prompt_lookup_max: int = 4
    """Longest suffix n-gram prompt lookup searches for."""
    prompt_lookup_min: int = 2
    """Shortest; a shorter match proposes nothing."""
    draft_model: str | None = None
    """The draft model's local folder or .gguf file (same tokenizer as ``model``), for ``speculative="draft"``."""
