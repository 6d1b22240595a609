"""One-off (2026-12-06): decode attention over an FP8 (e4m3) KV cache against the same context
in bf16, kernel alone, on the 8B's attention shape (32 query heads, 8 KV heads, head_dim 128,
16-token pages). In the 1,000-request throughput run an FP8 cache made decode steps slower, not
faster (34.8 against 27.3 ms), though it halves the bytes each step reads. Variants: the context
tile (tokens a loop step) and warps a program, for either cache. (A first run also had q rounded to
e4m3 for q.K on FP8 tensor cores: no faster than widening K to float16, seven times the error;
the second also timed one fresh 27 x 600-token prefill, which prefill_tiles_by_cache.py now does
over more cases and shapes.)
Each case's caches in copies past the L2, timed in one CUDA graph
(``engine.bench.kernels.time_rotating``); every variant checked against the reference attention
over the dequantized cache.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/fp8_kv_decode_ab.py``.
"""
import torch

from engine.attention.torch_ref import paged_attention_reference
from engine.attention.triton_paged import decode_attention
from engine.bench.ceilings import copy_bandwidth
from engine.bench.kernels import D, decode_cases, time_rotating

CASES = [(1, 575), (1, 4095), (32, 2047), (256, 799), (512, 600), (512, 1200)]
device = torch.device("cuda")
bw = copy_bandwidth(device)
print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:,.0f} GB/s", flush=True)
for batch, ctx in CASES:
    batch_cases = decode_cases(batch, ctx, device)
    made, fp8, copies = batch_cases.bf16, batch_cases.fp8, len(batch_cases.bf16)
    line = f"batch {batch:4d} x {ctx:5d}:"
    variants = [(f"bf16 t{t} w{w}", made, t, w) for t, w in ((64, 4), (128, 4), (128, 8))] \
        + [(f"fp8 t{t} w{w}", fp8, t, w) for t, w in ((64, 4), (128, 4), (128, 8), (256, 4), (256, 8))]
    for name, cases, tile, warps in variants:
        outs = [torch.empty_like(q) for q, _, _ in cases]

        def fn(i, cases=cases, outs=outs, tile=tile, warps=warps):
            q, cache, meta = cases[i]
            decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5, outs[i], tile_n=tile, num_warps=warps)

        try:
            fn(0)
            q, cache, meta = cases[0]
            ref = paged_attention_reference(q, cache.dequantized(torch.bfloat16) if cache.quantized else cache, meta, D**-0.5)
            err = ((outs[0].float() - ref.float()).norm() / ref.float().norm()).item()
            t = time_rotating(fn, copies)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            line += f"  {name}: failed ({type(e).__name__}: {str(e)[:120]})"
            continue
        size = batch_cases.fp8_bytes if cases is fp8 else batch_cases.bf16_bytes
        line += f"  {name} {t * 1e6:8.2f} us ({size / t / 1e9:5,.0f} GB/s, err {err:.1e})"
    print(line, flush=True)
    del made, fp8, batch_cases
