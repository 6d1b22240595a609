"""The engine's Llama (and Qwen2) matches transformers: logits of random tiny models, the GGUF loader, greedy text."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, build_engine
from engine.bench.correctness import prompt_logits
from engine.model.rope import inverse_frequencies
from tests.engine.helpers import hf_model_from_gguf


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_tied_dir", "tiny_qwen2_dir"])
def test_tiny_llama_logits_match_transformers(fixture, request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(fixture)
    core = build_engine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=8, num_kv_blocks=64))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    for length in (1, 9, 37, 100):  # odd lengths, partial last blocks
        ids = torch.randint(0, 301, (length,), generator=gen).tolist()
        ours = prompt_logits(core, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert rel_err(ours, ref) < 1e-4, length


def test_llama3_rope_scaling_matches_transformers():
    """Our Llama-3.1 frequency scaling against transformers' own implementation."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.config import ModelConfig

    raw = ModelConfig.from_json("engine/configs/llama-3.1-8b.json").to_hf_dict()
    ours = inverse_frequencies(ModelConfig.from_hf_dict(raw))
    hf_config = LlamaConfig(**raw)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    assert torch.allclose(ours.float(), ref.float(), rtol=1e-6, atol=0)
    # scaling must actually change the low frequencies
    plain = inverse_frequencies(ModelConfig.from_hf_dict({**raw, "rope_scaling": None}))
    assert not torch.allclose(ours, plain)


def test_gguf_loader_matches_transformers_gguf_loading(llm_gguf_path, smollm):
    """Same file, two loaders: ours (dequantize + un-permute Q/K) and transformers' gguf_file path."""
    hf = hf_model_from_gguf(llm_gguf_path)
    core = build_engine(EngineConfig(model=str(llm_gguf_path), num_kv_blocks=32), loaded=smollm)
    ids = smollm.tokenizer.encode("Employees receive 20 days of paid annual leave per year.")
    ours = prompt_logits(core, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(ours, ref) < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm_greedy_matches_transformers_generate(smollm, smollm_hf, llm_gguf_path):
    llm = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=256)
    hf = smollm_hf
    questions = ["What is the capital of France?", "Write a short poem about the sea.", "How do I apply for annual leave?"]
    prompts = [smollm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        assert result.token_ids == ref
    assert "Paris" in results[0].text
