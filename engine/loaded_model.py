"""Weights and tokenizer loaded once, on a resolved device and dtype; engines are built on them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.loader import has_tokenizer, load_model, model_kind
from engine.model import LlamaForCausalLM
from engine.gguf_blocks import BlockCache
from engine.native_decode import NativeWeights
from engine.fp8 import fp8_supported, quantize_lm_head_fp8, quantize_model_fp8
from engine.w4a16 import W4A16Linear, quantize_lm_head_int4, quantize_model_int4, quantize_model_int4_from_gguf
from engine.quantization import gguf_tensors, quantize_from_gguf
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else the CPU; a CUDA device that is not there is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return device


def device_label(device: torch.device) -> str:
    """The device as an error message names it: the GPU's name and compute capability, or "the CPU"."""
    if device.type != "cuda":
        return "the CPU"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def check_fp8_hardware(device: torch.device, setting: str = "quantization") -> None:
    """Refuse FP8 weights on a CUDA GPU without FP8 tensor cores; the CPU emulates them (slowly).
    ``setting``: the EngineConfig field that asked for them, named in the error."""
    if device.type == "cuda" and not fp8_supported(device):
        raise ConfigError(f"{setting}='fp8' needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or later: "
                          f"Ada, Hopper); this engine runs on {device_label(device)}. Use {setting}='none' or 'int4'")


def quantize_lm_head(model: torch.nn.Module, fmt: str) -> None:
    """``model``'s head in ``fmt`` (EngineConfig.lm_head_quantization: "fp8" or "int4"), an int4 one
    on CUDA also laid out for tinygemm and the pairs GEMV (the batch-1 GEMVs)."""
    try:
        if fmt == "fp8":
            quantize_lm_head_fp8(model)
        else:
            quantize_lm_head_int4(model)
    except ValueError as e:
        raise ConfigError(f"lm_head_quantization={fmt!r}: {e}") from e
    if next(model.lm_head.parameters()).is_cuda:
        if fmt == "int4":
            model.lm_head.add_tinygemm()
            model.lm_head.add_pairs()
        torch.cuda.empty_cache()  # an untied head's bf16 weight


def resolve_dtype(name: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    """``auto``: bfloat16 on CUDA or with int4 weights, else float32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or quantization != "none" else torch.float32
    return getattr(torch, name)


@dataclass
class LoadedModel:
    """Weights and tokenizer, loaded once; several engines (e.g. benchmark variants) may share it."""

    model: LlamaForCausalLM
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    native_weights: NativeWeights | None = None  # int4 on the CPU: the GGUF's blocks for engine/native_decode.py

    @classmethod
    def load(cls, config: EngineConfig, tokenizer: Tokenizer | None = None) -> "LoadedModel":
        """The model ``config`` names, on its device; ``tokenizer``: the config's own when the caller
        has loaded it already (build_engine compares a draft's with the target's before any weights)."""
        config.validate()
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device, config.quantization if config.quantization != "none" else config.lm_head_quantization)
        cpu_int4 = config.quantization == "int4" and device.type == "cpu"  # the GGUF's own blocks; on CUDA: W4A16 at load
        if cpu_int4 and model_kind(config) != "gguf":
            raise ConfigError(f"quantization='int4' on the CPU runs a GGUF's own 4-bit blocks: got {model_kind(config)} weights "
                              "(on a CUDA GPU any weights are quantized at load)")
        if cpu_int4 and config.lm_head_quantization != "none":
            raise ConfigError(f"lm_head_quantization={config.lm_head_quantization!r}: quantization='int4' on the CPU already runs the "
                              "GGUF's own head as int4; leave lm_head_quantization 'none' there")
        for setting in ("quantization", "lm_head_quantization"):
            if getattr(config, setting) == "fp8":
                check_fp8_hardware(device, setting)
                if device.type == "cpu":
                    log.warning(f"{setting}='fp8' on the CPU emulates the GPU's FP8 arithmetic (weights and each token's activations "
                                "rounded to e4m3, products in float32): it shows what FP8 costs in answers, and is slower than 'none'")
        # int4: each matrix is repacked once, for its dense copy, its int4 parts and the native step's copy
        blocks = BlockCache(gguf_tensors(config.model)) if cpu_int4 else None
        model, model_config = load_model(config, device, dtype, blocks)
        if config.quantization == "fp8":
            try:
                quantize_model_fp8(model)
            except ValueError as e:
                raise ConfigError(f"quantization='fp8': {e}") from e
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the bf16 weights' blocks, freed layer by layer
        elif config.quantization == "int4" and device.type == "cuda":
            try:
                if model_kind(config) == "gguf":  # the file's own 4-bit groups, no second rounding
                    replaced, kept = quantize_model_int4_from_gguf(model, BlockCache(gguf_tensors(config.model)))
                    log.info("int4: %d layer projections from the GGUF's 4-bit groups, %d with wider types kept bf16", replaced, kept)
                else:
                    quantize_model_int4(model)
            except ValueError as e:
                raise ConfigError(f"quantization='int4': {e}") from e
            int4 = [m for m in model.modules() if isinstance(m, W4A16Linear)]
            # batch-1 decode runs PyTorch's kernel or the pairs GEMV (GemvPolicy.int4_kernel), each on its own layout
            laid_out = sum(m.add_tinygemm() for m in int4)
            paired = sum(m.add_pairs() for m in int4)
            log.info("int4: of %d projections, %d also laid out for aten._weight_int4pack_mm, %d for the pairs GEMV",
                     len(int4), laid_out, paired)
            torch.cuda.empty_cache()
        if config.lm_head_quantization != "none":
            quantize_lm_head(model, config.lm_head_quantization)
        native = None
        if blocks is not None:
            try:
                quantize_from_gguf(model, blocks)
            except ValueError as e:
                raise ConfigError(f"quantization='int4': {e}") from e
            if config.native_decode_step != "off":
                native = NativeWeights.from_gguf(blocks, model_config)
        if tokenizer is None and (config.tokenizer or has_tokenizer(config)):
            tokenizer = Tokenizer.load(config.tokenizer or config.model, config.cache_dir)
        if tokenizer is not None and config.load_format == "dummy" and tokenizer.vocab_size < model_config.vocab_size:
            # Random weights sample every id of the model's vocabulary: give the ones the
            # borrowed tokenizer lacks a text, so each streamed token is seen by clients.
            tokenizer.pad_vocab(model_config.vocab_size)
        return cls(model, model_config, tokenizer, device, dtype, native)

    def ensure_native_weights(self, config: EngineConfig) -> NativeWeights:
        """The GGUF's blocks for the native CPU step, read now if this model was loaded with
        ``native_decode_step="off"`` (kept: engines built on it later share the copy)."""
        if self.native_weights is None:
            self.native_weights = NativeWeights.from_gguf(BlockCache(gguf_tensors(config.model)), self.model_config)
        return self.native_weights
