"""``inferline load``, ``inferline profile`` and ``inferline plan``: capacity, measured and predicted.

    inferline profile smol                                   # -> profiles/smol.json
    inferline plan --workload workloads/chat.yaml            # replicas and cost per 1,000 requests
    inferline load chat --rate 1 --duration 60 --prompt-tokens uniform:32,96 --output-tokens fixed:32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from serving.capacity.loadgen import load_server, local_tokenizer
from serving.capacity.pipeline_plan import plan_pipeline
from serving.capacity.workload import Distribution, load_workload
from serving.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Subcommands
from serving.runtime.workspace import open_workspace


def add_capacity_parser(sub: Subcommands) -> None:
    load = sub.add_parser(
        "load", help="drive a live server with open-loop Poisson arrivals; SLO attainment, throughput, queue, cost",
        description="Send requests to POST /pipelines/PIPELINE of a running server at Poisson arrival times "
                    "(open loop: no request waits for an earlier answer), streamed, each a synthetic user message "
                    "of --prompt-tokens tokens with max_tokens from --output-tokens. Reports the achieved rate, "
                    "throughput, latency percentiles, the attainment of the pipeline's slo: (from GET "
                    "/pipelines/PIPELINE, as the client measured it and as the server counted it), the engine's "
                    "queue depth and step times (/metrics) and cost per request. The JSON report is the last line "
                    "of stdout.",
        epilog="Distributions: fixed:N (or N), uniform:LOW,HIGH, normal:MEAN,SD, lognormal:MEDIAN,SIGMA, "
               "exponential:MEAN. Example: inferline load chat --rate 1 --duration 60 --prompt-tokens "
               "uniform:32,96 --output-tokens fixed:32")
    load.add_argument("pipeline", metavar="PIPELINE", help="the pipeline's name on the server")
    load.add_argument("--rate", type=float, required=True, metavar="R", help="mean arrivals per second")
    load.add_argument("--duration", type=float, required=True, metavar="D", help="seconds of arrivals")
    load.add_argument("--prompt-tokens", required=True, metavar="DIST", help="user-message length, in tokens")
    load.add_argument("--output-tokens", required=True, metavar="DIST", help="max_tokens of each request")
    load.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    load.add_argument("--seed", type=int, default=0,
                      help="arrivals, sizes and prompt texts (default 0; plan's seed: to compare). A second run "
                           "with the same seed against the same server sends the same prompts, which its prefix "
                           "cache then holds: change the seed between runs")
    load.add_argument("--api-key", default=os.environ.get("INFERLINE_API_KEY"),
                      help="bearer key for the pipeline (default $INFERLINE_API_KEY)")
    load.add_argument("--metrics-key", default=os.environ.get("INFERLINE_METRICS_KEY"),
                      help="bearer key with the auditor role for /metrics (default $INFERLINE_METRICS_KEY, "
                           "else --api-key)")
    load.add_argument("--drain", type=float, default=120.0, metavar="S",
                      help="after the last arrival, wait this long for answers (default 120)")
    load.add_argument("--tokenizer", metavar="FOLDER", help="the model's tokenizer folder, to size prompts "
                      "(default: the config's first local model; without one, a word per token)")
    load.add_argument("--config", "-c", metavar="FILE", help="server config, for the tokenizer")
    load.set_defaults(handler=_load)

    profile = sub.add_parser(
        "profile", help="measure a model's engine: prefill and decode step times at each batch size",
        description="Load MODEL's engine as `inferline serve` would (same dtype, threads, KV cache, speculative "
                    "decoding) and time single steps: prefills of 16..512 new tokens, and decode steps of 1, 2, 4 "
                    "... sequences, and steps mixing both; where the engine's small-batch kernel stops (its row "
                    "limit, measured at start-up), prefills and mixed steps just below and above it too. Writes the "
                    "profile JSON that `inferline plan` reads.",
        epilog="Example: inferline profile smol --output profiles/smol.json")
    profile.add_argument("model", metavar="MODEL", help="a local model of the config (models: in inferline.yaml)")
    profile.add_argument("--output", "-o", metavar="FILE", help="where to write it (default profiles/MODEL.json)")
    profile.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="decode batch sizes (default 1,2,4,8,16,32)")
    profile.add_argument("--prefill-sizes", default="16,64,128,256,512",
                         help="prefill chunk sizes in tokens (default 16,64,128,256,512)")
    profile.add_argument("--repeats", type=int, default=3, help="prefill repeats per size (default 3)")
    profile.add_argument("--decode-steps", type=int, default=24, help="timed decode steps per batch size (default 24)")
    profile.add_argument("--passes", type=int, default=2,
                         help="sweeps over all sizes, their samples pooled (default 2): noise from other work on the "
                              "machine then spreads over every size")
    profile.add_argument("--config", "-c", metavar="FILE", help="server config (default ./inferline.yaml)")
    profile.set_defaults(handler=_profile)

    plan = sub.add_parser(
        "plan", help="replicas needed to meet a pipeline's SLOs at a request rate, and cost per 1,000 requests",
        description="Simulate the workload (Poisson arrivals, token distributions) on N replicas of the pipeline's "
                    "engine, step by step as its scheduler batches them, with step times from the model's profile; "
                    "judge every simulated request against the pipeline's slo:, and report the fewest replicas at "
                    "which every objective holds, and the cost per 1,000 requests. See docs/capacity.md.",
        epilog="Example: inferline plan --workload workloads/chat.yaml --json")
    plan.add_argument("--workload", "-w", required=True, metavar="FILE", help="the workload (YAML)")
    plan.add_argument("--profile", "-p", metavar="FILE", help="the model's profile (default: the workload's "
                      "profile:, else profiles/MODEL.json)")
    plan.add_argument("--replicas", type=int, metavar="N", help="predict at N replicas only")
    plan.add_argument("--overhead-ms", type=float, metavar="MS",
                      help="time outside the engine per request (default: the profile's overhead_ms, else 0)")
    plan.add_argument("--step-scale", type=float, metavar="F",
                      help="how much slower the server runs engine steps than the profile measured them (default: "
                           "the profile's step_scale, else 1): calibrate it once with `inferline load` at a low rate, "
                           "as its mean ITL over the plan's (docs/capacity.md)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object on the last line")
    plan.add_argument("--config", "-c", metavar="FILE", help="server config (default ./inferline.yaml)")
    plan.set_defaults(handler=_plan)


# -- load ----------------------------------------------------------------------


def _load(args: argparse.Namespace) -> int:
    try:
        prompt, output = Distribution.parse(args.prompt_tokens), Distribution.parse(args.output_tokens)
    except ValueError as exc:
        print(f"inferline load: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.rate <= 0 or args.duration <= 0:
        print("inferline load: --rate and --duration must be positive", file=sys.stderr)
        return EXIT_USAGE
    tokenizer = local_tokenizer(args.tokenizer, args.config)
    result = asyncio.run(load_server(args.url, args.pipeline, args.rate, args.duration, prompt, output,
                                      seed=args.seed, api_key=args.api_key, metrics_key=args.metrics_key,
                                      drain_s=args.drain, tokenizer=tokenizer))
    _print_load(result)
    print(json.dumps(result))
    return EXIT_OK if result["completed"] else EXIT_FAILED


def _print_load(r: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"{r['pipeline']}: {r['requests']} requests at {r['target_rate_rps']}/s for {r['duration_s']:g} s "
          f"(achieved {r['achieved_rate_rps']}/s, send lag p99 {r['send_lag_ms_p99']} ms); {r['completed']} "
          f"completed, status {r['status']}", file=err)
    print(f"  throughput {r['throughput_rps']} req/s, {r['output_tok_s']} output tok/s; ttft p50/p95 "
          f"{r['ttft_ms']['p50']}/{r['ttft_ms']['p95']} ms, itl {r['itl_ms']['p50']}/{r['itl_ms']['p95']} ms, e2e "
          f"{r['e2e_ms']['p50']}/{r['e2e_ms']['p95']} ms", file=err)
    queue = r.get("queue_depth") or {}
    print(f"  queue depth mean {queue.get('mean')} max {queue.get('max')}; tokens {r['tokens']}; cost per request "
          f"{r['cost_usd']['per_request']} USD", file=err)
    steps = r.get("engine_steps")
    if steps:
        decode, prefill = steps["decode"], steps["prefill"]
        print(f"  engine steps: {decode['steps']} decode (mean {decode['mean_ms']} ms at a mean batch of "
              f"{decode['mean_batch']}), {prefill['steps']} with prompt tokens (mean {prefill['mean_ms']} ms)",
              file=err)
    for name, entry in (r.get("slo") or {}).items():
        print(f"  slo {name}: attainment {entry['attainment']} ({entry['met']}/{entry['judged']})"
              + (f", observed {entry['observed']} vs {entry['target']}" if "target" in entry else ""), file=err)


# -- profile -------------------------------------------------------------------


def _profile(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from serving.capacity.step_profile import profile_model

    workspace = open_workspace(args.config)
    spec = workspace.server.models.get(args.model)
    if spec is None or spec.backend != "local":
        local = sorted(n for n, m in workspace.server.models.items() if m.backend == "local")
        print(f"inferline profile: {args.model!r} is not a local model of the config (local models: "
              f"{', '.join(local) or 'none'})", file=sys.stderr)
        return EXIT_FAILED
    print(f"profiling {args.model}...", file=sys.stderr)
    profile = profile_model(workspace, args.model, batch_sizes=[int(x) for x in args.batch_sizes.split(",")],
                            prefill_sizes=[int(x) for x in args.prefill_sizes.split(",")], repeats=args.repeats,
                            decode_steps=args.decode_steps, passes=args.passes)
    out = Path(args.output or f"profiles/{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    pre = profile["prefill"]
    print(f"{profile['device']}, {profile['dtype']}, speculative {profile['engine']['speculative']}: prefill "
          f"{pre['base_ms']:.1f} ms + {pre['per_token_ms']:.3f} ms/token; decode step ms by batch: "
          + ", ".join(f"{d['batch']}: {d['step_ms']:.1f} ({d['tokens_per_step']:.2f} tok/seq)"
                      for d in profile["decode"]), file=sys.stderr)
    print(f"wrote {out}")
    return EXIT_OK


# -- plan ----------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> int:
    workload = load_workload(args.workload)
    workspace = open_workspace(args.config)
    loaded = workspace.load_pipeline(workspace.resolve(workload.pipeline))
    if args.step_scale is not None and args.step_scale <= 0:
        print("inferline plan: --step-scale must be positive", file=sys.stderr)
        return EXIT_USAGE
    result = plan_pipeline(workspace, loaded, workload, profile_path=args.profile, replicas=args.replicas,
                          overhead_ms=args.overhead_ms, step_scale=args.step_scale, workload_file=args.workload)
    _print_plan(result)
    if args.json:
        print(json.dumps(result))
    return EXIT_OK


def _print_plan(result: dict[str, Any]) -> None:
    print(f"{result['pipeline']} on {result['model']} (profile {result['profile']}), slo {result['slo']}, "
          f"prompt {result['workload']['prompt_tokens']} + {result['prompt_overhead_tokens']} tokens, "
          f"output {result['workload']['output_tokens']}", file=sys.stderr)
    for rate in result["rates"]:
        best = rate["tried"][-1]
        needed = rate["replicas_needed"]
        head = f"  {rate['rate_rps']:g} req/s: " + (f"{needed} replica(s)" if needed else
                                                    f"SLO not met with {best['replicas']} replica(s)")
        attained = ", ".join(f"{k} {v['attainment']}" for k, v in best["attainment"].items())
        band = best.get("attainment_if_steps")
        if band:
            attained += " (all: " + ", ".join(f"{v} if steps run {k.split('_')[1].removesuffix('pct')}% "
                                              f"{k.split('_')[0]}" for k, v in band.items()) + ")"
        print(f"{head}; busy {best['busy']}, p95 ttft {best['ttft_ms_p95']} ms, itl {best['itl_ms_p95']} ms, "
              f"e2e {best['e2e_ms_p95']} ms; attainment {attained or '-'}; "
              f"{rate['cost_per_1k_requests_usd']} USD per 1,000 requests", file=sys.stderr)


