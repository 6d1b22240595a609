"""One-off (2026-12-02, 2-core AMD EPYC with AVX-512 VNNI): the native step's AVX-512 tile against
the 256-bit tile and the per-row kernel, interleaved round by round so that the shared machine's
drift hits every variant alike; T-token steps at position 0 (matrices and the rest) and after a
cached context of random K/V (the difference is attention).

Run from the repository root: ``OMP_WAIT_POLICY=passive PYTHONPATH=$PWD python
engine/bench/experiments/native_tile_ab.py MODEL.gguf [ROUNDS]``.
Results: docs/results/2026-12-02-cpu-native-tile-ab.txt.
"""
import statistics
import sys
import time

import torch

from engine.config import EngineConfig, default_cache_dir
from engine.loaded_model import LoadedModel
from engine.native_decode import NativeDecodeStep, build_library

PAGE, CONTEXT = 16, 2000
model, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
loaded = LoadedModel.load(EngineConfig(model=model, quantization="int4", native_decode_step="on"))
cfg = loaded.model_config
blocks = (CONTEXT + 32) // PAGE + 2
torch.manual_seed(0)
kv = (torch.randn(cfg.num_hidden_layers, 2, blocks, PAGE, cfg.num_key_value_heads, cfg.head_dim) * 0.5).bfloat16()
wide = NativeDecodeStep(build_library(default_cache_dir()), loaded.model, loaded.native_weights, kv, PAGE)
narrow = NativeDecodeStep(build_library(default_cache_dir(), wide=False), loaded.model, loaded.native_weights, kv, PAGE)
variants = {f"{wide.simd} tile": (wide, True), f"{narrow.simd} 256-bit tile": (narrow, True), "per-row": (narrow, False)}
cases = [(t, c) for t in (1, 30) for c in (0, CONTEXT)]
times: dict = {(name, case): [] for name in variants for case in cases}
print(f"# {model.rsplit('/', 1)[-1]}, {wide.thread_choice.max_threads} threads, {rounds} rounds; ms per step, median (min)", flush=True)
for r in range(rounds):
    for t, c in cases:
        ids, pos = torch.randint(0, 1000, (t,)), torch.arange(c, c + t)
        tables, rows = torch.arange(blocks).expand(t, blocks), torch.tensor([t - 1])
        for name, (kernel, tiled) in variants.items():
            start = time.perf_counter()
            kernel.run(ids, pos, tables, rows if tiled else None, tiled=tiled)
            times[name, (t, c)].append(time.perf_counter() - start)
for t, c in cases:
    cells = [f"{name} {statistics.median(times[name, (t, c)]) * 1e3:7.1f} ({min(times[name, (t, c)]) * 1e3:6.1f})" for name in variants]
    print(f"T={t:<3} after {c:>5} cached: " + " | ".join(cells), flush=True)
