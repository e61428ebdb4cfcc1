"""Write a GGUF model's weights in another block format: the same metadata and tokenizer, every 2-D weight
whose rows are whole blocks of 32 re-quantized (through float32) to Q8_0, Q4_0 or Q4_1 by the ``gguf``
package; norms and other tensors copied as they are.

    .venv/bin/python scripts/requantize_gguf.py models/smollm2-135m-instruct/model.gguf /tmp/q8.gguf --type Q8_0

For trying ``dtype: gguf`` (serving/engine/blocks.py) on each format and for its tests; llama.cpp's
``llama-quantize`` does the same from a float file with better rounding (importance matrices, K-quants).
Re-quantizing an already 4-bit file adds the new format's rounding to the old one's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

TYPES = ("Q8_0", "Q4_0", "Q4_1")


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
            writer.add_key_value(field.name, int(gguf.LlamaFileType[f"MOSTLY_{qtype}"]), value_type)
            continue
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    new_type = gguf.GGMLQuantizationType[qtype]
    count = 0
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]  # rows first
        data, raw_type = tensor.data, tensor.tensor_type
        if len(shape) == 2 and shape[1] % 32 == 0 and tensor.tensor_type != new_type:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
            data, raw_type = quantize(values, new_type), new_type
            count += 1
        writer.add_tensor(tensor.name, np.ascontiguousarray(data), raw_shape=data.shape, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count


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
