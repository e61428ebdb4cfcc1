"""The policy stage's rails: detectors turned into decisions, on the input and on streamed output.

A *rail* is a detector (PII, deny rules, prompt injection) with an action:
``block`` refuses (input) or stops the stream (output), ``redact`` replaces the
span with a typed placeholder, ``flag`` only records, ``allow`` turns it off.
Every finding that acts is a :class:`Decision`; decisions are data, recorded
in the trace and the audit record, and never carry the offending text.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from stages.detectors import PII_TYPES, PLACEHOLDER, PLACEHOLDER_MAX_CHARS, DenyMatcher, Finding, find_pii

Action = Literal["block", "redact", "flag", "allow"]
_STRENGTH = {"allow": 0, "flag": 1, "redact": 2, "block": 3}


@dataclass(frozen=True, slots=True)
class Decision:
    """One rule that fired: what it was, what was done, and where (never the matched text)."""

    stage: str
    where: str  # input | output
    rule: str
    category: str
    action: str
    score: float
    span: tuple[int, ...]  # (message index, start, end) on input; (start, end) in the output

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "where": self.where, "rule": self.rule, "category": self.category,
                "action": self.action, "score": round(self.score, 4), "span": list(self.span)}


@dataclass(frozen=True, slots=True)
class Detectors:
    """The detectors of one direction (input or output) with the action of each rule."""

    pii_actions: Mapping[str, Action]  # pii type -> action; types set to allow are absent
    deny: DenyMatcher | None
    deny_actions: Mapping[str, Action]  # deny rule id -> action

    def scan(self, text: str) -> list[tuple[Finding, Action]]:
        """Every finding with its action, sorted by start."""
        found: list[tuple[Finding, Action]] = []
        if self.pii_actions:
            found += [(f, self.pii_actions[f.rule.removeprefix("pii.")])
                      for f in find_pii(text, tuple(self.pii_actions))]
        if self.deny is not None:
            found += [(f, self.deny_actions[f.rule.removeprefix("deny.")]) for f in self.deny.find(text)]
        found.sort(key=lambda item: (item[0].start, -item[0].end))
        return found

    @property
    def active(self) -> bool:
        return bool(self.pii_actions) or self.deny is not None


def pii_actions(action: Action, per_type: Mapping[str, Action], types: Sequence[str] = PII_TYPES) -> dict[str, Action]:
    chosen = {t: per_type.get(t, action) for t in types}
    return {t: a for t, a in chosen.items() if a != "allow"}


def non_overlapping(findings: Sequence[Finding]) -> list[Finding]:
    """The findings to redact, earliest first, skipping any that overlaps one already kept."""
    kept: list[Finding] = []
    for finding in sorted(findings, key=lambda f: (f.start, -f.end)):
        if not kept or finding.start >= kept[-1].end:
            kept.append(finding)
    return kept


def _outside(found: Sequence[tuple[Finding, Action]], cut: int) -> int:
    """*cut*, moved back to the start of every finding it falls inside (repeatedly: they may overlap)."""
    moved = True
    while moved:
        moved = False
        for finding, _ in found:
            if finding.start < cut < finding.end:
                cut, moved = finding.start, True
    return cut


def strongest(actions: Sequence[str]) -> str:
    return max(actions, key=_STRENGTH.__getitem__, default="allow")


class OutputRails:
    """Output rails over streamed text (a ``pipeline.protocols.TextFilter``).

    The last ``hold_back`` characters are held back, and never a cut inside a
    word or a finding, so that a span that must be blocked or redacted is whole
    before anything of it is released. On a block the text before the span is
    sent and the stream stops with finish reason ``content_filter``. With
    *restore*, placeholders that input redaction put in the prompt are replaced
    by their values in what the client receives (after the rails have run, so
    restored values are the caller's own, not model-made PII).
    """

    def __init__(self, stage_id: str, detectors: Detectors, hold_back: int,
                 restore: Mapping[str, str] | None = None,
                 on_decision: Callable[[dict[str, Any]], None] | None = None, taken: Collection[str] = ()):
        self._stage = stage_id
        self._detectors = detectors
        self._hold_back = hold_back
        self._restore = restore
        self._on_decision = on_decision
        self._pending = ""
        self._offset = 0  # characters released so far: output spans are absolute
        self._taken = set(taken)  # the input's placeholders: output ones are numbered past them
        self._names: dict[tuple[str, str], str] = {}
        self._sent: list[str] = []
        self._stopped = False
        self.decisions: list[dict[str, Any]] = []

    @property
    def sent_redacted(self) -> str:
        return "".join(self._sent)

    def feed(self, text: str) -> tuple[str, str | None]:
        if self._stopped:
            return "", "content_filter"
        if not text:
            return "", None
        self._pending += text
        return self._release(final=False)

    def flush(self) -> tuple[str, str | None]:
        if self._stopped:
            return "", "content_filter"
        return self._release(final=True)

    def _release(self, final: bool) -> tuple[str, str | None]:
        pending = self._pending
        found = self._detectors.scan(pending) if self._detectors.active else []
        block = next((f for f, action in found if action == "block"), None)
        if block is not None:  # send what comes before it, never part of an overlapping span or its word
            cut = self._word_start(pending, _outside(found, block.start))
        elif final:
            cut = len(pending)
        else:
            cut = self._safe_cut(pending, found)
        released = [(f, a) for f, a in found if f.end <= cut and f is not block]
        for finding, action in [*released, *([(block, "block")] if block is not None else [])]:
            self._decide(finding, action)
        text, sent = self._assemble(pending[:cut], non_overlapping([f for f, a in released if a == "redact"]))
        self._pending = pending[cut:]
        self._offset += cut
        self._sent.append(sent)
        if block is not None:
            self._stopped = True
            self._pending = ""
            return text, "content_filter"
        return text, None

    def _assemble(self, text: str, redact: list[Finding]) -> tuple[str, str]:
        """(what the client gets, what is recorded): model-made PII redacted; in the first, the caller's
        own values restored, around (never into) the new placeholders, which are numbered past the
        input's so that the two cannot be confused."""
        client, recorded, position = [], [], 0
        for finding in redact:
            piece = text[position:finding.start]
            placeholder = self._placeholder(finding.kind or "REDACTED", text[finding.start:finding.end])
            client += [self._restored(piece), placeholder]
            recorded += [piece, placeholder]
            position = finding.end
        client.append(self._restored(text[position:]))
        recorded.append(text[position:])
        return "".join(client), "".join(recorded)

    def _placeholder(self, kind: str, value: str) -> str:
        name = self._names.get((kind, value))
        if name is None:
            number = sum(1 for k, _ in self._names if k == kind) + 1
            while f"<{kind}_{number}>" in self._taken:
                number += 1
            name = self._names[kind, value] = f"<{kind}_{number}>"
            self._taken.add(name)
        return name

    def _restored(self, text: str) -> str:
        if not self._restore or "<" not in text:
            return text
        restore = self._restore
        return PLACEHOLDER.sub(lambda m: restore.get(m.group(0), m.group(0)), text)

    def _word_start(self, pending: str, cut: int) -> int:
        """*cut* moved to the start of the word it is in (a secret, an address or a keyword may still be
        growing there); a run without spaces longer than ``hold_back`` is cut anyway."""
        word = cut
        while word > 0 and word < len(pending) and not pending[word - 1].isspace() and not pending[word].isspace():
            word -= 1
        return word if cut - word <= self._hold_back else cut

    def _safe_cut(self, pending: str, found: list[tuple[Finding, Action]]) -> int:
        """Where to cut: ``hold_back`` before the end, then earlier until the cut is inside no finding,
        no word (within ``hold_back``: a run without spaces is cut anyway) and no placeholder."""
        cut = max(0, len(pending) - self._hold_back)
        while True:
            moved = self._word_start(pending, _outside(found, cut))
            opener = pending.rfind("<", max(0, moved - PLACEHOLDER_MAX_CHARS), moved)
            if self._restore is not None and opener >= 0 and ">" not in pending[opener:moved]:
                moved = opener  # restoring must see a placeholder whole
            if moved == cut:
                return cut
            cut = moved

    def _decide(self, finding: Finding, action: Action) -> None:
        decision = Decision(self._stage, "output", finding.rule, finding.category, action, finding.score,
                            (self._offset + finding.start, self._offset + finding.end)).to_dict()
        self.decisions.append(decision)
        if self._on_decision is not None:
            self._on_decision(decision)
