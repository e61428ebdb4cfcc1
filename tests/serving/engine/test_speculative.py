"""Speculative decoding: the same output as plain decoding, and the model's distribution when sampling."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.errors import EngineError
from serving.engine.models import LoadedModel
from serving.engine.models.llama import LlamaModel
from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import Sequence
from serving.engine.speculative import PromptLookup, accepted_prefix, propose_counts

MODEL = "models/smollm2-135m-instruct"


def tiny_llama(vocab_size: int, seed: int, layers: int = 2, hidden: int = 64) -> tuple[LlamaForCausalLM, LoadedModel]:
    """A random Llama-architecture model: transformers' module (the reference) and ours on the same weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init: neither flat nor one-hot
        hf.model.embed_tokens.weight.mul_(2)
    state = {name: tensor.detach().clone() for name, tensor in hf.state_dict().items()}
    model = LlamaModel(config, state, torch.float32, torch.device("cpu"))
    return hf, LoadedModel(model, config, SimpleNamespace(eos_token_id=None))


# -- the proposers and the bookkeeping, without a model ------------------------------------------

def test_prompt_lookup_continues_the_latest_earlier_occurrence():
    lookup = PromptLookup(max_n=3, min_n=1)
    assert lookup.lookup([5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 7], 2) == [9, 5]  # the latest of two earlier matches
    assert lookup.lookup([1, 2, 3, 4], 3) == []  # the last token never occurred before
    assert lookup.lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # as many as follow, up to k


def test_prompt_lookup_prefers_the_longest_match():
    lookup = PromptLookup(max_n=3, min_n=1)
    # "2 3" occurs followed by 4; "3" alone occurs later followed by 7: the longer match wins.
    assert lookup.lookup([2, 3, 4, 3, 7, 2, 3], 1) == [4]
    assert PromptLookup(max_n=2, min_n=2).lookup([9, 3, 7, 3], 1) == []  # a 1-gram is below min_n


def test_guess_counts_stop_at_max_tokens_and_the_context_window():
    seq = Sequence(0, [1] * 10 + [2] * 5, 10, SamplingParams(max_tokens=8))
    assert propose_counts([seq], 4, max_model_len=100) == [2]  # 3 tokens left: 2 guesses + 1
    assert propose_counts([seq], 4, max_model_len=17) == [1]  # 2 positions left in the window
    assert propose_counts([seq], 1, max_model_len=100) == [1]


def test_accepted_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 1]) == 3
    assert accepted_prefix([], [7]) == 0


def test_a_draft_with_another_vocabulary_is_refused(loaded_model):
    _, other = tiny_llama(vocab_size=1000, seed=0)
    config = EngineConfig(model=MODEL, speculative="draft", num_blocks=64)
    with pytest.raises(EngineError, match="vocabulary"):
        LLMEngine(config, loaded=loaded_model, draft=other)


# -- the real model: identical output ----------------------------------------------------------

def _engine(loaded_model, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=MODEL, **options), loaded=loaded_model)


@pytest.fixture(scope="module")
def plain_greedy(loaded_model, chat_prompts) -> list[list[int]]:
    engine = _engine(loaded_model)
    return [out.token_ids for out in engine.generate(chat_prompts, SamplingParams(max_tokens=48, temperature=0))]


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 5])
def test_prompt_lookup_greedy_equals_plain_greedy(loaded_model, chat_prompts, plain_greedy, k):
    engine = _engine(loaded_model, speculative="ngram", num_speculative_tokens=k, speculative_max_batch=64)
    outputs = engine.generate(chat_prompts, SamplingParams(max_tokens=48, temperature=0))
    for index, (ours, reference) in enumerate(zip(outputs, plain_greedy, strict=True)):
        assert ours.token_ids == reference, f"prompt {index} differs"
    stats = engine.metrics.snapshot()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["same-model", "random-tiny"])
def test_draft_model_greedy_equals_plain_greedy(loaded_model, chat_prompts, plain_greedy, draft):
    if draft == "same-model":
        draft_model = loaded_model  # every guess right: the most tokens per step
    else:  # a draft that is almost always wrong: every guess rejected, nothing may change
        _, tiny = tiny_llama(loaded_model.model.shape.vocab_size, seed=3)
        draft_model = LoadedModel(tiny.model, tiny.config, loaded_model.tokenizer)
    config = EngineConfig(model=MODEL, speculative="draft", num_speculative_tokens=3, speculative_max_batch=64)
    engine = LLMEngine(config, loaded=loaded_model, draft=draft_model)
    outputs = engine.generate(chat_prompts, SamplingParams(max_tokens=48, temperature=0))
    for index, (ours, reference) in enumerate(zip(outputs, plain_greedy, strict=True)):
        assert ours.token_ids == reference, f"prompt {index} differs"
    stats = engine.metrics.snapshot()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if draft == "same-model":
        assert stats["spec_decode_acceptance_rate"] > 0.9
    assert engine.block_manager.num_used_blocks == 0
    assert engine.proposer.blocks.num_used_blocks == 0  # the draft's KV is given back too


@pytest.mark.slow
def test_seeded_sampling_is_the_same_with_or_without_speculation(loaded_model, chat_prompts):
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=seed, repetition_penalty=1.1)
              for seed in range(len(chat_prompts))]
    plain = _engine(loaded_model).generate(chat_prompts, params)
    engine = _engine(loaded_model, speculative="ngram", speculative_max_batch=64)
    speculated = engine.generate(chat_prompts, params)
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    assert engine.metrics.snapshot()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_speculation_pauses_for_a_large_batch_and_per_request(loaded_model, chat_prompts):
    engine = _engine(loaded_model, speculative="ngram", speculative_max_batch=2)
    engine.generate(chat_prompts, SamplingParams(max_tokens=8, temperature=0))  # 8 running: never guesses
    assert engine.metrics.snapshot()["spec_decode_num_draft_tokens"] == 0
    off = SamplingParams(max_tokens=32, temperature=0, speculative=False)
    engine.generate([chat_prompts[4]], off)
    assert engine.metrics.snapshot()["spec_decode_num_draft_tokens"] == 0
    engine.generate([chat_prompts[4]], SamplingParams(max_tokens=32, temperature=0))
    assert engine.metrics.snapshot()["spec_decode_num_draft_tokens"] > 0


# -- sampling keeps the model's distribution -----------------------------------------------------

def test_speculative_sampling_keeps_the_models_distribution():
    """Chi-square of the 2nd and 3rd output tokens (64 cells) against the exact probabilities.

    An 8-token vocabulary and a repetitive prompt, so prompt lookup guesses at almost every step
    and both outcomes (accepted and rejected guesses) are frequent.
    """
    vocab, num_samples = 8, 6000
    hf, loaded = tiny_llama(vocab, seed=11)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    config = EngineConfig(model="tiny", speculative="ngram", prompt_lookup_min=1, num_speculative_tokens=3,
                          speculative_max_batch=1 << 20, max_num_seqs=256, max_num_batched_tokens=4096,
                          num_blocks=4096, enable_prefix_caching=False, max_waiting=num_samples)
    engine = LLMEngine(config, loaded=loaded)
    params = SamplingParams(max_tokens=4, temperature=0.9, ignore_eos=True)
    outputs = engine.generate([prompt] * num_samples, params)
    stats = engine.metrics.snapshot()
    assert stats["spec_decode_num_draft_tokens"] >= num_samples // 2, stats  # guessed for most samples
    assert 0.05 < stats["spec_decode_acceptance_rate"] < 0.95  # both branches taken often

    counts = torch.zeros(vocab, vocab)
    for out in outputs:
        counts[out.token_ids[1], out.token_ids[2]] += 1
    expected = _second_and_third_token_probs(hf, prompt, vocab, temperature=0.9) * num_samples
    keep = expected.flatten() >= 5  # chi-square needs enough expected counts per cell
    observed, wanted = counts.flatten()[keep], expected.flatten()[keep]
    wanted = wanted * observed.sum() / wanted.sum()
    _, p_value = chisquare(observed.numpy(), wanted.numpy())
    assert p_value > 1e-3, f"speculative samples do not follow the model's distribution (p = {p_value:.2g})"


@torch.inference_mode()
def _second_and_third_token_probs(hf, prompt: list[int], vocab: int, temperature: float) -> torch.Tensor:
    """P(t2 = a, t3 = b) = sum over t1 of p(t1) p(a | t1) p(b | t1, a), from transformers' forward."""
    def next_probs(ids: list[int]) -> torch.Tensor:
        logits = hf(torch.tensor([ids])).logits[0, -1].double()
        return torch.softmax(logits / temperature, dim=-1)

    first = next_probs(prompt)
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1, t2 in itertools.product(range(vocab), repeat=2):
        p2 = next_probs([*prompt, t1])[t2]
        joint[t2] += first[t1] * p2 * next_probs([*prompt, t1, t2])
    return joint
