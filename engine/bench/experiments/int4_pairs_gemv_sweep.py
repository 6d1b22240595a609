"""One-off (2026-12-06): the engine's int4 "pairs" GEMV (engine/kernels/int4_pairs_gemv.py)
against PyTorch's tinygemm at batch 1, on the Llama-3.1-8B and Qwen2.5-1.5B projection shapes.

First it checks the PTX products on the GPU against the dequantized weight (groups of 128 and 32,
K split 1-4, a bias); then, per shape, it times tinygemm and the pairs kernel over tiles (rows,
words a step, warps, stages) and K splits, each in one CUDA graph over weight copies larger than
L2, and prints the fastest, the default tile (``pairs_tile`` / ``pairs_split_k``) and tinygemm,
with the bandwidth each reads at against the copy bandwidth measured in the same run.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_pairs_gemv_sweep.py``.
Options widen the sweep (defaults: the first run's): ``--shapes "8B down_proj" ...``, ``--rows``,
``--words``, ``--warps``, ``--stages``, ``--splits`` (for o_proj and down_proj), and ``--pdl``: each
launch with programmatic dependent launch and the engine's 1 MiB L2 prefetch, as in the decode graph.
"""
import argparse
import itertools

import torch

from engine.bench.ceilings import copy_bandwidth
from engine.bench.kernels import time_rotating
from engine.kernels.linear import prefetch_columns
from engine.kernels.int4_pairs_gemv import PairsTile, int4_pairs_gemv, pack_pairs, pairs_split_k, pairs_tile
from engine.w4a16 import GROUP, W4A16Linear, dequantize_groups, quantize_groups, unpack_groups

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", nargs="+", default=None, help="names as printed (default: all)")
parser.add_argument("--rows", nargs="+", type=int, default=[16, 32])
parser.add_argument("--words", nargs="+", type=int, default=[32, 64, 128])
parser.add_argument("--warps", nargs="+", type=int, default=[4, 8])
parser.add_argument("--stages", nargs="+", type=int, default=[2, 3])
parser.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4])
parser.add_argument("--pdl", action="store_true")
args = parser.parse_args()
device = torch.device("cuda")
torch.manual_seed(0)
for n, k, group, split, bias in [(256, 4096, 128, 1, False), (512, 14336, 128, 2, False), (256, 4096, 128, 4, False),
                                 (512, 1536, 32, 1, True), (2048, 8960, 128, 1, False)]:
    w = torch.randn(n, k, device=device) * torch.logspace(-2, 0, n, device=device)[:, None]
    qw, s, mn = quantize_groups(w, group)
    x = (torch.randn(1, k, device=device) * 3).to(torch.bfloat16)
    b = torch.randn(n, device=device) if bias else None
    want = x.float() @ dequantize_groups(qw, s, mn, group).t() + (b if bias else 0)
    y = int4_pairs_gemv(x, pack_pairs(unpack_groups(qw, group)), s, mn, group, b, torch.float32 if split == 1 else None, split_k=split)
    y = y.sum(dim=0) if split > 1 else y
    err = ((y - want).norm() / want.norm()).item()
    print(f"check [{n} x {k}] group {group} split {split}{' bias' if bias else ''}: relative error {err:.2e} (bf16 word sums)", flush=True)
    assert err < 1e-2, err

bw = copy_bandwidth(device)
print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:,.0f} GB/s; batch 1, torch {torch.__version__}", flush=True)
shapes = {"8B q|k|v": (6144, 4096, False), "8B o_proj": (4096, 4096, True), "8B gate|up": (28672, 4096, False),
          "8B down_proj": (4096, 14336, True), "1.5B q|k|v": (2048, 1536, False), "1.5B o_proj": (1536, 1536, True),
          "1.5B gate|up": (17920, 1536, False), "1.5B down_proj": (1536, 8960, True)}
print(f"launches {'with PDL and a 1 MiB L2 prefetch' if args.pdl else 'without PDL'}", flush=True)
for name, (n, k, splits) in shapes.items():
    if args.shapes and name not in args.shapes:
        continue
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    nbytes = n * k // 2 + n * (k // GROUP) * 4
    copies = max(2, -(-(256 << 20) // nbytes))
    linears = []
    for _ in range(copies):
        linear = W4A16Linear(*quantize_groups(w), GROUP, None)
        linear.add_tinygemm()
        linear.add_pairs()
        linears.append(linear)
    rows = [(time_rotating(lambda i: linears[i].tinygemm(x), copies) * 1e6, "tinygemm")]
    default_split = pairs_split_k(n, k, GROUP) if splits else 1
    default = pairs_tile(n, k, GROUP, default_split)
    candidates = list(itertools.product(args.rows, args.words, args.warps, args.stages, args.splits if splits else (1,)))
    if (default.block_n, default.block_w, default.num_warps, default.num_stages, default_split) not in candidates:
        candidates.append((default.block_n, default.block_w, default.num_warps, default.num_stages, default_split))
    for block_n, block_w, warps, stages, split in candidates:
        tile = PairsTile(block_n, block_w, warps, stages)
        if n % block_n or (k // 8) % (split * block_w):
            continue
        label = f"pairs {block_n} rows x {block_w} words, {warps} warps, {stages} stages, split {split}"
        if tile == default and split == default_split:
            label += " (default)"
        try:
            prefetch = 2 * prefetch_columns(linears[0].qweight, split, 1 << 20) if args.pdl else 0
            us = time_rotating(lambda i: int4_pairs_gemv(x, linears[i].pairs_words, linears[i].scales, linears[i].mins, GROUP,
                                                         split_k=split, tile=tile, pdl=args.pdl, prefetch_k=prefetch), copies) * 1e6
        except Exception as e:  # out of registers or shared memory: not a candidate
            print(f"    {label}: {type(e).__name__}", flush=True)
            continue
        rows.append((us, label))
    print(f"{name} [{n} x {k}]", flush=True)
    shown = sorted(rows)[:6] + [r for r in rows if r[1] == "tinygemm" or "(default)" in r[1]]
    for us, label in shown:
        print(f"    {us:7.1f} us {nbytes / us / 1e3:6,.0f} GB/s ({nbytes / us / 1e3 / (bw / 1e9):.2f} of copy)  {label}", flush=True)
    del linears
    torch.cuda.empty_cache()
