"""Rerankers through the real code paths: a tiny cross-encoder built here, and the bundled model as an ``llm``
reranker on the real engine."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipeline.context import RequestContext
from pipeline.errors import BackendError
from pipeline.events import Done
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Catalog, ModelInfo, RerankerInfo, Resources
from pipeline.runner import Pipeline, Runner
from serving.backends.rerankers import RerankerPool
from serving.config.server import RerankerSpec, ServerSpec
from stages.audit import AuditConfig, build_record
from stages.rerank import rerank, yes_probability
from tests.fakes import FakeIndex

ROOT = Path(__file__).parents[3]
WORDS = ["plus", "costs", "refunds", "within", "days", "how", "much", "is", "the", "plan", "price"]


def tiny_cross_encoder(folder: Path) -> Path:
    """A randomly initialised one-layer BERT with one output: a CrossEncoder's shape, saved as one is."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    folder.mkdir(parents=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "$", "8", "21", "."]) + "\n")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab.read_text().split()), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(folder)
    BertTokenizer(str(vocab)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cross_encoder_folder(tmp_path_factory) -> Path:
    return tiny_cross_encoder(tmp_path_factory.mktemp("rerankers") / "tiny-ce")


@pytest.mark.slow
async def test_a_cross_encoder_from_its_folder_reorders_the_candidates(registry, cross_encoder_folder):
    from sentence_transformers import CrossEncoder

    server = ServerSpec(rerankers={"tiny": RerankerSpec(source=cross_encoder_folder.name, device="cpu")})
    pool = RerankerPool(server, cross_encoder_folder.parent)
    catalog = Catalog(indexes=frozenset({"handbook"}), rerankers={"tiny": RerankerInfo("tiny")})
    yaml_text = """
    name: rag
    stages:
      - {id: context, type: retrieve, with: {index: handbook, top_k: 1, rerank: {model: tiny, top_n: 2}}}
    """
    loaded = load_pipeline_text(textwrap.dedent(yaml_text), "rag.yaml", registry, catalog)
    index = FakeIndex()
    pipeline = Pipeline(loaded, Resources(catalog, indexes={"handbook": index}, rerankers=pool))
    ctx = RequestContext.from_text("rag", "How much is the Plus plan?")
    assert isinstance(await Runner().run(pipeline, ctx), Done)
    assert index.calls[0][1] == 2  # top_n candidates searched for, top_k kept
    model = CrossEncoder(str(cross_encoder_folder), device="cpu")
    passages = ["Billing\n\nPlus costs $8.", "Refunds\n\nRefunds within 21 days."]
    expected = model.predict([("How much is the Plus plan?", p) for p in passages])
    best = ["billing#3", "refunds#9"][int(expected.argmax())]
    record = build_record(ctx, AuditConfig())["retrieval"]
    assert record["rerank"]["model"] == "tiny" and record["rerank"]["ids"][0] == best
    assert record["rerank"]["scores"] == sorted((round(float(s), 4) for s in expected), reverse=True)
    assert [d.id for d in ctx.documents] == [best] and record["ids"] == [best]
    assert (await pool.get("tiny")) is (await pool.get("tiny"))  # loaded once


async def test_a_missing_cross_encoder_folder_is_a_clear_error(tmp_path):
    pool = RerankerPool(ServerSpec(rerankers={"ce": RerankerSpec(source="nowhere")}), tmp_path)
    with pytest.raises(BackendError, match=r"no model at .*nowhere.*nothing is downloaded"):
        await pool.get("ce")
    with pytest.raises(BackendError, match="no cross-encoder reranker 'other'"):
        await pool.get("other")


def test_yes_probability_reads_the_first_tokens_candidates():
    words = {1: "Yes", 2: " no", 3: "maybe", 4: "y"}
    decode = lambda ids: words[ids[0]]  # noqa: E731
    assert yes_probability([(1, -0.1), (2, -2.0), (3, -3.0)], decode) == pytest.approx(
        0.9048 / (0.9048 + 0.1353), abs=1e-3)
    assert yes_probability([(3, -0.1)], decode) is None


@pytest.mark.slow
async def test_the_llm_reranker_scores_every_passage_in_shared_engine_batches(monkeypatch):
    from serving.backends.model_pool import ModelPool
    from serving.config.models import KVCacheSpec, ModelSpec

    monkeypatch.chdir(ROOT)
    spec = ModelSpec(source="models/smollm2-135m-instruct", device="cpu", dtype="float32",
                     kv_cache=KVCacheSpec(memory_gb=0.25))
    pool = ModelPool(ServerSpec(models={"smol": spec}), ROOT)
    catalog = Catalog(models={"smol": ModelInfo("smol")}, rerankers={"judge": RerankerInfo("judge", "llm", "smol")})
    passages = ["The Plus plan costs $8 per user per month.", "Press Ctrl+Shift+K to open the command palette.",
                "Refunds are paid within 21 days of a yearly renewal.", "The desktop app checks for updates."]
    try:
        engine = await pool.get("smol")
        before = engine.engine.stats()["prefill_step_seconds"]["count"]
        result = await rerank(Resources(catalog, engines=pool), "judge", "How much is the Plus plan?", passages)
        steps = engine.engine.stats()["prefill_step_seconds"]["count"] - before
    finally:
        await pool.close()
    assert len(result.scores) == 4 and all(0.0 <= s <= 1.0 for s in result.scores)
    assert result.model == "smol" and result.input_tokens > 4 * 40 and result.output_tokens == 4
    assert steps < len(passages), steps  # the four prompts were prefilled together, not one after another
