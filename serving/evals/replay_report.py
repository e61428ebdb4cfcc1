"""The HTML report of a replay (``inferline replay --html FILE``): the totals, then each request old against new.

    page = html_report("support", "support-v4.yaml", totals, results)   # serving/evals/replay.py's output

One self-contained page (no outside assets), in words and rounded figures: latencies in milliseconds to
one decimal, costs in dollars, and per request what of it the replay could not send again; a replay by step
shows under each request its steps (reused or rerun, old against new, the output's diff) and in the totals
what reusing saved. The command's text lines for steps come from here too (:func:`step_line`).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from serving.evals.replay_steps import diff_parts

#: Why a checkpoint or a deploy action is skipped: not a request, so not listed one by one.
NOT_A_REQUEST = "not a request"
#: How the why of a record skipped for its content begins (``content kept as hash``).
CONTENT_KEPT = "content kept as"

_STYLE = ("body{font:14px system-ui,sans-serif;margin:2rem}table{border-collapse:collapse}"
          "td,th{border:1px solid #ccc;padding:.3rem;vertical-align:top}.diff{background:#fff3f0}"
          "dt{font-weight:600}dd{margin:0 0 .4rem 1rem}ul{margin:0;padding-left:1rem}del{background:#fdd}"
          "ins{background:#dfd;text-decoration:none}.steps table{font-size:90%}")


def html_report(name: str, candidate: str, totals: dict[str, Any], results: Sequence[dict[str, Any]],
                skipped: Sequence[Mapping[str, str]] = ()) -> str:
    """A self-contained HTML page (no outside assets): the totals, each request old against new, then each
    request that could not be replayed and why."""
    e = html.escape
    rows = "\n".join(_row(r) for r in results)
    facts = "".join(f"<dt>{e(term)}</dt><dd>{e(text)}</dd>" for term, text in _facts(totals))
    skips = "".join(f"<li><code>{e(s['record_id'])}</code>: {e(s['why'])}"
                    + (f". {e(changes_text(s['steps']))} ({e(s['reuse'])})" if s.get("steps") else "") + "</li>"
                    for s in skipped if s["why"] != NOT_A_REQUEST)
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
    if totals.get("steps"):
        facts.append(("by step", saved_text(totals["steps"])))
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
            f"<td>{f'<ul>{missing}</ul>' if missing else ''}</td></tr>" + _steps_row(r.get("steps")))


def _steps_row(steps: Sequence[Mapping[str, Any]] | None) -> str:
    """A request's steps (a replay by step), under its row: how each ran, old -> new, and its output's diff."""
    if not steps:
        return ""
    e = html.escape

    def side(s: Mapping[str, Any] | None, name: str, fmt: Any) -> str:
        return fmt(s[name]) if s else "–"

    rows = "".join(
        f"<tr><td><code>{e(s['step'])}</code></td><td>{e(s['run'])}</td>"
        f"<td>{side(s['old'], 'duration_ms', ms)} / {side(s['new'], 'duration_ms', ms)}</td>"
        f"<td>{side(s['old'], 'output_tokens', str)} / {side(s['new'], 'output_tokens', str)}</td>"
        f"<td>{side(s['old'], 'cost_usd', usd)} / {side(s['new'], 'cost_usd', usd)}</td>"
        f"<td>{_diff_html(s)}</td></tr>" for s in steps)
    return ("<tr class=\"steps\"><td></td><td colspan=\"7\"><table><thead><tr><th>step</th><th>ran</th>"
            "<th>ms old / new</th><th>output tokens old / new</th><th>cost old / new</th><th>output</th></tr></thead>"
            f"<tbody>{rows}</tbody></table></td></tr>")


def _diff_html(step: Mapping[str, Any]) -> str:
    e = html.escape
    old, new = (step["old"] or {}).get("output"), (step["new"] or {}).get("output")
    if step["identical"] is not False or old is None or new is None:
        return "same" if step["identical"] else ""
    tags = {"=": "{}", "-": "<del>{}</del>", "+": "<ins>{}</ins>", "…": "…"}
    return " ".join(tags[op].format(e(words)) for op, words in diff_parts(old, new))


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{what} {n}" for what, n in sorted(counts.items(), key=lambda item: -item[1]))


def ms(value: float | None) -> str:
    """Milliseconds to one decimal; a dash when there is no figure."""
    return "–" if value is None else f"{value:,.1f}"


def usd(value: float | None) -> str:
    """Dollars to six decimals, trailing zeros dropped."""
    return "–" if value is None else (f"{value:.6f}".rstrip("0").rstrip(".") or "0")


def step_line(step: Mapping[str, Any]) -> str:
    """One step of a replay by step as a line of text: how it ran, its time, tokens (in/out) and cost, old ->
    new, and its output's short diff when it changed."""
    old, new = step["old"] or {}, step["new"] or {}

    def tokens(side: Mapping[str, Any]) -> str:
        return f"{side['input_tokens']}/{side['output_tokens']}" if side else "–"

    same = {True: "same", False: "DIFF", None: ""}[step["identical"]]
    return (f"{step['step']:<14} {step['run']:<8} {same:<4}  ms {ms(old.get('duration_ms'))} -> "
            f"{ms(new.get('duration_ms'))}  tokens {tokens(old)} -> {tokens(new)}  cost "
            f"{usd(old.get('cost_usd'))} -> {usd(new.get('cost_usd'))}" + (f"  {step['diff']}" if step["diff"] else ""))


def changes_text(changes: Mapping[str, Sequence[str]]) -> str:
    """Which steps a candidate changed, in words (serving/evals/replay_steps.py's ``step_changes``)."""
    labels = (("changed", "steps changed"), ("added", "added"), ("removed", "removed"), ("after", "after them"),
              ("unchanged", "unchanged"))
    said = [f"{label}: {', '.join(changes[key])}" for key, label in labels if changes.get(key)]
    return "; ".join(said) if changes.get("changed") or changes.get("added") or changes.get("removed") else \
        "no step changed; " + "; ".join(said)


def saved_text(steps: Mapping[str, Any]) -> str:
    """The totals of a replay by step in words: steps reused, rerun and skipped, and what reusing saved."""
    saved = steps["saved"]
    text = f"steps {steps['reused']} reused, {steps['rerun']} rerun, {steps['skipped']} skipped"
    if steps["mode"] == "full":
        return text + " (--full: every step rerun)"
    return (text + f"; reusing saved {saved['input_tokens']:g} input and {saved['output_tokens']:g} output tokens, "
            f"USD {usd(saved['cost_usd'])}, {ms(saved['duration_ms'])} ms of step time")
