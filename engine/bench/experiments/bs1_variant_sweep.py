"""One-off (2026-11-30, H200): batch-1 decode per decode-attention variant, the batch-1 graph
recaptured per variant in one process (module constants patched), engine tpot and graph replay.

Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/bs1_variant_sweep.py``.
This is its last form (DECODE_TILE / DECODE_SMALL_TILE); the first form patched
``triton_paged.decode_splits`` for batch 1 (splits 32, 16, 8, 4, 2, 1) the same way.
Results: docs/results/2026-11-30-h200-bs1-ab-step-inputs-tiles.txt.
"""
import random

import torch

import engine.attention.triton_paged as tp
from engine import EngineConfig, build_engine
from engine.bench.timing import replay_ms
from engine.bench.workload import engine_decode, random_prompt
from engine.cuda_graph import CudaGraphRunner

config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", gpu_memory_utilization=0.5,
                      max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
rng = random.Random(0)
prompt = random_prompt(rng, 512, core.model_config.vocab_size)
engine_decode(core, prompt, 8)
runner, graphs = core.runner, core.runner.graphs
rows = []
for rnd in range(2):
    for s in ((64, 64), (32, 32), (64, 32), (64, 16)):
        tp.DECODE_TILE, tp.DECODE_SMALL_TILE = s
        other = CudaGraphRunner(core.model, runner.backend, runner.kv_layers, [1], graphs.block_tables.shape[1], len(graphs.tokens), core.device, runner.gemv)
        runner.graphs = other
        core.block_manager.reset_prefix_cache()
        _, tpot = engine_decode(core, prompt, 128)
        ms = replay_ms(other.graphs[1])
        runner.graphs = graphs
        del other
        torch.cuda.synchronize()
        rows.append((rnd, s, tpot * 1e3, ms))
        print(f"round {rnd} tile/align {s}: tpot {tpot*1e3:.4f} ms ({1/tpot:.2f} tok/s), replay {ms:.4f} ms", flush=True)
