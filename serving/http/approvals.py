"""Requests paused for the client's approval of tool calls (an ``agent`` step's ``require_approval``), on the
pipeline API and the Responses API (docs/tools.md, "Approval").

A route that offers approval calls :func:`offer`, which sets :func:`keeper` as the request's
``approval_keeper``: when the agent step pauses, it has its state kept (:meth:`store.responses.ResponseStore.pause`,
for ``responses.retention_days``) before it ends, and :func:`pending_requests` shows the calls awaiting
approval; a request that fails after its pause has the kept state discarded. The client's next request names
the paused request and decides each call; :func:`resume` takes the kept state (once: a second resume of the
same request finds nothing) and hands it to the agent step with the decisions. A call left undecided is
denied. The resumed request's audit record holds each call's decision (``approval``: approved or denied).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from pipeline.context import ChatMessage, RequestContext, Reusable
from pipeline.errors import BackendError
from pipeline.runner import Pipeline
from serving.http.problems import Problem, bad_request
from serving.http.services import Services
from store.db import utcnow
from store.responses import PausedRequest

logger = logging.getLogger(__name__)


def offer(services: Services, ctx: RequestContext) -> None:
    """Let *ctx* pause for approval: its agent step has its state kept (:func:`keeper`), and a request that fails
    after it paused (a later step, its audit record) has the kept state discarded, so that no approval of a
    request the client was told failed can be resumed."""
    ctx.facts["approval_keeper"] = keeper(services)

    async def discard(ctx: RequestContext) -> None:
        if "approval_pending" in ctx.facts and ctx.status != "ok":
            owner = ctx.principal.key_id if ctx.principal is not None else None
            try:
                await asyncio.to_thread(services.responses.resume, ctx.request_id, owner)  # taken: gone
            except SQLAlchemyError as exc:
                logger.warning("paused request %s failed but its state was not discarded: %s", ctx.request_id, exc)

    ctx.finalizers.append(discard)


def keeper(services: Services) -> Callable[[RequestContext], Awaitable[None]]:
    """What keeps a paused request's state (``ctx.facts["approval_keeper"]``, awaited by the agent step as it
    pauses); BackendError when it cannot be kept: the step, and so the request, fails (503, and its audit record
    says so), since approval requests that cannot be resumed would be a lie."""

    async def keep(ctx: RequestContext) -> None:
        pending = ctx.facts["approval_pending"]
        created = utcnow()
        days = services.runtime.workspace.server.responses.retention_days
        owner = ctx.principal.key_id if ctx.principal is not None else None
        state = {**pending, "input": [{"role": m.role, "content": m.content} for m in ctx.input_messages]}
        paused = PausedRequest(ctx.request_id, owner, ctx.pipeline, state, created,
                               None if days is None else created + timedelta(days=days))
        try:
            await asyncio.to_thread(services.responses.pause, paused)
        except SQLAlchemyError as exc:
            logger.warning("paused request %s not kept: %s", ctx.request_id, exc)
            raise BackendError("the request paused for approval but its state could not be stored; retry it") \
                from None

    return keep


def pending_requests(ctx: RequestContext) -> list[dict[str, Any]] | None:
    """The calls a paused request awaits approval of (``id``, ``name``, ``server_label``, ``arguments`` as a
    JSON string); None when it did not pause."""
    pending = ctx.facts.get("approval_pending")
    if pending is None:
        return None
    return [{**request, "arguments": json.dumps(request["arguments"], ensure_ascii=False)}
            for request in pending["requests"]]


async def resume(services: Services, pipeline: Pipeline, ctx: RequestContext, request_id: str,
                 decisions: dict[str, bool], param: str) -> list[ChatMessage]:
    """Resume the paused request *request_id* in *ctx* with the client's *decisions* (by approval request id);
    the paused request's input messages. A 404 when there is none to resume (never paused, already resumed,
    expired, or another key's), a 400 for a decision on a call it did not await."""
    owner = ctx.principal.key_id if ctx.principal is not None else None
    paused = await asyncio.to_thread(services.responses.resume, request_id, owner)
    if paused is None:
        raise Problem(404, "Not found", f"no request {request_id!r} awaits approval (it never paused, was resumed "
                      "already, expired, or is another key's)", "approval_not_found", extra={"param": param})
    state = paused.state
    awaited = [request["id"] for request in state["requests"]]
    problem = None
    if paused.pipeline != ctx.pipeline:
        problem = bad_request(f"{param}: request {request_id!r} ran pipeline {paused.pipeline!r}, not "
                              f"{ctx.pipeline!r}", param)
    elif not pipeline.resumes_at(state["step"]):
        problem = Problem(409, "Conflict", f"pipeline {ctx.pipeline!r} no longer has the agent step "
                          f"{state['step']!r} that paused (a Responses request with mcp tools: send the same tools "
                          "again); otherwise start the request again", "approval_conflict")
    elif unknown := sorted(set(decisions) - set(awaited)):
        problem = bad_request(f"{', '.join(map(repr, unknown))}: not a call request {request_id!r} awaits "
                              f"(it awaits: {', '.join(awaited)})", param)
    if problem is not None:  # the client may try again with a right request
        await asyncio.to_thread(services.responses.pause, paused)
        raise problem
    ctx.facts["approval_resume"] = {"state": state, "decisions": decisions}
    ctx.reuse = {key: Reusable(**kept) for key, kept in state.get("reuse", {}).items()}
    ctx.tags["resumes"] = request_id
    return [ChatMessage(m["role"], m["content"]) for m in state["input"]]
