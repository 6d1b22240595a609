"""Model definitions (the Llama architecture, which also runs Qwen2: Llama with q/k/v biases)."""

from engine.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
