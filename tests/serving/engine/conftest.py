"""The real default model, loaded once for the engine tests (marked slow).

``INFERLINE_TEST_MODEL`` and ``INFERLINE_TEST_DEVICE`` point them at another model folder and
device (bench/gpu_check.sh runs them on CUDA that way); the defaults are the bundled model on the CPU."""

from __future__ import annotations

import pytest

from tests.serving.engine.model import DEVICE, MODEL


@pytest.fixture(scope="session")
def loaded_model():
    from serving.engine.models import load_model

    # make test fetches the model first: its absence is a failure, not a skip.
    assert (MODEL / "config.json").exists(), f"no model at {MODEL}; run make install"
    return load_model(str(MODEL), "float32", DEVICE)


@pytest.fixture(scope="session")
def chat_prompts(loaded_model) -> list[list[int]]:
    """Eight chat prompts of mixed lengths (about 20 to 400 tokens)."""
    questions = [
        "What is the capital of France?",
        "Name three primary colors.",
        "Write a haiku about autumn leaves.",
        "Explain photosynthesis to a ten-year-old in two sentences.",
        "Summarize this: " + "The quick brown fox jumps over the lazy dog. " * 12,
        "List the planets of the solar system in order from the sun, with one fact about each.",
        "Translate into French: Good morning, how are you today?",
        "Here are my notes: " + "Meeting moved to Tuesday; bring the budget draft and the hiring plan. " * 25
        + "What should I bring?",
    ]
    tokenizer = loaded_model.tokenizer
    prompts = []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return prompts


@pytest.fixture(scope="session")
def ops():
    """``torch.ops.inferline``, the C++ CPU kernels."""
    from serving.engine.kernels import cpu_ops, disabled_reason

    ops = cpu_ops()
    if ops is None:  # the build is part of `make install`: a missing kernel is a broken install, not a skip
        pytest.fail(f"the C++ kernels did not build: {disabled_reason()}", pytrace=False)
    return ops
