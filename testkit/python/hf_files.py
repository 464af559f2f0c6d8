"""What the test setup's GGUF converters (gemma_bf16.py, gguf_to_hf.py) share when they write a
Hugging Face model directory: bf16 rounding as ggml does it, and a safetensors writer.

The writer is here rather than the `safetensors` package because numpy has no bfloat16 dtype:
the package's numpy API cannot produce BF16 tensors without torch.
"""
import json
from pathlib import Path

import gguf
import numpy as np

ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bit patterns, round to nearest even (ggml_compute_fp32_to_bf16)."""
    return gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32),
                                gguf.GGMLQuantizationType.BF16).view(np.uint16).reshape(a.shape)


def write_safetensors(path: Path, entries, metadata: dict) -> int:
    """The safetensors format (an 8-byte little-endian header size, a JSON header, the data),
    in the order given. `entries` are `(name, dtype, shape, data)`; `data` is an array or a
    function returning one, called when its turn to be written comes, so a large model is never
    whole in memory. Returns the file's size."""
    entries = list(entries)
    header = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, _ in entries:
        n = ITEMSIZE[dtype] * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, dtype, shape, data in entries:
            array = np.ascontiguousarray(data() if callable(data) else data)
            n = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if array.nbytes != n or list(array.shape) != header[name]["shape"]:
                raise ValueError(f"{name}: {array.shape} of {array.nbytes} bytes, header says {shape} {dtype}")
            f.write(array.tobytes())
        size = f.tell()
    if size != 8 + len(raw) + offset:
        raise ValueError(f"{path}: wrote {size} bytes, expected {8 + len(raw) + offset}")
    return size
