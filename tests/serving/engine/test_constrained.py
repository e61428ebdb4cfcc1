"""Constrained decoding in the engine, on the real model: output valid by construction, other rows untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.errors import InvalidRequest
from serving.engine.sampling_params import SamplingParams
from tests.serving.engine.model import MODEL

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 40}}}


@pytest.fixture(scope="module")
def engine(loaded_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(MODEL), speculative="ngram"), loaded=loaded_model)


def chat(engine: LLMEngine, text: str) -> list[int]:
    return list(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, return_dict=False))


def test_json_schema_regex_and_choice_hold_in_one_batch_beside_a_free_request(engine):
    extract = chat(engine, "Extract name, age and city: Mary Jones, 35, lives in Bristol.")
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = engine.generate([extract], free)[0].token_ids
    prompts = [extract, chat(engine, "Is water wet? Answer yes or no."), chat(engine, "Give me a date."), extract]
    params = [SamplingParams(max_tokens=80, temperature=0, output={"json_schema": PERSON}),
              SamplingParams(max_tokens=8, temperature=0.8, seed=3, output={"choice": ["yes", "no"]}),
              SamplingParams(max_tokens=20, temperature=0, output={"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}),
              free]
    outputs = engine.generate(prompts, params)
    texts = [engine.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    assert texts[1] in ("yes", "no")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", texts[2])
    assert [o.finish_reason for o in outputs[:3]] == ["stop"] * 3
    assert outputs[3].token_ids == alone  # the unconstrained row is as it is alone
    assert engine.block_manager.num_used_blocks == 0


def test_forced_spans_are_appended_without_sampling(engine):
    # One allowed answer: after the first sampled token the rest is forced, appended without a step each.
    answer = "The answer is certainly yes, without any doubt."
    seq = engine.add_request(chat(engine, "Say something."), SamplingParams(max_tokens=40, temperature=0,
                                                                           output={"choice": [answer]}))
    steps, emitted = 0, []
    while not seq.is_finished:
        emitted += [out.token_id for out in engine.step() if out.seq_id == seq.seq_id]
        steps += 1
    assert emitted == seq.output_token_ids  # every forced token reaches the caller too
    assert engine.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) == answer
    assert seq.finish_reason == "stop"
    assert len(seq.output_token_ids) >= 8 and steps <= 3, (len(seq.output_token_ids), steps)


@pytest.mark.parametrize(("output", "message"), [
    ({"json_schema": {"type": "object", "uniqueItems": True}}, "uniqueItems"),
    ({"json_schema": {"type": "array", "items": {"not": {"type": "string"}}}}, "not"),
    ({"regex": "[a-z"}, "regex"),
    ({"choice": []}, "choice"),
    ({"yaml": "x"}, "exactly one of"),
])
def test_bad_constraints_are_refused_before_queueing(engine, output, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, output=output))
    assert engine.scheduler.num_waiting == 0
