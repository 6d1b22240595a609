"""One-off (2026-11-30 ~11:02 UTC, H200): GemvPolicy.late_release A/B after the even-wave GEMV
grids, the batch-1 graph recaptured per variant in one process, three rounds. Results:
docs/results/2026-11-30-h200-bs1-even-wave-ab.txt. Run from the repository root:
``PYTHONPATH=$PWD python engine/bench/experiments/bs1_late_release_after_even_wave_ab.py``.
"""
import random
from dataclasses import replace

import torch

from engine import EngineConfig, build_engine
from engine.bench.timing import replay_ms
from engine.bench.workload import random_prompt, run_to_completion
from engine.cuda_graph import CudaGraphRunner
from engine.sampling import SamplingParams

config = EngineConfig(model="engine/configs/llama-3.1-8b.json", load_format="dummy", gpu_memory_utilization=0.5,
                      max_num_seqs=8, max_model_len=4096, cuda_graph_batch_sizes=(1, 2, 4, 8))
core = build_engine(config)
path = core.runner.gemv
print("path:", path)
prompt = random_prompt(random.Random(0), 512, core.model_config.vocab_size)


def decode(n):
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    run_to_completion(core)
    return req.metrics.tpot


decode(8)
runner, graphs = core.runner, core.runner.graphs
for rnd in range(3):
    for late in [("o", "gate_up"), ("gate_up",), (), ("o",), ("gate_up", "lm_head")]:
        variant = replace(path, late_release=late)
        try:
            other = CudaGraphRunner(core.model, runner.backend, runner.kv_layers, [1], graphs.block_tables.shape[1], len(graphs.tokens), core.device,
                                    variant)
            runner.graphs = other
            core.block_manager.reset_prefix_cache()
            tpot = decode(128)
            ms = replay_ms(other.graphs[1])
        finally:
            runner.graphs = graphs
        del other
        torch.cuda.synchronize()
        print(f"round {rnd} late {'+'.join(late) or 'none':16s} tpot {tpot * 1e3:.4f} ms ({1 / tpot:.2f} tok/s), replay {ms:.4f} ms", flush=True)
