"""Cost accounting: every stage reports what it cost, in US dollars.

Two kinds of cost exist. *Token* cost prices a model's input and output tokens
by the ``price`` block of its config (per 1,000 tokens). *Compute* cost prices
the time a stage spent on our own hardware (``compute_per_s``), so that a local
model has a cost comparable with a remote one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Price:
    """Prices of one model, in USD."""

    input_per_1k: float = 0.0
    output_per_1k: float = 0.0
    compute_per_s: float = 0.0

    def tokens_usd(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_1k + output_tokens * self.output_per_1k) / 1000.0

    def compute_usd(self, seconds: float) -> float:
        return seconds * self.compute_per_s


@dataclass(frozen=True, slots=True)
class CostEntry:
    """One line of the ledger."""

    stage_id: str
    kind: str  # tokens | compute | other
    usd: float
    detail: str = ""


@dataclass(slots=True)
class CostLedger:
    """All costs of one request, line by line."""

    entries: list[CostEntry] = field(default_factory=list)

    def add(self, stage_id: str, usd: float, kind: str = "other", detail: str = "") -> None:
        if usd < 0:
            raise ValueError(f"a cost cannot be negative, got {usd}")
        self.entries.append(CostEntry(stage_id, kind, usd, detail))

    def stage_total(self, stage_id: str) -> float:
        return sum(e.usd for e in self.entries if e.stage_id == stage_id)

    @property
    def total_usd(self) -> float:
        return sum(e.usd for e in self.entries)
