"""Host -> device copies that do not wait for the device.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronizes the
stream, so it waits for every kernel already queued - with async scheduling that is the whole
step in flight. Staging through pinned memory and copying with ``non_blocking=True`` only
enqueues the copy; PyTorch's pinned-memory cache keeps the staging buffer alive until the copy
has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, enqueued behind the queued work without a host wait."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, values: np.ndarray) -> None:
    """Enqueue ``values`` into the first ``len(values)`` elements of ``dst`` (a persistent
    device buffer, e.g. a CUDA graph's input) without a host wait."""
    host = torch.from_numpy(values)
    if dst.device.type == "cuda":
        host = host.pin_memory()
    dst[: len(values)].copy_(host, non_blocking=dst.device.type == "cuda")
