"""Engine fixtures: the embedded SmolLM2 loaded once, and tiny random Llamas in HF format."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LoadedModel

# On the CPU the Triton kernels run in Triton's interpreter, which has to be on before triton is
# first imported and then holds for the whole process. So there the kernel tests run in a pytest
# of their own (test_triton_interpreter.py), and in this session the kernels stay compiled: a CPU
# code path that wrongly launches one fails here instead of silently running interpreted.
collect_ignore = [] if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" else ["test_triton_kernels.py"]
# CUDA graph capture needs a GPU; the runners' layout logic has CPU tests (test_greedy_invariance.py).
if not torch.cuda.is_available():
    collect_ignore.append("test_cuda_graphs.py")

TINY = dict(
    vocab_size=301, hidden_size=72, intermediate_size=100, num_hidden_layers=3,
    num_attention_heads=6, num_key_value_heads=2, head_dim=12, max_position_embeddings=512,
    rms_norm_eps=1e-5, rope_theta=10000.0,
)


def save_tiny_llama(path: Path, seed: int, **overrides) -> Path:
    """A random HF LlamaForCausalLM with odd sizes and GQA, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # HF inits norms to 1; perturb them so a wrong norm weight is visible
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_llama3_tied_dir(tmp_path_factory) -> Path:
    """Tied embeddings and Llama-3.1 rope scaling."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama3"), seed=1, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )


@pytest.fixture(scope="session")
def smollm(llm_gguf_path) -> LoadedModel:
    return LoadedModel.load(EngineConfig(model=str(llm_gguf_path)))
