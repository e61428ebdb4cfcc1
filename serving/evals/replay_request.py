"""An audited request rebuilt from its audit record, to be sent again by a replay (serving/evals/replay.py).

    served = generate_config(version_text)        # the generate stage of the version that served it
    candidate = generate_config(candidate_text)   # ... and of the candidate (None: not known here)
    request = rebuild(record, served, candidate)
    request.text, request.params, request.tags, request.not_restored

What a record keeps of its request: the last user message (``input_content``, with ``content: full``), or
for a chat of several turns (``params.turns``) the JSON list of its turns, all sent again,
the sampling its answer was generated with (``params``: ``temperature``, ``top_p``, ``max_tokens``,
``seed``, and ``n`` and the output constraint's kind when used), and its ``tags``, the end user among
them (``user``; records from before tags were kept name it as ``params.user``). The recorded sampling
is what the ``generate`` stage ran, the pipeline's own values and the caller's together: a value that
differs from the serving version's own is the caller's (or a policy's cap, which the candidate's
policy would set alike), and is sent again; the others were the pipeline's, and the candidate's own
apply, so that a candidate that changes them shows it. When the serving version is not known, every
recorded value is sent. What cannot be sent again is named per record in ``not_restored``:
``{"what", "why"}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pipeline.yamlsrc import parse
from stages.generate import GenerateConfig
from stages.llm import LlmConfig

#: What a record's ``params`` keep of the sampling, beside the output constraint's kind and the user.
SAMPLED = ("max_tokens", "temperature", "top_p", "seed", "n")


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """What a replay sends for one record: its last user message, the caller's sampling, its tags (the end
    user among them), and what of the request could not be sent again and why."""

    text: str
    params: dict[str, Any]
    tags: dict[str, str]
    not_restored: tuple[dict[str, str], ...]
    #: The whole chat (``{"role", "content"}`` turns, *text* the last user one), when the record keeps one.
    messages: tuple[dict[str, str], ...] = ()

    def body(self) -> dict[str, Any]:
        """The pipeline API's body for it: ``messages`` for a chat, else ``input``; the sampling params."""
        sent: dict[str, Any] = {"messages": list(self.messages)} if self.messages else {"input": self.text}
        return sent | self.params


def generate_config(text: str) -> GenerateConfig | None:
    """The config of the step whose sampling callers set, in pipeline YAML *text*: the last ``generate`` stage
    (whose sampling a record keeps), else a workflow's last ``llm`` step (its answer, which takes the callers'
    options); None when the text does not parse or has neither."""
    src, issues = parse("version.yaml", text)
    data = src.data if src is not None and not issues else None
    stages = [s for s in data.get("stages") or () if isinstance(s, dict)] if isinstance(data, dict) and \
        isinstance(data.get("stages"), list) else []
    for kind, config in (("generate", GenerateConfig), ("llm", LlmConfig)):
        found = [stage for stage in stages if stage.get("type") == kind]
        if found:
            try:
                return config.model_validate(found[-1].get("with") or {})
            except ValidationError:
                return None
    return None


def rebuild(record: dict[str, Any], served: GenerateConfig | None, candidate: GenerateConfig | None, *,
            can_send_n: bool = True) -> ReplayRequest:
    """The request *record* keeps, as a replay sends it to a candidate whose generate stage is *candidate*
    (None: not known; what it refuses, it then refuses at the request). *served*: the generate stage of
    the version that answered it (None: not kept). *can_send_n*: whether the route takes ``n``."""
    missing: list[dict[str, str]] = []
    recorded: dict[str, Any] = dict(record.get("params") or {})
    text, messages = _input(record, recorded.pop("turns", None), missing)
    if served is None:
        missing.append({"what": "sampling", "why": "the version that served it is not kept: every recorded "
                                                   "value is sent as the caller's"})
    params: dict[str, Any] = {}
    for name in SAMPLED:
        value = recorded.get(name)
        if value is None or (served is not None and value == getattr(served, name)):
            continue  # not set, or the serving pipeline's own value: the candidate's own applies
        why = _refused(name, value, candidate, can_send_n)
        if why:
            missing.append({"what": name, "why": why})
        elif candidate is None or value != getattr(candidate, name):
            params[name] = value
    kind = recorded.get("output")
    if kind and (served is None or served.output is None):
        missing.append({"what": "output", "why": f"the caller's {kind} constraint: the record keeps its kind only"})
    tags = _tags(record, missing)
    if recorded.get("user") and "user" not in tags:  # where an older record kept the end user (the user tag)
        tags["user"] = str(recorded["user"])
    return ReplayRequest(text, params, tags, tuple(missing), messages)


def _input(record: dict[str, Any], turns: Any, missing: list[dict[str, str]]) -> tuple[str, tuple[dict[str, str], ...]]:
    """The last user message and, for a chat of *turns* turns, every turn, as *record* keeps them."""
    content = record.get("input_content") or ""
    if not turns:
        return content, ()
    try:
        chat = json.loads(content)
        messages = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in chat)
    except (ValueError, TypeError, KeyError):
        missing.append({"what": "earlier turns", "why": f"a chat of {turns} turns, kept in a form that cannot be "
                                                        "sent (not the JSON list of its turns)"})
        return content, ()
    last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    return last, messages


def _tags(record: dict[str, Any], missing: list[dict[str, str]]) -> dict[str, str]:
    """The tags *record* keeps (none: it sent none); what it does not keep, noted in *missing*."""
    if "tags" not in record:  # a server from before records kept tags
        missing.append({"what": "tags", "why": "not in the record"})
        return {}
    tags = record["tags"]
    if tags is None:
        return {}
    if not isinstance(tags, dict):
        missing.append({"what": "tags", "why": "the record keeps them in a form that cannot be sent (not a JSON "
                                               "object)"})
        return {}
    return {str(name): str(value) for name, value in tags.items()}


def _refused(name: str, value: Any, candidate: GenerateConfig | None, can_send_n: bool) -> str:
    """Why *value* of *name* cannot be sent to the candidate ('' when it can)."""
    if name == "n" and not can_send_n:
        return f"{value} answers: the pipeline API answers one; compared with the first recorded answer"
    if candidate is None or value == getattr(candidate, name):
        return ""
    if name not in candidate.client_params:
        return f"{value}: the candidate does not let callers set it (its own is {getattr(candidate, name)})"
    if name == "max_tokens" and value > candidate.max_tokens:
        return f"{value}: over the candidate's limit of {candidate.max_tokens}, which applies"
    return ""
