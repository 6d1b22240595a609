"""The KV cache pool: one preallocated tensor of fixed-size blocks, sized from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one block across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block)


class KVCache:
    """K and V for every layer as views into one zero-initialised tensor.

    Zeroed, not empty: padded reads in reference attention multiply masked-out V rows by 0,
    and uninitialised NaN bytes would turn that into NaN.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.storage = torch.zeros(
            spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
            dtype=spec.dtype, device=device,
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage[i, 0], self.storage[i, 1]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.layer(i) for i in range(self.spec.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
