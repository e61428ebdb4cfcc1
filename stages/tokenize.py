"""The ``tokenize`` stage: the chat messages, through the model's chat template, to token ids.

YAML::

    - id: tok
      type: tokenize
      with:
        model: smol               # default: the routed model, else the server's first model
        max_input_tokens: 2048    # default: no limit beyond the model's own
        overflow: drop_oldest     # error (default) | drop_oldest: drop the oldest
                                  #   non-system turns until the prompt fits (the
                                  #   conversation never opens with an assistant turn)

Writes ``prompt_ids``, ``prompt_tokens`` and the resolved ``model``. Functions a caller offers
(``tools``, from the OpenAI API) are rendered by the chat template where it takes them, else listed in
the system message (see :mod:`stages.tools`); that system message is then part of ``messages``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, cast

from pydantic import BaseModel, Field

from pipeline.context import ChatMessage, RequestContext, chat_turns
from pipeline.errors import InvalidInput
from pipeline.protocols import Catalog
from pipeline.refs import ModelRef
from pipeline.stage import CheckIssue, NoConfig, Stage, StageScope
from pipeline.tracing import GEN_AI_REQUEST_MODEL, GEN_AI_USAGE_INPUT_TOKENS
from stages.engines import engine_for
from stages.tools import prompt_encoder


class TokenizeConfig(NoConfig):
    #: Whose chat template and tokenizer (default: the routed model, else the server's first model).
    model: ModelRef | None = None
    #: Longer prompts are refused, or trimmed with ``overflow: drop_oldest``.
    max_input_tokens: int | None = Field(None, gt=0)
    #: error: refuse a prompt over the limit; drop_oldest: drop the oldest non-system turns until it fits.
    overflow: Literal["error", "drop_oldest"] = "error"


class TokenizeStage(Stage):
    type_name = "tokenize"
    Config = TokenizeConfig
    reads = frozenset({"messages", "tools", "tool_choice"})
    # It may trim ``messages`` (overflow: drop_oldest), but does not provide them: not in ``writes``.
    writes = frozenset({"prompt_ids", "prompt_tokens", "model"})

    @classmethod
    def model_of(cls, config: BaseModel) -> str | None:
        return cast(TokenizeConfig, config).model

    @classmethod
    def check(cls, config: BaseModel, catalog: Catalog) -> list[CheckIssue]:
        if cast(TokenizeConfig, config).model is None and not catalog.models:
            return [((), "no model to tokenize for: inferline.yaml has no models; add one, or set model:")]
        return []

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(TokenizeConfig, self.config)
        ctx.model, engine = await engine_for(self.resources, ctx.model or config.model or "")
        turns = chat_turns(ctx.messages)
        encode, rendered = prompt_encoder(engine.tokenizer, turns, ctx.tools, ctx.tool_choice)
        ids, kept = _fit(encode, rendered, config.max_input_tokens, config.overflow)
        ctx.prompt_ids, ctx.prompt_tokens = ids, len(ids)
        if kept != turns:  # a fallback or remote model gets the same conversation: trimmed, tools listed
            ctx.messages = [ChatMessage(t["role"], t["content"]) for t in kept]
        ctx.facts["prompt_model"] = ctx.model
        scope.set_attribute(GEN_AI_REQUEST_MODEL, ctx.model)
        scope.set_attribute(GEN_AI_USAGE_INPUT_TOKENS, len(ids))


def _fit(encode: Callable[[list[dict[str, str]]], list[int]], turns: list[dict[str, str]], limit: int | None,
         overflow: str) -> tuple[list[int], list[dict[str, str]]]:
    """The prompt's token ids and the turns they encode (fewer when the oldest were dropped)."""
    turns = list(turns)
    ids = encode(turns)
    while limit is not None and len(ids) > limit:
        if overflow == "error" or not _drop_oldest(turns):
            raise InvalidInput(f"the prompt has {len(ids)} tokens, over this pipeline's limit of {limit}"
                               + ("" if overflow == "error" else " even with only the last turn kept"))
        ids = encode(turns)
    return ids, turns


def _drop_oldest(turns: list[dict[str, str]]) -> bool:
    """Drop the oldest non-system turn before the last, and an assistant turn left leading."""
    earlier = [i for i, t in enumerate(turns[:-1]) if t["role"] != "system"]
    if not earlier:
        return False
    del turns[earlier[0]]
    # Never leave the conversation opening with an assistant turn.
    if len(earlier) > 1 and turns[earlier[1] - 1]["role"] == "assistant":
        del turns[earlier[1] - 1]
    return True
