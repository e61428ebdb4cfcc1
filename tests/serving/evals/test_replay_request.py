"""Rebuilding an audited request from its record: what a replay sends again, and what it says it cannot."""

from __future__ import annotations

import json

from serving.evals.replay_request import generate_config, rebuild

SERVED = "name: s\nstages:\n  - {id: g, type: generate, with: {max_tokens: 64, temperature: 0.7}}\n"


def record(**fields):
    return {"id": "r1", "input_content": "Hello?", "params": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 64,
                                                                "seed": None}, "tags": None} | fields


def notes(request):
    return {note["what"]: note["why"] for note in request.not_restored}


def test_only_what_the_caller_set_is_sent_again():
    served = generate_config(SERVED)
    params = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 20, "seed": 3}
    request = rebuild(record(params=params, tags={"product": "acme"}), served, served)
    assert request.text == "Hello?" and request.params == {"temperature": 0.0, "max_tokens": 20, "seed": 3}
    assert request.tags == {"product": "acme"} and not notes(request) and request.body() == {
        "input": "Hello?", "temperature": 0.0, "max_tokens": 20, "seed": 3}
    assert rebuild(record(), served, served).params == {}  # all the pipeline's own: the candidate's apply


def test_a_chat_of_several_turns_is_sent_whole():
    served = generate_config(SERVED)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "three?"}]
    request = rebuild(record(input_content=json.dumps(chat), params={"temperature": 0.7, "turns": 3}), served, served)
    assert request.text == "three?" and request.body() == {"messages": chat} and not notes(request)
    broken = rebuild(record(input_content="three?", params={"turns": 3}), served, served)
    assert broken.body() == {"input": "three?"} and "a chat of 3 turns" in notes(broken)["earlier turns"]


def test_what_the_candidate_refuses_or_caps_is_named():
    served = generate_config(SERVED)
    strict = generate_config(SERVED.replace("temperature: 0.7}", "temperature: 0.7, client_params: [max_tokens]}")
                             .replace("max_tokens: 64", "max_tokens: 128"))
    request = rebuild(record(params={"temperature": 0.0, "top_p": 1.0, "max_tokens": 100, "seed": None}),
                      served, strict)
    assert request.params == {"max_tokens": 100}
    assert notes(request)["temperature"] == "0.0: the candidate does not let callers set it (its own is 0.7)"
    small = generate_config(SERVED.replace("max_tokens: 64", "max_tokens: 16"))
    request = rebuild(record(params={"temperature": 0.7, "top_p": 1.0, "max_tokens": 40, "seed": None}), served, small)
    assert request.params == {} and "over the candidate's limit of 16" in notes(request)["max_tokens"]


def test_n_output_tags_and_an_unknown_version_are_said():
    served = generate_config(SERVED)
    request = rebuild(record(params={"temperature": 0.7, "max_tokens": 64, "n": 3, "output": "json_schema"}),
                      served, served, can_send_n=False)
    said = notes(request)
    assert "the pipeline API answers one" in said["n"] and "keeps its kind only" in said["output"]
    assert "n" not in request.params
    older = {k: v for k, v in record(params={"temperature": 0.7, "user": "alice"}).items() if k != "tags"}
    request = rebuild(older, None, served)  # a record from before tags were kept, of a version not kept
    assert request.tags == {"user": "alice"} and notes(request)["tags"] == "not in the record"
    assert "every recorded value is sent" in notes(request)["sampling"]
    assert rebuild(record(params={"temperature": 0.2}), None, None).params == {"temperature": 0.2}


def test_the_generate_stage_of_a_version():
    assert generate_config(SERVED).temperature == 0.7
    assert generate_config("name: s\nstages: [{id: p, type: prompt}]\n") is None
    assert generate_config("stages: [{type: generate, with: {max_tokens: ten}}]") is None
    assert generate_config("a: &a [*a]") is None


def test_a_workflows_sampling_is_its_answering_llm_steps():
    text = "name: w\nstages:\n  - {id: a, type: llm, with: {max_tokens: 32, temperature: 0.3}}\n"
    config = generate_config(text)
    assert config is not None and (config.max_tokens, config.temperature) == (32, 0.3)
    request = rebuild(record(params={"temperature": 0.0, "max_tokens": 32}), config, config)
    assert request.params == {"temperature": 0.0} and "sampling" not in notes(request)
