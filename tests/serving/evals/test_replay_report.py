"""The replay's HTML report: facts in words and rounded figures, never a Python dict."""

from __future__ import annotations

from serving.evals.replay import summarize_replay
from serving.evals.replay_report import html_report


def result(record_id, old_ms, new_ms, identical=True, not_restored=()):
    side = {"version": "1", "status": "ok", "finish_reason": "stop", "ttft_ms": None, "output_tokens": 4,
            "cost_usd": 0.0001234, "policy_action": None, "output": "Paris."}
    return {"record_id": record_id, "identical": identical, "normalized_identical": identical,
            "not_restored": list(not_restored), "old": {**side, "duration_ms": old_ms},
            "new": {**side, "duration_ms": new_ms}}


def test_the_report_reads_as_words_and_rounded_figures():
    results = [result("a1", 812.412345678, 655.10000001),
               result("b2", 530.2, 512.75, False, [{"what": "tags", "why": "not in the record"}])]
    skipped = [{"record_id": "c3", "why": "content kept as hash"}, {"record_id": "d4", "why": "not a request"}]
    page = html_report("support", "v4.yaml", summarize_replay(results, skipped), results, skipped)
    assert "{" not in page.split("</style>")[1] and "'old'" not in page  # no Python dict printed
    assert "812.4 / 655.1" in page and "671.3 → 583.9" in page  # per request, then the medians
    assert "0.000247 → 0.000247" in page
    assert "<li>tags: not in the record</li>" in page and "tags 1" in page
    assert "<li><code>c3</code>: content kept as hash</li>" in page and "d4" not in page  # a deploy is no request
