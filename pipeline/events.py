"""What the runner tells its caller while a request runs.

Per executed step (per attempt, when it is retried): :class:`StageStarted` then
:class:`StageFinished`; a skipped step gets only :class:`StageFinished` with status
``skipped`` and its reason. Steps that do not need each other run at the same time,
so their events interleave. Text for
the client comes as :class:`TextDelta`. The last event is always exactly one
:class:`Done` or :class:`Error`.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass

from pipeline.context import Choice, Source, StageRecord, TokenLogprob, Usage


@dataclass(frozen=True, slots=True)
class StageStarted:
    stage_id: str
    type: str
    #: Which attempt of the step (a retry: runs it again).
    attempt: int = 1
    #: The step it runs under (a sub-pipeline's), "" at the top.
    parent: str = ""


@dataclass(frozen=True, slots=True)
class StageFinished:
    stage_id: str
    type: str
    #: ok | skipped | failed | timeout | cancelled | denied
    status: str
    duration_s: float
    cost_usd: float
    error: str = ""
    attempt: int = 1
    parent: str = ""
    #: Why a skipped step did not run: when, failed or ended (StageRecord.skip_reason).
    skip_reason: str = ""
    #: Whether the runner runs it again (its retry: covers this failure).
    retrying: bool = False


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    stage_id: str
    #: Which answer it belongs to, when the request asked for ``n`` of them (0 otherwise).
    index: int = 0
    #: With ``logprobs`` asked for, those of the tokens this delta's text came from (a delta may carry
    #: tokens that made no text yet, and text may wait for a later token: a stop string being matched).
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Summary:
    """What every request returns to its caller, success or not."""

    request_id: str
    trace_id: str
    pipeline: str
    duration_s: float
    ttft_s: float | None
    cost_usd: float
    stages: tuple[StageRecord, ...]
    usage: Usage
    output_text: str
    finish_reason: str
    #: The retrieved documents the request ended with (those its prompt placed), numbered as cited; empty
    #: when the pipeline retrieved nothing.
    sources: tuple[Source, ...] = ()
    #: The version that served the request: its ``version:`` label and the SHA-256 of its YAML text.
    pipeline_version: str = ""
    spec_sha256: str = ""
    #: With ``n`` above 1, every answer (``output_text`` and ``finish_reason`` are choice 0's); else empty.
    choices: tuple[Choice, ...] = ()
    #: With ``logprobs`` asked for, the tokens' log-probabilities (choice 0's with n above 1).
    logprobs: tuple[TokenLogprob, ...] = ()
    #: When its answer's last text went out, from the request's start: the end of its answering step (a chain's
    #: ``stream`` stage, a workflow's answering ``llm`` step); None when none ended ok. With ``ttft_s``, what
    #: inter-token latency is measured over.
    last_token_s: float | None = None


@dataclass(frozen=True, slots=True)
class Done:
    summary: Summary


@dataclass(frozen=True, slots=True)
class Error:
    #: denied | failed | cancelled
    status: str
    #: the error's kind (``policy_denied``, ``stage_timeout``, ...)
    kind: str
    message: str
    stage_id: str
    summary: Summary


Event = StageStarted | StageFinished | TextDelta | Done | Error


async def final_event(events: AsyncIterable[Event]) -> Done | Error:
    """Consume a run's events and return the last ``Done`` or ``Error`` (a runner always ends with one)."""
    final: Done | Error | None = None
    async for event in events:
        if isinstance(event, (Done, Error)):
            final = event
    if final is None:
        raise RuntimeError("pipeline ended without a final event")
    return final
