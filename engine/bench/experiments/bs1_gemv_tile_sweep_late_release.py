"""One-off (2026-11-30, H200): the batch-1 GEMV tiles again now that o_proj and gate|up release the
next kernel late (GemvPolicy.late_release): the batch-1 graph recaptured per variant in one
process (``engine.kernels.linear.decode_tile`` patched for one weight shape), engine tpot and graph
replay, two rounds. Results: docs/results/2026-11-30-h200-bs1-gemv-tile-sweep-late-release.txt.
Run from the repository root:
``PYTHONPATH=$PWD python engine/bench/experiments/bs1_gemv_tile_sweep_late_release.py``.
"""
import random

import torch

import engine.kernels.linear as linear
from engine import EngineConfig, build_engine
from engine.bench.timing import replay_ms
from engine.bench.workload import engine_decode, random_prompt
from engine.cuda_graph import CudaGraphRunner
from engine.kernels.linear import GemvConfig

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
VARIANTS = [("base", None, None),  # first sweep (results ...-sweep-late-release.txt): o, qkv, gate_up, down, lm_head tiles
            ("qkv", "qkv", GemvConfig("dot", 64, 128, 4, 6)), ("qkv", "qkv", GemvConfig("dot", 64, 128, 4, 7)),
            ("qkv", "qkv", GemvConfig("dot", 64, 128, 4, 8)), ("qkv", "qkv", GemvConfig("dot", 64, 64, 4, 10)),
            ("qkv", "qkv", GemvConfig("dot", 64, 256, 4, 5)), ("qkv", "qkv", GemvConfig("dot", 64, 128, 8, 6)),
            ("o", "o", GemvConfig("dot", 32, 256, 4, 6)), ("o", "o", GemvConfig("dot", 32, 128, 4, 8)),
            ("gate_up", "gate_up", GemvConfig("dot", 128, 128, 8, 3)), ("gate_up", "gate_up", GemvConfig("dot", 128, 64, 4, 6))]

config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", gpu_memory_utilization=0.5,
                      max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
print("path:", core.runner.gemv)
rng = random.Random(0)
prompt = random_prompt(rng, 512, core.model_config.vocab_size)
engine_decode(core, prompt, 8)
runner, graphs = core.runner, core.runner.graphs
chosen = linear.decode_tile
for rnd in range(2):
    for label, which, tile in VARIANTS:
        linear.decode_tile = chosen if tile is None else (lambda n, k, tile=tile, shape=SHAPES[which]: tile if (n, k) == shape else chosen(n, k))
        try:
            other = CudaGraphRunner(core.model, runner.backend, runner.kv_layers, [1], graphs.block_tables.shape[1], len(graphs.tokens), core.device, runner.gemv)
            runner.graphs = other
            core.block_manager.reset_prefix_cache()
            _, tpot = engine_decode(core, prompt, 128)
            ms = replay_ms(other.graphs[1])
        except Exception as e:  # a tile that does not fit (shared memory): say so, go on
            print(f"round {rnd} {label} {tile}: failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        finally:
            runner.graphs = graphs
            linear.decode_tile = chosen
        del other
        torch.cuda.synchronize()
        name = "base" if tile is None else f"{label} {tile.block_n}x{tile.block_k} s{tile.num_stages} w{tile.num_warps}"
        print(f"round {rnd} {name:24s} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.2f} tok/s), replay {ms:.4f} ms", flush=True)
