"""A workspace of small pipelines over fake engines, for the evaluator's fast tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.fakes import FakeEngine, FakeEngines

SERVER = """
models:
  smol: {source: models/none, price: {input_per_1k: 1.0, output_per_1k: 2.0}}
  grader: {source: models/none, price: {input_per_1k: 0.5}}
indexes:
  handbook: {}
database: sqlite:///{root}/eval.db
pipelines: pipelines/
auth: {enabled: false}
"""


QA = """
name: qa
slo: {e2e_ms_p95: 60000, max_cost_usd_per_request: 1.0}
stages:
  - {id: context, type: search, with: {index: handbook}}
  - {id: prompt, type: prompt, with: {system: Answer from the sources.}}
  - {id: tok, type: tokenize}
  - {id: gen, type: generate, with: {max_tokens: 64, temperature: 0}}
  - {id: out, type: stream}
  - {id: log, type: audit, always: true, with: {content: full}}
"""


GRADER = """
name: grader
stages:
  - id: prompt
    type: prompt
    with:
      system: Grade 1 to 5.
      user: "Q: {{ tags.question }} A: {{ input }} R: {{ tags.reference }}"
  - {id: tok, type: tokenize, with: {model: grader}}
  - {id: gen, type: generate, with: {max_tokens: 4, temperature: 0}}
  - {id: out, type: stream}
"""


def write_pipelines(root: Path, **files: str) -> Path:
    (root / "pipelines").mkdir(exist_ok=True)
    for name, text in files.items():
        (root / "pipelines" / f"{name}.yaml").write_text(textwrap.dedent(text))
    config = root / "inferline.yaml"
    config.write_text(SERVER.replace("{root}", str(root)))
    return config


def engines(answer: str = "Paris is the capital of France [1].", grade: str = "4") -> FakeEngines:
    return FakeEngines(smol=FakeEngine(answer), grader=FakeEngine(grade))
