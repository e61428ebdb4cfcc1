"""What int8 (and bfloat16) weights and GGUF's block formats cost in quality against float32, and what int8 buys
in memory and speed.

    .venv/bin/python bench/quality.py [--model DIR] [--max-tokens N] [--decode-tokens N] [--rounds R]
                                      [--no-formats] [--gguf FILE]

The default model on our engine (``LLMEngine``, 2 torch threads, CPU), one engine per dtype: float32, int8, and
bfloat16 only where ``bf16_is_slow`` says it is not more than 4x slower than float32 here (else it would be
refused at load).

greedy      Eight varied chat prompts (chat template applied; 20 to 300 tokens), submitted together, N (64)
            greedy new tokens each. Against float32's tokens: ``*_greedy_agreement`` = positions where both
            hold the same token / positions of the longer output; ``*_greedy_prefix_agreement`` = tokens
            before the first difference / float32's tokens.
perplexity  exp(mean negative log-likelihood) of the first 512 tokens of a fixed English passage, from one
            prefill over the whole passage (every position's logits). ``*_next_token_agreement``: positions of
            that passage where the dtype's most likely next token is float32's (teacher-forced, so one
            difference does not derail the rest, unlike greedy generation).
memory      ``LlamaModel.weight_bytes()``: bytes held by the weights the forward reads, as stored. float32
            holds the embedding and a oneDNN-packed copy of the tied LM head; int8 holds the float32
            embedding and an int8 LM head. ``int8_weight_memory_ratio`` = int8 / float32 (target <= 0.5).
decode      One request alone, a short prompt and D (128) new tokens with EOS ignored, R (3) rounds with the
            dtypes interleaved, best round of each (shared machine). ``int8_decode_speedup`` = int8 tok/s /
            float32 tok/s (target >= 1.5). ``--decode-tokens 0`` skips it.
rounding    What the weights' rounding alone costs, whatever the kernels: the float32 model with every linear
            weight but the embedding rounded and stored back in float32 (round to nearest, symmetric), then the
            same perplexity and next-token agreement against float32: ``rounding_int8_channel_*`` (int8, one
            scale per output channel, as ``dtype: int8`` stores them), ``rounding_int8_g32_*`` (int8, one
            float16 scale per 32 inputs: GGUF's Q8_0), ``rounding_bfloat16_*`` (bfloat16 weights, float32
            activations). ``int8_ppl_ratio`` = int8 / float32 perplexity (the engine's ``dtype: int8``).
            With ``--gptq``, also ``rounding_int8_gptq_*``: int8 per channel rounded by GPTQ (each column's
            rounding error spread over the columns not yet rounded through the inverse Hessian of the
            layer's inputs, columns in order of that Hessian's diagonal, damping 1%), calibrated on
            ``gptq_calibration_tokens`` tokens of pipelines/data/handbook/ (not the measured passage): what
            a calibrated quantizer buys against round-to-nearest's agreement.
formats     ``dtype: gguf``, a GGUF file served in its own blocks, for each block format: the bundled
            ``model.gguf`` (Q4_1, its embedding Q8_0) and the same weights written in Q8_0, Q4_0 and Q4_K (its
            ``ffn_down``: the rows that are whole super-blocks) by scripts/requantize_gguf.py (re-quantized from
            Q4_1: they add their own rounding to Q4_1's). Per format: ``gguf_<format>_perplexity``,
            ``gguf_<format>_next_token_agreement`` (against float32, which is the Q4_1 weights de-quantized),
            ``gguf_<format>_weight_bytes``, ``gguf_<format>_file_bytes``. ``--no-formats`` skips it.
            llama.cpp (llama-cpp-python, ``make bench-deps``), when importable, computes the perplexity of the
            same token ids from the bundled file (``llamacpp_q4_1_perplexity``, all logits of one batch):
            ``q4_ppl_vs_llamacpp`` = ours on that file / llama.cpp's (target: within 0.5%, |ratio - 1| <= 0.005).
            It also writes a Q4_K_M file with its own quantizer (``llama_model_quantize``, from the weights
            de-quantized to F32), as users download them: Q4_K and Q6_K, and Q5_0 and Q8_0 where a row is not a
            multiple of 256. Ours serves it in blocks (Q4_K as Q4_1, Q5_0 as Q8_0, Q6_K re-quantized to Q8_0;
            serving/engine/blocks.py): ``gguf_q4_k_m_perplexity``, ``gguf_q4_k_m_weight_bytes``,
            ``gguf_q4_k_m_file_bytes``, ``llamacpp_q4_k_m_perplexity`` and ``q4_k_m_ppl_vs_llamacpp``.
            ``gguf_q4_1_8bit_activations_perplexity``: ours with each matmul's activations first rounded to
            8 bits per 32 as llama.cpp rounds them for these formats (its Q8_0/Q8_1): the part of the gap to
            llama.cpp that is its activation rounding (we keep activations float32).
gguf        With ``--gguf FILE``: the same perplexity for that file loaded as float32 (its own precision,
            dequantized) and as int8 (requantized per channel). Off by default: loading a GGUF file
            through transformers takes about 25 s.

The last line of output is one JSON object: every figure above, ``bf16_slow`` and ``bf16_slowdown`` (the
probe's bfloat16 / float32 time), and ``timings_s``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http
# package (imported by torch, httpx...) for any script run from here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from serving.engine.attention import AttentionMetadata, PrefillChunk
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.model_runner import ModelRunner
from serving.engine.models.llama import LlamaModel
from serving.engine.models.loader import bf16_is_slow, load_model
from serving.engine.sampling_params import SamplingParams

MODEL_DIR = "models/smollm2-135m-instruct"
NUM_THREADS = 2
PERPLEXITY_TOKENS = 512
KV_CACHE_BYTES = 256 << 20

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old in two sentences.",
    "Give me three tips for writing clean Python code.",
    "Translate into French: Good morning, how are you today?",
    "List the planets of the solar system in order from the sun, with one fact about each.",
    "What is 17 times 23? Show your working.",
    "Summarize this: " + "The committee met on Tuesday to review the budget, approved the new library wing, "
    "postponed the decision on street lighting and asked the treasurer for a revised forecast. " * 6,
)

PASSAGE = """\
The first public libraries in the small market towns of the north were not built by the councils but by the
mill owners, who hoped that a room full of books would keep their workers out of the taverns on a Saturday
night. The rooms were usually above a shop or beside the chapel, lit by gas, heated by a single stove, and
open for three evenings a week. A librarian, often a retired schoolmaster, sat at a high desk by the door and
wrote every loan into a ledger by hand. Members paid a penny a month, and for that they could borrow one book
at a time for a fortnight.

What the workers chose to read surprised the owners. Sermons and improving tracts sat untouched on the
shelves, while travel books, popular science and the new serial novels were worn to pieces within a year.
The ledgers that survive show the same names borrowing an atlas, a manual of engineering and a romance in the
same month. Some readers formed societies that met in the reading room after closing time to discuss what
they had read, and a few of those societies later became the first evening schools in the district.

By the end of the century the councils had taken over most of the rooms, and the penny subscription was
abolished. New buildings went up with wide staircases, tall windows and carved stone over the doors, paid for
partly by a tax on property and partly by a wealthy donor whose name was cut into the lintel. The collections
grew from a few hundred volumes to many thousands, and the ledgers gave way to card catalogues and printed
tickets. Children were admitted for the first time, though at first only to a separate room with its own
entrance, so that their noise would not disturb the adults.

Historians who study these libraries today rely on the loan records, the minutes of the committees and the
letters that readers wrote to the local newspapers, complaining about the hours, the rules on silence or the
shortage of new fiction. Together these sources give an unusually detailed picture of what ordinary people
wanted to know at a time when few of them had stayed at school beyond the age of twelve. They also show how
quickly a service meant to improve its users was reshaped by what those users actually asked for, and how the
habit of reading, once acquired, was passed from parents to children across several generations.
"""


def next_token_logits(model: LlamaModel, token_ids: Sequence[int]) -> torch.Tensor:
    """``[len - 1, vocab]`` float32: the logits predicting each next token, from one prefill (fresh KV cache)."""
    num_tokens = len(token_ids)
    runner = ModelRunner(model, num_tokens, 1)  # slot i holds token i
    device = model.device
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(positions, [], [PrefillChunk(0, num_tokens, 0, None, None)])
    with torch.inference_mode():
        return model.forward(ids, positions, meta, runner.k_caches, runner.v_caches, positions[:-1]).float().cpu()


def perplexity(logits: torch.Tensor, token_ids: Sequence[int]) -> float:
    """exp(mean negative log-likelihood) of ``token_ids[1:]`` under :func:`next_token_logits`' *logits*."""
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:])).item())


def agreement(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(positions equal / positions of the longer output, tokens before the first difference / reference's)."""
    same = total = prefix = num_reference = 0
    for ref, out in zip(reference, outputs, strict=True):
        matches = [a == b for a, b in zip(ref, out, strict=False)]
        same += sum(matches)
        total += max(len(ref), len(out))
        prefix += matches.index(False) if False in matches else len(matches)
        num_reference += len(ref)
    return same / max(total, 1), prefix / max(num_reference, 1)


def chat_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def decode_speeds(engines: dict[str, LLMEngine], num_tokens: int, rounds: int) -> dict[str, float]:
    """Best-of-*rounds* tok/s of one greedy request per engine, the engines interleaved."""
    first = next(iter(engines.values()))
    prompt = first.tokenizer("The history of the Roman Empire is long and complicated. It began")["input_ids"]
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    for engine in engines.values():
        engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    best = dict.fromkeys(engines, 0.0)
    for _ in range(rounds):
        for dtype, engine in engines.items():
            start = time.perf_counter()
            engine.generate([prompt], params)
            best[dtype] = max(best[dtype], num_tokens / (time.perf_counter() - start))
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    timings: dict[str, float] = {}
    result: dict[str, Any] = {}
    start = time.perf_counter()
    slow, slowdown = bf16_is_slow("cpu")
    result.update(bf16_slow=slow, bf16_slowdown=slowdown)
    dtypes = ["float32", "int8"] + ([] if slow else ["bfloat16"])
    engines = {dtype: LLMEngine(EngineConfig(model=args.model, dtype=dtype, num_threads=NUM_THREADS,
                                             kv_cache_bytes=KV_CACHE_BYTES)) for dtype in dtypes}
    timings["load_s"] = time.perf_counter() - start

    tokenizer = engines["float32"].tokenizer
    prompts = chat_prompts(tokenizer)
    passage = tokenizer(PASSAGE)["input_ids"][:PERPLEXITY_TOKENS]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    outputs: dict[str, list[list[int]]] = {}
    logits: dict[str, torch.Tensor] = {}
    for dtype, engine in engines.items():
        start = time.perf_counter()
        outputs[dtype] = [out.token_ids for out in engine.generate(prompts, greedy)]
        timings[f"{dtype}_greedy_s"] = time.perf_counter() - start
        start = time.perf_counter()
        logits[dtype] = next_token_logits(engine.model, passage)
        result[f"{dtype}_perplexity"] = perplexity(logits[dtype], passage)
        timings[f"{dtype}_perplexity_s"] = time.perf_counter() - start
        result[f"{dtype}_weight_bytes"] = engine.model.weight_bytes()
        if dtype != "float32":
            result[f"{dtype}_greedy_agreement"], result[f"{dtype}_greedy_prefix_agreement"] = agreement(
                outputs["float32"], outputs[dtype])
            result[f"{dtype}_weight_memory_ratio"] = result[f"{dtype}_weight_bytes"] / result["float32_weight_bytes"]
            result[f"{dtype}_next_token_agreement"] = (
                (logits[dtype].argmax(-1) == logits["float32"].argmax(-1)).float().mean().item())
    result["perplexity_tokens"] = len(passage)

    result["int8_ppl_ratio"] = result["int8_perplexity"] / result["float32_perplexity"]
    start = time.perf_counter()
    result.update(rounding(engines["float32"].hf_config, args.model, passage, logits["float32"], args.gptq))
    timings["rounding_s"] = time.perf_counter() - start

    if args.decode_tokens:
        start = time.perf_counter()
        speeds = decode_speeds(engines, args.decode_tokens, args.rounds)
        for dtype, tok_s in speeds.items():
            result[f"{dtype}_decode_tok_s"] = tok_s
        result["int8_decode_speedup"] = speeds["int8"] / speeds["float32"]
        timings["decode_s"] = time.perf_counter() - start
    del engines

    if args.formats:
        start = time.perf_counter()
        result.update(formats(Path(args.model) / "model.gguf", passage, logits["float32"]))
        timings["formats_s"] = time.perf_counter() - start
    if args.gguf:
        start = time.perf_counter()
        for dtype in ("float32", "int8"):
            model = load_model(args.gguf, dtype).model
            result[f"gguf_{dtype}_perplexity"] = perplexity(next_token_logits(model, passage), passage)
        timings["gguf_s"] = time.perf_counter() - start
    result["timings_s"] = timings
    return result


FORMATS = ("Q4_1", "Q8_0", "Q4_0", "Q4_K")


def formats(gguf: Path, passage: list[int], reference: torch.Tensor) -> dict[str, Any]:
    """Perplexity and next-token agreement of ``dtype: gguf`` per block format, and llama.cpp's on *gguf*."""
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location("requantize_gguf", Path(__file__).parents[1] / "scripts" /
                                                  "requantize_gguf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for qtype in FORMATS:
            path = gguf
            if qtype != "Q4_1":  # the bundled file's own format
                path = Path(folder) / f"model-{qtype}.gguf"
                script.requantize(gguf, path, qtype)
            model = load_model(str(path), "gguf").model
            logits = next_token_logits(model, passage)
            key = f"gguf_{qtype.lower()}"
            out[f"{key}_perplexity"] = perplexity(logits, passage)
            out[f"{key}_next_token_agreement"] = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
            out[f"{key}_weight_bytes"] = model.weight_bytes()
            out[f"{key}_file_bytes"] = path.stat().st_size
            if qtype == "Q4_1":
                out["gguf_q4_1_8bit_activations_perplexity"] = perplexity(
                    next_token_logits(_with_8bit_activations(model), passage), passage)
            del model
        out["llamacpp_q4_1_perplexity"] = llamacpp_perplexity(gguf, passage)
        out["q4_ppl_vs_llamacpp"] = (None if out["llamacpp_q4_1_perplexity"] is None else
                                     out["gguf_q4_1_perplexity"] / out["llamacpp_q4_1_perplexity"])
        if out["llamacpp_q4_1_perplexity"] is not None:
            out.update(q4_k_m(script, gguf, Path(folder), passage))
    return out


def q4_k_m(script: Any, gguf: Path, folder: Path, passage: list[int]) -> dict[str, Any]:
    """Ours and llama.cpp's perplexity on a Q4_K_M file written by llama.cpp's own quantizer."""
    import llama_cpp

    f32, path = folder / "model-F32.gguf", folder / "model-Q4_K_M.gguf"
    script.requantize(gguf, f32, "F32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = NUM_THREADS
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), params) != 0:
        raise RuntimeError("llama_model_quantize failed to write a Q4_K_M file")
    f32.unlink()
    model = load_model(str(path), "gguf").model
    out = {"gguf_q4_k_m_perplexity": perplexity(next_token_logits(model, passage), passage),
           "gguf_q4_k_m_weight_bytes": model.weight_bytes(), "gguf_q4_k_m_file_bytes": path.stat().st_size,
           "llamacpp_q4_k_m_perplexity": llamacpp_perplexity(path, passage)}
    out["q4_k_m_ppl_vs_llamacpp"] = out["gguf_q4_k_m_perplexity"] / out["llamacpp_q4_k_m_perplexity"]
    return out


def _with_8bit_activations(model: LlamaModel) -> LlamaModel:
    """*model* with every matmul's activations rounded to 8 bits per 32 (an fp16 scale each) first: what
    llama.cpp does to them for its Q4 and Q8 dot products (Q8_0/Q8_1), to tell that rounding from ours."""
    linear = model.linear

    def rounded_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        groups = x.reshape(x.shape[0], -1, 32)
        scale = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return linear((torch.round(groups / scale).clamp(-127, 127) * scale).reshape(x.shape), weight, bias)

    model.linear = model.head_linear = rounded_linear
    return model


def llamacpp_perplexity(gguf: Path, passage: list[int]) -> float | None:
    """llama.cpp's perplexity of *passage* (token ids) on *gguf*: one batch, every position's logits; None
    (and a note on stderr) when llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except (ImportError, OSError, RuntimeError) as exc:
        print(f"NOTE: llama_cpp is not importable ({exc}): run `make bench-deps` for llama.cpp's perplexity",
              file=sys.stderr)
        return None
    llama = Llama(str(gguf), n_ctx=len(passage) + 8, n_batch=len(passage), n_ubatch=len(passage),
                  n_threads=NUM_THREADS, logits_all=True, verbose=False)
    try:
        llama.eval(passage)
        logits = torch.from_numpy(llama.scores[:len(passage) - 1].copy()).float()
    finally:
        llama.close()
    return perplexity(logits, passage)


def rounded(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """*weight* ``[out, in]`` rounded as *kind* stores it, back in float32."""
    if kind == "bfloat16":
        return weight.bfloat16().float()
    groups = weight.reshape(weight.shape[0], -1, 32 if kind == "int8_g32" else weight.shape[1])
    scale = groups.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if kind == "int8_g32":
        scale = scale.half().float()
    return (torch.round(groups / scale).clamp(-127, 127) * scale).reshape(weight.shape)


def rounding(config, folder: str, passage: list[int], reference: torch.Tensor, gptq: bool = False
             ) -> dict[str, float]:
    """Perplexity and next-token agreement of the float32 model with its linear weights rounded."""
    from serving.engine.models import loader

    state = loader._read_safetensors(Path(folder))
    out: dict[str, float] = {}
    kinds = ["int8_channel", "int8_g32", "bfloat16"]
    if gptq:
        hessians, out["gptq_calibration_tokens"] = input_hessians(folder, GPTQ_CALIBRATION_TOKENS)
        kinds.append("int8_gptq")
    for kind in kinds:
        changed = {name: t.float() for name, t in state.items()}
        for name, weight in changed.items():
            if weight.dim() == 2 and name.endswith("proj.weight"):
                changed[name] = (gptq_int8(weight, hessians[name.removesuffix(".weight")]) if kind == "int8_gptq"
                                 else rounded(weight, kind))
        model = LlamaModel(config, changed, torch.float32, torch.device("cpu"))
        logits = next_token_logits(model, passage)
        out[f"rounding_{kind}_perplexity"] = perplexity(logits, passage)
        out[f"rounding_{kind}_next_token_agreement"] = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return out


GPTQ_CALIBRATION_TOKENS = 4096


def input_hessians(folder: str, num_tokens: int) -> tuple[dict[str, torch.Tensor], int]:
    """``X^T X`` (float64) of every ``*_proj`` layer's inputs X over *num_tokens* tokens of the handbook pages,
    by Hugging Face module name, from transformers' forward of the float32 model (hooks on its linears)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    pages = sorted((Path(__file__).parents[1] / "pipelines" / "data" / "handbook").glob("*.md"))
    ids = tokenizer("\n\n".join(page.read_text() for page in pages))["input_ids"][:num_tokens]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    hessians: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module, inputs, output) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            hessians[name] = hessians.get(name, 0) + x.T @ x
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("proj"):
            module.register_forward_hook(record(name))
    with torch.no_grad():
        for start in range(0, len(ids), PERPLEXITY_TOKENS):
            model(torch.tensor([ids[start:start + PERPLEXITY_TOKENS]]))
    return hessians, len(ids)


def gptq_int8(weight: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """*weight* ``[out, in]`` rounded to int8 with one scale per output (as ``dtype: int8``) by GPTQ (Frantar et al.
    2022), back in float32."""
    w, h = weight.double().clone(), hessian.clone()
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.zeros_like(w)
    for first in range(0, w.shape[1], block):
        last = min(first + block, w.shape[1])
        part, local = w[:, first:last].clone(), inverse[first:last, first:last]
        errors = torch.zeros_like(part)
        for i in range(last - first):
            out[:, first + i] = torch.round(part[:, i] / scale).clamp(-127, 127) * scale
            errors[:, i] = (part[:, i] - out[:, first + i]) / local[i, i]
            part[:, i:] -= errors[:, i:i + 1] * local[i, i:][None, :]
        w[:, last:] -= errors @ inverse[first:last, last:]
    return out[:, torch.argsort(order)].float()


def print_table(result: dict[str, Any]) -> None:
    dtypes = [d for d in ("float32", "int8", "bfloat16") if f"{d}_perplexity" in result]
    columns = ("perplexity", "next_token_agreement", "greedy_agreement", "greedy_prefix_agreement", "weight_bytes",
               "decode_tok_s")
    print(f"{'dtype':<10}" + "".join(f"{c:>24}" for c in columns))
    for dtype in dtypes:
        cells = [result.get(f"{dtype}_{c}", 1.0 if dtype == "float32" and "agreement" in c else None)
                 for c in columns]
        print(f"{dtype:<10}" + "".join(f"{_fmt(v):>24}" for v in cells))
    print(f"int8 weight memory / float32: {_fmt(result['int8_weight_memory_ratio'])}; "
          f"int8 decode speedup: {_fmt(result.get('int8_decode_speedup'))}; "
          f"bfloat16 probe slowdown: {_fmt(result['bf16_slowdown'])} (slow: {result['bf16_slow']})")
    for kind in ("int8_channel", "int8_g32", "bfloat16", "int8_gptq"):
        if f"rounding_{kind}_perplexity" not in result:
            continue
        print(f"weights rounded as {kind}: perplexity {_fmt(result[f'rounding_{kind}_perplexity'])}, next-token "
              f"agreement {_fmt(result[f'rounding_{kind}_next_token_agreement'])}")
    for qtype in FORMATS:
        key = f"gguf_{qtype.lower()}"
        if f"{key}_perplexity" in result:
            print(f"dtype gguf, {qtype}: perplexity {_fmt(result[f'{key}_perplexity'])}, next-token agreement "
                  f"{_fmt(result[f'{key}_next_token_agreement'])}, weights {_fmt(result[f'{key}_weight_bytes'])} "
                  f"bytes (file {_fmt(result[f'{key}_file_bytes'])})")
    if "q4_ppl_vs_llamacpp" in result:
        print(f"llama.cpp on the bundled Q4_1 file: perplexity {_fmt(result['llamacpp_q4_1_perplexity'])}; "
              f"ours / llama.cpp: {_fmt(result['q4_ppl_vs_llamacpp'])}")
    if "q4_k_m_ppl_vs_llamacpp" in result:
        print(f"llama.cpp's Q4_K_M: ours {_fmt(result['gguf_q4_k_m_perplexity'])} in "
              f"{_fmt(result['gguf_q4_k_m_weight_bytes'])} bytes (file {_fmt(result['gguf_q4_k_m_file_bytes'])}), "
              f"llama.cpp {_fmt(result['llamacpp_q4_k_m_perplexity'])}; "
              f"ours / llama.cpp: {_fmt(result['q4_k_m_ppl_vs_llamacpp'])}")
    for dtype in ("float32", "int8"):
        if f"gguf_{dtype}_perplexity" in result:
            print(f"gguf loaded as {dtype}: perplexity {_fmt(result[f'gguf_{dtype}_perplexity'])}")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default=MODEL_DIR, help="local HF folder (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default: 64)")
    parser.add_argument("--decode-tokens", type=int, default=128,
                        help="tokens per decode-speed run; 0 skips it (default: 128)")
    parser.add_argument("--rounds", type=int, default=3, help="decode-speed rounds per dtype (default: 3)")
    parser.add_argument("--no-formats", dest="formats", action="store_false",
                        help="skip the GGUF block formats (dtype: gguf) and llama.cpp's perplexity")
    parser.add_argument("--gptq", action="store_true",
                        help="also round the weights to int8 by GPTQ, calibrated on the handbook (about 2 minutes)")
    parser.add_argument("--gguf", default=None, help="also measure this .gguf file's perplexity as float32 and int8")
    args = parser.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    result = run(args)
    print_table(result)
    print(json.dumps({k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in result.items()}), flush=True)
    return result


if __name__ == "__main__":
    main()
