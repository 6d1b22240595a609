"""One-off (2026-12-03, H200): where an FP8 prefill step of the Llama-3.1-8B shape spends its time,
random weights. The 1,000-request throughput run measured the FP8 prefill step only 2% faster than
bf16's (378.6 against 386.3 ms for 16,384 tokens), though Hopper's FP8 matmuls have twice bf16's
peak. This times, for one 16,384-token step:

1. each projection shape alone: cuBLAS bf16, ``torch._scaled_mm`` (e4m3, row-wise scales as
   Fp8Linear runs it), and the rounding of x to e4m3 in torch (six passes) and in the fused
   kernel (engine/kernels/row_quant.py), checked equal;
2. the whole model's prefill forward (eager, 32 layers, attention included) in bf16, then FP8 with
   the fused rounding, then FP8 with the torch rounding.

Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/fp8_prefill_parts.py [TOKENS]``.
"""
import sys
from unittest import mock

import torch

import engine.fp8 as fp8
from engine.attention import AttentionMetadata, select_backend
from engine.config import EngineConfig
from engine.kernels.row_quant import quantize_rows_triton
from engine.kv_cache import KVCache, KVCacheSpec
from engine.loaded_model import LoadedModel

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
SHAPES = {"q|k|v": (6144, 4096), "o_proj": (4096, 4096), "gate|up": (28672, 4096), "down_proj": (4096, 14336)}


def cuda_ms(fn, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after two warm-ups (CUDA events)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


torch.manual_seed(0)
print(f"# FP8 prefill parts, {torch.cuda.get_device_name()}, torch {torch.__version__}, {TOKENS} tokens a step", flush=True)
print(f"{'projection':<10} {'bf16 ms':>8} {'TFLOPS':>7} {'fp8 mm ms':>9} {'TFLOPS':>7} {'quant torch ms':>14} {'quant fused ms':>14} "
      f"{'fp8 total (fused)':>17}")
layer = {"bf16": 0.0, "mm": 0.0, "torch": 0.0, "fused": 0.0}
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = fp8.quantize_rows(w)
    xq, xs = quantize_rows_triton(x, fp8.FP8_MAX)
    ref_q, ref_s = fp8.quantize_rows(x)
    same = (xq.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean().item()
    print(f"{name}: fused rounding against torch's: scales equal {torch.equal(xs, ref_s)}, e4m3 codes equal {same:.6f}", flush=True)
    flops = 2 * TOKENS * n * k
    bf16 = cuda_ms(lambda: x @ w.t())
    mm = cuda_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16))
    q_torch = cuda_ms(lambda: fp8.quantize_rows(x))
    q_fused = cuda_ms(lambda: quantize_rows_triton(x, fp8.FP8_MAX))
    for key, value in (("bf16", bf16), ("mm", mm), ("torch", q_torch), ("fused", q_fused)):
        layer[key] += value
    print(f"{name:<10} {bf16:8.3f} {flops / bf16 / 1e9:7.0f} {mm:9.3f} {flops / mm / 1e9:7.0f} {q_torch:14.3f} {q_fused:14.3f} {mm + q_fused:17.3f}",
          flush=True)
    del w, x, wq, xq
print(f"32 layers: bf16 {32 * layer['bf16']:.1f} ms; fp8 matmuls {32 * layer['mm']:.1f} ms + rounding {32 * layer['fused']:.1f} ms fused "
      f"({32 * layer['torch']:.1f} ms in torch)", flush=True)

config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", max_model_len=TOKENS + 64)
loaded = LoadedModel.load(config)
device = loaded.device
spec = KVCacheSpec.for_model(loaded.model_config, config.block_size, loaded.dtype)
blocks = -(-TOKENS // spec.block_size) + 1
cache = KVCache(spec, blocks, device)
meta = AttentionMetadata(
    slot_mapping=torch.arange(spec.block_size, spec.block_size + TOKENS, device=device),
    query_start_loc=torch.tensor([0, TOKENS], dtype=torch.int32, device=device),
    seq_lens=torch.tensor([TOKENS], dtype=torch.int32, device=device),
    block_tables=torch.arange(1, blocks, dtype=torch.int32, device=device)[None],
    query_lens_host=[TOKENS], seq_lens_host=[TOKENS], num_decodes=0, max_seq_len=TOKENS,
)
ids = torch.randint(0, loaded.model_config.vocab_size, (TOKENS,), device=device)
positions = torch.arange(TOKENS, device=device)
backend = select_backend("auto", device)


@torch.inference_mode()
def forward() -> None:
    loaded.model(ids, positions, backend, meta, cache.layers())


results = {"bf16": cuda_ms(forward, reps=5)}
fp8.quantize_model_fp8(loaded.model)
torch.cuda.empty_cache()
results["fp8, fused rounding"] = cuda_ms(forward, reps=5)
with mock.patch.object(fp8, "can_quantize_rows", lambda rows: False):
    results["fp8, torch rounding"] = cuda_ms(forward, reps=5)
for label, ms in results.items():
    print(f"whole prefill forward, {TOKENS} tokens, {label}: {ms:.1f} ms ({ms / results['bf16']:.2f}x bf16)", flush=True)
