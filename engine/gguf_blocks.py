"""GGUF weight matrices as the two block formats the CPU kernels run: Q4_1 and Q8_0, 32 weights a block.

The int4 PyTorch path (engine/quantization.py) and the native decode step (engine/native_decode.py)
multiply Q4_1 (w = d*q + m, q in 0..15) and Q8_0 (w = d*q, q signed 8-bit) blocks of 32 along K,
with d and m held as float32. Files quantized with llama.cpp's "K-quants" (e.g. Qwen2.5's
Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0) are repacked into those two formats at load time; layouts as in
ggml-common.h / ``gguf.quants``:

- **Q4_K -> Q4_1, exact.** A Q4_K super-block is 256 weights: fp16 ``d`` and ``dmin``, eight
  6-bit (scale, min) pairs and 4-bit q; sub-block j (32 weights) is w = (d*sc_j)*q - dmin*m_j,
  i.e. a Q4_1 block with d' = d*sc_j and m' = -dmin*m_j. Both products (11-bit fp16 significand
  times a 6-bit integer) are exact in float32, so ``d'*q + m'`` is bit for bit the value
  ``gguf.quants.dequantize`` computes. They are *not* exact in fp16 (17 significant bits), which
  is why the repacked blocks keep float32 scales, unlike a Q4_1 file's fp16 ones.
- **Q5_0 -> Q8_0, exact.** w = d*(q5 - 16) with q5 in 0..31: a Q8_0 block with the same d and
  q = q5 - 16; bit for bit gguf's value.
- **Q6_K -> Q8_0, not exact.** A Q6_K super-block has one int8 scale per 16 weights, so a
  32-group mixes two scales s_a = d*sc_a, s_b = d*sc_b, w = s*q with q in -32..31. The group is
  requantized with d' = s/4 of the scale of larger magnitude (signed): that half is exact
  (q' = 4q in -128..124); the other half is rounded to the nearest multiple of d' (clipped to
  int8). Measured against ``gguf.quants.dequantize`` (2026-12-01), per tensor: the 29 Q6_K
  tensors of Qwen2.5-Coder-1.5B-Instruct Q4_K_M: largest |error| 0.29-0.40% of the tensor's
  largest |w|, mean |error| 0.28-0.65% of its mean |w| (mean over tensors 0.31%), RMS error
  0.38-0.65% of its RMS; the 0.5B's 12: 0.22-0.39%, 0.28-0.31%, 0.39-0.45%. A plain Q8_0
  requantization (d = amax/127 per 32) of the same values has about twice the mean error
  (0.55-1.04% on the 1.5B).
  (``python -m engine.gguf_blocks FILE`` prints these figures.)

Q4_1 and Q8_0 tensors are read as they are (their fp16 d and m widened to float32).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K as GGUF_Q4_K
from gguf.quants import Q6_K as GGUF_Q6_K
from gguf.quants import dequantize

GROUP = 32  # weights per block of the formats the kernels run
QK_K = 256  # weights per K-quant super-block
SLAB_BLOCKS = 4096  # super-blocks (1M weights) a Q6_K slab: small enough for its temporaries, big enough for numpy
SUPPORTED = (Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_0, Q.Q6_K)


class UnsupportedTensorError(ValueError):
    """A GGUF tensor whose type the CPU kernels cannot run (the message names file, tensor and type)."""


@dataclass(frozen=True)
class Blocks:
    """A matrix [rows, cols] as blocks of 32 along cols: Q4_1 (``q`` uint8 0..15, w = d*q + m) or
    Q8_0 (``q`` int8, w = d*q, ``m`` None); ``d`` and ``m`` float32 [rows, cols/32]."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None

    @property
    def is_q4_1(self) -> bool:
        return self.m is not None

    def dequantize(self) -> np.ndarray:
        """The float32 weights [rows, cols] (d*q + m in that order: Q4_K's repack is then bit-exact)."""
        rows, cols = self.q.shape
        w = self.q.reshape(rows, cols // GROUP, GROUP).astype(np.float32)
        w *= self.d[..., None]  # broadcast per block: no repeated copy of the scales
        if self.m is not None:
            w += self.m[..., None]
        return w.reshape(rows, cols)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields [..., 2] bytes as float32 [...]."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def q4_1_blocks(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """Q4_1 (20 bytes a block: fp16 d, fp16 m, 16 bytes of nibbles, low = weights 0..15)."""
    b = raw.reshape(rows, cols // GROUP, 20)
    qs = b[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return Blocks(q.reshape(rows, cols), _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """Q8_0 (34 bytes a block: fp16 d, 32 int8)."""
    b = raw.reshape(rows, cols // GROUP, 34)
    return Blocks(b[..., 2:34].copy().view(np.int8).reshape(rows, cols), _f16(b[..., 0:2]), None)


def q4_k_blocks(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """Q4_K (144 bytes a super-block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes
    of nibbles: byte i of chunk c holds weight i of sub-block 2c (low) and of 2c+1 (high)) as Q4_1."""
    b = raw.reshape(rows * (cols // QK_K), 144)
    sc, mn = GGUF_Q4_K.get_scale_min(b[:, 4:16])  # [n, 8] each, 0..63
    d = _f16(b[:, 0:2])[:, None] * sc.astype(np.float32)  # exact in float32: 11 x 6 significant bits
    m = -(_f16(b[:, 2:4])[:, None] * mn.astype(np.float32))
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [n, chunk, low/high, 32] = sub-blocks in order
    return Blocks(q.reshape(rows, cols), d.reshape(rows, cols // GROUP), m.reshape(rows, cols // GROUP))


def q5_0_blocks(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """Q5_0 (22 bytes a block: fp16 d, 32 high bits, 16 bytes of low nibbles) as Q8_0: q5 - 16."""
    b = raw.reshape(rows * (cols // GROUP), 22)
    q = np.empty((len(b), GROUP), np.uint8)  # built in place: no temporaries of the whole matrix
    np.bitwise_and(b[:, 6:22], 0x0F, out=q[:, :16])
    np.right_shift(b[:, 6:22], 4, out=q[:, 16:])
    high = np.unpackbits(b[:, 2:6], axis=1, bitorder="little")  # bit j of the little-endian uint32: weight j
    high <<= 4
    q |= high
    q -= 16  # wraps to q5 - 16 as int8
    return Blocks(q.view(np.int8).reshape(rows, cols), _f16(b[:, 0:2]).reshape(rows, cols // GROUP), None)


def _q6_k_slabs(b: np.ndarray):
    """(first block, slab, gguf's own float32 values [n, 256]) for each slab of SLAB_BLOCKS Q6_K
    super-blocks of ``b`` [blocks, 210]: gguf's ``dequantize_blocks`` on many blocks a call rather
    than ``dequantize``'s 16 rows at a time (each block is computed alone, so the values are the
    same; a 1.5B model's head is 57k calls less), a slab's temporaries staying in cache."""
    for s in range(0, len(b), SLAB_BLOCKS):
        slab = b[s : s + SLAB_BLOCKS]
        yield s, slab, GGUF_Q6_K.dequantize_blocks(slab)


def q6_k_blocks(raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """Q6_K (210 bytes a super-block: 4+2 bit q, 16 int8 scales, fp16 d) requantized to Q8_0: per
    group of 32, d' = (the larger-magnitude of its two 16-weight scales) / 4 (module docstring)."""
    b = raw.reshape(rows * (cols // QK_K), 210)
    q = np.empty((len(b), QK_K // GROUP, GROUP), np.int8)
    d = np.empty((len(b), QK_K // GROUP, 1), np.float32)
    for s, slab, values in _q6_k_slabs(b):
        w = values.reshape(-1, QK_K // GROUP, GROUP)
        scales = _f16(slab[:, 208:210])[:, None] * slab[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
        pairs = scales.reshape(-1, QK_K // GROUP, 2)
        big = np.take_along_axis(pairs, np.abs(pairs).argmax(axis=-1, keepdims=True), axis=-1)  # [n, 8, 1]
        d[s : s + SLAB_BLOCKS] = big / 4
        with np.errstate(divide="ignore", invalid="ignore"):
            qs = np.where(d[s : s + SLAB_BLOCKS] == 0, 0, np.rint(w / d[s : s + SLAB_BLOCKS]))
        q[s : s + SLAB_BLOCKS] = np.clip(qs, -128, 127)
    return Blocks(q.reshape(rows, cols), d.reshape(rows, cols // GROUP), None)


def q6_k_values(raw: np.ndarray) -> np.ndarray:
    """Q6_K blocks (any shape of whole 210-byte blocks) as gguf's own float32 values, flat
    (computed a slab at a time: :func:`_q6_k_slabs`)."""
    b = raw.reshape(-1, 210)
    out = np.empty((len(b), QK_K), np.float32)
    for s, slab, values in _q6_k_slabs(b):
        out[s : s + len(slab)] = values
    return out.reshape(-1)


READERS = {Q.Q4_1: q4_1_blocks, Q.Q8_0: q8_0_blocks, Q.Q4_K: q4_k_blocks, Q.Q5_0: q5_0_blocks, Q.Q6_K: q6_k_blocks}


def tensor_blocks(tensor) -> Blocks:
    """One GGUF matrix (an :class:`engine.gguf_file.GGUFTensor`, or gguf's ``ReaderTensor``) as
    Q4_1 or Q8_0 :class:`Blocks`; any other type
    raises :class:`UnsupportedTensorError` naming the file, the tensor and its type."""
    read = READERS.get(tensor.tensor_type)
    if read is None or len(tensor.shape) != 2:
        file = getattr(tensor.data, "filename", None) or "a GGUF file"  # the reader's memory map knows its file
        raise UnsupportedTensorError(
            f"{file}: tensor {tensor.name} is {tensor.tensor_type.name}{'' if len(tensor.shape) == 2 else ' and not a matrix'}; "
            f"the int4/native CPU path runs {', '.join(t.name for t in SUPPORTED)} matrices")
    cols, rows = (int(x) for x in tensor.shape)
    return read(np.asarray(tensor.data), rows, cols)


EXACT = (Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_0)  # repacked bit for bit: Blocks.dequantize() is gguf's value


class BlockCache:
    """The :class:`Blocks` of one GGUF file's matrices, each repacked once and kept for one load:
    an int4 load reads every matrix three times (its dense bf16 copy, the int4 parts, the native
    step's copy) and repacking is most of its time."""

    def __init__(self, tensors: dict) -> None:
        """``tensors``: the file's tensors by name (:func:`engine.quantization.gguf_tensors`)."""
        self.tensors = tensors
        self._blocks: dict[str, Blocks] = {}

    def __getitem__(self, name: str) -> Blocks:
        if name not in self._blocks:
            self._blocks[name] = tensor_blocks(self.tensors[name])
        return self._blocks[name]

    @property
    def repacked(self) -> int:
        """How many matrices have been repacked so far."""
        return len(self._blocks)


def dequantized(tensor, cache: BlockCache | None = None) -> np.ndarray:
    """One GGUF tensor as float32 values in its file's layout, the same values as
    ``gguf.quants.dequantize``: through :class:`Blocks` where the repack is exact (faster than
    gguf's generic reader, and shared with ``cache``), Q6_K through :func:`q6_k_values`, else through gguf."""
    if tensor.tensor_type in EXACT and len(tensor.shape) == 2:
        blocks = cache[tensor.name] if cache is not None else tensor_blocks(tensor)
        return blocks.dequantize()
    if tensor.tensor_type == Q.Q6_K:
        cols, *rest = (int(x) for x in tensor.shape)
        return q6_k_values(np.asarray(tensor.data)).reshape(*reversed(rest), cols)
    return dequantize(tensor.data, tensor.tensor_type)


def repack_error(tensor) -> tuple[float, float, float]:
    """(largest |error| / largest |w|, mean |error| / mean |w|, RMS error / RMS w) of
    :func:`tensor_blocks` against ``gguf.quants.dequantize``, computed a slab of rows at a time."""
    cols, rows = (int(x) for x in tensor.shape)
    raw = np.asarray(tensor.data).reshape(rows, -1)
    max_err = max_w = sum_err = sum_w = sq_err = sq_w = 0.0
    for r0 in range(0, rows, 4096):
        slab = raw[r0 : r0 + 4096]
        exact = dequantize(slab, tensor.tensor_type).reshape(len(slab), cols).astype(np.float64)
        err = np.abs(READERS[tensor.tensor_type](slab, len(slab), cols).dequantize() - exact)
        max_err, max_w = max(max_err, err.max()), max(max_w, np.abs(exact).max())
        sum_err, sum_w = sum_err + err.sum(), sum_w + np.abs(exact).sum()
        sq_err, sq_w = sq_err + (err**2).sum(), sq_w + (exact**2).sum()
    return max_err / max_w, sum_err / sum_w, (sq_err / sq_w) ** 0.5


def main(argv: list[str]) -> int:
    """Print :func:`repack_error` of every non-exact (Q6_K) matrix of the GGUF files in ``argv``."""
    from engine.gguf_file import GGUFFile

    for path in argv:
        figures = []
        for t in GGUFFile.read(path).tensors:
            if t.tensor_type == Q.Q6_K:
                figures.append(repack_error(t))
                print(f"{t.name:28s} max {figures[-1][0]:.3%}  mean {figures[-1][1]:.3%}  rms {figures[-1][2]:.3%}", flush=True)
        if figures:
            lo, hi = np.min(figures, axis=0), np.max(figures, axis=0)
            print(f"{path}: {len(figures)} Q6_K tensors -> Q8_0: max |err|/max |w| {lo[0]:.2%}..{hi[0]:.2%}, "
                  f"mean |err|/mean |w| {lo[1]:.2%}..{hi[1]:.2%}, rms {lo[2]:.2%}..{hi[2]:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
