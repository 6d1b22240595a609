"""One-off (2026-12-06): what is left of an int4 batch-1 step outside the projections' bytes, in
the 8B's decode graph (random weights, int4 layers and an int4 head, pairs GEMV). Between the
GEMVs DRAM idles while short latency-bound kernels run (attention, its combine, the norms); each
GEMV asks L2 for only 1 MiB of its weight before its PDL wait. Variants, one part changed each:
a larger L2 prefetch (all GEMVs, or o_proj alone, whose window is attention's combine), fewer
context splits for batch-1 attention (32 at 8 KV heads today, half of them idle at a
517-token context; ``engine.attention.triton_paged.decode_splits`` patched), and PDL off.
The batch-1 graph recaptured per variant (``engine.bench.latency.with_batch1_graph``), three rounds
interleaved, greedy tokens checked equal to the first variant's.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_bs1_rest_ab.py [ROUNDS]``.
"""
import random
import sys
from dataclasses import replace

import torch

import engine.attention.triton_paged as paged
from engine import EngineConfig, build_engine
from engine.bench.ceilings import copy_bandwidth, decode_step_bytes
from engine.bench.latency import with_batch1_graph
from engine.bench.workload import random_prompt, run_to_completion
from engine.sampling import SamplingParams

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", quantization="int4", lm_head_quantization="int4",
                      gpu_memory_utilization=0.5, max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
prompt = random_prompt(random.Random(0), 512, core.model_config.vocab_size)
ceiling = copy_bandwidth(core.device) / decode_step_bytes(core, 512 + 64)
path = core.runner.gemv
print(torch.cuda.get_device_name(), "path:", path, f"\nceiling {ceiling:.1f} tok/s", flush=True)
default_splits = paged.decode_splits
MIB = 1 << 20


def decode(n):
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.tpot, list(req.output_token_ids)


variants = {  # name: (policy, batch-1 attention splits or None for the default)
    "default": (path, None),
    "L2 prefetch 2 MiB a weight": (replace(path, prefetch_bytes=2 * MIB), None),
    "L2 prefetch 4 MiB a weight": (replace(path, prefetch_bytes=4 * MIB), None),
    "o_proj prefetch 4 MiB": (replace(path, prefetch_by_projection=(("o", 4 * MIB),)), None),
    "o_proj prefetch 9 MiB (all of it)": (replace(path, prefetch_by_projection=(("o", 9 * MIB),)), None),
    "attention 16 splits": (path, 16),
    "attention 8 splits": (path, 8),
    "PDL off": (replace(path, pdl=False), None),
}
decode(8)
first = None
for rnd in range(rounds):
    for name, (policy, splits) in variants.items():
        if splits:
            paged.decode_splits = lambda num_seqs, num_kv_heads, s=splits: s if num_seqs == 1 else default_splits(num_seqs, num_kv_heads)
        try:
            (tpot, tokens), ms = with_batch1_graph(core, policy, lambda: decode(128))
        finally:
            paged.decode_splits = default_splits
        torch.cuda.synchronize()
        first = first or tokens
        same = "same tokens" if tokens == first else "TOKENS DIFFER"
        print(f"round {rnd} {name:36s} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.1f} tok/s, {1 / tpot / ceiling:.3f} of ceiling), "
              f"replay {ms:.4f} ms, {same}", flush=True)
