"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, for the tooling written against it.

    POST /tokenize   {"model": "chat", "prompt": "Hello"}     -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /tokenize   {"model": "chat", "messages": [...], "add_generation_prompt": true}
    POST /detokenize {"model": "chat", "tokens": [9906, 28]}  -> {"prompt": "Hello!"}

``model`` names a pipeline (its ``tokenize`` stage's model, else the server's first; an embeddings
pipeline's ``embed`` stage's model, which takes a ``prompt`` only: each text is embedded alone) or a model
of ``inferline.yaml``; the caller needs the pipeline's roles, or ``caller`` for a model. Errors come in
the OpenAI shape, as vLLM answers them. A model served remotely has no tokenizer here: a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.runner import Pipeline
from serving.http.openapi import openai_errors
from serving.http.problems import Problem
from serving.http.schemas import ChatMessageIn
from serving.http.services import Services

#: The most token ids one /detokenize takes, and the longest text one /tokenize takes.
MAX_TOKENS = 1 << 17
MAX_TEXT = 1 << 20


class TokenizeRequest(BaseModel):
    # The document says what _one_input checks: exactly one of prompt and messages.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"prompt": {"type": "null"}, "messages": {"type": "array"}}}]})
    model: str
    prompt: str | None = Field(None, max_length=MAX_TEXT)
    messages: list[ChatMessageIn] | None = Field(None, min_length=1)
    #: Default: true for a prompt, false for messages (the chat template has its special tokens).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    tokens: list[int] = Field(max_length=MAX_TOKENS)


@dataclass(slots=True)
class _Tokenizer:
    """What a /tokenize names: the tokenizer, its model and the most tokens that model reads."""

    tokenizer: Any
    model: str
    max_model_len: int
    #: An embedding model's: it reads texts, never a chat.
    texts_only: bool = False


async def _tokenizer(services: Services, request: Request, name: str) -> _Tokenizer:
    """The tokenizer *name* means (a pipeline's model, or a model), after checking the caller may use it."""
    server = services.runtime.workspace.server
    pipeline = services.executor.pipelines.get(name)
    principal = await services.auth.principal(request)
    if pipeline is not None:
        services.auth.require(principal, pipeline.spec.access.roles, f"tokenize for pipeline {name!r}")
        if pipeline.embeds:
            return await _embedder_tokenizer(services, pipeline)
        model = _model_of(services, pipeline)
        tokenizer, _ = await _model_tokenizer(services, model)
        return _Tokenizer(tokenizer, model, server.models[model].context_window)
    if name not in server.models:
        raise Problem(404, "Not found", f"no pipeline or model {name!r}; pipelines: "
                      f"{', '.join(sorted(services.executor.pipelines))}; models: {', '.join(server.models)}",
                      "model_not_found")
    services.auth.require(principal, ("caller",), f"tokenize for model {name!r}")
    tokenizer, _ = await _model_tokenizer(services, name)
    return _Tokenizer(tokenizer, name, server.models[name].context_window)


async def _embedder_tokenizer(services: Services, pipeline: Pipeline) -> _Tokenizer:
    """The tokenizer of the embedding model *pipeline*'s embedding step names: what counts its texts."""
    model = pipeline.embedding_model or ""
    backend = await services.runtime.embedders.get(model)  # BackendError: a 503
    tokenizer = getattr(backend, "tokenizer", None)
    if backend is None or tokenizer is None:
        raise Problem(400, "Bad request", f"embedding model {model!r} has no tokenizer here", "invalid_request")
    return _Tokenizer(tokenizer, model, backend.max_input_tokens, texts_only=True)


async def tokenizer_of(services: Services, pipeline: Pipeline) -> tuple[Any, str]:
    """The tokenizer of the model *pipeline*'s answer is encoded for (a chain's ``tokenize`` stage's, a workflow's
    answering ``llm`` step's; else the server's first), and that model: what encodes its prompts."""
    return await _model_tokenizer(services, _model_of(services, pipeline), "encode_chat")


def _model_of(services: Services, pipeline: Pipeline) -> str:
    return pipeline.answer_model or next(iter(services.runtime.workspace.server.models), "")


async def _model_tokenizer(services: Services, model: str, needs: str = "tokenize") -> tuple[Any, str]:
    """*model*'s tokenizer, which must have the method *needs* (a remote model's has none)."""
    engine = await services.runtime.engines.get(model)
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, needs):
        raise Problem(400, "Bad request", f"model {model!r} is served remotely: it has no tokenizer here",
                      "invalid_request")
    return tokenizer, model


@post("/tokenize", summary="Token ids of a text or a chat, as vLLM's /tokenize", tags=["openai"], status_code=200,
      responses=openai_errors(400, 401, 403, 404, 422, 503))
async def tokenize(data: JSONBody[TokenizeRequest], request: Request,
                   services: NamedDependency[Services]) -> dict[str, Any]:
    found = await _tokenizer(services, request, data.model)
    tokenizer = found.tokenizer
    if found.texts_only and data.messages is not None:
        raise Problem(400, "Bad request", f"messages: pipeline {data.model!r} makes embeddings of texts, each "
                      "read alone (no chat template): send the text as prompt", "invalid_request",
                      extra={"param": "messages"})
    chat = [{"role": m.role, "content": m.text()} for m in data.messages] if data.messages is not None else None
    special = data.add_special_tokens if data.add_special_tokens is not None else chat is None
    ids = tokenizer.tokenize(text=data.prompt, messages=chat, add_special_tokens=special,
                             add_generation_prompt=data.add_generation_prompt)
    return {"count": len(ids), "max_model_len": found.max_model_len,
            "tokens": ids, "token_strs": tokenizer.token_strings(ids) if data.return_token_strs else None}


@post("/detokenize", summary="The text of token ids, as vLLM's /detokenize", tags=["openai"], status_code=200,
      responses=openai_errors(400, 401, 403, 404, 422, 503))
async def detokenize(data: JSONBody[DetokenizeRequest], request: Request,
                     services: NamedDependency[Services]) -> dict[str, Any]:
    found = await _tokenizer(services, request, data.model)
    size = found.tokenizer.vocab_size()
    bad = [token for token in data.tokens if not 0 <= token < size]
    if bad:
        raise Problem(400, "Bad request", f"tokens: {bad[:5]} are not ids of model {found.model!r} (0 to "
                      f"{size - 1})", "invalid_request")
    return {"prompt": found.tokenizer.decode(data.tokens)}


#: Their errors come in the OpenAI shape, as vLLM's (the OpenAI router's: serving/http/routers.py).
ROUTES = [tokenize, detokenize]
