"""``inferline plan``: how many replicas a pipeline needs to meet its SLOs at a request rate, and what
1,000 requests cost. docs/capacity.md explains the model; in short:

* **Arrivals** are the workload's: Poisson at the rate, token counts from its distributions,
  the very requests ``inferline load`` would send with the same seed and duration
  (serving/capacity/workload.py).
* **Each replica** is simulated step by step as the engine's scheduler runs it (continuous batching,
  chunked prefill): every step, running sequences first (a decode is one token, a prompt chunk
  what the budget leaves), then waiting ones admitted first come, first served, while the step's
  token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow. A request joins the least
  loaded replica (waiting + running). The prompt's shared prefix (system prompt, chat template) is
  served from the prefix cache after the first request.
* **A step's time** comes from the measured profile (serving/capacity/step_profile.py): ``decode_ms(b) +
  per_token_ms * prefill_tokens``; a decoding sequence gains ``tokens_per_step(b)`` tokens per step.
  Waiting in the queue is what the simulation produces, not a formula: it is exact for this
  scheduler given the step times.
* **Around the engine**, ``overhead_ms`` (the stages before ``generate``, HTTP, streaming) is added
  to every request's TTFT and end-to-end time, and ``step_scale`` multiplies every step's time: a
  serving process runs the engine slower than the bare one the profile timed (docs/capacity.md).
* Each simulated request is judged by serving/runtime/slo.py as a served one is; a ``*_p95`` objective holds at
  95% attainment. The answer is the fewest replicas at which every objective holds. At that count the
  plan is simulated again with every step 5% faster and 5% slower (``attainment_if_steps``): where
  many requests sit near an objective's edge, a few percent of the machine's speed move the
  attainment by tens of points, and an operator should know that of a prediction.
* **Cost** is what the pipeline's cost accounting charges (stages/stream.py): token prices, plus the
  compute price for each request's time in the engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from statistics import fmean
from typing import Any

from pipeline.cost import Price
from pipeline.spec import SLOSpec
from serving.capacity.step_profile import StepModel
from serving.capacity.workload import LoadRequest
from serving.runtime.slo import ALL, REQUIRED, RequestFigures, attainment

#: How much faster and slower than the profile a plan also simulates, to show how far its attainment moves
#: with the machine's speed (``attainment_if_steps``): a shared machine runs the same steps at different
#: speeds from one hour to the next, and where many requests sit near an objective's edge, a few percent
#: of step time move the attainment of all objectives by many points (docs/capacity.md).
STEP_TIME_SENSITIVITY = 0.05


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The scheduler limits and prompt facts the simulation needs."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    #: Tokens the pipeline adds around the user's message (system prompt, chat template, documents).
    prompt_overhead_tokens: int = 0
    #: Of those, the leading tokens every request shares, which the prefix cache serves after the first.
    cached_prefix_tokens: int = 0
    #: Time outside the engine per request (stages before generate, HTTP, streaming), in ms.
    overhead_ms: float = 0.0
    #: How much slower a serving process runs the engine's steps than the bare engine the profile timed
    #: (its event loop, and clients, share the cores): every step time is multiplied by it.
    step_scale: float = 1.0


@dataclass(slots=True)
class _Request:
    spec: LoadRequest
    prefill_left: int
    produced: float = 0.0
    first_s: float | None = None
    last_s: float | None = None
    done_s: float | None = None


@dataclass(slots=True)
class _Tally:
    """Steps of one kind a replica ran: how many, their seconds, and the decodes among their rows."""

    steps: int = 0
    seconds: float = 0.0
    decodes: int = 0


@dataclass(slots=True)
class _Replica:
    waiting: deque[_Request] = field(default_factory=deque)
    running: list[_Request] = field(default_factory=list)
    busy_until: float | None = None
    batch: list[tuple[_Request, int]] = field(default_factory=list)
    num_decodes: int = 0
    warm: bool = False
    max_waiting: int = 0
    #: Steps run, by kind (``prefill``: computed prompt tokens, decodes may ride along; ``decode``): the
    #: engine's ``inferline_*_step_seconds`` count them the same way.
    steps: dict[str, _Tally] = field(default_factory=lambda: {"prefill": _Tally(), "decode": _Tally()})

    @property
    def busy_s(self) -> float:
        return sum(tally.seconds for tally in self.steps.values())

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)


@dataclass(frozen=True, slots=True)
class Simulation:
    """Every simulated request's figures, and how busy the replicas were."""

    requests: list[RequestFigures]
    #: Fraction of the run's span the replicas spent stepping (mean over replicas).
    busy: float
    max_waiting: int
    span_s: float
    #: The steps the replicas ran, by kind: ``{"prefill"|"decode": {"steps", "mean_ms", "mean_batch"}}``,
    #: to set against a served engine's own step series during a load of the same requests.
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)


def simulate(requests: Sequence[LoadRequest], model: StepModel, shape: EngineShape, *, replicas: int = 1,
             price: Price | None = None) -> Simulation:
    """Run *requests* through *replicas* simulated engines; each request's figures as a server judges them."""
    price = price or Price()
    pool = [_Replica() for _ in range(replicas)]
    queue = [_Request(r, r.prompt_tokens + shape.prompt_overhead_tokens) for r in sorted(requests,
                                                                                      key=lambda r: r.arrival_s)]
    done: list[_Request] = []
    nxt, now = 0, 0.0
    while True:
        arrival = queue[nxt].spec.arrival_s if nxt < len(queue) else None
        busy = [r for r in pool if r.busy_until is not None]
        step_end = min(busy, key=lambda r: r.busy_until) if busy else None  # type: ignore[arg-type,return-value]
        if arrival is None and step_end is None:
            break
        if step_end is None or (arrival is not None and arrival <= step_end.busy_until):  # type: ignore[operator]
            now = arrival  # type: ignore[assignment]
            replica = min(pool, key=lambda r: r.num_requests)
            request = queue[nxt]
            if replica.warm:
                request.prefill_left -= min(shape.cached_prefix_tokens, request.prefill_left - 1)
            replica.warm = True
            replica.waiting.append(request)
            replica.max_waiting = max(replica.max_waiting, len(replica.waiting))
            nxt += 1
            if replica.busy_until is None:
                _start(replica, now, model, shape)
        else:
            now = step_end.busy_until  # type: ignore[assignment]
            done += _finish(step_end, now, model)
            _start(step_end, now, model, shape)
    span = max((r.done_s or 0.0 for r in done), default=0.0)
    figures = [_figures(r, shape, price) for r in sorted(done, key=lambda r: r.spec.index)]
    return Simulation(figures, fmean(r.busy_s for r in pool) / span if span else 0.0,
                      max(r.max_waiting for r in pool), span, _step_summary(pool))


def _step_summary(pool: list[_Replica]) -> dict[str, dict[str, Any]]:
    out = {}
    for kind in ("prefill", "decode"):
        count = sum(r.steps[kind].steps for r in pool)
        seconds = sum(r.steps[kind].seconds for r in pool)
        decodes = sum(r.steps[kind].decodes for r in pool)
        out[kind] = {"steps": count, "mean_ms": round(seconds / count * 1e3, 2) if count else None,
                     "mean_batch": round(decodes / count, 3) if count else None}
    return out


def _start(replica: _Replica, now: float, model: StepModel, shape: EngineShape) -> None:
    """Schedule the replica's next step as the engine's scheduler would, and set when it ends."""
    budget, batch, decodes = shape.max_num_batched_tokens, [], 0
    for request in replica.running:
        if budget <= 0:
            break
        take = min(request.prefill_left, budget) if request.prefill_left else 1
        decodes += not request.prefill_left
        batch.append((request, take))
        budget -= take
    while replica.waiting and budget > 0 and len(replica.running) < shape.max_num_seqs:
        request = replica.waiting.popleft()
        take = min(request.prefill_left, budget)
        replica.running.append(request)
        batch.append((request, take))
        budget -= take
    if not batch:
        replica.busy_until, replica.batch = None, []
        return
    prefill = sum(take for request, take in batch if request.prefill_left)
    seconds = model.step_ms(prefill, decodes) * shape.step_scale / 1e3
    replica.batch, replica.num_decodes = batch, decodes
    replica.busy_until = now + seconds
    tally = replica.steps["prefill" if prefill else "decode"]
    tally.steps += 1
    tally.seconds += seconds
    tally.decodes += decodes


def _finish(replica: _Replica, now: float, model: StepModel) -> list[_Request]:
    """Apply the step that just ended: prompts advance, decodes gain tokens; the requests it finished."""
    gain = model.tokens_per_step(replica.num_decodes) if replica.num_decodes else 1.0
    finished = []
    for request, take in replica.batch:
        if request.prefill_left:
            request.prefill_left -= take
            if request.prefill_left:
                continue
            request.produced, request.first_s = 1.0, now  # the step that ends the prompt samples a token
        else:
            request.produced += gain
        request.last_s = now
        if request.produced >= request.spec.output_tokens:
            request.done_s = now
            finished.append(request)
    if finished:
        replica.running = [r for r in replica.running if r.done_s is None]
    replica.busy_until, replica.batch = None, []
    return finished


def _figures(request: _Request, shape: EngineShape, price: Price) -> RequestFigures:
    arrival, overhead = request.spec.arrival_s, shape.overhead_ms
    n = request.spec.output_tokens
    ttft = ((request.first_s or arrival) - arrival) * 1e3 + overhead
    itl = None if n < 2 else ((request.last_s or 0.0) - (request.first_s or 0.0)) * 1e3 / (n - 1)
    engine_s = (request.done_s or arrival) - arrival
    prompt = request.spec.prompt_tokens + shape.prompt_overhead_tokens
    cost = price.tokens_usd(prompt, n) + price.compute_usd(engine_s)
    return RequestFigures(True, ttft, itl, engine_s * 1e3 + overhead, cost)


def plan_rate(requests: Sequence[LoadRequest], model: StepModel, shape: EngineShape, slo: SLOSpec | None, *,
              price: Price | None = None, max_replicas: int = 16, replicas: int | None = None) -> dict[str, Any]:
    """The fewest replicas (up to *max_replicas*) at which every objective holds, with the prediction at each
    count tried; with *replicas*, the prediction at that count only."""
    tried: list[dict[str, Any]] = []
    needed = None
    counts = [replicas] if replicas is not None else range(1, max_replicas + 1)
    for count in counts:
        sim = simulate(requests, model, shape, replicas=count, price=price)
        entry = _prediction(sim, slo, count)
        tried.append(entry)
        if replicas is None and entry["meets_slo"]:
            needed = count
            break
    best = tried[-1]
    if slo is not None:
        best["attainment_if_steps"] = _sensitivity(requests, model, shape, slo, best["replicas"], price)
    return {"replicas_needed": needed if replicas is None else (replicas if best["meets_slo"] else None),
            "cost_per_1k_requests_usd": best["cost_per_1k_requests_usd"], "tried": tried}


def _sensitivity(requests: Sequence[LoadRequest], model: StepModel, shape: EngineShape, slo: SLOSpec,
                 replicas: int, price: Price | None) -> dict[str, float | None]:
    """The attainment of all objectives with every step STEP_TIME_SENSITIVITY faster and slower than the
    profile says: how far the prediction moves with the machine's speed."""
    out: dict[str, float | None] = {}
    for label, factor in (("faster", 1 - STEP_TIME_SENSITIVITY), ("slower", 1 + STEP_TIME_SENSITIVITY)):
        sim = simulate(requests, model, replace(shape, step_scale=shape.step_scale * factor), replicas=replicas,
                       price=price)
        out[f"{label}_{round(STEP_TIME_SENSITIVITY * 100)}pct"] = attainment(slo, sim.requests)[ALL]["attainment"]
    return out


def _prediction(sim: Simulation, slo: SLOSpec | None, replicas: int) -> dict[str, Any]:
    requests = sim.requests
    report = attainment(slo, requests) if slo is not None else {}
    holds = all(entry.get("holds") is not False for name, entry in report.items() if name in REQUIRED)
    return {
        "replicas": replicas, "requests": len(requests), "busy": round(sim.busy, 4), "max_waiting": sim.max_waiting,
        "attainment": report, "meets_slo": holds,
        "cost_per_1k_requests_usd": round(1000 * fmean(r.cost_usd for r in requests), 8) if requests else None,
        "ttft_ms_p95": _p95([r.ttft_ms for r in requests]), "itl_ms_p95": _p95([r.itl_ms for r in requests]),
        "e2e_ms_p95": _p95([r.e2e_ms for r in requests]),
        "itl_ms_mean": _mean([r.itl_ms for r in requests]), "e2e_ms_mean": _mean([r.e2e_ms for r in requests]),
        "throughput_rps": round(len(requests) / sim.span_s, 4) if sim.span_s else None,
        "steps": sim.steps,
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(fmean(present), 2) if present else None


def _p95(values: list[float | None]) -> float | None:
    from serving.runtime.slo import percentile

    present = [v for v in values if v is not None]
    value = percentile(present, 95)
    return None if value is None else round(value, 2)
