"""The KV cache pool: one preallocated tensor of fixed-size blocks, sized from a memory budget.

With an FP8 cache (``kv_cache_dtype="fp8"``) K and V are stored in e4m3 with one float32 scale
per (layer, K|V, block, row in page, KV head) in a side tensor: per-token-per-head scales need no
calibration and keep large K biases (Qwen2's) from clipping, at 4 bytes per 128-element row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
FP8_MIN_SCALE = 1e-12  # an all-zero row still gets a finite, nonzero scale


@dataclass(frozen=True)
class LayerKV:
    """One layer's view of the cache: K and V ``[blocks, page, kv_heads, head_dim]``, and with an
    FP8 cache their scales ``[blocks, page, kv_heads]`` (None otherwise)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> "LayerKV":
        """Plain K and V in ``dtype`` (the stored values times their scales): what reads of an FP8
        cache compute with, as a copy."""
        if self.k_scale is None or self.v_scale is None:
            return LayerKV(self.k.to(dtype), self.v.to(dtype))
        return LayerKV(dequantize(self.k, self.k_scale, dtype), dequantize(self.v, self.v_scale, dtype))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., head_dim]`` as e4m3 values and one float32 scale each (amax / 448), so that
    ``values * scale`` restores the row within e4m3's 3 mantissa bits."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    return (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values * scale`` in float32, then ``dtype``."""
    return (values.float() * scale[..., None]).to(dtype)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one block across all layers; ``dtype`` is the stored K/V dtype (e4m3 for FP8)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, block_size, dtype)

    @property
    def quantized(self) -> bool:
        return self.dtype == FP8_DTYPE

    @property
    def bytes_per_block(self) -> int:
        """K and V rows, plus a float32 scale per row when quantized."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        row = self.head_dim * elem + (4 if self.quantized else 0)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row

    @property
    def bytes_per_token(self) -> int:
        """One token's K and V in every layer, as stored (scales included)."""
        return self.bytes_per_block // self.block_size

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block)


class KVCache:
    """K and V for every layer as views into one zero-initialised tensor (and the scales' one).

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
        self.scales = (
            torch.zeros(spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, dtype=torch.float32, device=device)
            if spec.quantized else None
        )

    def layer(self, i: int) -> LayerKV:
        if self.scales is None:
            return LayerKV(self.storage[i, 0], self.storage[i, 1])
        return LayerKV(self.storage[i, 0], self.storage[i, 1], self.scales[i, 0], self.scales[i, 1])

    def layers(self) -> list[LayerKV]:
        return [self.layer(i) for i in range(self.spec.num_layers)]

    @property
    def ledger_name(self) -> str:
        """The memory ledger's owner: says the stored format when it is not the model's dtype."""
        return "kv_cache (fp8 e4m3 + f32 scales)" if self.spec.quantized else "kv_cache"

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.storage.numel() * self.storage.element_size() + scales
