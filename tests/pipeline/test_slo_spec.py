"""slo: in a pipeline file: validated with located errors, and dumped back."""

from __future__ import annotations

import textwrap

import pytest

from pipeline.errors import SpecError
from pipeline.loader import dump_pipeline, load_pipeline_text

BASE = """
name: chat
slo: {slo}
stages:
  - {{id: prompt, type: prompt}}
"""


def load(slo: str, registry, catalog):
    return load_pipeline_text(textwrap.dedent(BASE.format(slo=slo)), "p.yaml", registry, catalog)


def test_objectives_load_and_dump_back(registry, catalog):
    loaded = load("{ttft_ms_p95: 800, itl_ms_p95: 120, e2e_ms_p95: 8000, max_cost_usd_per_request: 0.001}",
                  registry, catalog)
    slo = loaded.spec.slo
    assert (slo.ttft_ms_p95, slo.itl_ms_p95, slo.e2e_ms_p95, slo.max_cost_usd_per_request) == (800, 120, 8000, 0.001)
    assert "slo:\n  ttft_ms_p95: 800.0\n" in dump_pipeline(loaded.spec)
    assert load("{e2e_ms_p95: 5000}", registry, catalog).spec.slo.ttft_ms_p95 is None


@pytest.mark.parametrize(("slo", "message"), [
    ("{ttft_ms_p95: fast}", "p.yaml:3:20: slo.ttft_ms_p95: expected a number, got 'fast'"),
    ("{ttft_ms_p95: -5}", "p.yaml:3:20: slo.ttft_ms_p95: should be greater than 0, got -5"),
    ("{ttft_ms: 500}", "p.yaml:3:7: slo.ttft_ms: unknown key 'ttft_ms'; did you mean 'ttft_ms_p95'? (allowed: "
                       "ttft_ms_p95, itl_ms_p95, e2e_ms_p95, max_cost_usd_per_request)"),
    ("{}", "p.yaml:3:6: slo: give at least one objective"),
])
def test_bad_objectives_are_located(slo, message, registry, catalog):
    with pytest.raises(SpecError) as caught:
        load(slo, registry, catalog)
    assert str(caught.value.issues[0]).startswith(message), caught.value.issues
