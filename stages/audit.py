"""The ``audit`` stage: one audit record per request, whatever happened to it.

YAML (mark it ``always: true`` so that failed, denied and disconnected
requests are recorded too)::

    - id: log
      type: audit
      always: true
      with:
        content: hash        # full | redacted | hash (SHA-256 only; the default) | encrypted
        subject: key         # content: encrypted: whose data key (key | tenant | tags.NAME); erasable per subject
        retention_days: 365  # how long `inferline audit prune` keeps this pipeline's records

``redacted`` stores the text a policy stage redacted (``facts["redacted_input"]``)
and the answer as the output rails redacted it (or, without output rails, with
its PII redacted here); it falls back to ``hash`` when no policy stage redacted
the input. An embeddings request's content is its list of texts (JSON), with no output: never
the vectors. A request for ``n`` answers keeps them all: its output content is
the JSON list of their texts, in index order (hashed, redacted or encrypted as
one text), and ``params.n`` says how many. A chat of several turns keeps them all: its input content
is the JSON list of its ``{"role", "content"}`` turns, and ``params.turns`` says how many. The request's
tags (the end user that OpenAI's ``user``
or Anthropic's ``metadata.user_id`` names is the ``user`` tag) are kept as its content is: as sent,
redacted, each value hashed, or encrypted with the content; with ``encrypted`` the record names its
subject only by a keyed hash, which the sink computes (``subject_hash``). The record
goes to the server's audit sink, which writes it durably (database, or a local
spool file while the database is away) and chains it into the tamper-evident log.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

from pydantic import Field

from pipeline.context import ChatMessage, RequestContext, StageRecord, chat_turns
from pipeline.errors import BackendError, InferlineError
from pipeline.stage import NoConfig, Stage, StageScope
from pipeline.step_results import differing_steps, step_results
from stages.detectors import Redactor, find_pii

#: ctx.status -> the record's status.
_STATUS = {"ok": "ok", "denied": "denied", "failed": "failed", "cancelled": "disconnected"}
_POLICY_STRENGTH = {"block": 3, "redact": 2, "flag": 1, "allow": 0}


class AuditConfig(NoConfig):
    #: What the record keeps of the input and output: full text, redacted text, only a SHA-256 hash, or
    #: the full text encrypted under the subject's data key (erasable: ``inferline audit erase``).
    content: Literal["full", "redacted", "hash", "encrypted"] = "hash"
    #: With ``content: encrypted``, whose data key: ``key`` (the caller's API key), ``tenant``, or
    #: ``tags.NAME`` (a tag the request sends, such as ``tags.user``). Erasure names it the same way:
    #: ``key:ID``, ``tenant:NAME``, ``tags.user:VALUE``.
    subject: str = Field("key", pattern=r"^(key|tenant|tags\.[A-Za-z0-9_.-]+)$")
    #: How long ``inferline audit prune`` keeps this pipeline's records.
    retention_days: int = Field(365, ge=1)


class AuditStage(Stage):
    type_name = "audit"
    Config = AuditConfig
    records_steps = True

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        if ctx.parent_request:  # a sub-pipeline's run: the calling request's record holds its steps
            scope.set_attribute("inferline.audit.nested_in", ctx.parent_request)
            return
        sink = self.resources.audit
        if sink is None:
            raise BackendError("no audit sink is configured in this process")
        await sink.write(build_record(ctx, cast(AuditConfig, self.config)))
        ctx.facts["audited"] = True  # the server records a refusal only if no audit stage did


#: Under ``content: encrypted``, a tool call's arguments and result in plain text, for the sink to encrypt
#: (serving/backends/audit_sink.py): never stored as they are.
SEALED = "to_seal"


def build_record(ctx: RequestContext, config: AuditConfig) -> dict[str, Any]:
    """The audit record of *ctx*, as the audit store takes it."""
    now = datetime.now(UTC)
    principal = ctx.principal
    policy = list(ctx.facts.get("policy", []))
    mode, input_text, output_text = _content(ctx, config.content)
    subject = {"content_subject": content_subject(ctx, config.subject)} if mode == "encrypted" else {}
    return {**subject,
        "request_id": ctx.request_id, "trace_id": ctx.trace_id,
        "received_at": ctx.received_at, "completed_at": now,
        "first_token_at": None if ctx.ttft_s is None else ctx.received_at + timedelta(seconds=ctx.ttft_s),
        "duration_ms": (now - ctx.received_at).total_seconds() * 1e3,
        "ttft_ms": None if ctx.ttft_s is None else ctx.ttft_s * 1e3,
        "key_id": principal.key_id if principal else None, "role": principal.role if principal else None,
        "client_addr": ctx.client_addr or None,
        "pipeline": ctx.pipeline, "pipeline_version": ctx.pipeline_version, "spec_sha256": ctx.spec_sha256,
        "model": ctx.model or ctx.facts.get("embedding", {}).get("model"),
        "weights_hash": ctx.facts.get("weights_hash"),
        "params": _params(ctx),
        "input_tokens": ctx.usage.input_tokens, "output_tokens": ctx.usage.output_tokens,
        "cost_usd": ctx.ledger.total_usd,
        "route": ctx.facts.get("route"), "retrieval": ctx.facts.get("retrieval"), "policy": policy,
        "policy_action": strongest_action(policy), "policy_categories": ",".join(sorted({p.get("category", "")
                                                                                   for p in policy} - {""})),
        "status": _STATUS.get(ctx.status, ctx.status), "finish_reason": ctx.finish_reason or None,
        "error_type": _error_type(ctx.error), "content_mode": mode,
        "input_content": input_text, "output_content": output_text, "tags": tags_content(ctx.tags, mode),
        "stages": [{"stage_id": s.id, "type": s.type, "status": s.status, "duration_ms": s.duration_s * 1e3,
                    "cost_usd": s.cost_usd, "decision": ctx.facts.get("decisions", {}).get(s.id),
                    "step": step_record(s, mode)}
                   for s in ctx.stages] + _shadow_stage(ctx),
    }


def step_record(stage: StageRecord, mode: str) -> dict[str, Any]:
    """What the record keeps of one attempt of one step beside its status, time and cost: which attempt, when it
    started, its tokens, why it was skipped, what it ran in the place of, and the SHA-256 of its definition, of
    what it read and of what it gave (what tells a replay which steps a candidate changed: with ``content: full``
    or ``hash`` only); with ``content: full`` those values too (what lets a replay reuse its output)."""
    kept: dict[str, Any] = {"attempt": stage.attempt, "started_ms": round(stage.started_s * 1e3, 3)}
    # The hashes of what it read and gave are the content's: kept as content: hash keeps it, not beside
    # redacted or encrypted content (a short value is found by hashing guesses, and erasure could not reach them).
    hashed = ("inputs_sha256", "output_sha256") if mode in ("full", "hash") else ()
    for name in ("skip_reason", "fallback_for", "parent", "definition_sha256", *hashed, "round", "reused"):
        if getattr(stage, name):
            kept[name] = getattr(stage, name)
    if stage.item is not None:
        kept["item"] = stage.item
    if stage.tool is not None:  # a tool call; its arguments' and result's hashes are content, kept as above
        kept["tool"] = {k: v for k, v in stage.tool.items()
                        if mode in ("full", "hash") or k not in ("arguments_sha256", "result_sha256")}
        if mode == "encrypted":  # the values, which the sink encrypts with the content (or keeps the hashes of)
            kept["tool"][SEALED] = {"arguments": (stage.inputs or {}).get("arguments"),
                                    "result": (stage.output or {}).get("result", ""),
                                    "arguments_sha256": stage.tool.get("arguments_sha256", ""),
                                    "result_sha256": stage.tool.get("result_sha256", "")}
    if stage.input_tokens or stage.output_tokens:
        kept |= {"input_tokens": stage.input_tokens, "output_tokens": stage.output_tokens}
    if mode == "full":
        kept |= {name: getattr(stage, name) for name in ("inputs", "output") if getattr(stage, name) is not None}
    return kept


def _params(ctx: RequestContext) -> dict[str, Any]:
    """The sampling the request was generated with (the end user it names is a tag, kept with the tags), and
    for a chat of several turns their number (its content is then the chat: :func:`_sent_input`)."""
    turns = {"turns": len(ctx.input_messages)} if len(ctx.input_messages) > 1 and "input_texts" not in ctx.facts \
        else {}
    return dict(ctx.facts.get("sampling", {})) | turns


def tags_content(tags: dict[str, str], mode: str) -> str | None:
    """The request's *tags* as the record keeps them under content *mode*, as JSON text (None without tags):
    as sent with ``full`` and ``encrypted`` (the sink encrypts them with the content), each value's SHA-256
    with ``hash``, each value with its PII redacted with ``redacted``."""
    if not tags:
        return None
    if mode == "hash":
        shown = {name: _sha256(value) for name, value in tags.items()}
    elif mode == "redacted":
        redactor = Redactor()  # one for all: a value in two tags gets one placeholder
        shown = {name: redactor.redact(value, find_pii(value)) for name, value in tags.items()}
    else:
        shown = dict(tags)
    return json.dumps(shown, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _shadow_stage(ctx: RequestContext) -> list[dict[str, Any]]:
    """On a shadow run, one more stage row, ``shadow``: which request it mirrors, that request as served
    (its version, latency, tokens, cost, policy decision), whether the outputs are identical, and which runs of
    steps gave something else (``steps_differing``). The served run's per-step results are compared, not kept:
    they are hashes of content, which the record keeps only where its ``content:`` mode says so."""
    served = ctx.facts.get("shadow")
    if not ctx.shadow_of or served is None:
        return []
    served = dict(served)
    served_steps = served.pop("steps", {})
    identical = served.get("output_sha256") == _sha256(ctx.output_text)
    return [{"stage_id": "shadow", "type": "shadow", "status": "ok", "duration_ms": 0.0, "cost_usd": 0.0,
             "decision": {"of": ctx.shadow_of, "output_identical": identical,
                          "policy_identical": served.get("policy_action") == strongest_action(
                              list(ctx.facts.get("policy", []))), "served": served,
                          "steps_differing": differing_steps(served_steps, step_results(ctx))}}]


def _content(ctx: RequestContext, mode: str) -> tuple[str, str, str]:
    if "input_texts" in ctx.facts:
        return _texts_content(ctx, mode)
    redacted = ctx.facts.get("redacted_input")
    sent = _sent_input(ctx, ctx.facts.get("original_messages", ctx.input_messages),
                       ctx.facts.get("original_input", ctx.input))
    if mode in ("full", "encrypted"):  # what the client sent, before any policy redaction (the sink encrypts)
        return mode, sent, output_content(ctx)
    if mode == "redacted" and redacted is not None:
        output = ctx.facts.get("redacted_output")
        if output is None:  # no output rails redacted the answer: redact its PII here
            output = output_content(ctx, lambda text: Redactor().redact(text, find_pii(text)))
        return "redacted", _sent_input(ctx, ctx.input_messages, redacted), output
    return "hash", _sha256(sent), _sha256(output_content(ctx))


def _sent_input(ctx: RequestContext, messages: list[ChatMessage], last_user: str) -> str:
    """The input as the record keeps it: the last user message's text, or, for a chat of several turns
    (``params.turns`` says how many), the JSON list of its ``{"role", "content"}`` turns: what replay sends
    again."""
    if len(ctx.input_messages) < 2:
        return last_user
    return json.dumps(chat_turns(messages), ensure_ascii=False)


def output_content(ctx: RequestContext, shown: Callable[[str], str] = str) -> str:
    """The answer as the record keeps it: its text, or with ``n`` above 1 every answer's text as a JSON list in
    index order (``["first", "second", ...]``); *shown* maps each text (a redaction)."""
    if not ctx.choices:
        return shown(ctx.output_text)
    return json.dumps([shown(choice.text) for choice in ctx.choices], ensure_ascii=False)


def _texts_content(ctx: RequestContext, mode: str) -> tuple[str, str, str]:
    """An embeddings request's content: its texts as a JSON list, and no output (never the vectors)."""
    sent = json.dumps(ctx.facts.get("input_texts", []), ensure_ascii=False)
    if mode in ("full", "encrypted"):
        return mode, sent, ""
    if mode == "redacted" and "redacted_input" in ctx.facts:  # the texts as the policy stage redacted them
        redacted = [m.content for m in ctx.input_messages if m.role == "user"]
        return "redacted", json.dumps(redacted, ensure_ascii=False), ""
    return "hash", _sha256(sent), ""


def content_subject(ctx: RequestContext, subject: str) -> str:
    """The subject whose data key encrypts *ctx*'s content: ``key:ID``, ``tenant:NAME`` or ``tags.F:VALUE``
    (an empty value when the request has none: ``key:`` without auth)."""
    if subject == "key":
        return f"key:{ctx.principal.key_id if ctx.principal else ''}"
    if subject == "tenant":
        return f"tenant:{ctx.tenant}"
    return f"{subject}:{ctx.tags.get(subject.removeprefix('tags.'), '')}"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def strongest_action(policy: list[dict[str, Any]]) -> str | None:
    """The strongest action among *policy*'s entries (block, redact, flag, allow): the record's
    ``policy_action``; None when no rule fired."""
    actions = [p.get("action", "") for p in policy]
    return max(actions, key=lambda a: _POLICY_STRENGTH.get(a, -1)) if actions else None


def _error_type(error: BaseException | None) -> str | None:
    if error is None:
        return None
    return error.kind if isinstance(error, InferlineError) else type(error).__name__
