"""Batch-1 engine decode (the latency suite's measure) with two builds of the native step on one
loaded engine, interleaved round by round so the 2-core machine's drift hits both alike; each
round also measures the copy bandwidth, and each build's tok/s is given as a fraction of the
bandwidth ceiling (bytes a step / copy bandwidth), as engine.bench prints it.

Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/native_step_ab.py
MODEL.gguf BASE.c [ROUNDS]`` (BASE.c: the baseline source, e.g. ``git show HEAD~1:engine/kernels/native_decode.c``;
the working tree's source is the other build).
"""
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import engine.native_decode as nd
from engine.bench.ceilings import copy_bandwidth, decode_step_bytes
from engine.bench.workload import Sizes, engine_decode, random_prompt
from engine.config import EngineConfig, default_cache_dir
from engine.engine_builder import build_engine
from engine.loaded_model import LoadedModel

path, base_source, rounds = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2
config = EngineConfig(model=path, quantization="int4", max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=512)
core = build_engine(config, LoadedModel.load(config))
new = core.runner.native.lib
nd.SOURCE = base_source
builds = {"base": nd.build_library(default_cache_dir()), "new": new}
sizes = Sizes.for_device(torch.device("cpu"))
prompt = random_prompt(random.Random(0), sizes.decode_prompt, core.model_config.vocab_size)
step_bytes = decode_step_bytes(core, sizes.decode_prompt + sizes.decode_tokens // 2)
for lib in builds.values():  # warm-up
    core.runner.native.lib = lib
    engine_decode(core, prompt, 4)
results = {name: [] for name in builds}
for r in range(rounds):
    for name in (builds if r % 2 == 0 else reversed(builds)):
        bw = copy_bandwidth(torch.device("cpu"))
        core.runner.native.lib = builds[name]
        core.block_manager.reset_prefix_cache()
        _, tpot = engine_decode(core, prompt, sizes.decode_tokens)
        frac = (1 / tpot) / (bw / step_bytes)
        results[name].append(frac)
        print(f"{time.strftime('%H:%M:%S')} round {r} {name}: {1 / tpot:6.2f} tok/s, copy bw {bw / 1e9:5.2f} GB/s, "
              f"ceiling {bw / step_bytes:5.2f} tok/s, fraction {frac:.3f}", flush=True)
print({name: f"fraction median {statistics.median(f):.3f}" for name, f in results.items()}, f"{step_bytes / 1e6:.0f} MB a step")
