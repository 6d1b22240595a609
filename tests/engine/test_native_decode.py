"""The native CPU decode step (engine/native_decode.py): the real C kernel, built by the test run,
on the embedded SmolLM2 GGUF's real blocks, checked against HF transformers in float32 on the
dequantized weights, against its own portable (AVX2-only, scalar) builds, and inside the engine."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

from engine import LLM, EngineConfig, LoadedModel
from engine.config import ConfigError
from engine.native_decode import (NATIVE_MAX_TOKENS, NATIVE_MAX_TOKENS_BF16, NativeDecodeError, NativeDecodeStep, build_library,
                                  native_max_tokens)
from engine.execution_path import ExecutionPath
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def native_llm(smollm_int4, llm_gguf_path) -> LLM:
    return LLM(str(llm_gguf_path), quantization="int4", native_decode_step="on", max_model_len=512, num_kv_blocks=96,
               loaded=smollm_int4)


@pytest.fixture(scope="module")
def hf_fp32(smollm_hf):
    return smollm_hf


def feed(kernel: NativeDecodeStep, rows: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Run prompts through the kernel one position per call ("prefill by decode"), all rows in
    one batch per call; returns the last call's logits [rows, vocab]. Each row: (tokens, blocks)."""
    n = len(rows[0][0])
    assert all(len(t) == n for t, _ in rows)
    tables = torch.tensor([blocks for _, blocks in rows])
    for pos in range(n):
        logits = kernel.run(torch.tensor([t[pos] for t, _ in rows]), torch.tensor([pos] * len(rows)), tables)
    return logits


def prompt_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def float32_logits(hf_fp32, ids: list[int]) -> torch.Tensor:
    """Float32 HF's next-token logits after ``ids``."""
    with torch.inference_mode():
        return hf_fp32(torch.tensor([ids])).logits[0, -1].float()


def kl_from_float32(ref: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(float32 HF || ours) of the next-token distribution, from float32's logits ``ref``."""
    p = torch.log_softmax(ref, -1)
    return float((p.exp() * (p - torch.log_softmax(logits, -1))).sum())


def assert_float32_ranks_first(hf_fp32, prompt: list[int], tokens: list[int], nats: float = 0.5) -> None:
    """Every greedy token is float32 HF's top choice or within ``nats`` of it (a near tie that
    quantization may flip); garbage from a wrong kernel or KV layout is many nats off."""
    with torch.inference_mode():
        logp = torch.log_softmax(hf_fp32(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float(), -1)
    gap = logp.max(-1).values - logp[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert gap.max() < nats, f"token {int(gap.argmax())} is {gap.max():.2f} nats below float32's choice"


def test_logits_match_float32_transformers(native_llm, hf_fp32):
    """Prompt fed token by token through scattered KV blocks; the last position's logits against
    HF's float32 forward of the dequantized file: same top token, close distribution."""
    kernel = native_llm.core.runner.native
    ids = prompt_ids(native_llm, "How many days of annual leave do employees get?")
    blocks = [7, 3, 12, 5, 40, 2]  # not in order, not consecutive: the block table is followed
    assert len(ids) <= 16 * len(blocks)
    ours = feed(kernel, [(ids, blocks)])[0]
    ref = float32_logits(hf_fp32, ids)
    assert ours.argmax() == ref.argmax()
    kl = kl_from_float32(ref, ours)
    assert kl < 0.05, f"KL(float32 || native) = {kl:.4f}"


def test_long_context_chunks_merge(native_llm, hf_fp32):
    """Past 256 context tokens attention runs as several chunks merged by log-sum-exp: a ~600-token
    prompt still gives float32's top token and distribution."""
    kernel = native_llm.core.runner.native
    text = " ".join(f"Rule {i}: employees file form {i * 7} before day {i + 3}." for i in range(32))
    ids = prompt_ids(native_llm, text + " Which form comes before day 10?")
    assert 512 < len(ids) <= 16 * 50  # three chunks
    ours = feed(kernel, [(ids, list(range(41, 91)))])[0]
    ref = float32_logits(hf_fp32, ids)
    assert ours.argmax() == ref.argmax()
    assert kl_from_float32(ref, ours) < 0.05


def test_batch_rows_are_independent(native_llm):
    """Rows of one call, at different positions and chunk counts, give exactly what each gives alone."""
    kernel = native_llm.core.runner.native
    a = prompt_ids(native_llm, "Where is the office? " * 50)  # > 256 tokens: two attention chunks
    b = prompt_ids(native_llm, "年假怎么申请？")
    ta, tb = list(range(41, 61)), [30, 31, 32]
    feed(kernel, [(a[:-1], ta)])
    feed(kernel, [(b[:-1], tb)])
    run = lambda rows: kernel.run(torch.tensor([t[-1] for t, _ in rows]), torch.tensor([len(t) - 1 for t, _ in rows]),  # noqa: E731
                                  torch.tensor([blocks + [0] * (20 - len(blocks)) for _, blocks in rows]))
    together = run([(a, ta), (b, tb)])
    alone = torch.cat([run([(a, ta)]), run([(b, tb)])])
    assert len(a) > 256
    torch.testing.assert_close(together, alone, rtol=0, atol=0)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the SIMD variants are x86 builds")
def test_portable_builds(native_llm, smollm_int4, hf_fp32, tmp_path):
    """AVX2 without VNNI computes the 256-bit VNNI tile's integer sums in the same order: the same
    logits. The AVX-512 tile (two blocks a register, where the CPU has it) and the scalar build sum
    floats in other orders, which 30 layers of int8/bf16 rounding amplify to different but equally
    good logits: same top token, as close to float32."""
    kernel = native_llm.core.runner.native
    ids = prompt_ids(native_llm, "What is the dress code?")
    reference = float32_logits(hf_fp32, ids)
    builds = {kernel.simd: feed(kernel, [(ids, [50, 51, 52])])}
    for march, wide in (("native", False), ("haswell", True), ("x86-64", True)):
        other = NativeDecodeStep(build_library(tmp_path, march=march, wide=wide), smollm_int4.model, smollm_int4.native_weights,
                                 native_llm.core.kv_cache.storage, 16)
        builds[other.simd] = feed(other, [(ids, [50, 51, 52])])
    assert {"AVX2", "scalar"} <= set(builds)
    if "AVX-VNNI" in builds:  # the CPU has VNNI: dpbusd and AVX2's two-step emulation give the same sums
        torch.testing.assert_close(builds["AVX2"], builds["AVX-VNNI"], rtol=1e-6, atol=1e-6)
    for name, logits in builds.items():
        assert logits.argmax() == builds["AVX2"].argmax(), name
        assert kl_from_float32(reference, logits[0]) < 0.05, name


def test_engine_decodes_natively_and_answers_like_float32(native_llm, hf_fp32):
    """Through the engine: small decode-only batches run natively and every greedy token is one
    float32 HF also ranks (near) first."""
    params = SamplingParams(temperature=0, max_tokens=10)
    prompts = [prompt_ids(native_llm, q) for q in ("What is the capital of France? Answer in one word.", "Name a primary colour.")]
    core = native_llm.core
    core.step_times.native_steps = 0
    ours = native_llm.generate(prompts, params)
    assert core.step_times.native_steps >= 9
    assert "Paris" in ours[0].text
    for prompt, out in zip(prompts, ours):
        assert_float32_ranks_first(hf_fp32, prompt, out.token_ids)


def test_a_batch_of_ten_decodes_natively_with_the_tokens_of_each_alone(native_llm, hf_fp32):
    """Ten decodes at once (past the 8 the native step once stopped at, above which the PyTorch
    path ran) are native steps of ten rows: the same greedy tokens as each request decoded alone,
    each one float32 HF also ranks (near) first. (Against the PyTorch path itself a near tie may
    flip: int8 against bf16 activations. So may the prefill: ten prompts prefilled at once are one
    bf16 matmul of all their rows, whose oneDNN blocking, and so its rounding, depends on the row
    count; an answer may then part from its alone twin, but only at a float32 near tie.)"""
    core = native_llm.core
    questions = ("What is the capital of France?", "Name a primary colour.", "How many legs does a spider have?",
                 "What is two plus two?", "Which planet is closest to the sun?", "What colour is the sky?",
                 "How many days are in a week?", "What do bees make?", "What is frozen water called?",
                 "Which animal says moo?")
    preface = "Answer the question below briefly, in plain words, as a friendly assistant would, without any lists. " * 2
    prompts = [prompt_ids(native_llm, preface + q) for q in questions]
    assert min(map(len, prompts)) > NATIVE_MAX_TOKENS  # alone or together, each prefills through PyTorch
    steps: list[tuple[ExecutionPath, int]] = []
    prepare = core.runner.prepare

    def spy(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        steps.append((inputs.path, len(inputs.chunks)))
        return inputs

    def answers(batch: list[list[int]]) -> list[list[int]]:
        core.block_manager.reset_prefix_cache()
        reqs = [core.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in batch]
        while core.has_unfinished_requests():
            core.step()
        return [r.output_token_ids for r in reqs]

    core.runner.prepare = spy
    try:
        together = answers(prompts)
    finally:
        core.runner.prepare = prepare
    assert sum(1 for path, n in steps if path is ExecutionPath.NATIVE and n == 10) >= 5
    alone = [answers([p])[0] for p in prompts]
    assert sum(a == b for a, b in zip(together, alone)) >= 8
    for prompt, tokens, twin in zip(prompts, together, alone):
        assert_float32_ranks_first(hf_fp32, prompt, tokens)
        if tokens != twin:  # they part at a near tie: both choices within 0.5 nats of float32's first
            at = next(i for i, (a, b) in enumerate(zip(tokens, twin)) if a != b)
            assert_float32_ranks_first(hf_fp32, prompt, twin[: at + 1])
    assert native_llm.stats().kv_blocks_free == native_llm.stats().kv_blocks_total


def test_native_kv_serves_a_later_prefix_hit(native_llm, hf_fp32):
    """K/V written by native decode steps is read by a later request's PyTorch prefill (more than
    NATIVE_MAX_TOKENS new tokens): the follow-up reuses the first answer's blocks and still
    answers as float32 would."""
    first = prompt_ids(native_llm, "Tell me about annual leave.")
    reply = native_llm.generate([first], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    question = prompt_ids(native_llm, "And sick leave? " + "Please explain who approves it, how many days there are and what the form is called. " * 2)[1:]
    assert len(question) > NATIVE_MAX_TOKENS
    follow = first + reply.token_ids + question
    second = native_llm.generate([follow], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert second.num_cached_tokens >= len(first) + 16  # blocks the native steps filled were reused
    assert_float32_ranks_first(hf_fp32, follow, second.token_ids)


def test_a_short_prefill_runs_natively(native_llm):
    """A prompt of at most the native step's ``max_tokens`` (a question after a cached prefix)
    prefills in one native call, one row per token: its first token is what the native step gives
    fed token by token. Above it (16 tokens where the CPU has bf16 matmuls) the PyTorch path runs it."""
    core = native_llm.core
    ids = prompt_ids(native_llm, "How many days of annual leave do employees get?")
    assert NATIVE_MAX_TOKENS_BF16 < len(ids) <= NATIVE_MAX_TOKENS
    steps: list[ExecutionPath] = []
    prepare, limit = core.runner.prepare, core.runner.native.max_tokens

    def spy(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        steps.append(inputs.path)
        return inputs

    core.runner.prepare = spy
    try:
        for core.runner.native.max_tokens in (NATIVE_MAX_TOKENS_BF16, NATIVE_MAX_TOKENS):  # as with bf16 matmuls, then without
            core.block_manager.reset_prefix_cache()
            out = native_llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    finally:
        core.runner.prepare, core.runner.native.max_tokens = prepare, limit
    assert steps == [ExecutionPath.EAGER, ExecutionPath.NATIVE]  # above the bf16 CPUs' limit the PyTorch path takes it
    assert out.token_ids[0] == int(feed(core.runner.native, [(ids, [60, 61, 62, 63])])[0].argmax())


def test_bad_calls_raise_clear_errors(native_llm, llm_gguf_path, monkeypatch, tmp_path, smollm_int4, caplog):
    kernel = native_llm.core.runner.native
    with pytest.raises(NativeDecodeError, match="at least one request"):
        kernel.run(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long))
    for ids, pos, blocks in (([kernel.vocab], [0], [[1, 2]]), ([1], [40], [[1, 2]]), ([1], [20], [[1, 10**6]])):
        with pytest.raises(NativeDecodeError, match="out of range"):  # token id; position past the table; block id
            kernel.run(torch.tensor(ids), torch.tensor(pos), torch.tensor(blocks))
    with pytest.raises(ConfigError, match="needs quantization='int4'"):
        EngineConfig(model=str(llm_gguf_path), native_decode_step="on").validate()
    with pytest.raises(ConfigError, match="auto/on/off"):
        EngineConfig(model=str(llm_gguf_path), native_decode_step="yes").validate()
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(NativeDecodeError, match="no C compiler 'no-such-compiler'"):
        build_library(tmp_path)
    with pytest.raises(ConfigError, match="native_decode_step='on': no C compiler"):
        LLM(str(llm_gguf_path), quantization="int4", native_decode_step="on", cache_dir=tmp_path, loaded=smollm_int4)
    with caplog.at_level(logging.WARNING, logger="engine.engine_core"):  # auto: warn, decode through PyTorch
        fallback = LLM(str(llm_gguf_path), quantization="int4", cache_dir=tmp_path, max_model_len=256, loaded=smollm_int4)
    assert fallback.core.runner.native is None and "decoding through PyTorch" in caplog.text
    out = fallback.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert len(out.token_ids) == 2


def mixed_format_qwen2():
    """A small random Qwen2 (q|k|v biases) whose fused outputs mix formats as Qwen2.5-1.5B's
    repacked ones do (q, k Q4_1 and v Q8_0; gate Q8_0 and up Q4_1; a Q8_0 head), and its native
    step over an 8-block cache. Returns (kernel, the model on the dequantized weights)."""
    import gguf

    from engine.config import ModelConfig, default_cache_dir
    from engine.gguf_blocks import q4_1_blocks, q8_0_blocks
    from engine.model import LlamaForCausalLM
    from engine.native_decode import BlockMatrix, NativeLayer, NativeWeights

    Q = gguf.GGMLQuantizationType
    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64,
                      architecture="qwen2", attention_bias=True, name="tiny-qwen2")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, max_positions=64).float().eval().requires_grad_(False)

    def quantized(w: torch.Tensor, fmt) -> BlockMatrix:
        """Random weights quantized to ``fmt``; the model keeps the dequantized values."""
        w.copy_(torch.randn_like(w) / w.shape[1] ** 0.5)
        raw = gguf.quants.quantize(w.numpy(), fmt)
        blocks = (q4_1_blocks if fmt == Q.Q4_1 else q8_0_blocks)(raw, *w.shape)
        w.copy_(torch.from_numpy(blocks.dequantize()))
        return BlockMatrix.from_blocks(blocks)

    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    model.embed_tokens.weight.copy_(torch.randn(cfg.vocab_size, cfg.hidden_size).bfloat16().float())  # the C step reads it as bf16
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w, gate_up_w = attn.qkv_proj.weight, mlp.gate_up_proj.weight
        attn.qkv_proj.bias.copy_(torch.randn(q + 2 * kv))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))
        layers.append(NativeLayer([quantized(qkv_w[:q], Q.Q4_1), quantized(qkv_w[q : q + kv], Q.Q4_1), quantized(qkv_w[q + kv :], Q.Q8_0)],
                                  attn.qkv_proj.bias.numpy().copy(), quantized(attn.o_proj.weight, Q.Q8_0),
                                  [quantized(gate_up_w[:inter], Q.Q8_0), quantized(gate_up_w[inter:], Q.Q4_1)],
                                  quantized(mlp.down_proj.weight, Q.Q4_1)))
    weights = NativeWeights(layers, quantized(model.lm_head.weight, Q.Q8_0))
    kv_cache = torch.zeros(cfg.num_hidden_layers, 2, 8, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
    return NativeDecodeStep(build_library(default_cache_dir()), model, weights, kv_cache, 16), model


def test_mixed_formats_and_biases_match_float32():
    """The mixed-format Qwen2 fed token by token against HF float32 on the same (dequantized) weights."""
    from engine.bench.hf_reference import build_hf_model

    kernel, model = mixed_format_qwen2()
    ids = torch.randint(0, model.config.vocab_size, (40,)).tolist()
    ours = feed(kernel, [(ids, [5, 2, 7])])[0]
    hf = build_hf_model(model)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
    assert ours.argmax() == ref.argmax()
    kl = float((ref.exp() * (ref - torch.log_softmax(ours, -1))).sum())
    assert kl < 0.01, f"KL(float32 || native) = {kl:.4f}"


def one_call_and_one_by_one(kernel: NativeDecodeStep, ids: list[int], start: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ``ids`` at positions start.. as one step of len(ids) rows (tokens tiled in the
    matrices, rows sharing each K/V chunk in attention), and as one one-row step per token."""
    tables = torch.tensor([blocks] * len(ids))
    pos = torch.arange(start, start + len(ids))
    together = kernel.run(torch.tensor(ids), pos, tables)
    alone = torch.cat([kernel.run(torch.tensor(ids[i : i + 1]), pos[i : i + 1], tables[:1]) for i in range(len(ids))])
    return together, alone


@pytest.mark.parametrize("tokens", [8, 11, 21])
def test_a_tiled_step_equals_its_tokens_one_by_one(tokens):
    """A prefill step of T tokens (T a multiple of the 8-token tile or not; Q4_1 and Q8_0
    matrices, fused of both) gives each token the logits it gets as a one-token step, and the
    per-row kernel (the benchmark's baseline) the same top tokens and logits up to rounding."""
    kernel, model = mixed_format_qwen2()
    ids = torch.randint(0, model.config.vocab_size, (7 + tokens,)).tolist()
    blocks = [5, 2, 7, 0]
    feed(kernel, [(ids[:7], blocks)])  # a cached prefix
    together, alone = one_call_and_one_by_one(kernel, ids[7:], 7, blocks)
    torch.testing.assert_close(together, alone)
    per_row = kernel.run(torch.tensor(ids[7:]), torch.arange(7, 7 + tokens), torch.tensor([blocks] * tokens), tiled=False)
    # Another summation order: most rows agree to float rounding; where a sum lands on the other side
    # of an int8 rounding step, the next layer's activation moves by one step (up to ~2e-2 here), and
    # later rows, attending to that K/V, move with it.
    row_diff = (together - per_row).abs().amax(dim=1)
    assert torch.equal(together.argmax(dim=1), per_row.argmax(dim=1))
    assert row_diff.median() < 1e-4 and row_diff.max() < 0.05, row_diff
    assert not torch.equal(together[:, 0], together[:, 1])  # the rows are real logits, not a constant


def test_a_long_tiled_step_after_a_cached_prefix(native_llm, hf_fp32):
    """SmolLM2 (Q4_1 with a Q8_0 head): a 300-token prefix written by one native step, then a
    37-token question (two 16-row attention groups and a short one, over two K/V chunks) as one
    step: every row the logits of its token as a one-token step; the last one float32's top token."""
    kernel = native_llm.core.runner.native
    text = " ".join(f"Rule {i}: employees file form {i * 7} before day {i + 3}." for i in range(20))
    ids = prompt_ids(native_llm, text + " Which form comes before day 10? Answer with the form number only, please.")
    blocks = list(range(60, 85))
    prefix, question = ids[:300], ids[300:]
    assert len(question) >= 33 and len(question) % 8 and len(ids) <= 16 * len(blocks)
    kernel.run(torch.tensor(prefix), torch.arange(300), torch.tensor([blocks] * 300))
    together, alone = one_call_and_one_by_one(kernel, question, 300, blocks)
    torch.testing.assert_close(together, alone)
    with torch.inference_mode():
        ref = hf_fp32(torch.tensor([ids])).logits[0, -1].float()
    assert together[-1].argmax() == ref.argmax()
    assert kl_from_float32(ref, together[-1]) < 0.05


@pytest.fixture(scope="module")
def qwen_int4(qwen_0_5b_gguf) -> LoadedModel:
    return LoadedModel.load(EngineConfig(model=str(qwen_0_5b_gguf), quantization="int4"))


def test_qwen2_k_quants_decode_natively_with_the_dense_tokens(qwen_int4, qwen_fp32, qwen_0_5b_gguf):
    """Qwen2.5-Coder-0.5B Q4_K_M (Q5_0 and Q4_K repacked exactly, Q6_K requantized, float32
    q|k|v biases) on the int4 path, decoding natively and through PyTorch's int4 kernel: the
    greedy tokens of the dense float32 path."""
    path = str(qwen_0_5b_gguf)
    params = SamplingParams(temperature=0, max_tokens=16)
    native = LLM(path, quantization="int4", native_decode_step="on", max_model_len=256, num_kv_blocks=32, loaded=qwen_int4)
    prompts = [prompt_ids(native, q) for q in ("What is the capital of France? Answer in one word.",
                                                 "Write a Python function that adds two numbers.")]
    native.core.step_times.native_steps = 0
    ours = [o.token_ids for o in native.generate(prompts, params)]
    assert native.core.step_times.native_steps >= 15
    torch_int4 = [o.token_ids for o in LLM(path, quantization="int4", native_decode_step="off", max_model_len=256,
                                           num_kv_blocks=32, loaded=qwen_int4).generate(prompts, params)]
    dense = [o.token_ids for o in LLM(path, max_model_len=256, num_kv_blocks=32, loaded=qwen_fp32).generate(prompts, params)]
    assert len(dense[1]) == 16 and ours == dense and torch_int4 == dense


def test_the_native_limit_for_prefill_steps_follows_the_cpus_bf16_matmuls():
    """Questions of more than 16 tokens take the dense bf16 path where bf16 matmuls are in hardware
    (faster there from ~16 tokens); elsewhere the native step takes up to 64."""
    assert native_max_tokens(frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})) == NATIVE_MAX_TOKENS_BF16 == 16
    assert native_max_tokens(frozenset({"amx_bf16"})) == 16
    assert native_max_tokens(frozenset({"avx512f", "avx512_vnni"})) == NATIVE_MAX_TOKENS == 64
    assert native_max_tokens(None) == 16  # unknown flags: as the int4 model, which then prefers dense bf16 above 8 rows
