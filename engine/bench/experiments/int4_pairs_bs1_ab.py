"""One-off (2026-12-06): the int4 pairs GEMV's choices in the 8B's batch-1 decode graph, random
weights, int4 layers and an e4m3 head. The latency bench measured the engine with the pairs GEMV
at 427.74 tok/s (graph replay 2.33 ms, H100) before two changes and 400.87 (2.48 ms) after them:
SwiGLU moved into gate|up's epilogue (its words interleaved) and o_proj split 4 ways instead of 2
(each faster in isolation where measured). This A/B recaptures the batch-1 graph per variant in
one process (``engine.bench.latency.with_batch1_graph``), three rounds interleaved, greedy tokens
checked equal to the first variant's: SwiGLU fused or after (gate|up packed again), o_proj split
4 or 2 (``engine.model.llama.pairs_split_k`` patched), and tinygemm for scale.
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_pairs_bs1_ab.py``.
"""
import random
from dataclasses import replace

import torch

import engine.model.llama as llama
from engine import EngineConfig, build_engine
from engine.bench.ceilings import copy_bandwidth, decode_step_bytes
from engine.bench.latency import with_batch1_graph
from engine.bench.workload import random_prompt, run_to_completion
from engine.sampling import SamplingParams

config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", quantization="int4", lm_head_quantization="fp8",
                      gpu_memory_utilization=0.5, max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
prompt = random_prompt(random.Random(0), 512, core.model_config.vocab_size)
ceiling = copy_bandwidth(core.device) / decode_step_bytes(core, 512 + 64)
print(torch.cuda.get_device_name(), "path:", core.runner.gemv, f"\nceiling {ceiling:.1f} tok/s", flush=True)
gate_ups = [layer.mlp.gate_up_proj for layer in core.model.layers]


def decode(n):
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.tpot, list(req.output_token_ids)


def o_split(split):
    default = llama.pairs_split_k
    return lambda n, k, group: split if (n, k) == (4096, 4096) else default(n, k, group)


variants = {  # name: (SwiGLU in gate|up's GEMV, o_proj's split or None for the default, int4 kernel)
    "default (SwiGLU in gate|up, o split 4)": (True, None, "pairs"),
    "o split 2": (True, 2, "pairs"),
    "SwiGLU after gate|up": (False, None, "pairs"),
    "SwiGLU after gate|up, o split 2": (False, 2, "pairs"),
    "tinygemm": (True, None, "tinygemm"),
}
decode(8)
first, default_split = None, llama.pairs_split_k
for rnd in range(3):
    for name, (fused, split, kernel) in variants.items():
        for m in gate_ups:
            if m.pairs_interleaved != fused:
                m.add_pairs(interleave=fused)
        if split:
            llama.pairs_split_k = o_split(split)
        try:
            (tpot, tokens), ms = with_batch1_graph(core, replace(core.runner.gemv, int4_kernel=kernel), lambda: decode(128))
        finally:
            llama.pairs_split_k = default_split
        torch.cuda.synchronize()
        first = first or tokens
        same = "same tokens" if tokens == first else "TOKENS DIFFER"
        print(f"round {rnd} {name:42s} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.1f} tok/s, {1 / tpot / ceiling:.3f} of ceiling), "
              f"replay {ms:.4f} ms, {same}", flush=True)
