"""A GGUF file's tensor table and a few of its metadata values, read without parsing the rest.

``gguf.GGUFReader`` turns every metadata value into numpy objects, the tokenizer's hundred thousand
strings included: about 5 s and tens of MB of garbage for SmolLM2's file, paid again at every load.
The weights need only the tensor table, the architecture and the alignment; this reads those (and any
scalar or string value asked for by name), skips the other values by their sizes, and maps the file:
tensors are zero-copy uint8 views of it, ``[rows, bytes a row]``; the mapping goes with the last view.

The format (GGUF v2 and v3, little-endian): magic ``GGUF``, version, tensor count, metadata count; the
metadata as (key, type, value); the tensor table as (name, dims, type, offset); then the data, from the
first multiple of ``general.alignment`` (32 by default) after the table.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.engine.errors import EngineError

MAGIC = b"GGUF"
#: Value types: 0-7 and 10-12 fixed-size scalars (struct formats), 8 a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """Rows first (GGUF lists the fastest dimension first; this is the reverse)."""
    type: int
    """ggml's type number (``gguf.GGMLQuantizationType``)."""
    data: np.ndarray
    """uint8 ``[rows, bytes a row]``: a view of the mapped file."""


class GGUFFile:
    """A mapped GGUF file: ``tensors`` and the metadata values named at open (``values``)."""

    def __init__(self, path: Path, keys: Iterable[str] = ()) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        wanted = {"general.architecture", "general.alignment", *keys}
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != MAGIC:
            raise EngineError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
        version, num_tensors, num_values = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise EngineError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian file "
                              "reads as a huge version)")
        self.values: dict[str, object] = {}
        pos = 24
        for _ in range(num_values):
            key, pos = _string(buf, pos)
            (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            if key in wanted:
                self.values[key], pos = _value(buf, pos, kind)
            else:
                pos = _skip(buf, pos, kind)
        infos = []
        for _ in range(num_tensors):
            name, pos = _string(buf, pos)
            (num_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{num_dims}Q", buf, pos)
            pos += 8 * num_dims
            kind, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(reversed(dims)), kind, offset))
        alignment = int(self.values.get("general.alignment", 32))
        start = -(-pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, shape, kind, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            row_bytes = shape[-1] // block * block_bytes
            data = np.frombuffer(buf, dtype=np.uint8, count=rows * row_bytes, offset=start + offset)
            self.tensors.append(TensorInfo(name, shape, kind, data.reshape(rows, row_bytes)))



def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8:pos + 8 + length].decode("utf-8", errors="replace"), pos + 8 + length


def _value(buf: mmap.mmap, pos: int, kind: int) -> tuple[object, int]:
    if kind == _STRING:
        return _string(buf, pos)
    if kind in _SCALARS:
        return struct.unpack_from(_SCALARS[kind], buf, pos)[0], pos + struct.calcsize(_SCALARS[kind])
    return None, _skip(buf, pos, kind)  # arrays are only skipped


def _skip(buf: mmap.mmap, pos: int, kind: int) -> int:
    if kind in _SCALARS:
        return pos + struct.calcsize(_SCALARS[kind])
    if kind == _STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _SCALARS:
            return pos + count * struct.calcsize(_SCALARS[item])
        for _ in range(count):
            pos = _skip(buf, pos, item)
        return pos
    raise EngineError(f"GGUF metadata value of unknown type {kind} at byte {pos}")
