"""One-off (2026-12-03, H200): int4 (W4A16) kernel tiles at batch 1 on the Llama-3.1-8B and
Qwen2.5-1.5B projection shapes, random weights: microseconds per call (one CUDA graph over
weight copies that overflow L2, replayed, as engine.bench.kernels --gemv times them) and the bytes
read per second, against cuBLAS on the bf16 weight; the tensor-core kernel's tiles and the CUDA-core
GEMV's (kind "sum", added after the second run). Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_tile_sweep.py``.
"""
import itertools

import torch

from engine.bench.kernels import time_rotating
from engine.kernels.int4_linear import Int4Tile, int4_linear, int4_split_k, int4_tile
from engine.w4a16 import quantize_groups


shapes = {"8B q|k|v": (6144, 4096), "8B o_proj": (4096, 4096), "8B gate|up": (28672, 4096), "8B down_proj": (4096, 14336),
          "1.5B q|k|v": (2048, 1536), "1.5B gate|up": (17920, 1536), "1.5B down_proj": (1536, 8960)}
for name, (n, k) in shapes.items():
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, s, m = quantize_groups(w)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nbytes = q.numel() + 2 * s.numel() * 2
    copies = max(2, -(-(256 << 20) // nbytes))
    packs = [(q.clone(), s.clone(), m.clone()) for _ in range(copies)]
    dense = [w.clone() for _ in range(max(2, -(-(256 << 20) // (n * k * 2))))]
    dense_us = time_rotating(lambda i: torch.nn.functional.linear(x, dense[i]), len(dense)) * 1e6
    rows = []
    splits = {1, int4_split_k(1, n, k, 128)} if "o_proj" in name or "down" in name else {1}
    tiles = [(Int4Tile(16, bn, gps, 4, st), sp) for bn, gps, st, sp in itertools.product((16, 32, 64), (1, 2, 4), (3, 5), sorted(splits))]
    tiles += [(Int4Tile(16, bn, 1, w_, st, "sum"), sp) for bn, w_, st, sp in itertools.product((4, 8, 16, 32), (2, 4), (2, 3), sorted(splits))]
    default = (int4_tile(1, n, k, 128, max(splits)), max(splits))
    for tile, split in [default, *tiles]:
        if k % (split * 128 * tile.groups_per_step):
            continue
        try:
            us = time_rotating(lambda i: int4_linear(x, *packs[i], 128, split_k=split, tile=tile), copies) * 1e6
        except Exception as e:  # out of shared memory or registers: not a candidate
            print(f"  {name} {tile} split {split}: {type(e).__name__}")
            continue
        rows.append((us, tile, split))
    del packs, dense
    default_us = rows[0][0]  # timed first
    rows.sort(key=lambda r: r[0])
    print(f"{name} [{n}x{k}] cuBLAS bf16 {dense_us:.1f} us ({w.numel() * 2 / dense_us / 1e3:.0f} GB/s); int4 default {default[0]} "
          f"split {default[1]} {default_us:.1f} us ({nbytes / default_us / 1e3:.0f} GB/s)", flush=True)
    for us, tile, split in rows[:5]:
        print(f"    {us:6.1f} us {nbytes / us / 1e3:5.0f} GB/s  {tile} split {split}", flush=True)
