"""One-off (2026-12-06): the pairs GEMV's measured tiles (``TUNED_TILES``: each program reads its
slice in one or two steps) against the general rule's, in the 8B's batch-1 decode graph (random
weights, int4 layers and an int4 head), and an o_proj L2 prefetch of 4 MiB on top (0.7% on the
H200 in engine/bench/experiments/int4_bs1_rest_ab.py). The batch-1 graph recaptured per variant
(``engine.bench.latency.with_batch1_graph``), three rounds interleaved, greedy tokens compared
with the first variant's (another split sums in another order, so they may differ). A fourth
variant, added after the first run: the tuned tiles but o_proj in the general rule's 4 slices.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/int4_pairs_tuned_ab.py``.
"""
import random
from dataclasses import replace

import torch

import engine.kernels.int4_pairs_gemv as pairs_gemv
from engine import EngineConfig, build_engine
from engine.bench.ceilings import copy_bandwidth, decode_step_bytes
from engine.bench.latency import with_batch1_graph
from engine.bench.workload import random_prompt, run_to_completion
from engine.sampling import SamplingParams

config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", quantization="int4", lm_head_quantization="int4",
                      gpu_memory_utilization=0.5, max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
prompt = random_prompt(random.Random(0), 512, core.model_config.vocab_size)
ceiling = copy_bandwidth(core.device) / decode_step_bytes(core, 512 + 64)
path = core.runner.gemv
print(torch.cuda.get_device_name(), "path:", path, f"\nceiling {ceiling:.1f} tok/s", flush=True)
tuned = dict(pairs_gemv.TUNED_TILES)


def decode(n):
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.tpot, list(req.output_token_ids)


o_split4 = {shape: entry for shape, entry in tuned.items() if shape != (4096, 4096)}
variants = {  # name: (policy, the tiles)
    "tuned tiles (default)": (path, tuned),
    "the general rule's tiles": (path, {}),
    "tuned tiles, o_proj prefetch 4 MiB": (replace(path, prefetch_by_projection=(("o", 4 << 20),)), tuned),
    "tuned tiles but o_proj split 4": (path, o_split4),
}
decode(8)
first = None
for rnd in range(3):
    for name, (policy, tiles) in variants.items():
        pairs_gemv.TUNED_TILES.clear()
        pairs_gemv.TUNED_TILES.update(tiles)
        try:
            (tpot, tokens), ms = with_batch1_graph(core, policy, lambda: decode(128))
        finally:
            pairs_gemv.TUNED_TILES.update(tuned)
        torch.cuda.synchronize()
        first = first or tokens
        same = "same tokens" if tokens == first else "tokens differ"
        print(f"round {rnd} {name:36s} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.1f} tok/s, {1 / tpot / ceiling:.3f} of ceiling), "
              f"replay {ms:.4f} ms, {same}", flush=True)
