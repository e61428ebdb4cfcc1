"""What the OpenAPI document (``/schema``) says a route answers besides its plain JSON 200.

Each handler lists the error statuses it can give, so that clients (and schemathesis, which checks
every response against the document: tests/security/test_schemathesis.py) know them::

    @get("/audit/records", responses=problems(400, 401, 403, 422, 503))
    @post("/v1/completions", responses=openai_errors(400, 401, 403, 404, 413, 422, 429, 503, 504))
    @post("/pipelines/{name:str}", operation_class=JsonOrEventStream, ...)   # 200: JSON, or SSE

Request bodies are described by pydantic's own JSON Schema of their models
(:func:`use_pydantic_schemas`): Litestar's rendering of them drops ``extra="forbid"`` and every bound
that is 0 (``ge=0``, ``gt=0``), so the document would accept bodies the server refuses.

Errors are RFC 9457 problem details (``application/problem+json``, serving/http/problems.py), except on
the OpenAI-compatible routes, which answer in OpenAI's own error shape, and Anthropic's Messages API
(``/v1/messages``), in Anthropic's. Keys (bearer, or ``x-api-key``) are declared as
the document's security schemes; routes anyone may call say so with ``operation_class=Public``.

The document is served as ``/schema/openapi.json`` (and ``.yaml``); ``/schema`` is Swagger UI over it,
whose scripts, stylesheet and icon come from the ``swagger-ui-py`` package through
``/schema/assets/...`` (:func:`render_plugins`, :data:`viewer_asset`): Litestar's own viewers load them
from CDNs, so offline they drew a blank page.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from litestar import Litestar, get
from litestar.datastructures import CacheControlHeader
from litestar.exceptions import NotFoundException
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin, SwaggerRenderPlugin, YamlRenderPlugin
from litestar.openapi.spec import Components, OpenAPIMediaType, Operation, Schema, SecurityScheme
from litestar.openapi.spec.enums import OpenAPIType
from litestar.params import FromPath
from litestar.response import File
from pydantic import BaseModel, ConfigDict, Field

from serving.http.problems import title_for

PROBLEM_MEDIA_TYPE = "application/problem+json"
#: The document's security schemes, either of which every operation but the :class:`Public` ones requires:
#: the key as a bearer token, or in ``x-api-key`` (as Anthropic's clients send it).
BEARER = "bearer"
API_KEY = "x-api-key"
SECURITY = [{BEARER: []}, {API_KEY: []}]


def components() -> Components:
    """The document's components: the key's schemes (a fresh object per app: Litestar adds to it)."""
    return Components(security_schemes={
        BEARER: SecurityScheme(
            type="http", scheme="bearer",
            description="An API key: `Authorization: Bearer il_...` (made by `inferline keys create`)"),
        API_KEY: SecurityScheme(type="apiKey", name="x-api-key", security_scheme_in="header",
                                description="The same API key as `x-api-key: il_...`, as Anthropic's clients send it")})


class ProblemDetails(BaseModel):
    """An RFC 9457 problem; some carry more members (``errors``, ``request_id``, ``policy``...)."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(description="https://inferline.dev/problems/<kind>")
    title: str
    status: int
    detail: str = ""
    instance: str | None = None


class OpenAIErrorBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: OpenAIErrorBody


class AnthropicErrorBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""

    model_config = ConfigDict(extra="allow")
    type: str
    error: AnthropicErrorBody


def problems(*statuses: int) -> dict[int, ResponseSpec]:
    """*statuses* answered as problem details."""
    return {status: ResponseSpec(ProblemDetails, description=title_for(status), media_type=PROBLEM_MEDIA_TYPE,
                                 generate_examples=False) for status in statuses}


def openai_errors(*statuses: int) -> dict[int, ResponseSpec]:
    """*statuses* answered in OpenAI's error shape (application/json)."""
    return {status: ResponseSpec(OpenAIError, description=title_for(status), generate_examples=False)
            for status in statuses}


def anthropic_errors(*statuses: int) -> dict[int, ResponseSpec]:
    """*statuses* answered in Anthropic's error shape (application/json)."""
    return {status: ResponseSpec(AnthropicError, description=title_for(status), generate_examples=False)
            for status in statuses}


def _add_200_media(operation: Operation, media_type: str, schema: Schema) -> None:
    response = (operation.responses or {}).get("200")
    if response is not None and not isinstance(response, dict) and hasattr(response, "content"):
        response.content = {**(response.content or {}), media_type: OpenAPIMediaType(schema=schema)}


@dataclass
class JsonOrEventStream(Operation):
    """A 200 that is JSON, or Server-Sent Events when the request asks to stream."""

    def __post_init__(self) -> None:
        _add_200_media(self, "text/event-stream", Schema(type=OpenAPIType.STRING))


@dataclass
class JsonLinesOrCsv(Operation):
    """A 200 streamed as JSON Lines or CSV (``format=``)."""

    def __post_init__(self) -> None:
        if self.responses and "200" in self.responses:
            self.responses["200"].content = {  # type: ignore[union-attr]
                "application/x-ndjson": OpenAPIMediaType(schema=Schema(type=OpenAPIType.STRING)),
                "text/csv": OpenAPIMediaType(schema=Schema(type=OpenAPIType.STRING)),
            }


@dataclass
class Public(Operation):
    """A route anyone may call, without a key (the document's default requires one)."""

    def __post_init__(self) -> None:
        self.security = []


def use_pydantic_schemas(app: Litestar, *models: type[BaseModel]) -> None:
    """Describe *models* in *app*'s OpenAPI document by pydantic's JSON Schema (their nested models too)."""
    openapi = app.openapi_schema  # built once, cached: the document /schema serves
    if openapi.components.schemas is None:  # type: ignore[union-attr]
        openapi.components.schemas = {}  # type: ignore[union-attr]
    schemas = openapi.components.schemas  # type: ignore[union-attr]
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema


#: Where the viewer's files are served; the files themselves, with their media types.
ASSETS_PATH = "/schema/assets"
_ASSETS = {"swagger-ui.css": "text/css", "swagger-ui-bundle.js": "text/javascript",
           "swagger-ui-standalone-preset.js": "text/javascript", "favicon-32x32.png": "image/png"}


def _viewer_dir() -> Path:
    # Found without importing swagger_ui (its __init__ loads handlers for other frameworks).
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the package swagger-ui-py is missing: it serves /schema's viewer (pip install -e .)")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def render_plugins() -> list[OpenAPIRenderPlugin]:
    """``/schema`` (and ``/schema/swagger``): Swagger UI from :data:`viewer_asset`; the document as JSON and YAML."""
    swagger = SwaggerRenderPlugin(
        path=["/", "/swagger"], js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js", css_url=f"{ASSETS_PATH}/swagger-ui.css",
        standalone_preset_js_url=f"{ASSETS_PATH}/swagger-ui-standalone-preset.js",
        favicon=f"<link rel='icon' type='image/png' href='{ASSETS_PATH}/favicon-32x32.png'>")
    return [swagger, JsonRenderPlugin(), YamlRenderPlugin()]


@get(f"{ASSETS_PATH}/{{name:str}}", name="schema-assets", include_in_schema=False, sync_to_thread=False,
     cache_control=CacheControlHeader(max_age=86400, public=True))
def viewer_asset(name: FromPath[str]) -> File:
    """One of the viewer's files (anyone may read them, as ``/schema`` itself)."""
    if name not in _ASSETS:
        raise NotFoundException(f"no viewer asset {name!r}: there are {', '.join(sorted(_ASSETS))}")
    return File(_viewer_dir() / name, media_type=_ASSETS[name], content_disposition_type="inline")
