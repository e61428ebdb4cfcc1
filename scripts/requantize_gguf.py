"""Write a GGUF model's weights in another block format: the same metadata and tokenizer, every 2-D weight
whose rows are whole blocks of 32 re-quantized (through float32) to Q8_0, Q4_0, Q4_1 (by the ``gguf``
package) or Q4_K; norms and other tensors copied as they are.

    .venv/bin/python scripts/requantize_gguf.py models/smollm2-135m-instruct/model.gguf /tmp/q8.gguf --type Q8_0

``--type Q4_K`` writes Q4_K where a row is a multiple of 256 weights (a super-block) and keeps the other
tensors as they are (and the token embedding): on the bundled model, its 30 ``ffn_down`` weights. Its
Q4_K rounding is plain (each sub-block's range to 4 bits, the 6-bit scales to the super-block's), not
``llama-quantize``'s search for the best scales. ``--type F32`` writes every weight de-quantized: an input
for ``llama-quantize`` (bench/quality.py makes a Q4_K_M file from it with llama.cpp's own quantizer).

For trying ``dtype: gguf`` (serving/engine/blocks.py) on each format and for its tests; llama.cpp's
``llama-quantize`` does the same from a float file with better rounding (importance matrices, K-quants).
Re-quantizing an already 4-bit file adds the new format's rounding to the old one's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "F32")
SUPER = 256  # weights per K-quant super-block
FILE_TYPES = {"Q4_K": "MOSTLY_Q4_K_M", "F32": "ALL_F32"}  # general.file_type's names where not MOSTLY_<type>


def requantize(source: Path, target: Path, qtype: str) -> int:
    """Write *source* to *target* with its block weights in *qtype*; returns how many tensors were re-quantized."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(source)
    architecture = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(target, architecture)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        if field.name == gguf.Keys.General.FILE_TYPE:
            file_type = gguf.LlamaFileType[FILE_TYPES.get(qtype, f"MOSTLY_{qtype}")]
            writer.add_key_value(field.name, int(file_type), value_type)
            continue
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    count = 0
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]  # rows first
        data, raw_type = tensor.data, tensor.tensor_type
        new_type = target_type(tensor.name, shape, qtype)
        if new_type is not None and tensor.tensor_type != new_type:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
            data = quantize_q4_k(values) if new_type.name == "Q4_K" else quantize(values, new_type)
            raw_type = new_type
            count += 1
        writer.add_tensor(tensor.name, np.ascontiguousarray(data), raw_shape=data.shape, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count


def target_type(name: str, shape: list[int], qtype: str):
    """The type tensor *name* of *shape* is written in for ``--type`` *qtype*, or None (copied as it is)."""
    import gguf

    if len(shape) != 2 or shape[1] % 32:
        return None
    if qtype == "Q4_K" and (shape[1] % SUPER or name == "token_embd.weight"):
        return None
    return gguf.GGMLQuantizationType[qtype]


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Float32 ``[out, in]`` (in a multiple of 256) as Q4_K rows, ggml's layout: per super-block of 256, fp16
    ``d`` and ``dmin``, 12 bytes of 6-bit scales ``sc`` and minimums ``m`` of its 8 sub-blocks of 32, and 128
    bytes of 4-bit quants q, where a weight is ``d * sc * q - dmin * m``."""
    rows, cols = values.shape
    sub = values.reshape(-1, 8, 32).astype(np.float32)
    count = sub.shape[0]
    low = np.minimum(sub.min(axis=-1), 0.0)  # the sub-block's minimum, at most 0
    step = (sub.max(axis=-1) - low) / 15
    d = (step.max(axis=-1, keepdims=True) / 63).astype(np.float16)
    dmin = (-low.min(axis=-1, keepdims=True) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(step / np.where(d32 == 0, 1, d32)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / np.where(dmin32 == 0, 1, dmin32)), 0, 63).astype(np.uint8)
    scale = (d32 * sc)[..., None]
    q = np.rint((sub + (dmin32 * m)[..., None]) / np.where(scale == 0, 1, scale))
    q = np.clip(np.where(scale == 0, 0, q), 0, 15).astype(np.uint8)
    packed = np.empty((count, 12), dtype=np.uint8)  # the layout gguf.quants.Q4_K.get_scale_min reads
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    pairs = q.reshape(count, 4, 2, 32)  # byte j of pair i: weight j of sub-block 2i (low), of 2i + 1 (high)
    quants = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, quants.reshape(count, 128)], axis=1)
    return out.reshape(rows, cols // SUPER * 144)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a .gguf model")
    parser.add_argument("target", type=Path, help="the .gguf file to write")
    parser.add_argument("--type", choices=TYPES, required=True, help="the block format of the weights")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        parser.error(f"{args.source} is not a file")
    count = requantize(args.source, args.target, args.type)
    print(f"{args.target}: {count} tensors in {args.type}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
