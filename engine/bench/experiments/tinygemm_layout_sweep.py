"""One-off (2026-12-06): PyTorch's int4 kernel (``aten._weight_int4pack_mm``, "tinygemm") at batch 1
on the Llama-3.1-8B shapes, random weights, over the two layout choices the engine fixes today:
the group size (engine/w4a16.py GROUP, 128) and the inner K tiles the weight is packed with
(TINYGEMM_INNER_K_TILES, 8, gpt-fast's). Microseconds a call (one CUDA graph over weight copies
larger than L2, replayed) and bytes read per second (nibbles plus bf16 scale and zero per group),
next to the device's copy bandwidth measured in the same run.
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/tinygemm_layout_sweep.py``.
"""
import torch

from engine.bench.ceilings import copy_bandwidth
from engine.bench.kernels import time_rotating
from engine.w4a16 import quantize_groups, tinygemm_operands

torch.manual_seed(0)
device = torch.device("cuda")
bw = copy_bandwidth(device)
print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:,.0f} GB/s; batch 1, bf16 x", flush=True)
shapes = {"q|k|v": (6144, 4096), "o_proj": (4096, 4096), "gate|up": (28672, 4096), "down_proj": (4096, 14336), "lm_head": (128256, 4096)}
for name, (n, k) in shapes.items():
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    rows = []
    for group in (64, 128, 256):
        nibbles, scales_zeros = tinygemm_operands(*quantize_groups(w, group), group)
        nbytes = n * k // 2 + scales_zeros.numel() * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        for tiles in (2, 4, 8):
            packed = [torch.ops.aten._convert_weight_to_int4pack(nibbles, tiles) for _ in range(copies)]
            us = time_rotating(lambda i: torch.ops.aten._weight_int4pack_mm(x, packed[i], group, scales_zeros), copies) * 1e6
            rows.append((us, nbytes, f"group {group}, inner K tiles {tiles}"))
            del packed
    print(f"{name} [{n} x {k}]", flush=True)
    for us, nbytes, label in sorted(rows):
        print(f"    {us:7.1f} us {nbytes / us / 1e3:6,.0f} GB/s ({nbytes / us / 1e3 / (bw / 1e9):.2f} of copy)  {label}", flush=True)
    del w
