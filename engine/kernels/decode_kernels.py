"""Which kernels a step of few tokens runs on CUDA: the batch-1 decode path's launch policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeKernels:
    """The batch-1 decode path (measured on the H200: docs/performance.md). Steps of 1 to
    ``max_rows`` tokens run q|k|v, o_proj, gate|up (and ``gemv_down``: down_proj) and the lm_head
    as Triton GEMVs (engine/kernels/linear.py) instead of cuBLAS; ``fused_swiglu``: the gate|up
    GEMV applies SwiGLU in its epilogue (one kernel fewer per layer); ``pdl``: every Triton kernel
    of the step launches with programmatic dependent launch, so its launch overlaps the previous
    kernel's tail (Hopper+). ``gemv_down`` is off because it measured slower than cuBLAS; the
    bench keeps it as an A/B. The engine sets this before it captures CUDA graphs
    (EngineConfig.decode_kernels / .pdl); the default is the plain path."""

    max_rows: int = 0
    fused_swiglu: bool = True
    gemv_down: bool = False
    pdl: bool = False

    def applies(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens takes this path (never 0 rows: a step may sample none)."""
        return 0 < rows <= self.max_rows
