"""Which kernels a step of few tokens runs on CUDA: the batch-1 GEMV policy."""

from __future__ import annotations

from dataclasses import dataclass


PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")
FP8_MATHS = ("bf16", "fp16", "fp8")  # how the GEMV multiplies an FP8 weight (GemvPolicy.fp8_math; the kernel's FP8_MATH is the index)
INT4_KERNELS = ("triton", "tinygemm", "pairs")  # which kernel multiplies an int4 weight at batch 1 (GemvPolicy.int4_kernel)


@dataclass(frozen=True)
class GemvPolicy:
    """The batch-1 decode path (measured on the H200: docs/performance.md). Steps of 1 to
    ``max_rows`` tokens run q|k|v, o_proj, gate|up, down_proj (``gemv_down``) and the lm_head as
    Triton GEMVs (engine/kernels/linear.py) instead of cuBLAS; ``fused_swiglu``: the gate|up
    GEMV applies SwiGLU in its epilogue (one kernel fewer per layer); ``pdl``: every Triton kernel
    of the step launches with programmatic dependent launch, so its launch overlaps the previous
    kernel's tail (Hopper+). down_proj is a split-K GEMV whose partials the next norm sums: graph
    replay 4.07 vs 4.14 ms with cuBLAS (split-K plus its reduction kernel; H200, 2026-11-30
    05:35 run); unsplit or split 4 ways the GEMV was slower than cuBLAS (4.40 / 4.51 ms). An
    o_proj split measured no gain (2) or a loss (4). The bench keeps each as an A/B. The engine's
    model runner passes its policy (EngineConfig.batch1_gemv / .pdl) to every forward and CUDA
    graph capture; the default is the plain path."""

    max_rows: int = 0
    fused_swiglu: bool = True
    gemv_down: bool = True
    pdl: bool = False
    o_split_k: int = 1
    """o_proj's GEMV over this many K slices (more programs for a weight of few rows): float32
    partials that the next residual add + RMSNorm sums, so no reduction kernel."""
    down_split_k: int = 2
    """Likewise for down_proj when ``gemv_down``."""
    late_release: tuple[str, ...] = ("gate_up",)
    """With ``pdl``, the projections (of ``PROJECTIONS``) whose GEMV lets the next kernel launch
    only after its K loop, not right after its wait: the kernel after it then launches as the GEMV
    ends instead of holding an SM from the GEMV's start. Batch-1 graph replay on the H200, one
    process, three rounds (2026-11-30, after the even-wave grids of ``decode_tile``,
    docs/performance.md): gate|up 4.042-4.043 ms, none 4.049-4.050, o_proj and gate|up 4.057,
    o_proj alone 4.063-4.064 (before those grids o_proj and gate|up had been best); q|k|v's late
    release cost 2.5-2.9% (the attention kernel after it starts late); the lm_head's is within
    noise."""

    fp8_math: str = "fp16"
    """For FP8 weights (engine/fp8.py): "bf16" widens each weight tile to bf16 in registers (W8A16),
    "fp16" widens the tile and x to fp16 (e4m3 -> fp16 is one conversion instruction, to bf16
    two), "fp8" rounds x to e4m3 per row and multiplies on FP8 tensor cores (W8A8). 8B shape,
    batch 1, H200 (2026-12-03): 314 / 220 / 226 tok/s for fp16 / bf16 / fp8 with K 256 tiles; fp16
    holds x up to 65,504 (the projections' inputs are normed or SwiGLU outputs)."""
    fp8_block_k: int = 256
    """K elements a GEMV tile loads of an FP8 weight (0: the bf16 tile's, which then moves half the
    bytes a stage): 256, a bf16 tile's bytes at 128, 314 against 307 tok/s (same run)."""

    fp8_down_split_k: int = 1
    """``down_split_k`` for an FP8 down_proj, whose own tile (engine/kernels/linear.py fp8_decode_tile)
    streams K 512 at a time: unsplit 332.9 tok/s against 311.4 with split 2 and 279.6 with 4 (8B
    shape, batch 1, H200, one run, 2026-12-03 18:56 UTC)."""

    prefetch_bytes: int = 1 << 20
    """With ``pdl``, each GEMV first asks L2 for up to this many bytes of its weight (its first
    columns; engine/kernels/linear.py ``prefetch_columns``) before waiting for the kernel before it;
    0: off. Small weights' GEMVs wait on DRAM latency more than on bandwidth. Batch-1 graph replay
    of the Qwen2.5-1.5B shape, three interleaved rounds in one process (H200, 2026-12-03): 1.322 ms
    with 1 MiB, 1.324 with 2, 1.342 without, 1.428 / 1.527 / 1.592 with 8 / 32 / 128 MiB (a larger
    prefetch competes with the kernel before it for DRAM)."""

    prefetch_by_projection: tuple[tuple[str, int], ...] = ()
    """(projection, bytes) pairs that replace ``prefetch_bytes`` for those projections (of
    ``PROJECTIONS``): each GEMV's window before its wait is the kernel before it, which differs by
    projection (a norm before q|k|v and gate|up, attention's combine before o_proj)."""

    sum_tiles: tuple[str, ...] = ()
    """The projections (of ``PROJECTIONS``) whose one-row GEMV runs the CUDA-core "sum" tile
    (engine/kernels/linear.py ``sum_tile``: multiply-and-reduce, no tensor-core padding) instead
    of the "dot" tile, where the weight is bf16 and its K splits into the tile; unsplit then
    unless K splits into whole tiles. Off: on the 1.5B shape, q|k|v and o_proj on it replayed the
    batch-1 graph in 1.290 ms against 1.303-1.316 in one run (three rounds,
    engine/bench/experiments/bs1_prefetch_ab.py --sum) and 1.31 against 1.30 in the bench's A/B
    rows of the next (H200, 2026-12-04): within noise."""

    int4_kernel: str = "pairs"
    """For int4 weights (engine/w4a16.py): "tinygemm" runs PyTorch's ``aten._weight_int4pack_mm``
    where the weight has that layout too (W4A16Linear.add_tinygemm); "triton" runs this engine's
    kernel (engine/kernels/int4_linear.py, split-K partials for o_proj and down_proj, PDL). 8B shape,
    batch 1, H200 (2026-12-03 18:13 UTC): 360.8 against 187.6 tok/s; alone, tinygemm reads the 8B's
    projections at 1.3-1.9 TB/s, the Triton kernel at 0.6-1.0 (engine/bench/experiments/int4_kernel_ab.py).
    "pairs" (the default): the two-weights-an-instruction GEMV (engine/kernels/int4_pairs_gemv.py)
    where the weight has that layout (W4A16Linear.add_pairs), split-K for o_proj and down_proj;
    steps of more rows fall back to tinygemm. 8B shape, batch 1, H100 (2026-12-06 04:51 UTC): 433.62
    against tinygemm's 372.62 tok/s with an e4m3 head, 446.79 against 377.38 with an int4 head; H200
    (09:25 UTC, int4 head): 484.37 against 371.47."""

    pairs_min_bytes: int = 8 << 20
    """With ``int4_kernel`` "pairs": only weights of at least this many bytes of nibbles take the
    pairs GEMV, smaller ones tinygemm. H100, batch 1, each kernel alone (2026-12-06,
    engine/bench/experiments/int4_pairs_gemv_sweep.py): pairs won on every 8B projection (8 MiB
    o_proj 6.1 against 6.8 us up to 56 MiB gate|up 23.8 against 35.1) and on the 1.5B's 13 MiB
    gate|up (10.0 against 11.3); tinygemm won on the 1.5B's q|k|v, o_proj and down_proj (1.5, 1.1
    and 6.6 MiB: 3.6 against 4.4 us, 3.5 against 3.9, 8.6 against 22 unsplit)."""

    def __post_init__(self) -> None:
        if self.int4_kernel not in INT4_KERNELS:
            raise ValueError(f"GemvPolicy.int4_kernel must be one of {INT4_KERNELS}, got {self.int4_kernel!r}")
        unknown = (set(self.late_release) | set(self.sum_tiles) | {name for name, _ in self.prefetch_by_projection}) - set(PROJECTIONS)
        if unknown:
            raise ValueError(f"GemvPolicy.late_release / sum_tiles / prefetch_by_projection: unknown projections {sorted(unknown)} (known: {PROJECTIONS})")
        if self.fp8_math not in FP8_MATHS:
            raise ValueError(f"GemvPolicy.fp8_math must be one of {FP8_MATHS}, got {self.fp8_math!r}")

    def prefetch_budget(self, projection: str) -> int:
        """Bytes of this projection's weight its GEMV asks L2 for before its PDL wait."""
        return dict(self.prefetch_by_projection).get(projection, self.prefetch_bytes)

    def applies(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens takes this path (never 0 rows: a step may sample none)."""
        return 0 < rows <= self.max_rows
