"""Turns one step's logits into next tokens.

A constrained request (``Sequence.matcher``, constraints.py) first has the tokens its constraint forbids
set to -inf, and a request short of its ``min_tokens`` its end-of-sequence and stop tokens. Then per
row, in this order (vLLM's and Hugging Face's): repetition penalty (HF-style, over prompt and output
tokens), presence and frequency penalties (OpenAI-style, over output tokens only), then for sampled
rows temperature, top-k, top-p (on the top-k-renormalized distribution) and min-p (relative to the
most likely token), then one draw. Greedy rows (temperature 0) take the first maximum of the
penalized logits (:func:`greedy_ids`), so ties go to the lowest token id, as in HF ``generate``.

Seeded requests: the draw for output token ``i`` of a request seeded ``s`` is a uniform number
hashed from ``(s, i)``. There is no generator state, so a seeded row's token depends only on its
logits, ``s`` and ``i``: not on the rest of the batch, its row index, or whether the sequence was
preempted and recomputed.

Log-probabilities are *raw*: ``log_softmax`` of the model's logits before any penalty, temperature
or filter (what OpenAI returns; vLLM's ``raw_logprobs`` mode).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

from serving.engine.sampling_params import SamplingParams
from serving.engine.sequence import Sequence

_MIN_TEMPERATURE = 1e-5
"""Rows below it are greedy, as in vLLM: far smaller divisors overflow float32 logits to inf, and
the tempered distribution is all but one-hot long before that."""
_NUM_CANDIDATES = (256, 4096)
"""Top-p is first resolved on the 256 most likely tokens, then 4096, then a full sort. With a real model
the nucleus almost always fits the first, and a full sort of a batch's vocabulary costs many times a
top-256."""
_CDF_BLOCK = 256
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class TokenLogprobs:
    """Raw log-probabilities (unpenalized, temperature 1) of one sampled token."""

    logprob: float
    """Of the sampled token."""
    top_logprobs: list[tuple[int, float]]
    """``(token_id, logprob)`` of the ``sampling.logprobs`` most likely tokens, most likely first."""


@dataclass(slots=True)
class SamplerOutput:
    """One token per row, and its log-probabilities where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Picks each row's next token from a ``[num_seqs, vocab]`` float32 logits tensor.

    ``seed`` seeds the draws of requests without a seed of their own (None: from the OS).
    """

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [{len(seqs)}, vocab] for {len(seqs)} sequences, "
                             f"got {list(logits.shape)}")
        raw = logits = logits.float()
        constrained = [i for i, seq in enumerate(seqs) if getattr(seq, "matcher", None) is not None]
        if constrained:  # tokens the request's constraint forbids get -inf (raw logprobs stay unmasked)
            logits = logits.clone()
            for i in constrained:
                seqs[i].matcher.apply(logits[i])
        held = [i for i, seq in enumerate(seqs) if seq.num_output_tokens < seq.sampling.min_tokens]
        if held:  # min_tokens: no end-of-sequence or stop token yet (raw logprobs stay unmasked)
            logits = logits.clone() if logits is raw else logits
            for i in held:
                ends = [t for t in (*seqs[i].eos_token_ids, *seqs[i].sampling.stop_token_ids) if t < logits.shape[1]]
                if ends:
                    logits[i, ends] = float("-inf")
        greedy_rows = [i for i, seq in enumerate(seqs) if _is_greedy(seq.sampling)]
        if len(greedy_rows) == len(seqs) and not any(_has_penalty(seq.sampling) for seq in seqs):
            token_ids = greedy_ids(logits)  # the common case: one kernel, one sync
        else:
            sampled_rows = [i for i, seq in enumerate(seqs) if not _is_greedy(seq.sampling)]
            token_ids = [0] * len(seqs)
            for rows, pick in ((greedy_rows, _pick_greedy), (sampled_rows, self._pick_sampled)):
                if rows:
                    for row, token_id in zip(rows, pick(logits, [seqs[i] for i in rows], rows), strict=True):
                        token_ids[row] = token_id
        return SamplerOutput(token_ids, _raw_logprobs(raw, seqs, token_ids))

    def release(self, seq_id: int) -> None:
        """Drop what the sampler keeps for a finished or aborted sequence.

        Nothing, today: seeded draws are hashed from (seed, output index) rather than read from a
        per-sequence generator. The engine calls it anyway, so that adding state later cannot leak.
        """

    def _pick_sampled(self, logits: torch.Tensor, group: list[Sequence], rows: list[int]) -> list[int]:
        scaled = _penalized(logits, group, rows)
        if any(seq.sampling.temperature != 1.0 for seq in group):
            scaled = scaled / _column([seq.sampling.temperature for seq in group], logits)
        probs = torch.softmax(scaled, dim=-1)
        _filter_(probs, [seq.sampling for seq in group])
        uniforms = [self._uniform(seq) for seq in group]
        return _inverse_cdf(probs, torch.tensor(uniforms, dtype=torch.float64, device=probs.device)).tolist()

    def _uniform(self, seq: Sequence) -> float:
        if seq.sampling.seed is None:
            return self._rng.random()
        return _seeded_uniform(seq.sampling.seed, seq.num_output_tokens)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Apply each sequence's repetition, presence and frequency penalties to its row, in place.

    Repetition (HF): a logit of a token seen in the prompt or output is divided by the penalty when
    positive and multiplied by it otherwise, so a penalty > 1 always makes a repeat less likely.
    Presence and frequency (OpenAI): ``presence * (count > 0) + frequency * count`` is subtracted,
    counting output tokens only. Work is per seen token, never per vocabulary entry.
    """
    rep_rows = [i for i, seq in enumerate(seqs) if seq.sampling.repetition_penalty != 1.0]
    if rep_rows:
        row_ids, token_ids, lengths = _flatten(logits, rep_rows, [seqs[i].token_ids for i in rep_rows])
        penalty = _per_token([seqs[i].sampling.repetition_penalty for i in rep_rows], lengths, logits)
        seen = logits[row_ids, token_ids]
        # A repeated token writes the same value each time, so duplicate indices are harmless.
        logits[row_ids, token_ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    pf_rows = [i for i, seq in enumerate(seqs) if seq.sampling.presence_penalty or seq.sampling.frequency_penalty]
    if pf_rows:
        row_ids, token_ids, lengths = _flatten(logits, pf_rows, [seqs[i].output_token_ids for i in pf_rows])
        frequency = _per_token([seqs[i].sampling.frequency_penalty for i in pf_rows], lengths, logits)
        presence = _per_token([seqs[i].sampling.presence_penalty for i in pf_rows], lengths, logits)
        logits.index_put_((row_ids, token_ids), -frequency, accumulate=True)  # once per occurrence
        logits[row_ids, token_ids] -= presence  # a plain write: once per distinct token, as for repetition


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _MIN_TEMPERATURE


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """Each row's most likely token id, the lowest on a tie (``torch.max`` over a dimension returns the
    first maximum's index, as ``argmax`` does). ``max`` rather than ``argmax``: on the CPU it is the
    faster reduction."""
    return logits.max(dim=-1).indices.tolist()


def _pick_greedy(logits: torch.Tensor, group: list[Sequence], rows: list[int]) -> list[int]:
    return greedy_ids(_penalized(logits, group, rows))


def _penalized(logits: torch.Tensor, group: list[Sequence], rows: list[int]) -> torch.Tensor:
    """The ``rows`` of ``logits`` with ``group``'s penalties applied; never writes to ``logits``."""
    needs_penalty = any(_has_penalty(seq.sampling) for seq in group)
    selected = _select(logits, rows)
    if needs_penalty:
        if selected is logits:
            selected = logits.clone()
        apply_penalties(selected, group)
    return selected


def _filter_(probs: torch.Tensor, params: list[SamplingParams]) -> None:
    """Zero, in place, the probabilities that top-k, top-p or min-p remove.

    Each filter keeps the tokens at or above a per-row threshold probability, so the three combine
    into one threshold (the largest) and one pass over the batch.
    """
    vocab_size = probs.shape[1]
    threshold = probs.new_zeros(len(params))
    has_min_p = any(p.min_p > 0 for p in params)
    if has_min_p:
        # Relative to the most likely token, which top-k and top-p always keep.
        threshold = _column([p.min_p for p in params], probs).squeeze(1) * probs.amax(dim=-1)
    nucleus_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size or p.top_p < 1.0]
    if nucleus_rows:
        index = torch.tensor(nucleus_rows, device=probs.device)
        top_k = [params[i].top_k if 0 < params[i].top_k < vocab_size else vocab_size for i in nucleus_rows]
        nucleus = _nucleus_threshold(_select(probs, nucleus_rows), top_k, [params[i].top_p for i in nucleus_rows])
        threshold[index] = torch.maximum(threshold[index], nucleus)
    if nucleus_rows or has_min_p:
        probs.masked_fill_(probs < threshold.unsqueeze(1), 0.0)


def _nucleus_threshold(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Per row, the probability of the last token that top-k then top-p keep.

    The top-p mass is taken over the top-k tokens (vLLM renormalizes after top-k). A row is resolved
    by the first candidate set that holds its nucleus; prefix sums of the sorted candidates do not
    depend on how many there are, so the answer does not depend on the other rows either.
    """
    num_rows, vocab_size = probs.shape
    k = torch.tensor(top_k, device=probs.device)
    top_p_mass = torch.tensor(top_p, dtype=torch.float64, device=probs.device)
    row_mass = probs.sum(dim=-1).double()  # float32 sum: a float64 one would first copy all of probs
    threshold = probs.new_empty(num_rows)
    pending = torch.arange(num_rows, device=probs.device)
    for num_candidates in (*_NUM_CANDIDATES, vocab_size):
        k_pending = k[pending]
        # A top-k row needs all its k candidates to know the mass its top-p is relative to.
        k_needed = k_pending[k_pending < vocab_size]
        size = min(vocab_size, max(num_candidates, int(k_needed.max()) if k_needed.numel() else 0))
        candidates = (probs if pending.numel() == num_rows else probs[pending]).topk(size, dim=-1).values
        cum = candidates.cumsum(dim=-1, dtype=torch.float64)
        k_pending = k_pending.clamp(max=size)
        top_k_mass = cum.gather(1, (k_pending - 1).unsqueeze(1)).squeeze(1)
        total = torch.where(k[pending] < vocab_size, top_k_mass, row_mass[pending])
        last = torch.searchsorted(cum, (top_p_mass[pending] * total).unsqueeze(1)).squeeze(1)
        if size == vocab_size:  # float rounding may leave the whole-vocab target a hair above the sum
            last = last.clamp(max=vocab_size - 1)
        resolved = last < k_pending
        kept = candidates.gather(1, last.clamp(max=size - 1).unsqueeze(1)).squeeze(1)
        threshold[pending[resolved]] = kept[resolved]
        pending = pending[~resolved]
        if pending.numel() == 0:
            break
    return threshold


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token per row drawn from the (unnormalized) ``probs`` with one uniform in [0, 1) per row.

    Exact multinomial sampling like the Gumbel / exponential trick, but one random number per row
    instead of one per vocabulary entry, which a whole batch's vocabulary makes costly on the CPU. The
    CDF is two-level, over blocks and then within the chosen block, so that it is float64 without
    converting the whole batch: zeroed tokens span empty intervals and are never picked.
    """
    num_rows, vocab_size = probs.shape
    if vocab_size % _CDF_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, -vocab_size % _CDF_BLOCK))
    blocks = probs.view(num_rows, -1, _CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    block, offset = _search(block_cdf, uniforms * block_cdf[:, -1])
    token_cdf = blocks[torch.arange(num_rows, device=probs.device), block].double().cumsum(dim=-1)
    token, _ = _search(token_cdf, offset)
    return block * _CDF_BLOCK + token


def _search(cdf: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the interval of ``cdf`` that holds ``target`` and how far into it ``target`` lies."""
    total = cdf[:, -1]
    # Strictly below the total, so the interval found is a non-empty one even after float rounding.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    start = cdf.gather(1, (index - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return index, target - torch.where(index > 0, start, torch.zeros_like(start))


def _raw_logprobs(logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    rows = [i for i, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
    if not rows:
        return out
    logprobs = torch.log_softmax(_select(logits, rows), dim=-1)
    sampled = torch.tensor([token_ids[i] for i in rows], device=logits.device)
    chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    num_top = max(seqs[i].sampling.logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        num = seqs[i].sampling.logprobs or 0
        out[i] = TokenLogprobs(chosen[j], list(zip(ids[j][:num], values[j][:num], strict=True)))
    return out


def _flatten(logits: torch.Tensor, rows: list[int],
             token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row index and token id of every token of ``token_lists`` (one list per row of ``rows``), and
    each list's length."""
    device = logits.device
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    row_ids = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    token_ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    return row_ids, token_ids, lengths


def _per_token(values: list[float], lengths: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(values, dtype=like.dtype, device=like.device), lengths)


def _select(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``tensor[rows]``, without a copy when ``rows`` (always ascending here) is every row."""
    if len(rows) == tensor.shape[0]:
        return tensor
    return tensor[torch.tensor(rows, device=tensor.device)]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _seeded_uniform(seed: int, index: int) -> float:
    """A uniform in [0, 1) fixed by (seed, index): a counter-based draw, with no state to lose."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 11) * 2.0**-53
