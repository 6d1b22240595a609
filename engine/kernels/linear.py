"""Projections of a batch-1 decode step (CUDA): a Triton GEMV that streams the weight once.

``decode_linear(x, w)`` computes x @ w.T for x of at most ``DECODE_MAX_ROWS`` rows, optionally
straight into float32 (the lm_head's logits, no cast kernel). On the H200 at batch 1 it beats
cuBLAS on q|k|v, o_proj, gate|up and the lm_head (15.2 / 12.3 / 56.7 / 233.6 us against 15.3 /
12.6 / 60.5 / 247.8), not alone on down_proj (33.6 against 31.3), which runs it split-K with its
partials summed by the next norm (``split_k``: in the batch-1 graph 4.07 vs 4.14 ms against
cuBLAS's split-K and reduction kernel, docs/performance.md); at 8 rows cuBLAS
was ahead on q|k|v and gate|up (docs/results/2026-11-29-h200-gemv-sweep.txt), so only batch-1
steps use it (``GemvPolicy.max_rows``, engine/kernels/gemv_policy.py). ``python -m engine.kernel_bench
--gemv`` sweeps its tiles against cuBLAS; :func:`decode_tile` holds the winners.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.kernels.gemv_policy import FP8_MATHS

DECODE_MAX_ROWS = 1  # measured faster than cuBLAS at batch 1 only (see above)
TILE_ROWS = 16  # x's rows are padded to one 16-row tensor-core tile


@dataclass(frozen=True)
class GemvConfig:
    kind: str  # "dot": tensor cores, x padded to block_m rows; "sum": one row, CUDA cores
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = TILE_ROWS
    columns: int = 0
    """Output columns a program owns (0: block_n; for a gated weight, of the SwiGLU output): fewer
    than the tile's width to give every SM the same share of the weight."""

    def fits(self, rows: int, k: int) -> bool:
        return rows <= self.block_m if self.kind == "dot" else (rows == 1 and k % self.block_k == 0)


def spread(n: int, block_n: int, programs: int) -> int:
    """Output columns a program owns so that ``n`` columns take ``programs`` programs; 0 (the
    tile's width) when the tile is that narrow already, or when it would lose more than half its
    rows (a small weight: more, tinier programs do not pay)."""
    columns = -(-n // programs)
    return columns if block_n // 2 <= columns < block_n else 0


def decode_tile(n: int, k: int) -> GemvConfig:
    """The tile for an [n, k] weight: the fastest in the H200 sweeps for each 8B shape at batch 1
    (docs/results/2026-11-29-h200-gemv-sweep.txt, then A/Bs in the batch-1 graph), by size class
    for other shapes. ``columns`` sizes the grid to one even wave: 128 programs of q|k|v, 512 of
    gate|up (4 resident per SM at 3 stages); in the batch-1 graph replay 4.049-4.053 ms against
    4.106-4.111 with full-width tiles (96 and 224 programs; both with the early residual read of
    add_rms_norm, H200, 2026-11-30, docs/performance.md). 131 programs of q|k|v were 2% slower than
    96, and a grid that needs a second wave (gate|up at 4 stages) 5%.

    Weights narrower than the 8B's (fewer than 4,096 rows: Qwen2.5-1.5B's q|k|v 2,048, o_proj and
    down_proj 1,536) take 16-row tiles (32 for a weight over four times as deep as wide, split-K 2
    on top by ``GemvPolicy.down_split_k``), so that 96-128 programs share the SMs: the wide tiles
    gave them 24-48. H200 sweep on the 1.5B's shapes at batch 1: q|k|v 4.9 us, o_proj 5.0, down_proj
    12.1 (cuBLAS 5.0 / 6.5 / 11.5; docs/results/2026-12-03-h200-gemv-sweep-qwen1.5b.txt)."""
    if n < 4096:
        return GemvConfig("dot", 32, 128, 4, 5) if k > 4 * n else GemvConfig("dot", 16, 128, 4, 5)
    if n <= 4096 and k > 8192:  # down_proj, split-K 2 (GemvPolicy.down_split_k): in the batch-1 graph
        return GemvConfig("dot", 64, 256, 4, 4)  # replay 4.065 vs 4.105 ms with 32x256 s5 (H200, 2026-11-30)
    if n == 4096:  # o_proj: few columns, so narrow tiles to occupy every SM
        return GemvConfig("dot", 32, 256, 4, 5)
    if n <= 16384:  # q|k|v: 7 stages in flight, replay 4.070 vs 4.086 ms with 5 (in-graph sweep, H200
        return GemvConfig("dot", 64, 128, 4, 7, columns=spread(n, 64, 128))  # 2026-11-30, ...-gemv-tile-sweep-late-release.txt)
    if n <= 65536:  # gate|up, gated: columns count SwiGLU outputs (n // 2), 32 a 64-row tile
        return GemvConfig("dot", 64, 128, 4, 3, columns=spread(n // 2, 32, 512))
    return GemvConfig("dot", 64, 128, 4, 3)  # lm_head


def fp8_decode_tile(n: int, k: int, block_k: int) -> GemvConfig:
    """The tile for an FP8 (e4m3) weight [n, k] at batch 1: :func:`decode_tile`'s with K tiles of
    ``block_k`` elements (GemvPolicy.fp8_block_k), except for the 8B's q|k|v and down_proj shapes,
    where a sweep of FP8 tiles found faster ones (H200, 2026-12-03 18:20 UTC, unsplit, weights
    rotating through more than L2, engine/bench/experiments/fp8_gemv_sweep.py): down_proj 32 x 512
    at 6 stages 25.7 us against 39.3 with the borrowed 64 x 256; q|k|v 64 x 512 at 3 stages 13.5
    against 14.0; its 96 programs left 36 SMs idle (Nsight Compute, H100), so its rows are spread
    over 128 programs: the 8B's FP8 batch-1 graph replay 2.849 ms against 2.951 (H200, 2026-12-06,
    three rounds, engine/bench/experiments/fp8_bs1_tile_ab.py; more programs for o_proj or
    down_proj were 5-26% slower). gate|up's borrowed tile was the sweep's fastest (31.5 us, 3.7 TB/s). A
    vocabulary-sized head (``EngineConfig.lm_head_quantization="fp8"``) takes 128 x 256 at 3 stages:
    the 8B's [128,256 x 4,096] head in 175.4 us, at the copy bandwidth, against 206.8 with the
    borrowed tile (H100, 2026-12-06, engine/bench/experiments/lm_head_gemv_sweep.py)."""
    if n > 65536 and k % 256 == 0:
        return GemvConfig("dot", 128, 256, 4, 3)
    if n < 4096:  # narrower models' shapes: not swept in FP8
        return replace(decode_tile(n, k), block_k=block_k)
    if n == 4096 and k > 8192:
        return GemvConfig("dot", 32, 512, 4, 6)
    if 4096 < n <= 16384 and k % 512 == 0:  # rows spread over 128 programs, as bf16's q|k|v: see the docstring
        return GemvConfig("dot", 64, 512, 4, 3, columns=spread(n, 64, 128))
    return replace(decode_tile(n, k), block_k=block_k)


def sum_tile(n: int, k: int) -> GemvConfig | None:
    """The CUDA-core "sum" tile for an [n, k] weight at batch 1 (GemvPolicy.sum_tiles): 4 rows of
    W a program, K 512 at a time, the fastest for the 1.5B's q|k|v and o_proj in the H200 sweep
    (docs/results/2026-12-03-h200-gemv-sweep-qwen1.5b.txt); None where K does not split into it."""
    config = GemvConfig("sum", 4, 512, 4, 3)
    return config if k % config.block_k == 0 else None


def usable_split_k(w: torch.Tensor, split_k: int, config: GemvConfig | None = None) -> int:
    """``split_k`` where it divides the weight's K into whole tiles (of ``config``, default
    :func:`decode_tile`'s), else 1 (no split)."""
    return split_k if w.shape[1] % (split_k * (config or decode_tile(*w.shape)).block_k) == 0 else 1


def prefetch_columns(w: torch.Tensor, split_k: int, budget_bytes: int) -> int:
    """K columns of each program's slice that a GEMV asks L2 for before its PDL wait, so that the
    whole weight prefetched is at most ``budget_bytes`` (all of it when it fits; 0 when not even one
    128-byte line a row does)."""
    rows, k = w.shape
    columns = min(k // split_k, budget_bytes // (rows * w.element_size() * split_k))
    return columns if columns * w.element_size() >= 128 else 0


# ---- references ----------------------------------------------------------------------------
def decode_linear_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias).to(out_dtype or x.dtype)


# ---- Triton --------------------------------------------------------------------------------
def decode_linear(
    x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, config: GemvConfig | None = None,
    *, gated: bool = False, pdl: bool = False, split_k: int = 1, late_release: bool = False, bias: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None, fp8_math: str = "bf16", prefetch_k: int = 0,
) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ ``bias`` [N], added in float32 in the epilogue: Qwen2's q|k|v)
    -> [M, N] in ``out_dtype`` (default x's), M <= the tile's rows. A "sum" ``config``
    (:func:`sum_tile`) runs the CUDA-core kernel instead: one row, no ``gated``, no FP8 weight.

    ``split_k`` > 1: float32 partial products [split_k, M, N] over K slices, to be summed by the
    consumer (:func:`~engine.kernels.norm.add_rms_norm` takes them as its ``x``); K must be a
    multiple of split_k x the tile's block_k; not with ``gated``, ``out_dtype`` or ``bias``.

    ``gated``: w is gate|up stacked ([2F, K]) and the result is silu(x @ gate^T) * (x @ up^T)
    [M, F] (SwiGLU in the GEMV's epilogue). ``pdl``: launch with programmatic dependent launch
    (Hopper+; the caller checks :func:`~engine.kernels.triton_utils.pdl_supported`): its launch
    overlaps the previous kernel's tail; ``late_release``: the kernel after it may launch only once
    this one's K loop is done (GemvPolicy.late_release). ``w_scale``: w is FP8 (e4m3) with these
    float32 scales, one per row of w (engine/fp8.py); ``fp8_math`` (GemvPolicy.fp8_math): "bf16" widens its tiles to
    x's dtype, "fp16" widens tiles and x to fp16, "fp8" rounds x to e4m3 per row (W8A8) for FP8 tensor cores.
    ``prefetch_k`` (with ``pdl``; :func:`prefetch_columns`): columns of each program's weight rows
    requested into L2 before the PDL wait, while the kernel before still runs."""
    from engine.kernels._linear_triton import decode_linear_kernel
    from engine.kernels.triton_utils import launch_options

    config = config or decode_tile(*w.shape)
    if config.kind == "sum":
        return _sum_linear(x, w, out_dtype, config, gated=gated, pdl=pdl, split_k=split_k, bias=bias, w_scale=w_scale,
                           prefetch_k=prefetch_k)
    m, (rows, k) = x.shape[0], w.shape
    n = rows // 2 if gated else rows
    block_n = config.block_n // 2 if gated else config.block_n  # same weight rows per program
    columns = config.columns or block_n
    split_ok = split_k == 1 or (not gated and out_dtype is None and bias is None and k % (split_k * config.block_k) == 0)
    bias_ok = bias is None or (not gated and bias.shape == (rows,) and bias.stride(0) == 1)
    scale_ok = (w_scale is None) == (w.dtype == x.dtype) and (
        w_scale is None or (w_scale.shape == (rows,) and w_scale.dtype == torch.float32 and w_scale.stride(0) == 1))
    if (m > config.block_m or x.stride(1) != 1 or w.stride(1) != 1 or (gated and rows % 2) or split_k < 1 or not split_ok
            or columns > block_n or not bias_ok or not scale_ok):
        raise ValueError(f"decode_linear: x {tuple(x.shape)} {x.dtype} w {tuple(w.shape)} {w.dtype} gated={gated} split_k={split_k} "
                         f"bias {None if bias is None else tuple(bias.shape)} "
                         f"w_scale {None if w_scale is None else (tuple(w_scale.shape), w_scale.dtype)} do not fit {config}")
    if split_k > 1:
        y = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    decode_linear_kernel[(-(-n // columns), split_k)](
        x, w, y, w if bias is None else bias, x if w_scale is None else w_scale, m, n, k, x.stride(0), w.stride(0), y.stride(-2),
        y.stride(0) if split_k > 1 else 0,
        EVEN_K=k % config.block_k == 0, BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=config.block_k,
        GATED=gated, USE_PDL=pdl, SPLIT_K=split_k, LATE_RELEASE=late_release, COLUMNS=columns, HAS_BIAS=bias is not None,
        HAS_SCALE=w_scale is not None, FP8_MATH=FP8_MATHS.index(fp8_math),
        PREFETCH_K=prefetch_k if pdl else 0, LINE=128 // w.element_size(),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )
    return y


def _sum_linear(
    x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None, config: GemvConfig, *, gated: bool, pdl: bool, split_k: int,
    bias: torch.Tensor | None, w_scale: torch.Tensor | None, prefetch_k: int,
) -> torch.Tensor:
    """:func:`decode_linear` with a "sum" tile: one row of x, a plain (not gated, not FP8) weight."""
    from engine.kernels._linear_triton import gemv_sum_kernel
    from engine.kernels.triton_utils import launch_options

    n, k = w.shape
    if (gated or w_scale is not None or split_k < 1 or not config.fits(x.shape[0], k // split_k) or k % split_k
            or x.stride(1) != 1 or w.stride(1) != 1 or (split_k > 1 and (out_dtype is not None or bias is not None))
            or (bias is not None and (bias.shape != (n,) or bias.stride(0) != 1))):
        raise ValueError(f"decode_linear: x {tuple(x.shape)} w {tuple(w.shape)} {w.dtype} gated={gated} split_k={split_k} "
                         f"bias {None if bias is None else tuple(bias.shape)} fp8={w_scale is not None} do not fit {config}")
    if split_k > 1:
        y = torch.empty((split_k, 1, n), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    gemv_sum_kernel[(-(-n // config.block_n), split_k)](
        x, w, y, w if bias is None else bias, n, k, w.stride(0), y.stride(0) if split_k > 1 else 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k, HAS_BIAS=bias is not None, USE_PDL=pdl,
        PREFETCH_K=prefetch_k if pdl else 0, LINE=128 // w.element_size(),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )
    return y


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """Plain x @ w^T with the kernel and tile named by ``config`` (the sweep's candidates)."""
    return decode_linear(x, w, config=config)
