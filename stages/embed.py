"""The ``embed`` stage: the vectors of the request's texts, from a sentence-embedding model.

YAML::

    - id: vectors
      type: embed
      with:
        model: minilm        # a name under `embedding_models:` in inferline.yaml
        max_inputs: 2048     # texts one request may send

Each user message of the request is one text (``POST /v1/embeddings`` sends one per ``input``
item; a policy stage before this one may have redacted them). Writes ``embeddings`` (the vectors, in
the texts' order, and each text's token count), the usage (input tokens), the cost at the model's
``price.input_per_1k`` and ``facts["embedding"]`` (model, texts, tokens, dimensions). A request's
``dimensions`` (``params``) must be the model's own: these models cannot shorten their vectors. A
text longer than the model reads is refused, never cut.
"""

from __future__ import annotations

from typing import cast

from pydantic import BaseModel, Field

from pipeline.context import RequestContext
from pipeline.errors import BackendError, InvalidInput
from pipeline.refs import EmbeddingModelRef
from pipeline.stage import NoConfig, Stage, StageScope
from pipeline.tracing import GEN_AI_OPERATION_NAME, GEN_AI_REQUEST_MODEL, GEN_AI_USAGE_INPUT_TOKENS

#: The most texts one request may send (OpenAI's own limit).
MAX_INPUTS = 2048


class EmbedConfig(NoConfig):
    #: One of inferline.yaml's embedding_models.
    model: EmbeddingModelRef
    #: Texts one request may send.
    max_inputs: int = Field(MAX_INPUTS, ge=1, le=MAX_INPUTS)


class EmbedStage(Stage):
    type_name = "embed"
    Config = EmbedConfig
    reads = frozenset({"input_messages"})
    # Not ``model``: that names the generating model later stages submit to (the embedding model is in
    # ``facts["embedding"]``, which the audit record names).
    writes = frozenset({"embeddings"})

    @classmethod
    def model_of(cls, config: BaseModel) -> str | None:
        return cast(EmbedConfig, config).model

    async def run(self, ctx: RequestContext, scope: StageScope) -> None:
        config = cast(EmbedConfig, self.config)
        texts = [m.content for m in ctx.input_messages if m.role == "user"]
        if not texts:
            raise InvalidInput("input: no text to embed")
        if len(texts) > config.max_inputs:
            raise InvalidInput(f"input: {len(texts)} texts, over this pipeline's limit of {config.max_inputs}")
        if self.resources.embedders is None:
            raise BackendError("this server has no embedding models")
        backend = await self.resources.embedders.get(config.model)
        dimensions = ctx.params.get("dimensions")
        if dimensions is not None and dimensions != backend.dimensions:
            raise InvalidInput(f"dimensions: model {config.model!r} makes {backend.dimensions}-dimensional vectors "
                               f"only; send dimensions: {backend.dimensions} or none")
        result = await backend.embed(texts)
        ctx.embeddings = result
        num_tokens = sum(result.num_tokens)
        ctx.usage.input_tokens = num_tokens
        info = self.resources.catalog.embedding_models.get(config.model)
        if info is not None:
            scope.add_cost(info.price.tokens_usd(num_tokens, 0), "tokens", f"{config.model}: {num_tokens} in")
        summary = {"model": config.model, "inputs": len(texts), "tokens": num_tokens,
                   "dimensions": backend.dimensions}
        ctx.facts["embedding"] = summary
        ctx.facts.setdefault("decisions", {})[self.id] = summary
        scope.set_attribute(GEN_AI_OPERATION_NAME, "embeddings")
        scope.set_attribute(GEN_AI_REQUEST_MODEL, config.model)
        scope.set_attribute(GEN_AI_USAGE_INPUT_TOKENS, num_tokens)
