"""One-off (2026-12-07): what a device speculation step costs on the GPU, without real weights.

engine/device_speculation.py steps hold k + 1 rows a request and ``verify_and_draft`` (one Triton
kernel) after the argmax. With random weights of a model config and a random prompt the drafts
are rarely accepted, so this measures cost, not gain: the plain engine and an engine with
``speculative_device`` at each k answer the same prompt greedily, and each prints its graph
steps' mean device span (CUDA events), the device's idle time between steps, and decode tokens/s.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python
engine/bench/experiments/device_step_cost.py [--model engine/configs/qwen2.5-coder-1.5b.json]
[--context 2160] [--k 4 8] [--tokens 96]``.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import replace

from engine.bench.experiments.verify_step_anatomy import answer
from engine.bench.report import device_name
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.loaded_model import LoadedModel
from engine.metrics import StepTimes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="engine/configs/qwen2.5-coder-1.5b.json")
    p.add_argument("--context", type=int, default=2160)
    p.add_argument("--k", type=int, nargs="+", default=[4, 8])
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args()
    base = EngineConfig(model=args.model, load_format="dummy", max_model_len=4096, max_num_seqs=1)
    loaded = LoadedModel.load(base)
    base = replace(base, kv_cache_memory_bytes=2 << 30)
    engines = {"plain": build_engine(base, loaded)}
    for k in args.k:
        engines[f"device k={k}"] = build_engine(replace(base, speculative="ngram", speculative_device="on", num_speculative_tokens=k,
                                                        speculative_ngram_sizes=(1, 8)), loaded)
    prompt = [random.Random(0).randrange(100, loaded.model_config.vocab_size - 100) for _ in range(args.context)]
    print(f"# device_step_cost on {device_name(loaded.device)}; {args.model} (random weights), context {args.context}, "
          f"{args.tokens} tokens an answer")
    print(f"{'engine':>12} {'graph steps':>11} {'rows/step':>9} {'device ms/step':>14} {'idle ms/step':>12} {'tok/s':>8} {'accepted':>8}")
    want = None
    for name, core in engines.items():
        answer(core, prompt, 4)  # warm: the prompt cached, every path once
        core.step_times = StepTimes()
        got, rate = answer(core, prompt, args.tokens)
        want = want or got
        t = core.step_times
        seconds, steps = t.device_span.get("graph", [0.0, 1])
        _, host_steps, rows = t.by_mode.get("graph", [0.0, 1, 0])
        print(f"{name:>12} {int(steps):>11} {rows / host_steps:>9.2f} {1e3 * seconds / steps:>14.3f} {1e3 * t.device_idle / max(steps, 1):>12.3f} "
              f"{rate:>8.1f} {core.spec_stats.num_accepted_tokens:>8}  same as plain: {got == want}")


if __name__ == "__main__":
    main()
