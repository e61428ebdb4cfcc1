"""``inferline plan`` for a pipeline: its model, the tokens its prompt adds, and the plan at each rate.

The step model and the simulation are in :mod:`serving.capacity.planner`; this module reads what they
need from a pipeline and its server config, and the step profile ``inferline profile`` wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.errors import SpecError, SpecIssue
from pipeline.loader import LoadedPipeline
from serving.backends.tokenizer import HFTokenizer
from serving.capacity.planner import EngineShape, plan_rate
from serving.capacity.step_profile import StepModel
from serving.capacity.workload import Distribution, requests_for
from serving.runtime.workspace import Workspace


def plan_pipeline(workspace: Workspace, loaded: LoadedPipeline, workload: Any, *, profile_path: str | None = None,
                 replicas: int | None = None, overhead_ms: float | None = None, step_scale: float | None = None,
                 workload_file: str = "") -> dict[str, Any]:
    """The plan for each of the workload's rates."""
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
    from transformers import AutoTokenizer  # slow to import: only when planning

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
