"""One-off (2026-12-06): why decode attention over an FP8 (e4m3) KV cache reads at half the GB/s
of a bf16 one, so that a step takes as long with either (fp8_kv_decode_ab.py, H100: 512 x 1,200
tokens 818 against 856 us for half the bytes).

A stand-alone copy of the decode loop (no fused RoPE, no PDL, one split: batches large enough to
fill the GPU unsplit) in variants that isolate one suspect each:
- ``scales in loop``: the engine's way, each tile's per-row K/V scales gathered in the tile's
  iteration. Triton's software pipeliner stages the K/V loads that feed the dots; a gather the
  loop waits on each iteration that is not staged would make the loop latency-bound.
- ``no scales``: the scales not read at all (wrong results: error printed, timed only).
- ``scales ahead``: the next tile's scales (one float a row, two registers a thread) gathered one
  iteration early, the K/V tiles left to the pipeliner.
- ``V widened first``: V's e4m3 tile widened to float16 by an inline-asm ``cvt.rn.f16x2.e4m3x2``
  the compiler cannot move. Without it Triton loads V from shared memory straight into the dot's
  operand layout in e4m3, which needs 4 consecutive tokens of a column a thread: one byte a load
  (128 ``ld.shared.b8`` a thread a tile in the sm_90 PTX of Triton 3.9), where K (token rows of
  contiguous columns) and bf16 V (``ldmatrix.trans``) load 8-16 bytes an instruction. Widened
  first, V goes to shared memory again as float16 and is read with ``ldmatrix.trans``.
- each with 1-4 pipeline stages, and bf16 through the same loop as the reference.
Per compiled variant it prints registers, spills, shared memory and what the pipeliner made of
the loads (TTGIR ``async_copy_global_to_local`` count), and writes TTGIR and PTX to ``$OUT_DIR``
(default ./anatomy). The engine's own kernel (``decode_attention``) is timed alongside.

Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/fp8_kv_decode_anatomy.py``.
"""
import os
import re

from pathlib import Path

import torch
import triton
import triton.language as tl

from engine.attention.torch_ref import paged_attention_reference
from engine.attention.triton_paged import decode_attention
from engine.bench.ceilings import copy_bandwidth
from engine.bench.kernels import D, HKV, HQ, decode_cases, time_rotating
from engine.kv_cache import LayerKV


@triton.jit
def _scales(KS, VS, BT, b, kvh, offs, end, stride_bt, stride_sb, stride_ss, stride_sh, PAGE: tl.constexpr):
    valid = offs < end
    page = tl.load(BT + b * stride_bt + offs // PAGE, mask=valid, other=0).to(tl.int64)
    sc = page * stride_sb + (offs % PAGE) * stride_ss + kvh * stride_sh
    return tl.load(KS + sc, mask=valid, other=0.0), tl.load(VS + sc, mask=valid, other=0.0)


@triton.jit
def decode_loop(Q, K, V, KS, VS, BT, SEQ, OUT, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                stride_sb, stride_ss, stride_sh, stride_ot, stride_oh, scale,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
                FP8: tl.constexpr, SCALES: tl.constexpr):
    """SCALES: 0 gathered in the tile's iteration, 1 not read (all 1), 2 gathered one tile ahead, 4 as 0
    with V widened to float16 by an opaque conversion before its dot."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    seq_len = tl.load(SEQ + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    n = tl.arange(0, TILE)
    heads = kvh * GROUP + g
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    if FP8:
        q = q.to(tl.float16)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    if SCALES == 2:
        ks_next, vs_next = _scales(KS, VS, BT, b, kvh, n, seq_len, stride_bt, stride_sb, stride_ss, stride_sh, PAGE)
    for n0 in range(0, seq_len, TILE):
        offs = n0 + n
        valid = offs < seq_len
        page = tl.load(BT + b * stride_bt + offs // PAGE, mask=valid, other=0).to(tl.int64)
        row = page * stride_kb + (offs % PAGE) * stride_ks + kvh * stride_kh
        k = tl.load(K + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if FP8:
            if SCALES == 0 or SCALES == 4:
                ks, vs = _scales(KS, VS, BT, b, kvh, offs, seq_len, stride_bt, stride_sb, stride_ss, stride_sh, PAGE)
            elif SCALES == 1:
                ks = tl.full([TILE], 1.0, tl.float32)
                vs = ks
            else:
                ks, vs = ks_next, vs_next
                ks_next, vs_next = _scales(KS, VS, BT, b, kvh, offs + TILE, seq_len, stride_bt, stride_sb, stride_ss,
                                           stride_sh, PAGE)
            s = tl.dot(q, tl.trans(k.to(tl.float16))) * ks[None, :] * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8 and SCALES == 4:  # V widened by an opaque conversion the compiler cannot move into the dot's operand load
            v_max = tl.maximum(tl.max(vs, 0), 1e-12)
            p = p * (vs / v_max)[None, :]
            v16 = tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [v.to(tl.uint8, bitcast=True)],
                                            dtype=tl.float16, is_pure=False, pack=2)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v16) * v_max
        elif FP8:
            v_max = tl.maximum(tl.max(vs, 0), 1e-12)
            p = p * (vs / v_max)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16)) * v_max
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(OUT + b * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=(g < GROUP)[:, None])


def launch(q, cache: LayerKV, meta, out, *, fp8: bool, scales: int, stages: int, warps: int = 4, tile: int = 128):
    ks, vs = (cache.k_scale, cache.v_scale) if fp8 else (cache.k, cache.k)
    sst = cache.k_scale.stride() if fp8 else (0, 0, 0)
    bt = meta.block_tables
    return decode_loop[(q.shape[0], HKV)](
        q, cache.k, cache.v, ks, vs, bt, meta.seq_lens, out, q.stride(0), q.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), bt.stride(0), *sst, out.stride(0), out.stride(1), D**-0.5,
        GROUP=HQ // HKV, GROUP_PAD=16, D=D, PAGE=cache.k.shape[1], TILE=tile, FP8=fp8, SCALES=scales,
        num_warps=warps, num_stages=stages)


def anatomy(name: str, kernel, out_dir: Path) -> str:
    """Registers, spills, shared memory and the loads the pipeliner staged, one line; asm to files."""
    kernel._init_handles()
    ttgir, ptx = kernel.asm.get("ttgir", ""), kernel.asm.get("ptx", "")
    stem = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    (out_dir / f"{stem}.ttgir").write_text(ttgir)
    (out_dir / f"{stem}.ptx").write_text(ptx)
    counts = {
        "async_copy": ttgir.count("async_copy_global_to_local"),
        "tt.load": ttgir.count("tt.load "),
        "cvt_layout": ttgir.count("convert_layout"),
        "cp.async": ptx.count("cp.async.c"),
        "ld.global": ptx.count("ld.global"),
        "cvt.f16x2.e4m3x2": ptx.count("cvt.rn.f16x2.e4m3x2"),
        "mma": ptx.count("mma.sync") + ptx.count("wgmma.mma_async"),
    }
    return (f"regs {kernel.n_regs:3d} spills {kernel.n_spills:3d} smem {kernel.metadata.shared:6d} "
            + " ".join(f"{k} {v}" for k, v in counts.items()))


def main() -> None:
    device = torch.device("cuda")
    out_dir = Path(os.environ.get("OUT_DIR", "anatomy"))
    out_dir.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth(device)
    print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:,.0f} GB/s", triton.__version__, flush=True)
    seen: set[str] = set()
    for batch, ctx in [(512, 1200), (256, 799), (32, 2047)]:
        batch_cases = decode_cases(batch, ctx, device)
        made, fp8, copies, nbytes, fp8_bytes = batch_cases.bf16, batch_cases.fp8, len(batch_cases.bf16), batch_cases.bf16_bytes, batch_cases.fp8_bytes
        print(f"batch {batch} x {ctx}: bf16 {nbytes / 1e6:.1f} MB, fp8 {fp8_bytes / 1e6:.1f} MB", flush=True)
        variants = [("engine bf16", made, None), ("engine fp8", fp8, None)]
        for stages in (1, 2, 3, 4):
            variants += [(f"loop bf16 s{stages}", made, (False, 0, stages))]
            variants += [(f"loop fp8 {nm} s{stages}", fp8, (True, sc, stages))
                         for sc, nm in ((0, "scales in loop"), (1, "no scales"), (2, "scales ahead"), (4, "V widened first"))]
        for name, cases, spec in variants:
            outs = [torch.empty_like(q) for q, _, _ in cases]

            def fn(i, cases=cases, outs=outs, spec=spec):
                q, cache, meta = cases[i]
                if spec is None:
                    return decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5, outs[i])
                return launch(q, cache, meta, outs[i], fp8=spec[0], scales=spec[1], stages=spec[2])

            try:
                kernel = fn(0)
                q, cache, meta = cases[0]
                ref = paged_attention_reference(q, cache.dequantized(torch.bfloat16) if cache.quantized else cache, meta, D**-0.5)
                err = ((outs[0].float() - ref.float()).norm() / ref.float().norm()).item()
                t = time_rotating(fn, copies)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                print(f"  {name:34s} failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
                continue
            size = fp8_bytes if cases is fp8 else nbytes
            line = f"  {name:34s} {t * 1e6:8.2f} us ({size / t / 1e9:5,.0f} GB/s, err {err:.1e})"
            if spec is not None and name not in seen:
                seen.add(name)
                line += "  " + anatomy(name, kernel, out_dir)
            print(line, flush=True)
        del made, fp8, batch_cases
        from engine.attention._triton_kernels import decode_launch
        for key, kernel in decode_launch._compiled.items():
            name = f"engine {'fp8' if any('float8' in str(k) for k in key[:4]) else 'bf16'} {len(seen)}"
            seen.add(name)
            print(f"  {name:34s} " + anatomy(name, kernel, out_dir), flush=True)
        decode_launch._compiled.clear()


if __name__ == "__main__":
    main()
