"""Read a CTranslate2 ``model.bin`` with numpy alone, so PyTorch can run the same weights.

The file (binary version >= 2) is a plain container: a u32 version, the spec name (u16 length,
null-terminated) and a u32 spec revision, a u32 count of variables, then per variable its name,
u8 rank, rank x u32 dims, u8 dtype id, u32 byte count and the raw little-endian bytes; at the end
a u32 count of aliases, each a (name, target) pair of strings. int8 weights come with a
``<name>_scale`` (per output row) and are dequantized here: weight = int8 / scale.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MIN_BINARY_VERSION = 2
# CTranslate2's dtype ids; bfloat16 (5) has no numpy type and is widened to float32 when read.
DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    5: np.dtype("<u2"),
}
BFLOAT16 = 5


class CT2FormatError(ValueError):
    """The file is not a CTranslate2 model this reader understands; the message says why."""


@dataclass(frozen=True)
class CT2Model:
    """The variables of a CTranslate2 model file, aliases resolved, int8 weights dequantized."""

    spec: str
    revision: int
    binary_version: int
    variables: dict[str, np.ndarray]

    def scalar(self, name: str) -> int:
        """A rank-0 variable (e.g. ``encoder/num_heads``) as an int."""
        return int(self.variables[name])


class _Cursor:
    def __init__(self, data: bytes, path: Path) -> None:
        self.data, self.offset, self.path = data, 0, path

    def take(self, count: int) -> bytes:
        if self.offset + count > len(self.data):
            raise CT2FormatError(f"{self.path}: truncated at byte {self.offset} (wanted {count} more)")
        chunk = self.data[self.offset : self.offset + count]
        self.offset += count
        return chunk

    def unpack(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.unpack("H"))
        if not raw.endswith(b"\0"):
            raise CT2FormatError(f"{self.path}: a string at byte {self.offset} is not null-terminated")
        return raw[:-1].decode("utf-8")


def read_ct2_model(path: Path | str) -> CT2Model:
    """Read ``model.bin`` (or the directory holding it) into numpy arrays (copies, writable)."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.bin"
    cursor = _Cursor(path.read_bytes(), path)
    version = cursor.unpack("I")
    if version < MIN_BINARY_VERSION:
        raise CT2FormatError(f"{path}: binary version {version}; this reader needs >= {MIN_BINARY_VERSION}")
    spec = cursor.string()
    revision = cursor.unpack("I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(cursor.unpack("I")):
        name = cursor.string()
        dims = [cursor.unpack("I") for _ in range(cursor.unpack("B"))]
        dtype_id = cursor.unpack("B")
        if dtype_id not in DTYPES:
            raise CT2FormatError(f"{path}: variable {name!r} has unknown dtype id {dtype_id}")
        raw = cursor.take(cursor.unpack("I"))
        array = np.frombuffer(raw, DTYPES[dtype_id]).reshape(dims).copy()
        if dtype_id == BFLOAT16:
            array = (array.astype(np.uint32) << 16).view(np.float32)
        variables[name] = array
    aliases = [(cursor.string(), cursor.string()) for _ in range(cursor.unpack("I"))]
    variables = _dequantize(variables)
    for alias, target in aliases:
        variables[alias] = variables[target]
    return CT2Model(spec, revision, version, variables)


def _dequantize(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Replace each int8 ``X`` that has an ``X_scale`` by float32 ``X / X_scale`` (per row)."""
    out = {}
    for name, array in variables.items():
        if name.endswith("_scale"):
            continue
        scale = variables.get(name + "_scale")
        if scale is not None and array.dtype == np.int8:
            scale = scale.astype(np.float32).reshape(-1, *([1] * (array.ndim - 1)))
            array = array.astype(np.float32) / scale
        out[name] = array
    return out


def write_ct2_model(path: Path | str, spec: str, revision: int, variables: dict[str, np.ndarray],
                    aliases: dict[str, str] | None = None) -> None:
    """Write variables in the same container (binary version 6); the reader's inverse."""
    ids = {dtype: dtype_id for dtype_id, dtype in DTYPES.items() if dtype_id != BFLOAT16}

    def string(text: str) -> bytes:
        raw = text.encode("utf-8") + b"\0"
        return struct.pack("<H", len(raw)) + raw

    parts = [struct.pack("<I", 6), string(spec), struct.pack("<I", revision),
             struct.pack("<I", len(variables))]
    for name, array in variables.items():
        array = np.asarray(array, order="C")  # (ascontiguousarray would make a scalar 1-d)
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        parts += [string(name), struct.pack("<B", array.ndim),
                  struct.pack(f"<{array.ndim}I", *array.shape),
                  struct.pack("<B", ids[np.dtype(dtype)]), struct.pack("<I", array.nbytes),
                  array.astype(dtype, copy=False).tobytes()]
    aliases = aliases or {}
    parts.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        parts += [string(alias), string(target)]
    Path(path).write_bytes(b"".join(parts))


__all__ = ["CT2FormatError", "CT2Model", "read_ct2_model", "write_ct2_model"]
