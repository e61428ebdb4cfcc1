"""Load a causal LM's weights, config and tokenizer from a local HF folder or a .gguf file.

Nothing here reaches a model hub: both paths are local files. A GGUF file is
read through transformers' GGUF support (it needs the ``gguf`` package) and
dequantized to the requested dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from serving.engine.errors import EngineError
from serving.engine.models.llama import LlamaModel

logger = logging.getLogger(__name__)

#: HF ``model_type``s served by the Llama-family forward pass.
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    if path.suffix == ".gguf":
        config, tokenizer, state = _from_gguf(path, torch_dtype)
    else:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        state = _read_safetensors(path)
    if config.model_type not in LLAMA_FAMILY:
        raise EngineError(f"model type {config.model_type!r} is not supported; supported: {sorted(LLAMA_FAMILY)}")
    state = {name: t.to(device=torch_device, dtype=torch_dtype).contiguous() for name, t in state.items()}
    logger.info("loaded %s (%s, %d tensors) on %s as %s", path, config.model_type, len(state), device, dtype)
    return LoadedModel(LlamaModel(config, state, torch_dtype, torch_device), config, tokenizer)


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
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **kwargs)
    state = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    return hf_model.config, tokenizer, state
