"""One-off (2026-12-07): which kernels make a verifying step's row graph dearer than a one-token step.

On an H100 (2026-12-07 16:31 UTC, random weights of the 1.5B shape, verify_step_anatomy.py), a row
graph step of 2 rows took 0.15 ms more device time than the one-token decode graph step, with RoPE
and the KV write fused into attention or not; each further row added only 0.02-0.04 ms. This
answers with the same random weights and oracle drafts as verify_step_anatomy.py (every draft
accepted), under ``torch.profiler``, and prints each kernel's device microseconds a step for the
plain engine and for each k, so that the kernels which differ stand out. Also printed: each
engine's graph steps and their mean device span from the engine's own CUDA events.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python
engine/bench/experiments/row_graph_profile.py [--model engine/configs/qwen2.5-coder-1.5b.json]
[--context 2160] [--k 1 8] [--tokens 48] [--top 40]``.
"""
from __future__ import annotations

import argparse
import collections
import random
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench.experiments.verify_step_anatomy import OracleProposer, answer
from engine.bench.report import device_name
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.loaded_model import LoadedModel
from engine.metrics import StepTimes


def kernel_us_a_step(core: EngineCore, prompt: list[int], tokens: int) -> tuple[dict[str, float], int, float]:
    """Each kernel's (or copy's) device microseconds a step over one answer, the answer's steps,
    and their mean device span (ms) by the engine's events."""
    answer(core, prompt, 4)  # warm: the prompt's blocks cached, every path once
    core.step_times = StepTimes()
    activities = [ProfilerActivity.CUDA] if core.device.type == "cuda" else [ProfilerActivity.CPU]
    before = core.num_steps
    with profile(activities=activities) as prof:
        answer(core, prompt, tokens)
    steps = core.num_steps - before
    totals: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if core.device.type == "cuda" and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        totals[e.name[:90]] += getattr(e, "device_time", 0.0) or e.cpu_time  # microseconds
    spans = core.step_times.device_span
    seconds = sum(s for s, _ in spans.values())
    return {name: us / steps for name, us in totals.items()}, steps, 1e3 * seconds / steps if spans else 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="engine/configs/qwen2.5-coder-1.5b.json")
    p.add_argument("--context", type=int, default=2160)
    p.add_argument("--k", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--device", action="store_true", help="device speculation steps instead of the host's verifying steps")
    p.add_argument("--pdl", choices=["auto", "off"], default="auto")
    args = p.parse_args()
    base = EngineConfig(model=args.model, load_format="dummy", max_model_len=4096, max_num_seqs=4, pdl=args.pdl)
    loaded = LoadedModel.load(base)
    base = replace(base, kv_cache_memory_bytes=2 << 30)
    plain = build_engine(base, loaded)
    rng = random.Random(0)
    prompt = [rng.randrange(100, loaded.model_config.vocab_size - 100) for _ in range(args.context)]
    want, _ = answer(plain, prompt, args.tokens)
    columns = {"plain": kernel_us_a_step(plain, prompt, args.tokens)}
    for k in args.k:
        spec = replace(base, speculative="ngram", num_speculative_tokens=k, speculative_row_cost=0.0)
        if args.device:
            core = build_engine(replace(spec, speculative_device="on", speculative_ngram_sizes=(1, 8)), loaded)
        else:
            core = build_engine(spec, loaded)
            core.proposer = OracleProposer(len(prompt), want)
        columns[f"k={k}"] = kernel_us_a_step(core, prompt, args.tokens)
    drafts = "device n-gram drafts" if args.device else "oracle drafts"
    print(f"# row_graph_profile on {device_name(loaded.device)}; {args.model} (random weights), context {args.context}, "
          f"{args.tokens} tokens an answer, {drafts}, pdl {args.pdl}")
    print("  ".join(f"{name}: {steps} steps, device span {span:.3f} ms a step" for name, (_, steps, span) in columns.items()))
    names = sorted({n for us, _, _ in columns.values() for n in us}, key=lambda n: -max(c[0].get(n, 0.0) for c in columns.values()))
    print(f"{'us a step':>10} " + " ".join(f"{c:>9}" for c in columns) + "  kernel")
    for name in names[: args.top]:
        print(f"{'':>10} " + " ".join(f"{c[0].get(name, 0.0):>9.2f}" for c in columns.values()) + f"  {name}")
    print(f"{'total':>10} " + " ".join(f"{sum(c[0].values()):>9.2f}" for c in columns.values()))


if __name__ == "__main__":
    main()
