"""The identity of a model's weights: the hash audit records and responses carry."""

from __future__ import annotations

import hashlib
from pathlib import Path


def weights_sha256(source: Path) -> str:
    """SHA-256 over the weight files of *source* (a .gguf file or a folder's safetensors, in name order)."""
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()
