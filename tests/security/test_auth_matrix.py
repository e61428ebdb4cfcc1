"""The auth matrix of every route, generated from the app's route table.

:data:`ACCESS` declares, for every (method, path) the app serves, who may call it: ``PUBLIC``
(anyone, no key), ``SIGNED_IN`` (any valid key), or the roles a key needs (``admin`` always may).
The first test compares the declaration with ``app.routes``, so a new route fails until its access
is declared here; then, route by route: no key -> 401 (the console's pages: a redirect to its login
page; the OpenAI routes: OpenAI's error shape), a key of a role not declared -> 403, a key of each
declared role -> neither 401 nor 403. Every one of those refusals leaves one audit record (the
console's pages, which send a caller without a key to the login page, excepted).
The API takes the key as ``Authorization: Bearer``; the console (``/ui``) as its session cookie, and
its form posts with their CSRF token.
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pipeline.context import Principal
from serving.console.session import CSRF_COOKIE, CSRF_FIELD, CSRF_HEADER, KEY_COOKIE, Session
from serving.console.state import STATE_KEY
from store.keys import ROLES, public_id
from tests.security.secured_app import App

PUBLIC = "public"
SIGNED_IN = "signed in"
CALLERS = ("caller",)  # the `chat` pipeline's access.roles (tests/security/secured_app.py)
REVIEWERS = ("auditor",)
ADMINS = ()  # admins only (an admin may call every route)


@dataclass(frozen=True)
class Call:
    """How to call one route: a concrete path, a body, and whether it is a console form or fetch."""

    path: str
    json: dict[str, Any] | None = None
    form: dict[str, str] = field(default_factory=dict)
    console: bool = False
    csrf: str = ""  # "form" or "header": where the console wants its token
    pipeline: str = ""  # the pipeline the call runs: what the audit record of its refusal names


CHAT = {"input": "hello"}
OPENAI_CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}

#: (METHOD, route path) -> who may call it, and how the test calls it.
ACCESS: dict[tuple[str, str], tuple[str | tuple[str, ...], Call]] = {
    ("GET", "/healthz"): (PUBLIC, Call("/healthz")),
    ("GET", "/readyz"): (PUBLIC, Call("/readyz")),
    ("GET", "/health"): (PUBLIC, Call("/health")),
    ("GET", "/version"): (PUBLIC, Call("/version")),
    ("POST", "/tokenize"): (CALLERS, Call("/tokenize", json={"model": "chat", "prompt": "hi"})),
    ("POST", "/detokenize"): (CALLERS, Call("/detokenize", json={"model": "chat", "tokens": [104, 105]})),
    ("GET", "/metrics"): (REVIEWERS, Call("/metrics")),
    ("GET", "/pipelines"): (("caller", "auditor"), Call("/pipelines")),
    ("GET", "/pipelines/{name:str}"): (("caller", "auditor"), Call("/pipelines/chat")),
    ("POST", "/pipelines/{name:str}"): (CALLERS, Call("/pipelines/chat", json=CHAT, pipeline="chat")),
    # Deploy routes, called so that an admin's call changes nothing (the pipeline does not exist).
    ("GET", "/pipelines/{name:str}/versions"): (ADMINS, Call("/pipelines/nope/versions")),
    ("POST", "/pipelines/{name:str}/versions"): (ADMINS, Call("/pipelines/nope/versions", json={"yaml": "x: ["})),
    ("POST", "/pipelines/{name:str}/activate"): (ADMINS, Call("/pipelines/nope/activate",
                                                              json={"spec_sha256": "ffffff"})),
    ("POST", "/pipelines/{name:str}/rollback"): (ADMINS, Call("/pipelines/nope/rollback")),
    ("DELETE", "/pipelines/{name:str}"): (ADMINS, Call("/pipelines/nope")),
    ("PUT", "/pipelines/{name:str}/traffic"): (ADMINS, Call("/pipelines/nope/traffic", json={"weights": {"9": 1}})),
    ("DELETE", "/pipelines/{name:str}/traffic"): (ADMINS, Call("/pipelines/nope/traffic")),
    ("POST", "/pipelines/{name:str}/promote"): (ADMINS, Call("/pipelines/nope/promote")),
    ("PUT", "/pipelines/{name:str}/shadow"): (ADMINS, Call("/pipelines/nope/shadow",
                                                           json={"version": "9", "percent": 5})),
    ("DELETE", "/pipelines/{name:str}/shadow"): (ADMINS, Call("/pipelines/nope/shadow")),
    ("POST", "/v1/chat/completions"): (CALLERS, Call("/v1/chat/completions", json=OPENAI_CHAT, pipeline="chat")),
    ("POST", "/v1/completions"): (CALLERS, Call("/v1/completions", json={"model": "chat", "prompt": "hello"},
                                                pipeline="chat")),
    ("GET", "/v1/models"): (("caller", "auditor"), Call("/v1/models")),
    ("POST", "/v1/responses"): (CALLERS, Call("/v1/responses", json={"model": "chat", "input": "hello"},
                                              pipeline="chat")),
    ("GET", "/v1/responses/{response_id:str}"): (CALLERS, Call("/v1/responses/resp_none")),
    ("DELETE", "/v1/responses/{response_id:str}"): (CALLERS, Call("/v1/responses/resp_none")),
    ("POST", "/v1/messages"): (CALLERS, Call("/v1/messages", json={**OPENAI_CHAT, "max_tokens": 8}, pipeline="chat")),
    ("POST", "/v1/messages/count_tokens"): (CALLERS, Call("/v1/messages/count_tokens", json=OPENAI_CHAT)),
    # `chat` makes no embeddings: a caller's call is a 400 naming `model` (the real model: test_embeddings_routes.py).
    ("POST", "/v1/embeddings"): (CALLERS, Call("/v1/embeddings", json={"model": "chat", "input": "hello"},
                                               pipeline="chat")),
    ("GET", "/audit/records"): (REVIEWERS, Call("/audit/records")),
    ("GET", "/audit/records/{record_id:str}"): (REVIEWERS, Call("/audit/records/no-such-record")),
    ("GET", "/audit/records/{record_id:str}/spec"): (REVIEWERS, Call("/audit/records/no-such-record/spec")),
    ("GET", "/audit/summary"): (REVIEWERS, Call("/audit/summary")),
    ("GET", "/audit/verify"): (REVIEWERS, Call("/audit/verify")),
    ("GET", "/audit/export"): (REVIEWERS, Call("/audit/export")),
    ("GET", "/audit/access"): (REVIEWERS, Call("/audit/access")),
    # The OpenAPI document and its viewer, with the viewer's own files (serving/http/openapi.py).
    **{("GET", path): (PUBLIC, Call(path.replace("{path:str}", "nothing")))
       for path in ("/schema", "/schema/openapi.json", "/schema/openapi.yaml", "/schema/openapi.yml",
                    "/schema/swagger", "/schema/oauth2-redirect.html", "/schema/{path:str}")},
    ("GET", "/schema/assets/{name:str}"): (PUBLIC, Call("/schema/assets/swagger-ui.css")),
    # The web console (serving/console/).
    ("GET", "/ui"): (("caller", "auditor"), Call("/ui", console=True)),
    ("GET", "/ui/pipelines"): (("caller", "auditor"), Call("/ui/pipelines", console=True)),
    ("GET", "/ui/pipelines/{name:str}"): (("caller", "auditor"), Call("/ui/pipelines/chat", console=True)),
    ("GET", "/ui/traces"): (SIGNED_IN, Call("/ui/traces", console=True)),
    ("GET", "/ui/traces/{ident:str}"): (SIGNED_IN, Call("/ui/traces/no-such-trace", console=True)),
    ("GET", "/ui/metrics"): (REVIEWERS, Call("/ui/metrics", console=True)),
    ("GET", "/ui/login"): (PUBLIC, Call("/ui/login", console=True)),
    ("POST", "/ui/login"): (PUBLIC, Call("/ui/login", console=True, csrf="form", form={"api_key": "{caller}"})),
    ("POST", "/ui/logout"): (PUBLIC, Call("/ui/logout", console=True, csrf="form")),
    ("GET", "/ui/{rest:path}"): (PUBLIC, Call("/ui/no/such/page", console=True)),
    ("GET", "/ui/audit"): (REVIEWERS, Call("/ui/audit", console=True)),
    ("GET", "/ui/audit/records/{record_id:str}"): (REVIEWERS, Call("/ui/audit/records/none", console=True)),
    ("GET", "/ui/audit/records/{record_id:str}/spec"): (REVIEWERS, Call("/ui/audit/records/none/spec", console=True)),
    ("POST", "/ui/audit/verify"): (REVIEWERS, Call("/ui/audit/verify", console=True, csrf="form")),
    ("GET", "/ui/audit/export"): (REVIEWERS, Call("/ui/audit/export", console=True)),
    ("GET", "/ui/audit/access"): (REVIEWERS, Call("/ui/audit/access", console=True)),
    ("POST", "/ui/api/pipelines/{name:str}/run"): (CALLERS, Call("/ui/api/pipelines/chat/run", json=CHAT,
                                                                 console=True, csrf="header", pipeline="chat")),
    ("GET", "/ui/audit/report"): (REVIEWERS, Call("/ui/audit/report", console=True)),
    ("GET", "/ui/api/metrics"): (REVIEWERS, Call("/ui/api/metrics", console=True)),
    ("GET", "/ui/static/{file_path:path}"): (PUBLIC, Call("/ui/static/console.css", console=True)),
}
#: Methods every route answers by itself (CORS preflight, HEAD of a GET): not access-controlled.
AUTOMATIC = {"OPTIONS", "HEAD"}


def served_routes(secured: App) -> set[tuple[str, str]]:
    return {(method, route.path) for route in secured.app.routes for method in route.methods
            if method not in AUTOMATIC}


def test_every_route_declares_who_may_call_it(secured):
    served = served_routes(secured)
    undeclared = sorted(served - set(ACCESS))
    assert not undeclared, f"routes without a declared access in tests/security/test_auth_matrix.py: {undeclared}"
    assert not sorted(set(ACCESS) - served), "declared routes the app no longer serves"


def send(secured: App, method: str, call: Call, role: str | None):
    """*call* as *role* (None: no key at all)."""
    key = secured.keys[role] if role else ""
    headers: dict[str, str] = {}
    form = {name: value.format(caller=secured.keys["caller"]) for name, value in call.form.items()}
    if call.console:
        cookies = {KEY_COOKIE: key} if key else {}
        if call.csrf:
            nonce = "n" * 32
            cookies[CSRF_COOKIE] = nonce
            token = csrf_token(secured, nonce, key, role)
            if call.csrf == "form":
                form[CSRF_FIELD] = token
            else:
                headers[CSRF_HEADER] = token
        if cookies:
            headers["cookie"] = "; ".join(f"{name}={value}" for name, value in cookies.items())
    elif role:
        headers.update(secured.auth(role))
    return secured.client.request(method, call.path, headers=headers, json=call.json, data=form or None,
                                  follow_redirects=False)


def csrf_token(secured: App, nonce: str, key: str, role: str | None) -> str:
    """The token the console's own pages would put in their forms for this session."""
    console = secured.app.state[STATE_KEY]
    principal = Principal(key_id="", role=role or "", tenant="") if role else None
    return console.sessions.token(Session(True, principal, nonce, key=key))


def is_login_redirect(response) -> bool:
    return response.status_code in (302, 303, 307) and response.headers["location"].startswith("/ui/login")


@pytest.mark.parametrize(("method", "path"), sorted(ACCESS), ids=lambda value: value)
def test_route_access(secured, method, path):
    allowed, call = ACCESS[(method, path)]
    nobody = send(secured, method, call, None)
    if allowed == PUBLIC:
        assert nobody.status_code not in (401, 403), (nobody.status_code, nobody.text[:300])
        return
    if call.console and not path.startswith("/ui/api/"):  # a page: to the login form, and back after it
        assert is_login_redirect(nobody), (nobody.status_code, nobody.headers)
    elif path.startswith("/v1/messages"):  # Anthropic's error shape
        assert nobody.status_code == 401 and nobody.json()["error"]["type"] == "authentication_error"
        assert nobody.json()["type"] == "error"
    elif path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):  # OpenAI's error shape (vLLM's too)
        assert nobody.status_code == 401 and nobody.json()["error"]["type"] == "authentication_error"
    else:
        assert nobody.status_code == 401, (nobody.status_code, nobody.text[:300])
        assert nobody.headers["content-type"].startswith("application/problem+json")
    roles = ROLES if allowed == SIGNED_IN else (*allowed, "admin")
    for role in ROLES:
        response = send(secured, method, call, role)
        if role in roles:
            assert response.status_code not in (401, 403), (role, response.status_code, response.text[:300])
            assert not is_login_redirect(response), role
        else:
            assert response.status_code == 403, (role, response.status_code, response.text[:300])


def test_a_bad_key_is_401_everywhere(secured):
    bad_keys = ["il_AAAAAAAAAAAA_" + "A" * 43, secured.keys["caller"][:-1] + "x", "not-a-key", "il_", "Bearer"]
    for (method, path), (allowed, call) in sorted(ACCESS.items()):
        if allowed == PUBLIC or call.console:
            continue
        for bad in bad_keys:
            response = secured.client.request(method, call.path, json=call.json,
                                              headers={"Authorization": f"Bearer {bad}"})
            assert response.status_code == 401, (method, path, bad, response.status_code)
        for header in ("Basic dXNlcjpwYXNz", "bearer", "", secured.keys["admin"]):  # wrong scheme, no key
            response = secured.client.request(method, call.path, json=call.json, headers={"Authorization": header})
            assert response.status_code == 401, (method, path, header[:10], response.status_code)


def test_a_key_may_come_as_x_api_key(secured):
    """Anthropic's clients send the key as ``x-api-key``: taken on every API route, checked as a bearer key."""
    for (method, path), (allowed, call) in sorted(ACCESS.items()):
        if allowed == PUBLIC or call.console:
            continue
        for bad in ("il_AAAAAAAAAAAA_" + "A" * 43, secured.keys["caller"][:-1] + "x", " "):
            response = secured.client.request(method, call.path, json=call.json, headers={"x-api-key": bad})
            assert response.status_code == 401, (method, path, bad, response.status_code)
        roles = ROLES if allowed == SIGNED_IN else (*allowed, "admin")
        for role in ROLES:
            response = secured.client.request(method, call.path, json=call.json,
                                              headers={"x-api-key": secured.keys[role]})
            if role in roles:
                assert response.status_code not in (401, 403), (path, role, response.status_code)
            else:
                assert response.status_code == 403, (path, role, response.status_code)


def denied_after(secured: App, seq: int) -> list[dict[str, Any]]:
    """The refusals' records (status ``denied``) chained after record *seq*, oldest first."""
    response = secured.client.get("/audit/records", params={"status": "denied", "sort": "-seq", "limit": "20"},
                                  headers=secured.auth("auditor"))
    assert response.status_code == 200, response.text
    return sorted((r for r in response.json()["records"] if r["seq"] > seq), key=lambda r: r["seq"])


def test_every_refusal_leaves_one_audit_record(secured, monkeypatch):
    """A 401 (no key) and a 403 (each role not declared) on every route of ``app.routes``: one record each,
    naming the route, the reason, the key refused, and a pipeline only where the call runs one. The
    console's pages send a caller without a key to the login page: that is no refusal, and no record."""
    refusals = secured.app.state.inferline.services.refusals
    ticks = itertools.count(time.monotonic() + 60.0, 60.0)  # a minute before each refusal: its buckets are full
    monkeypatch.setattr(refusals, "clock", lambda: next(ticks))
    seq = max([r["seq"] for r in denied_after(secured, -1)], default=-1)
    for method, path in sorted(served_routes(secured)):
        allowed, call = ACCESS[(method, path)]
        if allowed == PUBLIC:
            continue
        roles = ROLES if allowed == SIGNED_IN else (*allowed, "admin")
        for role in (None, *(role for role in ROLES if role not in roles)):
            response = send(secured, method, call, role)
            records = denied_after(secured, seq)
            if role is None and call.console and not path.startswith("/ui/api/"):
                assert is_login_redirect(response) and not records, (path, records)
                continue
            status = 401 if role is None else 403
            assert response.status_code == status, (method, path, role, response.status_code)
            assert len(records) == 1, (method, path, role, records)
            record = records[0]
            seq = record["seq"]
            reason = record["policy"][0]
            assert (record["http_status"], record["error_type"], reason["route"]) == (
                status, "missing_key" if role is None else "role_not_allowed", call.path), (method, path, role)
            assert record["pipeline"] == call.pipeline, (method, path, record["pipeline"])
            key_id = public_id(secured.keys[role]) if role else None
            assert (record["key_id"], record["role"]) == (key_id, role), (method, path)


def test_the_api_doc_says_which_routes_are_open(secured):
    """docs/api.md names the routes anyone may call twice, in its routes table and in "Keys and roles":
    both say what ACCESS (checked against the app above) says, the OpenAPI document's routes as ``/schema``."""
    doc = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    text = re.split(r"\sneeds\s", doc.split("## Keys and roles", 1)[1], maxsplit=1)[0]
    in_text = set(re.findall(r"`(/[\w./{}-]*)`", text))
    rows = [line.split("|") for line in doc.splitlines() if line.startswith("| `")]
    in_table = {path for row in rows if row[-2].strip() == "anyone"
                for path in re.findall(r"`(?:[A-Z|]+ )?(/[\w./{}-]*)`", row[1])}
    in_code = {path for (method, path), (allowed, _) in ACCESS.items() if allowed == PUBLIC
               and not path.startswith("/ui")}

    def api(paths: set[str]) -> set[str]:
        return {"/schema" if path.startswith("/schema") else path for path in paths}

    assert api(in_text) == api(in_table) == api(in_code), (in_text, in_table, in_code)
