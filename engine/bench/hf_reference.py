"""HF transformers' ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) holding the same weights as an engine model.

The baseline for benchmarks and the reference for parity tests: same architecture code path as
everyone else's, same numbers in, so any difference is the engine's.
"""

from __future__ import annotations

import torch

from engine.config import ARCHITECTURES
from engine.fp8 import Fp8Linear
from engine.model import LlamaForCausalLM
from engine.quantization import Int4Linear
from engine.w4a16 import W4A16Linear


def to_hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Split the engine's fused q|k|v (weights and biases) and gate|up weights back into HF names
    (views, no copies; an FP8 projection's weight as its dequantized values, in the embedding's
    dtype: the HF model then holds the weights the engine rounded to e4m3)."""
    cfg = model.config
    q, kv, ff = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:  # untied, or a tied head quantized into a copy of its own
        out["lm_head.weight"] = _weight(model.lm_head, model.embed_tokens.weight.dtype)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = _weight(layer.self_attn.qkv_proj, model.embed_tokens.weight.dtype)
        out[p + "self_attn.q_proj.weight"] = qkv[:q]
        out[p + "self_attn.k_proj.weight"] = qkv[q : q + kv]
        out[p + "self_attn.v_proj.weight"] = qkv[q + kv :]
        bias = layer.self_attn.qkv_proj.bias
        if bias is not None:
            out[p + "self_attn.q_proj.bias"] = bias[:q]
            out[p + "self_attn.k_proj.bias"] = bias[q : q + kv]
            out[p + "self_attn.v_proj.bias"] = bias[q + kv :]
        out[p + "self_attn.o_proj.weight"] = _weight(layer.self_attn.o_proj, model.embed_tokens.weight.dtype)
        gate_up = _weight(layer.mlp.gate_up_proj, model.embed_tokens.weight.dtype)
        out[p + "mlp.gate_proj.weight"] = gate_up[:ff]
        out[p + "mlp.up_proj.weight"] = gate_up[ff:]
        out[p + "mlp.down_proj.weight"] = _weight(layer.mlp.down_proj, model.embed_tokens.weight.dtype)
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return out


def _weight(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A projection's weight as HF holds it: itself, an FP8 or CUDA int4 one's dequantized values,
    or a CPU int4 one's dense copy."""
    if isinstance(linear, (Fp8Linear, W4A16Linear)):
        return linear.dequantized().to(dtype)
    return linear.dense_weight() if isinstance(linear, Int4Linear) else linear.weight


def build_hf_model(model: LlamaForCausalLM, attn_implementation: str = "sdpa"):
    """A ``transformers.LlamaForCausalLM`` (``Qwen2ForCausalLM`` for a qwen2 model) on the same
    device/dtype with copies of the weights."""
    import transformers

    weight = model.embed_tokens.weight
    hf_class = getattr(transformers, ARCHITECTURES[model.config.architecture])
    config = hf_class.config_class(**model.config.to_hf_dict(), attn_implementation=attn_implementation)
    config.tie_word_embeddings = model.lm_head is None  # a quantized copy of a tied head is a head of its own
    config.pad_token_id = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    from engine.loader import default_dtype

    with torch.device(weight.device), default_dtype(weight.dtype):  # never a float32 copy of an 8B model
        hf = hf_class(config)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.lm_head is None)]
    if missing or unexpected:
        raise RuntimeError(f"HF reference mismatch: missing {missing}, unexpected {unexpected}")
    if model.lm_head is None:
        hf.tie_weights()
    return hf.eval().requires_grad_(False)
