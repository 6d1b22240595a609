"""One-off (2026-12-05): the Llama-3.1-8B lm_head [128,256 x 4,096] at batch 1 in each format
``EngineConfig.lm_head_quantization`` offers, random weights, float32 logits out as the engine
takes them: bf16 through today's GEMV tile, e4m3 through the FP8 GEMV over a sweep of tiles (the
default borrows the bf16 tile with K 256), int4 groups of 128 through tinygemm. Microseconds a
call (one CUDA graph, two weight copies, each larger than L2) and bytes read per second, next
to the device's copy bandwidth measured in the same run.
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/lm_head_gemv_sweep.py``.
"""
import itertools

import torch

from engine.bench.ceilings import copy_bandwidth
from engine.bench.kernels import time_rotating
from engine.fp8 import quantize_rows
from engine.kernels.linear import GemvConfig, decode_linear, fp8_decode_tile
from engine.w4a16 import W4A16Linear, quantize_groups

torch.manual_seed(0)
n, k = 128256, 4096
device = torch.device("cuda")
bw = copy_bandwidth(device)
print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:,.0f} GB/s; lm_head [{n} x {k}], batch 1, float32 out", flush=True)
x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
rows = [(time_rotating(lambda i: decode_linear(x, dense[i], torch.float32), 2) * 1e6, n * k * 2, "bf16, today's GEMV tile")]
packs = [quantize_rows(w) for w in dense]
configs = [("e4m3, the default tile (bf16's, K 256)", fp8_decode_tile(n, k, 256))]
configs += [(f"e4m3, bn{bn} bk{bk} s{st} w{nw}", GemvConfig("dot", bn, bk, nw, st))
            for bn, bk, st, nw in itertools.product((32, 64, 128), (256, 512), (3, 4, 6), (4, 8))]
for label, config in configs:
    try:
        us = time_rotating(lambda i: decode_linear(x, packs[i][0], torch.float32, config, w_scale=packs[i][1], fp8_math="fp16"), 2) * 1e6
    except Exception as e:  # out of shared memory: not a candidate
        print(f"    {label}: {type(e).__name__}", flush=True)
        continue
    rows.append((us, n * k + n * 4, label))
int4 = [W4A16Linear(*quantize_groups(w), 128, None) for w in dense]
for head in int4:
    head.add_tinygemm()
del dense
rows.append((time_rotating(lambda i: int4[i].tinygemm(x, torch.float32), 2) * 1e6, n * k // 2 + n * (k // 128) * 4, "int4 groups of 128, tinygemm"))
rows.sort()
for us, nbytes, label in rows[:12] + [r for r in rows[12:] if "default" in r[2] or "bf16" in r[2]]:
    print(f"  {us:7.1f} us  {nbytes / us / 1e3:6,.0f} GB/s ({nbytes / us / 1e3 / (bw / 1e9):.2f} of copy)  {label}", flush=True)
