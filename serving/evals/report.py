"""An evaluation run's summary, its comparison with a baseline run, and the Markdown and JSON reports.

Everything here works on plain dicts (a case as :meth:`CaseResult.to_dict` gives it, or as
store/eval_runs.py returns it), so a stored run compares like a fresh one.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

from pipeline.spec import SLOSpec
from serving.runtime.slo import RequestFigures, attainment, percentile

PERCENTILES = (50, 90, 95, 99)
_LATENCIES = ("ttft_ms", "itl_ms", "e2e_ms")


def _stats(values: Sequence[float]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {f"p{q}": _round(percentile(values, q)) for q in PERCENTILES}
    out["mean"] = _round(fmean(values)) if values else None
    out["count"] = len(values)
    return out


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def summarize(results: Sequence[dict[str, Any]], *, slo: SLOSpec | None = None, **meta: Any) -> dict[str, Any]:
    """The run's figures: pass rate per check, latency percentiles, tokens and cost per request.

    *meta* (run_id, pipeline, dataset, concurrency, wall_s...) is copied in as given.
    """
    n = len(results)
    checks: dict[str, dict[str, Any]] = {}
    for result in results:
        for check in result["checks"]:
            entry = checks.setdefault(check["name"], {"type": check["type"], "cases": 0, "passed": 0, "errors": 0,
                                                      "scores": []})
            entry["cases"] += 1
            entry["passed"] += bool(check["passed"])
            entry["errors"] += bool(check.get("error"))
            if check.get("score") is not None:
                entry["scores"].append(check["score"])
    for entry in checks.values():
        scores = entry.pop("scores")
        entry["pass_rate"] = round(entry["passed"] / entry["cases"], 4)
        entry["mean_score"] = round(fmean(scores), 4) if scores else None
    ok = [r for r in results if r["status"] == "ok"]
    passed = sum(bool(r["passed"]) for r in results)
    cost_total = sum(r["cost_usd"] for r in results)
    summary: dict[str, Any] = dict(meta)
    summary |= {
        "num_cases": n, "passed_cases": passed, "pass_rate": round(passed / n, 4) if n else 0.0,
        "checks": checks,
        "status": dict(Counter(r["status"] for r in results)),
        "finish_reasons": dict(Counter(r.get("finish_reason") or "-" for r in ok)),
        "latency_ms": {name: _stats([r[name] for r in ok if r[name] is not None]) for name in _LATENCIES},
        "tokens": {"input_per_request": _round(fmean([r["input_tokens"] for r in results])) if n else None,
                   "output_per_request": _round(fmean([r["output_tokens"] for r in results])) if n else None,
                   "input_total": sum(r["input_tokens"] for r in results),
                   "output_total": sum(r["output_tokens"] for r in results)},
        "cost_usd": {"per_request": cost_total / n if n else None, "total": cost_total,
                     "per_1k_requests": 1000 * cost_total / n if n else None,
                     "checks_total": sum(r.get("eval_cost_usd", 0.0) for r in results)},
    }
    if slo is not None:
        summary["slo"] = attainment(slo, (RequestFigures(r["status"] == "ok", r["ttft_ms"], r["itl_ms"],
                                                         r["e2e_ms"], r["cost_usd"]) for r in results))
    return summary


def _delta(base: float | None, current: float | None, digits: int = 4) -> dict[str, float | None]:
    delta = None if base is None or current is None else round(current - base, digits)
    return {"baseline": base, "current": current, "delta": delta}


def compare(current: dict[str, Any], results: Sequence[dict[str, Any]], baseline: dict[str, Any],
            baseline_results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What changed from *baseline* to *current*: overall and per case (cases matched by id)."""
    before = {r["case_id"]: r for r in baseline_results}
    after = {r["case_id"]: r for r in results}
    cases, counts = [], Counter()
    for case_id in [*after, *(i for i in before if i not in after)]:
        entry = _case_change(before.get(case_id), after.get(case_id))
        counts[entry["change"]] += 1
        cases.append({"id": case_id, **entry})
    checks = {name: _delta(baseline["checks"].get(name, {}).get("pass_rate"), current["checks"].get(name, {})
                           .get("pass_rate")) for name in {**baseline["checks"], **current["checks"]}}
    latency = {f"{name}_{q}": _delta(baseline["latency_ms"][name][q], current["latency_ms"][name][q], 2)
               for name in _LATENCIES for q in ("p50", "p95")}
    flips = Counter("fixed" if v["current"] else "regressed" for c in cases for v in c["checks"].values()
                    if v["baseline"] is not None and v["current"] is not None and v["baseline"] != v["current"])
    return {
        "baseline_id": baseline.get("run_id"), "baseline_created_at": baseline.get("created_at"),
        "spec_changed": baseline.get("spec_sha256") != current.get("spec_sha256"),
        "dataset_changed": baseline.get("dataset_sha256") != current.get("dataset_sha256"),
        "pass_rate": _delta(baseline["pass_rate"], current["pass_rate"]),
        "checks": dict(sorted(checks.items())),
        "latency_ms": latency,
        "output_tokens_per_request": _delta(baseline["tokens"]["output_per_request"],
                                            current["tokens"]["output_per_request"], 2),
        "cost_usd_per_request": _delta(baseline["cost_usd"]["per_request"], current["cost_usd"]["per_request"], 9),
        "cases": {"fixed": counts["fixed"], "regressed": counts["regressed"], "same": counts["same"],
                  "new": counts["new"], "removed": counts["removed"]},
        #: Single checks that went from fail to pass (fixed) or back, in cases present in both runs.
        "checks_flipped": {"fixed": flips["fixed"], "regressed": flips["regressed"]},
        "per_case": cases,
    }


def _case_change(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    if before is None or after is None:
        present = after or before
        return {"change": "new" if before is None else "removed", "baseline_passed": None if before is None
                else bool(before["passed"]), "current_passed": None if after is None else bool(after["passed"]),
                "checks": {c["name"]: {"baseline": None if before is None else c["passed"],
                                       "current": None if after is None else c["passed"]}
                           for c in (present or {}).get("checks", [])}}
    was, now = bool(before["passed"]), bool(after["passed"])
    change = "same" if was == now else "fixed" if now else "regressed"
    old = {c["name"]: c for c in before["checks"]}
    checks = {}
    for check in after["checks"]:
        prior = old.get(check["name"])
        score = (None if prior is None or prior.get("score") is None or check.get("score") is None
                 else round(check["score"] - prior["score"], 4))
        checks[check["name"]] = {"baseline": None if prior is None else prior["passed"], "current": check["passed"],
                                 "score_delta": score}
    return {"change": change, "baseline_passed": was, "current_passed": now, "checks": checks,
            "output_changed": before.get("output") != after.get("output"),
            "e2e_ms_delta": round(after["e2e_ms"] - before["e2e_ms"], 2)}


def write_reports(folder: str | Path, summary: dict[str, Any], results: Sequence[dict[str, Any]],
                  diff: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """``report.json`` (summary, diff and every case) and ``report.md`` in *folder*; their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / "report.json", folder / "report.md"
    body = {"summary": summary, "baseline": diff, "cases": list(results)}
    json_path.write_text(json.dumps(body, indent=2, default=str) + "\n", encoding="utf-8")
    md_path.write_text(markdown(summary, results, diff), encoding="utf-8")
    return json_path, md_path


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _signed(value: float | None, fmt: str = "{:+.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _cell(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("|", "\\|")


def markdown(summary: dict[str, Any], results: Sequence[dict[str, Any]], diff: dict[str, Any] | None = None) -> str:
    """The report a person reads: headline, checks, latency, tokens and cost, the baseline, every case."""
    lines = [f"# Eval of `{summary.get('pipeline')}` on `{summary.get('dataset')}`", "",
             f"Run `{summary.get('run_id')}` at {summary.get('created_at')}: {summary['num_cases']} cases, "
             f"concurrency {summary.get('concurrency')}, {_num(summary.get('wall_s'))} s; spec "
             f"`{str(summary.get('spec_sha256'))[:12]}`, dataset `{str(summary.get('dataset_sha256'))[:12]}`.", "",
             f"**{summary['passed_cases']}/{summary['num_cases']} cases passed every check "
             f"({_pct(summary['pass_rate'])})**"
             + (f", {_signed(diff['pass_rate']['delta'] * 100, '{:+.1f}')} points against the baseline."
                if diff and diff["pass_rate"]["delta"] is not None else "."), ""]
    lines += _checks_table(summary, diff)
    lines += ["", "## Latency (ms)", "", "| | p50 | p90 | p95 | p99 | mean | requests |", "|---" * 7 + "|"]
    for name, stats in summary["latency_ms"].items():
        lines.append(f"| {name.removesuffix('_ms')} | " + " | ".join(_num(stats[k]) for k in
                                                                     ("p50", "p90", "p95", "p99", "mean"))
                     + f" | {stats['count']} |")
    tokens, cost = summary["tokens"], summary["cost_usd"]
    lines += ["", "## Tokens and cost", "",
              f"- tokens per request: {_num(tokens['input_per_request'])} in, {_num(tokens['output_per_request'])} out",
              f"- cost per request: {_num(cost['per_request'], 8)} USD; per 1,000 requests "
              f"{_num(cost['per_1k_requests'], 5)} USD; checks (judges) {_num(cost['checks_total'], 8)} USD",
              f"- request status: {', '.join(f'{k} {v}' for k, v in summary['status'].items())}; finish reasons: "
              f"{', '.join(f'{k} {v}' for k, v in summary['finish_reasons'].items()) or '-'}"]
    if summary.get("slo"):
        lines += ["", "## SLO attainment (at this concurrency)", "", "| objective | target | observed | attainment |"
                  " holds |", "|---|---|---|---|---|"]
        for name, entry in summary["slo"].items():
            lines.append(f"| {name} | {entry.get('target', '-')} | {_num(entry.get('observed'), 4)} | "
                         f"{_pct(entry['attainment'])} | {entry.get('holds', '-')} |")
    if diff:
        lines += _baseline_section(diff)
    lines += ["", "## Cases", "", "| # | case | status | passed | failed checks | e2e ms | answer |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        failed = ", ".join(c["name"] + (" (error)" if c.get("error") else "") for c in r["checks"] if not c["passed"])
        verdict = "yes" if r["passed"] else "no"
        lines.append(f"| {r['position']} | {_cell(r['case_id'], 40)} | {r['status']} | {verdict} | {failed or '-'} | "
                     f"{_num(r['e2e_ms'], 0)} | {_cell(r['output'])} |")
    return "\n".join(lines) + "\n"


def _checks_table(summary: dict[str, Any], diff: dict[str, Any] | None) -> list[str]:
    head = "| check | type | passed | pass rate | mean score | errors |" + (" vs baseline |" if diff else "")
    lines = ["## Checks", "", head, "|---" * (7 if diff else 6) + "|"]
    for name, entry in sorted(summary["checks"].items()):
        row = (f"| {name} | {entry['type']} | {entry['passed']}/{entry['cases']} | {_pct(entry['pass_rate'])} | "
               f"{_num(entry['mean_score'], 3)} | {entry['errors']} |")
        if diff:
            delta = diff["checks"].get(name, {}).get("delta")
            row += f" {_signed(None if delta is None else delta * 100, '{:+.1f} pts')} |"
        lines.append(row)
    return lines


def _baseline_section(diff: dict[str, Any]) -> list[str]:
    counts = diff["cases"]
    lines = ["", f"## Against baseline `{diff['baseline_id']}` ({diff['baseline_created_at']})", ""]
    if diff["spec_changed"]:
        lines.append("The pipeline spec changed since the baseline.")
    if diff["dataset_changed"]:
        lines.append("**The dataset changed since the baseline**: cases are matched by id.")
    rate = diff["pass_rate"]
    points = None if rate["delta"] is None else rate["delta"] * 100
    lines += ["", "| | baseline | this run | change |", "|---|---|---|---|",
              f"| pass rate | {_pct(rate['baseline'])} | {_pct(rate['current'])} | {_signed(points, '{:+.1f} pts')} |"]
    for name, entry in diff["latency_ms"].items():
        lines.append(f"| {name.replace('_ms_', ' ')} ms | {_num(entry['baseline'])} | {_num(entry['current'])} | "
                     f"{_signed(entry['delta'])} |")
    tokens, cost = diff["output_tokens_per_request"], diff["cost_usd_per_request"]
    lines.append(f"| output tokens / request | {_num(tokens['baseline'])} | {_num(tokens['current'])} | "
                 f"{_signed(tokens['delta'])} |")
    lines.append(f"| cost / request (USD) | {_num(cost['baseline'], 8)} | {_num(cost['current'], 8)} | "
                 f"{_signed(cost['delta'], '{:+.8f}')} |")
    more = f", {counts['new']} new, {counts['removed']} removed" if counts["new"] or counts["removed"] else ""
    lines += ["", f"Cases: {counts['fixed']} fixed, {counts['regressed']} regressed, {counts['same']} unchanged"
                  f"{more}."]
    flipped = diff["checks_flipped"]
    lines.append(f"Checks: {flipped['fixed']} went from fail to pass, {flipped['regressed']} from pass to fail.")
    for change in ("regressed", "fixed"):
        changed = [c for c in diff["per_case"] if c["change"] == change]
        if changed:
            lines += ["", f"{change.capitalize()} cases:", ""]
            lines += [f"- `{case['id']}`: {_flips(case) or 'checks changed'}" for case in changed]
    others = [c for c in diff["per_case"] if c["change"] == "same" and _flips(c)]
    if others:
        lines += ["", "Checks that flipped in cases whose verdict did not change:", ""]
        lines += [f"- `{case['id']}`: {_flips(case)}" for case in others]
    return lines


def _flips(case: dict[str, Any]) -> str:
    return ", ".join(f"{name} {_mark(v['baseline'])}→{_mark(v['current'])}" for name, v in case["checks"].items()
                     if v["baseline"] is not None and v["baseline"] != v["current"])


def _mark(passed: bool | None) -> str:
    return "-" if passed is None else "pass" if passed else "fail"
