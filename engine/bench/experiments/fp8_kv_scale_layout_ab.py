"""One-off (2026-12-06): decode attention over an FP8 (e4m3) cache with its per-row scales laid out
[block, row, head] (the engine's: a row's scales for every head together, so one head's scales
for a 128-row tile sit in 128 different 32-byte sectors) against [block, head, row] (one head's
scales for a page's rows contiguous: 8 sectors a tile), kernel alone, on the 8B's attention shape
(32 query heads, 8 KV heads, head_dim 128, 16-token pages); bf16 alongside. The kernels take the
scales' strides, so the second layout is a permuted view of [block, head, row] storage.
Each case's caches in copies past the L2, timed in one CUDA graph
(``engine.bench.kernels.time_rotating``); every variant checked against the reference attention
over the dequantized cache.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/fp8_kv_scale_layout_ab.py``.
"""
import torch

from engine.attention.torch_ref import paged_attention_reference
from engine.attention.triton_paged import decode_attention
from engine.bench.ceilings import copy_bandwidth
from engine.bench.kernels import D, decode_cases, time_rotating
from engine.kv_cache import LayerKV

CASES = [(1, 4095), (32, 2047), (256, 799), (512, 1200)]
device = torch.device("cuda")
bw = copy_bandwidth(device)
print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:,.0f} GB/s", flush=True)


def head_major(scale: torch.Tensor) -> torch.Tensor:
    """The same scales [block, row, head], stored [block, head, row]."""
    return scale.permute(0, 2, 1).contiguous().permute(0, 2, 1)


for batch, ctx in CASES:
    batch_cases = decode_cases(batch, ctx, device)
    nbytes, fp8_bytes, copies = batch_cases.bf16_bytes, batch_cases.fp8_bytes, len(batch_cases.bf16)
    made = {"bf16": batch_cases.bf16, "fp8 row-major": batch_cases.fp8,
            "fp8 head-major": [(q, LayerKV(c.k, c.v, head_major(c.k_scale), head_major(c.v_scale)), meta) for q, c, meta in batch_cases.fp8]}
    line = f"batch {batch:4d} x {ctx:5d}:"
    for name, cases in made.items():
        outs = [torch.empty_like(q) for q, _, _ in cases]

        def fn(i, cases=cases, outs=outs):
            q, cache, meta = cases[i]
            decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5, outs[i])

        fn(0)
        q, cache, meta = cases[0]
        ref = paged_attention_reference(q, cache.dequantized(torch.bfloat16) if cache.quantized else cache, meta, D**-0.5)
        err = ((outs[0].float() - ref.float()).norm() / ref.float().norm()).item()
        t = time_rotating(fn, copies)
        size = nbytes if name == "bf16" else fp8_bytes
        line += f"  {name} {t * 1e6:8.2f} us ({size / t / 1e9:5,.0f} GB/s, err {err:.1e})"
    print(line, flush=True)
    del made, batch_cases
