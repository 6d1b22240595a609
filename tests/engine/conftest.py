"""Engine fixtures: the embedded SmolLM2 loaded once, and tiny random Llamas (and a Qwen2) in HF format."""

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


def save_tiny_llama(path: Path, seed: int, architecture: str = "llama", **overrides) -> Path:
    """A random HF LlamaForCausalLM (or ``architecture="qwen2"``: Qwen2ForCausalLM, q/k/v with
    biases) with odd sizes and GQA, saved as safetensors."""
    import transformers

    from engine.config import ARCHITECTURES

    torch.manual_seed(seed)
    model_class = getattr(transformers, ARCHITECTURES[architecture])
    model = model_class(model_class.config_class(**{**TINY, **overrides})).float()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; perturb them so a wrong one is visible
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
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
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2: Llama with q/k/v biases (random, not HF's zeros), rope base 1e6, eps 1e-6."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-qwen2"), seed=2, architecture="qwen2", rope_theta=1e6, rms_norm_eps=1e-6)


@pytest.fixture(scope="session")
def smollm(llm_gguf_path) -> LoadedModel:
    return LoadedModel.load(EngineConfig(model=str(llm_gguf_path)))


# A prompt that a quoting answer repeats: the n-gram proposer finds the answer's words in it.
QUOTE = ("Annual leave: every employee gets 20 days of paid annual leave a year. Request it in PeopleHub with form "
         "HR-01 at least 10 working days before the first day, and your manager approves it.")


@pytest.fixture(scope="session")
def quoting_prompts(smollm) -> list[list[int]]:
    """Two questions after a quoted text (answers that repeat it) and one that quotes nothing, as
    SmolLM2 chat prompts: the speculative decoding tests' inputs."""
    ask = [f"{QUOTE}\n\nRepeat the text above word for word.", f"{QUOTE}\n\nHow many days of annual leave do I get?",
           "Count from one to twenty in words, separated by commas."]
    return [smollm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in ask]


@pytest.fixture(scope="package")
def smollm_hf(smollm):
    """HF transformers' model holding SmolLM2's float32 weights (engine.bench.hf_reference), the
    reference of test_model_parity.py, test_native_decode.py and test_quantization.py, built once
    and only read (eval, no grad); freed after the engine tests."""
    from engine.bench.hf_reference import build_hf_model

    return build_hf_model(smollm.model)


@pytest.fixture(scope="package")
def smollm_int4(llm_gguf_path) -> LoadedModel:
    """SmolLM2 with its GGUF blocks repacked as int4, loaded once for the engine tests that use it
    (test_quantization.py, test_native_decode.py); freed after the engine tests."""
    return LoadedModel.load(EngineConfig(model=str(llm_gguf_path), quantization="int4"))


@pytest.fixture(scope="package")
def qwen_fp32(qwen_0_5b_gguf) -> LoadedModel:
    """Qwen2.5-Coder-0.5B dense in float32 on the CPU (every tensor dequantized) and its converted
    tokenizer, loaded once for test_qwen2.py and test_native_decode.py; freed after the engine tests."""
    return LoadedModel.load(EngineConfig(model=str(qwen_0_5b_gguf), dtype="float32", device="cpu", max_model_len=2048))
