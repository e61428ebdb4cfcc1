"""GGUF block formats served as they are (serving/engine/blocks.py, kernels/block_linear.cpp): the kernel against
the float32 reference on files the ``gguf`` package writes, the loader's row order, and the bundled model in
each format answering the README's question."""

from __future__ import annotations

import importlib.util
import json
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


# Offsets of the fp16 fields (d, dmin) in each K-quant block; every other byte of a block may hold anything.
_K_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}


def _raw(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """*rows* rows of *qtype* blocks: random bytes with small fp16 scales for the K-quants (the ``gguf`` package
    cannot quantize to them), the package's own quantization of random weights otherwise."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in _K_HALVES:
        return quantize(_weight(rows, cols, seed), kind)
    generator = np.random.default_rng(seed)
    size, nbytes = gguf.GGML_QUANT_SIZES[kind]
    data = generator.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    for at in _K_HALVES[qtype]:
        data[..., at:at + 2] = (generator.random((rows, cols // size, 1)) * 0.02).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def _write_raw(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# What each other quantized type is served as, and the largest error that adds, per block of 32: Q4_K's
# scales rounded to fp16 (2^-11 of each term), Q5_0 exact, the others re-quantized to 8 bits (half a step of
# the block's largest / 127, and its scale's fp16 rounding).
_SERVED_AS = {"Q4_K": "Q4_1", "Q5_0": "Q8_0", "Q5_1": "Q8_0", "Q5_K": "Q8_0", "Q6_K": "Q8_0", "Q2_K": "Q8_0",
              "Q3_K": "Q8_0"}


def _bound(reference: torch.Tensor, qtype: str) -> torch.Tensor:
    groups = reference.reshape(reference.shape[0], -1, 32)
    largest = groups.abs().amax(-1, keepdim=True)
    if qtype == "Q5_0":
        bound = torch.zeros_like(largest)
    elif qtype == "Q4_K":
        bound = 2.0 ** -10 * (largest + groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True))
    else:
        bound = largest / 200
    return (bound + 1e-7).expand_as(groups).reshape(reference.shape)


@pytest.mark.parametrize("qtype", list(_SERVED_AS))
def test_other_quantized_types_stay_in_blocks_that_have_a_kernel(qtype, tmp_path):
    rows, cols = OUT, 512  # two K-quant super-blocks a row
    data = _raw(qtype, rows, cols, 11)
    path = tmp_path / f"{qtype}.gguf"
    _write_raw(path, {"token_embd.weight": (quantize(_weight(16, cols, 8), gguf.GGMLQuantizationType.Q8_0), "Q8_0"),
                      "blk.0.ffn_down.weight": (data, qtype)})
    state, _ = read_gguf(path, num_heads=4, num_kv_heads=4)
    served = state["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(served, BlockRows) and served.format == _SERVED_AS[qtype]
    weight = served.pack()
    reference = torch.from_numpy(np.asarray(dequantize(data, gguf.GGMLQuantizationType[qtype]),
                                            dtype=np.float32).reshape(rows, cols))
    error = (weight.dequantize() - reference).abs()
    assert (error <= _bound(reference, qtype)).all(), f"{qtype}: largest error {error.max().item():.3g}"
    if qtype == "Q5_0":
        assert torch.equal(weight.dequantize(), reference)
    # Memory: Q4_K in Q4_1 blocks takes 20 bytes a 32 where the file takes 18; all far below float32's 128.
    assert weight.num_bytes <= 34 / 32 * rows * cols + weight.packed.shape[1]
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(block_linear(x, weight, None), x @ weight.dequantize().T, rtol=1e-4, atol=1e-4)


def _gate_and_up(tmp_path: Path, up_type: str) -> tuple[dict, BlockRows | torch.Tensor, torch.Tensor]:
    """A file with gate in Q4_1 and up in *up_type*: what was read, gate and up fused, and their stored values."""
    gate, up = _weight(32, IN, 9), _weight(32, IN, 10)
    path = tmp_path / "mixed.gguf"
    _write(path, {"token_embd.weight": (_weight(16, IN, 8), "Q8_0"), "blk.0.ffn_gate.weight": (gate, "Q4_1"),
                  "blk.0.ffn_up.weight": (up, up_type)})
    state, _ = read_gguf(path, num_heads=4, num_kv_heads=4)
    fused = blocks.concat([state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]])
    return state, fused, torch.cat([_stored(gate, "Q4_1"), _stored(up, up_type)])


def test_blocks_of_different_formats_fuse_in_q8_0(tmp_path):
    _, fused, reference = _gate_and_up(tmp_path, "Q8_0")
    assert isinstance(fused, BlockRows) and fused.format == "Q8_0" and fused.shape == (64, IN)
    values = fused.pack().dequantize()
    assert (values - reference).abs().le(_bound(reference, "Q8_0")).all()
    assert torch.equal(values[32:], reference[32:])  # the Q8_0 rows as they are


def test_the_q4_k_writer_rounds_within_a_step():
    script = _requantize_script()
    values = _weight(8, 512, 12)
    back = np.asarray(dequantize(script.quantize_q4_k(values), gguf.GGMLQuantizationType.Q4_K),
                      dtype=np.float32).reshape(values.shape)
    groups, errors = values.reshape(8, -1, 32), np.abs(back - values).reshape(8, -1, 32)
    step = (groups.max(-1) - np.minimum(groups.min(-1), 0)) / 15  # a 4-bit step of each sub-block
    assert (errors.max(-1) <= step + 1e-6).all()
    assert (errors.max(-1) <= step / 2 + 1e-6).mean() > 0.9  # mostly half a step: the 6-bit scales rarely clip


def test_unquantized_types_are_widened_and_fused_with_blocks_in_float32(tmp_path):
    state, fused, reference = _gate_and_up(tmp_path, "F16")
    assert state["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    assert isinstance(fused, torch.Tensor)  # Q4_1 and F16 cannot share blocks: both float32
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-7)
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


def test_a_gguf_files_config_and_tokenizer_are_parsed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from serving.engine.models import loader

    monkeypatch.setenv("INFERLINE_GGUF_CACHE", str(tmp_path / "cache"))
    parsed_config, parsed_tokenizer = loader.gguf_config_and_tokenizer(GGUF_MODEL)  # parsed, then saved
    [entry] = (tmp_path / "cache").iterdir()
    assert (entry / "complete").is_file() and (entry / "tokenizer.json").is_file()
    sources = []
    real = loader.AutoTokenizer.from_pretrained
    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", lambda *a, **k: sources.append(a[0]) or real(*a, **k))
    config, tokenizer = loader.gguf_config_and_tokenizer(GGUF_MODEL)
    assert sources == [entry]  # the cached copy, not the file
    assert config.to_dict() == parsed_config.to_dict()
    text = "Hello <|im_start|>user\nwörld ✓ 12345<|im_end|>"
    assert tokenizer(text)["input_ids"] == parsed_tokenizer(text)["input_ids"]
    assert tokenizer.get_vocab() == parsed_tokenizer.get_vocab()
    assert tokenizer.all_special_tokens == parsed_tokenizer.all_special_tokens
    # An unreadable copy is parsed again and replaced.
    (entry / "tokenizer.json").write_text("{")
    sources.clear()
    config, tokenizer = loader.gguf_config_and_tokenizer(GGUF_MODEL)
    assert sources == [entry, GGUF_MODEL.parent]
    assert tokenizer(text)["input_ids"] == parsed_tokenizer(text)["input_ids"]
    assert json.loads((entry / "tokenizer.json").read_text())  # rewritten


def test_a_gguf_tokenizer_knows_its_end_of_sequence_token_as_the_folders_does(tmp_path, monkeypatch):
    # transformers' GGUF tokenizer leaves eos/bos unset; constrained decoding needs eos_token_id (a JSON
    # schema or a forced tool call on the default GGUF model failed: "the tokenizer has no eos_token_id").
    from transformers import AutoTokenizer

    from serving.engine.models import loader

    monkeypatch.setenv("INFERLINE_GGUF_CACHE", str(tmp_path / "cache"))
    folder = AutoTokenizer.from_pretrained(GGUF_MODEL.parent, local_files_only=True)
    for _ in ("parsed", "cached"):
        _, tokenizer = loader.gguf_config_and_tokenizer(GGUF_MODEL)
        assert (tokenizer.eos_token_id, tokenizer.eos_token) == (folder.eos_token_id, folder.eos_token)
        assert tokenizer.bos_token_id == folder.bos_token_id


GUARDED_READS = """
import ctypes, mmap
import numpy as np, torch
from serving.engine.kernels import cpu_ops
ops, page = cpu_ops(), mmap.PAGESIZE
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
for fmt, nbytes in ((3, 20), (2, 18), (8, 34)):
    for n, k in ((40, 96), (24, 576), (16, 160), (8, 32)):
        packed = ops.block_pack(torch.randint(0, 256, (n, k // 32 * nbytes), dtype=torch.uint8), fmt, k)
        pages = -(-packed.numel() // page) + 1
        area = mmap.mmap(-1, pages * page)
        assert libc.mprotect(ctypes.addressof(ctypes.c_char.from_buffer(area)) + (pages - 1) * page, page, 0) == 0
        ends_at_guard = torch.from_numpy(np.frombuffer(area, np.uint8, packed.numel(),
                                                       (pages - 1) * page - packed.numel())).view(packed.shape)
        ends_at_guard.copy_(packed)
        for rows in (1, 4, 8, 9, 33):
            ops.block_linear(torch.randn(rows, k), ends_at_guard, fmt, n, k, None)
"""


def test_the_kernel_reads_nothing_past_the_packed_weights():
    # Prefill (over 8 rows) widened 128 positions at a time and read the blocks past k of a k that is not a
    # multiple of 128 (SmolLM2's 576): past the end of the last group, a segfault when the weights ended at a
    # page boundary (the default GGUF server crashed now and then). Here the weights end right before a page
    # that may not be read; in a child process, so that a read past them fails this test, not the run.
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", GUARDED_READS], capture_output=True, text=True, timeout=300,
                           cwd=Path(__file__).parents[3])
    assert child.returncode == 0, child.stderr[-2000:]


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


def _requantize_script():
    spec = importlib.util.spec_from_file_location("requantize_gguf", Path(__file__).parents[3] / "scripts" /
                                                  "requantize_gguf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, Path]:
    """The bundled model (Q4_1) and the same weights re-quantized to Q8_0, Q4_0 and Q4_K (its ``ffn_down``, the
    weights whose rows are whole super-blocks) by scripts/requantize_gguf.py."""
    script = _requantize_script()
    folder = tmp_path_factory.mktemp("models")
    files = {"Q4_1": GGUF_MODEL}
    for qtype in ("Q8_0", "Q4_0", "Q4_K"):
        files[qtype] = folder / f"model-{qtype}.gguf"
        assert script.main([str(GGUF_MODEL), str(files[qtype]), "--type", qtype]) == 0
    return files


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [*FORMATS, "Q4_K"])
def test_each_format_answers_the_readme_question_at_its_files_size(model_files, qtype):
    path = model_files[qtype]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="gguf", num_threads=2, max_num_seqs=4))
    model = engine.model
    assert model.is_blocks and isinstance(model.layers[0].gate_up, BlockWeight)
    assert model.embed is model.lm_head  # tied: one packed copy
    if qtype == "Q4_K":  # its Q4_K down projections in Q4_1 blocks, the rest as the bundled file
        assert model.layers[0].down.format == "Q4_1" and model.layers[0].gate_up.format == "Q4_1"
    else:
        assert model.layers[0].gate_up.format == qtype
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
