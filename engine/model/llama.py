"""Llama architecture over a paged KV cache: GQA, RoPE (incl. Llama-3.1 scaling), RMSNorm, SwiGLU.

The same class runs Qwen2, which is Llama with biases on q/k/v (``ModelConfig.attention_bias``:
the fused ``qkv_proj`` carries q_bias|k_bias|v_bias, added by torch's linear or in the GEMV's
epilogue).

Tokens of all requests in a step are flattened into one [T] batch (no padding); attention knows
where each request's tokens start and which KV blocks it owns from :class:`AttentionMetadata`.
Q/K/V and gate/up projections are fused into one matmul each, the residual add is fused into
the next RMSNorm, and RoPE is fused into the KV-cache write (on CUDA decode steps, into the
attention kernel too): fewer kernel launches per layer. Steps of one token can take the batch-1
GEMV path (:class:`~engine.kernels.gemv_policy.GemvPolicy`: Triton GEMVs, PDL): the policy is an
argument of each forward, not model state, so engines sharing one loaded model each run their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.kernels import add_rms_norm, rms_norm, silu_and_mul
from engine.kernels.gemv_policy import GemvPolicy
from engine.fp8 import weight_scale
from engine.kernels.int4_linear import int4_split_k
from engine.kernels.int4_pairs_gemv import pairs_split_k
from engine.kernels.linear import decode_linear, fp8_decode_tile, prefetch_columns, sum_tile, usable_split_k
from engine.kv_cache import LayerKV
from engine.model.rope import RotaryEmbedding
from engine.w4a16 import W4A16Linear

PLAIN = GemvPolicy()  # cuBLAS throughout: the default of every forward


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
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def attention(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        kv_cache: LayerKV,
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
    """The model (Llama or Qwen2); parameter names follow HF with ``qkv_proj``/``gate_up_proj`` fused."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config, max_positions or config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        kv_caches: list[LayerKV],
        gemv: GemvPolicy = PLAIN,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for the flattened tokens of one step; writes their KV.
        ``gemv``: which steps of few tokens run the batch-1 GEMVs (the engine's policy).

        Written as pieces split at attention (see :mod:`engine.cuda_graph`): piece 0, then per
        layer attention and the piece after it. Run straight through here; the piecewise runner
        replays the pieces as CUDA graphs and runs only attention eagerly."""
        qkv, residual = self.first_piece(input_ids, gemv)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn.attention(qkv, positions, self.rope.cos_sin, backend, meta, kv_caches[i], _pdl(gemv, qkv))
            if i == last:
                return self.last_piece(attn, residual, gemv)
            qkv, residual = self.middle_piece(i, attn, residual, gemv)
        raise AssertionError("a model has at least one layer")

    def first_piece(self, input_ids: torch.Tensor, gemv: GemvPolicy = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, layer 0's input norm and q|k|v projection -> (qkv, residual)."""
        h, layer = self.embed_tokens(input_ids), self.layers[0]
        x, residual = layer.input_layernorm(h, None, _pdl(gemv, h))
        return _proj(gemv, "qkv", layer.self_attn.qkv_proj, x), residual

    def _after_attention(self, i: int, attn: torch.Tensor, residual: torch.Tensor, gemv: GemvPolicy,
                         next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's output projection and MLP, then ``next_norm`` (layer i+1's input norm or the
        final norm) of the residual stream -> (normed, new residual)."""
        layer, pdl = self.layers[i], _pdl(gemv, attn)
        o_proj = layer.self_attn.o_proj
        # h may be split-K partials [parts, rows, hidden]: the norm after it sums them
        h = _gemv(gemv, "o", attn, o_proj, split_k=gemv.o_split_k) if _use_gemv(gemv, attn) else o_proj(attn)
        x, residual = layer.post_attention_layernorm(h, residual, pdl)
        mlp = layer.mlp
        if _use_gemv(gemv, x) and gemv.fused_swiglu:
            act = _gemv(gemv, "gate_up", x, mlp.gate_up_proj, gated=True)
        else:
            act = silu_and_mul(_proj(gemv, "gate_up", mlp.gate_up_proj, x), pdl=pdl)
        if _use_gemv(gemv, act) and (gemv.gemv_down or isinstance(mlp.down_proj, W4A16Linear)):  # int4: only its kernel
            split = gemv.fp8_down_split_k if weight_scale(mlp.down_proj) is not None else gemv.down_split_k
            return next_norm(_gemv(gemv, "down", act, mlp.down_proj, split_k=split), residual, pdl)
        return next_norm(mlp.down_proj(act), residual, pdl)

    def middle_piece(self, i: int, attn: torch.Tensor, residual: torch.Tensor, gemv: GemvPolicy = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's output projection and MLP, then layer i+1's input norm and q|k|v projection."""
        x, residual = self._after_attention(i, attn, residual, gemv, self.layers[i + 1].input_layernorm)
        return _proj(gemv, "qkv", self.layers[i + 1].self_attn.qkv_proj, x), residual

    def last_piece(self, attn: torch.Tensor, residual: torch.Tensor, gemv: GemvPolicy = PLAIN) -> torch.Tensor:
        """The last layer's output projection and MLP, then the final norm -> hidden [T, H]."""
        return self._after_attention(len(self.layers) - 1, attn, residual, gemv, self.norm)[0]

    def compute_logits(self, hidden: torch.Tensor, gemv: GemvPolicy = PLAIN) -> torch.Tensor:
        """Logits in float32 for the selected rows of ``hidden``."""
        if _use_gemv(gemv, hidden):  # float32 straight from the accumulator: no cast kernel
            return _gemv(gemv, "lm_head", hidden, self.embed_tokens if self.lm_head is None else self.lm_head, torch.float32)
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()


def _use_gemv(gemv: GemvPolicy, x: torch.Tensor) -> bool:
    """Whether this step's ``x`` ([rows, dim], or a split-K GEMV's [parts, rows, dim] partials)
    takes the batch-1 GEMV path."""
    return gemv.applies(x.shape[-2])


def _pdl(gemv: GemvPolicy, x: torch.Tensor) -> bool:
    return gemv.pdl and _use_gemv(gemv, x)


def _proj(gemv: GemvPolicy, name: str, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A projection (with its bias, if any): the GEMV for steps of few tokens, else the module
    (cuBLAS, or FP8 tensor cores for an :class:`~engine.fp8.Fp8Linear`)."""
    return _gemv(gemv, name, x, linear, bias=linear.bias) if _use_gemv(gemv, x) else linear(x)


def _gemv(
    gemv: GemvPolicy, name: str, x: torch.Tensor, linear: nn.Module, out_dtype: torch.dtype | None = None, gated: bool = False,
    split_k: int = 1, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Projection ``name`` (of gemv_policy.PROJECTIONS) of ``linear`` (an nn.Linear, the tied
    embedding, or an FP8 :class:`~engine.fp8.Fp8Linear` with its scales) as the batch-1 GEMV. An
    int4 :class:`~engine.w4a16.W4A16Linear` runs the kernel the policy names where the weight has
    its layout (the pairs GEMV for one row only; else tinygemm, else the Triton kernel), SwiGLU
    after it (in the pairs GEMV's epilogue it cost 0.16 ms a step, in down_proj's pairs GEMV as it
    reads its input 0.21 ms: docs/performance.md)."""
    if isinstance(linear, W4A16Linear):
        # Triton and pairs: o_proj's and down_proj's partials are summed by the norm after, as many slices as fill the SMs
        pairs = (gemv.int4_kernel == "pairs" and linear.has_pairs and x.shape[0] == 1
                 and linear.qweight.numel() >= gemv.pairs_min_bytes)
        triton = not pairs and (gemv.int4_kernel == "triton" or not linear.has_tinygemm)
        split = 1
        if name in ("o", "down") and (pairs or triton):
            shape = (linear.out_features, linear.in_features, linear.group)
            split = pairs_split_k(*shape) if pairs else int4_split_k(x.shape[0], *shape)
        y = linear(x, out_dtype=out_dtype, split_k=split, pdl=gemv.pdl,
                   prefetch_k=2 * prefetch_columns(linear.qweight, split, gemv.prefetch_budget(name)),
                   kernel="pairs" if pairs else "triton" if triton else "tinygemm", late_release=name in gemv.late_release)
        return silu_and_mul(y, pdl=gemv.pdl) if gated else y
    weight, scale = linear.weight, weight_scale(linear)
    config = fp8_decode_tile(*weight.shape, gemv.fp8_block_k) if scale is not None and gemv.fp8_block_k else None
    if name in gemv.sum_tiles and scale is None and not gated and x.shape[0] == 1:
        config = sum_tile(*weight.shape) or config
    split_k = usable_split_k(weight, split_k, config)
    return decode_linear(x, weight, out_dtype, config, gated=gated, pdl=gemv.pdl, split_k=split_k,
                         late_release=name in gemv.late_release, bias=bias, w_scale=scale, fp8_math=gemv.fp8_math,
                         prefetch_k=prefetch_columns(weight, split_k, gemv.prefetch_budget(name)))
