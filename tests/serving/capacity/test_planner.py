"""The capacity model: profiles, the step-time model and the simulation behind `inferline plan`."""

from __future__ import annotations

import itertools

import pytest

from pipeline.cost import Price
from pipeline.spec import SLOSpec
from serving.capacity.planner import EngineShape, plan_rate, simulate
from serving.capacity.step_profile import StepModel, _fit, _non_decreasing, profile_engine
from serving.capacity.workload import Distribution, LoadRequest, requests_for
from serving.engine.config import EngineConfig
from serving.engine.sampling_params import SamplingParams
from tests.serving.modelled_engine import ModelledEngine, VirtualClock

PROFILE = {"prefill": {"base_ms": 10.0, "per_token_ms": 0.5, "points": []},
           "decode": [{"batch": 1, "step_ms": 20.0, "tokens_per_step": 1.0},
                      {"batch": 4, "step_ms": 26.0, "tokens_per_step": 1.0},
                      {"batch": 16, "step_ms": 50.0, "tokens_per_step": 1.0}]}


def formula(prefill: int, decodes: int) -> float:
    """The step time the modelled engine takes: what a profile of it must find."""
    return (20.0 + 2.0 * (decodes - 1) if decodes else 10.0) + 0.5 * prefill


def test_profile_recovers_the_step_times_of_an_engine():
    clock = VirtualClock()
    engine = ModelledEngine(formula, EngineConfig(model="m", num_blocks=2048), clock)
    profile = profile_engine(engine, lambda n, seed: [1 + (seed + i) % 200 for i in range(n)], SamplingParams,
                             batch_sizes=(1, 2, 4, 8), prefill_sizes=(16, 64, 256), repeats=2, decode_steps=5,
                             clock=clock)
    assert profile["prefill"]["points"] == [[16, 18.0], [64, 42.0], [256, 138.0]]
    assert (profile["prefill"]["base_ms"], profile["prefill"]["per_token_ms"]) == (10.0, 0.5)
    assert [(d["batch"], d["step_ms"], d["tokens_per_step"]) for d in profile["decode"]] == [
        (1, 20.0, 1.0), (2, 22.0, 1.0), (4, 26.0, 1.0), (8, 34.0, 1.0)]
    # b decodes and an n-token prompt in one step: the decode step plus 0.5 ms a prompt token.
    assert [(m["batch"], m["prefill_tokens"], m["step_ms"]) for m in profile["mixed"]] == [
        (1, 32, 36.0), (1, 128, 84.0), (4, 32, 42.0), (4, 128, 90.0)]
    model = StepModel(profile)
    assert model.step_ms(64, 3) == 24.0 + 32.0 and model.step_ms(64, 0) == 42.0
    assert not engine.has_unfinished


def test_the_profile_measures_both_sides_of_the_small_batch_limit_and_the_model_keeps_them_apart():
    # Past 48 rows the matmuls leave the small-batch kernel: every such step costs 20 ms more.
    def jumpy(prefill: int, decodes: int) -> float:
        return formula(prefill, decodes) + (20.0 if prefill + decodes > 48 else 0.0)

    clock = VirtualClock()
    engine = ModelledEngine(jumpy, EngineConfig(model="m", num_blocks=2048), clock)
    profile = profile_engine(engine, lambda n, seed: [1 + (seed + i) % 200 for i in range(n)], SamplingParams,
                             batch_sizes=(1, 2, 4, 8), prefill_sizes=(16, 64, 256), repeats=2, decode_steps=5,
                             clock=clock, small_rows=48)
    assert profile["prefill"]["points"] == [[16, 18.0], [48, 34.0], [49, 54.5], [64, 62.0], [256, 158.0]]
    assert [(m["batch"], m["prefill_tokens"], m["step_ms"]) for m in profile["mixed"]] == [
        (1, 32, 36.0), (1, 44, 42.0), (1, 48, 64.0), (1, 128, 104.0),
        (4, 32, 42.0), (4, 44, 48.0), (4, 48, 70.0), (4, 128, 110.0)]
    model = StepModel({**profile, "engine": {"small_rows": 48}})
    for prefill, decodes in ((40, 3), (40, 10), (44, 4), (45, 4), (100, 2), (20, 8)):
        assert model.step_ms(prefill, decodes) == pytest.approx(jumpy(prefill, decodes)), (prefill, decodes)
    assert model.step_ms(48, 0) == 34.0 and model.step_ms(64, 0) == 62.0
    # Without the limit, the default sizes' line from 32 tokens (kernel) to 128 (oneDNN) misses the jump.
    blind = profile_engine(engine, lambda n, seed: [1 + (seed + i) % 200 for i in range(n)], SamplingParams,
                           batch_sizes=(1, 2, 4, 8), prefill_sizes=(16, 64, 256), repeats=2, decode_steps=5,
                           clock=clock)
    assert StepModel(blind).step_ms(49, 1) < jumpy(49, 1) - 15


def test_profile_step_times_are_means_because_the_plan_adds_them_up():
    # One decode step in four takes 40 ms more (it verifies speculative guesses, or the machine is
    # busy): a request's decode time is the sum of its steps, so each step counts 10 ms more on
    # average. The median of the samples would say the fast step's time, and the plan would be short.
    clock = VirtualClock()
    decode_only = itertools.count()

    def skewed(prefill: int, decodes: int) -> float:
        slow = prefill == 0 and decodes > 0 and next(decode_only) % 4 == 0
        return formula(prefill, decodes) + (40.0 if slow else 0.0)

    engine = ModelledEngine(skewed, EngineConfig(model="m", num_blocks=2048), clock)
    profile = profile_engine(engine, lambda n, seed: [1 + (seed + i) % 200 for i in range(n)], SamplingParams,
                             batch_sizes=(1, 2, 4), prefill_sizes=(16, 64), repeats=2, decode_steps=8, clock=clock)
    assert [(d["batch"], d["step_ms"]) for d in profile["decode"]] == [(1, 30.0), (2, 32.0), (4, 36.0)]


def test_noise_cannot_make_more_work_faster():
    # A burst of other work at batch 2: pooled with the batches above it, as least squares would.
    assert _non_decreasing([80.0, 260.0, 95.0, 105.0, 130.0]) == [80.0, 147.5, 147.5, 147.5, 147.5]
    assert _non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert _fit([16, 64, 256], [10.0, 20.0, 900.0])[0] == 0.0  # a negative intercept: through the origin
    assert _fit([16, 64], [50.0, 40.0]) == (45.0, 0.0)


def test_the_step_model_interpolates_the_profile():
    model = StepModel(PROFILE)
    assert model.step_ms(100, 0) == 60.0 and model.step_ms(0, 0) == 0.0
    assert model.decode_ms(2) == 22.0 and model.decode_ms(10) == 38.0
    assert model.decode_ms(32) == 82.0  # beyond the last point: the last segment's slope
    assert model.step_ms(40, 4) == 46.0
    assert model.tokens_per_step(3) == 1.0


def one(arrival: float, prompt: int, output: int, index: int = 0) -> LoadRequest:
    return LoadRequest(index, arrival, prompt, output)


def test_a_lone_request_is_one_prefill_then_decodes():
    sim = simulate([one(1.0, 100, 5)], StepModel(PROFILE), EngineShape(overhead_ms=3.0), price=Price(1.0, 2.0, 0.5))
    (request,) = sim.requests
    assert request.ttft_ms == pytest.approx(60.0 + 3.0)  # prefill step, and the time outside the engine
    assert request.itl_ms == pytest.approx(20.0) and request.e2e_ms == pytest.approx(60 + 4 * 20 + 3.0)
    assert request.cost_usd == pytest.approx((100 * 1.0 + 5 * 2.0) / 1000 + 0.5 * 0.14)
    assert sim.busy == pytest.approx(0.14 / 1.14)


def test_requests_share_steps_and_queue_behind_the_token_budget():
    shape = EngineShape(max_num_batched_tokens=256)
    sim = simulate([one(0.0, 200, 3, 0), one(0.05, 200, 3, 1), one(0.05, 200, 3, 2)], StepModel(PROFILE), shape)
    a, b, c = sim.requests
    # Step 1 (0-110 ms): a's prompt alone; b and c arrive meanwhile. Step 2 (110-257.5): a decodes, b's prompt
    # and 55 tokens of c's fill the budget of 256. Step 3 (257.5-352): a and b decode, c's last 145 tokens.
    assert a.ttft_ms == pytest.approx(110.0)
    assert b.ttft_ms == pytest.approx(110 + 20 + 0.5 * 255 - 50)
    assert c.ttft_ms == pytest.approx(257.5 + 22 + 0.5 * 145 - 50)
    assert a.e2e_ms == pytest.approx(352.0) and a.itl_ms == pytest.approx((352 - 110) / 2)
    assert sim.max_waiting == 2
    # The steps by kind, as the engine's step series count them: three that computed prompt tokens (with
    # 0, 1 and 2 decodes riding along), then two of decodes only (b and c's last tokens, then c's).
    assert sim.steps["prefill"] == {"steps": 3, "mean_ms": pytest.approx((110 + 147.5 + 94.5) / 3, abs=0.01),
                                    "mean_batch": 1.0}
    assert sim.steps["decode"] == {"steps": 2, "mean_ms": pytest.approx((22 + 20) / 2), "mean_batch": 1.5}


def test_the_prefix_cache_serves_the_shared_prompt_after_the_first_request():
    shape = EngineShape(prompt_overhead_tokens=40, cached_prefix_tokens=32)
    sim = simulate([one(0.0, 10, 1, 0), one(5.0, 10, 1, 1)], StepModel(PROFILE), shape)
    assert [r.ttft_ms for r in sim.requests] == [pytest.approx(10 + 0.5 * 50), pytest.approx(10 + 0.5 * 18)]


def workload(rate: float, seconds: float = 120.0) -> list[LoadRequest]:
    return requests_for(rate, seconds, Distribution.parse("uniform:50,150"), Distribution.parse("fixed:20"), 3)


def test_queueing_sets_in_as_the_rate_nears_capacity():
    model, shape, slo = StepModel(PROFILE), EngineShape(), SLOSpec(ttft_ms_p95=300, e2e_ms_p95=2000)
    low, high = (plan_rate(workload(rate), model, shape, slo, replicas=1)["tried"][0] for rate in (2.0, 14.0))
    assert low["meets_slo"] and low["attainment"]["all"]["attainment"] == 1.0
    assert not high["meets_slo"] and high["attainment"]["ttft_ms_p95"]["attainment"] < 0.95
    assert low["busy"] < high["busy"]
    assert high["ttft_ms_p95"] > low["ttft_ms_p95"] and high["max_waiting"] > low["max_waiting"]


def test_the_plan_is_the_fewest_replicas_that_meet_every_objective():
    model, slo = StepModel(PROFILE), SLOSpec(ttft_ms_p95=300, e2e_ms_p95=2000)
    planned = plan_rate(workload(30.0), model, EngineShape(), slo, price=Price(0.1, 0.4, 0.01), max_replicas=8)
    counts = [t["replicas"] for t in planned["tried"]]
    assert planned["replicas_needed"] == counts[-1] and counts == list(range(1, counts[-1] + 1))
    assert counts[-1] >= 2 and all(not t["meets_slo"] for t in planned["tried"][:-1])
    assert planned["tried"][-1]["meets_slo"] and planned["cost_per_1k_requests_usd"] > 0
    impossible = plan_rate(workload(30.0), model, EngineShape(), SLOSpec(ttft_ms_p95=1), max_replicas=3)
    assert impossible["replicas_needed"] is None and len(impossible["tried"]) == 3


def test_the_plan_shows_how_far_its_attainment_moves_with_the_machines_speed():
    model, shape = StepModel(PROFILE), EngineShape()
    requests = workload(6.0)
    e2es = sorted(r.e2e_ms for r in simulate(requests, model, shape).requests)
    edge = plan_rate(requests, model, shape, SLOSpec(e2e_ms_p95=e2es[len(e2es) // 2]), replicas=1)["tried"][-1]
    band = edge["attainment_if_steps"]
    assert band["faster_5pct"] > edge["attainment"]["all"]["attainment"] > band["slower_5pct"]
    roomy = plan_rate(requests, model, shape, SLOSpec(e2e_ms_p95=10 * e2es[-1]), replicas=1)["tried"][-1]
    assert roomy["attainment_if_steps"] == {"faster_5pct": 1.0, "slower_5pct": 1.0}


def test_prefill_follows_the_measured_points():
    profile = {**PROFILE, "prefill": {"base_ms": 0.0, "per_token_ms": 2.7,
                                      "points": [[16, 80.0], [64, 152.0], [256, 480.0], [512, 1500.0]]}}
    model = StepModel(profile)
    assert model.base_ms == 56.0  # the first segment (1.5 ms a token) at zero tokens
    assert model.prefill_ms(40) == 116.0 and model.prefill_ms(384) == 990.0
    assert model.prefill_ms(1) == 57.5  # below the first point: the first segment, extended
    assert model.step_ms(64, 0) == 152.0 and model.step_ms(64, 4) == 26.0 + 96.0


def test_the_step_scale_slows_every_step():
    plain = simulate([one(1.0, 100, 5)], StepModel(PROFILE), EngineShape()).requests[0]
    scaled = simulate([one(1.0, 100, 5)], StepModel(PROFILE), EngineShape(step_scale=1.5)).requests[0]
    assert scaled.ttft_ms == pytest.approx(1.5 * plain.ttft_ms) and scaled.e2e_ms == pytest.approx(1.5 * plain.e2e_ms)
