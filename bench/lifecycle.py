"""Hot reload under load: streaming clients on the chat pipeline while its file is rewritten, in one run
against the same clients without rewrites.

    .venv/bin/python bench/lifecycle.py [--quick] [--clients N] [--rewrites K] [--seconds S] [--max-tokens T]

One ``inferline serve`` (the default config and model, auth off, ``reload: {poll_s: 0.2}``) serves a copy
of ``pipelines/chat.yaml``. Each phase runs N (32; 8 with --quick) clients for S seconds (20; 8), each
sending streaming ``POST /pipelines/chat`` requests back to back (T max tokens, 16). The baseline phase
rewrites nothing; the reload phases rewrite the file K times in all (10; 4), evenly spaced, each time with a new
``version:`` label, so that each rewrite is a real change the server must validate, load and swap in.
The phases alternate baseline, reload, baseline, reload (the machine is noisy) and their requests pool.

Figures (the last line is one JSON object):
  failed_requests   requests of the reload phases that did not end in a ``done`` event (must be 0)
  ttft_p99_ratio    TTFT p99 of the reload phases / of the baseline phases (target at most 1.1)
  reload_ms_p50     the server's own time to validate, load and swap in one rewrite (its log), median
  versions_served   distinct ``pipeline_version`` values the reload phases' answers named (rewrites + 1
                    when every rewrite was served)
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds http.py, which would shadow the standard library's http package; the repository root
# must be importable (bench.server_process).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from bench.server_process import ROOT, ServerProcess

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What does a compiler do?",
             "Why is the sky blue?", "Give me a synonym for happy.", "What is 12 times 12?"]
RELOADED = re.compile(r"pipelines: reloaded chat from chat\.yaml in ([0-9.]+) ms")


@dataclass
class Phase:
    ttft_s: list[float] = field(default_factory=list)
    failed: int = 0
    completed: int = 0
    versions: set[str] = field(default_factory=set)


async def one_request(client: httpx.AsyncClient, question: str, max_tokens: int, phase: Phase) -> None:
    started = time.perf_counter()
    first: float | None = None
    done: dict | None = None
    try:
        async with client.stream("POST", "/pipelines/chat", json={"input": question, "stream": True,
                                                                   "max_tokens": max_tokens}) as response:
            event = ""
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                    if event == "delta" and first is None:
                        first = time.perf_counter()
                elif line.startswith("data: ") and event == "done":
                    done = json.loads(line[6:])
    except httpx.HTTPError:
        done = None
    if done is None:
        phase.failed += 1
        return
    phase.completed += 1
    phase.versions.add(done.get("pipeline_version", ""))
    phase.ttft_s.append((first or time.perf_counter()) - started)


async def client_loop(url: str, index: int, until: float, max_tokens: int, phase: Phase) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as client:
        n = index
        while time.perf_counter() < until:
            await one_request(client, QUESTIONS[n % len(QUESTIONS)], max_tokens, phase)
            n += 1


async def run_phase(url: str, chat: Path, original: str, args: argparse.Namespace, rewrites: int,
                    label: int) -> tuple[Phase, int]:
    phase = Phase()
    until = time.perf_counter() + args.seconds
    clients = [asyncio.create_task(client_loop(url, i, until, args.max_tokens, phase)) for i in range(args.clients)]
    for _ in range(rewrites):
        await asyncio.sleep(args.seconds / (rewrites + 1))
        label += 1
        chat.write_text(original.replace("name: chat", f"name: chat\nversion: 'bench-{label}'", 1))
    await asyncio.gather(*clients)
    return phase, label


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else (values[0] if values else 0.0)


async def main_async(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="inferline-lifecycle-") as tmp_name:
        tmp = Path(tmp_name)
        folder = tmp / "pipelines"
        folder.mkdir()
        original = (ROOT / "pipelines" / "chat.yaml").read_text()
        chat = folder / "chat.yaml"
        chat.write_text(original)
        server = ServerProcess.start(tmp / "server", auth=False, pipelines=folder,
                                     settings={"reload": {"watch": True, "poll_s": 0.2}})
        try:
            warm = Phase()
            await client_loop(server.url, 0, time.perf_counter() + 2, args.max_tokens, warm)  # kernels, caches
            baseline, reloading = Phase(), Phase()
            label = 0
            for _ in range(2):
                b, label = await run_phase(server.url, chat, original, args, 0, label)
                r, label = await run_phase(server.url, chat, original, args, args.rewrites // 2, label)
                for into, part in ((baseline, b), (reloading, r)):
                    into.ttft_s += part.ttft_s
                    into.failed += part.failed
                    into.completed += part.completed
                    into.versions |= part.versions
            await asyncio.sleep(1.0)  # the last rewrite's reload is logged
        finally:
            exit_code = server.stop()
        reload_ms = [float(ms) for ms in RELOADED.findall(server.log_path.read_text())]
    return {
        "failed_requests": reloading.failed,
        "ttft_p99_ratio": round(p99(reloading.ttft_s) / p99(baseline.ttft_s), 3),
        "reload_ms_p50": round(statistics.median(reload_ms), 2) if reload_ms else None,
        "reload_ms_max": round(max(reload_ms), 2) if reload_ms else None,
        "reloads_logged": len(reload_ms),
        "rewrites": args.rewrites // 2 * 2,
        "versions_served": len(reloading.versions),
        "baseline_failed_requests": baseline.failed,
        "baseline_requests": baseline.completed, "reload_requests": reloading.completed,
        "baseline_ttft_ms_p50": round(statistics.median(baseline.ttft_s) * 1e3, 1),
        "reload_ttft_ms_p50": round(statistics.median(reloading.ttft_s) * 1e3, 1),
        "baseline_ttft_ms_p99": round(p99(baseline.ttft_s) * 1e3, 1),
        "reload_ttft_ms_p99": round(p99(reloading.ttft_s) * 1e3, 1),
        "clients": args.clients, "seconds_per_phase": args.seconds, "max_tokens": args.max_tokens,
        "server_exit_code": exit_code,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 clients, 8 s phases, 4 rewrites unless given")
    p.add_argument("--clients", type=int, help="concurrent streaming clients (default 32; --quick 8)")
    p.add_argument("--seconds", type=float, help="length of each phase (default 20; --quick 8)")
    p.add_argument("--rewrites", type=int, help="rewrites in all, half in each reload phase (default 10; --quick 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens per request (default 16)")
    return p


def main() -> None:
    args = parser().parse_args()
    args.clients = args.clients or (8 if args.quick else 32)
    args.seconds = args.seconds or (8.0 if args.quick else 20.0)
    args.rewrites = args.rewrites or (4 if args.quick else 10)
    result = asyncio.run(main_async(args))
    print(f"reload phases: {result['failed_requests']} failed of {result['reload_requests']}; TTFT p99 "
          f"{result['reload_ttft_ms_p99']} ms against {result['baseline_ttft_ms_p99']} ms without rewrites "
          f"({result['ttft_p99_ratio']}x); reload p50 {result['reload_ms_p50']} ms over {result['reloads_logged']} "
          f"reloads; {result['versions_served']} versions served", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
