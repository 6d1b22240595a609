"""One-off (2026-12-06): a batch-1 int4 GEMV that widens nibbles two at a time (fp16 pairs),
against PyTorch's tinygemm, on the Llama-3.1-8B projection shapes. Its H100 run
(docs/results/2026-12-06-h100-int4-half2-gemv-ab.txt) led to the engine's bf16 version,
engine/kernels/int4_pairs_gemv.py (fp16 word sums overflow for large inputs).

Why: tinygemm reads the 8B's int4 projections at 0.43-0.68 of the copy bandwidth whatever its
layout (docs/results/2026-12-06-h100-tinygemm-layout-sweep.txt), and this engine's earlier
Triton GEMVs lost to it because each weight cost a shift, a logic op, a conversion and an FMA on
the CUDA cores (docs/performance.md, "words" GEMV). Here one LOP3 makes two fp16 values of two
nibbles (``(w & 0x000F000F) | 0x64006400`` reads as the half pair 1024 + q), one f16x2 subtract or
FMA removes the 1024 (and the x16 of the upper nibble of a byte), and one f16x2 FMA multiplies two
weights by two inputs: about 2 instructions a weight instead of 4-5 (PTX through Triton's
``inline_asm_elementwise``).

Layout: the weight's 4-bit values q (0..15, w = q * scale + min per group of 128, the engine's
``quantize_groups`` rule) as int32 words [N, K/8], word i holding inputs 8i..8i+7, input 8i+j in
bits 4j..4j+3. The half pairs are then (q0, q4), (q1, q5), (q2, q6), (q3, q7), so x is passed
as fp16 pairs in that order, int32 [K/8, 4] (``x_pairs``), with x's sum per group (float32) for
the minimums: y = sum over groups of scale * sum(q * x) + min * sum(x). Products of a word are
summed in fp16 (four f16x2 FMAs, each product below 16 x |x|), then in float32.

``--check`` runs on the CPU: the packing and the per-word arithmetic (emulated in fp16 in torch)
against the dequantized weight, and the Triton kernel in Triton's interpreter with its plain
(non-asm) per-word product. On a GPU the script checks the asm kernel against the same reference,
then times tiles against tinygemm, one CUDA graph over weight copies larger than L2.
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_half2_gemv_ab.py``
(``TRITON_INTERPRET=1 ... --check`` on the CPU).

Before its GPU run (2026-12-06, a 2-core CPU): ``--check`` passed (packing and fp16 word sums
7.9e-4 relative error against the dequantized weight; the plain kernel 2e-7), and the asm kernel
compiled for sm_90 through Triton's ptxas (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``): 32 rows x 64 words, per-step sums, 79 registers; with late
sums 166; 64 x 128 with late sums spills (255 registers, 664-byte stack). Its SASS still holds
one shuffle per ~2 words (the group sums across lanes), which may cost what the pairs save.
"""
import itertools
import sys

import torch
import triton
import triton.language as tl

from engine.w4a16 import GROUP, dequantize_groups, quantize_groups, unpack_groups

PAIR_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the inputs of a word's four half pairs, low half first


def pack_words(qweight: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The engine's packed groups (uint8 [N, K/2]) as int32 words [N, K/8]: input 8i+j in bits 4j..4j+3 of word i."""
    q = unpack_groups(qweight, group).to(torch.int64)
    n, k = q.shape
    words = (q.reshape(n, k // 8, 8) << (4 * torch.arange(8, device=q.device))).sum(dim=2)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def x_pairs(x: torch.Tensor) -> torch.Tensor:
    """One row of x [K] as the fp16 half pairs each word multiplies, int32 [K/8, 4]."""
    return x.to(torch.float16).reshape(-1, 8)[:, list(PAIR_ORDER)].contiguous().view(torch.int32)


def x_group_sums(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """sum(x) per group of inputs (x as the kernel sees it, in fp16), float32 [K/group]."""
    return x.to(torch.float16).float().reshape(-1, group).sum(dim=1)


def word_products_reference(words: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each word's sum of q * x as the asm computes it: the pairs' products summed in fp16 (each
    FMA rounds once; its operands' products are exact in float32), then the two halves in float32.
    float32 [N, K/8]."""
    n, kw = words.shape
    q = ((words.to(torch.int64)[:, :, None] >> (4 * torch.arange(8, device=words.device))) & 0xF).float()  # [N, K/8, 8]
    xs = x.to(torch.float16).float().reshape(kw, 8)
    halves = torch.zeros(n, kw, 2)
    for pair in range(4):
        lo, hi = PAIR_ORDER[2 * pair], PAIR_ORDER[2 * pair + 1]
        prod = torch.stack((q[:, :, lo] * xs[:, lo], q[:, :, hi] * xs[:, hi]), dim=2)
        halves = (halves + prod).half().float()
    return halves.sum(dim=2)


@triton.jit
def _word_products_asm(w, xa, xb, xc, xd):
    """sum(q * x) of each int32 word of nibbles against its four fp16 pairs of x (module doc), as float32 bits."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 magic, sixteenth, minus64, a, b, c, d, hi, acc;
        .reg .b16 h0, h1;
        .reg .f32 f0, f1, f2;
        mov.b32 magic, 0x64006400;
        mov.b32 sixteenth, 0x2C002C00;
        mov.b32 minus64, 0xD400D400;
        lop3.b32 a, $1, 0x000F000F, magic, 0xEA;
        lop3.b32 b, $1, 0x00F000F0, magic, 0xEA;
        shr.b32 hi, $1, 8;
        lop3.b32 c, hi, 0x000F000F, magic, 0xEA;
        lop3.b32 d, hi, 0x00F000F0, magic, 0xEA;
        sub.f16x2 a, a, magic;
        fma.rn.f16x2 b, b, sixteenth, minus64;
        sub.f16x2 c, c, magic;
        fma.rn.f16x2 d, d, sixteenth, minus64;
        mul.rn.f16x2 acc, a, $2;
        fma.rn.f16x2 acc, b, $3, acc;
        fma.rn.f16x2 acc, c, $4, acc;
        fma.rn.f16x2 acc, d, $5, acc;
        mov.b32 {h0, h1}, acc;
        cvt.f32.f16 f0, h0;
        cvt.f32.f16 f1, h1;
        add.f32 f2, f0, f1;
        mov.b32 $0, f2;
        }""",
        constraints="=r,r,r,r,r,r",
        args=[w, xa, xb, xc, xd],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    ).to(tl.float32, bitcast=True)


@triton.jit
def int4_half2_gemv_kernel(QW, XP, XF, XS, XW, S, MN, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                           GROUP_W: tl.constexpr, USE_ASM: tl.constexpr, REDUCE_LATE: tl.constexpr):
    """y [N] (float32) = W @ x for one row x. QW [N, K/8] int32 words, XP [K/8, 4] int32 fp16 pairs,
    XF [K] float32 (x as fp16 values; only without USE_ASM, the interpreter's plain product), XS
    [K/GROUP] and XW [K/8] float32 sums of x by group and by word, S / MN [N, K/GROUP] fp16 scales
    and minimums. GROUP_W words a group; BLOCK_W words (a multiple of GROUP_W) a loop step; N a
    multiple of BLOCK_N. REDUCE_LATE: each word's product is scaled where it lies (its group's
    scale and minimum loaded per word, from L1) and the words are summed once after the loop, so
    the loop has no cross-lane reduction; otherwise each step sums its words by group first."""
    GROUPS: tl.constexpr = BLOCK_W // GROUP_W
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.arange(0, BLOCK_W)
    kw = K // 8
    kg = kw // GROUP_W
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_words = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    for w0 in range(0, kw, BLOCK_W):
        w = tl.load(QW + rows[:, None].to(tl.int64) * kw + w0 + words[None, :], eviction_policy="evict_first")
        if USE_ASM:  # one 16-byte load of a word's four pairs, split into the four operands
            x4 = tl.reshape(tl.load(XP + (w0 + words)[:, None] * 4 + tl.arange(0, 4)[None, :]), (BLOCK_W, 2, 2))
            x_ac, x_bd = tl.split(x4)
            xa, xc = tl.split(x_ac)
            xb, xd = tl.split(x_bd)
            part = _word_products_asm(w, tl.broadcast_to(xa[None, :], (BLOCK_N, BLOCK_W)), tl.broadcast_to(xb[None, :], (BLOCK_N, BLOCK_W)),
                                      tl.broadcast_to(xc[None, :], (BLOCK_N, BLOCK_W)), tl.broadcast_to(xd[None, :], (BLOCK_N, BLOCK_W)))
        else:
            part = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
            for j in tl.static_range(8):
                q = ((w >> (4 * j)) & 0xF).to(tl.float32)
                part += q * tl.load(XF + (w0 + words) * 8 + j)[None, :]
        if REDUCE_LATE:
            gw = (w0 + words) // GROUP_W
            scale = tl.load(S + rows[:, None] * kg + gw[None, :]).to(tl.float32)
            low = tl.load(MN + rows[:, None] * kg + gw[None, :]).to(tl.float32)
            acc_words += scale * part + low * tl.load(XW + w0 + words)[None, :]
        else:
            by_group = tl.sum(tl.reshape(part, (BLOCK_N, GROUPS, GROUP_W)), axis=2)
            g = w0 // GROUP_W + tl.arange(0, GROUPS)
            scale = tl.load(S + rows[:, None] * kg + g[None, :]).to(tl.float32)
            low = tl.load(MN + rows[:, None] * kg + g[None, :]).to(tl.float32)
            acc += tl.sum(scale * by_group + low * tl.load(XS + g)[None, :], axis=1)
    if REDUCE_LATE:
        acc = tl.sum(acc_words, axis=1)
    tl.store(Y + rows, acc)


def int4_half2_gemv(words, pairs, xf, sums, word_sums, scales, mins, block_n=64, block_w=128, num_warps=4, num_stages=3,
                    use_asm=True, reduce_late=False):
    """Launch :func:`int4_half2_gemv_kernel` for one row; float32 [N]."""
    n, kw = words.shape
    y = torch.empty(n, dtype=torch.float32, device=words.device)
    int4_half2_gemv_kernel[(n // block_n,)](words, pairs, xf, sums, word_sums, scales, mins, y, n, kw * 8, BLOCK_N=block_n,
                                            BLOCK_W=block_w, GROUP_W=GROUP // 8, USE_ASM=use_asm, REDUCE_LATE=reduce_late,
                                            num_warps=num_warps, num_stages=num_stages)
    return y


def operands(w: torch.Tensor, x: torch.Tensor):
    """(words, pairs, x as float32 fp16 values, group sums, word sums, scales, mins) for weight w [N, K] and one row x [K]."""
    qweight, scales, mins = quantize_groups(w)
    xf = x.to(torch.float16).float().contiguous()
    return pack_words(qweight), x_pairs(x), xf, x_group_sums(x), xf.reshape(-1, 8).sum(dim=1), scales, mins


def reference(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """W (dequantized) @ x (rounded to fp16, as the kernel reads it), float32."""
    qweight, scales, mins = quantize_groups(w)
    return dequantize_groups(qweight, scales, mins) @ x.to(torch.float16).float()


def check(device: torch.device, use_asm: bool) -> None:
    torch.manual_seed(0)
    n, k = 128, 1024
    w = torch.randn(n, k, device=device) * torch.logspace(-2, 0, n, device=device)[:, None]  # row scales far apart
    x = torch.randn(k, device=device) * 3
    words, pairs, xf, sums, word_sums, scales, mins = operands(w, x)
    want = reference(w, x)
    qx = word_products_reference(words.cpu(), x.cpu())
    grouped = qx.reshape(n, -1, GROUP // 8).sum(dim=2)
    emulated = (scales.float().cpu() * grouped + mins.float().cpu() * sums.cpu()[None, :]).sum(dim=1)
    err = ((emulated - want.cpu()).norm() / want.norm().cpu()).item()
    print(f"packing and fp16 word sums (emulated) against the dequantized weight: relative error {err:.2e}", flush=True)
    assert err < 2e-3, err
    for (block_n, block_w), late in itertools.product(((32, 64), (64, 128)), (False, True)):
        y = int4_half2_gemv(words, pairs, xf, sums, word_sums, scales, mins, block_n, block_w, use_asm=use_asm, reduce_late=late)
        err = ((y - want).norm() / want.norm()).item()
        print(f"kernel ({'asm' if use_asm else 'plain'} word products, {block_n} x {block_w} words, "
              f"{'late' if late else 'per step'} reduction): relative error {err:.2e}", flush=True)
        assert err < 2e-3, err


def main() -> None:
    if "--check" in sys.argv:
        check(torch.device("cpu"), use_asm=False)
        return
    from engine.bench.ceilings import copy_bandwidth
    from engine.bench.kernels import time_rotating
    from engine.w4a16 import W4A16Linear

    device = torch.device("cuda")
    check(device, use_asm=True)
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:,.0f} GB/s; batch 1", flush=True)
    shapes = {"q|k|v": (6144, 4096), "o_proj": (4096, 4096), "gate|up": (28672, 4096), "down_proj": (4096, 14336)}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        x = torch.randn(k, device=device, dtype=torch.bfloat16)
        nbytes = n * k // 2 + n * (k // GROUP) * 4
        copies = max(2, -(-(256 << 20) // nbytes))
        ops = [operands(w, x) for _ in range(copies)]
        tiny = []
        for _ in range(copies):
            linear = W4A16Linear(*quantize_groups(w), GROUP, None)
            linear.add_tinygemm()
            tiny.append(linear)
        rows = [(time_rotating(lambda i: tiny[i].tinygemm(x[None, :]), copies) * 1e6, "tinygemm")]
        for block_n, block_w, warps, stages, late in itertools.product((16, 32, 64), (64, 128), (4, 8), (2, 3), (False, True)):
            if n % block_n:
                continue
            label = f"half2 {block_n} rows x {block_w} words, {warps} warps, {stages} stages, {'late' if late else 'per-step'} sums"
            try:
                us = time_rotating(lambda i: int4_half2_gemv(*ops[i], block_n, block_w, warps, stages, reduce_late=late), copies) * 1e6
            except Exception as e:  # out of registers or shared memory: not a candidate
                print(f"    {label}: {type(e).__name__}", flush=True)
                continue
            rows.append((us, label))
        print(f"{name} [{n} x {k}]", flush=True)
        for us, label in sorted(rows)[:8] + [r for r in rows if r[1] == "tinygemm"]:
            print(f"    {us:7.1f} us {nbytes / us / 1e3:6,.0f} GB/s ({nbytes / us / 1e3 / (bw / 1e9):.2f} of copy)  {label}", flush=True)
        del ops, tiny
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
