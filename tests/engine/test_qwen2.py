"""Qwen2 (Llama with q/k/v biases): its GGUF and HF loading, the loader's errors, and parity with
transformers - tiny random models, then the real Qwen2.5-Coder-0.5B GGUF."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, EngineConfig, LoadedModel, SamplingParams, build_engine
from engine.bench.correctness import prompt_logits
from engine.config import ConfigError
from engine.loader import GGUF_LAYER_NAMES, GGUF_NAMES, load_model
from tests.engine.helpers import hf_model_from_gguf

CPU = torch.device("cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def write_gguf(path: Path, arch: str, config: dict, tensors: dict[str, np.ndarray],
               raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
               tokens: list[tuple[str, gguf.TokenType]] | None = None, eos: int | None = None) -> Path:
    """A GGUF file of ``arch`` with the ``<arch>.*`` hyperparameters of a HF-style ``config``,
    float32 ``tensors`` (GGUF names, numpy shapes) and ``raw`` blocks of a given type."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    if tokens is not None:
        w.add_token_list([t for t, _ in tokens])
        w.add_token_types([int(k) for _, k in tokens])
    if eos is not None:
        w.add_eos_token_id(eos)
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    for name, (blocks, qtype) in (raw or {}).items():
        w.add_tensor(name, blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_tensors_of(hf_dir: Path) -> dict[str, np.ndarray]:
    """A HF checkpoint's tensors under their GGUF names, as llama.cpp writes a qwen2 file (Q/K rows
    as they are: only llama files get them interleaved)."""
    from safetensors.numpy import load_file

    hf_to_gguf = {v: k for k, v in GGUF_NAMES.items()}
    layer_names = {v: k for k, v in GGUF_LAYER_NAMES.items()}
    out = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name in hf_to_gguf:
            out[hf_to_gguf[name]] = t
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
            out[f"blk.{m[1]}.{layer_names[m[2]]}.{m[3]}"] = t
    return out


TINY_CONFIG = dict(vocab_size=301, hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
                   num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6)


# ---- tiny random models ----------------------------------------------------------------------
def test_tiny_qwen2_gguf_loads_like_its_hf_checkpoint(tiny_qwen2_dir, tmp_path):
    """The same random weights as a qwen2 GGUF (biases, a separate output.weight, Q/K rows not
    interleaved) and as HF safetensors: equal logits; the GGUF's hyperparameters come from its
    qwen2.* keys, and its stop ids are its EOS plus its other end-of-turn control tokens."""
    tokens = [(f"t{i}", gguf.TokenType.NORMAL) for i in range(301)]
    tokens[7] = ("<|endoftext|>", gguf.TokenType.CONTROL)
    tokens[9] = ("<|im_end|>", gguf.TokenType.CONTROL)
    tokens[11] = ("<|eot_id|>", gguf.TokenType.NORMAL)  # the text, but not a control token: no stop
    path = write_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", TINY_CONFIG, gguf_tensors_of(tiny_qwen2_dir), tokens=tokens, eos=9)
    model, config = load_model(EngineConfig(model=str(path)), CPU, torch.float32)
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == ("qwen2", True, False)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (1e6, pytest.approx(1e-6), 512)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.num_hidden_layers) == (6, 2, 12, 3)
    assert config.eos_token_ids == (9, 7)
    assert model.layers[0].self_attn.qkv_proj.bias.abs().min() > 0  # q|k|v biases all loaded

    gguf_config = EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=8, num_kv_blocks=64)
    from_gguf = build_engine(gguf_config, LoadedModel(model, config, None, CPU, torch.float32))  # no tokenizer in the file
    from_hf = build_engine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", device="cpu", block_size=8, num_kv_blocks=64))
    assert from_hf.model_config.architecture == "qwen2" and from_hf.model_config.attention_bias
    ids = torch.randint(0, 301, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    assert rel_err(prompt_logits(from_gguf, ids), prompt_logits(from_hf, ids)) < 1e-6


def test_the_hf_reference_of_a_qwen2_model_is_transformers_qwen2(tiny_qwen2_dir):
    """engine.bench.hf_reference rebuilds a Qwen2ForCausalLM (biases split back out of q|k|v)
    equal to the checkpoint's own."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    from engine.bench.hf_reference import build_hf_model

    model, _ = load_model(EngineConfig(model=str(tiny_qwen2_dir)), CPU, torch.float32)
    ours = build_hf_model(model)
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    assert isinstance(ours, Qwen2ForCausalLM)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.no_grad():
        assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-6


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "tiny-gemma.gguf", "gemma", TINY_CONFIG, {"output_norm.weight": np.ones(72)})
    with pytest.raises(ConfigError, match=r"tiny-gemma\.gguf: GGUF architecture 'gemma' is not supported \(supported: llama, qwen2\)"):
        load_model(EngineConfig(model=str(path)), CPU, torch.float32)


def test_a_tensor_type_gguf_cannot_dequantize_names_file_tensor_and_type(tmp_path):
    config = {**TINY_CONFIG, "hidden_size": 64}
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    q8_1 = np.zeros((301, 64 // block * size), dtype=np.uint8)
    path = write_gguf(tmp_path / "tiny-q8_1.gguf", "qwen2", config, {}, raw={"token_embd.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(ConfigError, match=r"tiny-q8_1\.gguf: tensor 'token_embd\.weight' has type Q8_1, which the gguf package cannot dequantize"):
        load_model(EngineConfig(model=str(path)), CPU, torch.float32)


def test_an_hf_checkpoint_of_another_model_type_is_refused(tiny_qwen2_dir, tmp_path):
    import json
    import shutil

    other = Path(shutil.copytree(tiny_qwen2_dir, tmp_path / "mixtral"))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"mixtral: model_type 'mixtral' .* is not supported; the engine runs llama, qwen2"):
        load_model(EngineConfig(model=str(other)), CPU, torch.float32)


# ---- the real Qwen2.5-Coder-0.5B GGUF --------------------------------------------------------
QUESTION = [{"role": "user", "content": "Write a Python function that returns the sum of a list of numbers."}]


def test_qwen_gguf_config_tokenizer_and_chat_template(qwen_fp32):
    cfg = qwen_fp32.model_config
    assert (cfg.architecture, cfg.attention_bias, cfg.tie_word_embeddings) == ("qwen2", True, False)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (24, 896, 14, 2)
    assert (cfg.rope_theta, cfg.max_position_embeddings, cfg.vocab_size) == (1e6, 32768, 151936)
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    assert set(cfg.eos_token_ids) == {151645, 151643}
    tok = qwen_fp32.tokenizer
    assert tok.encode("<|im_end|>") == [151645] and tok.encode("<|endoftext|>") == [151643]
    assert tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    text = "def add(a, b):\n    return a + b  # Grüße"
    assert tok.decode(tok.encode(text)) == text


def test_qwen_greedy_tokens_and_logprobs_match_transformers_from_the_same_gguf(qwen_fp32, qwen_0_5b_gguf):
    """Two loaders of one GGUF - ours (gguf's dequantize, biases into q|k|v, no Q/K un-permute)
    and transformers' gguf_file path - agree on 16 greedy tokens (each of ours is transformers'
    argmax given the ones before: one forward of transformers instead of 16 steps) with log-probs
    within 1e-3; and <|im_end|> ends a generation."""
    llm = LLM(str(qwen_0_5b_gguf), loaded=qwen_fp32, num_kv_blocks=64)
    prompt = qwen_fp32.tokenizer.apply_chat_template(QUESTION)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 16
    hf = hf_model_from_gguf(qwen_0_5b_gguf)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1)
    del hf
    assert ref.argmax(-1).tolist() == out.token_ids
    ours = [next(iter(entry.values())) for entry in out.logprobs]
    assert ours == pytest.approx(ref[torch.arange(16), out.token_ids].tolist(), abs=1e-3)

    short = qwen_fp32.tokenizer.apply_chat_template([{"role": "user", "content": "Answer with one word: is 7 a prime number?"}])
    answer = llm.generate([short], SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert answer.finish_reason == "stop" and len(answer.token_ids) < 24 and "yes" in answer.text.lower()
