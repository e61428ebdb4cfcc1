from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from serving.engine.sampler import Sampler, apply_penalties
from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import Sequence

# Chi-square critical value for 3 degrees of freedom at p = 0.001. The draws are seeded, so a pass is
# a pass forever; the loose bound only keeps a future change of hash from failing by bad luck.
CHI2_3DOF_P001 = 16.27


def make_seq(seq_id: int = 0, prompt: tuple[int, ...] = (1, 2), output: tuple[int, ...] = (),
             **sampling: object) -> Sequence:
    return Sequence(seq_id, [*prompt, *output], len(prompt), SamplingParams(**sampling))


def logits_of(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


def random_logits(rows: int, vocab_size: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


def sample_many(logits_row: torch.Tensor, num: int, **sampling: object) -> list[int]:
    """One token for each of ``num`` seeds 0..num-1, all in one batch."""
    seqs = [make_seq(i, seed=i, **sampling) for i in range(num)]
    return Sampler()(logits_row.expand(num, -1).contiguous(), seqs).token_ids


def chi_square(counts: Counter[int], probs: list[float]) -> float:
    total = sum(counts.values())
    return sum((counts[i] - total * p) ** 2 / (total * p) for i, p in enumerate(probs))


# greedy


def test_greedy_rows_take_the_argmax():
    logits = random_logits(6, 50)
    seqs = [make_seq(i, temperature=0.0) for i in range(6)]
    assert Sampler()(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("sampling", [{}, {"presence_penalty": 0.5}], ids=["fast path", "penalty path"])
def test_greedy_ties_go_to_the_lowest_token_id(sampling):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert Sampler()(logits, [make_seq(temperature=0.0, **sampling)]).token_ids == [1]


def test_greedy_ties_go_to_the_lowest_token_id_across_a_whole_vocabulary():
    # A reduction over 49,152 logits is split between threads; the first maximum must still win.
    logits = torch.zeros(32, 49152)
    for row in range(32):
        first = 37 * row
        logits[row, [first, 49151 - row, 30000 + row]] = 5.0
    seqs = [make_seq(i, temperature=0.0) for i in range(32)]
    assert Sampler()(logits, seqs).token_ids == [37 * row for row in range(32)]


def test_a_tiny_temperature_is_greedy():
    logits = random_logits(4, 100)
    seqs = [make_seq(i, temperature=1e-7) for i in range(4)]
    assert Sampler(seed=0)(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("sampling", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k=1", "tiny top_p"])
def test_filters_that_keep_one_token_are_greedy(sampling):
    logits = random_logits(8, 100, scale=3.0)
    seqs = [make_seq(i, temperature=1.5, seed=i, **sampling) for i in range(8)]
    assert Sampler()(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


# filters

PROBS = [0.35, 0.25, 0.15, 0.10, 0.07, 0.05, 0.02, 0.01]


@pytest.mark.parametrize(("sampling", "kept"), [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.7}, {0, 1, 2}),  # 0.35 + 0.25 < 0.7, so the third token is needed
    ({"top_p": 0.5}, {0, 1}),
    ({"top_k": 3, "top_p": 0.85}, {0, 1, 2}),  # top-p over the top-3 mass 0.75: 0.6 / 0.75 = 0.8 < 0.85
    ({"top_k": 3, "top_p": 0.75}, {0, 1}),
    ({"min_p": 0.25}, {0, 1, 2, 3}),  # keeps p >= 0.0875
    ({"min_p": 0.3}, {0, 1, 2}),  # keeps p >= 0.105
    ({"min_p": 0.9}, {0}),
    ({"top_p": 0.95, "min_p": 0.3}, {0, 1, 2}),
    ({"top_p": 0.8, "min_p": 0.1}, {0, 1, 2, 3}),
    ({}, set(range(8))),
])
def test_filters_keep_exactly_the_expected_tokens(sampling, kept):
    assert set(sample_many(logits_of(PROBS)[0], 3000, **sampling)) == kept


@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0], ids=["flat", "medium", "peaked"])
def test_top_p_matches_a_sort_based_nucleus_on_a_large_vocab(scale):
    # Flat rows need more than the 256- and 4096-token candidate sets; peaked ones fit the first.
    logits = random_logits(1, 6000, scale=scale, seed=1)[0]
    sorted_probs, order = logits.softmax(dim=-1).sort(descending=True)
    mass_before = sorted_probs.double().cumsum(dim=0) - sorted_probs.double()
    nucleus = set(order[mass_before < 0.8].tolist())
    sampled = sample_many(logits, 400, top_p=0.8)
    assert set(sampled) <= nucleus
    assert len(set(sampled)) > min(len(nucleus), 400) // 4  # not collapsed onto a few tokens


# penalties


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5]])
    seq = make_seq(prompt=(0, 1), output=(3, 3, 1), repetition_penalty=2.0, presence_penalty=0.5,
                   frequency_penalty=0.25)
    apply_penalties(logits, [seq])
    # repetition over {0, 1, 3}: 2 -> 1, -1 -> -2, 1 -> 0.5; then output counts {3: 2, 1: 1}:
    # token 3: 0.5 - 0.5 - 2 * 0.25 = -0.5; token 1: -2 - 0.5 - 0.25 = -2.75
    assert logits.tolist() == [[1.0, -2.75, 0.5, -0.5, -0.5]]


def test_presence_and_frequency_ignore_the_prompt():
    logits = torch.zeros(1, 4)
    apply_penalties(logits, [make_seq(prompt=(0, 1, 1), output=(2,), presence_penalty=1.0, frequency_penalty=1.0)])
    assert logits.tolist() == [[0.0, 0.0, -2.0, 0.0]]


def test_penalties_touch_only_their_own_rows():
    logits = torch.ones(3, 4)
    seqs = [make_seq(0, output=(0,)), make_seq(1, output=(0,), repetition_penalty=2.0),
            make_seq(2, output=(3,), frequency_penalty=0.5)]
    apply_penalties(logits, seqs)
    assert logits.tolist() == [[1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 1.0], [1.0, 1.0, 1.0, 0.5]]


def test_greedy_uses_penalized_logits_and_leaves_the_callers_logits_alone():
    logits = torch.tensor([[3.0, 0.0, 2.0, 0.0]])
    before = logits.clone()
    out = Sampler()(logits, [make_seq(prompt=(3,), output=(0,), temperature=0.0, repetition_penalty=2.0)])
    assert out.token_ids == [2]  # 3 / 2 < 2
    assert torch.equal(logits, before)


# seeded reproducibility


def run_steps(sampler: Sampler, seq: Sequence, logits_row: torch.Tensor, others: list[Sequence],
              row: int, steps: int = 6) -> list[int]:
    """Sample ``steps`` tokens for ``seq`` placed at ``row`` among ``others``; return them."""
    for _ in range(steps):
        batch = [*others[:row], seq, *others[row:]]
        logits = random_logits(len(batch), logits_row.shape[0], seed=len(seq.token_ids))
        logits[row] = logits_row
        seq.token_ids.append(sampler(logits, batch).token_ids[row])
    return seq.output_token_ids


def test_seeded_tokens_do_not_depend_on_the_batch_or_row():
    logits_row = random_logits(1, 1000, scale=1.5)[0]
    params = {"seed": 1234, "temperature": 0.8, "top_p": 0.9}
    alone = run_steps(Sampler(seed=1), make_seq(7, **params), logits_row, [], row=0)
    others = [make_seq(1, temperature=0.0), make_seq(2), make_seq(3, seed=99, top_k=300),
              make_seq(4, repetition_penalty=1.3, top_p=0.5), make_seq(5, min_p=0.1, logprobs=2)]
    for row in (0, 2, 5):
        crowded = run_steps(Sampler(seed=row), make_seq(7, **params), logits_row, others, row=row)
        assert crowded == alone
    assert run_steps(Sampler(), make_seq(7, **{**params, "seed": 4321}), logits_row, [], row=0) != alone


def test_a_recomputed_step_draws_the_same_token():
    # After preemption-by-recompute the sequence comes back with the same tokens and samples the
    # same output index again; a fresh Sequence object and a released sampler must not matter.
    logits = random_logits(1, 500)
    sampler = Sampler()
    first = sampler(logits, [make_seq(3, output=(5, 9), seed=42)]).token_ids
    sampler.release(3)
    again = sampler(logits, [make_seq(3, output=(5, 9), seed=42)]).token_ids
    assert first == again
    assert Sampler()(logits, [make_seq(8, output=(5, 9), seed=42)]).token_ids == first


@pytest.mark.parametrize("output", [(), (3, 1, 2)], ids=["first token", "fourth token"])
def test_seeded_draws_follow_the_distribution(output):
    probs = [0.1, 0.2, 0.3, 0.4]
    seqs = [make_seq(i, output=output, seed=i) for i in range(4000)]
    counts = Counter(Sampler()(logits_of(probs, len(seqs)), seqs).token_ids)
    assert chi_square(counts, probs) < CHI2_3DOF_P001


def test_unseeded_draws_follow_the_tempered_distribution():
    seqs = [make_seq(i, temperature=0.5) for i in range(4000)]
    counts = Counter(Sampler(seed=0)(logits_of([0.1, 0.2, 0.3, 0.4], len(seqs)), seqs).token_ids)
    squared = [p * p for p in (0.1, 0.2, 0.3, 0.4)]
    assert chi_square(counts, [p / sum(squared) for p in squared]) < CHI2_3DOF_P001


# logprobs and mixed batches


def test_logprobs_are_raw_and_the_top_n_are_the_most_likely():
    logits = random_logits(4, 30, scale=2.0)
    seqs = [make_seq(0, temperature=0.0, logprobs=3),
            make_seq(1, output=(4, 4), temperature=0.7, top_k=5, repetition_penalty=1.5, seed=1, logprobs=5),
            make_seq(2, seed=2),
            make_seq(3, seed=3, logprobs=0)]
    out = Sampler()(logits, seqs)
    raw = torch.log_softmax(logits, dim=-1)
    for row, num in ((0, 3), (1, 5), (3, 0)):
        entry = out.logprobs[row]
        assert entry is not None
        assert entry.logprob == pytest.approx(raw[row, out.token_ids[row]].item())
        values, ids = raw[row].topk(num) if num else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [token_id for token_id, _ in entry.top_logprobs] == ids.tolist()
        assert [lp for _, lp in entry.top_logprobs] == pytest.approx(values.tolist())
    assert out.logprobs[2] is None
    assert out.logprobs[0].top_logprobs[0][0] == out.token_ids[0]


def test_mixed_greedy_and_sampled_rows_in_one_batch():
    logits = random_logits(6, 200, scale=2.0)
    seqs = [make_seq(i, temperature=0.0) if i % 2 else make_seq(i, seed=10 + i, top_p=0.9) for i in range(6)]
    out = Sampler()(logits, seqs)
    for row, seq in enumerate(seqs):
        if seq.sampling.temperature == 0.0:
            assert out.token_ids[row] == logits[row].argmax().item()
        else:
            solo = Sampler()(logits[row:row + 1], [make_seq(row, seed=10 + row, top_p=0.9)]).token_ids
            assert out.token_ids[row] == solo[0]
    assert out.logprobs == [None] * 6


def test_the_last_token_of_a_vocab_that_is_not_a_multiple_of_the_cdf_block():
    logits = torch.full((2, 300), -math.inf)
    logits[:, 299] = 0.0
    assert Sampler()(logits, [make_seq(0, seed=0), make_seq(1)]).token_ids == [299, 299]


def test_empty_batch_and_shape_mismatch():
    assert Sampler()(torch.empty(0, 10), []).token_ids == []
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 10), [make_seq()])


# min_tokens


def test_min_tokens_holds_back_end_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # 0 the likeliest, then the stop token 1
    short = Sequence(0, [3, 3], 2, SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(1,)),
                     eos_token_ids=frozenset({0}))
    out = Sampler()(logits, [short])
    assert out.token_ids == [2]  # neither EOS nor the stop token yet
    assert out.logprobs == [None] and torch.equal(logits, torch.tensor([[5.0, 4.0, 3.0, 0.0]]))
    reached = Sequence(0, [3, 3, 2, 2], 2, short.sampling, eos_token_ids=frozenset({0}))
    assert Sampler()(logits, [reached]).token_ids == [0]  # two output tokens: EOS may come
