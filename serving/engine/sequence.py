"""One request's state inside the engine. Plain Python: no torch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from serving.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """A prompt and the tokens generated for it so far.

    ``num_computed_tokens`` counts the leading tokens whose keys and values are
    in the KV cache (from the prefix cache or earlier steps); the tokens after
    it still have to go through the model. A prefill may take several steps
    (chunked prefill); a sequence samples a token only in the step that
    computes its last token.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str = ""
    """Mixed into prefix-cache hashes: sequences with different salts never share blocks."""
    priority: int = 0
    """Priority class, lower first: 0 interactive, 1 batch (see wait_queue.py)."""
    tenant: str = ""
    """Whose request: tenants of one class take turns at admission."""
    deadline_s: float | None = None
    """``time.perf_counter()`` by which it must have been admitted; still waiting then, it finishes
    as ``deadline`` before any prefill. None: no deadline."""
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """Prefix-cache hashes of the leading full blocks of ``block_table`` (block manager's)."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at (the latest) admission."""
    num_preemptions: int = 0
    guesses: list[int] = field(default_factory=list)
    index: int = 0
    """Which of its request's ``n`` sequences this is (the OpenAI choice index)."""
    forks: list[Sequence] = field(default_factory=list)
    """The request's other sequences, not queued yet: the scheduler forks them from this one when its
    prompt is computed (they share its full prompt blocks), and empties the list."""
    matcher: Any = None
    """Constrained decoding: the request's position in its constraint (a constraints.Matcher), or None."""
    """Speculative decoding: tokens proposed to follow, for the next step to verify (see speculative.py)."""
    finish_reason: str | None = None
    """stop (EOS or a stop token) | length (max_tokens or max_model_len) | abort"""
    arrival_s: float = field(default_factory=time.perf_counter)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
