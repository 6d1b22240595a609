"""One-off (2026-12-06): how much an int4 batch-1 decode step could gain by fusing its small
kernels away, measured as upper bounds before any fusion is written. Each variant removes kernels
from the 8B's batch-1 decode graph (random weights, int4 layers and an int4 head, pairs GEMV)
outright, so its tokens are wrong by design and only its time means anything:
- "no norms": every residual add + RMSNorm returns its input (64 kernels a step). The split-K
  down_proj's float32 partials need that norm to sum them, so these variants run down_proj in one
  slice, against a baseline with one slice and the norms;
- "no SwiGLU": down_proj reads the first half of gate|up's output as it is (32 kernels);
both together. The graph recaptured per variant (``engine.bench.latency.with_batch1_graph``),
rounds interleaved.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_bs1_fusion_bounds.py [ROUNDS]``.
"""
import random
import sys
from contextlib import ExitStack
from unittest import mock

import torch

import engine.model.llama as llama
from engine import EngineConfig, build_engine
from engine.bench.latency import with_batch1_graph
from engine.bench.workload import engine_decode, random_prompt

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", quantization="int4", lm_head_quantization="int4",
                      gpu_memory_utilization=0.5, max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
prompt = random_prompt(random.Random(0), 512, core.model_config.vocab_size)
path = core.runner.gemv
print(torch.cuda.get_device_name(), "path:", path, flush=True)

patches = {
    "one slice": lambda: mock.patch.object(llama, "pairs_split_k", lambda n, k, g: 1),
    "no norms": lambda: mock.patch.object(llama, "add_rms_norm", lambda x, residual, w, eps, pdl=False: (x, residual)),
    "no SwiGLU": lambda: mock.patch.object(llama, "silu_and_mul", lambda y, pdl=False: y[:, : y.shape[1] // 2]),
}
variants = {
    "default (down_proj in slices)": (),
    "down_proj one slice": ("one slice",),
    "down_proj one slice, no norms": ("one slice", "no norms"),
    "default, no SwiGLU": ("no SwiGLU",),
    "down_proj one slice, no norms, no SwiGLU": ("one slice", "no norms", "no SwiGLU"),
}
engine_decode(core, prompt, 8)
for rnd in range(rounds):
    for name, names in variants.items():
        with ExitStack() as stack:
            for p in names:
                stack.enter_context(patches[p]())
            (_, tpot), ms = with_batch1_graph(core, path, lambda: engine_decode(core, prompt, 64))
        torch.cuda.synchronize()
        print(f"round {rnd} {name:44s} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.1f} tok/s), replay {ms:.4f} ms", flush=True)
