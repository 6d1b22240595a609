"""Memory ledger: where the device memory goes (weights, KV pool, activations, the rest)."""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each once (tied weights and views share one); an
    opaque tensor (oneDNN's prepacked weights) has no storage to share and counts its elements."""
    sizes = {}
    for t in tensors:
        if t.is_mkldnn:
            sizes[("opaque", id(t))] = t.numel() * t.element_size()
        else:
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def release_device_memory() -> None:
    """Free what engines no longer referenced still hold (weights, KV caches and CUDA graphs kept
    alive by reference cycles until the next collection) and hand the allocator's cached blocks
    back to the device: a CUDA engine sizes its KV cache from the device's free memory, so a
    second engine in one process (the eval's next variant) would otherwise find it taken."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage once."""
    return storage_bytes([*module.parameters(), *module.buffers()])


@dataclass
class MemoryLedger:
    """Bytes by owner, plus what the device says in total (CUDA only)."""

    device: str
    entries: dict[str, int] = field(default_factory=dict)

    def record(self, owner: str, nbytes: int) -> None:
        self.entries[owner] = nbytes

    def add(self, owner: str, nbytes: int) -> None:
        self.entries[owner] = self.entries.get(owner, 0) + nbytes

    @property
    def accounted(self) -> int:
        return sum(self.entries.values())

    def rows(self) -> list[tuple[str, int]]:
        """(owner, bytes) rows; on CUDA, peak reserved memory not owned by anyone is "other"."""
        rows = list(self.entries.items())
        if self.device.startswith("cuda") and torch.cuda.is_available():
            peak = torch.cuda.max_memory_reserved(torch.device(self.device))
            rows.append(("other (allocator, workspace)", max(0, peak - self.accounted)))
            rows.append(("peak reserved (device)", peak))
        return rows

    def format(self, rows: list[tuple[str, int]] | None = None) -> str:
        """The table of ``rows`` (default: now)."""
        return "\n".join(f"{owner:<32} {nbytes / 2**20:>12,.1f} MiB" for owner, nbytes in (self.rows() if rows is None else rows))
