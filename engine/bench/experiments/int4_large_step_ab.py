"""One-off (2026-12-06): int4 projections of many rows (prefill) through the Triton W4A16 kernel
against writing the weight out in bf16 and multiplying with cuBLAS (``W4A16Linear.dequantized_matmul``),
and cuBLAS on a bf16 weight alone, on the 8B's shapes: where the crossover lies
(``engine.w4a16.DEQUANTIZE_MIN_ROWS``). Random weights; each variant's output checked against
the bf16 product of the dequantized weight; times from ``triton.testing.do_bench``.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_large_step_ab.py``.
"""
import torch
import torch.nn.functional as F
import triton.testing

from engine.kernels.int4_linear import int4_dequantize, int4_linear
from engine.w4a16 import W4A16Linear, quantize_groups

SHAPES = {"q|k|v": (6144, 4096), "o_proj": (4096, 4096), "gate|up": (28672, 4096), "down_proj": (4096, 14336)}
ROWS = (16, 64, 128, 256, 512, 2048)
device = torch.device("cuda")
print(torch.cuda.get_device_name(), "microseconds: Triton int4 / dequantize + cuBLAS (of it the dequantize) / cuBLAS bf16 alone", flush=True)
for name, (n, k) in SHAPES.items():
    q, scales, mins = quantize_groups(torch.randn(n, k, device=device) * 0.02, 128)
    linear = W4A16Linear(q, scales, mins, 128, None)
    w = int4_dequantize(q, scales, mins, 128)
    deq_us = triton.testing.do_bench(lambda: int4_dequantize(q, scales, mins, 128), warmup=5, rep=40) * 1e3
    for rows in ROWS:
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        ref = F.linear(x, w).float()
        got = {"triton": int4_linear(x, q, scales, mins, 128), "dequantized": linear.dequantized_matmul(x)}
        errs = {key: ((y.float() - ref).norm() / ref.norm()).item() for key, y in got.items()}
        t_tri = triton.testing.do_bench(lambda: int4_linear(x, q, scales, mins, 128), warmup=5, rep=40) * 1e3
        t_deq = triton.testing.do_bench(lambda: linear.dequantized_matmul(x), warmup=5, rep=40) * 1e3
        t_bf16 = triton.testing.do_bench(lambda: F.linear(x, w), warmup=5, rep=40) * 1e3
        print(f"{name:10s} rows {rows:6d}: {t_tri:9.1f} / {t_deq:9.1f} ({deq_us:6.1f}) / {t_bf16:9.1f}   "
              f"errors triton {errs['triton']:.1e}, dequantized {errs['dequantized']:.1e}", flush=True)
