"""One-off (2026-12-07): the engine's decode kernel as a decode step runs it (RoPE and the KV write
fused in, a short slice's first tile loaded early: ``KV_PRELOAD``) against the kernel alone.

Why: a profiled decode step of the 8B shape at 256 requests x ~860 tokens (H100, FP8 weights,
``python -m engine.bench.kernels --profile-decode ... --kv-cache-dtype fp8|auto --pdl off``) spent
289.6 us a layer in attention over an FP8 cache and 331.1 over bf16 (1.14x), where the kernel alone
(fp8_kv_decode_anatomy.py, 256 x 799) took 254.2 against 336.5 (1.32x). The fused kernel carries
the RoPE, the e4m3 rounding of the new row and, with ``KV_PRELOAD``, a tile held in registers
across the wait; over an FP8 cache the loop already sits near the register limit.

Variants per cache dtype and shape: the kernel alone; fused with preload (the engine's step);
fused without preload; the FP8 one fused in 64-token tiles at 2-4 pipeline stages and in
128-token tiles at 3 (not yet run on a GPU: the next session's). PDL off
(the profile's setting). The fused variants write each request's new row to one spare slot, so
only their time is read here (the GPU tests check what they compute); the kernel alone's error
against the reference is printed. On 2026-12-07 it also ran on a copy of the kernel that
attends the new token before the cached context (its k, v and RoPE row dead before the loop):
1-2% slower over FP8, not kept (docs/results/2026-12-07-h100-fp8-kv-fused-decode-ab.txt).

Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/fp8_kv_fused_decode_ab.py``.
"""
import torch
import triton

from engine.attention import triton_paged
from engine.attention.torch_ref import paged_attention_reference
from engine.attention.triton_paged import NewTokens, decode_attention
from engine.bench.ceilings import copy_bandwidth
from engine.bench.kernels import D, HKV, decode_cases, time_rotating


def main() -> None:
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:,.0f} GB/s", triton.__version__, flush=True)
    angles = torch.rand(4096, D // 2, device=device) * 6.28
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    for batch, ctx in [(256, 859), (512, 1200), (1, 2047)]:
        batch_cases = decode_cases(batch, ctx, device)
        made, fp8, copies, nbytes, fp8_bytes = batch_cases.bf16, batch_cases.fp8, len(batch_cases.bf16), batch_cases.bf16_bytes, batch_cases.fp8_bytes
        new = [NewTokens(torch.randn(batch, HKV, D, device=device, dtype=torch.bfloat16),
                         torch.randn(batch, HKV, D, device=device, dtype=torch.bfloat16),
                         (meta.seq_lens - 1).long(), cos_sin, meta.slot_mapping) for _, _, meta in made]
        print(f"batch {batch} x {ctx}: bf16 {nbytes / 1e6:.1f} MB, fp8 {fp8_bytes / 1e6:.1f} MB", flush=True)
        variants = []
        for name, cases in (("bf16", made), ("fp8", fp8)):
            variants += [(f"{name} alone", cases, False, True, 0, 0),
                         (f"{name} fused, preload (the step's)", cases, True, True, 0, 0),
                         (f"{name} fused, no preload", cases, True, False, 0, 0)]
        # fewer registers a program, more programs an SM: the FP8 step's kernel in other tiles and stages
        variants += [(f"fp8 fused, tile {tile}, {stages} stages", fp8, True, True, tile, stages)
                     for tile, stages in ((64, 2), (64, 3), (64, 4), (128, 3))]
        stages_default = triton_paged.DECODE_FP8_STAGES
        for name, cases, fused, preload, tile, stages in variants:
            outs = [torch.empty_like(q) for q, _, _ in cases]
            triton_paged.DECODE_KV_PRELOAD = preload
            triton_paged.DECODE_FP8_STAGES = stages or stages_default

            def fn(i, cases=cases, outs=outs, fused=fused, new=new, tile=tile):
                q, cache, meta = cases[i]
                return decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5, outs[i], new=new[i] if fused else None,
                                        tile_n=tile)

            try:
                fn(0)
                err = ""
                if not fused:
                    q, cache, meta = cases[0]
                    ref = paged_attention_reference(q, cache.dequantized(torch.bfloat16) if cache.quantized else cache, meta, D**-0.5)
                    err = f", err {((outs[0].float() - ref.float()).norm() / ref.float().norm()).item():.1e}"
                t = time_rotating(fn, copies)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                print(f"  {name:40s} failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
                continue
            size = fp8_bytes if cases is fp8 else nbytes
            print(f"  {name:40s} {t * 1e6:8.2f} us ({size / t / 1e9:5,.0f} GB/s{err})", flush=True)
        triton_paged.DECODE_KV_PRELOAD, triton_paged.DECODE_FP8_STAGES = True, stages_default
        del made, fp8, new, batch_cases
    from engine.attention._triton_kernels import decode_launch
    for key, kernel in decode_launch._compiled.items():
        kind = "fp8" if any("float8" in str(k) for k in key[:4]) else "bf16"
        print(f"  compiled {kind}: regs {kernel.n_regs} spills {kernel.n_spills} smem {kernel.metadata.shared}  key {str(key)[-160:]}")


if __name__ == "__main__":
    main()
