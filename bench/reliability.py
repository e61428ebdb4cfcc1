"""The full reliability run: load and soak, faults, hostile input, security; rewrites docs/reliability.md.

    .venv/bin/python bench/reliability.py [--quick] [--clients N] [--minutes T] [--no-docs]   (make reliability)
    .venv/bin/python bench/reliability.py --render bench/results/reliability.json   # the page again, no run

1. ``bench/load.py --clients N --minutes T`` (128 clients for 10 minutes);
2. the fault tests (tests/faults/) with a 30 s database outage (``RELIABILITY_DB_OUTAGE_S``);
3. the hostile-input and security tests (tests/security/) with 200 schemathesis examples per operation
   (over 2,000 cases) and 2,000 hypothesis examples per YAML strategy.
``--quick``: the short versions ``make test`` runs (16 clients for 0.5 minutes, an 8 s outage, 25 and 200
examples). Each step's figures and test counts go into docs/reliability.md (unless ``--no-docs``), and
the last line of stdout is one JSON object with them all (kept, with each test's time, in
bench/results/reliability.json).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # bench/http.py shadows http
ROOT = _HERE.parent

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from typing import Any

DOC = ROOT / "docs" / "reliability.md"
RESULTS = ROOT / "bench" / "results" / "reliability.json"


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, str(ROOT / "bench" / "load.py"), "--clients", str(args.clients),
               "--minutes", str(args.minutes)]
    print("$", " ".join(command[1:]), flush=True)
    started = time.monotonic()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    sys.stdout.write(out.stdout[-2000:])
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr[-2000:]}"}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def run_tests(name: str, paths: list[str], env: dict[str, str], out_dir: Path) -> dict[str, Any]:
    junit = out_dir / f"{name}.xml"
    command = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    print("$", " ".join(f"{k}={v}" for k, v in env.items() if k.startswith("RELIABILITY_") and k != "RELIABILITY_OUT"),
          "pytest", " ".join(paths), flush=True)
    started = time.monotonic()
    out = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    print(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:], flush=True)
    result: dict[str, Any] = {"exit_code": out.returncode, "wall_s": round(time.monotonic() - started, 1)}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        assert suite is not None
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        result |= counts | {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]}
        result["cases"] = [{"name": case.get("name"), "file": case.get("classname", "").rsplit(".", 1)[-1],
                            "s": round(float(case.get("time", 0)), 1),
                            "ok": case.find("failure") is None and case.find("error") is None}
                           for case in suite.iter("testcase")]
    if out.returncode != 0:
        result["output_tail"] = out.stdout[-3000:]
    return result


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "commit": commit.strip(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="inferline-reliability-") as tmp:
        out_dir = Path(tmp)
        env = {"RELIABILITY_OUT": str(out_dir), "RELIABILITY_DB_OUTAGE_S": str(args.outage_s),
               "RELIABILITY_SCHEMATHESIS_EXAMPLES": str(args.schemathesis_examples),
               "RELIABILITY_HYPOTHESIS_EXAMPLES": str(args.hypothesis_examples)}
        result: dict[str, Any] = {"machine": machine(), "settings": {
            "clients": args.clients, "minutes": args.minutes, "db_outage_s": args.outage_s,
            "schemathesis_examples_per_operation": args.schemathesis_examples,
            "hypothesis_examples": args.hypothesis_examples}}
        result["load"] = run_load(args)
        result["faults"] = run_tests("faults", ["tests/faults/test_server_faults.py",
                                                "tests/faults/test_database_outage.py"], env, out_dir)
        result["security"] = run_tests("security", ["tests/security"], env, out_dir)
        schemathesis = out_dir / "schemathesis.json"
        result["schemathesis"] = json.loads(schemathesis.read_text()) if schemathesis.exists() else None
    return result


# -- the page ------------------------------------------------------------------


def render(r: dict[str, Any]) -> str:
    m, s, load = r["machine"], r["settings"], r["load"]
    lines = [
        "# Reliability",
        "",
        "How Inferline holds under load, faults and hostile input, as measured by `make reliability`",
        "(`bench/reliability.py`), which rewrote this page. Every run is on loopback only, bounded in",
        "count and time; `make test` runs the short versions of the same tests.",
        "",
        f"Last run: {m['date']}, commit `{m['commit']}`, {m['cores']} cores ({m['cpu']}), Python {m['python']}.",
        "",
        "## Load and soak",
        "",
        f"`bench/load.py --clients {s['clients']} --minutes {s['minutes']:g}`: {s['clients']} streaming clients,",
        "each sending its next `POST /pipelines/chat` (`\"stream\": true`, `max_tokens` 32 to 64) as soon as",
        "the last ended, against `inferline serve` on the default `inferline.yaml` (SmolLM2-135M-Instruct on",
        "our engine, on the CPU) with auth on (a `caller` key from `inferline keys create`) and the chat",
        "pipeline's audit stage writing one record per request to SQLite.",
        "",
    ]
    if "error" in load:
        lines += [f"The load run failed: `{load['error'][:500]}`", ""]
    else:
        growth = load["rss_growth_pct"]
        lines += [
            "| figure | value | target |",
            "|---|---|---|",
            f"| requests sent / completed | {load['requests_sent']:,} / {load['requests_completed']:,} | equal |",
            f"| 429 with Retry-After / without | {load['status_429_with_retry_after']} / "
            f"{load['status_429_without_retry_after']} | - / 0 |",
            f"| 5xx | {load['status_5xx']} | 0 |",
            f"| error events after a 200, failed connections | {load['stream_errors']}, "
            f"{load['transport_errors']} | 0 |",
            f"| TTFT p50 / p95 / p99 | {fmt_ms(load['ttft_ms_p50'])} / {fmt_ms(load['ttft_ms_p95'])} / "
            f"{fmt_ms(load['ttft_ms_p99'])} | |",
            f"| end to end p50 / p95 / p99 | {fmt_ms(load['e2e_ms_p50'])} / {fmt_ms(load['e2e_ms_p95'])} / "
            f"{fmt_ms(load['e2e_ms_p99'])} | |",
            f"| output tokens per second | {load['tokens_per_s']} ({load['requests_per_s']} requests/s) | |",
            f"| server RSS after warm-up / at the end | {load['rss_start_mb']:,.0f} / {load['rss_end_mb']:,.0f} MiB "
            f"({growth:+.2f}%) | growth < 5% |",
            f"| server RSS every 30 s of the load (MiB) | {', '.join(map(str, load.get('rss_samples_mb', [])))} | "
            "a plateau |",
            f"| audit records / missing / twice / unknown | {load['audit_records']:,} / {load['audit_missing']} / "
            f"{load['audit_duplicated']} / {load['audit_unmatched']} | = sent / 0 / 0 / 0 |",
            f"| audit chain verifies, server exit status | {str(load['audit_verify_ok']).lower()}, "
            f"{load['server_exit_code']} | true, 0 |",
            "",
            "TTFT and end-to-end times include queueing: with 128 clients on 2 cores most requests wait",
            "for a place in the batch (64 at most), so these are the latencies of a saturated server.",
            "",
            *rss_note(load),
        ]
    lines += ["## Faults", "", f"`pytest tests/faults/` with `RELIABILITY_DB_OUTAGE_S={s['db_outage_s']:g}`: "
              + counts(r["faults"]), ""]
    lines += [
        "| fault | what is checked |",
        "|---|---|",
        "| the database stops under load (a TCP proxy in front of a scratch PostgreSQL schema is cut, "
        f"{s['db_outage_s']:g} s) | every request is served meanwhile (keys verified before the outage keep "
        "working, records go to the spool); after it, every request has exactly one audit record, the chain "
        "verifies, the spool is empty |",
        "| the engine raises mid-batch (an operator plugin loaded only by the test, `tests/faults/engine_fault.py`) "
        "| the marked request and the batch it ran in end with an `error` event naming the failure; the "
        "requests waiting behind it finish; the server keeps serving; KV usage back to 0; each failed request "
        "audited as failed |",
        "| a remote backend hangs (accepts, never answers) | the first-token timeout fires and the route falls "
        "back to the local model (recorded in `route.fallbacks_tried`); without a fallback, a 503 problem |",
        "| clients disconnect at random points (24 requests, seeded) | running, waiting and KV usage return to "
        "0 in `/readyz` and `/metrics`; each request that got its 200 audited once |",
        "| hostile bodies against the real engine | prompts past the context window, a regex that does not "
        "compile, a schema nested 300 deep: 4xx problems, the server stays up |",
        "| SIGTERM under load (8 clients) | exit status 0; every accepted stream ends with `done`; every "
        "accepted request audited once |",
        "",
    ]
    lines += case_table(r["faults"])
    sch = r.get("schemathesis") or {}
    lines += ["## Hostile input and security", "",
              "`pytest tests/security/` with `RELIABILITY_SCHEMATHESIS_EXAMPLES="
              f"{s['schemathesis_examples_per_operation']} RELIABILITY_HYPOTHESIS_EXAMPLES="
              f"{s['hypothesis_examples']}`: " + counts(r["security"]), ""]
    if sch:
        lines += [f"schemathesis: **{sch['cases']:,} generated cases** over {sch['operations']} operations (every "
                  "operation in `/schema/openapi.json`), 0 server errors and 0 schema violations required.", ""]
    lines += [
        "| suite | what is checked |",
        "|---|---|",
        "| `test_schemathesis.py` | every documented operation, valid and invalid cases: no 5xx, statuses, "
        "content types, headers and bodies as documented, invalid data refused |",
        "| `test_hostile_yaml.py` | hypothesis over the pipeline and server loaders (arbitrary text, hostile "
        "fragments, mutated shipped pipelines, random mappings): a valid spec or a `file:line:col` SpecError, "
        "never another exception; alias bombs and deep nesting refused |",
        "| `test_hostile_input.py` | oversized and endless bodies (413), deep JSON, invalid UTF-8, NaN/Infinity, "
        "huge, negative and fractional numbers, bad constraints, odd and traversing pipeline and record names: "
        "4xx problem details (OpenAI's shape on `/v1`) |",
        "| `test_auth_matrix.py` | every route of `app.routes` declares who may call it; no key 401, wrong "
        "role 403, right role neither |",
        "| `test_secrets.py` | keys never in logs (DEBUG up), spans, the console's traces, audit records or "
        "response bodies; prompts and answers never in logs above DEBUG; audit filters resist SQL injection; "
        "secrets from `INFERLINE_*` variables and `*_FILE` files |",
        "| `test_console_security.py` | every console form refuses a missing, wrong, foreign or cross-site CSRF "
        "token; console cookies HttpOnly, SameSite=Strict, Path=/ui, Secure over https |",
        "",
        "Two schemathesis checks are adjusted, each for a reason the document cannot change: "
        "`positive_data_acceptance` also accepts 400 for schema-valid requests (a refusal no schema can "
        "express: an option over one pipeline's limit, an opaque cursor that is not ours, a prompt past the "
        "context window; a schema-valid body the validation layer refuses is 422 and still fails), and "
        "`ignored_auth` is off (it needs a network transport; `test_auth_matrix.py` checks the same per route).",
        "",
        "## What these tests found (and what was fixed)",
        "",
        *(f"- {finding}" for finding in FINDINGS),
        "",
        "## Reproduce",
        "",
        "```sh",
        "make reliability                                    # everything below, then rewrites this page",
        ".venv/bin/python bench/load.py --clients 128 --minutes 10   # load and soak alone (--quick: 16, 0.5)",
        "RELIABILITY_DB_OUTAGE_S=30 .venv/bin/python -m pytest tests/faults/",
        "RELIABILITY_SCHEMATHESIS_EXAMPLES=200 RELIABILITY_HYPOTHESIS_EXAMPLES=2000 .venv/bin/python -m pytest "
        "tests/security/",
        "```",
        "",
        "The fault tests need the PostgreSQL on 127.0.0.1:5432 (`$TEST_POSTGRES_URL`; they fail loudly without "
        "it) and create and drop their own schema; the machine's server is never stopped.",
        "",
    ]
    return "\n".join(lines)


def rss_note(load: dict[str, Any]) -> list[str]:
    """What the RSS samples say: growth in the first minute, and per minute over the second half."""
    samples, start = load.get("rss_samples_mb") or [], load["rss_start_mb"]
    if len(samples) < 4 or not start:
        return []
    half = samples[len(samples) // 2 - 1]
    minutes = (len(samples) - len(samples) // 2) / 2
    per_minute = (samples[-1] - half) / half * 100 / minutes
    first = (samples[1] - start) / start * 100
    verdict = "within" if load["rss_growth_pct"] < 5 else "**over**"
    return [f"Memory: {load['rss_growth_pct']:+.2f}% over the run, {verdict} the 5% target. "
            f"{first:+.1f}% of it comes in the first minute after the warm-up; over the second half the "
            f"server grows {per_minute:+.2f}% a minute. Before 2f04728 this run grew +7.18%: oneDNN cached a "
            "kernel and its scratch memory (about 2 MB) for every row count a matmul saw, while Python's own "
            "memory stayed flat (tracemalloc in the server); the linears now round their rows up to 56 "
            "buckets whose kernels are built at start (docs/engine.md, \"CPU kernels\").", ""]


FINDINGS = [
    "Deeply nested JSON bodies were a 500 (msgspec's RecursionError): now 400 `malformed_json` "
    "(serving/http/app.py).",
    "`since`/`until` without a UTC equivalent (`0001-01-01T00:19+19:58`) or without an offset were a 500 on "
    "every audit route: now 400, naive times taken as UTC (serving/http/audit_routes.py; the console's "
    "serving/console/audit_pages.py too). Found by schemathesis.",
    "An `output` regex Python's `re` cannot compile (Rust syntax, or a backend that does not enforce "
    "constraints) was a 500 in the stream stage's check: now a recorded finding (stages/stream.py).",
    "The OpenAPI document listed 200 and 400 only, JSON only, with request bodies that dropped `extra=forbid` "
    "and every bound of 0: it now lists each route's error statuses as problem details (OpenAI's shape on "
    "`/v1`), the SSE and JSON Lines/CSV bodies, the bearer scheme, and pydantic's own body schemas "
    "(serving/http/openapi.py).",
    "The YAML loader raised ReaderError (control characters), ValueError (`2001-13-45`), RecursionError "
    "(deep nesting, recursive aliases) and UnicodeDecodeError, and hung on alias bombs: now located "
    "SpecErrors (pipeline/yamlsrc.py, pipeline/loader.py). Found by hypothesis.",
    "Index names were not checked: `inferline index build --name ../../x` wrote outside indexes/, and "
    "`indexes: {'../x': {}}` loaded: now refused (serving/config/server.py, serving/cli/index.py).",
    "With auth on, a database outage took the whole API down (every key check failed) although audit "
    "records spool: keys verified in the last 10 minutes now keep working meanwhile (serving/http/auth.py).",
    "After clients disconnected, `/metrics` kept the aborted requests in `inferline_num_requests_running` and "
    "`inferline_kv_cache_usage_perc` (gauges were only set after a step): aborts update them "
    "(serving/engine/engine.py).",
]


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else (f"{value / 1e3:.2f} s" if value >= 1000 else f"{value:.0f} ms")


def counts(tests: dict[str, Any]) -> str:
    if "tests" not in tests:
        return f"did not run (exit {tests.get('exit_code')})."
    return (f"{tests['passed']} passed, {tests['failures'] + tests['errors']} failed, {tests['skipped']} skipped "
            f"in {tests['wall_s']:.0f} s.")


def case_table(tests: dict[str, Any]) -> list[str]:
    rows = [f"| `{c['file']}::{c['name']}` | {'ok' if c['ok'] else '**failed**'} | {c['s']:.0f} s |"
            for c in tests.get("cases", [])]
    return ["| test | result | time |", "|---|---|---|", *rows, ""] if rows else []


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the short versions (as make test runs them)")
    p.add_argument("--clients", type=int, help="load: concurrent clients (default 128; --quick 16)")
    p.add_argument("--minutes", type=float, help="load: minutes (default 10; --quick 0.5)")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/reliability.md")
    p.add_argument("--render", metavar="JSON", help="only rewrite docs/reliability.md from a saved result")
    return p


def main() -> int:
    args = parser().parse_args()
    if args.render:
        DOC.write_text(render(json.loads(Path(args.render).read_text())))
        print(f"wrote {DOC.relative_to(ROOT)}")
        return 0
    args.clients = args.clients or (16 if args.quick else 128)
    args.minutes = args.minutes if args.minutes is not None else (0.5 if args.quick else 10.0)
    args.outage_s = 8 if args.quick else 30
    args.schemathesis_examples = 25 if args.quick else 200
    args.hypothesis_examples = 200 if args.quick else 2000
    result = measure(args)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    if not args.no_docs:
        DOC.write_text(render(result))
        print(f"wrote {DOC.relative_to(ROOT)}")
    for suite in ("faults", "security"):
        result[suite].pop("cases", None)
    print(json.dumps(result))
    ok = all(result[suite].get("exit_code") == 0 for suite in ("faults", "security")) and "error" not in result["load"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
