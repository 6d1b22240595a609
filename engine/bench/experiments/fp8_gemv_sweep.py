"""One-off (2026-12-03, H200): FP8 weights (e4m3, a scale per output row) at batch 1 on the
Llama-3.1-8B projection shapes, random weights: the Triton GEMV (engine/kernels/linear.py,
``w_scale``) over tiles wider in K than the bf16 tile it borrows today, against cuBLASLt's FP8
matmul (``torch._scaled_mm``, x rounded to e4m3 per row, as Fp8Linear runs prefill) and cuBLAS on
the bf16 weight; then int4 (engine/w4a16.py) for 1 to 16 rows, tinygemm against the Triton
kernel, to find the row count up to which tinygemm wins. Microseconds a call (one CUDA graph over
weight copies that overflow L2, replayed) and bytes read per second.
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/fp8_gemv_sweep.py``.
"""
import itertools
from dataclasses import replace

import torch

from engine.bench.kernels import time_rotating
from engine.fp8 import quantize_rows
from engine.kernels.int4_linear import int4_linear, int4_split_k
from engine.kernels.linear import GemvConfig, decode_linear, decode_tile
from engine.w4a16 import W4A16Linear, quantize_groups

torch.manual_seed(0)
shapes = {"q|k|v": (6144, 4096), "o_proj": (4096, 4096), "gate|up": (28672, 4096), "down_proj": (4096, 14336)}
print("FP8 at batch 1 (fp16 math in the GEMV)", flush=True)
for name, (n, k) in shapes.items():
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, s = quantize_rows(w)
    copies = max(2, -(-(256 << 20) // (n * k)))
    packs = [(q.clone(), s.clone()) for _ in range(copies)]
    dense = [w.clone() for _ in range(max(2, -(-(256 << 20) // (n * k * 2))))]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    dense_us = time_rotating(lambda i: torch.nn.functional.linear(x, dense[i % len(dense)]), len(dense)) * 1e6
    gated = name == "gate|up"
    base = replace(decode_tile(n, k), block_k=256)
    rows = []
    configs = [("today's tile, K 256", base)]
    for bn, bk, st in itertools.product((16, 32, 64), (256, 512), (3, 4, 6)):
        if k % bk == 0:
            configs.append((f"bn{bn} bk{bk} s{st}", GemvConfig("dot", bn, bk, 4, st)))
    for label, config in configs:
        try:
            us = time_rotating(lambda i: decode_linear(x, packs[i][0], None, config, gated=gated, w_scale=packs[i][1], fp8_math="fp16"),
                               copies) * 1e6
        except Exception as e:  # out of shared memory: not a candidate
            print(f"    {label}: {type(e).__name__}", flush=True)
            continue
        rows.append((us, label))
    x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)

    def scaled_mm(i, xs=x16):
        xq, x_scale = quantize_rows(xs)
        return torch._scaled_mm(xq, packs[i][0].t(), scale_a=x_scale[:, None], scale_b=packs[i][1][None, :], out_dtype=torch.bfloat16)
    try:
        rows.append((time_rotating(scaled_mm, copies) * 1e6, "torch._scaled_mm, x padded to 16 rows"))
    except Exception as e:
        print(f"    _scaled_mm: {type(e).__name__} {str(e)[:150]}", flush=True)
    default_us = rows[0][0]
    rows.sort()
    print(f"{name} [{n}x{k}] cuBLAS bf16 {dense_us:.1f} us; FP8 today {default_us:.1f} us ({n * k / default_us / 1e3:.0f} GB/s)", flush=True)
    for us, label in rows[:6]:
        print(f"    {us:6.1f} us {n * k / us / 1e3:5.0f} GB/s  {label}", flush=True)
    del packs, dense

print("int4: tinygemm against the Triton kernel by rows", flush=True)
for name, (n, k) in shapes.items():
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    nbytes = n * k // 2 + n * (k // 128) * 4
    copies = max(2, -(-(256 << 20) // nbytes))
    linears = []
    for _ in range(copies):
        linear = W4A16Linear(*quantize_groups(w), 128, None)
        linear.add_tinygemm()
        linears.append(linear)
    for rows_ in (1, 2, 4, 8, 16):
        x = torch.randn(rows_, k, device="cuda", dtype=torch.bfloat16)
        split = int4_split_k(rows_, n, k, 128) if name in ("o_proj", "down_proj") else 1
        tri = time_rotating(lambda i: int4_linear(x, linears[i].qweight, linears[i].scales, linears[i].mins, 128, split_k=split), copies) * 1e6
        tiny = time_rotating(lambda i: linears[i].tinygemm(x), copies) * 1e6
        print(f"{name} rows {rows_:2d}: tinygemm {tiny:6.1f} us ({nbytes / tiny / 1e3:4.0f} GB/s), triton {tri:6.1f} us "
              f"({nbytes / tri / 1e3:4.0f} GB/s)", flush=True)
    del linears
    torch.cuda.empty_cache()
