"""One-off (2026-12-06): down_proj's pairs GEMV in the 8B's batch-1 decode graph, random weights,
int4 layers and an int4 head. Two changes A/B'd in one process, the batch-1 graph recaptured per
variant (``engine.bench.latency.with_batch1_graph``), three rounds interleaved, greedy tokens
checked equal to the first variant's: SwiGLU inside down_proj's GEMV (the default,
``GemvPolicy.pairs_swiglu_in_down``) or as its own kernel after gate|up; and down_proj's tile
(alone, with PDL: 16 rows x 64 words, 2 warps, split 4 read at 16.6-17.0 us and 8 rows x 128
words, 2 warps, split 2 at 17.0-17.3, against the default 16 x 128, 4 warps, split 2 at 17.5-18.7;
H100, engine/bench/experiments/int4_pairs_gemv_sweep.py), patched into ``pairs_tile`` and
``pairs_split_k`` for the 8B's down_proj shape only.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_pairs_down_ab.py``.
"""
import random
from dataclasses import replace

import torch

import engine.kernels.int4_pairs_gemv as pairs_gemv
import engine.model.llama as llama
from engine import EngineConfig, build_engine
from engine.bench.ceilings import copy_bandwidth, decode_step_bytes
from engine.bench.latency import with_batch1_graph
from engine.bench.workload import random_prompt, run_to_completion
from engine.kernels.int4_pairs_gemv import PairsTile
from engine.sampling import SamplingParams

config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", quantization="int4", lm_head_quantization="int4",
                      gpu_memory_utilization=0.5, max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
prompt = random_prompt(random.Random(0), 512, core.model_config.vocab_size)
ceiling = copy_bandwidth(core.device) / decode_step_bytes(core, 512 + 64)
print(torch.cuda.get_device_name(), "path:", core.runner.gemv, f"\nceiling {ceiling:.1f} tok/s", flush=True)
DOWN_K = 14336  # the 8B's intermediate size: down_proj's K
default_tile, default_split = pairs_gemv.pairs_tile, llama.pairs_split_k


def decode(n):
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.tpot, list(req.output_token_ids)


def down_tile(tile, split):
    """Patch the tile and split of the down_proj shape (K 14336) only."""
    pairs_gemv.pairs_tile = lambda k, group, split_k=1: tile if k == DOWN_K else default_tile(k, group, split_k)
    llama.pairs_split_k = lambda n, k, group: split if k == DOWN_K else default_split(n, k, group)


variants = {  # name: (SwiGLU in down_proj's GEMV, down tile, its split or None for the defaults)
    "default (SwiGLU in down's GEMV)": (True, None, None),
    "SwiGLU kernel after gate|up": (False, None, None),
    "down 16 x 64 words, 2 warps, split 4": (True, PairsTile(16, 64, 2, 3), 4),
    "down 8 x 128 words, 2 warps, split 2": (True, PairsTile(8, 128, 2, 3), 2),
    "SwiGLU after, down 16 x 64, 2 warps, split 4": (False, PairsTile(16, 64, 2, 3), 4),
}
decode(8)
first = None
for rnd in range(3):
    for name, (in_down, tile, split) in variants.items():
        if tile:
            down_tile(tile, split)
        try:
            (tpot, tokens), ms = with_batch1_graph(core, replace(core.runner.gemv, pairs_swiglu_in_down=in_down), lambda: decode(128))
        finally:
            pairs_gemv.pairs_tile, llama.pairs_split_k = default_tile, default_split
        torch.cuda.synchronize()
        first = first or tokens
        same = "same tokens" if tokens == first else "TOKENS DIFFER"
        print(f"round {rnd} {name:46s} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.1f} tok/s, {1 / tpot / ceiling:.3f} of ceiling), "
              f"replay {ms:.4f} ms, {same}", flush=True)
