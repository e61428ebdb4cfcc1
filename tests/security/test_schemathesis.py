"""schemathesis against our own OpenAPI document (``/schema/openapi.json``), every operation in it.

Generated requests (valid ones, and ones that break the schema on purpose) go to the in-process app
with an admin key, over fake engines. Checks: schemathesis' defaults, which include no 5xx
(``not_a_server_error``), every response's status, content type, headers and body as the document
declares them, and invalid data refused with a 4xx. ``$RELIABILITY_SCHEMATHESIS_EXAMPLES`` examples
per operation (25 here: about 300 cases in all; ``make reliability`` runs 200, over 2,000). With
``$RELIABILITY_OUT`` set, the number of cases run is written there for docs/reliability.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Response

from tests.security.secured_app import App

EXAMPLES = int(os.environ.get("RELIABILITY_SCHEMATHESIS_EXAMPLES", "25"))
# Two checks adjusted, each for a reason the document cannot change:
# - positive_data_acceptance also accepts 400 for schema-valid requests: a 400 (problem details) is a
#   refusal the document cannot express: an option over *this* pipeline's limit (max_tokens 65 where
#   the pipeline allows 64), an opaque pagination cursor that is not one of ours, a prompt longer than
#   the model's context window, an ``output`` constraint or OpenAI ``response_format``/``tools`` the
#   handler checks. A schema-valid body the validation layer refuses is 422 and still fails.
# - ignored_auth (send the request again without the key, expect 401) needs a network transport;
#   tests/security/test_auth_matrix.py checks exactly that, route by route, from the route table.
CONFIG = schemathesis.config.SchemathesisConfig.from_str("""
[checks]
positive_data_acceptance.expected-statuses = ["2xx", "3xx", "400", "401", "403", "404", "409", "429"]
ignored_auth.enabled = false
""")
#: Routes that are not API operations: the schema's own pages and the web console (HTML, cookies).
UNDOCUMENTED_PREFIXES = ("/schema", "/ui")


def documented_routes(secured: App) -> set[tuple[str, str]]:
    """(METHOD, path) of every app route the OpenAPI document must describe."""
    routes = set()
    for route in secured.app.routes:
        if route.path.startswith(UNDOCUMENTED_PREFIXES):
            continue
        path = route.path.replace(":str}", "}").replace(":path}", "}")
        routes |= {(method, path) for method in route.methods if method not in ("OPTIONS", "HEAD")}
    return routes


def send(secured: App, case: Any) -> Response:
    kwargs = case.as_transport_kwargs(base_url="http://testserver.local", headers=secured.auth("admin"))
    body = {key: kwargs[key] for key in ("json", "data", "content") if key in kwargs}
    if "data" in body and isinstance(body["data"], (bytes, str)):
        body["content"] = body.pop("data")
    response = secured.client.request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                                      params=kwargs.get("params"), cookies=kwargs.get("cookies") or None, **body)
    return Response.from_httpx(response, verify=True)


def test_every_operation_conforms_to_the_schema(secured):
    schema = schemathesis.openapi.from_dict(secured.client.get("/schema/openapi.json").json(), config=CONFIG)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == documented_routes(secured)
    counts: dict[str, int] = {}
    failures: dict[str, str] = {}
    for operation in operations:
        name = f"{operation.method.upper()} {operation.path}"
        try:
            fuzz(secured, operation, name, counts)
        except (Exception, BaseExceptionGroup) as exc:  # every operation runs; failures are reported together
            failures[name] = f"{type(exc).__name__}: {exc}"[:3000]
    record(counts)
    assert not failures, "\n\n".join(f"{name}\n{text}" for name, text in failures.items())
    assert sum(counts.values()) >= EXAMPLES * len(operations) // 2


def fuzz(secured: App, operation: Any, name: str, counts: dict[str, int]) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        counts[name] = counts.get(name, 0) + 1
        case.validate_response(send(secured, case), headers=secured.auth("admin"))

    check()


def record(counts: dict[str, int]) -> None:
    out = os.environ.get("RELIABILITY_OUT")
    if out:
        path = Path(out) / "schemathesis.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cases": sum(counts.values()), "operations": len(counts),
                                    "examples_per_operation": EXAMPLES, "by_operation": counts}, indent=1))
