"""One-off (2026-12-06): the 8B shape's FP8 GEMV tiles at batch 1 in the decode graph, random
weights, FP8 layers and an e4m3 head. Nsight Compute on the H100 (same day) showed the q|k|v GEMV
(64 x 512 tiles, 3 stages) with 96 programs, so 36 of 132 SMs idle, and o_proj and down_proj with
128 programs of 4 warps each (6% occupancy): this A/B gives each projection more programs than
SMs (``GemvConfig.columns``: fewer weight rows a program, the tile unchanged, or a narrower tile),
the batch-1 graph recaptured per variant in one process, three rounds interleaved, greedy tokens
checked equal to the first variant's (``engine.bench.latency.with_batch1_graph``;
``engine.model.llama.fp8_decode_tile`` is patched). Its H200 output was made before that helper
was factored out of the bench (same steps).
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/fp8_bs1_tile_ab.py``.
"""
import random

import torch

import engine.model.llama as llama
from engine import EngineConfig, build_engine
from engine.bench.ceilings import copy_bandwidth, decode_step_bytes
from engine.bench.latency import with_batch1_graph
from engine.bench.workload import random_prompt, run_to_completion
from engine.kernels.linear import GemvConfig
from engine.sampling import SamplingParams

config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", quantization="fp8", lm_head_quantization="fp8",
                      gpu_memory_utilization=0.5, max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
prompt = random_prompt(random.Random(0), 512, core.model_config.vocab_size)
ceiling = copy_bandwidth(core.device) / decode_step_bytes(core, 512 + 64)
print(torch.cuda.get_device_name(), "path:", core.runner.gemv, f"\nceiling {ceiling:.1f} tok/s", flush=True)


def decode(n):
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.tpot, list(req.output_token_ids)


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}
variants = {
    "default tiles": {},
    "qkv 64x512 s3, 48 rows a program (128 programs)": {"qkv": GemvConfig("dot", 64, 512, 4, 3, columns=48)},
    "qkv 32x512 s4, 24 rows (256 programs)": {"qkv": GemvConfig("dot", 32, 512, 4, 4, columns=24)},
    "qkv 32x512 s4 (192 programs)": {"qkv": GemvConfig("dot", 32, 512, 4, 4)},
    "o 32x256 s5, 16 rows (256 programs)": {"o": GemvConfig("dot", 32, 256, 4, 5, columns=16)},
    "o 16x512 s6 (256 programs)": {"o": GemvConfig("dot", 16, 512, 4, 6)},
    "down 32x512 s6, 16 rows (256 programs)": {"down": GemvConfig("dot", 32, 512, 4, 6, columns=16)},
    "down 16x512 s6 (256 programs)": {"down": GemvConfig("dot", 16, 512, 4, 6)},
}
default_tile = llama.fp8_decode_tile
decode(8)
first = None
for rnd in range(3):
    for name, tiles in variants.items():
        chosen = {SHAPES[p]: tile for p, tile in tiles.items()}
        llama.fp8_decode_tile = lambda n, k, block_k, chosen=chosen: chosen.get((n, k)) or default_tile(n, k, block_k)
        try:
            (tpot, tokens), ms = with_batch1_graph(core, core.runner.gemv, lambda: decode(128))
        finally:
            llama.fp8_decode_tile = default_tile
        torch.cuda.synchronize()
        first = first or tokens
        same = "same tokens" if tokens == first else "TOKENS DIFFER"
        print(f"round {rnd} {name:50s} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.1f} tok/s, {1 / tpot / ceiling:.3f} of ceiling), "
              f"replay {ms:.4f} ms, {same}", flush=True)
