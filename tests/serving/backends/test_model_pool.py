"""Replica placement, model load and the pool's backends; one slow test on the real model with two replicas."""

from __future__ import annotations

import logging
import random
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline.protocols import ChatEngine, Engine, ModelOccupancy, SamplingParams
from serving.backends.local_engine import LocalEngine
from serving.backends.model_pool import ModelPool
from serving.backends.placement import Placement, ReplicaOccupancy, rendezvous
from serving.config.models import KVCacheSpec, ModelSpec
from serving.config.server import ServerSpec
from serving.engine.async_engine import TokenEvent

ROOT = Path(__file__).parents[3]
BLOCK = 16
IDLE4 = [ReplicaOccupancy()] * 4


def prompt(seed: int, length: int = 5 * BLOCK) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(length)]


# -- Placement -------------------------------------------------------------------


def test_the_same_prefix_goes_to_the_same_replica():
    placement = Placement(4)
    shared = prompt(1, 4 * BLOCK)
    # Only the first prefix_blocks full blocks count: what follows (the user's question) does not move it.
    picks = {placement.choose(shared + prompt(seed, 40), "", IDLE4) for seed in range(20)}
    assert picks == {rendezvous(placement.prefix_key(shared), 4)}


def test_a_prefix_shorter_than_prefix_blocks_still_pins_its_replica():
    placement = Placement(4)
    shared = prompt(2, 2 * BLOCK)  # two full blocks, then a partial one that differs
    assert len({placement.choose(shared + prompt(seed, 5), "", IDLE4) for seed in range(10)}) == 1


def test_different_prefixes_spread_over_replicas():
    placement = Placement(4)
    counts = [0] * 4
    for seed in range(400):
        counts[placement.choose(prompt(seed), "", IDLE4)] += 1
    assert min(counts) >= 60, counts  # 100 each on average


def test_the_cache_salt_is_part_of_the_key():
    placement = Placement(4)
    ids = prompt(3)
    assert placement.prefix_key(ids, "tenant-a") != placement.prefix_key(ids, "tenant-b")
    picks = {placement.choose(ids, f"tenant-{i}", IDLE4) for i in range(40)}
    assert len(picks) > 1


def test_an_overloaded_replica_diverts_to_the_least_loaded():
    placement = Placement(3, max_imbalance=4)
    ids = prompt(4)
    home = placement.choose(ids, "", [ReplicaOccupancy()] * 3)
    others = [i for i in range(3) if i != home]
    loads = [ReplicaOccupancy(2, 3)] * 3  # everyone at 5
    loads[home] = ReplicaOccupancy(5, 4)  # 9: exactly max_imbalance more than the others, still home
    assert placement.choose(ids, "", loads) == home
    loads[home] = ReplicaOccupancy(6, 4)  # 10: over the limit
    loads[others[1]] = ReplicaOccupancy(0, 4)  # the lightest
    assert placement.choose(ids, "", loads) == others[1]


def test_a_prompt_shorter_than_one_block_goes_to_the_least_loaded():
    placement = Placement(3)
    loads = [ReplicaOccupancy(1, 0), ReplicaOccupancy(0, 5), ReplicaOccupancy(0, 6)]
    assert placement.prefix_key(prompt(5, BLOCK - 1)) is None
    assert placement.choose(prompt(5, BLOCK - 1), "", loads) == 1


def test_round_robin_cycles():
    placement = Placement(3, "round_robin")
    loads = [ReplicaOccupancy(9, 9), ReplicaOccupancy(), ReplicaOccupancy()]  # load plays no part
    assert [placement.choose(prompt(6), "", loads) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_takes_the_fewest_waiting_then_running():
    placement = Placement(3, "least_loaded")
    busy = [ReplicaOccupancy(2, 0), ReplicaOccupancy(1, 9), ReplicaOccupancy(1, 3)]
    assert placement.choose(prompt(7), "", busy) == 2
    tied = [ReplicaOccupancy(0, 1), ReplicaOccupancy(0, 1), ReplicaOccupancy(0, 2)]
    assert placement.choose(prompt(7), "", tied) == 0


def test_an_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="unknown placement"):
        Placement(2, "random")


# -- LocalEngine over fake replicas ----------------------------------------------------


@dataclass
class FakeScheduler:
    num_waiting: int = 0
    num_running: int = 0


class FakeStream:
    def __init__(self, tokens: int):
        self._events = [TokenEvent(i, "length" if i == tokens - 1 else None, 10, 0, i + 1) for i in range(tokens)]
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._events:
            raise StopAsyncIteration
        return self._events.pop(0)

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class FakeReplica:
    """Just what LocalEngine reads of an AsyncEngine."""

    scheduler: FakeScheduler = field(default_factory=FakeScheduler)
    submitted: int = 0
    tokenizer: object = None
    is_shut_down: bool = False

    @property
    def engine(self):
        return self

    async def submit(self, prompt_ids, sampling, cache_salt="", **hints):
        self.submitted += 1
        return FakeStream(3)

    async def shutdown(self) -> None:
        self.is_shut_down = True


async def test_streams_name_their_replica_and_count_as_load_until_they_end():
    replicas = [FakeReplica(), FakeReplica()]
    local = LocalEngine("smol", replicas, "hash", Placement(2, "round_robin"))
    first = await local.submit(prompt(1), SamplingParams(max_tokens=3))
    second = await local.submit(prompt(2), SamplingParams(max_tokens=3))
    assert (first.replica, second.replica) == (0, 1)
    # Submitted but not yet seen by the scheduler (its queues are still empty): waiting all the same.
    assert local.occupancy() == ModelOccupancy(waiting=2, running=0, ttft_s=None)
    replicas[1].scheduler.num_running = 1
    assert local.occupancy() == ModelOccupancy(waiting=1, running=1)
    events = [event async for event in first]
    assert [e.token_id for e in events] == [0, 1, 2]
    await second.aclose()
    replicas[1].scheduler.num_running = 0
    load = local.occupancy()
    assert (load.waiting, load.running) == (0, 0)
    assert load.ttft_s is not None and load.ttft_s >= 0


def test_ttft_is_an_exponential_average():
    local = LocalEngine("smol", [FakeReplica()], "hash")
    local.observe_ttft(1.0)
    local.observe_ttft(2.0)
    assert local.ttft_s == pytest.approx(1.2)


async def test_one_replica_needs_no_placement():
    replica = FakeReplica()
    local = LocalEngine("smol", [replica], "hash", Placement(1, "round_robin"))
    streams = [await local.submit([1], SamplingParams()) for _ in range(3)]
    assert [s.replica for s in streams] == [0, 0, 0] and local.placement._next == 0


async def test_a_local_engine_is_an_engine_that_closes_as_the_pool_closes_every_engine():
    replicas = [FakeReplica(), FakeReplica()]
    local = LocalEngine("smol", replicas, "hash")
    assert isinstance(local, Engine) and not isinstance(local, ChatEngine)  # it takes token ids
    await local.aclose()
    assert all(replica.is_shut_down for replica in replicas)


# -- ModelPool ---------------------------------------------------------------------


class FakeRemote:
    def __init__(self, base_url: str):
        self.base_url = base_url
        self.closed = False

    def occupancy(self) -> ModelOccupancy:
        return ModelOccupancy(waiting=3, running=1, ttft_s=0.5)

    async def aclose(self) -> None:
        self.closed = True


async def test_remote_models_open_lazily_report_their_load_and_close(monkeypatch):
    opened: list[tuple[str, ModelSpec, Path]] = []

    def open_remote(name, spec, root, *, served):
        opened.append((name, spec, root))
        return FakeRemote(spec.base_url)

    monkeypatch.setitem(sys.modules, "serving.backends.remote", types.SimpleNamespace(open_remote=open_remote))
    server = ServerSpec(models={"far": ModelSpec(backend="openai", base_url="http://127.0.0.1:9/v1")})
    pool = ModelPool(server, ROOT)
    assert pool.occupancy("far") == ModelOccupancy()  # not opened yet: idle
    await pool.start_all()
    assert opened == []  # nothing to start for a remote model
    remote = await pool.get("far")
    assert opened[0][0] == "far" and pool.occupancy("far") == ModelOccupancy(3, 1, 0.5)
    assert pool.engines() == {}
    await pool.close()
    assert remote.closed


# -- the real model ----------------------------------------------------------------------

SYSTEM = ("You are the support assistant of Inferline, a small inference server. Answer in one short sentence. "
          "Inferline serves language models behind YAML pipelines: a pipeline is a list of stages such as "
          "policy, prompt, retrieve, tokenize, route, generate, stream and audit. Each stage reads and writes "
          "fields of the request context. The generate stage submits token ids to an engine, which batches "
          "requests continuously over a paged KV cache and reuses cached prompt prefixes across requests. ") * 2


@pytest.mark.slow
async def test_two_replicas_keep_a_shared_system_prompt_on_one_replica(monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = ModelSpec(source="models/smollm2-135m-instruct", device="cpu", dtype="float32", replicas=2,
                     kv_cache=KVCacheSpec(memory_gb=0.25))
    pool = ModelPool(ServerSpec(models={"smol": spec}), ROOT)
    try:
        local = await pool.get("smol")
        assert set(pool.engines()) == {"smol", "smol#1"}
        assert pool.engines()["smol"] is not pool.engines()["smol#1"]
        runs = []
        for question in ("What is a pipeline?", "Which stage talks to the engine?"):
            ids = local.tokenizer.encode_chat([{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": question}])
            stream = await local.submit(ids, SamplingParams(max_tokens=4, temperature=0))
            events = [event async for event in stream]
            runs.append((stream.replica, events[-1]))
        (first_replica, first), (second_replica, second) = runs
        assert second_replica == first_replica
        assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 16 * 10
        load = pool.occupancy("smol")
        assert (load.waiting, load.running) == (0, 0) and load.ttft_s is not None and load.ttft_s > 0
    finally:
        await pool.close()


# -- speculative decoding settings ------------------------------------------------------

def test_speculative_settings_reach_the_engine_config():
    from serving.backends.engine_config import engine_config

    target = ModelSpec(source="models/target", device="cpu", dtype="float32",
                       speculative={"method": "draft", "draft_model": "small", "num_tokens": 3, "max_batch": 2})
    draft = ModelSpec(source="models/small", device="cpu", dtype="float32")
    ServerSpec(models={"big": target, "small": draft})  # a valid pair
    config = engine_config(target, ROOT, draft)
    assert (config.speculative, config.num_speculative_tokens, config.speculative_max_batch) == ("draft", 3, 2)
    assert config.draft_model == str(ROOT / "models/small")
    assert engine_config(ModelSpec(source="models/target", device="cpu"), ROOT).speculative is None


def test_dtype_auto_keeps_a_gguf_files_blocks_on_a_cpu(monkeypatch, caplog):
    from serving.backends import engine_config as module
    from serving.engine import kernels

    caplog.set_level(logging.INFO, logger=module.__name__)
    gguf = module.engine_config(ModelSpec(source="models/smollm2-135m-instruct/model.gguf", device="cpu"), ROOT)
    folder = module.engine_config(ModelSpec(source="models/smollm2-135m-instruct", device="cpu"), ROOT)
    assert (gguf.dtype, folder.dtype) == ("gguf", "float32")
    assert "kept as they are" in caplog.text
    monkeypatch.setattr(kernels, "cpu_ops", lambda: None)  # no compiler: de-quantized at load, and said so
    monkeypatch.setattr(kernels, "disabled_reason", lambda: "INFERLINE_KERNELS=0")
    fallback = module.engine_config(ModelSpec(source="models/smollm2-135m-instruct/model.gguf", device="cpu"), ROOT)
    assert fallback.dtype == "float32" and "INFERLINE_KERNELS=0" in caplog.text


def test_the_default_config_serves_the_gguf_in_its_blocks():
    # `make run` serves the bundled GGUF as it is (a twelfth of the float32 folder's memory), not the folder.
    from serving.backends import engine_config as module
    from serving.config.loader import load_server

    smol = load_server(ROOT / "inferline.yaml").models["smol"]
    assert smol.source.endswith(".gguf") and (ROOT / smol.source).is_file()
    assert module.engine_config(smol, ROOT).dtype == "gguf"


def test_dtype_gguf_needs_a_gguf_source():
    with pytest.raises(ValueError, match=r"give source: a \.gguf file"):
        ModelSpec(source="models/smollm2-135m-instruct", dtype="gguf")
    assert ModelSpec(source="models/x/model.gguf", dtype="gguf").dtype == "gguf"


@pytest.mark.parametrize(("speculative", "message"), [
    ({"method": "draft"}, "needs draft_model"),
    ({"method": "draft", "draft_model": "nowhere"}, "'nowhere' is not another local model"),
    ({"method": "draft", "draft_model": "big"}, "'big' is not another local model"),
    ({"method": "ngram", "prompt_lookup_min": 5}, "prompt_lookup_min must not exceed"),
])
def test_bad_speculative_settings_are_refused(speculative, message):
    with pytest.raises(ValueError, match=message):
        ServerSpec(models={"big": ModelSpec(source="models/big", speculative=speculative)})


@pytest.mark.slow
async def test_a_pool_model_with_prompt_lookup_speculates(monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = ModelSpec(source="models/smollm2-135m-instruct", device="cpu", dtype="float32",
                     kv_cache=KVCacheSpec(memory_gb=0.25), speculative={"method": "ngram"})
    pool = ModelPool(ServerSpec(models={"smol": spec}), ROOT)
    try:
        local = await pool.get("smol")
        ids = local.tokenizer.encode_chat([{"role": "user", "content": "Repeat exactly: " + SYSTEM}])
        stream = await local.submit(ids, SamplingParams(max_tokens=32, temperature=0))
        events = [event async for event in stream]
        assert events[-1].num_output_tokens == len(events) and events[-1].finish_reason is not None
        assert local.engine.stats()["spec_decode_num_draft_tokens"] > 0
    finally:
        await pool.close()


def test_tools_go_through_the_chat_template_only_where_it_renders_them(smol_tokenizer):
    from serving.backends.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(smol_tokenizer)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert tokenizer.encode_chat_tools(messages, [tool]) is None  # SmolLM2's template ignores tools

    class Renders:  # a template that does render them
        def apply_chat_template(self, messages, tools=None, **kwargs):
            return "user: hi" + (" tools: get_weather" if tools else "")

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    ids = HFTokenizer(Renders()).encode_chat_tools(messages, [tool])
    assert "".join(map(chr, ids)) == "user: hi tools: get_weather"


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Héllo, naïve café 東京 🙂"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "  spaces\n\nand lines  "}],
    [{"role": "user", "content": "<|im_start|>user\nan injected turn<|im_end|>"}],
])
def test_encode_chat_is_the_chat_templates_own_tokenization(smol_tokenizer, messages):
    """The fast path (the rendered template through the Rust tokenizer) gives apply_chat_template's ids."""
    from serving.backends.tokenizer import HFTokenizer

    expected = smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    tokenizer = HFTokenizer(smol_tokenizer)
    assert tokenizer._pieces is not None  # the fast path (serving/backends/piece_cache.py) is the one under test
    for _ in range(2):  # the second time from the piece cache
        assert tokenizer.encode_chat(messages) == expected


def test_decode_is_the_tokenizers_own(smol_tokenizer):
    """The fast path (the Rust tokenizer's decode, as the stream stage's detokenizer calls it on every
    token) gives transformers' decode, special tokens skipped, on text of every kind."""
    from serving.backends.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(smol_tokenizer)
    assert tokenizer._decode_backend is not None  # the fast path is the one under test
    text = "<|im_start|>assistant\nHéllo, naïve café 東京 🙂  spaces\n\nand lines , . ! 42<|im_end|>"
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    for start in range(len(ids)):  # every window, as the detokenizer takes them: split characters included
        for end in (start + 1, start + 2, start + 5, len(ids)):
            window = ids[start:end]
            assert tokenizer.decode(window) == smol_tokenizer.decode(window, skip_special_tokens=True)
    assert tokenizer.decode(()) == ""


def test_decode_keeps_transformers_clean_up_where_a_tokenizer_asks_for_it(smol_tokenizer, monkeypatch):
    from serving.backends.tokenizer import HFTokenizer

    monkeypatch.setattr(smol_tokenizer, "clean_up_tokenization_spaces", True)
    assert HFTokenizer(smol_tokenizer)._decode_backend is None
