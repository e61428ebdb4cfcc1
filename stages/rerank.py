"""Reranking for the ``retrieve`` stage: re-score the search's best candidates before its ``top_k``.

YAML (a ``retrieve`` step's ``with:``)::

    rerank: {model: minilm-ce, top_n: 20}    # a name under `rerankers:` in inferline.yaml

A ``cross_encoder`` reranker (a local sentence-transformers CrossEncoder folder) scores each (question,
passage) pair in a worker thread. An ``llm`` reranker asks one of the server's models, for each passage,
whether it answers the question, and scores the probability of "yes" against "no" from the first token's
log-probabilities; the passages go to the engine at once, so they are prefilled in the same batches as
each other and as the requests already running. With the bundled 135M model this is a working example,
not a quality claim: use a model trained for relevance when you have one.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import Field

from pipeline.errors import BackendError
from pipeline.protocols import ChatEngine, Engine, Resources, SamplingParams, SchedulingHints
from pipeline.refs import RerankerRef
from pipeline.stage import NoConfig
from stages.engines import engine_for

_SYSTEM = ("You judge search results. Read the question and the passage, and answer with one word: yes if "
           "the passage answers the question, no if it does not.")
_USER = "Question: {question}\n\nPassage:\n{passage}\n\nDoes the passage answer the question? Answer yes or no."


class RerankConfig(NoConfig):
    #: A reranker of inferline.yaml (``rerankers:``).
    model: RerankerRef
    #: How many of the search's best candidates are re-scored; the best ``top_k`` of them are kept.
    top_n: int = Field(20, ge=1, le=200)


@dataclass(frozen=True, slots=True)
class Reranked:
    """The scores of the passages, in their order, and the model tokens spent on them (an ``llm`` reranker)."""

    scores: list[float]
    input_tokens: int = 0
    output_tokens: int = 0
    #: The served model that scored (an ``llm`` reranker), for its price.
    model: str = ""


async def rerank(resources: Resources, name: str, question: str, passages: Sequence[str],
                 tenant: str = "") -> Reranked:
    """Scores of *passages* for *question* by reranker *name* (higher is better)."""
    info = resources.catalog.rerankers.get(name)
    if info is not None and info.kind == "llm":
        return await _llm_scores(resources, info.model, question, passages, tenant)
    if resources.rerankers is None:
        raise BackendError(f"reranker {name!r} needs the server's rerankers; run the pipeline through "
                           "`inferline run` or `inferline serve`")
    reranker = await resources.rerankers.get(name)
    return Reranked(list(await reranker.score(question, passages)))


async def _llm_scores(resources: Resources, model: str, question: str, passages: Sequence[str],
                      tenant: str) -> Reranked:
    model, engine = await engine_for(resources, model)
    results = await asyncio.gather(*(_ask(engine, question, passage, tenant) for passage in passages))
    return Reranked([score for score, _, _ in results], sum(n for _, n, _ in results),
                    sum(n for _, _, n in results), model)


async def _ask(engine: Engine, question: str, passage: str, tenant: str) -> tuple[float, int, int]:
    """P(yes) for one passage, with the prompt and output tokens it took."""
    messages = [{"role": "system", "content": _SYSTEM},
                {"role": "user", "content": _USER.format(question=question, passage=passage)}]
    sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20, speculative=False)
    prompt_ids: list[int] = []
    if isinstance(engine, ChatEngine):
        stream = await engine.submit_messages(messages, sampling, cache_salt=tenant)
    else:
        prompt_ids = engine.tokenizer.encode_chat(messages)
        stream = await engine.submit(prompt_ids, sampling, cache_salt=tenant,
                                     hints=SchedulingHints("interactive", tenant))
    first: int | None = None
    top: tuple[tuple[int, float], ...] = ()
    outputs, prompt_tokens = 0, len(prompt_ids)
    try:
        async for event in stream:
            prompt_tokens = event.num_prompt_tokens or prompt_tokens
            if event.token_id is not None and first is None:
                first, outputs = event.token_id, 1
                top = tuple(getattr(event, "top_logprobs", ()) or ())
            if event.finish_reason is not None:
                break
    finally:
        await stream.aclose()
    score = yes_probability(top, engine.tokenizer.decode) if top else None
    if score is None:  # no log-probabilities (or neither word among the likely tokens): read the answer
        answer = engine.tokenizer.decode([first]) if first is not None else ""
        score = 1.0 if answer.strip().lower().startswith("y") else 0.0
    return score, prompt_tokens, outputs


def yes_probability(top: Sequence[tuple[int, float]], decode: Callable[[list[int]], str]) -> float | None:
    """P(yes) / (P(yes) + P(no)) over the first token's likeliest candidates; None if neither is among them."""
    mass = {"yes": 0.0, "no": 0.0}
    for token_id, logprob in top:
        word = decode([token_id]).strip().lower()
        for label in ("yes", "no"):
            if word and label.startswith(word):
                mass[label] += math.exp(logprob)
                break
    total = mass["yes"] + mass["no"]
    return mass["yes"] / total if total else None
