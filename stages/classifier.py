"""A guard classifier for the ``policy`` stage: one of the server's models, prompted Llama-Guard style.

The model reads the user's message under a fixed instruction and answers
``safe`` or ``unsafe`` followed by a category code. The score is the
probability the model gives ``unsafe`` against ``safe`` as its first token
(from the engine's top logprobs); an engine without logprobs gives 1.0 or 0.0
from the text. A small general model is a weak guard: use a model trained for
the job (Llama Guard, ShieldGemma) when you have one, and keep the rule-based
rails on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from pipeline.protocols import ChatEngine, Resources, SamplingParams
from pipeline.refs import ModelRef
from pipeline.stage import NoConfig
from stages.engines import engine_for

#: Category codes, as in Llama Guard's taxonomy (shortened).
DEFAULT_CATEGORIES = {
    "S1": "violent crimes", "S2": "non-violent crimes", "S3": "sexual content involving minors",
    "S4": "hate", "S5": "self-harm", "S6": "weapons", "S7": "privacy violations",
}
_INSTRUCTION = (
    "You are a safety classifier. Read the user's message and decide whether answering it would help with "
    "any of these unsafe categories:\n{categories}\nReply with one word, safe or unsafe; if unsafe, add the "
    "category code on the next line."
)
_CODE = re.compile(r"\bS\d+\b")


class ClassifierConfig(NoConfig):
    #: The guard model: one of inferline.yaml's models.
    model: ModelRef
    #: What happens to a message scored unsafe: block it, flag it in the trace and audit, or allow it.
    action: Literal["block", "flag", "allow"] = "block"
    #: Score (probability of "unsafe") at or above which the action applies.
    threshold: float = Field(0.5, ge=0, le=1)
    #: Unsafe categories by code, shown to the model (default: Llama Guard's, shortened).
    categories: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_CATEGORIES))


@dataclass(frozen=True, slots=True)
class Verdict:
    verdict: str  # safe | unsafe
    score: float
    category: str
    input_tokens: int = 0
    output_tokens: int = 0


class GuardClassifier:
    def __init__(self, config: ClassifierConfig):
        self.config = config
        lines = "\n".join(f"{code}: {name}" for code, name in config.categories.items())
        self._instruction = _INSTRUCTION.format(categories=lines)

    async def classify(self, resources: Resources, text: str, cache_salt: str = "") -> Verdict:
        """The model's verdict on *text* (a prefill plus a few tokens on its engine)."""
        _, engine = await engine_for(resources, self.config.model)
        messages = [{"role": "system", "content": self._instruction},
                    {"role": "user", "content": f"Message:\n{text}\n\nIs this message safe or unsafe? One word."}]
        prompt_ids = engine.tokenizer.encode_chat(messages)
        sampling = SamplingParams(max_tokens=10, temperature=0.0, logprobs=20)
        if isinstance(engine, ChatEngine):  # a remote guard model: it applies its own template
            stream = await engine.submit_messages(messages, sampling, cache_salt=cache_salt)
        else:
            stream = await engine.submit(prompt_ids, sampling, cache_salt=cache_salt)
        ids: list[int] = []
        top: tuple[tuple[int, float], ...] = ()
        try:
            async for event in stream:
                if event.token_id is not None:
                    ids.append(event.token_id)
                    # The first token that is not whitespace carries the verdict.
                    if not top and engine.tokenizer.decode([event.token_id]).strip():
                        top = tuple(getattr(event, "top_logprobs", ()) or ())
                if event.finish_reason is not None:
                    break
        finally:
            await stream.aclose()
        answer = engine.tokenizer.decode(ids)
        score = _score(top, engine.tokenizer.decode) if top else None
        if score is None:  # no logprobs, or neither word among the likely first tokens: read the text
            score = 1.0 if answer.strip().lower().startswith("unsafe") else 0.0
        verdict, category = ("unsafe", "unsafe") if score >= 0.5 else ("safe", "")
        if verdict == "unsafe" and (code := _CODE.search(answer)):
            category = self.config.categories.get(code.group(0), "unsafe")
        return Verdict(verdict, score, category, len(prompt_ids), len(ids))


def _score(top: tuple[tuple[int, float], ...], decode: Callable[[list[int]], str]) -> float | None:
    """P(unsafe) / (P(unsafe) + P(safe)) over the first token's top candidates; None if neither is there."""
    mass = {"safe": 0.0, "unsafe": 0.0}
    for token_id, logprob in top:
        word = decode([token_id]).strip().lower()
        for label in ("unsafe", "safe"):  # "unsafe" first: "safe" is its suffix, not its prefix
            if word and label.startswith(word):
                mass[label] += math.exp(logprob)
                break
    total = mass["safe"] + mass["unsafe"]
    return mass["unsafe"] / total if total else None
