"""GGUF block formats served as they are (serving/engine/blocks.py, kernels/block_linear.cpp): the kernel against
the float32 reference on files the ``gguf`` package writes, the loader's row order, and the bundled model in
each format answering the README's question."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from serving.engine import blocks
from serving.engine.blocks import BlockRows, BlockWeight, block_embedding, block_linear, read_gguf
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.errors import EngineError
from serving.engine.gguf_file import GGUFFile
from serving.engine.kernels import cpu_ops
from serving.engine.models import load_model
from serving.engine.sampling_params import SamplingParams
from tests.serving.engine.model import MODEL

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the C++ kernels are not built")

FORMATS = ("Q8_0", "Q4_0", "Q4_1")
OUT, IN = 40, 96  # 40 outputs: two full groups of 16 lanes (AVX-512) or five of 8 (AVX2), and a partial one
GGUF_MODEL = MODEL / "model.gguf"  # Q4_1, its embedding Q8_0


def _weight(rows: int, cols: int, seed: int) -> np.ndarray:
    generator = np.random.default_rng(seed)
    # Rows of very different magnitudes, an all-zero row, and an offset so that Q4_1's minimum matters.
    weight = generator.standard_normal((rows, cols)).astype(np.float32) * np.logspace(-2, 1, rows)[:, None]
    weight[3] = 0
    weight[5] += 2.0
    return weight.astype(np.float32)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` of a Q or K weight (convert_hf_to_gguf.py): rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, str]], architecture: str = "llama") -> None:
    """A GGUF file of *tensors* (name: float32 values, type), quantized by the ``gguf`` package."""
    writer = gguf.GGUFWriter(path, architecture)
    for name, (values, qtype) in tensors.items():
        kind = gguf.GGMLQuantizationType[qtype]
        data = values if qtype == "F32" else quantize(values, kind)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _stored(values: np.ndarray, qtype: str) -> torch.Tensor:
    """The float32 weight a file of *values* in *qtype* holds: the ``gguf`` package's own round trip."""
    kind = gguf.GGMLQuantizationType[qtype]
    stored = np.asarray(dequantize(quantize(values, kind), kind), dtype=np.float32)
    return torch.from_numpy(stored.reshape(values.shape))


@pytest.fixture(scope="module", params=FORMATS)
def random_file(request, tmp_path_factory) -> tuple[str, dict[str, np.ndarray], Path]:
    qtype = request.param
    values = {"token_embd.weight": _weight(OUT, IN, 1), "blk.0.ffn_down.weight": _weight(OUT, IN, 2),
              "blk.0.attn_q.weight": _weight(32, IN, 3), "blk.0.attn_norm.weight": _weight(8, IN, 4)[0]}
    path = tmp_path_factory.mktemp("gguf") / f"random-{qtype}.gguf"
    _write(path, {"token_embd.weight": (values["token_embd.weight"], qtype),
                  "blk.0.ffn_down.weight": (values["blk.0.ffn_down.weight"], qtype),
                  "blk.0.attn_q.weight": (_permute(values["blk.0.attn_q.weight"], 4), qtype),
                  "blk.0.attn_norm.weight": (values["blk.0.attn_norm.weight"], "F32")})
    return qtype, values, path


# -- the kernel against the float32 reference ------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 70])
def test_the_kernel_equals_x_times_the_dequantized_weight(random_file, rows):
    qtype, values, path = random_file
    state, _ = read_gguf(path, num_heads=4, num_kv_heads=4)
    rows_of_blocks = state["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(rows_of_blocks, BlockRows) and rows_of_blocks.format == qtype
    weight = rows_of_blocks.pack()
    reference = _stored(values["blk.0.ffn_down.weight"], qtype)
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(OUT)
    torch.testing.assert_close(block_linear(x, weight, None), x @ reference.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(block_linear(x, weight, bias), x @ reference.T + bias, rtol=1e-4, atol=1e-4)


def test_the_packed_weight_keeps_the_files_size_and_values(random_file):
    qtype, values, path = random_file
    state, _ = read_gguf(path, num_heads=4, num_kv_heads=4)
    weight = state["model.embed_tokens.weight"].pack()
    reference = _stored(values["token_embd.weight"], qtype)
    lanes = torch.ops.inferline.block_lanes()
    bytes_per_block = blocks.FORMATS[qtype][1]
    assert weight.num_bytes == -(-OUT // lanes) * lanes * IN // 32 * bytes_per_block  # the file's bytes, padded
    torch.testing.assert_close(weight.dequantize(), reference, rtol=1e-6, atol=1e-7)
    ids = torch.tensor([0, 17, 3, OUT - 1, 17])
    torch.testing.assert_close(block_embedding(ids, weight), reference[ids], rtol=1e-6, atol=1e-7)


def test_q_and_k_rows_come_back_in_hugging_faces_order(random_file):
    qtype, values, path = random_file
    state, _ = read_gguf(path, num_heads=4, num_kv_heads=4)
    q = state["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(q.pack().dequantize(), _stored(values["blk.0.attn_q.weight"], qtype),
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state["model.layers.0.input_layernorm.weight"],
                               torch.from_numpy(values["blk.0.attn_norm.weight"]))


def test_other_architectures_keep_the_files_row_order(tmp_path):
    values = _weight(32, IN, 7)
    path = tmp_path / "qwen.gguf"
    _write(path, {"token_embd.weight": (_weight(16, IN, 8), "Q8_0"), "blk.0.attn_q.weight": (values, "Q8_0")},
           architecture="qwen2")
    state, _ = read_gguf(path, num_heads=4, num_kv_heads=4)
    torch.testing.assert_close(state["model.layers.0.self_attn.q_proj.weight"].pack().dequantize(),
                               _stored(values, "Q8_0"), rtol=1e-6, atol=1e-7)


def test_types_without_a_kernel_are_dequantized_and_fused_weights_of_mixed_types_too(tmp_path):
    gate, up = _weight(32, IN, 9), _weight(32, IN, 10)
    path = tmp_path / "mixed.gguf"
    _write(path, {"token_embd.weight": (_weight(16, IN, 8), "Q8_0"), "blk.0.ffn_gate.weight": (gate, "Q4_1"),
                  "blk.0.ffn_up.weight": (up, "F16")})
    state, _ = read_gguf(path, num_heads=4, num_kv_heads=4)
    assert state["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    fused = blocks.concat([state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]])
    assert isinstance(fused, torch.Tensor)  # Q4_1 and F16 cannot share blocks: both float32
    torch.testing.assert_close(fused, torch.cat([_stored(gate, "Q4_1"), _stored(up, "F16")]), rtol=1e-6, atol=1e-7)
    same = blocks.concat([state["model.layers.0.mlp.gate_proj.weight"]] * 2)
    assert isinstance(same, BlockRows) and same.shape == (64, IN)


@pytest.mark.parametrize("which", ["bundled", "random"])
def test_the_tensor_table_and_metadata_equal_the_gguf_packages(which, random_file):
    path = GGUF_MODEL if which == "bundled" else random_file[2]
    ours, theirs = GGUFFile(path, ["tokenizer.chat_template"]), gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.type == int(reference.tensor_type)
        assert list(mine.shape) == [int(n) for n in reversed(reference.shape)]
        assert np.array_equal(mine.data.reshape(-1), np.asarray(reference.data).view(np.uint8).reshape(-1))
    assert ours.values["general.architecture"] == reference_field(theirs, "general.architecture")
    assert ours.values.get("tokenizer.chat_template") == reference_field(theirs, "tokenizer.chat_template")


def reference_field(reader, name: str):
    field = reader.get_field(name)
    return None if field is None else field.contents()


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(EngineError, match="is not a GGUF file"):
        GGUFFile(path)


def test_the_kernel_refuses_what_it_cannot_read():
    lanes = torch.ops.inferline.block_lanes()
    x, packed = torch.randn(2, 64), torch.zeros(-(-16 // lanes), 2 * lanes * 34, dtype=torch.uint8)  # Q8_0, n 16
    ops = torch.ops.inferline
    with pytest.raises(RuntimeError, match="not one of Q4_0"):
        ops.block_linear(x, packed, 6, 16, 64, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.block_linear(torch.randn(2, 48), packed, 8, 16, 48, None)
    with pytest.raises(RuntimeError, match="block_pack's layout"):
        ops.block_linear(x, packed, 2, 16, 64, None)  # Q4_0's blocks are 18 bytes, not 34
    with pytest.raises(RuntimeError, match="out of range"):
        ops.block_rows(packed, 8, 16, 64, torch.tensor([16]))


def test_dtype_gguf_needs_a_gguf_file():
    with pytest.raises(EngineError, match=r"not a \.gguf file"):
        load_model(str(MODEL), "gguf")


# -- the bundled model in each format ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, Path]:
    """The bundled model (Q4_1) and the same weights re-quantized to Q8_0 and Q4_0 (scripts/requantize_gguf.py)."""
    spec = importlib.util.spec_from_file_location("requantize_gguf", Path(__file__).parents[3] / "scripts" /
                                                  "requantize_gguf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folder = tmp_path_factory.mktemp("models")
    files = {"Q4_1": GGUF_MODEL}
    for qtype in ("Q8_0", "Q4_0"):
        files[qtype] = folder / f"model-{qtype}.gguf"
        assert script.main([str(GGUF_MODEL), str(files[qtype]), "--type", qtype]) == 0
    return files


@pytest.mark.slow
@pytest.mark.parametrize("qtype", FORMATS)
def test_each_format_answers_the_readme_question_at_its_files_size(model_files, qtype):
    path = model_files[qtype]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="gguf", num_threads=2, max_num_seqs=4))
    model = engine.model
    assert model.is_blocks and isinstance(model.layers[0].gate_up, BlockWeight)
    assert model.layers[0].gate_up.format == qtype and model.embed is model.lm_head  # tied: one packed copy
    assert engine.runner.k_caches[0].dtype == torch.float16  # K and V in float16, as llama.cpp keeps them
    # Weights held: at most the file's size (its norms and the tokenizer's metadata are in the file too).
    assert model.weight_bytes() <= path.stat().st_size
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    batch = [prompt, prompt]  # two rows at once: the batched path answers too
    outputs = engine.generate(batch, [SamplingParams(max_tokens=24, temperature=0.0)] * 2)
    for output in outputs:
        assert "Paris" in engine.tokenizer.decode(output.token_ids)
