"""Model definitions (Llama architecture)."""

from engine.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
