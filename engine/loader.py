"""Weight loading: HF safetensors directories, llama/qwen2 GGUF files, and random ("dummy") weights.

Everything is mapped onto HF parameter names first, then fused into the engine's layout
(``qkv_proj`` = q|k|v rows, ``gate_up_proj`` = gate|up rows).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.config import ARCHITECTURES, ConfigError, EngineConfig, ModelConfig
from engine.gguf_blocks import BlockCache, dequantized
from engine.gguf_file import GGUFFile, unpermute_rows
from engine.model import LlamaForCausalLM
from engine.model.rope import RotaryEmbedding

GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def model_kind(config: EngineConfig) -> str:
    """'dummy', 'gguf' or 'hf', with a clear error for anything else."""
    path = Path(config.model)
    if config.load_format == "dummy":
        return "dummy"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "hf"
    raise ConfigError(
        f"{path} is not a model: expected a llama or qwen2 .gguf file or a directory with config.json and "
        "*.safetensors (or a config.json with load_format='dummy')"
    )


def has_tokenizer(config: EngineConfig) -> bool:
    """GGUF files embed one; HF directories may ship one; dummy weights have none."""
    kind = model_kind(config)
    if kind == "gguf":
        return True
    return kind == "hf" and any((Path(config.model) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


# ---- GGUF -----------------------------------------------------------------------------------
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>")
"""Control tokens that end a generation wherever a vocabulary has them (ChatML's and Llama 3's
turn ends, as llama.cpp's end-of-generation set): a file names one ``eos_token_id``, but Qwen's
``<|im_end|>`` (its EOS) and ``<|endoftext|>`` must both stop."""


def _stop_ids(file: GGUFFile) -> tuple[int, ...]:
    """The file's EOS (and EOT) id, then its control tokens of :data:`END_OF_TURN_TOKENS`."""
    import gguf

    ids = [int(v) for v in (file.get("tokenizer.ggml.eos_token_id"), file.get("tokenizer.ggml.eot_token_id")) if v is not None]
    tokens, types = file.get("tokenizer.ggml.tokens"), file.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        control = int(gguf.TokenType.CONTROL)
        ids += [i for i, text in enumerate(tokens) if text in END_OF_TURN_TOKENS and int(types[i]) == control]
    return tuple(dict.fromkeys(ids))


def gguf_model_config(file: GGUFFile) -> ModelConfig:
    """The model config of a llama or qwen2 GGUF (``<arch>.*`` keys)."""
    path = file.path
    arch = file.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path.name}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def field(key: str, default=None):
        return file.get(f"{arch}.{key}", default)

    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    names = {t.name for t in file.tensors}
    vocab = field("vocab_size") or len(file.metadata["tokenizer.ggml.tokens"])
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_hidden_layers=int(field("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(field("attention.head_count_kv", heads)),
        head_dim=int(field("rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        max_position_embeddings=int(field("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=file.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_stop_ids(file),
        name=str(file.get("general.name", "gguf")),
        architecture=arch,
        attention_bias="blk.0.attn_q.bias" in names,
    )


def _hf_name(path: Path, tensor_name: str) -> str | None:
    """The HF name of a GGUF tensor; None for one the engine recomputes (rope_freqs)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", tensor_name)
    if m and m[2] in GGUF_LAYER_NAMES:
        return f"model.layers.{m[1]}.{GGUF_LAYER_NAMES[m[2]]}.{m[3]}"
    if tensor_name in GGUF_NAMES:
        return GGUF_NAMES[tensor_name]
    if tensor_name == "rope_freqs.weight":
        return None
    raise ConfigError(f"{path.name}: unexpected tensor {tensor_name!r}")


def read_gguf(path: Path, blocks: BlockCache | None = None) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The model config and (HF name, float32 tensor) pairs, dequantized with the gguf package
    (any type it implements: F32, F16, BF16, Q4_0 ... Q8_0, the K-quants, the IQ types), or bit
    for bit the same through ``blocks`` (an int4 load's :class:`BlockCache`, shared with its int4
    and native copies) where :func:`engine.gguf_blocks.dequantized` can."""
    file = GGUFFile.read(path)
    config = gguf_model_config(file)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for t in file.tensors:
            name = _hf_name(path, t.name)
            if name is None:
                continue
            try:
                w = dequantized(t, blocks)
            except NotImplementedError as e:
                raise ConfigError(f"{path.name}: tensor {t.name!r} has type {t.tensor_type.name}, "
                                  f"which the gguf package cannot dequantize ({e})") from e
            w = w.reshape(tuple(reversed([int(x) for x in t.shape])))
            if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_rows(w, config.num_attention_heads)
            elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_rows(w, config.num_key_value_heads)
            # torch needs a writable array: a copy of a memory-mapped F32/F16 tensor; a fresh one as it is
            yield name, torch.from_numpy(np.require(w, np.float32, ["C", "W"]))

    return config, tensors()


# ---- HF safetensors -------------------------------------------------------------------------
def read_hf_dir(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    from safetensors import safe_open

    with open(path / "config.json") as f:
        raw = json.load(f)
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            raw = {**raw, "eos_token_id": eos}
    try:
        config = ModelConfig.from_hf_dict(raw, name=path.name)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return config, tensors()


# ---- into the engine's layout -----------------------------------------------------------------
def load_weights(model: LlamaForCausalLM, named: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model, fusing q/k/v (weights and biases) and gate/up into
    their slices."""
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    slices = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, q + kv), "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
              "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
              "up_proj": ("gate_up_proj", cfg.intermediate_size, 2 * cfg.intermediate_size)}
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in named:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and model.lm_head is None:
                continue  # tied checkpoints sometimes store the head too
            target = name.removeprefix("model.")
            m = re.fullmatch(r"(layers\.\d+\.(?:self_attn|mlp))\.(\w+)\.(weight|bias)", target)
            lo = hi = None  # the whole parameter, or rows lo:hi of a fused one
            if m and m[2] in slices:
                fused, lo, hi = slices[m[2]]
                target = f"{m[1]}.{fused}.{m[3]}"
            if target not in params:
                raise ConfigError(f"unexpected weight {name!r} for a {cfg.architecture} model")
            params[target][lo:hi].copy_(tensor)
            loaded.add(target if lo is None else f"{target}[{lo}:{hi}]")
    expected = set()
    for key in params:
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if key.endswith((f + ".weight", f + ".bias"))), None)
        if fused is None:
            expected.add(key)
        else:
            expected |= {f"{key}[{lo}:{hi}]" for f2, lo, hi in slices.values() if f2 == fused}
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights (normal, std 0.02; norms 1): speed does not depend on weight values."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in ``dtype`` (an 8B model never exists in float32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype,
               blocks: BlockCache | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model on ``device`` in ``dtype`` with weights from ``config.model`` (a GGUF's
    read through ``blocks`` where given: see :func:`read_gguf`)."""
    kind = model_kind(config)
    path = Path(config.model)
    if kind == "dummy":
        model_config, named = ModelConfig.from_json(path), None
    elif kind == "gguf":
        model_config, named = read_gguf(path, blocks)
    else:
        model_config, named = read_hf_dir(path)
    max_len = config.max_model_len or model_config.max_position_embeddings
    # Built on the meta device, then given uninitialized storage: every parameter is written below,
    # so nn.Linear's random init would be wasted (seconds for a 1.5B model on a small CPU).
    with torch.device("meta"), default_dtype(dtype):
        model = LlamaForCausalLM(model_config, max_positions=max(max_len, 1))
    model.to_empty(device=device)
    with torch.device(device):
        model.rope = RotaryEmbedding(model_config, max(max_len, 1))  # the one buffer computed, not loaded
    if named is None:
        init_dummy_weights(model, config.seed)
    else:
        load_weights(model, named)
    model.eval().requires_grad_(False)
    return model, model_config
