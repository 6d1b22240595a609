"""Whether the Triton kernels can run for a tensor."""

from __future__ import annotations

from functools import cache

import torch


@cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels for CUDA tensors; CPU tensors take the torch reference. (Tests run the
    Triton versions on the CPU under ``TRITON_INTERPRET=1`` by calling them directly.)"""
    return t.is_cuda and triton_available()
