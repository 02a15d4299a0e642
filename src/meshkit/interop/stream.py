"""Safetensors files written tensor by tensor, so that an export holds one tensor on the host at a time.

``safetensors.numpy.save_file`` takes a file's tensors as one dict, all in memory at once: exporting a
model with it gathers the whole model to the host. The format needs no such thing: a file is an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then the
bytes. Every shape and dtype is known before any tensor is read (from the parameters' shapes), so the
header is written first and each tensor is then gathered (``Tensor.read``), written and dropped.

Shards are cut as ``save_pretrained`` cuts them: tensors in order, a new file where the next would pass
``max_shard_bytes`` (a tensor larger than that alone in its file), named ``model-0000i-of-0000n`` with
an index (``model.safetensors.index.json``), or ``model.safetensors`` when one file holds them all.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

DTYPES = {
    np.dtype(k): v
    for k, v in (
        (np.float64, "F64"),
        (np.float32, "F32"),
        (np.float16, "F16"),
        (ml_dtypes.bfloat16, "BF16"),
        (np.int64, "I64"),
        (np.int32, "I32"),
        (np.int16, "I16"),
        (np.int8, "I8"),
        (np.uint8, "U8"),
        (np.bool_, "BOOL"),
    )
}
"""NumPy dtypes and their safetensors names."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tensor:
    """One tensor of a checkpoint: its name, shape and dtype, and how to read it (a host array of
    exactly that shape and dtype, made when the file it goes into is written)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def split(tensors: list[Tensor], max_shard_bytes: int) -> list[list[Tensor]]:
    """The tensors in files of at most ``max_shard_bytes`` each (a larger tensor: a file of its own)."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write(directory: Path, tensors: list[Tensor], max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` into safetensors files in ``directory`` (and the index where there are
    several); returns the files' names."""
    shards = split(tensors, max_shard_bytes)
    n = len(shards)
    files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for file, shard in zip(files, shards, strict=True):
        write_file(directory / file, shard)
    if n > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: f for f, shard in zip(files, shards, strict=True) for t in shard},
        }
        (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return files


def write_file(path: Path, tensors: list[Tensor], metadata: dict[str, str] | None = None) -> None:
    """One safetensors file: the header, then each tensor read, written and dropped in turn."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"tensor {t.name}: dtype {t.dtype} has no safetensors name")
        header[t.name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            value = np.ascontiguousarray(t.read())
            if value.shape != t.shape or value.dtype != t.dtype:
                raise ValueError(
                    f"tensor {t.name} read as {value.dtype}{value.shape}, not {t.dtype}{t.shape}"
                )
            f.write(value.reshape(-1).view(np.uint8).data)
            del value
