"""One-off (2026-12-06): the paged prefill kernel's tile shape per KV-cache dtype and prompt shape,
on the 8B's attention shape. PrefillConfig's default (128 x 128, 8 warps, 3 stages) was chosen on
chunks after a 32k context and a fresh 8 x 2,048 prefill with a bf16 cache; the throughput run's
eager steps are fresh ~600-token prompts, and an FP8 cache widens every K/V tile. Each case x
shape timed with ``triton.testing.do_bench``, checked against the reference attention.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/prefill_tiles_by_cache.py``.
"""
import torch
import triton.testing

from engine.attention.torch_ref import paged_attention_reference
from engine.attention.triton_paged import PrefillConfig, prefill_attention
from engine.bench.kernels import D, attention_cost, make_batch
from engine.kv_cache import LayerKV, quantize

CASES = {"fresh 27 x 600": ([600] * 27, [0] * 27), "fresh 8 x 2,048": ([2048] * 8, [0] * 8),
         "q480 after 31,520": ([480], [31520]), "q96 after 31,904": ([96], [31904])}
SHAPES = [PrefillConfig(128, 128, 8, 3), PrefillConfig(128, 128, 8, 2), PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 64, 8, 2),
          PrefillConfig(128, 64, 4, 2), PrefillConfig(64, 64, 4, 2), PrefillConfig(64, 128, 4, 2)]
device = torch.device("cuda")
print(torch.cuda.get_device_name(), flush=True)
print(f"{'case':20s} {'cache':5s} " + " ".join(f"{f'{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}':>16s}" for c in SHAPES)
      + "   (us; TFLOP/s of the fastest)")
for name, (ql, cl) in CASES.items():
    q, cache, meta = make_batch(ql, cl, device)
    (kq, ks), (vq, vs) = quantize(cache.k), quantize(cache.v)
    flops, _ = attention_cost(ql, cl)
    for label, c in (("bf16", cache), ("fp8", LayerKV(kq, vq, ks, vs))):
        ref = paged_attention_reference(q, c.dequantized(torch.bfloat16) if c.quantized else c, meta, D**-0.5)
        times = []
        for cfg in SHAPES:
            out = torch.empty_like(q)

            def fn(cfg=cfg, c=c, out=out):
                meta.scratch.clear()
                return prefill_attention(q, c, meta, D**-0.5, out, cfg)

            try:
                fn()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 2e-2:
                    raise SystemExit(f"{name} {label} {cfg}: relative error {err:.3g} against the reference")
                times.append(triton.testing.do_bench(fn, warmup=5, rep=40) * 1e3)
            except Exception as e:  # noqa: BLE001 - a shape that does not compile (shared memory) is reported
                print(f"  {name} {label} {cfg}: failed ({type(e).__name__})")
                times.append(float("inf"))
        best = min(times)
        print(f"{name:20s} {label:5s} " + " ".join(f"{t:16.1f}" for t in times) + f"   {flops / best / 1e6:.1f}", flush=True)
