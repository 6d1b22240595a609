"""One-off (2026-12-06): decode attention with each wide K/V tile loaded a loop step early
(``decode_attention(next_tile=True)``) against loaded when used, for an FP8 (e4m3) cache and a
bf16 one, kernel alone, on the 8B's attention shape (32 query heads, 8 KV heads, head_dim 128,
16-token pages). At equal context an FP8 cache took bf16's time (fp8_kv_decode_ab.py): its tiles are
widened to float16 between load and dot, so Triton does not pipeline their loads.
Each case's caches in copies past the L2, timed in one CUDA graph
(``engine.bench.kernels.time_rotating``); every variant checked against the reference attention
over the dequantized cache.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/fp8_kv_next_tile_ab.py``.
"""
import torch

from engine.attention.torch_ref import paged_attention_reference
from engine.attention.triton_paged import decode_attention
from engine.bench.ceilings import copy_bandwidth
from engine.bench.kernels import D, attention_cost, make_batch, time_rotating
from engine.kv_cache import LayerKV, quantize

CASES = [(1, 4095), (32, 2047), (256, 799), (512, 1200)]
VARIANTS = [("bf16", False, 128), ("bf16", True, 128), ("fp8", False, 128), ("fp8", True, 128), ("fp8", True, 64)]
device = torch.device("cuda")
bw = copy_bandwidth(device)
print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:,.0f} GB/s", flush=True)
for batch, ctx in CASES:
    _, nbytes = attention_cost([1] * batch, [ctx] * batch)
    fp8_bytes = nbytes / 2 + nbytes / 2 / D * 4 / 2  # K/V halved, a float32 scale a (token, head) row
    copies = max(1, -(-200_000_000 // nbytes))
    made = {"bf16": [make_batch([1] * batch, [ctx] * batch, device, seed=i) for i in range(copies)]}
    made["fp8"] = []
    for q, cache, meta in made["bf16"]:
        (kq, ks), (vq, vs) = quantize(cache.k), quantize(cache.v)
        made["fp8"].append((q, LayerKV(kq, vq, ks, vs), meta))
    line = f"batch {batch:4d} x {ctx:5d}:"
    for dtype, early, tile in VARIANTS:
        cases = made[dtype]
        outs = [torch.empty_like(q) for q, _, _ in cases]

        def fn(i, cases=cases, outs=outs, early=early, tile=tile):
            q, cache, meta = cases[i]
            decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5, outs[i], tile_n=tile, next_tile=early)

        name = f"{dtype} t{tile} {'early' if early else 'when used'}"
        try:
            fn(0)
            q, cache, meta = cases[0]
            ref = paged_attention_reference(q, cache.dequantized(torch.bfloat16) if cache.quantized else cache, meta, D**-0.5)
            err = ((outs[0].float() - ref.float()).norm() / ref.float().norm()).item()
            t = time_rotating(fn, copies)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            line += f"  {name}: failed ({type(e).__name__}: {str(e)[:120]})"
            continue
        size = fp8_bytes if dtype == "fp8" else nbytes
        line += f"  {name} {t * 1e6:8.2f} us ({size / t / 1e9:5,.0f} GB/s, err {err:.1e})"
    print(line, flush=True)
    del made
