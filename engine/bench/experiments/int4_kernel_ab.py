"""One-off (2026-12-03, H200): which kernel should multiply int4 (W4A16) weights - this engine's
Triton kernel (engine/kernels/int4_linear.py: its default tile, and the one-row CUDA-core tiles,
kind "sum") or PyTorch's ``aten._weight_int4pack_mm`` ("tinygemm", engine/w4a16.py
``W4A16Linear.add_tinygemm``) - on the Llama-3.1-8B and Qwen2.5-1.5B projection shapes, random
weights, for 1 row (decode), 16 and 512 rows (prefill): microseconds a call (one CUDA graph over
weight copies that overflow L2, replayed) and bytes read per second, against cuBLAS on the bf16
weight. First it checks tinygemm's output against the dequantized weight, so that the layout
``tinygemm_operands`` assumes is the kernel's.
A form ``--words`` (2026-12-05) timed a one-row CUDA-core GEMV over a "words" layout (each nibble
position's inputs contiguous in x, nibbles made floats by two integer ops, no conversion), since
dropped: 8B gate|up 44.3 us and down_proj 25.7 us at best against tinygemm's 33.6 and 18.9
(docs/results/2026-12-05-h200-int4-words-gemv-ab.txt).
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_kernel_ab.py``.
"""
import torch

from engine.bench.kernels import time_rotating
from engine.kernels.int4_linear import Int4Tile, int4_linear, int4_split_k, int4_tile
from engine.w4a16 import W4A16Linear, int4_linear_ref, quantize_groups

torch.manual_seed(0)
for group in (128, 32):
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) * 0.02
    linear = W4A16Linear(*quantize_groups(w, group), group, None)
    assert linear.add_tinygemm()
    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    ref = int4_linear_ref(x, linear.qweight, linear.scales, linear.mins, group, out_dtype=torch.float32)
    err = ((linear.tinygemm(x).float() - ref).norm() / ref.norm()).item()
    print(f"tinygemm against the dequantized weight, groups of {group}: relative error {err:.2e}", flush=True)
    assert err < 2e-2, "tinygemm_operands' nibble order is not the kernel's"

shapes = {"8B q|k|v": (6144, 4096), "8B o_proj": (4096, 4096), "8B gate|up": (28672, 4096), "8B down_proj": (4096, 14336),
          "1.5B q|k|v": (2048, 1536), "1.5B gate|up": (17920, 1536), "1.5B down_proj": (1536, 8960)}
for name, (n, k) in shapes.items():
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    nbytes = n * k // 2 + n * (k // 128) * 4
    copies = max(2, -(-(256 << 20) // nbytes))
    linears = []
    for _ in range(copies):
        linear = W4A16Linear(*quantize_groups(w), 128, None)
        linear.add_tinygemm()
        linears.append(linear)
    dense = [w.clone() for _ in range(max(2, -(-(256 << 20) // (n * k * 2))))]
    for rows in (1, 16, 512):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        dense_us = time_rotating(lambda i: torch.nn.functional.linear(x, dense[i % len(dense)]), len(dense)) * 1e6
        split = int4_split_k(rows, n, k, 128) if ("o_proj" in name or "down" in name) else 1
        candidates = {f"triton {int4_tile(rows, n, k, 128, split)} split {split}":
                      lambda i: int4_linear(x, linears[i].qweight, linears[i].scales, linears[i].mins, 128, split_k=split)}
        if rows == 1:
            for bn, warps in ((8, 4), (16, 4), (32, 8)):
                tile = Int4Tile(16, bn, 1, warps, 2, "sum")
                candidates[f"triton sum bn{bn} w{warps} split {split}"] = (
                    lambda i, tile=tile: int4_linear(x, linears[i].qweight, linears[i].scales, linears[i].mins, 128, split_k=split, tile=tile))
        candidates["tinygemm"] = lambda i: linears[i].tinygemm(x)
        print(f"{name} [{n}x{k}] rows {rows}: cuBLAS bf16 {dense_us:.1f} us ({n * k * 2 / dense_us / 1e3:.0f} GB/s of bf16)", flush=True)
        for label, fn in candidates.items():
            try:
                us = time_rotating(fn, copies) * 1e6
            except Exception as e:  # out of shared memory or registers: not a candidate
                print(f"    {label}: {type(e).__name__} {str(e)[:120]}", flush=True)
                continue
            print(f"    {us:7.1f} us {nbytes / us / 1e3:5.0f} GB/s  {label}", flush=True)
    del linears, dense
    torch.cuda.empty_cache()
