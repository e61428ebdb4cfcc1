"""The auth matrix of every route, generated from the app's route table.

:data:`ACCESS` declares, for every (method, path) the app serves, who may call it: ``PUBLIC``
(anyone, no key), ``SIGNED_IN`` (any valid key), or the roles a key needs (``admin`` always may).
The first test compares the declaration with ``app.routes``, so a new route fails until its access
is declared here; then, route by route: no key -> 401 (the console's pages: a redirect to its login
page; the OpenAI routes: OpenAI's error shape), a key of a role not declared -> 403, a key of each
declared role -> neither 401 nor 403.
The API takes the key as ``Authorization: Bearer``; the console (``/ui``) as its session cookie, and
its form posts with their CSRF token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pipeline.context import Principal
from serving.console.session import CSRF_COOKIE, CSRF_FIELD, CSRF_HEADER, KEY_COOKIE, Session
from serving.console.state import STATE_KEY
from store.keys import ROLES
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
    ("POST", "/pipelines/{name:str}"): (CALLERS, Call("/pipelines/chat", json=CHAT)),
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
    ("POST", "/v1/chat/completions"): (CALLERS, Call("/v1/chat/completions", json=OPENAI_CHAT)),
    ("POST", "/v1/completions"): (CALLERS, Call("/v1/completions", json={"model": "chat", "prompt": "hello"})),
    ("GET", "/v1/models"): (("caller", "auditor"), Call("/v1/models")),
    ("POST", "/v1/responses"): (CALLERS, Call("/v1/responses", json={"model": "chat", "input": "hello"})),
    ("GET", "/v1/responses/{response_id:str}"): (CALLERS, Call("/v1/responses/resp_none")),
    ("DELETE", "/v1/responses/{response_id:str}"): (CALLERS, Call("/v1/responses/resp_none")),
    ("POST", "/v1/messages"): (CALLERS, Call("/v1/messages", json={**OPENAI_CHAT, "max_tokens": 8})),
    ("POST", "/v1/messages/count_tokens"): (CALLERS, Call("/v1/messages/count_tokens", json=OPENAI_CHAT)),
    # `chat` makes no embeddings: a caller's call is a 400 naming `model` (the real model: test_embeddings_routes.py).
    ("POST", "/v1/embeddings"): (CALLERS, Call("/v1/embeddings", json={"model": "chat", "input": "hello"})),
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
                                                                 console=True, csrf="header")),
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
