"""``inferline plan`` against ``inferline load`` on this machine: predicted and measured SLO attainment.

    .venv/bin/python bench/plan_vs_load.py [--quick] [--rates 0.4,1.2] [--duration 90] [--profile FILE]
                                           [--prompt-tokens uniform:32,96] [--output-tokens fixed:24]
                                           [--ttft-ms 1000] [--itl-ms 250] [--e2e-ms 3000] [--threads 1]

1. ``inferline serve`` as a subprocess with one pipeline, ``loadtest``: the chat pipeline whose ``generate``
   ignores EOS (every answer is exactly ``max_tokens`` long, so the workload is the one planned) and whose
   ``slo:`` is given by --ttft-ms, --itl-ms and --e2e-ms.
2. An untimed warm-up load (--warmup seconds at the highest rate): a fresh engine's first batches of each
   shape are slower than later ones. Then for each rate, one after the other: ``inferline profile smol``
   (unless --profile names one), the engine's step times measured then, while the server idles; then
   ``inferline load`` at that rate (Poisson arrivals, the same seed for every rate). A profile per rate,
   because what else runs on a shared machine changes from minute to minute, and a profile is only true of
   the minutes it was measured in.
   With --calibrate-rate, before the checked rates, a calibration rate (held out: it is not one of the rates
   checked) is loaded the same way; the server's mean ITL there over the plan's gives ``step_scale``, how
   much slower a serving process runs the engine's steps than the bare engine of the profile (its event
   loop, the streams and the load's own client share the two cores with it).
3. ``inferline plan`` for each rate's workload (same seed and duration: the same requests) on 1 replica,
   with that rate's profile (and the calibrated ``step_scale``, else 1).

Figures (the last line of stdout is one JSON object): per rate, the attainment of each objective and of all
of them, predicted and measured (the client's measurement), and the difference in percentage points;
``max_diff_pp`` the largest difference over rates for ``all``, and ``within_10pp`` whether every rate's
``all`` is within 10 points. The machine's load average before and after is included: other work on the
same cores slows the engine down after it was profiled, which the plan cannot know.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
EXE = Path(sys.executable).with_name("inferline")
PIPELINE = """
name: loadtest
description: Chat with answers of exactly max_tokens tokens (generate ignores EOS), for capacity checks.
slo: {{ttft_ms_p95: {ttft}, itl_ms_p95: {itl}, e2e_ms_p95: {e2e}}}
stages:
  - {{id: prompt, type: prompt, with: {{system: You are a helpful AI assistant.}}}}
  - {{id: tok, type: tokenize, with: {{max_input_tokens: 4096}}}}
  - {{id: gen, type: generate, with: {{max_tokens: 256, temperature: 0, ignore_eos: true}}}}
  - {{id: out, type: stream}}
  - {{id: log, type: audit, always: true}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(folder: Path, args: argparse.Namespace) -> Path:
    (folder / "pipelines").mkdir()
    (folder / "pipelines" / "loadtest.yaml").write_text(textwrap.dedent(PIPELINE.format(
        ttft=args.ttft_ms, itl=args.itl_ms, e2e=args.e2e_ms)))
    config = folder / "inferline.yaml"
    text = (ROOT / "inferline.yaml").read_text()
    text = (text.replace("source: models/", f"source: {ROOT}/models/")
            .replace("pipelines: pipelines/", f"pipelines: {folder}/pipelines/")
            .replace("database: sqlite:///inferline.db", f"database: sqlite:///{folder}/bench.db"))
    config.write_text(text)
    return config


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the profile and the server: the same torch thread count for both."""
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else dict(os.environ)


def run_profile(config: Path, out: Path, args: argparse.Namespace) -> None:
    command = [str(EXE), "profile", "smol", "--config", str(config), "--output", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=engine_env(args))


def start_server(config: Path, port: int, log: Any, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(EXE), "serve", "--config", str(config), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=engine_env(args))


def wait_ready(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"the server exited with {server.returncode}; the end of its log:\n{tail}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server was not ready after 180 s")


def stop_server(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()


def attainments(slo_report: dict[str, Any] | None) -> dict[str, float | None]:
    return {name: entry["attainment"] for name, entry in (slo_report or {}).items()}


def compare(rates: list[float], loads: list[dict[str, Any]], plan: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for rate, load, planned in zip(rates, loads, plan["rates"], strict=True):
        predicted = attainments(planned["tried"][-1]["attainment"])
        measured = attainments(load["slo"])
        diff = {name: None if predicted.get(name) is None or measured.get(name) is None
                else round((predicted[name] - measured[name]) * 100, 1) for name in measured}
        rows.append({"rate_rps": rate, "predicted": predicted, "measured": measured, "diff_pp": diff,
                     "server_measured": attainments(load.get("server_slo")),
                     "predicted_p95_ms": {k: planned["tried"][-1][k] for k in ("ttft_ms_p95", "itl_ms_p95",
                                                                                "e2e_ms_p95")},
                     "measured_p95_ms": {"ttft": load["ttft_ms"]["p95"], "itl": load["itl_ms"]["p95"],
                                         "e2e": load["e2e_ms"]["p95"]},
                     "predicted_busy": planned["tried"][-1]["busy"],
                     "requests": load["requests"], "achieved_rate_rps": load["achieved_rate_rps"],
                     "queue_depth": load.get("queue_depth"), "status": load["status"],
                     "loadavg_1m": load.get("loadavg_1m"),
                     "output_tokens_per_request": load["tokens"]["output_per_request"],
                     "cost_per_1k_requests_usd": {"predicted": planned["cost_per_1k_requests_usd"],
                                                  "measured": load["cost_usd"]["per_1k_requests"]}})
    return rows


async def drive(url: str, args: argparse.Namespace, rates: list[float]) -> list[dict[str, Any]]:
    from serving.capacity_cli import _tokenizer, load_command
    from serving.workload import Distribution

    tokenizer = _tokenizer(None, str(args.config_path))
    if args.warmup:  # untimed: the engine's first batches of each shape are slower (kernels, allocator)
        print(f"warm-up: {max(rates):g} req/s for {args.warmup:g} s (not measured) ...", file=sys.stderr, flush=True)
        await load_command(url, "loadtest", max(rates), args.warmup, Distribution.parse(args.prompt_tokens),
                           Distribution.parse(args.output_tokens), seed=args.seed + 1000, tokenizer=tokenizer,
                           drain_s=300)
    loads = []
    for index, rate in enumerate(rates):
        if not args.profile:
            print(f"profile: measuring smol before {rate:g} req/s ...", file=sys.stderr, flush=True)
            await asyncio.to_thread(run_profile, args.config_path, args.folder / f"profile-{index}.json", args)
        print(f"load: {rate:g} req/s for {args.duration:g} s ...", file=sys.stderr, flush=True)
        before = os.getloadavg()[0]
        loads.append(await load_command(url, "loadtest", rate, args.duration,
                                        Distribution.parse(args.prompt_tokens), Distribution.parse(args.output_tokens),
                                        seed=args.seed, tokenizer=tokenizer, drain_s=300))
        loads[-1]["loadavg_1m"] = [round(before, 2), round(os.getloadavg()[0], 2)]
        await asyncio.sleep(2)  # let the engine go idle between rates
    return loads


def measure(config: Path, args: argparse.Namespace, rates: list[float]) -> list[dict[str, Any]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(config.parent / "server.log", "wb") as log:
        server = start_server(config, port, log, args)
        try:
            wait_ready(url, server, config.parent / "server.log")
            loads = asyncio.run(drive(url, args, rates))
        finally:
            stop_server(server)
    return loads


def plan_for(config: Path, profiles: list[Path], rates: list[float], args: argparse.Namespace,
             step_scale: float = 1.0) -> dict[str, Any]:
    """One plan per rate, each with the profile measured just before that rate's load."""
    from serving.capacity_cli import plan_command
    from serving.wiring import open_workspace
    from serving.workload import WorkloadSpec

    workspace = open_workspace(str(config))
    loaded = workspace.load(workspace.resolve("loadtest"))
    plans = []
    for rate, profile in zip(rates, profiles, strict=True):
        workload = WorkloadSpec(pipeline="loadtest", rate=rate, prompt_tokens=args.prompt_tokens,
                                output_tokens=args.output_tokens, duration_s=args.duration, seed=args.seed)
        plans.append(plan_command(workspace, loaded, workload, profile_path=str(profile), replicas=1,
                                  overhead_ms=args.overhead_ms, step_scale=step_scale))
    return {**plans[0], "rates": [plan["rates"][0] for plan in plans]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="30 s per rate (a smoke run)")
    p.add_argument("--rates", default="0.4,1.2", help="requests per second, comma-separated (default 0.4,1.2)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per rate (default 90; --quick 30)")
    p.add_argument("--prompt-tokens", default="uniform:32,96")
    p.add_argument("--output-tokens", default="fixed:24")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--warmup", type=float, default=30.0,
                   help="seconds of untimed load at the highest rate before the first measurement (default 30)")
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--itl-ms", type=float, default=250.0)
    p.add_argument("--e2e-ms", type=float, default=3000.0)
    p.add_argument("--overhead-ms", type=float, help="the plan's time outside the engine (default: the profile's)")
    p.add_argument("--profile", help="a profile to use instead of measuring one now")
    p.add_argument("--calibrate-rate", type=float, default=0.0,
                   help="a rate measured first, apart from --rates, only to find the plan's step_scale: the server's "
                        "mean ITL there over the plan's at scale 1 (default 0: no calibration, scale 1; on a noisy "
                        "machine one short calibration load amplifies the noise)")
    p.add_argument("--step-scale", type=float, help="the plan's step_scale, instead of calibrating it")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the profile and the server (OMP_NUM_THREADS; default 1: on a small shared "
                        "machine it leaves a core to the server's event loop and the client, and keeps OpenMP from "
                        "waiting on a thread another process preempted; 0: torch's default)")
    p.add_argument("--loads", help="write the load reports and profiles here (JSON) once measured; with "
                                   "--replan, read them instead of running the server (to re-plan only)")
    p.add_argument("--replan", action="store_true", help="plan against the --loads file: no server, no load")
    return p


def main() -> int:
    args = parser().parse_args()
    args.duration = args.duration or (30.0 if args.quick else 90.0)
    rates = [float(r) for r in args.rates.split(",")]
    calibrate = args.step_scale is None and args.calibrate_rate > 0
    measured_rates = ([args.calibrate_rate] if calibrate else []) + rates
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="inferline-plan-vs-load-") as tmp:
        folder = Path(tmp)
        args.config_path = config = write_config(folder, args)
        args.folder = folder
        profiles = ([Path(args.profile)] * len(measured_rates) if args.profile else
                    [folder / f"profile-{i}.json" for i in range(len(measured_rates))])
        if args.replan:  # the loads and profiles of an earlier run
            saved = json.loads(Path(args.loads).read_text())
            loads = saved["loads"]
            for path, profile in zip(profiles, saved["profiles"], strict=True):
                path.write_text(json.dumps(profile))
        else:
            loads = measure(config, args, measured_rates)
            if args.loads:
                Path(args.loads).write_text(json.dumps({"loads": loads, "profiles": [
                    json.loads(path.read_text()) for path in profiles]}))
        step_scale, calibration = args.step_scale or 1.0, None
        if calibrate:  # the first rate is held out: it only measures how much slower the server steps
            base = plan_for(config, profiles[:1], measured_rates[:1], args)["rates"][0]["tried"][0]
            step_scale = round(loads[0]["itl_ms"]["mean"] / base["itl_ms_mean"], 3)
            calibration = {"rate_rps": args.calibrate_rate, "measured_itl_ms_mean": loads[0]["itl_ms"]["mean"],
                           "predicted_itl_ms_mean_unscaled": base["itl_ms_mean"], "step_scale": step_scale}
            loads, profiles = loads[1:], profiles[1:]
        plan = plan_for(config, profiles, rates, args, step_scale)
        measured = [json.loads(p.read_text()) for p in profiles]
    rows = compare(rates, loads, plan)
    diffs = [abs(row["diff_pp"]["all"]) for row in rows if row["diff_pp"].get("all") is not None]
    result = {"rates": rows, "max_diff_pp": max(diffs) if len(diffs) == len(rows) else None,
              "within_10pp": len(diffs) == len(rows) and all(d <= 10 for d in diffs),
              "step_scale": step_scale, "calibration": calibration,
              "slo": plan["slo"], "workload": plan["workload"], "overhead_ms": plan["overhead_ms"],
              "prompt_overhead_tokens": plan["prompt_overhead_tokens"],
              "profiles": [{"prefill": p["prefill"], "decode": p["decode"]} for p in measured],
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    for row in rows:
        print(f"{row['rate_rps']:g} req/s: attainment (all) predicted {row['predicted'].get('all')}, measured "
              f"{row['measured'].get('all')} ({row['diff_pp'].get('all')} pts); p95 ms predicted "
              f"{row['predicted_p95_ms']}, measured {row['measured_p95_ms']}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
