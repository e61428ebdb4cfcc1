"""The server's embedding models over the real all-MiniLM-L6-v2: loaded once, on demand, and refusing long texts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeline.errors import BackendError, InvalidInput
from pipeline.protocols import EmbeddingBackend
from serving.backends.embedders import EmbedderPool
from serving.config.server import ServerSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    server = ServerSpec.model_validate({"embedding_models": {
        "minilm": {"device": "cpu", "batch_size": 2},
        "elsewhere": {"source": "no-such-folder"}}})
    return EmbedderPool(server, tmp_path_factory.mktemp("root"))


async def test_a_model_is_loaded_once_however_many_ask_at_once(pool):
    first, second = await asyncio.gather(pool.get("minilm"), pool.get("minilm"))
    assert first is second and isinstance(first, EmbeddingBackend)
    assert (first.dimensions, first.max_input_tokens) == (384, 256)
    await pool.start(["minilm"])
    assert await pool.get("minilm") is first


async def test_batches_keep_the_order_and_count_special_tokens(pool):
    backend = await pool.get("minilm")
    texts = ["one", "two words", "three words here", "four"]  # two batches of batch_size 2
    result = await backend.embed(texts)
    assert result.vectors.shape == (4, 384) and result.vectors.dtype == np.float32
    alone = np.stack([(await backend.embed([t])).vectors[0] for t in texts])
    np.testing.assert_allclose(result.vectors, alone, atol=1e-5)
    assert result.num_tokens == (3, 4, 5, 3)  # [CLS] ... [SEP]


async def test_a_text_past_the_model_is_refused_by_index(pool):
    backend = await pool.get("minilm")
    with pytest.raises(InvalidInput, match=r"^input\[1\]: 302 tokens, over the 256 that embedding model 'minilm'"):
        await backend.embed(["short", "word " * 300])


async def test_unknown_and_missing_models_are_backend_errors(pool):
    with pytest.raises(BackendError, match=r"no embedding model 'nope' \(embedding_models: minilm, elsewhere\)"):
        await pool.get("nope")
    with pytest.raises(BackendError, match=r"embedding model 'elsewhere' did not load: .*nothing is downloaded"):
        await pool.get("elsewhere")
