"""Loading ``inferline.yaml``: located errors, the repository's own file, and the catalog pipelines see."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cost import Price
from pipeline.errors import SpecError
from serving.config.loader import catalog_of, load_server
from serving.config.server import ServerSpec

ROOT = Path(__file__).parents[3]


def test_server_config_errors_are_located(tmp_path):
    path = tmp_path / "inferline.yaml"
    path.write_text("models:\n  smol:\n    source: models/x\n    dtype: float16\n    prices: {}\n")
    with pytest.raises(SpecError) as info:
        load_server(path)
    found = [str(issue) for issue in info.value.issues]
    assert found == [
        f"{path}:4:12: models.smol.dtype: expected one of 'auto', 'float32', 'bfloat16', 'int8' or 'gguf', "
        "got 'float16'",
        f"{path}:5:5: models.smol.prices: unknown key 'prices'; did you mean 'price'? (allowed: source, backend, "
        "base_url, api_key_env, device, dtype, context_window, replicas, placement, max_imbalance, base_urls, "
        "remote_model, timeout_s, tokenizer, kv_cache, batching, speculative, price, ray)",
    ]


def test_server_config_loads_the_repository_default():
    server = load_server(ROOT / "inferline.yaml")
    assert "smol" in server.models


@pytest.mark.parametrize(("text", "where"), [
    ("models: [a\n", ":2:1: "),  # YAML syntax: located before any setting is read
    ("- a\n- b\n", ":1:1: expected a mapping of settings"),
])
def test_a_server_file_that_is_no_mapping_is_located(tmp_path, text, where):
    path = tmp_path / "inferline.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_server(path)
    assert where in str(info.value.issues[0])


def test_the_catalog_holds_the_names_prices_and_windows_pipelines_are_checked_against():
    server = ServerSpec.model_validate({
        "models": {"smol": {"source": "m", "context_window": 2048, "price": {"input_per_1k": 0.5}},
                   "far": {"backend": "openai", "base_url": "http://a.test/v1"}},
        "indexes": {"handbook": {}}, "embedding_models": {"minilm": {"price": {"input_per_1k": 0.01}}}})
    catalog = catalog_of(server)
    assert list(catalog.models) == ["smol", "far"] and catalog.indexes == frozenset({"handbook"})
    assert (catalog.models["smol"].price, catalog.models["smol"].context_window) == (Price(0.5), 2048)
    assert catalog.models["far"].context_window is None
    assert catalog.embedding_models["minilm"].price == Price(0.01)


def test_the_servers_cap_on_loop_rounds_reaches_the_pipeline_loader(tmp_path):
    from pipeline.loader import load_pipeline_text
    from serving.runtime.workspace import build_registry

    path = tmp_path / "inferline.yaml"
    path.write_text("workflows: {max_rounds: 2}\n")
    server = load_server(path)
    text = ("name: l\nstages:\n  - {id: a, type: split}\n"
            "  - {id: b, type: split, repeat: {from: a, until: \"steps.b.chunks == []\", max: 3}}\n")
    with pytest.raises(SpecError, match="at most 2 rounds"):
        load_pipeline_text(text, "l.yaml", build_registry(server), catalog_of(server))
