"""A model of ``inferline.yaml`` as the engine's options (``device: auto``, ``dtype: auto`` resolved)."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.errors import BackendError
from pipeline.spec import ModelSpec
from serving.engine.config import EngineConfig

logger = logging.getLogger(__name__)


def engine_config(spec: ModelSpec, root: Path, draft: ModelSpec | None = None) -> EngineConfig:
    """The engine options for a model of ``inferline.yaml`` (resolving ``auto``); *draft*: its draft model's spec."""
    import torch

    if spec.source is None:
        raise BackendError("a local model needs source: (an HF folder or a .gguf file)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if spec.device == "auto" else spec.device
    dtype = spec.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" and torch.cuda.is_bf16_supported() else "float32"
        why = ("a CUDA device with bfloat16" if dtype == "bfloat16" else
               "on a CPU, int8 decodes faster but its next-token agreement with float32 is below the 0.99 "
               "that would make it the default (bench/quality.py); say dtype: int8 to choose it")
        logger.info("model source %s: dtype auto is %s (%s)", spec.source, dtype, why)
    kv = spec.kv_cache
    return EngineConfig(
        model=str(root / spec.source), dtype=dtype, device=device, block_size=kv.block_size,
        num_blocks=None if kv.max_blocks == "auto" else kv.max_blocks,
        kv_cache_bytes=int(kv.memory_gb * (1 << 30)), enable_prefix_caching=kv.prefix_cache,
        max_num_seqs=spec.batching.max_num_seqs, max_num_batched_tokens=spec.batching.max_num_batched_tokens,
        max_waiting=spec.batching.max_waiting, max_model_len=spec.context_window,
        **_speculative_options(spec, root, draft),
    )


def _speculative_options(spec: ModelSpec, root: Path, draft: ModelSpec | None) -> dict[str, object]:
    options = spec.speculative
    if options is None:
        return {}
    return {"speculative": options.method, "num_speculative_tokens": options.num_tokens,
            "speculative_max_batch": options.max_batch, "prompt_lookup_max": options.prompt_lookup_max,
            "prompt_lookup_min": options.prompt_lookup_min,
            "draft_model": str(root / draft.source) if draft is not None and draft.source else None}
