"""The HTML report of a replay (``inferline replay --html FILE``): the totals, then each request old against new.

    page = html_report("support", "support-v4.yaml", totals, results)   # serving/evals/replay.py's output

One self-contained page (no outside assets), in words and rounded figures: latencies in milliseconds to
one decimal, costs in dollars, and per request what of it the replay could not send again.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

#: Why a checkpoint or a deploy action is skipped: not a request, so not listed one by one.
NOT_A_REQUEST = "not a request"

_STYLE = ("body{font:14px system-ui,sans-serif;margin:2rem}table{border-collapse:collapse}"
          "td,th{border:1px solid #ccc;padding:.3rem;vertical-align:top}.diff{background:#fff3f0}"
          "dt{font-weight:600}dd{margin:0 0 .4rem 1rem}ul{margin:0;padding-left:1rem}")


def html_report(name: str, candidate: str, totals: dict[str, Any], results: Sequence[dict[str, Any]],
                skipped: Sequence[Mapping[str, str]] = ()) -> str:
    """A self-contained HTML page (no outside assets): the totals, each request old against new, then each
    request that could not be replayed and why."""
    e = html.escape
    rows = "\n".join(_row(r) for r in results)
    facts = "".join(f"<dt>{e(term)}</dt><dd>{e(text)}</dd>" for term, text in _facts(totals))
    skips = "".join(f"<li><code>{e(s['record_id'])}</code>: {e(s['why'])}</li>" for s in skipped
                    if s["why"] != NOT_A_REQUEST)
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Replay of {e(name)}</title>"
            f"<style>{_STYLE}</style></head><body>"
            f"<h1>Replay of {e(name)} through {e(candidate)}</h1><dl>{facts}</dl>"
            "<table><thead><tr><th>record</th><th>identical</th><th>old output</th><th>new output</th>"
            "<th>ms old / new</th><th>tokens old / new</th><th>policy old / new</th><th>not restored</th></tr>"
            f"</thead><tbody>{rows}</tbody></table>"
            + (f"<h2>Not replayed</h2><ul>{skips}</ul>" if skips else "") + "</body></html>\n")


def _facts(totals: Mapping[str, Any]) -> list[tuple[str, str]]:
    def old_new(key: str, fmt: Any) -> str:
        return f"{fmt(totals[key]['old'])} → {fmt(totals[key]['new'])}"

    facts = [
        ("replayed", f"{totals['replayed']} request(s)"),
        ("identical", f"{totals['identical']} ({totals['normalized_identical']} after normalizing)"),
        ("changed status", str(totals["status_changed"])),
        ("changed policy decision", str(totals["policy_changed"])),
        ("median latency (ms)", old_new("duration_ms_p50", ms)),
        ("output tokens", old_new("output_tokens", lambda v: f"{v:g}")),
        ("cost (USD)", old_new("cost_usd", usd)),
    ]
    if totals.get("not_restored"):
        facts.append(("not restored", f"{totals['not_restored']} request(s): "
                      + _counts(totals["not_restored_by_what"])))
    if totals.get("skipped"):
        facts.append(("skipped", f"{totals['skipped']} record(s): " + _counts(totals["skipped_by_reason"])))
    return facts


def _row(r: Mapping[str, Any]) -> str:
    e = html.escape
    old, new = r["old"], r["new"]
    missing = "".join(f"<li>{e(note['what'])}: {e(note['why'])}</li>" for note in r.get("not_restored", ()))
    return (f"<tr class=\"{'same' if r['identical'] else 'diff'}\"><td><code>{e(str(r['record_id']))}</code></td>"
            f"<td>{'yes' if r['identical'] else 'no'}</td><td>{e(old['output'])}</td><td>{e(new['output'])}</td>"
            f"<td>{ms(old['duration_ms'])} / {ms(new['duration_ms'])}</td>"
            f"<td>{old['output_tokens']} / {new['output_tokens']}</td>"
            f"<td>{e(old['policy_action'] or 'none')} / {e(new['policy_action'] or 'none')}</td>"
            f"<td>{f'<ul>{missing}</ul>' if missing else ''}</td></tr>")


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{what} {n}" for what, n in sorted(counts.items(), key=lambda item: -item[1]))


def ms(value: float | None) -> str:
    """Milliseconds to one decimal; a dash when there is no figure."""
    return "–" if value is None else f"{value:,.1f}"


def usd(value: float | None) -> str:
    """Dollars to six decimals, trailing zeros dropped."""
    return "–" if value is None else (f"{value:.6f}".rstrip("0").rstrip(".") or "0")
