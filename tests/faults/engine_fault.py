"""A fault for the fault tests only: the engine's step raises while a marked request is decoding.

A test's own ``inferline.yaml`` lists this module under ``plugins:`` (the operator's plugin
mechanism, pipeline/registry.py); no shipped config names it, and it lives under tests/, outside
the installed packages, so a normal server can never load it. Loaded, it wraps ``LLMEngine.step``:
a step whose running batch holds a request whose prompt contains :data:`MARKER`, once that request
has produced :data:`AFTER_TOKENS` tokens, raises before the forward, as a model failing mid-batch
would. The engine loop's own handling (serving/engine/async_engine.py) is what the tests exercise.
"""

from __future__ import annotations

from typing import Any

MARKER = "INJECT-ENGINE-FAULT-7f3a"
AFTER_TOKENS = 2
MESSAGE = "injected fault: the model failed mid-batch"


def register(registry: Any) -> None:
    """Plugin entry point: wrap the engine's step (registers no stage type)."""
    from serving.engine.engine import LLMEngine

    if getattr(LLMEngine.step, "is_fault_hook", False):
        return
    original = LLMEngine.step
    verdicts: dict[tuple[int, int], bool] = {}

    def marked(engine: Any, seq: Any) -> bool:
        key = (id(engine), seq.seq_id)
        if key not in verdicts:
            verdicts[key] = MARKER in engine.tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens])
        return verdicts[key]

    def step(self: Any) -> Any:
        for seq in list(self.scheduler.running):
            if seq.num_output_tokens >= AFTER_TOKENS and marked(self, seq):
                raise RuntimeError(MESSAGE)
        return original(self)

    step.is_fault_hook = True  # type: ignore[attr-defined]
    LLMEngine.step = step  # type: ignore[method-assign]
