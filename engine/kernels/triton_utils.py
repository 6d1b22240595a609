"""Whether the Triton kernels can run for a tensor."""

from __future__ import annotations

import os
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


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, set before
    triton is imported): kernels then run as Python and no inline PTX can run."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_triton(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``t``: a CUDA tensor, or any under Triton's CPU interpreter
    (``TRITON_INTERPRET=1``, the tests') - for modules whose only implementation is the kernel."""
    return triton_available() and (t.is_cuda or triton_interpreting())


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs a CUDA device of compute capability 9.0+ (Hopper)."""
    return device.type == "cuda" and triton_available() and torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(pdl: bool) -> dict[str, bool]:
    """Extra launch keywords for a Triton kernel: ``launch_pdl`` only when used (the CPU
    interpreter never sees it)."""
    return {"launch_pdl": True} if pdl else {}
