"""Whisper's encoder-decoder in PyTorch, loaded from CTranslate2 weights or random for timing.

The decoder runs one token per call (:meth:`Whisper.decode_step`) against a preallocated
:class:`KVCache`: self-attention keys and values are written at the step's position, and the
cross-attention keys and values are computed once per batch from the encoder output
(:meth:`Whisper.fill_cross`). Every tensor the step touches has a fixed shape and address, so
the whole step (all layers) can be captured in one CUDA graph.

CTranslate2's names map one to one: ``{side}/layer_i/self_attention/linear_0`` is the fused
q|k|v projection (k's bias stored as zeros), ``linear_1`` its output; the decoder's
``attention/linear_0`` is the cross-attention query, ``linear_1`` its fused k|v, ``linear_2`` its
output; ``ffn/linear_0|1`` the MLP; ``layer_norm`` gamma/beta; ``position_encodings/encodings``
the learned positions; ``decoder/embeddings/weight`` the token embedding, tied to the output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speech.asr.ct2_weights import CT2Model


@dataclass(frozen=True)
class WhisperDims:
    """The shape of a Whisper model."""

    n_mels: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int
    n_audio_ctx: int = 1500
    n_text_ctx: int = 448


# The large-v3-turbo shape (809M parameters): what real deployments run, for timing with random weights.
TURBO_DIMS = WhisperDims(n_mels=128, n_audio_state=1280, n_audio_head=20, n_audio_layer=32,
                         n_vocab=51866, n_text_state=1280, n_text_head=20, n_text_layer=4)  # fmt: skip


def _heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(batch, time, dim) -> (batch, heads, time, head_dim)."""
    batch, time, dim = x.shape
    return x.view(batch, time, n_head, dim // n_head).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, time, head_dim) -> (batch, time, dim)."""
    batch, heads, time, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, time, heads * head_dim)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, self.n_head) for t in self.qkv(x).chunk(3, dim=-1))
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v)))

    def step(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             step: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """One new position: write its k, v at ``step`` and attend to the positions ``attend`` marks."""
        q, k, v = (_heads(t, self.n_head) for t in self.qkv(x).chunk(3, dim=-1))
        index = step.view(1)
        k_cache.index_copy_(2, index, k)
        v_cache.index_copy_(2, index, v)
        return self.out(_merge(F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=attend)))


class CrossAttention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def keys_values(self, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv(audio).chunk(2, dim=-1)
        return _heads(k, self.n_head), _heads(v, self.n_head)

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q = _heads(self.q(x), self.n_head)
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v)))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.attn_ln, self.attn = nn.LayerNorm(dim), SelfAttention(dim, n_head)
        self.mlp_ln, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x))
        return x + self.mlp(self.mlp_ln(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.attn_ln, self.attn = nn.LayerNorm(dim), SelfAttention(dim, n_head)
        self.cross_ln, self.cross = nn.LayerNorm(dim), CrossAttention(dim, n_head)
        self.mlp_ln, self.mlp = nn.LayerNorm(dim), MLP(dim)


class Encoder(nn.Module):
    def __init__(self, dims: WhisperDims) -> None:
        super().__init__()
        dim = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.positions = nn.Parameter(torch.empty(dims.n_audio_ctx, dim))
        self.layers = nn.ModuleList(EncoderLayer(dim, dims.n_audio_head) for _ in range(dims.n_audio_layer))
        self.ln_post = nn.LayerNorm(dim)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """(batch, n_mels, 3000) log-mel -> (batch, 1500, dim)."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        x = x + self.positions
        for layer in self.layers:
            x = layer(x)
        return self.ln_post(x)


class Decoder(nn.Module):
    def __init__(self, dims: WhisperDims) -> None:
        super().__init__()
        dim = dims.n_text_state
        self.token_embedding = nn.Embedding(dims.n_vocab, dim)
        self.positions = nn.Parameter(torch.empty(dims.n_text_ctx, dim))
        self.layers = nn.ModuleList(DecoderLayer(dim, dims.n_text_head) for _ in range(dims.n_text_layer))
        self.ln = nn.LayerNorm(dim)


@dataclass(frozen=True)
class KVCache:
    """The decoder's static cache for ``batch`` rows (a view of a larger one keeps its addresses).

    self_k/self_v: (layers, batch, heads, positions, head_dim); cross_k/cross_v:
    (layers, batch, heads, audio_ctx, head_dim); positions: arange(positions), for the mask.
    """

    self_k: torch.Tensor
    self_v: torch.Tensor
    cross_k: torch.Tensor
    cross_v: torch.Tensor
    positions: torch.Tensor

    def rows(self, batch: int) -> KVCache:
        """The first ``batch`` rows (views: same memory)."""
        return KVCache(self.self_k[:, :batch], self.self_v[:, :batch], self.cross_k[:, :batch],
                       self.cross_v[:, :batch], self.positions)  # fmt: skip

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.self_k, self.self_v, self.cross_k, self.cross_v))


class Whisper(nn.Module):
    """The encoder, and the decoder run one step at a time against a :class:`KVCache`."""

    def __init__(self, dims: WhisperDims) -> None:
        super().__init__()
        self.dims = dims
        self.encoder = Encoder(dims)
        self.decoder = Decoder(dims)

    @torch.inference_mode()
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        return self.encoder(mel.to(self.encoder.conv1.weight.dtype))

    def new_cache(self, batch: int, positions: int) -> KVCache:
        """A zeroed cache for up to ``batch`` rows and ``positions`` decoder positions."""
        dims, weight = self.dims, self.decoder.ln.weight
        head_dim = dims.n_text_state // dims.n_text_head
        shape = (dims.n_text_layer, batch, dims.n_text_head)

        def zeros(length: int) -> torch.Tensor:
            return torch.zeros(*shape, length, head_dim, dtype=weight.dtype, device=weight.device)

        return KVCache(zeros(positions), zeros(positions), zeros(dims.n_audio_ctx), zeros(dims.n_audio_ctx),
                       torch.arange(positions, device=weight.device))  # fmt: skip

    @torch.inference_mode()
    def fill_cross(self, cache: KVCache, audio: torch.Tensor) -> None:
        """Write the cross-attention keys and values of ``audio`` (batch, 1500, dim) into rows 0..batch-1."""
        for index, layer in enumerate(self.decoder.layers):
            k, v = layer.cross.keys_values(audio)
            cache.cross_k[index, : len(audio)].copy_(k)
            cache.cross_v[index, : len(audio)].copy_(v)

    def decode_step(self, tokens: torch.Tensor, step: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed ``tokens`` (batch,) at position ``step`` (a 0-dim tensor); float32 logits (batch, vocab)."""
        decoder = self.decoder
        x = (decoder.token_embedding(tokens) + decoder.positions.index_select(0, step.view(1)))[:, None, :]
        attend = (cache.positions <= step).view(1, 1, 1, -1)
        for index, layer in enumerate(decoder.layers):
            x = x + layer.attn.step(layer.attn_ln(x), cache.self_k[index], cache.self_v[index], step, attend)
            x = x + layer.cross(layer.cross_ln(x), cache.cross_k[index], cache.cross_v[index])
            x = x + layer.mlp(layer.mlp_ln(x))
        x = decoder.ln(x[:, 0])
        return (x @ decoder.token_embedding.weight.T).float()


def dims_from_ct2(model: CT2Model) -> WhisperDims:
    """The shape of a CTranslate2 Whisper (layer counts from the variable names)."""
    v = model.variables

    def layers(side: str) -> int:
        found = {int(m.group(1)) for name in v if (m := re.match(rf"{side}/layer_(\d+)/", name))}
        return max(found) + 1

    conv1 = v["encoder/conv1/weight"]
    embeddings = v["decoder/embeddings/weight"]
    return WhisperDims(
        n_mels=conv1.shape[1], n_audio_state=conv1.shape[0], n_audio_head=model.scalar("encoder/num_heads"),
        n_audio_layer=layers("encoder"), n_vocab=embeddings.shape[0], n_text_state=embeddings.shape[1],
        n_text_head=model.scalar("decoder/num_heads"), n_text_layer=layers("decoder"),
        n_audio_ctx=v["encoder/position_encodings/encodings"].shape[0],
        n_text_ctx=v["decoder/position_encodings/encodings"].shape[0],
    )  # fmt: skip


def _ct2_name(name: str) -> str:
    """Our parameter name -> CTranslate2's variable name."""
    rules = [
        (r"^(encoder|decoder)\.layers\.(\d+)\.", r"\1/layer_\2/"),
        (r"attn_ln\.", "self_attention/layer_norm/"), (r"attn\.qkv\.", "self_attention/linear_0/"),
        (r"attn\.out\.", "self_attention/linear_1/"), (r"cross_ln\.", "attention/layer_norm/"),
        (r"cross\.q\.", "attention/linear_0/"), (r"cross\.kv\.", "attention/linear_1/"),
        (r"cross\.out\.", "attention/linear_2/"), (r"mlp_ln\.", "ffn/layer_norm/"),
        (r"mlp\.fc1\.", "ffn/linear_0/"), (r"mlp\.fc2\.", "ffn/linear_1/"),
        (r"^encoder\.ln_post\.", "encoder/layer_norm/"), (r"^decoder\.ln\.", "decoder/layer_norm/"),
        (r"^(encoder|decoder)\.positions$", r"\1/position_encodings/encodings"),
        (r"^encoder\.(conv\d)\.", r"encoder/\1/"), (r"^decoder\.token_embedding\.", "decoder/embeddings/"),
        (r"norm/weight$", "norm/gamma"), (r"norm/bias$", "norm/beta"),
    ]  # fmt: skip
    for pattern, replacement in rules:
        name = re.sub(pattern, replacement, name)
    return name


def from_ct2(model: CT2Model, device: torch.device, dtype: torch.dtype) -> Whisper:
    """A Whisper holding a CTranslate2 model's weights, on ``device`` in ``dtype``."""
    if model.spec != "WhisperSpec":
        raise ValueError(f"not a Whisper model: the file's spec is {model.spec!r}")
    with torch.device("meta"):
        whisper = Whisper(dims_from_ct2(model))
    state = {}
    for name in whisper.state_dict():
        array = model.variables[_ct2_name(name)]
        state[name] = torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)
    whisper.load_state_dict(state, assign=True)
    return whisper.eval()


def random_whisper(dims: WhisperDims, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Whisper:
    """A Whisper of shape ``dims`` with random weights (for timing only: it transcribes nothing)."""
    with torch.device("meta"):
        whisper = Whisper(dims)
    whisper = whisper.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in whisper.named_parameters():
            if "ln" in name.split(".")[-2] and name.endswith("weight"):
                parameter.fill_(1.0)
            elif name.endswith("bias"):
                parameter.zero_()
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    return whisper.eval()


def parameter_count(dims: WhisperDims) -> int:
    """How many parameters a Whisper of shape ``dims`` has (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Whisper(dims).parameters())


__all__ = ["KVCache", "TURBO_DIMS", "Whisper", "WhisperDims", "dims_from_ct2", "from_ct2",
           "parameter_count", "random_whisper"]  # fmt: skip
