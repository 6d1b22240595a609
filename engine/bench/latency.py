"""The latency suite: batch-1 decode against the bandwidth ceiling, with async scheduling off, with
each part of the decode path changed (CUDA), and against HF ``generate()``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TypeVar

import torch

from engine.bench.ceilings import decode_step_bytes
from engine.bench.report import Row
from engine.bench.timing import replay_ms, timed
from engine.bench.workload import Sizes, engine_decode, random_prompt
from engine.engine_core import EngineCore
from engine.fp8 import Fp8Linear
from engine.kernels.gemv_policy import FP8_MATHS, INT4_KERNELS, PROJECTIONS, GemvPolicy
from engine.w4a16 import W4A16Linear

T = TypeVar("T")


def bench_latency(core: EngineCore, hf: torch.nn.Module | None, sizes: Sizes, rng: random.Random, bw: float,
                  results: dict) -> list[Row]:
    """Batch-1 decode speed against the bandwidth ceiling, async scheduling off, each decode-path variant (CUDA) and HF."""
    prompt = random_prompt(rng, sizes.decode_prompt, core.model_config.vocab_size)
    engine_decode(core, prompt, 4)  # warm-up
    core.block_manager.reset_prefix_cache()
    ttft, tpot = engine_decode(core, prompt, sizes.decode_tokens)
    ceiling = bw / decode_step_bytes(core, sizes.decode_prompt + sizes.decode_tokens // 2)
    rows = [Row(f"decode batch 1 (prompt {sizes.decode_prompt})", 1 / tpot, "tok/s", "bandwidth ceiling (bytes/step / copy bw)", ceiling)]
    results.update(decode_bs1_tok_s=1 / tpot, decode_bs1_roofline_frac=(1 / tpot) / ceiling, decode_bs1_ceiling_tok_s=ceiling)
    graphs = core.runner.graphs
    if graphs is not None and graphs.bucket(1) == 1:
        # The device alone: replay the batch-1 graph back to back (last request's buffers).
        gpu_ms = replay_ms(graphs.graphs[1])
        rows.append(Row("decode batch 1: device time per step (graph replay)", gpu_ms, "ms", "engine time per token (tpot)", tpot * 1e3, False))
        results.update(decode_bs1_graph_ms=gpu_ms, decode_bs1_tpot_ms=tpot * 1e3)
        if core.runner.gemv.max_rows:
            rows += decode_path_ab(core, prompt, sizes, tpot, gpu_ms, results)
    if core.async_scheduling:  # what async scheduling buys: the same decode with it off
        core.async_scheduling = False
        core.block_manager.reset_prefix_cache()
        _, tpot_sync = engine_decode(core, prompt, sizes.decode_tokens)
        core.async_scheduling = True
        rows.append(Row("decode batch 1, async scheduling", 1 / tpot, "tok/s", "same, async scheduling off", 1 / tpot_sync))
        results.update(decode_bs1_sync_tok_s=1 / tpot_sync)
    if hf is not None:
        # HF's best: on a CPU float32 can beat bf16 (no AMX path for its small matmuls), so both run.
        dtype = next(hf.parameters()).dtype
        by_dtype = {str(dtype).removeprefix("torch."): 1 / hf_decode(hf, prompt, sizes.decode_tokens, core.device)[1]}
        if core.device.type == "cpu" and dtype != torch.float32:
            hf.float()
            by_dtype["float32"] = 1 / hf_decode(hf, prompt, sizes.decode_tokens, core.device)[1]
            hf.to(dtype)
        best = max(by_dtype, key=by_dtype.get)
        rows.append(Row("decode batch 1 vs HF generate()", 1 / tpot, "tok/s", f"HF generate() same model ({best}, best of {'/'.join(by_dtype)})", by_dtype[best]))
        results.update(hf_decode_bs1_tok_s=by_dtype[best], hf_decode_bs1_tok_s_by_dtype=by_dtype)
    return rows


def hf_decode(hf: torch.nn.Module, prompt: list[int], tokens: int, device: torch.device) -> tuple[float, float]:
    x = torch.tensor([prompt], device=device)
    gen = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(x, max_new_tokens=2, min_new_tokens=2, **gen)  # warm-up
        t1 = timed(lambda: hf.generate(x, max_new_tokens=1, min_new_tokens=1, **gen), device, 2)
        tn = timed(lambda: hf.generate(x, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, **gen), device, 1)
    return t1, (tn - t1) / tokens


def decode_path_variants(path: GemvPolicy, fp8: bool = False, int4: bool = False) -> dict[str, GemvPolicy]:
    """What each part of the batch-1 decode path buys: the path with one part changed (``fp8``:
    the model has FP8 weights, so also how the GEMV multiplies them and its tiles' K; ``int4``: it
    has int4 weights, so the other int4 kernel, PDL, the L2 prefetch and (pairs GEMV) where each
    GEMV lets the next kernel launch, and none of the bf16 GEMV's tiling choices, which do not
    reach an int4 projection)."""
    variants = {"cuBLAS projections, separate SwiGLU": replace(path, max_rows=0)}
    if int4:
        for kernel in sorted(set(INT4_KERNELS) - {path.int4_kernel}):
            variants[f"same, int4 kernel {kernel}"] = replace(path, int4_kernel=kernel)
        if path.pdl:
            variants["same, PDL off"] = replace(path, pdl=False)
            variants["same, L2 prefetch 0 MiB a weight"] = replace(path, prefetch_bytes=0)
            if path.int4_kernel == "pairs":  # the pairs GEMV releases the next kernel after its wait or after its K loop
                for late in sorted({(), ("gate_up",), ("gate_up", "down"), ("qkv", "o", "gate_up", "down")} - {path.late_release}):
                    variants[f"same, late PDL release: {'+'.join(late) or 'none'}"] = replace(path, late_release=late)
        return variants
    if fp8:
        for math in sorted(set(FP8_MATHS) - {path.fp8_math}):
            variants[f"same, FP8 GEMV math {math}"] = replace(path, fp8_math=math)
        for block_k in sorted({0, 256} - {path.fp8_block_k}):
            variants[f"same, FP8 tiles of K {block_k or 'as bf16'}"] = replace(path, fp8_block_k=block_k)
        for split in sorted({1, 2} - {path.fp8_down_split_k}):
            variants[f"same, FP8 down_proj split-K {split}"] = replace(path, fp8_down_split_k=split)
        for math, block_k in (("fp16", 256), ("fp8", 256)):
            if (math, block_k) != (path.fp8_math, path.fp8_block_k):
                variants[f"same, FP8 GEMV math {math}, tiles of K {block_k}"] = replace(path, fp8_math=math, fp8_block_k=block_k)
    if path.pdl:
        variants["same, PDL off"] = replace(path, pdl=False)
        for late in sorted({(), *((name,) for name in PROJECTIONS), ("o", "gate_up"), PROJECTIONS} - {path.late_release}):
            variants[f"same, late PDL release: {'+'.join(late) or 'none'}"] = replace(path, late_release=late)
        for mib in sorted({0, 1, 4, 16, 64} - {path.prefetch_bytes >> 20}):
            variants[f"same, L2 prefetch {mib} MiB a weight"] = replace(path, prefetch_bytes=mib << 20)
    for tiles in sorted({(), ("qkv",), ("o",), ("qkv", "o")} - {path.sum_tiles}):
        variants[f"same, CUDA-core GEMV for: {'+'.join(tiles) or 'none'}"] = replace(path, sum_tiles=tiles)
    if path.fused_swiglu:
        variants["same, SwiGLU as its own kernel"] = replace(path, fused_swiglu=False)
    down = "on cuBLAS" if path.gemv_down else f"as a GEMV too (split-K {path.down_split_k})"
    variants[f"same, down_proj {down}"] = replace(path, gemv_down=not path.gemv_down)
    for split in sorted({1, 2, 4} - {path.o_split_k}):
        variants[f"same, o_proj split-K {split}"] = replace(path, o_split_k=split)
    if path.gemv_down:
        for split in sorted({1, 2, 4} - {path.down_split_k}):
            variants[f"same, down_proj split-K {split}"] = replace(path, down_split_k=split)
    return variants


def with_batch1_graph(core: EngineCore, gemv: GemvPolicy, run: Callable[[], T]) -> tuple[T, float]:
    """``run()`` with the batch-1 CUDA graph captured again under ``gemv`` (the prefix cache
    emptied first, so a prompt is computed again), and that graph's replay milliseconds after it,
    with the context ``run`` left; the engine's own graphs are put back. For A/Bs of the decode
    path in one process (kernel tiles patched by the caller are captured too)."""
    from engine.cuda_graph import CudaGraphRunner

    runner, graphs = core.runner, core.runner.graphs
    other = CudaGraphRunner(core.model, runner.backend, runner.kv_layers, [1], graphs.block_tables.shape[1], len(graphs.tokens),
                            core.device, gemv)
    try:
        runner.graphs = other
        core.block_manager.reset_prefix_cache()
        result = run()
        return result, replay_ms(other.graphs[1])
    finally:
        runner.graphs = graphs


def decode_path_ab(core: EngineCore, prompt: list[int], sizes: Sizes, tpot: float, gpu_ms: float, results: dict) -> list[Row]:
    """The batch-1 graph captured again for each variant of the decode path (GemvPolicy): its
    replay time and the engine's decode speed with it, against the configured path."""
    path = core.runner.gemv
    rows, by_variant = [], {}
    fp8 = any(isinstance(m, Fp8Linear) for m in core.model.modules())
    int4 = any(isinstance(m, W4A16Linear) for m in core.model.modules())
    for name, variant in decode_path_variants(path, fp8, int4).items():
        (_, other_tpot), other_ms = with_batch1_graph(core, variant, lambda: engine_decode(core, prompt, sizes.decode_tokens))
        by_variant[name] = {"tok_s": 1 / other_tpot, "graph_ms": other_ms}
        rows += [Row(f"decode batch 1 ({path_name(path, fp8, int4)})", 1 / tpot, "tok/s", name, 1 / other_tpot),
                 Row("  graph replay", gpu_ms, "ms", name, other_ms, False)]
    results.update(decode_bs1_path=asdict(path), decode_bs1_variants=by_variant)
    return rows


def path_name(path: GemvPolicy, fp8: bool = False, int4: bool = False) -> str:
    """A short name of the decode path's parts, for the A/B rows (the FP8 and int4 choices only
    for a model with such weights; an int4 model runs SwiGLU after gate|up, and its o_proj and
    down_proj split K by their shape, not by the bf16 GEMV's numbers)."""
    if not path.max_rows:
        return "cuBLAS"
    fp8_math = f"FP8 math {path.fp8_math}" + (f" K {path.fp8_block_k}" if path.fp8_block_k else "")
    down_split = path.fp8_down_split_k if fp8 else path.down_split_k
    swiglu = ("SwiGLU after gate|up" if int4 else "SwiGLU in gate|up") if path.fused_swiglu else ""
    parts = ["GEMVs", f"int4 {path.int4_kernel}" if int4 else "", swiglu,
             fp8_math if fp8 else "", f"o_proj split-K {path.o_split_k}" if path.o_split_k > 1 and not int4 else "",
             f"down GEMV split-K {down_split}" if path.gemv_down and not int4 else "",
             "PDL" if path.pdl else "", f"L2 prefetch {path.prefetch_bytes >> 20} MiB" if path.pdl and path.prefetch_bytes else "",
             " ".join(f"{name} {size / (1 << 20):g} MiB" for name, size in path.prefetch_by_projection) if path.pdl else "",
             f"late release {'+'.join(path.late_release)}" if path.pdl and path.late_release else ""]
    return ", ".join(p for p in parts if p)
