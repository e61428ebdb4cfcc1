"""Reviewers' routes over the real audit store (SQLite), with requests from fake engines."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime

import pytest
from litestar.testing import TestClient

from pipeline.digest import digest
from serving.cli.main import main
from serving.runtime.workspace import open_workspace
from serving.server import create_server
from tests.fakes import FakeEngine, FakeEngines
from tests.serving.workspaces import write_workspace

INJECTIONS = ["' OR 1=1 --", "chat'; DROP TABLE audit_records; --", "%", "_", "\\", "\" OR \"\"=\""]


@pytest.fixture
def traffic(client):
    assert client.post("/pipelines/chat", json={"input": "Capital of France?"}).status_code == 200
    assert client.post("/pipelines/chat", json={"input": "Another one"}).status_code == 200
    assert client.post("/pipelines/chat", json={"input": "too much", "max_tokens": 999}).status_code == 400
    return client


def test_one_record_per_request(traffic):
    page = traffic.get("/audit/records").json()
    assert len(page["records"]) == 3 and page["next_cursor"] is None
    statuses = sorted(r["status"] for r in page["records"])
    assert statuses == ["failed", "ok", "ok"]
    failed = traffic.get("/audit/records", params={"status": "failed"}).json()["records"]
    assert [(r["error_type"], r["http_status"]) for r in failed] == [("invalid_input", 400)]


def test_record_detail_and_text_filter(traffic):
    found = traffic.get("/audit/records", params={"text": "Another"}).json()["records"]
    assert len(found) == 1, found
    (found,) = found
    detail = traffic.get(f"/audit/records/{found['id']}").json()
    assert detail["input_content"] == "Another one"
    assert detail["output_content"] == "Paris is the capital of France."
    assert [s["stage_id"] for s in detail["stages"]] == ["prompt", "tok", "gen", "out"]
    assert traffic.get("/audit/records/nope").status_code == 404


def test_pagination_covers_everything_once(traffic):
    seen, cursor = [], None
    while True:
        params = {"limit": 1, **({"cursor": cursor} if cursor else {})}
        page = traffic.get("/audit/records", params=params).json()
        seen += [r["id"] for r in page["records"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == len(set(seen)) == 3


def test_summary_verify_export(traffic):
    groups = traffic.get("/audit/summary", params={"group_by": "pipeline"}).json()["groups"]
    assert groups[0]["pipeline"] == "chat" and groups[0]["count"] == 3
    verdict = traffic.get("/audit/verify").json()
    assert verdict["ok"] is True and verdict["checked"] == 3
    lines = traffic.get("/audit/export", params={"format": "jsonl"}).text.strip().splitlines()
    assert len([json.loads(line) for line in lines]) == 3
    rows = list(csv.DictReader(io.StringIO(traffic.get("/audit/export", params={"format": "csv"}).text)))
    assert len(rows) == 3 and "pipeline" in rows[0]


@pytest.mark.parametrize("value", INJECTIONS)
@pytest.mark.parametrize("name", ["pipeline", "key_id", "model", "status", "text", "policy_category"])
def test_injection_in_filters_is_harmless(traffic, name, value):
    response = traffic.get("/audit/records", params={name: value})
    assert response.status_code == 200
    assert response.json()["records"] == []
    assert len(traffic.get("/audit/records").json()["records"]) == 3


def test_bad_sort_is_400(traffic):
    response = traffic.get("/audit/records", params={"sort": "hash; DROP TABLE x"})
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/problem+json")


def test_reviewer_roles_and_access_log(auth_client, keys):
    _, caller = keys.create("app", "caller")
    _, auditor = keys.create("reviewer", "auditor")
    assert auth_client.post("/pipelines/chat", json={"input": "hi"},
                            headers={"Authorization": f"Bearer {caller}"}).status_code == 200
    assert auth_client.get("/audit/records").status_code == 401
    assert auth_client.get("/audit/records", headers={"Authorization": f"Bearer {caller}"}).status_code == 403
    page = auth_client.get("/audit/records", params={"pipeline": "chat"},
                           headers={"Authorization": f"Bearer {auditor}"})
    assert page.status_code == 200
    (record,) = page.json()["records"]
    assert record["role"] == "caller" and record["key_id"] and "il_" not in json.dumps(record)
    store = auth_client.app.state.inferline.services.audit
    log = store.access_log(10)
    assert any(entry["action"] == "query" and entry["role"] == "auditor" for entry in log)


# --- one filter model on every surface (issue 44) ---------------------------------------------------

GHOST_KEY = "ghostghost12"  # a key that is not (or no longer) in the keys table


@pytest.fixture
def seeded(client, keys):
    """Twelve records over three named keys, an unknown key, two models, one per hour of 2026-12-05."""
    key_ids = [keys.create(name, "caller")[0].id for name in ("alpha bot", "beta bot", "gamma bot")] + [GHOST_KEY]
    store = client.app.state.inferline.services.audit
    records = [{"pipeline": "chat", "key_id": key_ids[i % 4], "model": "big" if i % 3 == 0 else "small",
                "received_at": datetime(2026, 12, 5, i, tzinfo=UTC), "cost_usd": i / 10, "request_id": f"r{i}"}
               for i in range(12)]
    ids = store.write_many(records)
    return client, key_ids, [{**record, "id": id_} for record, id_ in zip(records, ids, strict=True)]


def _parity_cases(key_ids):
    return [
        ({"key_id": key_ids[1]}, lambda r: r["key_id"] == key_ids[1]),
        ({"model": "big"}, lambda r: r["model"] == "big"),
        ({"key_id": key_ids[0], "model": "big"}, lambda r: r["key_id"] == key_ids[0] and r["model"] == "big"),
        ({"since": "2026-12-05T06:00", "until": "2026-12-05 10:00"}, lambda r: 6 <= r["received_at"].hour < 10),
        ({"min_cost_usd": "0.75", "status": "ok"}, lambda r: r["cost_usd"] >= 0.75),
    ]


def test_export_filters_agree_across_api_cli_and_console(seeded, tmp_path, capsys):
    client, key_ids, records = seeded
    for params, keep in _parity_cases(key_ids):
        expected = {r["id"] for r in records if keep(r)}
        assert 0 < len(expected) < len(records), params
        api = _jsonl_ids(client.get("/audit/export", params={**params, "format": "jsonl"}))
        console = _jsonl_ids(client.get("/ui/audit/export", params={**params, "format": "jsonl"}))
        listed = {r["id"] for r in client.get("/audit/records", params={**params, "limit": 500}).json()["records"]}
        counted = sum(g["count"] for g in client.get("/audit/summary", params=params).json()["groups"])
        options = [part for name, value in params.items() for part in ("--" + name.replace("_", "-"), value)]
        assert main(["audit", "export", "--config", str(tmp_path / "inferline.yaml"), *options]) == 0
        cli = {json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()}
        assert api == console == listed == cli == expected, params
        assert counted == len(expected), params


def test_unknown_query_parameters_are_refused_by_name(client):
    for path in ("/audit/records", "/audit/summary", "/audit/export", "/audit/verify", "/audit/access",
                 "/audit/records/some-id"):
        response = client.get(path, params={"pipelin": "chat"})
        assert response.status_code == 400, path
        assert response.headers["content-type"].startswith("application/problem+json"), path
        assert "unknown query parameter 'pipelin'" in response.json()["detail"], path
    # verify checks a time range of the chain: a record filter there is refused, not ignored
    assert "'pipeline'" in client.get("/audit/verify", params={"pipeline": "chat"}).json()["detail"]
    assert client.get("/ui/audit", params={"pipelin": "chat"}).status_code == 400
    assert client.get("/ui/audit/export", params={"keyid": "x"}).status_code == 400


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "lots"])
@pytest.mark.parametrize("path", ["/audit/records", "/audit/summary", "/audit/export", "/ui/audit"])
def test_a_cost_bound_must_be_a_finite_number(client, path, value):
    response = client.get(path, params={"min_cost_usd": value})
    assert response.status_code == 400, response.text
    assert "min_cost_usd" in response.text


def test_the_api_takes_relative_and_naive_times(traffic):
    def count(**params):
        response = traffic.get("/audit/records", params=params)
        assert response.status_code == 200, response.text
        return len(response.json()["records"])
    assert count(since="1h") == count(since="today") == count(since="2000-01-01") == 3
    assert count(until="1h") == count(until="yesterday") == count(since="2999-01-01T00:00") == 0
    assert traffic.get("/audit/summary", params={"since": "7d"}).json()["groups"][0]["count"] == 3
    assert traffic.get("/audit/verify", params={"since": "24h"}).json()["checked"] == 3
    for bad in ("someday", "7 days", "2026-13-01"):
        response = traffic.get("/audit/records", params={"since": bad})
        assert response.status_code == 400 and "since:" in response.json()["detail"], bad


def test_key_names_beside_key_ids(seeded):
    client, key_ids, _ = seeded
    names = {r["key_id"]: r["key_name"] for r in client.get("/audit/records", params={"limit": 500}).json()["records"]}
    assert names == {key_ids[0]: "alpha bot", key_ids[1]: "beta bot", key_ids[2]: "gamma bot", GHOST_KEY: None}
    groups = client.get("/audit/summary", params={"group_by": "key_id"}).json()["groups"]
    assert {g["key_id"]: (g["key_name"], g["count"]) for g in groups} == {
        key_ids[0]: ("alpha bot", 3), key_ids[1]: ("beta bot", 3), key_ids[2]: ("gamma bot", 3), GHOST_KEY: (None, 3)}
    one = client.get("/audit/records", params={"key_id": key_ids[1], "limit": 1}).json()["records"][0]
    assert client.get(f"/audit/records/{one['id']}").json()["key_name"] == "beta bot"
    page = client.get("/ui/audit", params={"key_id": key_ids[1]}).text
    assert '<span class="key-name">beta bot</span>' in page and "alpha bot" not in page
    exported = client.get("/audit/export", params={"key_id": key_ids[2], "format": "csv"}).text
    assert {row["key_name"] for row in csv.DictReader(io.StringIO(exported))} == {"gamma bot"}


def test_the_access_log_is_read_on_the_api(auth_client, keys):
    reviewer, auditor = keys.create("reviewer", "auditor")
    _, caller = keys.create("app", "caller")
    as_auditor = {"Authorization": f"Bearer {auditor}"}
    assert auth_client.get("/audit/records", params={"pipeline": "chat"}, headers=as_auditor).status_code == 200
    assert auth_client.get("/audit/export", params={"key_id": "k1"}, headers=as_auditor).status_code == 200
    assert auth_client.get("/audit/access").status_code == 401
    assert auth_client.get("/audit/access", headers={"Authorization": f"Bearer {caller}"}).status_code == 403
    body = auth_client.get("/audit/access", headers=as_auditor).json()
    assert [e["action"] for e in body["entries"]] == ["access", "export", "query"]  # newest first, this read too
    assert body["entries"][1]["query"]["key_id"] == "k1" and body["next_cursor"] is None
    assert {(e["key_id"], e["key_name"], e["role"]) for e in body["entries"]} == {(reviewer.id, "reviewer", "auditor")}
    entries = auth_client.get("/audit/access", params={"action": "access", "since": "1h"}, headers=as_auditor)
    assert [e["action"] for e in entries.json()["entries"]] == ["access", "access"]
    logged = entries.json()["entries"][0]["query"]
    assert set(logged) == {"action", "since", "limit"} and logged["since"].endswith("+00:00")  # resolved, in UTC
    first = auth_client.get("/audit/access", params={"limit": 2}, headers=as_auditor).json()
    second = auth_client.get("/audit/access", params={"limit": 2, "cursor": first["next_cursor"]},
                             headers=as_auditor).json()
    assert {e["id"] for e in first["entries"]}.isdisjoint(e["id"] for e in second["entries"])
    for params in ({"actoin": "query"}, {"since": "someday"}, {"cursor": "nope"}, {"limit": 0}):
        assert auth_client.get("/audit/access", params=params, headers=as_auditor).status_code == 400, params


def _jsonl_ids(response) -> set[str]:
    assert response.status_code == 200, response.text
    return {json.loads(line)["id"] for line in response.text.splitlines()}


@pytest.mark.parametrize("path", ["/audit/records", "/audit/summary", "/audit/export"])
def test_a_subject_without_a_master_key_is_a_400(traffic, path):
    answer = traffic.get(path, params={"subject": "tags.user:alice"})
    assert answer.status_code == 400 and "audit.master_key" in answer.json()["detail"], answer.text


# --- a workflow's steps in its record (issue 60, item 6) ----------------------------------------------------------

FLOW = """
name: flow
access: {roles: [caller]}
stages:
  - id: classify
    type: llm
    stream: true
    retry: {attempts: 2, on: [invalid_output]}
    with:
      system: "Classify."
      temperature: 0
      output: {json_schema: {type: object, properties: {intent: {enum: [refund, tech]}}, required: [intent]}}
  - id: refund
    type: llm
    when: "steps.classify.output.intent == 'refund'"
    with: {system: "Refunds.", temperature: 0}
  - {id: log, type: audit, always: true, with: {content: CONTENT}}
"""


class FirstAnswerInvalid(FakeEngine):
    """Answers "not json" to its first call (the classify step's retry runs it again), then the intent."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    async def submit(self, prompt_ids, sampling, cache_salt="", *, hints=None):
        self.calls += 1
        self.reply = b"not json" if self.calls == 1 else b'{"intent": "tech"}'
        return await super().submit(prompt_ids, sampling, cache_salt, hints=hints)


@pytest.mark.parametrize("content", ["hash", "full"])
def test_a_workflow_record_holds_each_attempt_of_each_step(tmp_path, monkeypatch, capsys, content):
    for name in ("INFERLINE_CONFIG", "INFERLINE_DATABASE"):
        monkeypatch.delenv(name, raising=False)
    config = write_workspace(tmp_path, auth=False)
    (tmp_path / "pipelines" / "flow.yaml").write_text(FLOW.replace("CONTENT", content))
    app = create_server(open_workspace(str(config)), engines=FakeEngines(smol=FirstAnswerInvalid()))
    with TestClient(app) as client:
        answer = client.post("/pipelines/flow", json={"input": "my router is down"})
        assert answer.status_code == 200 and answer.json()["output"] == '{"intent": "tech"}'
        (listed,) = client.get("/audit/records", params={"pipeline": "flow"}).json()["records"]
        record = client.get(f"/audit/records/{listed['id']}").json()
        assert client.get("/audit/verify").json()["ok"] is True
        page = client.get(f"/ui/audit/records/{listed['id']}").text
    stages = [(s["stage_id"], s["status"], s["step"]["attempt"]) for s in record["stages"]]
    assert stages == [("classify", "failed", 1), ("classify", "ok", 2), ("refund", "skipped", 1)]
    first, second, skipped = (s["step"] for s in record["stages"])
    assert skipped["skip_reason"] == "when" and "input_tokens" not in skipped
    assert first["started_ms"] <= second["started_ms"] <= skipped["started_ms"]
    assert first["input_tokens"] == second["input_tokens"] > 0 and second["output_tokens"] > first["output_tokens"]
    assert first["definition_sha256"] == second["definition_sha256"] and len(second["output_sha256"]) == 64
    assert first["inputs_sha256"] == second["inputs_sha256"] and "output_sha256" not in first  # it failed
    if content == "full":  # the values, as hashed: what a replay reuses
        assert second["output"]["output"] == {"intent": "tech"}
        assert second["inputs"]["input"] == "my router is down"
        assert digest(second["output"]) == second["output_sha256"]
        assert digest(first["inputs"]) == first["inputs_sha256"]
    else:  # hashes only
        assert {"inputs", "output"}.isdisjoint({*first, *second, *skipped})
        assert "my router is down" not in json.dumps(record["stages"])
    # The console's record page: attempt, start, tokens and skip reason per stage row.
    rows = page.split('id="record-stages"')[1].split("<tbody>")[1].split("</tbody>")[0].split("<tr>")[1:]
    assert [row.count("<td") for row in rows] == [12, 12, 12]
    assert ">2</td>" in rows[1] and ">when</td>" in rows[2]
    assert f"{second['started_ms']:.1f} ms" in rows[1]
    assert f"{second['input_tokens']} / {second['output_tokens']}" in rows[1]
    # inferline audit show: the record as JSON, each stage with its step.
    assert main(["audit", "show", listed["id"], "--config", str(config)]) == 0
    assert [s["step"] for s in json.loads(capsys.readouterr().out)["stages"]] == [first, second, skipped]
