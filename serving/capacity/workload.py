"""Workloads: token-count distributions, Poisson arrivals, and the workload file ``inferline plan`` reads.

A distribution is written ``fixed:64`` (or just ``64``), ``uniform:32,128``, ``normal:100,20``,
``lognormal:100,0.5`` (median, sigma) or ``exponential:100`` (mean); draws are whole numbers
of at least 1. The workload file (YAML)::

    pipeline: chat                 # whose slo: and model the plan uses
    rate: 1.5                      # requests per second; or rates: [0.5, 1.5, 3]
    prompt_tokens: uniform:64,192  # the user message, in the model's tokens
    output_tokens: fixed:48        # max_tokens of each request
    duration_s: 600                # of arrivals, simulated per rate (default 600)
    seed: 1                        # the same seed and duration as an `inferline load` run: the same requests
    extra_prompt_tokens: 0         # tokens the pipeline adds beyond its system prompt (retrieved documents)
    profile: profiles/smol.json    # default: profiles/<model>.json

:func:`requests_for` turns a rate, a duration and a seed into the same list of requests
for ``inferline load`` (which sends them) and ``inferline plan`` (which simulates them).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, field_validator, model_validator

from pipeline.diagnostics import validation_issues
from pipeline.errors import SpecError
from pipeline.yamlsrc import parse

_KINDS = ("fixed", "uniform", "normal", "lognormal", "exponential")


@dataclass(frozen=True, slots=True)
class Distribution:
    """A distribution of token counts, parsed from ``kind:a,b``."""

    kind: Literal["fixed", "uniform", "normal", "lognormal", "exponential"]
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> Distribution:
        """``fixed:64``, ``64``, ``uniform:32,128``, ``normal:100,20``, ``lognormal:100,0.5``, ``exponential:100``."""
        kind, _, rest = str(text).strip().partition(":")
        if not rest:
            kind, rest = "fixed", kind
        try:
            params = tuple(float(p) for p in rest.split(","))
        except ValueError:
            raise ValueError(f"{text!r}: the parameters of a distribution are numbers (e.g. uniform:32,128)") from None
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exponential": 1}
        if kind not in arity:
            raise ValueError(f"{text!r}: unknown distribution {kind!r} (one of {', '.join(_KINDS)})")
        if len(params) != arity[kind]:
            raise ValueError(f"{text!r}: {kind} takes {arity[kind]} parameter(s)")
        if any(not math.isfinite(p) or p < 0 for p in params) or params[0] <= 0:
            raise ValueError(f"{text!r}: parameters must be positive")
        if kind == "uniform" and params[1] < params[0]:
            raise ValueError(f"{text!r}: uniform:LOW,HIGH needs LOW <= HIGH")
        return cls(kind, params)  # type: ignore[arg-type]

    def sample(self, rng: random.Random) -> int:
        a = self.params[0]
        b = self.params[1] if len(self.params) > 1 else 0.0
        if self.kind == "fixed":
            value = a
        elif self.kind == "uniform":
            value = rng.uniform(a, b)
        elif self.kind == "normal":
            value = rng.gauss(a, b)
        elif self.kind == "lognormal":
            value = a * math.exp(rng.gauss(0.0, b))
        else:
            value = rng.expovariate(1.0 / a)
        return max(1, round(value))

    @property
    def mean(self) -> float:
        """The mean before rounding and clipping at 1."""
        a = self.params[0]
        if self.kind == "uniform":
            return (a + self.params[1]) / 2
        if self.kind == "lognormal":
            return a * math.exp(self.params[1] ** 2 / 2)
        return a

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(f'{p:g}' for p in self.params)}"


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One request of a workload: when it arrives (seconds from the start) and its sizes."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of *rate* per second (exponential gaps)."""
    if rate <= 0 or duration_s <= 0:
        return []
    times, t = [], rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def requests_for(rate: float, duration_s: float, prompt_tokens: Distribution, output_tokens: Distribution,
                 seed: int = 0) -> list[LoadRequest]:
    """The requests of one run: Poisson arrivals, then each one's sizes, all from *seed*."""
    rng = random.Random(seed)
    arrivals = poisson_arrivals(rate, duration_s, rng)
    sizes = random.Random(seed + 1)  # apart from the arrivals, so that a rate change keeps the sizes' stream
    return [LoadRequest(i, t, prompt_tokens.sample(sizes), output_tokens.sample(sizes))
            for i, t in enumerate(arrivals)]


class WorkloadSpec(BaseModel):
    """The workload file of ``inferline plan``."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    rate: PositiveFloat | None = None
    rates: list[PositiveFloat] = Field(default_factory=list)
    prompt_tokens: str
    output_tokens: str
    duration_s: PositiveFloat = 600.0
    seed: int = 0
    extra_prompt_tokens: int = Field(0, ge=0)
    profile: str | None = None
    #: The most replicas the plan tries before it gives up.
    max_replicas: int = Field(16, ge=1, le=1024)

    @field_validator("prompt_tokens", "output_tokens", mode="before")
    @classmethod
    def _distribution(cls, value: object) -> str:
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = f"fixed:{value:g}"
        if not isinstance(value, str):
            raise ValueError("expected a distribution such as fixed:64, uniform:32,128 or normal:100,20")
        Distribution.parse(value)
        return value

    @model_validator(mode="after")
    def _some_rate(self) -> WorkloadSpec:
        if self.rate is None and not self.rates:
            raise ValueError("give rate: (requests per second) or rates: [...]")
        return self

    @property
    def all_rates(self) -> list[float]:
        return ([self.rate] if self.rate is not None else []) + [r for r in self.rates if r != self.rate]


def load_workload(path: str | Path) -> WorkloadSpec:
    """Read a workload file; raises :class:`SpecError` with every problem, located."""
    file = str(path)
    src, issues = parse(file, Path(path).read_text(encoding="utf-8"))
    if src is None or issues:
        raise SpecError(issues)
    if not isinstance(src.data, dict):
        raise SpecError([src.issue((), "a workload is a mapping: pipeline:, rate:, prompt_tokens:, output_tokens:")])
    try:
        return WorkloadSpec.model_validate(src.data)
    except ValidationError as exc:
        raise SpecError(validation_issues(src, exc, WorkloadSpec, src.data)) from None
