"""``n`` sequences from one prefill: the forks share the prompt's full KV blocks, sample on their own,
and finish, abort and free on their own (the real model)."""

from __future__ import annotations

import asyncio

import pytest

from serving.engine.async_engine import AsyncEngine
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine, count_work
from serving.engine.errors import InvalidRequest
from serving.engine.sampling_params import SamplingParams, choice_seed
from tests.serving.engine.model import DEVICE, MODEL

pytestmark = pytest.mark.slow

SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, ignore_eos=True, n=4)


def make_engine(loaded_model, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(MODEL), device=DEVICE, **options), loaded=loaded_model)


def group(engine: LLMEngine, prompt: list[int], sampling: SamplingParams):
    first = engine.add_request(prompt, sampling)
    return [first, *first.forks]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_forks_share_the_prompt_blocks_and_compute_only_their_tails(loaded_model, chat_prompts, prefix_caching,
                                                                    monkeypatch):
    engine = make_engine(loaded_model, enable_prefix_caching=prefix_caching)
    prompt_tokens_run: list[int] = []
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run",
                        lambda items: prompt_tokens_run.append(count_work(items)[0]) or real_run(items))
    manager = engine.block_manager
    prompt = chat_prompts[7]
    num_shared = (len(prompt) - 1) // manager.block_size
    assert num_shared > 10
    seqs = group(engine, prompt, SAMPLED)
    assert [s.index for s in seqs] == [0, 1, 2, 3]
    while not all(s.num_output_tokens >= 3 for s in seqs):
        engine.step()
    shared = seqs[0].block_table[:num_shared]
    for seq in seqs:
        assert seq.block_table[:num_shared] == shared
    assert [manager.ref_count(b) for b in shared] == [4] * num_shared
    tails = [seq.block_table[num_shared:] for seq in seqs]
    assert len({b for tail in tails for b in tail}) == sum(map(len, tails))  # no tail block is shared
    assert manager.num_used_blocks == num_shared + sum(map(len, tails))
    # The prompt went through the model once, plus each fork's recomputed last partial block.
    assert sum(prompt_tokens_run) == len(prompt) + 3 * (len(prompt) - num_shared * manager.block_size)
    while engine.has_unfinished:
        engine.step()
    assert [s.num_output_tokens for s in seqs] == [12] * 4
    assert manager.num_used_blocks == 0


def test_seeded_n_reproduces_run_to_run_and_the_sequences_differ(loaded_model, chat_prompts):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=77, n=4)
    first = [o.token_ids for o in make_engine(loaded_model).generate([chat_prompts[3]], seeded)]
    again = [o.token_ids for o in make_engine(loaded_model).generate([chat_prompts[3]], seeded)]
    assert len(first) == 4
    assert first == again
    assert len({tuple(t) for t in first}) == 4
    # Sequence 0 samples under the request's own seed, sequence i under one derived from it.
    alone = make_engine(loaded_model).generate([chat_prompts[3]], SamplingParams(max_tokens=16, temperature=1.0,
                                                                                 seed=77))[0].token_ids
    assert first[0] == alone
    derived = SamplingParams(max_tokens=16, temperature=1.0, seed=choice_seed(77, 2))
    assert make_engine(loaded_model).generate([chat_prompts[3]], derived)[0].token_ids == first[2]


def test_greedy_n_gives_identical_sequences(loaded_model, chat_prompts):
    outputs = make_engine(loaded_model).generate([chat_prompts[0]], SamplingParams(max_tokens=16, temperature=0, n=2))
    alone = make_engine(loaded_model).generate([chat_prompts[0]], SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outputs] == [alone[0].token_ids] * 2


def test_sequences_abort_and_free_on_their_own(loaded_model, chat_prompts):
    engine = make_engine(loaded_model)
    seqs = group(engine, chat_prompts[7], SAMPLED)
    while not all(s.num_output_tokens >= 2 for s in seqs):
        engine.step()
    engine.abort(seqs[2].seq_id)
    assert seqs[2].finish_reason == "abort"
    num_shared = (len(chat_prompts[7]) - 1) // engine.block_manager.block_size
    assert engine.block_manager.ref_count(seqs[0].block_table[0]) == 3
    while engine.has_unfinished:
        engine.step()
    assert [s.finish_reason for s in seqs] == ["length", "length", "abort", "length"]
    assert engine.block_manager.num_used_blocks == 0
    assert num_shared > 0


def test_aborting_the_first_before_its_prefill_ends_the_forks(loaded_model, chat_prompts):
    engine = make_engine(loaded_model, max_num_batched_tokens=64)  # the prompt takes several steps
    seqs = group(engine, chat_prompts[7], SAMPLED)
    engine.step()
    engine.abort(seqs[0].seq_id)
    assert [s.finish_reason for s in seqs] == ["abort"] * 4
    assert not engine.has_unfinished
    assert engine.block_manager.num_used_blocks == 0


def test_n_is_validated(loaded_model):
    engine = make_engine(loaded_model)
    for n in (0, 17):
        with pytest.raises(InvalidRequest, match="n must be"):
            engine.add_request([1, 2, 3], SamplingParams(n=n))


def test_one_stream_carries_every_sequence_and_closing_it_aborts_them_all(loaded_model, chat_prompts):
    async def run():
        engine = AsyncEngine(engine=make_engine(loaded_model))
        await engine.start()
        try:
            stream = await engine.submit(chat_prompts[1], SamplingParams(max_tokens=6, temperature=0.8, n=3,
                                                                         ignore_eos=True))
            counts, finished = [0, 0, 0], []
            async for event in stream:
                counts[event.index] += 1
                if event.finish_reason is not None:
                    finished.append(event.index)
            assert counts == [6, 6, 6] and sorted(finished) == [0, 1, 2]
            stream = await engine.submit(chat_prompts[7], SamplingParams(max_tokens=200, n=3, ignore_eos=True))
            async for event in stream:
                if event.index == 2:
                    break
            await stream.aclose()
            for _ in range(100):
                if not engine.engine.has_unfinished:
                    break
                await asyncio.sleep(0.02)
            assert engine.engine.block_manager.num_used_blocks == 0
        finally:
            await engine.shutdown()

    asyncio.run(run())
