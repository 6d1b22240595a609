"""GGUF matrices as Q4_1/Q8_0 blocks (engine/gguf_blocks.py), checked against the ``gguf``
package's own dequantizer: bit-exact for Q4_1, Q8_0, Q4_K and Q5_0, within the requantization
bound for Q6_K; on random blocks (every bit pattern of q, scales and mins) and on the real
Qwen2.5-Coder-0.5B file."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest

from engine.gguf_blocks import READERS, BlockCache, UnsupportedTensorError, dequantized, repack_error, tensor_blocks
from engine.quantization import gguf_supports_int4, gguf_tensors

Q = gguf.GGMLQuantizationType
FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_0: (0,), Q.Q6_K: (208,)}  # byte offsets of each block's fp16 d (and dmin)


def random_raw(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random block bytes [rows, bytes per row]; the fp16 fields finite, some of them subnormal."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        d = rng.uniform(-0.05, 0.05, len(raw)) * np.where(rng.random(len(raw)) < 0.1, 1e-4, 1.0)
        raw[:, offset : offset + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def exact(raw: np.ndarray, qtype: Q, rows: int, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(rows, cols)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0])
def test_exact_repacks_of_random_blocks(qtype):
    """Q4_K -> Q4_1 and Q5_0 -> Q8_0 give gguf's float32 values bit for bit (3 rows of 2 super-blocks)."""
    rows, cols = 3, 512
    raw = random_raw(qtype, rows, cols)
    blocks = READERS[qtype](raw, rows, cols)
    assert blocks.is_q4_1 == (qtype == Q.Q4_K)
    assert blocks.q.shape == (rows, cols) and blocks.d.shape == (rows, cols // 32)
    if qtype == Q.Q4_K:
        assert blocks.q.dtype == np.uint8 and blocks.q.max() == 15 and blocks.q.min() == 0
    else:
        assert blocks.q.dtype == np.int8 and blocks.q.max() == 15 and blocks.q.min() == -16
    np.testing.assert_array_equal(blocks.dequantize(), exact(raw, qtype, rows, cols))


def test_q6_k_requantization_bound():
    """Q6_K -> Q8_0: per group of 32, the half with the larger scale is exact; every weight is
    within half a step d' of gguf's value (a whole step where 4*q*s_small/s_big rounds past 127)."""
    rows, cols = 4, 768
    raw = random_raw(Q.Q6_K, rows, cols)
    blocks = READERS[Q.Q6_K](raw, rows, cols)
    want = exact(raw, Q.Q6_K, rows, cols)
    err = np.abs(blocks.dequantize() - want).reshape(rows, -1, 2, 16)
    step = np.abs(blocks.d).reshape(rows, -1, 1, 1)
    assert blocks.q.dtype == np.int8 and blocks.q.min() == -128
    clipped = np.abs(want.reshape(err.shape)) > 127.5 * step
    assert (err <= np.where(clipped, 1.0, 0.5) * step * (1 + 1e-6)).all()
    assert clipped.mean() < 0.01
    sc = raw.reshape(-1, 210)[:, 192:208].view(np.int8).reshape(rows, -1, 2)  # the scale of each 16-weight half
    larger = np.abs(sc.astype(np.int32)).argmax(-1)  # which half sets d'
    exact_half = np.take_along_axis(err.max(-1), larger[..., None], -1)
    assert (exact_half == 0).all()
    assert err.max() > 0  # the other half is rounded: this is a requantization


@pytest.fixture(scope="module")
def qwen_tensors(qwen_0_5b_gguf) -> dict:
    return gguf_tensors(str(qwen_0_5b_gguf))


def test_real_tensors_of_the_qwen_file(qwen_tensors):
    """The 0.5B's Q4_K, Q5_0 and Q8_0 matrices bit for bit; its Q6_K ones within the measured
    error (module docstring: largest 0.22-0.39% of max |w|, mean 0.28-0.31% of mean |w|)."""
    by_type: dict[Q, list] = {}
    for t in qwen_tensors.values():
        if len(t.shape) == 2 and not t.name.startswith(("token_embd", "output")):  # keep it quick: the layers'
            by_type.setdefault(t.tensor_type, []).append(t)
    assert set(by_type) == {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0}
    for qtype in (Q.Q4_K, Q.Q5_0, Q.Q8_0):
        t = by_type[qtype][0]
        cols, rows = (int(x) for x in t.shape)
        np.testing.assert_array_equal(tensor_blocks(t).dequantize(), exact(t.data, qtype, rows, cols), err_msg=t.name)
    for t in by_type[Q.Q6_K][:2]:
        largest, mean, rms = repack_error(t)
        assert 0 < largest < 0.005 and mean < 0.004 and rms < 0.005, (t.name, largest, mean, rms)


def test_unsupported_types_name_the_file_tensor_and_type(qwen_tensors, qwen_0_5b_gguf, tmp_path):
    with pytest.raises(UnsupportedTensorError, match=re.escape(f"{qwen_0_5b_gguf.name}: tensor blk.0.attn_q.bias is F32 and not a matrix")):
        tensor_blocks(qwen_tensors["blk.0.attn_q.bias"])
    path = tmp_path / "f16.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", np.ones((4, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = gguf_tensors(str(path))["blk.0.ffn_up.weight"]
    with pytest.raises(UnsupportedTensorError, match=re.escape(f"{path}: tensor blk.0.ffn_up.weight is F16; the int4/native CPU path runs "
                                                               "Q4_1, Q8_0, Q4_K, Q5_0, Q6_K matrices")):
        tensor_blocks(t)
    assert not gguf_supports_int4(str(path))
    assert gguf_supports_int4(str(qwen_0_5b_gguf))


def test_a_loads_block_cache_repacks_each_matrix_once_and_dequantizes_like_gguf(qwen_tensors):
    """The dense copy of an int4 load reads the same repacked blocks as its int4 and native copies
    (one repack a matrix), with gguf's values bit for bit; Q6_K, whose repack is not exact, and
    vectors are dequantized by gguf and leave the cache alone."""
    cache = BlockCache(qwen_tensors)
    q4k = next(t for t in qwen_tensors.values() if t.tensor_type == Q.Q4_K)
    q6k = next(t for t in qwen_tensors.values() if t.tensor_type == Q.Q6_K)
    bias = qwen_tensors["blk.0.attn_q.bias"]
    for t in (q4k, q6k, bias):
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(dequantized(t, cache).reshape(want.shape), want, err_msg=t.name)
    assert cache.repacked == 1
    assert cache[q4k.name] is cache[q4k.name] and cache.repacked == 1
