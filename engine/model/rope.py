"""Rotary position embeddings, including Llama-3.1's frequency scaling ("llama3" rope type)."""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, in float32 exactly as HF computes them (greedy parity)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin table indexed by absolute position (no per-step trig); the attention
    backend applies it (fused with the KV-cache write on the GPU)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        # One table [max_positions, head_dim]: cos in the first half, sin in the second.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1).float(), persistent=False)
