"""``inferline load``: drive a live server with an open-loop Poisson workload and measure what it gets.

Open loop: request i is sent at its arrival time whatever happened to the earlier ones (none is
awaited before the next is sent), as independent users arrive; a closed loop (N clients, each
waiting for its answer) would slow down with the server and hide its queueing. The requests are
serving/capacity/workload.py's (:func:`~serving.capacity.workload.requests_for`), so ``inferline plan`` with the same
seed and duration simulates the very same ones.

Each request is ``POST /pipelines/{name}`` with ``"stream": true``, a synthetic user message of the
drawn prompt length (random common words, cut to that many of the model's tokens) and
``max_tokens`` of the drawn output length (a pipeline whose ``generate`` sets ``ignore_eos: true``
always produces that many; others may stop earlier, which the report shows). The client measures
TTFT (request sent to the first ``delta``), ITL ((last delta - first delta) / (output tokens - 1))
and end-to-end (to ``done``) and judges them against the pipeline's ``slo:`` (serving/runtime/slo.py). While
it runs, ``/metrics`` is read every half second for the engine's queue depth.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pipeline.errors import SpecError, SpecIssue
from pipeline.spec import SLOSpec
from serving.capacity.workload import Distribution, LoadRequest, requests_for
from serving.runtime.slo import RequestFigures, attainment, itl_ms, percentile
from serving.runtime.workspace import open_workspace

_WORDS = ("time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye",
          "woman", "place", "work", "week", "case", "point", "government", "company", "number", "group", "problem",
          "fact", "water", "room", "mother", "area", "money", "story", "month", "lot", "right", "study", "book",
          "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father",
          "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president",
          "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level",
          "office", "door", "health", "art", "war", "history", "party", "result", "change", "morning", "reason",
          "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "river", "garden", "window",
          "music", "market", "letter", "mountain", "table", "winter", "summer", "bridge", "island", "forest")


def synthetic_text(tokenizer: Any, num_tokens: int, rng: random.Random) -> str:
    """Random common words, cut to *num_tokens* of *tokenizer* (an HF tokenizer; None: one word a token)."""
    words = [rng.choice(_WORDS) for _ in range(num_tokens + 8)]
    if tokenizer is None:
        return " ".join(words[:num_tokens])
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    while len(ids) < num_tokens:
        words += [rng.choice(_WORDS) for _ in range(num_tokens)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    index: int
    scheduled_s: float
    sent_s: float
    status: str = "ok"
    http_status: int = 200
    ttft_s: float | None = None
    last_delta_s: float | None = None
    e2e_s: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    finish_reason: str = ""
    error: str = ""

    def figures(self) -> RequestFigures:
        ok = self.status == "ok"
        return RequestFigures(ok, None if self.ttft_s is None else self.ttft_s * 1e3,
                              itl_ms(self.ttft_s, self.last_delta_s, self.output_tokens),
                              (self.e2e_s or 0.0) * 1e3, self.cost_usd)


async def dispatch(requests: Sequence[LoadRequest], send: Callable[[LoadRequest, float], Awaitable[Any]], *,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> tuple[list[asyncio.Task[Any]], float]:
    """Start ``send(request, started_at)`` for each request at its arrival time, never waiting for one to
    finish before starting the next; the tasks and the start time (on *clock*)."""
    started = clock()
    tasks = []
    for request in requests:
        delay = started + request.arrival_s - clock()
        if delay > 0:
            await sleep(delay)
        tasks.append(asyncio.ensure_future(send(request, started)))
    return tasks, started


#: Engine series summed over models: the gauges sampled while a load runs, and the step totals read
#: before and after it (serving/engine/metrics.py).
_SUMMED = frozenset({
    "inferline_num_requests_waiting", "inferline_num_requests_running",
    "inferline_decode_step_seconds_count", "inferline_decode_step_seconds_sum",
    "inferline_prefill_step_seconds_count", "inferline_prefill_step_seconds_sum",
    "inferline_decode_step_sequences_total",
})


@dataclass(slots=True)
class MetricsSampler:
    """Reads ``/metrics`` now and then: queue depth and requests running, summed over models."""

    client: httpx.AsyncClient
    every_s: float = 0.5
    waiting: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    error: str = ""

    async def run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.every_s)

    async def sample(self) -> dict[str, float] | None:
        values = await self.read()
        if values is not None:
            self.waiting.append(values.get("inferline_num_requests_waiting", 0.0))
            self.running.append(values.get("inferline_num_requests_running", 0.0))
        return values

    async def read(self, pipeline: str | None = None) -> dict[str, float] | None:
        """Gauges summed by name, and (for *pipeline*) its SLO counters as ``slo:OBJECTIVE:RESULT``."""
        try:
            response = await self.client.get("/metrics")
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        if response.status_code != 200:
            self.error = f"GET /metrics: {response.status_code}"
            return None
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name in _SUMMED:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
                elif (sample.name == "inferline_slo_requests_total" and pipeline is not None
                      and sample.labels.get("pipeline") == pipeline):
                    values[f"slo:{sample.labels['objective']}:{sample.labels['result']}"] = sample.value
        return values


async def send_one(client: httpx.AsyncClient, pipeline: str, request: LoadRequest, text: str, started: float,
                   clock: Callable[[], float] = time.monotonic) -> Outcome:
    """One streamed request; what the client measured."""
    sent = clock()
    outcome = Outcome(request.index, request.arrival_s, sent - started)
    body = {"input": text, "stream": True, "max_tokens": request.output_tokens}
    try:
        async with client.stream("POST", f"/pipelines/{pipeline}", json=body) as response:
            outcome.http_status = response.status_code
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                outcome.status, outcome.error = "failed", f"HTTP {response.status_code}: {detail}"
                outcome.e2e_s = clock() - sent
                return outcome
            event = ""
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif not line.startswith("data:"):
                    continue
                elif event == "delta":
                    now = clock() - sent
                    outcome.ttft_s = now if outcome.ttft_s is None else outcome.ttft_s
                    outcome.last_delta_s = now
                elif event in ("done", "error"):
                    _final(outcome, event, json.loads(line[5:]), clock() - sent)
                    return outcome
        outcome.status, outcome.error = "failed", "the stream ended without a done event"
    except httpx.HTTPError as exc:
        outcome.status, outcome.error = "failed", f"{type(exc).__name__}: {exc}"
    outcome.e2e_s = clock() - sent
    return outcome


def _final(outcome: Outcome, event: str, payload: dict[str, Any], e2e_s: float) -> None:
    outcome.e2e_s = e2e_s
    if event == "error":
        outcome.status, outcome.error = "failed", str(payload.get("detail") or payload.get("title"))[:300]
        return
    outcome.input_tokens = payload["usage"]["input_tokens"]
    outcome.output_tokens = payload["usage"]["output_tokens"]
    outcome.cost_usd = payload.get("cost_usd") or 0.0
    outcome.finish_reason = payload.get("finish_reason") or ""


async def run_load(client: httpx.AsyncClient, pipeline: str, requests: Sequence[LoadRequest], texts: Sequence[str],
                   *, rate: float, duration_s: float, slo: SLOSpec | None = None, drain_s: float = 120.0,
                   metrics: bool = True, metrics_client: httpx.AsyncClient | None = None) -> dict[str, Any]:
    """Send *requests* open-loop and wait (up to *drain_s* after the last arrival) for their answers; the report.

    ``/metrics`` is read through *metrics_client* (default *client*): it may need another key (auditor).
    """
    sampler = MetricsSampler(metrics_client or client)
    before = await sampler.read(pipeline) if metrics else None
    sampling = asyncio.create_task(sampler.run()) if metrics and before is not None else None
    sent: dict[int, float] = {}

    async def send(request: LoadRequest, started: float) -> Outcome:
        sent[request.index] = time.monotonic() - started
        return await send_one(client, pipeline, request, texts[request.index], started)

    wall = time.monotonic()
    tasks, _ = await dispatch(requests, send)
    sent_span = time.monotonic() - wall
    finished, late = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
    for task in late:
        task.cancel()
    wall = time.monotonic() - wall
    if sampling is not None:
        sampling.cancel()
    after = await sampler.read(pipeline) if metrics and before is not None else None
    outcomes = sorted((t.result() for t in finished), key=lambda o: o.index)
    answered = {o.index for o in outcomes}
    outcomes += [Outcome(r.index, r.arrival_s, sent.get(r.index, r.arrival_s), "timeout", 0,
                         error=f"no answer {drain_s:g} s after the last arrival")
                 for r in requests if r.index not in answered]
    return report(outcomes, requests, rate=rate, duration_s=duration_s, wall_s=wall, sent_span_s=sent_span, slo=slo,
                  sampler=sampler, server_slo=_slo_delta(before, after), engine_steps=_steps_delta(before, after))


def _steps_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The server's engine steps during the load: how many of each kind, their mean wall time, and the
    decode steps' mean batch, to set against the profile's step times at that batch. None when the
    server exposes no step series (no local engine: a remote or Ray backend, a fake in tests)."""
    if before is None or after is None or "inferline_decode_step_seconds_count" not in after:
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out: dict[str, Any] = {}
    for kind in ("decode", "prefill"):
        count = delta(f"inferline_{kind}_step_seconds_count")
        out[kind] = {"steps": int(count),
                     "mean_ms": round(delta(f"inferline_{kind}_step_seconds_sum") / count * 1e3, 2) if count else None}
    decodes = out["decode"]["steps"]
    sequences = delta("inferline_decode_step_sequences_total")
    out["decode"]["mean_batch"] = round(sequences / decodes, 3) if decodes else None
    return out


def _slo_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    counts: dict[str, dict[str, float]] = {}
    for key, value in after.items():
        if key.startswith("slo:"):
            _, objective, result = key.split(":")
            counts.setdefault(objective, {"met": 0.0, "missed": 0.0})[result] = value - before.get(key, 0.0)
    return {objective: {"judged": int(c["met"] + c["missed"]), "met": int(c["met"]),
                        "attainment": round(c["met"] / (c["met"] + c["missed"]), 4) if c["met"] + c["missed"] else None}
            for objective, c in counts.items()} or None


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    out = {f"p{q}": None if (v := percentile(values, q)) is None else round(v * 1e3, 2) for q in (50, 95, 99)}
    return out | {"mean": round(fmean(values) * 1e3, 2) if values else None}


def report(outcomes: Sequence[Outcome], requests: Sequence[LoadRequest], *, rate: float, duration_s: float,
           wall_s: float, sent_span_s: float, slo: SLOSpec | None, sampler: MetricsSampler | None = None,
           server_slo: dict[str, Any] | None = None, engine_steps: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a load run measured. The achieved rate counts the requests actually sent within the duration."""
    ok = [o for o in outcomes if o.status == "ok"]
    lateness = [max(0.0, o.sent_s - o.scheduled_s) for o in outcomes]
    in_window = sum(o.sent_s <= duration_s for o in outcomes)
    statuses: dict[str, int] = {}
    for o in outcomes:
        key = o.status if o.status != "failed" else f"failed:{o.http_status or 'stream'}"
        statuses[key] = statuses.get(key, 0) + 1
    finish: dict[str, int] = {}
    for o in ok:
        finish[o.finish_reason or "-"] = finish.get(o.finish_reason or "-", 0) + 1
    requested = [r.output_tokens for r in requests]
    result: dict[str, Any] = {
        "requests": len(requests), "completed": len(ok), "status": statuses,
        "target_rate_rps": rate, "achieved_rate_rps": round(in_window / duration_s, 4) if duration_s else None,
        "send_lag_ms_p99": None if not lateness else round((percentile(lateness, 99) or 0.0) * 1e3, 2),
        "duration_s": duration_s, "wall_s": round(wall_s, 2), "sent_span_s": round(sent_span_s, 2),
        "throughput_rps": round(len(ok) / wall_s, 4) if wall_s else None,
        "output_tok_s": round(sum(o.output_tokens for o in ok) / wall_s, 2) if wall_s else None,
        "ttft_ms": _stats_ms([o.ttft_s for o in ok if o.ttft_s is not None]),
        "itl_ms": {k: v for k, v in _stats_itl(ok).items()},
        "e2e_ms": _stats_ms([o.e2e_s for o in ok if o.e2e_s is not None]),
        "tokens": {"input_per_request": round(fmean(o.input_tokens for o in ok), 2) if ok else None,
                   "output_per_request": round(fmean(o.output_tokens for o in ok), 2) if ok else None,
                   "output_requested_per_request": round(fmean(requested), 2) if requested else None},
        "finish_reasons": finish,
        "cost_usd": {"per_request": fmean(o.cost_usd for o in ok) if ok else None,
                     "per_1k_requests": 1000 * fmean(o.cost_usd for o in ok) if ok else None},
        "slo": attainment(slo, (o.figures() for o in outcomes)) if slo is not None else None,
        "server_slo": server_slo,
        "engine_steps": engine_steps,
    }
    if sampler is not None:
        result["queue_depth"] = {"mean": round(fmean(sampler.waiting), 2) if sampler.waiting else None,
                                 "max": max(sampler.waiting, default=None), "samples": len(sampler.waiting),
                                 "running_mean": round(fmean(sampler.running), 2) if sampler.running else None,
                                 **({"error": sampler.error} if sampler.error and not sampler.waiting else {})}
    errors = [o.error for o in outcomes if o.error]
    if errors:
        result["first_errors"] = errors[:3]
    return result


def _stats_itl(ok: list[Outcome]) -> dict[str, float | None]:
    values = [v / 1e3 for o in ok if (v := itl_ms(o.ttft_s, o.last_delta_s, o.output_tokens)) is not None]
    return _stats_ms(values)


async def load_server(url: str, pipeline: str, rate: float, duration_s: float, prompt: Distribution,
                       output: Distribution, *, seed: int = 0, api_key: str | None = None,
                       metrics_key: str | None = None, drain_s: float = 120.0, tokenizer: Any = None) -> dict[str, Any]:
    """The whole ``inferline load`` run: the pipeline's SLO from the server, the requests, the report."""
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


def local_tokenizer(folder: str | None, config: str | None) -> Any:
    """The tokenizer synthetic prompts are measured in: *folder*'s, else the config's first local model's;
    None when there is none (prompts are then sized in words)."""
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
