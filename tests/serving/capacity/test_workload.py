"""Workloads: token-count distributions, the Poisson arrival process, and the workload file."""

from __future__ import annotations

import random
import statistics

import pytest
from scipy import stats

from pipeline.errors import SpecError
from serving.capacity.workload import Distribution, load_workload, poisson_arrivals, requests_for


@pytest.mark.parametrize(("text", "kind", "params"), [
    ("64", "fixed", (64.0,)), ("fixed:64", "fixed", (64.0,)), ("uniform:32,128", "uniform", (32.0, 128.0)),
    ("normal:100,20", "normal", (100.0, 20.0)), ("lognormal:100,0.5", "lognormal", (100.0, 0.5)),
    ("exponential:50", "exponential", (50.0,)),
])
def test_distributions_parse(text, kind, params):
    dist = Distribution.parse(text)
    assert (dist.kind, dist.params) == (kind, params) and Distribution.parse(str(dist)) == dist


@pytest.mark.parametrize(("text", "message"), [
    ("zipf:3", "unknown distribution 'zipf'"), ("uniform:5", "takes 2 parameter"), ("uniform:9,3", "LOW <= HIGH"),
    ("fixed:0", "positive"), ("normal:a,b", "are numbers"),
])
def test_bad_distributions_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        Distribution.parse(text)


def test_draws_are_whole_positive_and_centred():
    rng = random.Random(3)
    for text, mean in (("uniform:32,128", 80), ("normal:100,20", 100), ("exponential:50", 50)):
        draws = [Distribution.parse(text).sample(rng) for _ in range(5000)]
        assert all(isinstance(d, int) and d >= 1 for d in draws)
        assert statistics.fmean(draws) == pytest.approx(mean, rel=0.05)
    assert {Distribution.parse("fixed:7").sample(rng) for _ in range(10)} == {7}
    assert Distribution.parse("lognormal:100,0.5").mean == pytest.approx(100 * 1.1331, rel=1e-3)


def test_arrivals_are_a_poisson_process_at_the_rate():
    rate, duration = 20.0, 500.0
    times = poisson_arrivals(rate, duration, random.Random(11))
    assert times == sorted(times) and times[0] > 0 and times[-1] < duration
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01  # exponential gaps of mean 1/rate
    assert len(times) / duration == pytest.approx(rate, rel=0.05)
    per_second = [sum(1 for t in times if s <= t < s + 1) for s in range(int(duration))]
    assert statistics.variance(per_second) == pytest.approx(statistics.fmean(per_second), rel=0.2)  # Poisson counts
    assert poisson_arrivals(0, 10, random.Random(1)) == []


def test_the_same_seed_gives_the_same_requests():
    prompt, output = Distribution.parse("uniform:10,20"), Distribution.parse("fixed:5")
    first = requests_for(2.0, 30, prompt, output, seed=4)
    assert first == requests_for(2.0, 30, prompt, output, seed=4) != requests_for(2.0, 30, prompt, output, seed=5)
    assert [r.index for r in first] == list(range(len(first))) and {r.output_tokens for r in first} == {5}


def test_a_workload_file_is_validated_with_locations(tmp_path):
    good = tmp_path / "w.yaml"
    good.write_text("pipeline: chat\nrates: [0.5, 1]\nprompt_tokens: uniform:32,96\noutput_tokens: 24\n")
    workload = load_workload(good)
    assert workload.all_rates == [0.5, 1.0] and workload.duration_s == 600 and workload.seed == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("pipeline: chat\nprompt_tokens: zipf:2\noutput_tokens: 24\nrate: -1\nburst: 3\n")
    with pytest.raises(SpecError) as caught:
        load_workload(bad)
    lines = [str(issue) for issue in caught.value.issues]
    assert any(line.startswith(f"{bad}:2:16: prompt_tokens: ") and "unknown distribution 'zipf'" in line
               for line in lines), lines
    assert any(line.startswith(f"{bad}:4:7: rate: ") for line in lines)
    assert any(line.startswith(f"{bad}:5:1: burst: unknown key 'burst'") for line in lines)
