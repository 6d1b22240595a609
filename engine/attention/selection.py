"""Which attention backend a step runs on: a choice between the implementations, kept apart from
the interface (``backend``) so the interface imports none of them."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.torch_ref import TorchReferenceAttention
from engine.kernels.triton_utils import triton_available


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks Triton on CUDA when it imports, else the torch reference."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchReferenceAttention()
    if device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device}")
    if not triton_available():
        if name == "triton":
            raise ValueError("attention backend 'triton' needs the triton package")
        return TorchReferenceAttention()
    from engine.attention.triton_paged import TritonPagedAttention  # only once Triton is known to import

    return TritonPagedAttention()
