"""OpenTelemetry set-up and the attribute names we use.

One span per request (``pipeline NAME``) with one child span per stage
(``stage ID``). Stages add GenAI semantic-convention attributes to their own
span through ``scope.set_attribute`` with the names below. Without an exporter
nothing is recorded, and the stages write to the request's no-op span (the
runner makes no stage spans then; see ``Runner._stage_span``).
"""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler, SamplingResult

# OpenTelemetry GenAI semantic conventions.
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
#: Which provider served the model (the 2025 conventions' name; it replaced gen_ai.system).
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
#: The model that answered (a route's fallback may differ from the one requested).
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
#: Opt-in only (telemetry.capture_message_content): the request's messages and the answer, as JSON.
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"

# Ours.
PIPELINE_NAME = "inferline.pipeline.name"
PIPELINE_VERSION = "inferline.pipeline.version"
REQUEST_ID = "inferline.request.id"
REQUEST_STATUS = "inferline.request.status"
STAGE_ID = "inferline.stage.id"
STAGE_TYPE = "inferline.stage.type"
STAGE_STATUS = "inferline.stage.status"
#: A step's attempt (1, then each retry), and in a loop its item (for_each) and round (repeat): a loop's runs are
#: spans side by side under the request, told apart by these.
STAGE_ATTEMPT = "inferline.stage.attempt"
STAGE_ITEM = "inferline.stage.item"
STAGE_ROUND = "inferline.stage.round"
COST_USD = "inferline.cost_usd"


def make_tracer_provider(exporter: str = "none", endpoint: str | None = None,
                         service_name: str = "inferline") -> TracerProvider:
    """A tracer provider exporting to ``none``, ``console`` or ``otlp`` (HTTP).

    With ``none`` every request still has a real trace id to return to its caller, but its spans
    are not recorded: they would go nowhere, and recording them costs the event loop time on every
    request. Adding a span processor later, as tests and bench/runner.py do, turns recording on.
    """
    sampler = _WhileExported()
    provider = _Provider(sampler, resource=Resource.create({"service.name": service_name}), sampler=sampler)
    processor = _processor(exporter, endpoint)
    if processor is not None:
        provider.add_span_processor(processor)
    return provider


class _WhileExported(Sampler):
    """Samples every span once the provider has a span processor, none before."""

    def __init__(self) -> None:
        self.recording = False

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        return (ALWAYS_ON if self.recording else ALWAYS_OFF).should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return "WhileExported"


class _Provider(TracerProvider):
    def __init__(self, recording: _WhileExported, **kwargs) -> None:
        super().__init__(**kwargs)
        self._recording = recording

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self._recording.recording = True


def _processor(exporter: str, endpoint: str | None) -> SpanProcessor | None:
    if exporter == "none":
        return None
    if exporter == "console":
        return BatchSpanProcessor(ConsoleSpanExporter())
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter())
    raise ValueError(f"unknown telemetry exporter {exporter!r}; use none, console or otlp")
