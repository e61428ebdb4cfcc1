"""``inferline plan`` against ``inferline load`` on this machine: predicted and measured SLO attainment.

    .venv/bin/python bench/plan_vs_load.py [--quick] [--rates auto|0.4,1.2] [--duration 90] [--profile FILE]
                                           [--prompt-tokens uniform:32,96] [--output-tokens fixed:24]
                                           [--slo auto|TTFT,ITL,E2E] [--threads 1]

0. Unless --rates and --slo are both given, the engine is profiled first (the server not yet started) and
   the check is scaled to this machine, whose speed differs from one machine to the next by several times:
   * the SLO (``--slo auto``): ``--slo-headroom`` (default 2) times what a lone request of the largest prompt
     and the output length would see (its TTFT, its inter-token latency, its end-to-end time), so that an idle
     server meets every objective and a loaded one misses some;
   * the rates (``--rates auto``): ``--rate-fractions`` (default 0.35,0.75) of the rate at which the planned
     replica is busy stepping 90% of the time: one light load and one near capacity.
   Fixed rates and targets on a machine of another speed put every request on the same side of a target
   (attainment 0% or 100% both predicted and measured: a check that cannot fail), or a target at the median
   of the light load's latencies, where a few percent of step time move the attainment by tens of points.

1. ``inferline serve`` as a subprocess with one pipeline, ``loadtest``: the chat pipeline whose ``generate``
   ignores EOS (every answer is exactly ``max_tokens`` long, so the workload is the one planned) and whose
   ``slo:`` is --slo's (or step 0's).
2. An untimed warm-up load (--warmup seconds at the highest rate): a fresh engine's first batches of each
   shape are slower than later ones. Then for each rate, one after the other: ``inferline profile smol``
   (unless --profile names one), the engine's step times measured then, while the server idles; then
   ``inferline load`` at that rate (Poisson arrivals, a seed of its own for each rate: with one seed for all,
   a later rate would send the very prompts of an earlier one, and find them in the server's prefix cache,
   which the plan rightly does not assume; measured: TTFT p95 655 ms at 0.71 req/s after 840 at 0.33).
   A profile per rate,
   because what else runs on a shared machine changes from minute to minute, and a profile is only true of
   the minutes it was measured in.
   With --calibrate-rate, before the checked rates, a calibration rate (held out: it is not one of the rates
   checked) is loaded the same way; the server's mean ITL there over the plan's gives ``step_scale``, how
   much slower a serving process runs the engine's steps than the bare engine of the profile (its event
   loop, the streams and the load's own client share the two cores with it).
3. ``inferline plan`` for each rate's workload (same seed and duration: the same requests) on 1 replica,
   with that rate's profile (and the calibrated ``step_scale``, else 1).

Figures (the last line of stdout is one JSON object): ``auto`` (how the SLO and the rates were derived, when
they were), per rate, the attainment of each objective and of all
of them, predicted and measured (the client's measurement), and the difference in percentage points;
``max_diff_pp`` the largest difference over rates for ``all``, and ``within_10pp`` whether every rate's
``all`` is within 10 points. ``predicted_all_if_steps``: the plan's attainment of all objectives with every
step 5% faster and 5% slower than the profile, how far the prediction moves with the machine's speed. The
machine's load average before and after is included: other work on the same cores slows the engine down
after it was profiled, which the plan cannot know. Per rate,
``decode_steps`` sets the server's own decode steps during the load (``inferline_decode_step_seconds``
in /metrics) against the profile's step at the same mean batch (``served_vs_profile`` > 1: the server
stepped slower than its profile said), and ``steps`` sets both kinds of step the server ran (``prefill``:
steps that computed prompt tokens, decodes riding along; ``decode``) against those the plan simulated for
the same requests: their counts, mean times and mean decode rows (``served_vs_plan`` > 1: the server's
steps of that kind took longer than the plan's). A plan pessimistic through TTFT with its decode steps
matching shows here whether its prefill steps are the ones too long, or too many. ``profiles`` holds each
profile's prefill, decode and mixed steps and the small-batch kernel's row limits its process measured
(``small_rows``, ``head_small_rows``), beside ``server_small_rows``, the server's own (from its log): a step's
time jumps where its rows cross the limit, and two processes can measure it apart near the crossover.
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
import re
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
#: The system text makes the template's shared part exactly one KV block (16 tokens with SmolLM2's template),
#: so that the user's text starts a block of its own. With "You are a helpful AI assistant." (15 tokens) the
#: first block held the template and the user's first word, one of the load's ~100 common words: after a few
#: dozen requests most prompts found that block in the server's prefix cache, which the plan (whole blocks of
#: the template only) did not count: the served prefill steps took 0.82-0.91x the planned (runs 24-25,
#: docs/capacity.md), and the plan was pessimistic through TTFT.
PIPELINE = """
name: loadtest
description: Chat with answers of exactly max_tokens tokens (generate ignores EOS), for capacity checks.
slo: {{ttft_ms_p95: {ttft}, itl_ms_p95: {itl}, e2e_ms_p95: {e2e}}}
stages:
  - {{id: prompt, type: prompt, with: {{system: 'You are a concise, helpful assistant.'}}}}
  - {{id: tok, type: tokenize, with: {{max_input_tokens: 4096}}}}
  - {{id: gen, type: generate, with: {{max_tokens: 256, temperature: 0, ignore_eos: true}}}}
  - {{id: out, type: stream}}
  - {{id: log, type: audit, always: true}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(folder: Path, slo: dict[str, float]) -> Path:
    (folder / "pipelines").mkdir(exist_ok=True)
    write_pipeline(folder, slo)
    config = folder / "inferline.yaml"
    text = (ROOT / "inferline.yaml").read_text()
    text = (text.replace("source: models/", f"source: {ROOT}/models/")
            .replace("pipelines: pipelines/", f"pipelines: {folder}/pipelines/")
            .replace("database: sqlite:///inferline.db", f"database: sqlite:///{folder}/bench.db"))
    config.write_text(text)
    return config


def write_pipeline(folder: Path, slo: dict[str, float]) -> None:
    (folder / "pipelines" / "loadtest.yaml").write_text(textwrap.dedent(PIPELINE.format(
        ttft=slo["ttft_ms_p95"], itl=slo["itl_ms_p95"], e2e=slo["e2e_ms_p95"])))


def parse_slo(text: str) -> dict[str, float]:
    ttft, itl, e2e = (float(x) for x in text.split(","))
    return {"ttft_ms_p95": ttft, "itl_ms_p95": itl, "e2e_ms_p95": e2e}


def workload_at(rate: float, args: argparse.Namespace) -> Any:
    from serving.capacity.workload import WorkloadSpec

    return WorkloadSpec(pipeline="loadtest", rate=rate, prompt_tokens=args.prompt_tokens,
                        output_tokens=args.output_tokens, duration_s=args.duration, seed=seed_for(rate, args))


def seed_for(rate: float, args: argparse.Namespace) -> int:
    """The seed of one rate's requests, for both load and plan: other rates send other prompts."""
    return args.seed + round(rate * 1000)


def machine_relative(config: Path, profile_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The SLO and the rates scaled to this machine, from a profile (module docstring, step 0)."""
    import random

    from serving.capacity.pipeline_plan import cached_prefix, pipeline_model, plan_pipeline, prompt_overhead
    from serving.capacity.step_profile import StepModel
    from serving.capacity.workload import Distribution
    from serving.runtime.workspace import open_workspace

    workspace = open_workspace(str(config))
    loaded = workspace.load_pipeline(workspace.resolve("loadtest"))
    profile = json.loads(profile_path.read_text())
    model = StepModel(profile)
    name = pipeline_model(workspace, loaded)
    overhead, shared = prompt_overhead(workspace, loaded, name)
    rng = random.Random(args.seed)
    prompt = max(Distribution.parse(args.prompt_tokens).sample(rng) for _ in range(2000))
    output = max(Distribution.parse(args.output_tokens).sample(rng) for _ in range(2000))
    cached = cached_prefix(profile, shared, workspace.server.models[name].kv_cache.block_size)
    ttft = model.prefill_ms(prompt + overhead - cached)
    itl = model.decode_ms(1) / model.tokens_per_step(1)
    lone = {"prompt_tokens": prompt, "output_tokens": output, "ttft_ms": round(ttft, 1), "itl_ms": round(itl, 1),
            "e2e_ms": round(ttft + (output - 1) * itl, 1)}
    slo = {f"{name}_ms_p95": round(args.slo_headroom * lone[f"{name}_ms"]) for name in ("ttft", "itl", "e2e")}

    def busy(rate: float) -> float:
        plan = plan_pipeline(workspace, loaded, workload_at(rate, args), profile_path=str(profile_path), replicas=1,
                            overhead_ms=0.0, step_scale=1.0)
        return plan["rates"][0]["tried"][-1]["busy"]

    low, high = 0.0, 0.25
    while busy(high) < 0.9 and high < 1000:
        low, high = high, high * 2
    for _ in range(10):  # to about 0.1% of the rate
        middle = (low + high) / 2
        low, high = (middle, high) if busy(middle) < 0.9 else (low, middle)
    saturation = round(high, 4)
    fractions = [float(f) for f in args.rate_fractions.split(",")]
    return {"lone_request": lone, "slo_headroom": args.slo_headroom, "slo": slo,
            "rate_at_90pct_busy": saturation, "rate_fractions": fractions,
            "rates": [round(f * saturation, 3) for f in fractions]}


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


def served_steps(load: dict[str, Any], profile: dict[str, Any]) -> dict[str, Any] | None:
    """The server's decode steps during the load (``engine_steps``, from /metrics) against the profile's
    decode step at the same mean batch: a ratio above 1 is the server stepping slower than the profile,
    which the plan cannot know (another job on the cores, the event loop's share of them)."""
    decode = (load.get("engine_steps") or {}).get("decode") or {}
    if not decode.get("steps") or decode.get("mean_batch") is None:
        return None
    from serving.capacity.step_profile import StepModel

    profiled = StepModel(profile).decode_ms(decode["mean_batch"])
    return {"decode_steps": decode["steps"], "mean_batch": decode["mean_batch"], "served_ms": decode["mean_ms"],
            "profile_ms": round(profiled, 2), "served_vs_profile": round(decode["mean_ms"] / profiled, 3)}


def steps_against_plan(load: dict[str, Any], planned: dict[str, Any]) -> dict[str, Any] | None:
    """Each kind of step, served (``engine_steps`` of the load) against planned (the simulation's)."""
    served, simulated = load.get("engine_steps"), planned.get("steps")
    if not served or not simulated:
        return None
    out = {}
    for kind in ("prefill", "decode"):
        ours, plan = served.get(kind) or {}, simulated.get(kind) or {}
        ratio = None
        if ours.get("mean_ms") and plan.get("mean_ms"):
            ratio = round(ours["mean_ms"] / plan["mean_ms"], 3)
        out[kind] = {"served": ours, "planned": plan, "served_vs_plan": ratio}
    return out


def compare(rates: list[float], loads: list[dict[str, Any]], plan: dict[str, Any],
            profiles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for rate, load, planned, profile in zip(rates, loads, plan["rates"], profiles, strict=True):
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
                     "predicted_all_if_steps": planned["tried"][-1].get("attainment_if_steps"),
                     "requests": load["requests"], "achieved_rate_rps": load["achieved_rate_rps"],
                     "queue_depth": load.get("queue_depth"), "status": load["status"],
                     "loadavg_1m": load.get("loadavg_1m"), "decode_steps": served_steps(load, profile),
                     "steps": steps_against_plan(load, planned["tried"][-1]),
                     "output_tokens_per_request": load["tokens"]["output_per_request"],
                     "cost_per_1k_requests_usd": {"predicted": planned["cost_per_1k_requests_usd"],
                                                  "measured": load["cost_usd"]["per_1k_requests"]}})
    return rows


async def drive(url: str, args: argparse.Namespace, rates: list[float]) -> list[dict[str, Any]]:
    from serving.capacity.loadgen import load_server, local_tokenizer
    from serving.capacity.workload import Distribution

    tokenizer = local_tokenizer(None, str(args.config_path))
    if args.warmup:  # untimed: the engine's first batches of each shape are slower (kernels, allocator)
        print(f"warm-up: {max(rates):g} req/s for {args.warmup:g} s (not measured) ...", file=sys.stderr, flush=True)
        await load_server(url, "loadtest", max(rates), args.warmup, Distribution.parse(args.prompt_tokens),
                           Distribution.parse(args.output_tokens), seed=args.seed - 1, tokenizer=tokenizer,
                           drain_s=300)
    loads = []
    for index, rate in enumerate(rates):
        if not args.profile:
            print(f"profile: measuring smol before {rate:g} req/s ...", file=sys.stderr, flush=True)
            await asyncio.to_thread(run_profile, args.config_path, args.folder / f"profile-{index}.json", args)
        print(f"load: {rate:g} req/s for {args.duration:g} s ...", file=sys.stderr, flush=True)
        before = os.getloadavg()[0]
        loads.append(await load_server(url, "loadtest", rate, args.duration,
                                        Distribution.parse(args.prompt_tokens), Distribution.parse(args.output_tokens),
                                        seed=seed_for(rate, args), tokenizer=tokenizer, drain_s=300))
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


def server_small_rows(log: Path) -> dict[str, int]:
    """The small-batch kernel's row limits the server's start-up measured (its log), to set beside each
    profile's (``engine.small_rows``, ``engine.head_small_rows``): a step's time jumps where its rows cross
    the limit, so a profile whose process measured another limit times another engine."""
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        if match := re.search(r"small-batch kernel up to (\d+) rows for (the layers|the \d+ x \d+ matmul)", line):
            found["small_rows" if match.group(2) == "the layers" else "head_small_rows"] = int(match.group(1))
    return found


def plan_for(config: Path, profiles: list[Path], rates: list[float], args: argparse.Namespace,
             step_scale: float = 1.0) -> dict[str, Any]:
    """One plan per rate, each with the profile measured just before that rate's load."""
    from serving.capacity.pipeline_plan import plan_pipeline
    from serving.runtime.workspace import open_workspace

    workspace = open_workspace(str(config))
    loaded = workspace.load_pipeline(workspace.resolve("loadtest"))
    plans = []
    for rate, profile in zip(rates, profiles, strict=True):
        plans.append(plan_pipeline(workspace, loaded, workload_at(rate, args), profile_path=str(profile), replicas=1,
                                  overhead_ms=args.overhead_ms, step_scale=step_scale))
    return {**plans[0], "rates": [plan["rates"][0] for plan in plans]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="30 s per rate (a smoke run)")
    p.add_argument("--rates", default="auto",
                   help="requests per second, comma-separated, or auto: --rate-fractions of the rate at which the "
                        "first profile's planned replica is 90%% busy (default auto)")
    p.add_argument("--rate-fractions", default="0.35,0.75", help="with --rates auto (default 0.35,0.75)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per rate (default 90; --quick 30)")
    p.add_argument("--prompt-tokens", default="uniform:32,96")
    p.add_argument("--output-tokens", default="fixed:24")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--warmup", type=float, default=30.0,
                   help="seconds of untimed load at the highest rate before the first measurement (default 30)")
    p.add_argument("--slo", default="auto",
                   help="the pipeline's ttft, itl and e2e p95 targets in ms (e.g. 1000,250,3000), or auto: "
                        "--slo-headroom times a lone request's figures in the first profile (default auto)")
    p.add_argument("--slo-headroom", type=float, default=2.0, help="with --slo auto (default 2)")
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
    p = parser()
    args = p.parse_args()
    args.duration = args.duration or (30.0 if args.quick else 90.0)
    if args.replan and (not args.loads or args.profile):
        p.error("--replan plans with the profiles saved in --loads FILE (and takes no --profile)")
    saved = json.loads(Path(args.loads).read_text()) if args.replan else None
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="inferline-plan-vs-load-") as tmp:
        folder = Path(tmp)
        args.folder = folder
        if saved:  # the SLO and the rates that run used
            slo, rates, auto = saved["slo"], saved["rates"], saved.get("auto")
        else:
            slo = None if args.slo == "auto" else parse_slo(args.slo)
            rates = None if args.rates == "auto" else [float(r) for r in args.rates.split(",")]
            auto = None
        args.config_path = config = write_config(folder, slo or parse_slo("1000,250,3000"))
        if slo is None or rates is None:
            first = Path(args.profile) if args.profile else folder / "profile-scale.json"
            if not args.profile:
                print("profile: measuring smol to scale the SLO and the rates to this machine ...", file=sys.stderr,
                      flush=True)
                run_profile(config, first, args)
            auto = machine_relative(config, first, args)
            slo, rates = slo or auto["slo"], rates or auto["rates"]
            write_pipeline(folder, slo)
            print(f"scaled to this machine: slo {slo}, rates {rates} req/s "
                  f"({auto['rate_fractions']} of {auto['rate_at_90pct_busy']:g}, where the plan is 90% busy)",
                  file=sys.stderr, flush=True)
        calibrate = args.step_scale is None and args.calibrate_rate > 0
        measured_rates = ([args.calibrate_rate] if calibrate else []) + rates
        profiles = ([Path(args.profile)] * len(measured_rates) if args.profile else
                    [folder / f"profile-{i}.json" for i in range(len(measured_rates))])
        if saved:  # the loads and profiles of an earlier run
            loads, small_rows = saved["loads"], saved.get("server_small_rows")
            for path, profile in zip(profiles, saved["profiles"], strict=True):
                path.write_text(json.dumps(profile))
        else:
            loads = measure(config, args, measured_rates)
            small_rows = server_small_rows(config.parent / "server.log")
            if args.loads:
                Path(args.loads).write_text(json.dumps({"loads": loads, "slo": slo, "rates": rates, "auto": auto,
                                                        "server_small_rows": small_rows,
                                                        "profiles": [json.loads(path.read_text())
                                                                     for path in profiles]}))
        step_scale, calibration = args.step_scale or 1.0, None
        if calibrate:  # the first rate is held out: it only measures how much slower the server steps
            base = plan_for(config, profiles[:1], measured_rates[:1], args)["rates"][0]["tried"][0]
            step_scale = round(loads[0]["itl_ms"]["mean"] / base["itl_ms_mean"], 3)
            calibration = {"rate_rps": args.calibrate_rate, "measured_itl_ms_mean": loads[0]["itl_ms"]["mean"],
                           "predicted_itl_ms_mean_unscaled": base["itl_ms_mean"], "step_scale": step_scale}
            loads, profiles = loads[1:], profiles[1:]
        plan = plan_for(config, profiles, rates, args, step_scale)
        measured = [json.loads(p.read_text()) for p in profiles]
    rows = compare(rates, loads, plan, measured)
    diffs = [abs(row["diff_pp"]["all"]) for row in rows if row["diff_pp"].get("all") is not None]
    result = {"auto": auto, "rates": rows, "max_diff_pp": max(diffs) if len(diffs) == len(rows) else None,
              "within_10pp": len(diffs) == len(rows) and all(d <= 10 for d in diffs),
              "step_scale": step_scale, "calibration": calibration,
              "slo": plan["slo"], "workload": plan["workload"], "overhead_ms": plan["overhead_ms"],
              "prompt_overhead_tokens": plan["prompt_overhead_tokens"],
              "profiles": [{"prefill": p["prefill"], "decode": p["decode"], "mixed": p.get("mixed"),
                            "small_rows": {k: v for k, v in p.get("engine", {}).items() if "small_rows" in k}}
                           for p in measured],
              "server_small_rows": small_rows,
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    for row in rows:
        band = row["predicted_all_if_steps"] or {}
        print(f"{row['rate_rps']:g} req/s: attainment (all) predicted {row['predicted'].get('all')} "
              f"({band.get('faster_5pct')} / {band.get('slower_5pct')} with steps 5% faster / slower), measured "
              f"{row['measured'].get('all')} ({row['diff_pp'].get('all')} pts); p95 ms predicted "
              f"{row['predicted_p95_ms']}, measured {row['measured_p95_ms']}; served decode steps "
              f"{row['decode_steps']}; steps served against planned {row['steps']}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
