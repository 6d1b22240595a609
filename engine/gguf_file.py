"""A GGUF file's metadata and tensors, read in a fraction of a second.

gguf's ``GGUFReader`` builds a numpy memory-map view for every part of every metadata field; a
151,936-token vocabulary (Qwen2.5) is about ten million views and 23 s on this project's 2-core
machine before the first weight is read, and 3.4 s for SmolLM2's 49k, once per reader, and a
model load opened two or three. :class:`GGUFFile` walks the header once with ``struct`` and keeps
the metadata as Python values; the tensors are views into one read-only memory map, with gguf's
own type enum and the same ``shape`` and ``data`` layout as a ``ReaderTensor``, so gguf's
dequantization (and :mod:`engine.gguf_blocks`) read them unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {  # value type -> (struct format, numpy dtype)
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.FLOAT64: ("<d", np.float64),
    GGUFValueType.BOOL: ("<?", np.bool_),
}  # fmt: skip
_TYPED = {  # tensor types gguf exposes as typed arrays, not bytes
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands; the message names the file."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in ggml order (innermost dimension first), ``data`` a view of the
    file (typed for float and integer types, bytes by row for quantized ones), as gguf gives it."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # strings, numbers and bools; arrays as lists (strings) or numpy arrays
    tensors: tuple[GGUFTensor, ...]

    @classmethod
    def read(cls, path: str | Path) -> GGUFFile:
        """Parse the header of ``path``; tensor data stays on disk until used (memory-mapped)."""
        path = Path(path)
        data = np.memmap(path, mode="r")
        try:
            return _parse(path, data)
        except GGUFFormatError:
            raise
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
            raise GGUFFormatError(f"{path}: not a readable GGUF file ({e})") from e

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of ``key``, or ``default``."""
        return self.metadata.get(key, default)


def _parse(path: Path, data: np.memmap) -> GGUFFile:
    buf = memoryview(data)
    magic, version = struct.unpack_from("<II", buf, 0)
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (magic {magic:#x})")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        metadata[key], pos = _value(buf, pos, GGUFValueType(kind))
    infos = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
        pos += 8 * n_dims
        kind, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append((name, dims, GGMLQuantizationType(kind), offset))
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"{path}: general.alignment={alignment} is not a power of two")
    start = pos + (-pos) % alignment
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise GGUFFormatError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        elements = int(np.prod(dims, dtype=np.int64))
        block, size = GGML_QUANT_SIZES[kind]
        typed = _TYPED.get(kind)
        nbytes = elements * np.dtype(typed).itemsize if typed is not None else elements * size // block
        first = start + offset
        if first + nbytes > len(data):
            raise GGUFFormatError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
        raw = data[first : first + nbytes]
        shape = tuple(reversed(dims))
        view = raw.view(typed).reshape(shape) if typed is not None else raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, tuple(int(d) for d in dims), view))
    return GGUFFile(path, metadata, tuple(tensors))


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise ValueError(f"a string of {n} bytes runs past the end of the file")
    return bytes(buf[pos + 8 : end]).decode("utf-8"), end


def _value(buf: memoryview, pos: int, kind: GGUFValueType) -> tuple[Any, int]:
    if kind == GGUFValueType.STRING:
        return _string(buf, pos)
    if kind in _SCALARS:
        fmt, _ = _SCALARS[kind]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if kind != GGUFValueType.ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    item = GGUFValueType(item)
    if item in _SCALARS:  # one numpy copy, not a Python object per element
        dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
        end = pos + count * dtype.itemsize
        return np.frombuffer(buf[pos:end], dtype=dtype).copy(), end
    values = []
    for _ in range(count):
        value, pos = _value(buf, pos, item)
        values.append(value)
    return values, pos


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (its RoPE pairs adjacent dims; HF pairs halves),
    of a weight [rows, cols] or a bias [rows]."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
