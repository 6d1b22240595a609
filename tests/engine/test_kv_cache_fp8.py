"""The FP8 KV cache on the CPU: e4m3 K/V with a float32 scale per (token, KV head) row, written and
read by the torch reference backend; its capacity per budget; the start-up refusal; and an engine
with it decoding like one with a float cache. (The Triton kernels' FP8 paths: test_triton_kernels.py.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_ref import TorchReferenceAttention, paged_attention_reference, write_kv
from engine.config import ConfigError, EngineConfig
from engine.kv_cache import FP8_DTYPE, FP8_MAX, KVCache, KVCacheSpec

PAGE, HKV, HQ, D = 8, 2, 6, 32


def batch(query_lens: list[int], ctx_lens: list[int], num_blocks: int, seed: int) -> AttentionMetadata:
    """Metadata for requests with ``ctx_lens`` cached tokens and ``query_lens`` new ones each, in
    shuffled blocks (block 0 is the null block)."""
    rng = random.Random(seed)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    it = iter(ids)
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    tables = [[next(it) for _ in range(-(-s // PAGE))] for s in seq_lens]
    width = max(len(t) for t in tables)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor([t[p // PAGE] * PAGE + p % PAGE for t, s in zip(tables, seq_lens) for p in range(s)]),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_host=list(query_lens), seq_lens_host=seq_lens,
        num_decodes=sum(1 for q in query_lens if q == 1), max_seq_len=max(seq_lens),
    )


def kv_rows(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K rows with large per-channel biases (Qwen2's K projections have them: a fixed scale of 1
    would clip them in e4m3) and rows of very different sizes; V rows plain."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(D)
    bias[:4] = torch.tensor([900.0, -350.0, 120.0, 40.0])
    k = torch.randn(tokens, HKV, D, generator=g) * torch.rand(tokens, HKV, 1, generator=g) * 4 + bias
    v = torch.randn(tokens, HKV, D, generator=g)
    return k, v


def fp8_cache(num_blocks: int) -> KVCache:
    return KVCache(KVCacheSpec(1, HKV, D, PAGE, FP8_DTYPE), num_blocks, torch.device("cpu"))


def test_write_kv_stores_each_row_in_e4m3_with_its_amax_scale():
    """Written, then read back (values times their row's scale): every element within e4m3's
    rounding of the original - 1/16 of it, or half a subnormal step of its row for tiny ones."""
    cache = fp8_cache(12)
    layer = cache.layer(0)
    assert cache.scales is not None and cache.scales.shape == (1, 2, 12, PAGE, HKV) and cache.scales.dtype == torch.float32
    assert layer.k_scale is not None and layer.k_scale.shape == (12, PAGE, HKV) == layer.v_scale.shape
    assert layer.k.dtype == FP8_DTYPE
    k, v = kv_rows(40, seed=1)
    slots = torch.randperm(11 * PAGE)[:40] + PAGE  # anywhere but the null block
    write_kv(k, v, layer, slots)
    back = layer.dequantized()
    for x, cache_x, scales in ((k, back.k, layer.k_scale), (v, back.v, layer.v_scale)):
        scale = scales.view(-1, HKV)[slots]
        torch.testing.assert_close(scale, x.abs().amax(-1) / FP8_MAX, rtol=1e-6, atol=0)
        got = cache_x.view(-1, HKV, D)[slots]
        assert ((got - x).abs() <= x.abs() / 16 + scale[..., None] * 2**-10).all()
    assert (k - back.k.view(-1, HKV, D)[slots]).abs().max() < 900 / 16  # the biases are not clipped


@pytest.mark.parametrize("query_lens,ctx_lens", [([1, 1, 1], [0, 9, 40]), ([1, 1, 6, 13], [12, 3, 20, 0])])
def test_reference_attention_over_an_fp8_cache_is_close_to_the_float_cache(query_lens, ctx_lens):
    """Decodes and prefill chunks over the same K/V, cached in e4m3 and in float32: the outputs
    differ by e4m3's rounding only (a wrong scale, or scales on the wrong rows, is far off)."""
    seed = random.randrange(1 << 30)
    meta = batch(query_lens, ctx_lens, 24, seed)
    k, v = kv_rows(len(meta.slot_mapping), seed)
    k = k / 100  # the biases would leave a softmax of one key; scaled down, every key counts
    fp8 = fp8_cache(24).layer(0)
    plain = KVCache(KVCacheSpec(1, HKV, D, PAGE, torch.float32), 24, torch.device("cpu")).layer(0)
    write_kv(k, v, fp8, meta.slot_mapping)
    write_kv(k, v, plain, meta.slot_mapping)
    step = AttentionMetadata(  # the step itself: only the last query_lens tokens of each request are queries
        slot_mapping=meta.slot_mapping, query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=meta.seq_lens, block_tables=meta.block_tables, query_lens_host=query_lens, seq_lens_host=meta.seq_lens_host,
        num_decodes=meta.num_decodes, max_seq_len=meta.max_seq_len,
    )
    q = torch.randn(sum(query_lens), HQ, D)
    want = paged_attention_reference(q, plain, step, D**-0.5)
    got = TorchReferenceAttention().attend(q, fp8, step, D**-0.5)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.04, f"seed {seed}: {rel}"
    # and exactly what the float path computes on the cache's own dequantized contents
    torch.testing.assert_close(got, paged_attention_reference(q, fp8.dequantized(), step, D**-0.5), rtol=1e-5, atol=1e-5)


def test_an_fp8_cache_holds_about_twice_the_blocks_of_bf16_in_the_same_budget():
    """Llama-3.1-8B's shape: 128-element rows of 1 byte plus a 4-byte scale against 2 bytes each."""
    budget = 40 << 30
    bf16 = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    fp8 = KVCacheSpec(32, 8, 128, 16, FP8_DTYPE)
    assert fp8.num_blocks_for_budget(budget) >= 1.9 * bf16.num_blocks_for_budget(budget)
    assert fp8.bytes_per_block == 2 * 32 * 16 * 8 * (128 + 4)
    assert fp8.bytes_per_token == 2 * 32 * 8 * (128 + 4) and bf16.bytes_per_token == 2 * 32 * 8 * 128 * 2
    small = KVCacheSpec(2, HKV, D, PAGE, FP8_DTYPE)
    assert KVCache(small, 5, torch.device("cpu")).nbytes == 5 * small.bytes_per_block


def test_fp8_kv_with_the_native_cpu_decode_step_is_refused_at_start_up(llm_gguf_path, smollm_int4):
    """The native step reads the cache as bf16: the engine says so and names the two fixes."""
    from engine import build_engine

    config = EngineConfig(model=str(llm_gguf_path), quantization="int4", kv_cache_dtype="fp8", num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ConfigError, match=r"native CPU decode step.*kv_cache_dtype='auto', native_decode_step='off', or quantization='none'"):
        build_engine(config, smollm_int4)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be"):
        EngineConfig(model=str(llm_gguf_path), kv_cache_dtype="fp16").validate()  # type: ignore[arg-type]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_an_engine_with_an_fp8_kv_cache_decodes_like_one_with_a_float_cache(fixture, request):
    """Greedy tokens of an engine caching K/V in e4m3 (torch backend, the CPU), scored by the
    float-cache engine teacher-forced (one prefill of the prompt and the tokens): each token's
    log-prob close to the float cache's and each token its choice or within the tolerance of it
    (random tiny models have near-ties). Qwen2's K biases are in the cached rows."""
    from engine import LLM, SamplingParams
    from engine.bench.correctness import prompt_logits

    model_dir = str(request.getfixturevalue(fixture))
    prompt = [5, 17, 33, 2, 90, 41, 7, 250, 11, 3, 64, 128, 9]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    fp8 = LLM(model_dir, kv_cache_dtype="fp8", num_kv_blocks=32, block_size=4, attention_backend="torch")
    assert fp8.core.kv_cache.spec.dtype == FP8_DTYPE and "kv_cache (fp8 e4m3 + f32 scales)" in fp8.core.memory.entries
    got = fp8.generate([prompt], params)[0]
    plain = LLM(model_dir, num_kv_blocks=32, block_size=4, attention_backend="torch")
    # the bench's bandwidth ceiling counts the K/V a step reads as stored: e4m3 and its scales
    from engine.bench.ceilings import decode_step_bytes

    read = {name: decode_step_bytes(llm.core, 100) - decode_step_bytes(llm.core, 0) for name, llm in (("fp8", fp8), ("plain", plain))}
    assert read["fp8"] == 100 * fp8.core.kv_cache.spec.bytes_per_token < read["plain"] == 100 * plain.core.kv_cache.spec.bytes_per_token
    dense = torch.log_softmax(prompt_logits(plain.core, prompt + got.token_ids[:-1]).float(), dim=-1)
    tol = 0.05
    for i, (token, logprobs) in enumerate(zip(got.token_ids, got.logprobs)):
        row = dense[len(prompt) - 1 + i]
        assert logprobs[token] == pytest.approx(row[token].item(), abs=tol), i
        assert (row.max() - row[token]).item() <= tol, i


def test_the_fp8_cache_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """The interpreter runs the kernels as Python and never lowers them: here the RoPE + write,
    decode (RoPE and the write fused, a short slice's K/V loaded early; also for a verifying step's
    rows, up to 9 of one request) and prefill kernels with FP8=True compile for sm_90 through
    ptxas (Triton's own, no GPU needed), their e4m3 conversions included; the reads widen e4m3 to
    float16 two values an instruction and multiply in float16 (no per-value float16 -> bf16 step),
    and V reaches its dot in float16, not one shared-memory byte a load; V's loaded 32-bit
    registers go to the widening whole (four values a PTX block), so no byte of it is split off and
    paired again to be widened."""
    import inspect
    import re

    from engine.attention import _triton_kernels as kernels
    from engine.bench.kernels import compile_as_launched

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled now, not found in a cache
    source = Path(inspect.getsourcefile(kernels)).read_text()
    v_dot_lines = {i for i, line in enumerate(source.splitlines(), 1) if "_widen_e4m3(v)" in line}
    body, first = inspect.getsourcelines(kernels._widen_e4m3.fn)
    widen_lines = set(range(first, first + len(body)))  # the widening function's own lines

    def lines_of(ptx: str, opcodes: tuple[str, ...], anywhere: bool = False) -> set[int]:
        """Source lines of _triton_kernels.py that PTX instructions of ``opcodes`` come from
        (``anywhere``: also inside one-line inline-asm blocks)."""
        file_no = re.search(r'\.file\s+(\d+)\s+"[^"]*_triton_kernels\.py"', ptx).group(1)
        lines, here = set(), None
        for row in ptx.splitlines():
            loc = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", row)
            if loc:
                here = int(loc.group(2)) if loc.group(1) == file_no else None
            elif here is not None and re.match(r"\s*(@%p\d+ )?" + (".*" if anywhere else "") + "("
                                               + "|".join(re.escape(o) for o in opcodes) + ")", row):
                lines.add(here)
        return lines

    def byte_load_lines(ptx: str) -> set[int]:
        return lines_of(ptx, ("ld.shared.b8",))

    cache = {"K_CACHE": "*fp8e4nv", "V_CACHE": "*fp8e4nv", "K_SCALE": "*fp32", "V_SCALE": "*fp32", "scale": "fp32"}
    cases = [
        (kernels.rope_store_kernel, {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "POS": "*i64", "COS_SIN": "*fp32", "SLOT": "*i64"},
         {"HQ": 32, "HKV": 8, "HALF": 64, "HQ_PAD": 32, "HKV_PAD": 8, "HALF_PAD": 64, "USE_PDL": False}),
        (kernels.split_kv_decode_attention,
         {"Q": "*bf16", "BLOCK_TABLES": "*i32", "SEQ_LENS": "*i32", "OUT": "*bf16", "O_PART": "*fp32", "LSE_PART": "*fp32",
          "K_NEW": "*bf16", "V_NEW": "*bf16", "POS": "*i64", "COS_SIN": "*fp32", "SLOT": "*i64"},
         {"GROUP": 4, "GROUP_PAD": 16, "D": 128, "D_PAD": 128, "PAGE": 16, "TILE_N": 64, "USE_PDL": False, "FUSED_ROPE": True,
          "HALF": 64, "SMALL_TILE": 32, "KV_PRELOAD": True}),
        (kernels.prefill_kernel,
         {"Q": "*bf16", "BLOCK_TABLES": "*i32", "SEQ_LENS": "*i32", "QUERY_START": "*i32", "TILE_REQ": "*i32", "TILE_START": "*i32",
          "OUT": "*bf16", "O_PART": "*fp32", "LSE_PART": "*fp32"},
         {"GROUP": 4, "D": 128, "D_PAD": 128, "PAGE": 16, "BLOCK_M": 128, "BLOCK_N": 128}),
    ]
    decode = cases[1]
    cases.append((decode[0], decode[1], {**decode[2], "ROW_GROUP": 9}))  # a verifying step's rows: up to 9 of one request
    for fn, pointers, constexprs in cases:
        compiled = compile_as_launched(fn, {**cache, **pointers}, {**constexprs, "FP8": True}, num_warps=4)
        ptx = compiled.asm["ptx"]
        assert "e4m3" in ptx and compiled.asm["cubin"], fn.fn.__name__
        if fn is not kernels.rope_store_kernel:  # the reads: e4m3 pairwise to float16, the dots in float16, no bf16 widening
            assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx, fn.fn.__name__
            assert re.search(r"mma[\w.]*\.f16\.f16", ptx) and not re.search(r"mma[\w.]*\.bf16\.bf16", ptx), fn.fn.__name__
            # V widened before its dot (_widen_e4m3): no byte-wide shared-memory loads at the dot
            assert v_dot_lines and not v_dot_lines & byte_load_lines(ptx), fn.fn.__name__
            # V's loaded 32-bit registers go to the widening whole: no byte split off and paired again
            assert widen_lines & lines_of(ptx, ("cvt.rn.f16x2.e4m3x2",), anywhere=True), f"{fn.fn.__name__}: V not widened by _widen_e4m3"
            assert not widen_lines & lines_of(ptx, ("shl.b16", "or.b16", "prmt.b32", "cvt.u16.u32")), \
                f"{fn.fn.__name__}: V widened from single bytes"
