"""Engine options: one slotted dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """How one engine runs one model."""

    model: str
    """A local HF folder (config.json, tokenizer, safetensors) or a .gguf file."""
    dtype: str = "float32"
    """float32 | bfloat16 (auto is resolved before the engine sees it)."""
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
