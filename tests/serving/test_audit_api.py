"""Reviewers' routes over the real audit store (SQLite), with requests from fake engines."""

from __future__ import annotations

import csv
import io
import json

import pytest

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
    store = auth_client.app.state.inferline.audit
    log = store.access_log(10)
    assert any(entry["action"] == "query" and entry["role"] == "auditor" for entry in log)
