"""The console in-process, over fake engines: pages, roles, login, CSRF, playground, traces, audit."""

from __future__ import annotations

import html
import json
import logging
import re

import pytest

from serving.console.trace_ring import TraceRing
from tests.serving.console.signin import csrf_of, sign_in
from tests.serving.http.test_app import sse_events


def run(client, pipeline: str = "chat", body: dict | None = None, token: str | None = None, **headers):
    """POST the playground's request, with the page's CSRF token unless *token* says otherwise."""
    if token is None:
        token = csrf_of(client.get(f"/ui/pipelines/{pipeline}").text)
    if token:
        headers["x-csrf-token"] = token
    return client.post(f"/ui/api/pipelines/{pipeline}/run", json=body or {"input": "hi", "stream": True},
                       headers=headers)


# --- auth off (loopback dev mode) -------------------------------------------------------------

def test_auth_off_opens_every_page_and_says_so(client):
    for path in ("/ui", "/ui/pipelines", "/ui/pipelines/chat", "/ui/traces", "/ui/audit", "/ui/metrics"):
        response = client.get(path)
        assert response.status_code == 200, (path, response.text)
        assert "Auth is off (loopback dev mode): no login needed" in response.text
    assert "no key is needed" in client.get("/ui/login").text


def test_pages_carry_security_headers_and_a_csrf_cookie(client):
    response = client.get("/ui")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    assert response.headers["x-frame-options"] == "DENY" and response.headers["cache-control"] == "no-store"
    cookie = response.headers["set-cookie"].lower()
    assert cookie.startswith("inferline_console_csrf=") and "httponly" in cookie
    assert "samesite=strict" in cookie and "path=/ui" in cookie and "secure" not in cookie


def test_pipelines_list_and_chain_with_config(client):
    listed = client.get("/ui").text
    assert 'href="/ui/pipelines/chat"' in listed and 'href="/ui/pipelines/reviews"' in listed
    page = client.get("/ui/pipelines/chat").text
    for stage_id in ("prompt", "tok", "gen", "out", "log"):
        assert f'<span class="stage-id">{stage_id}</span>' in page
    assert "max_tokens: 64" in page and "content: full" in page  # each stage's `with:` as YAML
    assert 'id="playground"' in page and 'data-run-url="/ui/api/pipelines/chat/run"' in page
    assert '<label for="play-input">' in page


def test_playground_streams_the_api_events_and_the_trace_shows_every_stage(client):
    response = run(client)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert "".join(d["text"] for k, d in events if k == "delta") == "Paris is the capital of France."
    done = events[-1][1]
    assert events[-1][0] == "done" and len(done["trace_id"]) == 32
    page = client.get(f"/ui/traces/{done['trace_id']}")
    assert page.status_code == 200, page.text
    for stage_id in ("prompt", "tok", "gen", "out", "log"):
        assert f'data-stage="{stage_id}"' in page.text
    assert 'id="ttft-marker"' in page.text and 'class="ttft"' in page.text
    assert "Paris" not in page.text  # a trace shows no content
    # the same trace by request id, and listed among the recent ones
    assert client.get(f"/ui/traces/{done['request_id']}").status_code == 200
    assert done["trace_id"][:12] in client.get("/ui/traces").text


def test_playground_errors_are_problem_details(client):
    response = run(client, body={"input": "x", "max_tokens": 65, "stream": True})
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/problem+json")
    assert "over this pipeline's limit" in response.json()["detail"] and response.json()["trace_id"]
    bad = run(client, body={"stream": True})
    assert bad.status_code == 422 and bad.json()["status"] == 422
    missing = run(client, pipeline="nope", token=csrf_of(client.get("/ui").text))
    assert missing.status_code == 404 and missing.json()["type"].endswith("/pipeline_not_found")


@pytest.mark.parametrize("token", ["", "0" * 64])
def test_playground_without_the_right_csrf_token_is_refused(client, token):
    response = run(client, token=token)
    assert response.status_code == 403 and response.json()["type"].endswith("/csrf_failed")


def test_cross_site_requests_are_refused_even_with_a_token(client):
    token = csrf_of(client.get("/ui/pipelines/chat").text)
    assert run(client, token=token, origin="https://evil.example").status_code == 403
    assert run(client, token=token, **{"sec-fetch-site": "cross-site"}).status_code == 403
    assert run(client, token=token, origin="http://testserver.local").status_code == 200


def test_bad_input_gets_friendly_pages_never_500(client):
    cases = {"/ui/audit?since=someday": 400, "/ui/audit?limit=abc": 400, "/ui/audit?limit=100000": 400,
             "/ui/audit?sort=evil": 400, "/ui/audit?cursor=garbage": 400, "/ui/audit?min_cost_usd=lots": 400,
             "/ui/audit/records/nope": 404, "/ui/pipelines/nope": 404, "/ui/traces/nope": 404,
             "/ui/audit/export?format=xml": 400, "/ui/nowhere/at/all": 404}
    for path, status in cases.items():
        response = client.get(path)
        assert response.status_code == status, (path, response.text)
        assert response.headers["content-type"].startswith("text/html"), path
        assert f"<h1 id=\"error-title\">{status}" in response.text, path


def test_audit_explorer_filters_pages_shows_verifies_and_exports(client):
    for text in ("one", "two", "three"):
        client.post("/pipelines/chat", json={"input": text})
    client.post("/pipelines/chat", json={"input": "x", "max_tokens": 65})  # refused: audited as failed
    page = client.get("/ui/audit?pipeline=chat&status=ok&limit=2")
    assert page.status_code == 200, page.text
    assert page.text.count('class="record-link"') == 2 and 'id="next-page"' in page.text
    next_url = _next_href(page.text)
    second = client.get(next_url)
    assert second.text.count('class="record-link"') == 1 and "First page" in second.text
    assert 'value="chat"' in second.text  # the filters stay in the form
    assert client.get("/ui/audit?status=denied").text.count('class="record-link"') == 0
    record_path = _first_record_href(page.text)
    record = client.get(record_path)
    assert record.status_code == 200 and 'id="record-stages"' in record.text
    assert all(f"<td>{stage}</td>" in record.text for stage in ("prompt", "tok", "gen", "out"))
    assert "Paris is the capital of France." in record.text  # content: full, shown to reviewers
    verified = client.post("/ui/audit/verify", data={"csrf_token": csrf_of(page.text), "since": "", "until": ""})
    assert verified.status_code == 200 and "Chain intact: 4 record(s) checked" in verified.text
    jsonl = client.get("/ui/audit/export?format=jsonl&pipeline=chat&status=ok")
    assert jsonl.headers["content-disposition"] == 'attachment; filename="audit.jsonl"'
    assert len([json.loads(line) for line in jsonl.text.splitlines()]) == 3
    csv = client.get("/ui/audit/export?format=csv&status=ok")
    assert csv.headers["content-type"].startswith("text/csv") and len(csv.text.strip().splitlines()) == 4
    # an old request, out of the ring (here: a console that forgot everything), is found through its
    # audit record by request id
    request_id = client.get(record_path).text.split('href="/ui/traces/')[1].split('"')[0]
    client.app.state["inferline_console"].ring = TraceRing()
    trace = client.get(f"/ui/traces/{request_id}")
    assert trace.status_code == 200 and "the audit record" in trace.text


def test_verify_needs_its_csrf_token(client):
    assert client.post("/ui/audit/verify", data={}).status_code == 403
    assert client.post("/ui/audit/verify", data={"csrf_token": "f" * 64}).status_code == 403


def test_verify_reports_a_broken_chain(client):
    client.post("/pipelines/chat", json={"input": "one"})
    client.post("/pipelines/chat", json={"input": "two"})
    store = client.app.state.inferline.services.audit
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE audit_records SET cost_usd = 99 WHERE seq = 1")
    token = csrf_of(client.get("/ui/audit").text)
    page = client.post("/ui/audit/verify", data={"csrf_token": token})
    assert page.status_code == 200 and "Chain BROKEN" in page.text and 'id="findings"' in page.text


def test_metrics_json_has_every_series(client):
    client.post("/pipelines/chat", json={"input": "x"})
    body = client.get("/ui/api/metrics").json()
    point = body["points"][-1]
    assert {"rps", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "queue_depth", "kv_cache_usage",
            "prefix_cache_hit_rate", "cost_per_request_usd"} <= set(point)
    assert body["interval_s"] > 0


def _figure(page: str, chart: str) -> str:
    start = page.index(f'id="chart-{chart}"')
    return page[start:page.index("</figure>", start)]


def test_metrics_charts_have_a_legend_and_axes_with_units(client):
    page = client.get("/ui/metrics").text
    ttft = _figure(page, "ttft")
    # One legend entry per line, named, each drawn like its line (class line-N: its own colour and dash).
    legend = re.findall(r'<li class="legend-item" data-field="([^"]+)">.*?class="line (line-\d)".*?</svg> ([^<]+)</li>',
                        ttft, flags=re.S)
    assert legend == [("ttft_p50_ms", "line-0", "p50"), ("ttft_p95_ms", "line-1", "p95"),
                      ("ttft_p99_ms", "line-2", "p99")]
    # The lines metrics.js draws are the legend's: same fields, same order.
    series = json.loads(html.unescape(re.search(r'data-series="([^"]+)"', ttft).group(1)))
    assert [(line["field"], line["label"]) for line in series] == [(f, label) for f, _, label in legend]
    assert '<text class="axis-title" x="4" y="10">ms</text>' in ttft
    assert 'class="axis axis-y"' in ttft and 'class="axis axis-x"' in ttft
    for chart, unit in (("rps", "req/s"), ("itl", "ms"), ("kv_cache_usage", "%"), ("cost_per_request_usd", "USD")):
        figure = _figure(page, chart)
        assert f'data-unit="{unit}"' in figure and f">{unit}</text>" in figure, chart
        assert figure.count('class="legend-item"') >= 1, chart
    css = client.get("/ui/static/console.css").text
    dashes = {n: re.search(rf"\.chart \.line-{n} \{{([^}}]*)\}}", css).group(1) for n in range(3)}
    assert len({d.replace(" ", "") for d in dashes.values()}) == 3 and "dasharray" in dashes[1] + dashes[2]


# --- auth on ------------------------------------------------------------------------------------

def test_pages_redirect_to_login_and_back(auth_client):
    response = auth_client.get("/ui/audit?status=ok", follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == "/ui/login?next=%2Fui%2Faudit%3Fstatus%3Dok"
    assert auth_client.get("/ui/api/metrics").status_code == 401
    assert auth_client.post("/ui/api/pipelines/chat/run", json={"input": "x"}).status_code == 401


def test_login_sets_an_httponly_strict_cookie_and_logout_clears_it(auth_client, keys, caplog):
    _, caller = keys.create("app", "caller")
    token = csrf_of(auth_client.get("/ui/login").text)
    with caplog.at_level(logging.DEBUG):
        response = auth_client.post("/ui/login", data={"api_key": caller, "csrf_token": token,
                                                        "next": "/ui/pipelines/chat"}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/ui/pipelines/chat"
    cookies = response.headers.get_list("set-cookie")
    key_cookie = next(c for c in cookies if c.startswith("inferline_console_key=")).lower()
    assert "httponly" in key_cookie and "samesite=strict" in key_cookie and "path=/ui" in key_cookie
    assert any(c.startswith("inferline_console_csrf=") for c in cookies)  # a fresh nonce at login
    assert caller not in caplog.text  # never the key in a log
    page = auth_client.get("/ui/pipelines/chat")
    assert "Signed in: key" in page.text and "(caller)" in page.text
    assert csrf_of(page.text) != token  # the token changed with the session
    logout = auth_client.post("/ui/logout", data={"csrf_token": csrf_of(page.text)}, follow_redirects=False)
    assert logout.status_code == 303
    assert any(c.startswith("inferline_console_key=") and "Max-Age=0" in c
               for c in logout.headers.get_list("set-cookie"))
    assert auth_client.get("/ui", follow_redirects=False).status_code == 303


def test_login_with_an_unknown_key_is_refused(auth_client):
    token = csrf_of(auth_client.get("/ui/login").text)
    response = auth_client.post("/ui/login", data={"api_key": "il_nope_nope", "csrf_token": token})
    assert response.status_code == 401 and "unknown or revoked" in response.text


@pytest.mark.parametrize("token", [None, "", "deadbeef" * 8])
def test_login_without_the_right_csrf_token_is_refused(auth_client, keys, token):
    _, caller = keys.create("app", "caller")
    auth_client.get("/ui/login")
    data = {"api_key": caller} | ({} if token is None else {"csrf_token": token})
    response = auth_client.post("/ui/login", data=data, follow_redirects=False)
    assert response.status_code == 403 and "security token" in response.text
    assert "inferline_console_key" not in response.headers.get("set-cookie", "")


def test_logout_needs_its_csrf_token(auth_client, keys):
    _, caller = keys.create("app", "caller")
    sign_in(auth_client, caller)
    assert auth_client.post("/ui/logout", data={}).status_code == 403
    assert auth_client.get("/ui").status_code == 200  # still signed in


def test_caller_cannot_open_the_audit_explorer_or_metrics(auth_client, keys):
    _, caller = keys.create("app", "caller")
    sign_in(auth_client, caller)
    for path in ("/ui/audit", "/ui/audit/records/x", "/ui/audit/export?format=csv", "/ui/metrics"):
        response = auth_client.get(path)
        assert response.status_code == 403, path
        assert "role &#39;caller&#39; may not" in response.text and "Sign out" in response.text
    assert auth_client.get("/ui/api/metrics").status_code == 403
    assert 'href="/ui/audit"' not in auth_client.get("/ui").text  # not offered in the nav either


def test_roles_for_the_playground_and_traces(auth_client, keys):
    _, caller = keys.create("app", "caller")
    _, other = keys.create("other", "caller")
    _, auditor = keys.create("reviewer", "auditor")
    sign_in(auth_client, caller)
    assert "may not call this pipeline" in auth_client.get("/ui/pipelines/reviews").text
    assert run(auth_client, pipeline="reviews", token=csrf_of(auth_client.get("/ui").text)).status_code == 403
    done = sse_events(run(auth_client).text)[-1][1]
    assert auth_client.get(f"/ui/traces/{done['trace_id']}").status_code == 200
    sign_in(auth_client, other)
    assert auth_client.get(f"/ui/traces/{done['trace_id']}").status_code == 404  # not their request
    assert done["trace_id"][:12] not in auth_client.get("/ui/traces").text
    sign_in(auth_client, auditor)
    assert auth_client.get(f"/ui/traces/{done['trace_id']}").status_code == 200
    assert auth_client.get("/ui/audit").status_code == 200
    store = auth_client.app.state.inferline.services.audit
    actions = [(a["action"], a["query"].get("via")) for a in store.access_log()]
    assert ("query", "console") in actions  # the console's reads are in the access log


SIGN_IN_LINK = '<a href="/ui/login">Sign in</a>'


@pytest.mark.parametrize("path", ["/ui/no/such/page", "/ui/audit?since=not-a-date", "/ui/audit?limit=0",
                                  "/ui/pipelines/nope"])
def test_error_pages_show_who_is_signed_in(auth_client, keys, path):
    """Whatever failed (no such page, a query that does not parse before the page ran, a role), the error
    page knows the session: it offers to sign out, never to sign in."""
    info, auditor = keys.create("reviewer", "auditor")
    sign_in(auth_client, auditor)
    response = auth_client.get(path)
    assert response.status_code in (400, 404), (path, response.status_code)
    assert f"<code>{info.id}</code>" in response.text and "Sign out" in response.text, path
    assert SIGN_IN_LINK not in response.text, path


def test_error_pages_offer_to_sign_in_without_a_session(auth_client):
    response = auth_client.get("/ui/no/such/page")
    assert response.status_code == 404 and SIGN_IN_LINK in response.text and "Sign out" not in response.text


def test_a_revoked_key_is_signed_out(auth_client, keys):
    info, caller = keys.create("app", "caller")
    sign_in(auth_client, caller)
    keys.revoke(info.id)
    response = auth_client.get("/ui", follow_redirects=False)
    assert response.status_code == 303 and "reason=" in response.headers["location"]


def test_login_never_redirects_off_site(auth_client, keys):
    _, caller = keys.create("app", "caller")
    for target in ("https://evil.example/", "//evil.example", "/pipelines", "/ui\\@evil"):
        token = csrf_of(auth_client.get("/ui/login").text)
        response = auth_client.post("/ui/login", data={"api_key": caller, "csrf_token": token, "next": target},
                                    follow_redirects=False)
        assert response.headers["location"] == "/ui", target


def _next_href(html: str) -> str:
    return html.split('id="next-page"')[0].rsplit('href="', 1)[1].split('"')[0].replace("&amp;", "&")


def _first_record_href(html: str) -> str:
    return html.split('class="record-link" href="')[1].split('"')[0]


def test_the_access_log_page(auth_client, keys):
    info, auditor = keys.create("reviewer", "auditor")
    _, caller = keys.create("app", "caller")
    sign_in(auth_client, auditor)
    assert auth_client.get("/ui/audit?pipeline=chat").status_code == 200
    assert auth_client.get("/ui/audit/export?format=csv").status_code == 200
    page = auth_client.get("/ui/audit/access")
    assert page.status_code == 200 and 'href="/ui/audit/access" aria-current="page"' in page.text  # in the nav
    assert [a for a in ("access", "export", "query") if f'data-action="{a}"' in page.text] == ["access", "export",
                                                                                                "query"]
    assert f'<code>{info.id}</code> <span class="key-name">reviewer</span>' in page.text
    assert '"via": "console"' in page.text  # the console's own reads are logged too
    only = auth_client.get("/ui/audit/access?action=export&since=1h&key_id=" + info.id)
    assert only.text.count('class="access-entry"') == 1 and 'data-action="export"' in only.text
    assert auth_client.get("/ui/audit/access?since=someday").status_code == 400
    assert auth_client.get("/ui/audit/access?actoin=query").status_code == 400
    paged = auth_client.get("/ui/audit/access?limit=1")
    assert paged.text.count('class="access-entry"') == 1 and 'id="next-page"' in paged.text
    sign_in(auth_client, caller)
    assert auth_client.get("/ui/audit/access").status_code == 403
    assert 'href="/ui/audit/access"' not in auth_client.get("/ui").text
