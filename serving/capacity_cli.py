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

from pipeline.errors import SpecError, SpecIssue
from pipeline.loader import LoadedPipeline
from pipeline.spec import SLOSpec
from serving.wiring import Workspace, open_workspace
from serving.workload import Distribution, load_workload, requests_for

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_capacity_parsers(sub: Any) -> None:
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
    tokenizer = _tokenizer(args.tokenizer, args.config)
    result = asyncio.run(load_command(args.url, args.pipeline, args.rate, args.duration, prompt, output,
                                      seed=args.seed, api_key=args.api_key, metrics_key=args.metrics_key,
                                      drain_s=args.drain, tokenizer=tokenizer))
    _print_load(result)
    print(json.dumps(result))
    return EXIT_OK if result["completed"] else EXIT_FAILED


async def load_command(url: str, pipeline: str, rate: float, duration_s: float, prompt: Distribution,
                       output: Distribution, *, seed: int = 0, api_key: str | None = None,
                       metrics_key: str | None = None, drain_s: float = 120.0, tokenizer: Any = None) -> dict[str, Any]:
    """The whole ``inferline load`` run: the pipeline's SLO from the server, the requests, the report."""
    import random

    import httpx

    from serving.load import run_load, synthetic_text

    requests = requests_for(rate, duration_s, prompt, output, seed)
    texts = [synthetic_text(tokenizer, r.prompt_tokens, random.Random(seed * 1_000_003 + r.index)) for r in requests]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(drain_s + duration_s, connect=30.0)
    metrics_headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else headers
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout,
                                 trust_env=False) as client, \
            httpx.AsyncClient(base_url=url, headers=metrics_headers, timeout=10.0, trust_env=False) as metrics:
        described = await client.get(f"/pipelines/{pipeline}")
        if described.status_code != 200:
            raise SpecError([SpecIssue(url, 1, 1, "", f"GET /pipelines/{pipeline}: {described.status_code} "
                                                      f"{described.text[:200]}")])
        objectives = (described.json().get("slo") or {}).get("objectives")
        slo = SLOSpec.model_validate(objectives) if objectives else None
        result = await run_load(client, pipeline, requests, texts, rate=rate, duration_s=duration_s, slo=slo,
                                drain_s=drain_s, metrics_client=metrics)
    return {"pipeline": pipeline, "url": url, "seed": seed, "prompt_tokens": str(prompt),
            "output_tokens": str(output), **result}


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


def _tokenizer(folder: str | None, config: str | None) -> Any:
    if folder is None:
        try:
            workspace = open_workspace(config)
        except SpecError:
            return None
        local = [m for m in workspace.server.models.values() if m.backend == "local" and m.source]
        if not local:
            return None
        folder = str(workspace.root / local[0].source)  # type: ignore[operator]
    if not Path(folder).is_dir():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# -- profile -------------------------------------------------------------------


def small_rows_of(model: Any) -> dict[str, int]:
    """Up to how many rows the model's linear layers (``small_rows``) and LM head (``head_small_rows``) run
    on the small-batch kernel, as its start-up measured on this machine (none off the CPU float32 path).
    A step's time jumps where its rows cross it, and two processes can measure it apart near the
    crossover: a profile is the plan of an engine that chose as this one did."""
    out = {}
    for key, attr in (("small_rows", "linear"), ("head_small_rows", "head_linear")):
        rows = getattr(getattr(model, attr, None), "small_rows", None)
        if isinstance(rows, int):
            out[key] = rows
    return out


def _profile(args: argparse.Namespace) -> int:
    import os as _os

    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from serving.engine.engine import LLMEngine
    from serving.engine.sampling_params import SamplingParams
    from serving.model_pool import engine_config
    from serving.profile import profile_engine, synthetic_prompt_maker

    workspace = open_workspace(args.config)
    spec = workspace.server.models.get(args.model)
    if spec is None or spec.backend != "local":
        local = sorted(n for n, m in workspace.server.models.items() if m.backend == "local")
        print(f"inferline profile: {args.model!r} is not a local model of the config (local models: "
              f"{', '.join(local) or 'none'})", file=sys.stderr)
        return EXIT_FAILED
    config = engine_config(spec, workspace.root)
    engine = LLMEngine(config, name=args.model)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    prefill_sizes = [int(x) for x in args.prefill_sizes.split(",")]
    print(f"profiling {args.model} ({config.device}, {config.dtype}, speculative {config.speculative})...",
          file=sys.stderr)
    limits = small_rows_of(engine.model)
    measured = profile_engine(engine, synthetic_prompt_maker(engine.tokenizer, engine.model.shape.vocab_size),
                              SamplingParams, batch_sizes=sizes, prefill_sizes=prefill_sizes, repeats=args.repeats,
                              decode_steps=args.decode_steps, passes=args.passes, small_rows=limits.get("small_rows"))
    import torch

    profile = {"model": args.model, "source": spec.source, "device": config.device, "dtype": config.dtype,
               "num_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
               "engine": {"max_num_batched_tokens": config.max_num_batched_tokens,
                          "max_num_seqs": config.max_num_seqs, "block_size": config.block_size,
                          "prefix_cache": config.enable_prefix_caching, "speculative": config.speculative,
                          "speculative_max_batch": config.speculative_max_batch,
                          **limits},
               **measured}
    out = Path(args.output or f"profiles/{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    pre = profile["prefill"]
    print(f"prefill {pre['base_ms']:.1f} ms + {pre['per_token_ms']:.3f} ms/token; decode step ms by batch: "
          + ", ".join(f"{d['batch']}: {d['step_ms']:.1f} ({d['tokens_per_step']:.2f} tok/seq)"
                      for d in profile["decode"]), file=sys.stderr)
    print(f"wrote {out}")
    return EXIT_OK


# -- plan ----------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> int:
    workload = load_workload(args.workload)
    workspace = open_workspace(args.config)
    loaded = workspace.load(workspace.resolve(workload.pipeline))
    if args.step_scale is not None and args.step_scale <= 0:
        print("inferline plan: --step-scale must be positive", file=sys.stderr)
        return EXIT_USAGE
    result = plan_command(workspace, loaded, workload, profile_path=args.profile, replicas=args.replicas,
                          overhead_ms=args.overhead_ms, step_scale=args.step_scale, workload_file=args.workload)
    _print_plan(result)
    if args.json:
        print(json.dumps(result))
    return EXIT_OK


def plan_command(workspace: Workspace, loaded: LoadedPipeline, workload: Any, *, profile_path: str | None = None,
                 replicas: int | None = None, overhead_ms: float | None = None, step_scale: float | None = None,
                 workload_file: str = "") -> dict[str, Any]:
    """The plan for each of the workload's rates."""
    from serving.plan import EngineShape, plan_rate
    from serving.profile import StepModel

    model_name = pipeline_model(workspace, loaded)
    spec = workspace.server.models[model_name]
    path = Path(profile_path or workload.profile or f"profiles/{model_name}.json")
    if not path.exists():
        raise SpecError([SpecIssue(workload_file or str(path), 1, 1, "profile", f"no profile at {path}: measure "
                                   f"one with `inferline profile {model_name} --output {path}`")])
    profile = json.loads(path.read_text())
    overhead_tokens, shared = prompt_overhead(workspace, loaded, model_name)
    cached = cached_prefix(profile, shared, spec.kv_cache.block_size)
    engine = profile.get("engine", {})
    shape = EngineShape(engine.get("max_num_batched_tokens", spec.batching.max_num_batched_tokens),
                        engine.get("max_num_seqs", spec.batching.max_num_seqs),
                        overhead_tokens + workload.extra_prompt_tokens, cached,
                        overhead_ms if overhead_ms is not None else float(profile.get("overhead_ms", 0.0)),
                        step_scale if step_scale is not None else float(profile.get("step_scale", 1.0)))
    model = StepModel(profile)
    prompt, output = Distribution.parse(workload.prompt_tokens), Distribution.parse(workload.output_tokens)
    rates = []
    for rate in workload.all_rates:
        requests = requests_for(rate, workload.duration_s, prompt, output, workload.seed)
        planned = plan_rate(requests, model, shape, loaded.spec.slo, price=spec.price.to_price(),
                            max_replicas=workload.max_replicas, replicas=replicas)
        rates.append({"rate_rps": rate, **planned})
    return {"pipeline": loaded.spec.name, "model": model_name, "profile": str(path),
            "slo": loaded.spec.slo.model_dump(exclude_none=True) if loaded.spec.slo else None,
            "workload": {"prompt_tokens": str(prompt), "output_tokens": str(output), "duration_s": workload.duration_s,
                         "seed": workload.seed},
            "prompt_overhead_tokens": shape.prompt_overhead_tokens, "cached_prefix_tokens": cached,
            "overhead_ms": shape.overhead_ms, "step_scale": shape.step_scale, "rates": rates}


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


def pipeline_model(workspace: Workspace, loaded: LoadedPipeline) -> str:
    """The local model the pipeline generates with: its tokenize or route stage's, else the config's first."""
    for plan in loaded.plans:
        for key in ("model", "default"):
            name = getattr(plan.config, key, None)
            if isinstance(name, str) and name in workspace.server.models:
                return name
    local = [n for n, m in workspace.server.models.items() if m.backend == "local"]
    if not local:
        raise SpecError([SpecIssue(loaded.file, 1, 1, "", "no local model in the config to plan for")])
    return local[0]


def cached_prefix(profile: dict[str, Any], shared: int, block_size: int) -> int:
    """Of the *shared* leading tokens of every prompt, those the prefix cache serves: whole blocks, when the
    profiled engine caches prefixes."""
    engine = profile.get("engine", {})
    block = engine.get("block_size", block_size)
    return shared // block * block if engine.get("prefix_cache", True) else 0


def prompt_overhead(workspace: Workspace, loaded: LoadedPipeline, model: str) -> tuple[int, int]:
    """Tokens the pipeline adds around a user message (its prompt stage's system text and the chat
    template), and how many leading tokens all its prompts share."""
    from transformers import AutoTokenizer

    from serving.model_pool import HFTokenizer

    source = workspace.server.models[model].source
    hf = AutoTokenizer.from_pretrained(str(workspace.root / source))  # type: ignore[operator]
    tokenizer = HFTokenizer(hf)
    system = _system_text(loaded)

    def encode(user: str) -> list[int]:
        return tokenizer.encode_chat(([{"role": "system", "content": system}] if system else [])
                                     + [{"role": "user", "content": user}])

    a, b = "alpha beta gamma", "zulu yankee xray"
    ids_a, ids_b = encode(a), encode(b)
    shared = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), len(ids_a))
    user = len(hf.encode(a, add_special_tokens=False))
    return len(ids_a) - user, shared


def _system_text(loaded: LoadedPipeline) -> str:
    for plan in loaded.plans:
        if plan.spec.type == "prompt":
            template = plan.config.templates.get("system")  # type: ignore[attr-defined]
            if template is None:
                return ""
            return template.render({name: {} if name == "tags" else "" for name in template.names}).strip()
    return ""
