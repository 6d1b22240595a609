"""``python -m engine.bench native-prefill --model GGUF``: a prefill chunk of T tokens after a cached
context, through the native CPU step (engine/native_decode.py), tiled against the per-row kernel
(and, on a CPU with AVX-512 VNNI, the two-blocks-a-register tile against the 256-bit one).

The question after a cached handbook prefix is one native step of its T new tokens, each
attending over the ~5,000 cached ones. The cached K/V is random bf16 (speed does not depend on
its values), so no long prefill is needed first. Each step is timed twice: after the context
(the real case) and at position 0 (no context: matrices and the rest), so the difference is the
attention over the context. Against: the per-row kernel (``tiled=False``) in the same run, the
machine's int8 GEMM rate (``torch._int_mm``, oneDNN) over the step's matrix multiply-adds, or its
copy bandwidth over the weight bytes a step reads (once, whatever T), whichever is slower. The tiled
step runs the head over the last row only, as the engine now does for a prefill chunk.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
from pathlib import Path

import torch

from engine.bench.ceilings import copy_bandwidth
from engine.bench.report import Row, format_table
from engine.bench.timing import timed
from engine.config import EngineConfig, default_cache_dir
from engine.loaded_model import LoadedModel
from engine.native_decode import NativeDecodeStep, NativeWeights, build_library

PAGE = 16


def int8_gemm_macs(n: int = 1024) -> float:
    """Multiply-adds per second of torch's int8 GEMM (``torch._int_mm``): the machine's int8 dot rate."""
    a = torch.randint(-127, 128, (n, 1536), dtype=torch.int8)
    b = torch.randint(-127, 128, (1536, 4 * n), dtype=torch.int8)
    return n * 1536 * 4 * n / timed(lambda: torch._int_mm(a, b), torch.device("cpu"), 5)


def step_macs(weights: NativeWeights, tokens: int) -> int:
    """Multiply-adds of a T-token step's block matrices: every layer's for each token, the head's for the last."""
    layers = sum(n * k for layer in weights.layers for n, k in (m.shape for m in (*layer.qkv, layer.o, *layer.gate_up, layer.down)))
    return layers * tokens + weights.head.shape[0] * weights.head.shape[1]


def step_seconds(kernel: NativeDecodeStep, tokens: int, context: int, tiled: bool, repeat: int) -> tuple[float, torch.Tensor]:
    """Median seconds of one T-token step at positions context.., and its last row's logits:
    tiled with the head over that row alone (as the engine runs a prefill chunk), else the
    earlier step: one row per token, the head over every row."""
    width = (context + tokens) // PAGE + 1
    tables = torch.arange(width).expand(tokens, width)  # one request: every row shares its block table
    ids = torch.randint(0, kernel.vocab, (tokens,), generator=torch.Generator().manual_seed(tokens))
    pos = torch.arange(context, context + tokens)
    rows = torch.tensor([tokens - 1]) if tiled else None  # the earlier step ran the head over every row
    out = []
    seconds = timed(lambda: out.append(kernel.run(ids, pos, tables, rows, tiled=tiled)[-1]), torch.device("cpu"), repeat)
    return seconds, out[-1]


def main(argv: list[str]) -> int:
    """Time T-token native steps after a cached context, tiled and per-row, and print the table."""
    p = argparse.ArgumentParser(prog="python -m engine.bench native-prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (e.g. Qwen2.5-Coder-1.5B Q4_K_M, or the embedded SmolLM2)")
    p.add_argument("--context", type=int, default=5000, help="cached tokens before the chunk")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128], help="chunk sizes T")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per figure after one warm-up (the median is shown)")
    args = p.parse_args(argv)

    loaded = LoadedModel.load(EngineConfig(model=args.model, quantization="int4", native_decode_step="on"))
    cfg = loaded.model_config
    blocks = (args.context + max(args.tokens)) // PAGE + 2
    torch.manual_seed(0)
    kv = (torch.randn(cfg.num_hidden_layers, 2, blocks, PAGE, cfg.num_key_value_heads, cfg.head_dim) * 0.5).bfloat16()
    kernel = NativeDecodeStep(build_library(default_cache_dir()), loaded.model, loaded.native_weights, kv, PAGE)
    narrow_lib = build_library(default_cache_dir(), wide=False)  # the 256-bit tile, where the AVX-512 one exists
    narrow = (NativeDecodeStep(narrow_lib, loaded.model, loaded.native_weights, kv, PAGE)
              if narrow_lib.simd_level() != kernel.lib.simd_level() else None)
    int8_rate, bw = int8_gemm_macs(), copy_bandwidth(torch.device("cpu"))
    weight_bytes = kernel.weight_bytes_per_step
    try:
        nice = os.nice(0)
    except OSError:
        nice = "?"
    print(f"# native-prefill on {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {kernel.thread_choice.max_threads} threads, "
          f"nice {nice}, {kernel.simd}; {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}")
    print(f"# model {Path(args.model).name}: {cfg.num_hidden_layers} layers, {step_macs(loaded.native_weights, 1) / 1e9:.2f} G multiply-adds/token, "
          f"{weight_bytes / 1e6:,.0f} MB of weight blocks; cached context {args.context} tokens (random K/V)")
    print(f"# torch._int_mm int8 GEMM {int8_rate / 1e9:,.1f} G multiply-adds/s; copy bandwidth {bw / 1e9:.1f} GB/s", flush=True)
    rows, breakdown = [], []
    for t in args.tokens:
        figures = {}
        for tiled in (False, True):
            for context in (0, args.context):
                print(f"... T={t} {'tiled' if tiled else 'per-row'} context {context}", file=sys.stderr, flush=True)
                figures[tiled, context] = step_seconds(kernel, t, context, tiled, args.repeat)
        new, old = figures[True, args.context], figures[False, args.context]
        if narrow is not None:
            print(f"... T={t} 256-bit tile context {args.context}", file=sys.stderr, flush=True)
            tile256 = step_seconds(narrow, t, args.context, True, args.repeat)
        diff = float((new[1] - old[1]).abs().max())
        # the matrices alone at the int8 GEMM rate or reading the weights once, whichever takes longer
        ceiling = t / max(step_macs(loaded.native_weights, t) / int8_rate, weight_bytes / bw)
        rows.append(Row(f"T={t} after {args.context} cached, tiled", t / new[0], "tok/s", "matrices at int8 GEMM rate / weight read", ceiling))
        rows.append(Row(f"T={t} after {args.context} cached, tiled vs per-row", t / new[0], "tok/s", "per-row kernel, head on every row (baseline)", t / old[0]))
        if narrow is not None:
            rows.append(Row(f"T={t} after {args.context} cached, {kernel.simd} tile vs 256-bit", t / new[0], "tok/s", "256-bit tile (baseline)", t / tile256[0]))
        for tiled in (False, True):
            total, bare = figures[tiled, args.context][0], figures[tiled, 0][0]
            breakdown.append(f"  T={t:<4} {'tiled  ' if tiled else 'per-row'} step {total * 1e3:9.1f} ms = no-context step {bare * 1e3:9.1f} ms "
                             f"(matrices and the rest) + attention over the context {(total - bare) * 1e3:9.1f} ms ({(total - bare) / total:4.0%})")
        breakdown.append(f"  T={t:<4} max |difference| of the last row's logits, tiled vs per-row: {diff:.2e}")
    print(format_table(rows))
    print("\nwhere a step's time went (the step at position 0 vs after the context):")
    print("\n".join(breakdown))
    return 0
