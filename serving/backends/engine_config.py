"""A model of ``inferline.yaml`` as the engine's options (``device: auto``, ``dtype: auto`` resolved)."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.errors import BackendError
from serving.config.models import ModelSpec
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
        dtype, why = _auto_dtype(spec.source, device)
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


def _auto_dtype(source: str, device: str) -> tuple[str, str]:
    """What ``dtype: auto`` is for *source* on *device*, and why."""
    import torch

    if device == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "a CUDA device with bfloat16"
        return "float32", "a CUDA device without bfloat16"
    if source.endswith(".gguf"):
        from serving.engine.kernels import cpu_ops, disabled_reason

        if cpu_ops() is not None:
            return "gguf", "a .gguf file on a CPU: its Q8_0/Q4_0/Q4_1 blocks are kept as they are, at the file's size"
        return "float32", f"a .gguf file de-quantized at load: the block kernels are unavailable ({disabled_reason()})"
    return "float32", ("on a CPU, int8 decodes faster but its next-token agreement with float32 is below the 0.99 "
                       "that would make it the default (bench/quality.py); say dtype: int8 to choose it")


def _speculative_options(spec: ModelSpec, root: Path, draft: ModelSpec | None) -> dict[str, object]:
    options = spec.speculative
    if options is None:
        return {}
    return {"speculative": options.method, "num_speculative_tokens": options.num_tokens,
            "speculative_max_batch": options.max_batch, "prompt_lookup_max": options.prompt_lookup_max,
            "prompt_lookup_min": options.prompt_lookup_min,
            "draft_model": str(root / draft.source) if draft is not None and draft.source else None}
