"""The request bodies of the HTTP API: a pipeline request, and OpenAI's chat and completion requests.

Pydantic models: the app validates bodies against them and the OpenAPI document (``/schema``)
shows their JSON Schemas. Pipeline requests refuse unknown fields; OpenAI requests ignore the fields
of OpenAI's API that we do not use, as OpenAI's clients send them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from pipeline.context import ChatMessage
from serving.runtime.pipeline_tool import GenerationParams


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatInput(BaseModel):
    """``input`` or ``messages``: what a pipeline request and an evaluation case both send."""

    model_config = ConfigDict(extra="forbid")
    input: str | None = Field(None, description="A single user message.")
    messages: list[Message] | None = Field(None, description="A chat history ending with a user turn.")

    @model_validator(mode="after")
    def _one_input(self) -> ChatInput:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of 'input' or 'messages'")
        if self.messages is not None and not any(m.role == "user" for m in self.messages):
            raise ValueError("'messages' needs at least one user message")
        return self

    def chat(self) -> list[ChatMessage]:
        if self.messages is None:
            return [ChatMessage("user", self.input or "")]
        return [ChatMessage(m.role, m.content) for m in self.messages]


class PipelineRequest(ChatInput, GenerationParams):
    """The body of ``POST /pipelines/{name}``: ``input`` or ``messages`` (or ``resume``), plus options."""

    # The document says what _one_input checks: exactly one of them, and messages with a user turn, without
    # approvals; or resume (with approvals or none).
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["input"], "properties": {"input": {"type": "string"}, "messages": {"type": "null"},
                                               "resume": {"type": "null"}, "approvals": {"type": "null"}}},
        {"required": ["messages"], "properties": {"input": {"type": "null"}, "resume": {"type": "null"},
                                                  "approvals": {"type": "null"}, "messages": {
            "type": "array", "contains": {"type": "object", "required": ["role"],
                                          "properties": {"role": {"const": "user"}}}}}},
        {"required": ["resume"], "properties": {"input": {"type": "null"}, "messages": {"type": "null"},
                                                "resume": {"type": "string"}}}]})

    stream: bool = False
    tags: dict[str, str] = Field(default_factory=dict, description="Free-form tags, visible to `when:` and audit.")
    resume: str | None = Field(None, max_length=64, description=(
        "The request_id of a request paused for approval (its `pending_approval`): resume it with `approvals` "
        "(no `input` nor `messages`: the paused request's are used)."))
    approvals: list[ApprovalIn] | None = Field(None, description=(
        "With `resume`: the decision on each call awaiting approval; a call left out is denied."))

    @model_validator(mode="after")
    def _one_input(self) -> PipelineRequest:
        if self.resume is None:
            if self.approvals is not None:
                raise ValueError("'approvals' goes with 'resume' (the request_id of a paused request)")
            return ChatInput._one_input(self)  # type: ignore[return-value]
        if self.input is not None or self.messages is not None:
            raise ValueError("a request that resumes another takes its input: leave out 'input' and 'messages'")
        return self


class ApprovalIn(BaseModel):
    """The client's decision on one tool call awaiting approval (an item of ``pending_approval``)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(max_length=64, description="The call's id in `pending_approval`.")
    approve: bool


# -- the OpenAI API ----------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    #: vLLM's: every chunk carries the usage so far (guidellm asks for it).
    continuous_usage_stats: bool = False


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal...: accepted, not used
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class FunctionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    #: Honoured by every call: a call is answered only with arguments its ``parameters`` accept (a forced
    #: call is decoded under that schema). ``true`` also asks for OpenAI's strict schema rules, checked.
    strict: bool | None = None


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionIn


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field("response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaIn


RESPONSE_FORMAT: TypeAdapter[Any] = TypeAdapter(
    Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")])
TOOLS: TypeAdapter[list[ToolIn]] = TypeAdapter(list[ToolIn])
TOOL_CHOICE: TypeAdapter[Any] = TypeAdapter(Literal["auto", "none", "required"] | NamedToolChoice)


class OpenAIRequest(GenerationParams):
    """What the chat and completions requests share."""

    # A field we do not know is kept aside and refused by name (serving/http/openai_routes.py): never ignored.
    model_config = ConfigDict(extra="allow")
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    #: How many answers (``choices``): the pipeline runs once and the model forks them from one prefill.
    n: int = Field(1, ge=1, le=16)
    max_completion_tokens: int | None = Field(None, ge=1)
    #: The end user: kept as the request's ``user`` tag (``when:``, routes, templates, an audit stage's
    #: ``subject: tags.user``).
    user: str | None = Field(None, max_length=256)
    #: Accepted either way: an answer makes at most one tool call, which both values allow.
    parallel_tool_calls: bool | None = None

    def refused_fields(self) -> list[str]:
        """What this request asks for that is not done here: unknown fields (``logit_bias`` among them)."""
        return sorted(self.model_extra or {})

    def num_logprobs(self) -> int | None:
        """How many likeliest tokens' log-probabilities to return with each token (None: no log-probabilities;
        the chat and completion requests each ask in their own way)."""
        return None

    def overrides(self) -> dict[str, Any]:
        params = super().overrides()
        if self.max_completion_tokens is not None:
            params["max_tokens"] = self.max_completion_tokens
        if self.n != 1:
            params["n"] = self.n
        if (num := self.num_logprobs()) is not None:
            params["logprobs"] = num
        return params

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    #: Return each token's log-probability (``choices[].logprobs.content``).
    logprobs: bool | None = None
    #: With ``logprobs: true``, also this many likeliest tokens' at each position.
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Checked by the handler, not the body's schema: a malformed value is OpenAI's 400 naming the param.
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None


    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(OpenAIRequest):
    prompt: str
    #: Return each token's log-probability, with this many likeliest tokens' at each position.
    logprobs: int | None = Field(None, ge=0, le=20)

    def num_logprobs(self) -> int | None:
        return self.logprobs


# -- the Responses API ------------------------------------------------------------------------


class ResponsesFunctionIn(BaseModel):
    """A function tool in the Responses API's flat shape."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ResponsesJsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Annotated[TextFormat | JsonObjectFormat | ResponsesJsonSchemaFormat,
                      Field(discriminator="type")] = Field(default_factory=lambda: TextFormat(type="text"))


RESPONSES_TEXT: TypeAdapter[ResponsesText] = TypeAdapter(ResponsesText)
RESPONSES_TOOLS: TypeAdapter[list[ResponsesFunctionIn]] = TypeAdapter(list[ResponsesFunctionIn])
RESPONSES_TOOL_CHOICE: TypeAdapter[Any] = TypeAdapter(Literal["auto", "none", "required"] | ResponsesNamedChoice)


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``: OpenAI's Responses API, the parameters this server does."""

    # A field we do not know is kept aside and refused by name (serving/http/responses_routes.py).
    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[Any] = Field(description="A user message, or a list of items: messages, function calls "
                                   "and their outputs.")
    instructions: str | None = Field(None, description="A system message before the input (not carried over "
                                     "by previous_response_id).")
    max_output_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # Checked by the handler, not the body's schema: a malformed value is OpenAI's 400 naming the param.
    text: Any = None
    tools: Any = None
    tool_choice: Any = None
    #: Accepted either way: an answer makes at most one tool call, which both values allow.
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = Field(True, description="Keep the response for GET /v1/responses/{id} and previous_response_id.")
    previous_response_id: str | None = Field(None, max_length=64)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    #: The end user: kept as the request's ``user`` tag, as in the chat API.
    user: str | None = Field(None, max_length=256)

    def overrides(self) -> dict[str, Any]:
        params = {"max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p}
        return {name: value for name, value in params.items() if value is not None}


# -- deploying pipeline versions ----------------------------------------------------------------


class DeployRequest(BaseModel):
    """The body of ``POST /pipelines/{name}/versions``."""

    model_config = ConfigDict(extra="forbid")
    yaml: str = Field(min_length=1, max_length=1 << 20, description="The pipeline file, as YAML text.")
    activate: bool = Field(True, description=(
        "false: check and keep the version without serving it, for a canary split, a shadow or a pin."))


class ActivateRequest(BaseModel):
    """The body of ``POST /pipelines/{name}/activate``."""

    model_config = ConfigDict(extra="forbid")
    spec_sha256: str = Field(min_length=1, max_length=64, description=(
        "The version: six or more characters of its spec hash, or its version: label."))


class TrafficRequest(BaseModel):
    """The body of ``PUT /pipelines/{name}/traffic``."""

    model_config = ConfigDict(extra="forbid")
    weights: dict[str, int] = Field(min_length=1, max_length=16, description=(
        'Version (its version: label, or six or more characters of its spec hash) -> weight, e.g. '
        '{"3": 95, "4": 5}: each caller key sticks to one version, chosen by the weights.'))


class ShadowRequest(BaseModel):
    """The body of ``PUT /pipelines/{name}/shadow``."""

    model_config = ConfigDict(extra="forbid")
    version: str = Field(min_length=1, max_length=64, description=(
        "The candidate: a kept version's version: label, or six or more characters of its spec hash."))
    percent: float = Field(gt=0, le=100, description=(
        "The share of the pipeline's requests that also run on the candidate, whose answer is never sent."))
