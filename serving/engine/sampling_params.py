"""Per-request sampling parameters, validated before anything is queued."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from serving.engine.errors import InvalidRequest

#: The most sequences one request may ask for (``n``).
MAX_N = 16
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """0 means off."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    """End-of-sequence and stop token ids cannot be sampled before this many output tokens (vLLM's)."""
    logprobs: int | None = None
    """Return this many top log-probabilities per token (None: none)."""
    speculative: bool = True
    """Let the engine's speculative decoding guess this request's tokens (when the engine has it on).

    The output is the same either way (speculative.py); turning it off only changes the speed.
    """
    output: Mapping[str, Any] | None = None
    """Constrained decoding: exactly one of ``{"json_schema": {...}}``, ``{"regex": "..."}`` or
    ``{"choice": ["...", ...]}``; the output is guaranteed to match (see constraints.py)."""
    n: int = 1
    """How many sequences to sample from the prompt: it is prefilled once, and the other ``n - 1`` are
    forked from it, sharing its full KV blocks (see engine.py)."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of sequence *index* of an ``n``-sequence request: ``n`` 1, and with a seed, a
        seed of its own derived from it (sequence 0 keeps the request's), so that seeded choices differ
        from one another and each reproduces run to run."""
        seed = self.seed if self.seed is None or index == 0 else choice_seed(self.seed, index)
        return replace(self, n=1, seed=seed)

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`InvalidRequest` naming the first bad parameter."""
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(0 <= t < vocab_size for t in self.stop_token_ids),
             f"stop_token_ids must be token ids in [0, {vocab_size})"),
            (self.output is None or (isinstance(self.output, Mapping) and len(self.output) == 1
                                     and next(iter(self.output)) in ("json_schema", "regex", "choice")),
             "output must be exactly one of {json_schema: ...}, {regex: ...} or {choice: [...]}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)


def choice_seed(seed: int, index: int) -> int:
    """Sequence *index*'s seed in a request seeded *seed*: a splitmix64 mix of the two, a non-negative
    63-bit integer."""
    z = ((seed & _MASK64) + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1
