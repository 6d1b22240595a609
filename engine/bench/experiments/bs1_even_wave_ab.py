"""One-off (2026-11-30 ~10:50-11:00 UTC, H200): the batch-1 graph recaptured per variant in one
process (``engine.kernels.linear.decode_tile`` patched per weight shape), greedy tokens compared
with the first variant's, engine tpot and graph replay, two rounds. Results:
docs/results/2026-11-30-h200-bs1-even-wave-ab.txt. As run for its third table; the first two
used other VARIANTS lists (in that file). The "early" switches were kernel flags of the A/B:
the early block-table lookup in decode attention was removed (no gain), the early residual read of
add_rms_norm became the kernel's only behaviour, so on today's code those switches no longer exist.
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/bs1_even_wave_ab.py``.
"""
import random
import sys

import torch

import engine.kernels.linear as linear
from engine import EngineConfig, build_engine
from engine.bench.timing import replay_ms
from engine.bench.workload import random_prompt, run_to_completion
from engine.sampling import SamplingParams
from engine.cuda_graph import CudaGraphRunner
from engine.kernels.linear import GemvConfig

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
G = GemvConfig
QKV48 = {"qkv": G("dot", 64, 128, 4, 7, columns=48)}
DOWN63 = {"down": G("dot", 64, 256, 4, 4, columns=63)}
GU28 = {"gate_up": G("dot", 64, 128, 4, 3, columns=28)}
B = {**QKV48, **GU28}
VARIANTS = [  # (name, tiles, early block table, early residual)
    ("base", {}, False, False),  # the early residual read ("B" = ... + it) is now always on
    ("B", B, False, False),
    ("B + o c16 32x256", {**B, "o": G("dot", 32, 256, 4, 5, columns=16)}, False, False),
    ("B + o 16x256 s5", {**B, "o": G("dot", 16, 256, 4, 5)}, False, False),
    ("B + lm_head c63", {**B, "lm_head": G("dot", 64, 128, 4, 3, columns=63)}, False, False),
    ("B + qkv s8", {**B, "qkv": G("dot", 64, 128, 4, 8, columns=48)}, False, False),
    ("B + gate_up w8", {**B, "gate_up": G("dot", 64, 128, 8, 3, columns=28)}, False, False),
    ("B + gate_up c56 128x128", {**B, "gate_up": G("dot", 128, 128, 4, 3, columns=56)}, False, False),
    ("B + qkv c24 32x128 s7", {**B, "qkv": G("dot", 32, 128, 4, 7, columns=24)}, False, False),
]
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2

config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", gpu_memory_utilization=0.5,
                      max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
print("path:", core.runner.gemv, "SMs:", torch.cuda.get_device_properties(0).multi_processor_count)
rng = random.Random(0)
prompt = random_prompt(rng, 512, core.model_config.vocab_size)


def decode(n):
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    run_to_completion(core)
    return list(req.output_token_ids), req.metrics.tpot


decode(8)
runner, graphs = core.runner, core.runner.graphs
chosen = linear.decode_tile
ref_tokens = None
for rnd in range(ROUNDS):
    for name, tiles, early, early_res in VARIANTS:
        by_shape = {SHAPES[k]: v for k, v in tiles.items()}
        linear.decode_tile = lambda n, k, by_shape=by_shape: by_shape.get((n, k)) or chosen(n, k)
        if early or early_res:
            raise SystemExit("the early_* switches were removed after this A/B (see the docstring)")
        try:
            other = CudaGraphRunner(core.model, runner.backend, runner.kv_layers, [1], graphs.block_tables.shape[1], len(graphs.tokens), core.device, runner.gemv)
            runner.graphs = other
            core.block_manager.reset_prefix_cache()
            tokens, tpot = decode(128)
            ms = replay_ms(other.graphs[1])
        except Exception as e:
            print(f"round {rnd} {name}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        finally:
            runner.graphs = graphs
            linear.decode_tile = chosen
        del other
        torch.cuda.synchronize()
        ref_tokens = ref_tokens or tokens
        same = "same tokens" if tokens == ref_tokens else f"TOKENS DIFFER at {next(i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b)}"
        print(f"round {rnd} {name:26s} {same} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.2f} tok/s), replay {ms:.4f} ms", flush=True)
