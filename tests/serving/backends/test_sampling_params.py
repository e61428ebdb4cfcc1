"""The two SamplingParams, the pipeline's (what stages hand an engine) and the engine's (which imports
nothing of ours), declare the same fields with the same defaults: a field added to one only fails here."""

from __future__ import annotations

import dataclasses

from pipeline.protocols import SamplingParams
from serving.backends.local_engine import engine_sampling
from serving.engine.sampling_params import SamplingParams as EngineSampling


def declared(cls: type) -> dict[str, object]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            for f in dataclasses.fields(cls)}


def test_the_two_declarations_agree():
    assert declared(SamplingParams) == declared(EngineSampling)


def test_every_field_reaches_the_engine():
    changed = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
               "presence_penalty": 0.2, "frequency_penalty": 0.3, "seed": 11, "stop_token_ids": (1, 2),
               "ignore_eos": True, "min_tokens": 3, "logprobs": 3, "speculative": False, "output": {"regex": "a+"},
               "n": 3}
    assert set(changed) == set(declared(SamplingParams))  # a new field needs a value here too
    engine = engine_sampling(SamplingParams(**changed))
    assert {name: getattr(engine, name) for name in changed} == changed
