"""Load a causal LM's weights, config and tokenizer from a local HF folder or a .gguf file.

Nothing here reaches a model hub: both paths are local files.

dtypes: ``gguf``, a .gguf file's Q8_0, Q4_0 and Q4_1 weights kept as they are (``serving/engine/blocks.py``);
``float32``; ``bfloat16``, refused on a CPU where a probe matmul runs
more than 4x slower than in float32 (:func:`bf16_is_slow`), rather than
serving silently slowly; ``int8``, float32 weights quantized per output
channel at load (``serving/engine/quant.py``), activations and KV cache float32.

GGUF and stored precision: with ``dtype: gguf`` a file's Q8_0, Q4_0 and Q4_1
tensors stay in their blocks and run through our block kernel, so the model
takes its file's size in memory; its other quantized types are converted to
those blocks at load (Q4_K to Q4_1, the rest to Q8_0: ``blocks.kernel_blocks``)
and its float tensors (norms, F16) widened to float32.
With any other dtype, a GGUF file is read through transformers' GGUF support
(it needs the ``gguf`` package), which dequantizes every tensor to float at
load: loaded as float32, a Q4 file takes float32's memory and speed with its
4-bit weights' quality. ``dtype: int8`` requantizes the dequantized weights per
output channel: a Q8_0 file (int8 blocks of 32, one scale each) lands at a
similar, slightly coarser precision (one scale per row instead of per 32
values); a 4-, 5- or 6-bit file keeps its own rounding error plus the int8
step's. Either way it takes int8's memory and speed.

The default model's linear weights are 4-bit at the source: its
``model.gguf`` is Q4_1 (token embedding Q8_0), and ``scripts/fetch_model.py``
wrote ``model.safetensors`` from that file, dequantized. Both sources load the
same weights (checked: identical tensors, and identical perplexity in
``bench/quality.py --gguf``), and "float32" there means Q4_1 weights computed
in float32.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from serving.engine.blocks import chat_template, check_kernels, read_gguf
from serving.engine.errors import EngineError
from serving.engine.models.llama import LlamaModel

logger = logging.getLogger(__name__)

#: HF ``model_type``s served by the Llama-family forward pass.
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})

#: Each dtype's activations (int8 quantizes float32 weights after loading; gguf keeps a file's blocks).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32, "gguf": torch.float32}

#: bfloat16 is refused where the probe matmul is this many times slower than float32.
MAX_BF16_SLOWDOWN = 4.0


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    config: object
    tokenizer: PreTrainedTokenizerBase


def load_model(source: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load *source* (a folder or a .gguf file) onto *device* in *dtype*."""
    path = Path(source)
    if not path.exists():
        raise EngineError(f"model source {source!r} does not exist (run `make install` for the default model)")
    if dtype not in DTYPES:
        raise EngineError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    torch_dtype, torch_device = DTYPES[dtype], torch.device(device)
    if dtype == "bfloat16" and torch_device.type == "cpu":
        slow, ratio = bf16_is_slow(torch_device)
        if slow:
            raise EngineError(f"bfloat16 runs {ratio:.1f}x slower than float32 on this CPU (no fast bfloat16 "
                              "matmul); use dtype float32, or int8 for half the memory and more speed")
    if dtype == "gguf":
        if path.suffix != ".gguf":
            raise EngineError(f"dtype gguf serves a .gguf file's own blocks; {source!r} is not a .gguf file "
                              "(use dtype float32 or int8 for a folder)")
        check_kernels(torch_device)
        config, tokenizer = gguf_config_and_tokenizer(path)
        state, template = read_gguf(path, config.num_attention_heads,
                                    getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        tokenizer.chat_template = tokenizer.chat_template or template
    elif path.suffix == ".gguf":
        config, tokenizer, state = _from_gguf(path, torch_dtype)
    else:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        state = _read_safetensors(path)
    if config.model_type not in LLAMA_FAMILY:
        raise EngineError(f"model type {config.model_type!r} is not supported; supported: {sorted(LLAMA_FAMILY)}")
    state = {name: t.to(device=torch_device, dtype=torch_dtype).contiguous() if isinstance(t, torch.Tensor) else t
             for name, t in state.items()}
    logger.info("loaded %s (%s, %d tensors) on %s as %s", path, config.model_type, len(state), device, dtype)
    model = LlamaModel(config, state, torch_dtype, torch_device, int8=dtype == "int8")
    if path.suffix == ".gguf":
        del state
        release_freed_memory()
    return LoadedModel(model, config, tokenizer)


def gguf_cache_dir() -> Path:
    """Where the config and tokenizer of GGUF files are kept once parsed: ``$INFERLINE_GGUF_CACHE``, by default
    ``~/.cache/inferline/gguf``."""
    return Path(os.environ.get("INFERLINE_GGUF_CACHE", Path.home() / ".cache/inferline/gguf"))


def gguf_config_and_tokenizer(path: Path) -> tuple[object, PreTrainedTokenizerBase]:
    """A GGUF file's config and tokenizer. transformers builds them from the file's metadata, parsing every
    vocabulary entry through the ``gguf`` package's reader once for each (about 10 s for the bundled model);
    the result is saved under :func:`gguf_cache_dir`, keyed by the file's path, size and modification time and
    transformers' version, and read from there on later loads (a fraction of a second). A cache that cannot
    be written is skipped (logged at DEBUG); one that cannot be read is rebuilt."""
    import hashlib
    import shutil
    import tempfile

    import transformers

    stat = path.stat()
    identity = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    cached = gguf_cache_dir() / hashlib.sha256(identity.encode()).hexdigest()[:32]
    if (cached / "complete").is_file():
        try:
            config = AutoConfig.from_pretrained(cached, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(cached, local_files_only=True)
            config._name_or_path = tokenizer.name_or_path = str(path.parent)  # as parsed from the file
            return config, _with_special_tokens(config, tokenizer)
        except (OSError, ValueError) as exc:
            logger.warning("the cached config and tokenizer of %s in %s cannot be read (%s); parsing the file",
                           path, cached, exc)
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    config = AutoConfig.from_pretrained(path.parent, **kwargs)
    tokenizer = _with_special_tokens(config, AutoTokenizer.from_pretrained(path.parent, **kwargs))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".partial-"))
        try:
            config.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            (staging / "complete").touch()
            shutil.rmtree(cached, ignore_errors=True)  # an unreadable or incomplete earlier copy
            staging.rename(cached)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:  # read-only home, full disk, another process renaming first: the next load parses
        logger.debug("not caching the config and tokenizer of %s in %s: %s", path, cached, exc)
    return config, tokenizer


def release_freed_memory() -> None:
    """Hand the heap memory that loading a GGUF file freed back to the system: transformers parses its
    metadata twice (config, tokenizer) into objects that become garbage, and the copies made while packing
    leave tens of MB that glibc's malloc otherwise keeps resident for the process's lifetime."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return
    trim(0)


def bf16_is_slow(device: torch.device | str = "cpu") -> tuple[bool, float]:
    """Whether bfloat16 is more than :data:`MAX_BF16_SLOWDOWN` x slower than float32 on *device*, and the
    measured ratio (bfloat16 time / float32 time of one decode-sized matmul). Measured once per process."""
    ratio = _bf16_slowdown(torch.device(device).type)
    return ratio > MAX_BF16_SLOWDOWN, ratio


@functools.cache
def _bf16_slowdown(device_type: str) -> float:
    # One decode step's down projection (batch 1, 1536 -> 576), timed in short
    # rounds that alternate between the dtypes, best round of each: on a busy
    # shared machine a burst of load then hits both alike. A "slow" verdict is
    # measured again before it stands (up to three times): it refuses a dtype.
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, 1536, generator=generator), torch.randn(576, 1536, generator=generator)
    calls = [functools.partial(F.linear, x.to(device_type, dtype), weight.to(device_type, dtype))
             for dtype in (torch.float32, torch.bfloat16)]
    ratio = float("inf")
    for _ in range(3):
        float32_s, bfloat16_s = _best_times(calls, device_type)
        ratio = min(ratio, bfloat16_s / float32_s)
        if ratio <= MAX_BF16_SLOWDOWN:
            break
    return ratio


def _best_times(calls: list, device_type: str, rounds: int = 15, repeats: int = 5) -> list[float]:
    """Seconds per call of each of *calls*, best of *rounds* interleaved rounds."""
    best = [float("inf")] * len(calls)
    for call in calls:
        call()  # warm-up: first-call packing and allocation
    for _ in range(rounds):
        for index, call in enumerate(calls):
            if device_type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            if device_type == "cuda":
                torch.cuda.synchronize()
            best[index] = min(best[index], (time.perf_counter() - start) / repeats)
    return best


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no .safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def _from_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    tokenizer.chat_template = tokenizer.chat_template or chat_template(path)  # transformers leaves it out
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **kwargs)
    state = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    return hf_model.config, _with_special_tokens(hf_model.config, tokenizer), state


def _with_special_tokens(config, tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """*tokenizer* with the end- and start-of-sequence tokens the file's config names: transformers' GGUF
    tokenizer leaves them unset, and constrained decoding (the grammar's end) needs ``eos_token_id``."""
    for role in ("eos", "bos"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if getattr(tokenizer, f"{role}_token_id") is None and token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer
