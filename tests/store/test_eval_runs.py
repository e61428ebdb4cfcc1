"""Stored eval runs: save, list, resolve ("last", ids and prefixes) and read back, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from store.eval_runs import EvalRunStore, UnknownRun

T0 = datetime(2026, 12, 1, 12, tzinfo=UTC)


def case(position: int, passed: bool) -> dict:
    return {"position": position, "case_id": f"c{position}", "status": "ok", "passed": passed,
            "checks": [{"name": "contains", "type": "contains", "passed": passed, "score": float(passed)}],
            "output": "Paris", "ttft_ms": 10.0, "itl_ms": None, "e2e_ms": 50.0, "input_tokens": 3,
            "output_tokens": 1, "cost_usd": 0.001, "request_id": f"r{position}"}


def save(store: EvalRunStore, run_id: str, pipeline: str, minutes: int, passed: list[bool]) -> str:
    summary = {"run_id": run_id, "pipeline": pipeline, "spec_sha256": "a" * 64, "dataset": "evals/x.jsonl",
               "dataset_sha256": "b" * 64, "pass_rate": sum(passed) / len(passed), "checks": {}}
    return store.save(summary, [case(i + 1, p) for i, p in enumerate(passed)],
                      created_at=T0 + timedelta(minutes=minutes))


def test_runs_are_listed_resolved_and_read_back(engine):
    store = EvalRunStore(engine)
    save(store, "11111111-aaaa", "rag", 0, [True, False])
    save(store, "22222222-bbbb", "rag", 5, [True, True])
    save(store, "22223333-cccc", "chat", 9, [False])
    assert [r["id"] for r in store.list_runs()] == ["22223333-cccc", "22222222-bbbb", "11111111-aaaa"]
    rag = store.list_runs("rag", limit=1)
    assert rag[0]["id"] == "22222222-bbbb" and rag[0]["pass_rate"] == 1.0 and rag[0]["num_cases"] == 2
    assert rag[0]["created_at"] == T0 + timedelta(minutes=5)
    assert store.resolve("last", "rag") == "22222222-bbbb" and store.resolve("last") == "22223333-cccc"
    assert store.resolve("1111") == "11111111-aaaa"
    with pytest.raises(UnknownRun, match="ambiguous"):
        store.resolve("2222")
    with pytest.raises(UnknownRun, match="no stored eval run"):
        store.resolve("9999")
    with pytest.raises(UnknownRun, match="too short"):
        store.resolve("1")
    with pytest.raises(UnknownRun, match="of pipeline 'other'"):
        store.resolve("last", "other")
    summary, results = store.get("11111111-aaaa")
    assert summary["run_id"] == "11111111-aaaa" and summary["pipeline"] == "rag"
    assert [(r["case_id"], r["passed"]) for r in results] == [("c1", True), ("c2", False)]
    assert results[0]["checks"][0]["score"] == 1.0 and results[0]["itl_ms"] is None
    with pytest.raises(UnknownRun):
        store.get("nope")


def test_a_prefix_with_like_wildcards_matches_literally(engine):
    store = EvalRunStore(engine)
    save(store, "ab%d-1", "rag", 0, [True])
    save(store, "abcd-2", "rag", 1, [True])
    assert store.resolve("ab%d") == "ab%d-1"
