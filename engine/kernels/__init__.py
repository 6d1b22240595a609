"""Small fused ops with a torch reference (CPU, tests) and a Triton kernel (CUDA).

Each op is one kernel on the GPU where eager PyTorch would launch several: at batch-1 decode
every launch costs microseconds against a ~3.5 ms step, so fewer launches is the point.
"""

from engine.kernels.activation import silu_and_mul
from engine.kernels.norm import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "rms_norm", "silu_and_mul"]
