"""Llama architecture over a paged KV cache: GQA, RoPE (incl. Llama-3.1 scaling), RMSNorm, SwiGLU.

Tokens of all requests in a step are flattened into one [T] batch (no padding); attention knows
where each request's tokens start and which KV blocks it owns from :class:`AttentionMetadata`.
Q/K/V and gate/up projections are fused into one matmul each, the residual add is fused into
the next RMSNorm, and RoPE is fused into the KV-cache write (on CUDA decode steps, into the
attention kernel too): fewer kernel launches per layer. Steps of one token can take the batch-1
decode path (:class:`~engine.kernels.decode_kernels.DecodeKernels`: Triton GEMVs, PDL).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.kernels import add_rms_norm, rms_norm, silu_and_mul
from engine.kernels.decode_kernels import DecodeKernels
from engine.kernels.linear import decode_linear, usable_split_k
from engine.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual): with a residual, normalises ``x + residual``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, pdl=pdl), x
        return add_rms_norm(x, residual, self.weight, self.eps, pdl=pdl)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def attention(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        pdl: bool = False,
    ) -> torch.Tensor:
        """The part between the projections: RoPE, KV write, paged attention -> [T, q_size].
        Piecewise CUDA graphs run exactly this eagerly (its launch shape depends on the batch)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return backend.rope_store_attend(q, k, v, positions, cos_sin, kv_cache, meta, self.scale, pdl).reshape(t, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


class LlamaForCausalLM(nn.Module):
    """The model; parameter names follow HF with ``qkv_proj``/``gate_up_proj`` fused."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config, max_positions or config.max_position_embeddings)
        # The batch-1 decode path (Triton GEMVs, PDL); off by default. Set by the engine
        # (EngineConfig.decode_kernels / .pdl, CUDA only) before it captures graphs; tests set it
        # on the CPU to run the same kernels in Triton's interpreter.
        self.decode_kernels = DecodeKernels()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for the flattened tokens of one step; writes their KV.

        Written as pieces split at attention (see :mod:`engine.cuda_graph`): piece 0, then per
        layer attention and the piece after it. Run straight through here; the piecewise runner
        replays the pieces as CUDA graphs and runs only attention eagerly."""
        qkv, residual = self.first_piece(input_ids)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn.attention(qkv, positions, self.rope.cos_sin, backend, meta, kv_caches[i], self._pdl(qkv))
            if i == last:
                return self.last_piece(attn, residual)
            qkv, residual = self.middle_piece(i, attn, residual)
        raise AssertionError("a model has at least one layer")

    def first_piece(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, layer 0's input norm and q|k|v projection -> (qkv, residual)."""
        return self._norm_qkv(0, self.embed_tokens(input_ids), None)

    def _use_gemv(self, x: torch.Tensor) -> bool:
        """Whether this step's ``x`` ([rows, dim], or a split-K GEMV's [parts, rows, dim]
        partials) takes the batch-1 decode path (DecodeKernels)."""
        return self.decode_kernels.applies(x.shape[-2])

    def _pdl(self, x: torch.Tensor) -> bool:
        return self.decode_kernels.pdl and self._use_gemv(x)

    def _proj(self, name: str, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """A projection: the decode GEMV for steps of few tokens, else the module (cuBLAS)."""
        return self._gemv(name, x, linear.weight) if self._use_gemv(x) else linear(x)

    def _gemv(
        self, name: str, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None, gated: bool = False,
        split_k: int = 1,
    ) -> torch.Tensor:
        """Projection ``name`` (of decode_kernels.PROJECTIONS) as the decode GEMV."""
        path = self.decode_kernels
        return decode_linear(x, weight, out_dtype, gated=gated, pdl=path.pdl, split_k=usable_split_k(weight, split_k),
                             late_release=name in path.late_release)

    def _norm_qkv(self, i: int, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's input norm (of h + residual) and q|k|v projection -> (qkv, new residual)."""
        layer = self.layers[i]
        x, residual = layer.input_layernorm(h, residual, self._pdl(h))
        return self._proj("qkv", layer.self_attn.qkv_proj, x), residual

    def _after_attention(self, i: int, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer, pdl, path = self.layers[i], self._pdl(attn), self.decode_kernels
        o_proj = layer.self_attn.o_proj
        # h may be split-K partials [parts, rows, hidden]: the norm after it sums them
        h = self._gemv("o", attn, o_proj.weight, split_k=path.o_split_k) if self._use_gemv(attn) else o_proj(attn)
        x, residual = layer.post_attention_layernorm(h, residual, pdl)
        mlp = layer.mlp
        if self._use_gemv(x) and self.decode_kernels.fused_swiglu:
            act = self._gemv("gate_up", x, mlp.gate_up_proj.weight, gated=True)
        else:
            act = silu_and_mul(self._proj("gate_up", mlp.gate_up_proj, x), pdl=pdl)
        if path.gemv_down:
            down = self._gemv("down", act, mlp.down_proj.weight, split_k=path.down_split_k) if self._use_gemv(act) else mlp.down_proj(act)
            return down, residual
        return mlp.down_proj(act), residual

    def middle_piece(self, i: int, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's output projection and MLP, then layer i+1's input norm and q|k|v projection."""
        h, residual = self._after_attention(i, attn, residual)
        return self._norm_qkv(i + 1, h, residual)

    def last_piece(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output projection and MLP, then the final norm -> hidden [T, H]."""
        h, residual = self._after_attention(len(self.layers) - 1, attn, residual)
        return self.norm(h, residual, self._pdl(h))[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the selected rows of ``hidden``."""
        if self._use_gemv(hidden):  # float32 straight from the accumulator: no cast kernel
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            return self._gemv("lm_head", hidden, weight, torch.float32)
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
