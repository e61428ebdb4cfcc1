"""The engine against transformers' greedy generate, token for token, on the real model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serving.engine.async_engine import AsyncEngine
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.errors import EngineOverloaded, InvalidRequest
from serving.engine.sampling_params import SamplingParams
from tests.serving.engine.model import DEVICE, MODEL

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)


def make_engine(loaded_model, **options) -> LLMEngine:
    config = EngineConfig(model=str(MODEL), device=DEVICE, **options)
    return LLMEngine(config, loaded=loaded_model)


@pytest.fixture(scope="module")
def hf_greedy(loaded_model, chat_prompts) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding to blur it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).to(DEVICE)
    outputs = []
    with torch.inference_mode():
        for ids in chat_prompts:
            out = model.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=DEVICE))
            tokens = out[0, len(ids):].tolist()
            eos = loaded_model.tokenizer.eos_token_id
            outputs.append(tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
    return outputs


@pytest.mark.parametrize("options", [
    pytest.param({}, id="defaults"),
    pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
    pytest.param({"max_num_batched_tokens": 16}, id="chunk-16-splits-every-prompt"),
    pytest.param({"num_blocks": 40, "block_size": 16}, id="small-pool-preempts"),
])
def test_greedy_matches_transformers(loaded_model, chat_prompts, hf_greedy, options):
    engine = make_engine(loaded_model, **options)
    outputs = engine.generate(chat_prompts, GREEDY)
    for index, (ours, reference) in enumerate(zip(outputs, hf_greedy, strict=True)):
        assert ours.token_ids == reference, f"prompt {index} differs"
    assert engine.block_manager.num_used_blocks == 0
    if "num_blocks" in options:
        assert engine.metrics.snapshot()["num_preemptions"] > 0


def test_a_step_is_padded_once_to_the_matmul_row_bucket(loaded_model, chat_prompts, hf_greedy, monkeypatch):
    """Steps that go to oneDNN run at its row bucket from the embedding on: every matmul gets a bucket's
    rows as they are (no pad of its own), and the output is still transformers' token for token."""
    from serving.engine import cpu_linear

    model = loaded_model.model
    if not isinstance(model.linear, cpu_linear.CpuLinear):
        pytest.skip("the oneDNN path runs only in float32 on a CPU with oneDNN")
    monkeypatch.setenv("INFERLINE_SMALL_ROWS", "4")  # steps above 4 tokens go to oneDNN
    calibrated = model.linear.small_rows, model.head_linear.small_rows  # the shared model keeps its limits
    matmul_rows: list[int] = []
    real_linear = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear",
                        lambda x, w, b: matmul_rows.append(x.shape[0]) or real_linear(x, w, b))
    engine = make_engine(loaded_model)
    step_tokens: list[int] = []
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run",
                        lambda items: step_tokens.append(sum(i.num_new_tokens for i in items)) or real_run(items))
    try:
        outputs = engine.generate(chat_prompts, GREEDY)
    finally:
        model.linear.small_rows, model.head_linear.small_rows = calibrated
    assert [o.token_ids for o in outputs] == hf_greedy
    assert any(cpu_linear.bucket_rows(n) > n for n in step_tokens if n > 4)  # some step was padded
    assert matmul_rows and all(cpu_linear.bucket_rows(n) == n for n in matmul_rows)


def test_prefix_cache_hits_on_a_repeated_prompt(loaded_model, chat_prompts, hf_greedy):
    engine = make_engine(loaded_model)
    engine.generate([chat_prompts[7]], GREEDY)
    again = engine.generate([chat_prompts[7]], GREEDY)[0]
    assert again.num_cached_tokens >= len(chat_prompts[7]) - 16
    assert again.token_ids == hf_greedy[7]


def test_tenants_do_not_share_the_prefix_cache(loaded_model, chat_prompts):
    engine = make_engine(loaded_model)
    engine.generate([chat_prompts[7]], GREEDY, cache_salt="tenant-a")
    other = engine.generate([chat_prompts[7]], GREEDY, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0


def test_finished_and_aborted_requests_return_every_block(loaded_model, chat_prompts):
    engine = make_engine(loaded_model, max_num_batched_tokens=64)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0)) for p in chat_prompts]
    for _ in range(4):
        engine.step()
    for seq in seqs[::3]:
        engine.abort(seq.seq_id)
    while engine.has_unfinished:
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    assert [s.finish_reason for s in seqs[::3]] == ["abort"] * len(seqs[::3])


def test_seeded_sampling_reproduces_whatever_the_batch(loaded_model, chat_prompts):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = make_engine(loaded_model).generate([chat_prompts[2]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0) for _ in chat_prompts]
    batch = list(chat_prompts)
    params = [*others[:2], seeded, *others[3:]]
    in_batch = make_engine(loaded_model).generate(batch, params)[2].token_ids
    assert in_batch == alone


def test_min_tokens_generates_past_the_end_it_would_stop_at(loaded_model, chat_prompts):
    engine = make_engine(loaded_model)
    free = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=200, temperature=0))[0]
    assert free.finish_reason == "stop"  # the model ends this answer by itself
    held = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=200, temperature=0,
                                                             min_tokens=len(free.token_ids) + 5))[0]
    assert len(held.token_ids) >= len(free.token_ids) + 5
    assert not set(held.token_ids[:len(free.token_ids) + 4]) & engine.eos_token_ids
    with pytest.raises(InvalidRequest, match="min_tokens"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, min_tokens=5))


def test_invalid_requests_are_refused_before_queueing(loaded_model):
    engine = make_engine(loaded_model)
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.add_request([1, 2, 3], SamplingParams(top_p=0))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.add_request([10**9], GREEDY)
    assert engine.scheduler.num_waiting == 0


def test_overload_is_a_typed_error(loaded_model):
    engine = make_engine(loaded_model, max_waiting=2)
    engine.add_request([1, 2, 3], GREEDY)
    engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(EngineOverloaded):
        engine.add_request([1, 2, 3], GREEDY)


async def test_async_streams_and_cancellation_frees_blocks(loaded_model, chat_prompts, hf_greedy):
    engine = AsyncEngine(engine=make_engine(loaded_model))
    await engine.start()
    try:
        long = await engine.submit(chat_prompts[7], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        first = await long.__anext__()
        assert first.num_output_tokens == 1
        streams = [await engine.submit(p, GREEDY) for p in chat_prompts[:3]]
        results = await asyncio.gather(*(_tokens(s) for s in streams))
        assert results == hf_greedy[:3]
        await long.aclose()
        for _ in range(50):
            if engine.engine.block_manager.num_used_blocks == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.engine.block_manager.num_used_blocks == 0
        assert engine.stats()["running"] == 0
    finally:
        await engine.shutdown()


async def test_a_running_engine_shortens_the_gil_switch_interval(loaded_model, monkeypatch):
    # The step's torch calls each retake the GIL; with the default 5 ms interval the event loop can keep
    # the engine thread waiting that long for every one (async_engine.GIL_SWITCH_INTERVAL_S).
    import sys

    from serving.engine import async_engine

    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)
    chosen: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", chosen.append)
    engine = AsyncEngine(engine=make_engine(loaded_model))
    await engine.start()
    await engine.shutdown()
    assert chosen == [async_engine.GIL_SWITCH_INTERVAL_S] and chosen[0] < 0.005


def test_steps_are_timed_as_prefill_or_decode(loaded_model, chat_prompts):
    engine = make_engine(loaded_model, max_num_batched_tokens=16)  # every prompt in chunks of 16
    prompts = chat_prompts[:2]
    engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    snap = engine.metrics.snapshot()
    prefill, decode = snap["prefill_step_seconds"], snap["decode_step_seconds"]
    assert prefill["count"] >= sum(len(p) for p in prompts) // 16  # a chunk a step at most
    assert 5 <= decode["count"] < 2 * 5 + 1  # five more tokens each; the two may decode apart at first
    assert decode["sum"] > 0 and prefill["p50"] > 0
    assert decode["count"] <= snap["decode_step_sequences"] <= 2 * decode["count"]


async def test_a_running_engine_keeps_the_startup_heap_frozen(loaded_model):
    # An oldest-generation collection over the loaded model's objects stops the loop and the step for
    # ~0.3 s (serving/engine/heap.py); frozen, collections skip them.
    import gc

    engine = AsyncEngine(engine=make_engine(loaded_model))
    await engine.start()
    try:
        assert gc.get_freeze_count() > 0
        assert not any(o is loaded_model for o in gc.get_objects())
    finally:
        await engine.shutdown()
    assert gc.get_freeze_count() == 0


async def _tokens(stream) -> list[int]:
    return [event.token_id async for event in stream]
